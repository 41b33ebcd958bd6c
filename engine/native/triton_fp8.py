"""Block-FP8 W8A8 GEMM in Triton, for the sizes cuBLAS' blockwise scaled_mm handles badly.

cuBLAS' blockwise kernel is built for large M and wants scale dimensions in multiples
of 4 blocks; at decode sizes it leaves most of HBM bandwidth unused. This kernel has the
same numerics (activations quantized to e4m3 per token and group of 128 by ``quantize_groups``,
the cuBLAS path's own kernel, FP8 x FP8 dot per 128x128 weight block, both scales applied to the
fp32 partial product), streams the weight once, and splits K across programs so every SM has
loads in flight. It consumes the same processed tensors: weight [Np, Kp] (padded to 128),
weight_scale [>=Np/128, >=Kp/128].

Split-K's fp32 planes are added up by a second kernel of many small programs, in a fixed order. Until 2026-12-03 the
last of a tile's programs to arrive (a per-tile counter) summed them inside the GEMM: one launch fewer, but that one
program's reads made the tail; on the H200 the second kernel is faster for qkv / o / down by 2.3 / 1.3 / 2.1 us at
one row and 2.6 / 6.0 / 9.6 us at 64 (bench/gemm_split_k_probe.py, bench/results/gpu_gemm_split_k_probe.json), and
the graphed decode step went 2.87 -> 2.80 ms at batch 1, 4.45 -> 4.01 ms at 64.

At decode sizes the GEMM writes its output and split-K's planes with an L2 evict-last hint: the kernel after it reads
them, and without the hint the weight stream (17-117 MB a GEMM, read once) pushes them out of the L2 first, to HBM.
On the H100 the graphed decode step went 4.76 -> 4.61 ms at batch 64 and 3.433 -> 3.414 at batch 1, the time saved in
the GEMMs themselves (3,006 -> 2,894 us at 64), not in the sum: kept in the L2, the planes are likely overwritten there
by the next GEMM's (the same memory, from the graph's pool) instead of written back while the weights stream in.
Evict-first on the weights, evict-last on the activations and dropping the planes' lines unwritten after the sum
(discard.global.L2) gained nothing more or lost (bench/results/gpu_h100_l2_hints_s42.json).

Each decode-size program asks the L2 for the first bytes of its weight rows before its PDL wait (prefetch_bytes), so
that its first loads need not start from HBM when the kernel ahead of it ends.

The activations are quantized once per GEMM, not by every program that reads them (each of the
N / BLOCK_N programs of a row tile used to quantize the same rows again): on the H200, for
llama3-8b's four layer GEMMs, 79 us against 91 at M = 1, 85 against 96 at 16, and 98 and 105 us
at 32 and 64 rows against cuBLAS' 114 and 115 (bench/gemm_small_m.py,
bench/results/gpu_gemm_small_m.json: its "prequantized" rows are this kernel).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

from engine.native.fused_ops import (
    FP8_MAX,
    GROUP,
    SMALL_ROWS,
    Quantized,
    group_codes,
    pdl_enabled,
    pdl_enter,
    prefetch_l2,
    sm_count,
)

BLOCK_K = 128
MAX_SPLIT = 16  # the most K splits a launch picks: the partial sums' traffic grows with them
MIN_WALK = 8  # the fewest K blocks a split program walks: shorter walks are mostly their pipeline's start and end
PREFETCH_TMA, PREFETCH_LOADS = 256, 128  # prefetch_bytes; 0 switches the prefetch off (benchmarks compare)
SUM_ROWS = 4  # rows of a tile per program of split-K's _sum_planes


@triton.jit
def _fp8_block_gemm(
    xq_ptr, xs_ptr, w_ptr, w_mem_ptr, s_ptr, out_ptr, part_ptr, M, N, stride_xm, stride_xs, stride_wn, stride_sn,
    stride_om, SPLITS: tl.constexpr, K_PER_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SWAP_AB: tl.constexpr, TMA: tl.constexpr, USE_PDL: tl.constexpr, KEEP: tl.constexpr,
    PREFETCH: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_begin = pid_k * K_PER_SPLIT
    if PREFETCH > 0:  # the weight is never written: its first bytes towards the L2 while the kernel ahead runs
        lines = k_begin + tl.arange(0, PREFETCH // 128) * 128
        prefetch_l2(w_mem_ptr + offs_n[:, None] * stride_wn + lines[None, :])
    pdl_enter(USE_PDL)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m[:, None] < M
    if SWAP_AB:  # weight rows as the MMA's M side (wgmma's is 64 rows), the few tokens as its N side
        acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_begin + K_PER_SPLIT, BLOCK_K):
        xq = tl.load(xq_ptr + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :], mask=m_mask, other=0.0)
        x_scale = tl.load(xs_ptr + (k0 // BLOCK_K) * stride_xs + offs_m, mask=offs_m < M, other=0.0)
        if TMA:  # w_ptr is a host-made tensor descriptor of the weight: Hopper's bulk copies
            w = w_ptr.load([pid_n * BLOCK_N, k0])
        else:
            w = tl.load(w_ptr + offs_n[:, None] * stride_wn + (k0 + offs_k)[None, :])
        w_scale = tl.load(s_ptr + (offs_n // 128) * stride_sn + k0 // 128)
        if SWAP_AB:
            acc_t += tl.dot(w, tl.trans(xq)) * w_scale[:, None] * x_scale[None, :]
        else:
            acc += tl.dot(xq, tl.trans(w)) * x_scale[:, None] * w_scale[None, :]
    if SWAP_AB:
        acc = tl.trans(acc_t)
    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    if SPLITS == 1:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask, eviction_policy=KEEP)
    else:  # split-K: each program leaves its fp32 partial in its own plane; _sum_planes adds them up
        offs, plane = _plane_offsets(pid_n, pid_m, tl.arange(0, BLOCK_M), tl.num_programs(0), tl.num_programs(2),
                                     BLOCK_M, BLOCK_N)  # fmt: skip
        tl.store(part_ptr + pid_k * plane + offs, acc, mask=m_mask, eviction_policy=KEEP)


@triton.jit
def _plane_offsets(pid_n, pid_m, rows, n_tiles, m_tiles, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Where ``rows`` of output tile (pid_m, pid_n) lie in a split-K plane (tile after tile, each row-major), and
    the plane's size: the one layout the GEMM writes and _sum_planes reads."""
    tile = (pid_m * n_tiles + pid_n) * BLOCK_M * BLOCK_N
    return tile + rows[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :], n_tiles * m_tiles * BLOCK_M * BLOCK_N


@triton.jit
def _sum_planes(part_ptr, out_ptr, M, stride_om, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                ROWS: tl.constexpr, USE_PDL: tl.constexpr):  # fmt: skip
    """Split-K's second kernel: ROWS rows of one output tile, its SPLITS planes added in a fixed order
    (deterministic), many small programs so that no single one reads a whole tile's planes."""
    pdl_enter(USE_PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = tl.program_id(2) * ROWS + tl.arange(0, ROWS)
    offs_m = pid_m * BLOCK_M + rows
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m[:, None] < M
    offs, plane = _plane_offsets(pid_n, pid_m, rows, tl.num_programs(0), tl.num_programs(1), BLOCK_M, BLOCK_N)
    total = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for i in tl.static_range(SPLITS):
        total += tl.load(part_ptr + i * plane + offs, mask=m_mask, other=0.0)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], total.to(out_ptr.dtype.element_ty), mask=m_mask)


def fp8_block_gemm(x: torch.Tensor | Quantized, w: torch.Tensor, s: torch.Tensor, block_n: int | None = None,
                   split_k: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                   swap_ab: bool = True, tma: bool | None = None, block_m: int | None = None,
                   ) -> torch.Tensor:  # fmt: skip
    """x [M, Kp] bf16 (or already quantized: engine/native/fused_ops.py), w [Np, Kp] fp8, s [>=Np/128, >=Kp/128]
    fp32 -> [M, Np] in x's dtype. Launch choices left as None follow the rule below."""
    xq, xs, dtype = x[:3] if isinstance(x, Quantized) else (*quantize_groups(x, x.shape[0]), x.dtype)
    m, kp = xq.shape
    np_ = w.shape[0]
    block_m = block_m or row_tile(m)
    # Launch choices from H200 sweeps (bench/gemm_small_m.py --splits, then --explore:
    # bench/results/gpu_gemm_small_m_{splits,explore}.json): 64 columns and 4 warps a program, K split so that there
    # are at least 2.5 programs per SM (k_splits), the weight tile as the MMA's left operand (swap-AB: its 64 rows on
    # the side that Hopper's wgmma takes 64 at a time, the tokens on the narrow side), and for one row tile of 16 the
    # weight brought in by TMA, five stages deep. For llama3-8b's four layer GEMMs: 73.1 / 79.7 / 101.0 us at 1 / 16
    # / 64 rows against 79.9 / 82.0 / 103.1 for the same rule unswapped, through plain loads, three stages (72.0 /
    # 77.4 / 96.1 for the best choice of each GEMM alone).
    block_n = block_n or 64
    num_warps = num_warps or 4
    if tma is None:  # TMA: 16-byte aligned rows, and a Triton that makes host-side descriptors (3.4+)
        tma = block_m == 16 and w.data_ptr() % 16 == 0 and w.stride(1) == 1 and _tensor_descriptor() is not None
    num_stages = num_stages or (5 if block_m == 16 else 3)
    m_tiles = triton.cdiv(m, block_m)
    n_programs = np_ // block_n
    k_blocks = kp // BLOCK_K
    if split_k is not None and k_blocks % split_k:
        raise ValueError(f"split_k={split_k} does not divide the {k_blocks} K blocks")
    tiles = n_programs * m_tiles
    split_k = split_k or k_splits(m, kp, tiles, sm_count(xq.device))
    decode = m <= SMALL_ROWS  # decode sizes: an early start (PDL) and the writes kept in the L2 for the next kernel
    out = torch.empty(m, np_, dtype=dtype, device=xq.device)
    part = torch.empty(split_k * tiles * block_m * block_n if split_k > 1 else 1, dtype=torch.float32,
                       device=xq.device)  # fmt: skip
    w_arg = _tensor_descriptor().from_tensor(w, [block_n, BLOCK_K]) if tma else w
    pdl = pdl_enabled(xq.device) and decode
    _fp8_block_gemm[(n_programs, split_k, m_tiles)](
        xq, xs, w_arg, w, s, out, part, m, np_, xq.stride(0), xs.stride(1), w.stride(0),
        s.stride(0), out.stride(0), SPLITS=split_k, K_PER_SPLIT=kp // split_k, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=BLOCK_K, SWAP_AB=swap_ab, TMA=tma, num_warps=num_warps, num_stages=num_stages,
        USE_PDL=pdl, launch_pdl=pdl, KEEP="evict_last" if decode else "",
        PREFETCH=min(prefetch_bytes(tma), kp // split_k) if pdl else 0,
    )  # fmt: skip
    if split_k > 1:
        _sum_planes[(n_programs, m_tiles, block_m // SUM_ROWS)](
            part, out, m, out.stride(0), SPLITS=split_k, BLOCK_M=block_m, BLOCK_N=block_n, ROWS=SUM_ROWS, USE_PDL=pdl,
            num_warps=4, launch_pdl=pdl,
        )  # fmt: skip
    return out


def prefetch_bytes(tma: bool) -> int:
    """Bytes of each weight row a decode GEMM program asks the L2 for before its PDL wait: its first loads then hit
    the L2 instead of starting when the kernel ahead ends. Best of 128 / 256 / 512 / 1,024 in the graphed decode step
    (H100, docs/benchmarks.md): 256 where the weights come by TMA (1-16 rows: -3.1% at one row), 128 through plain
    loads (32-64 rows: -1.1 to -1.3%); 1,024 is slower than none. A power of two lines of 128 bytes, or 0 for none."""
    return PREFETCH_TMA if tma else PREFETCH_LOADS


def row_tile(m: int) -> int:
    """The launch rule's rows a tile for ``m`` rows: the power of two that holds them, 16 to 64 (wgmma's N side)."""
    return min(64, max(16, triton.next_power_of_2(m)))


def k_splits(m: int, kp: int, tiles: int, sms: int) -> int:
    """The launch rule's K splits for ``m`` rows, K of ``kp``, ``tiles`` output tiles on ``sms`` SMs: the fewest that
    divide the K blocks and make at least 2.5 programs an SM, at most MAX_SPLIT, at most K / (16 m): split-K's fp32
    planes (splits x m x N x 4 bytes, written and read again) stay within a quarter of the weight's bytes, and at most
    as many as leave each program MIN_WALK K blocks to walk.
    Of llama3-8b's GEMMs the planes' cap changes only o at 33-64 rows (4 splits, not 8): on the H100, o at 64 rows took
    12.12 us at the 8 splits the programs alone asked for against 10.44 at 4 (bench/decode_launch_probe.py,
    bench/results/gpu_h100_decode_launch.json). The walk's cap gives o 4 splits at 1-32 rows too (8 asked for walks
    of 4 blocks): 7.20 / 7.58 / 8.40 us at 1 / 16 / 32 rows against 7.56 / 8.21 / 9.05 on the H200, 8.67 / 9.09 /
    9.77 against 9.13 / 9.81 / 10.35 on the H100 (gpu_decode_launch_s37.json, gpu_h100_decode_launch_small_rows.json);
    the graphed decode step at batch 1 2.775 / 2.778 -> 2.742 / 2.742 ms on the H200. qkv's rule gives 4, down's 7."""
    k_blocks = kp // BLOCK_K
    cap = max(1, min(kp // (16 * m), k_blocks // MIN_WALK))
    splits = [k for k in range(1, min(k_blocks, MAX_SPLIT, cap) + 1) if k_blocks % k == 0]
    return next((k for k in splits if tiles * k >= 5 * sms // 2), splits[-1])


@functools.cache
def _tensor_descriptor() -> Any:  # triton.tools.tensor_descriptor.TensorDescriptor, or None before Triton 3.4
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        return None
    return TensorDescriptor


@triton.jit
def _quantize_groups(x_ptr, q_ptr, s_ptr, M, stride_xm, stride_qm, rows, FP8_MAX: tl.constexpr,
                     GROUP: tl.constexpr, BLOCK_ROWS: tl.constexpr, USE_PDL: tl.constexpr):  # fmt: skip
    pdl_enter(USE_PDL)
    r = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    group = tl.program_id(1)
    cols = group * GROUP + tl.arange(0, GROUP)
    x = tl.load(x_ptr + r[:, None] * stride_xm + cols[None, :], mask=(r < M)[:, None], other=0.0).to(tl.float32)
    q, scale = group_codes(x, FP8_MAX)
    tl.store(q_ptr + r[:, None] * stride_qm + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=(r < rows)[:, None])
    tl.store(s_ptr + group * rows + r, scale, mask=r < rows)  # column-major: strides (1, rows)


def quantize_groups(x: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] (K a multiple of 128) -> fp8 [rows, K] and fp32 scales [rows, K/128] with strides (1, rows),
    rows >= M (the extra rows are zeros): the activation operands of cuBLAS' blockwise scaled_mm, in one launch."""
    m, k = x.shape
    groups = k // BLOCK_K
    q = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(groups * rows, dtype=torch.float32, device=x.device)
    block_rows = 16
    _quantize_groups[(triton.cdiv(rows, block_rows), groups)](
        x, q, scale, m, x.stride(0), q.stride(0), rows, FP8_MAX=FP8_MAX, GROUP=GROUP, BLOCK_ROWS=block_rows,
        num_warps=4, USE_PDL=(pdl := pdl_enabled(x.device) and rows <= SMALL_ROWS), launch_pdl=pdl,
    )  # fmt: skip
    return q, scale.as_strided((rows, groups), (1, rows))
