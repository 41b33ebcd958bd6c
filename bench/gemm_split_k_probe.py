"""Where the block-FP8 GEMM's time goes at decode sizes (H200 diagnostic; its variants are wrong on purpose).

A copy of engine/native/triton_fp8.py's kernel as it was before 2026-12-03 (split-K summed inside the GEMM by the
last of a tile's programs to arrive, through a per-tile counter), with knobs that each remove or replace one part:
the per-block scaling (``scale``: one plain wgmma chain); the split-K sum (``reduce``: 0 none, 1 in the GEMM, 2 the
counter only, 3 without the barrier before it, 4 a second kernel of ``rows``-row programs with ``sum_warps`` warps,
what the engine does now, ``live_rows`` leaving out the programs of rows past M); the activations (``xfixed``: every
program reads one L2-hot tile); the dot (``dot``: weights streamed and summed without one); the operand order
(``swap``); the counters' spacing (``cstride``); the weight's layout (``tiled``: each 64 x 128 tile one run of 8
KiB, a column tile's K blocks one after another, against rows of K bytes). Activations come prequantized, as in the
step; each variant is timed in a CUDA graph with the weights cycled past the L2 (as bench/gemm_small_m.py does), its
relative error against the engine's fp8_block_gemm printed beside it.

    PYTHONPATH=/tmp/site:$PWD python3 bench/gemm_split_k_probe.py --out $OUT/probe.json --rows 1,16,64 \
        --variants rule,noreduce,atomic_only,nobarrier,spread,kernel2,kernel2_r4,kernel2_split16,split2,kernel2_w8
    # not run yet: the second kernel's shape, and the splits with it
    ... --variants kernel2_r4,kernel2_r2,kernel2_r4_live,kernel2_r4_sw1,kernel2_r4_sw2,kernel2_r4_split2,\
kernel2_r4_split4
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

from bench.gemm_small_m import weight_copies
from bench.gpu_step_profile import graphed_us
from engine.native.fused_ops import Quantized, pdl_enabled, pdl_enter, sm_count
from engine.native.triton_fp8 import _plane_offsets, _sum_planes, _tensor_descriptor, fp8_block_gemm, quantize_groups

GEMMS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
VARIANTS = {
    "rule": {}, "noscale": {"scale": False}, "noreduce": {"reduce": 0}, "atomic_only": {"reduce": 2},
    "nobarrier": {"reduce": 3}, "spread": {"cstride": 32}, "xfixed": {"xfixed": True}, "nodot": {"dot": False},
    "noscale_noreduce": {"scale": False, "reduce": 0}, "kernel2": {"reduce": 4}, "kernel2_r4": {"reduce": 4, "rows": 4},
    "kernel2_split16": {"reduce": 4, "split_k": 16}, "kernel2_w8": {"reduce": 4, "num_warps": 8},
    "kernel2_r2": {"reduce": 4, "rows": 2}, "kernel2_r4_live": {"reduce": 4, "rows": 4, "live_rows": True},
    "kernel2_r4_sw1": {"reduce": 4, "rows": 4, "sum_warps": 1},
    "kernel2_r4_sw2": {"reduce": 4, "rows": 4, "sum_warps": 2},
    "kernel2_r4_split2": {"reduce": 4, "rows": 4, "split_k": 2},
    "kernel2_r4_split4": {"reduce": 4, "rows": 4, "split_k": 4},
    "split1": {"split_k": 1}, "split2": {"split_k": 2}, "split4": {"split_k": 4}, "split8": {"split_k": 8},
    "split16": {"split_k": 16}, "bn128": {"block_n": 128}, "bn128_w8": {"block_n": 128, "num_warps": 8},
    "s4": {"num_stages": 4}, "s5": {"num_stages": 5}, "tma": {"tma": True}, "w8": {"num_warps": 8},
    "w8_split4": {"num_warps": 8, "split_k": 4}, "noswap": {"swap": False},
    "noswap_noscale": {"swap": False, "scale": False},
    "kernel2_r4_notma": {"reduce": 4, "rows": 4, "tma": False},
    "kernel2_r4_tiled": {"reduce": 4, "rows": 4, "tiled": True},
    "kernel2_r4_tiled_notma": {"reduce": 4, "rows": 4, "tiled": True, "tma": False},
    "noreduce_tiled": {"reduce": 0, "tiled": True},
}  # fmt: skip
_COUNTERS: dict[int, torch.Tensor] = {}


@triton.jit
def _probe_gemm(
    xq_ptr, xs_ptr, w_ptr, s_ptr, out_ptr, part_ptr, count_ptr, M, stride_xm, stride_xs, stride_wn, stride_sn,
    stride_om, SPLITS: tl.constexpr, K_PER_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, TMA: tl.constexpr, USE_PDL: tl.constexpr, SCALE: tl.constexpr, REDUCE: tl.constexpr,
    CSTRIDE: tl.constexpr, XFIXED: tl.constexpr, DOT: tl.constexpr, SWAP: tl.constexpr, TILED: tl.constexpr,
    K_BLOCKS: tl.constexpr,
):  # fmt: skip
    pdl_enter(USE_PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m[:, None] < M
    k_begin = pid_k * K_PER_SPLIT
    acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_begin + K_PER_SPLIT, BLOCK_K):
        kx = 0 if XFIXED else k0
        xq = tl.load(xq_ptr + offs_m[:, None] * stride_xm + (kx + offs_k)[None, :], mask=m_mask, other=0.0)
        x_scale = tl.load(xs_ptr + (kx // BLOCK_K) * stride_xs + offs_m, mask=offs_m < M, other=0.0)
        if TILED:  # each BLOCK_N x 128 tile of the weight one contiguous run of bytes (tiled(): K blocks in a row)
            first = (pid_n * K_BLOCKS + k0 // BLOCK_K) * BLOCK_N
            if TMA:
                w = w_ptr.load([first, 0])
            else:
                w = tl.load(w_ptr + (first + tl.arange(0, BLOCK_N))[:, None] * BLOCK_K + offs_k[None, :])
        elif TMA:
            w = w_ptr.load([pid_n * BLOCK_N, k0])
        else:
            w = tl.load(w_ptr + offs_n[:, None] * stride_wn + (k0 + offs_k)[None, :])
        w_scale = tl.load(s_ptr + (offs_n // 128) * stride_sn + k0 // 128)
        if not DOT:
            acc_t += tl.sum(w.to(tl.float32), axis=1)[:, None] * w_scale[:, None]
            acc_t += tl.sum(xq.to(tl.float32), axis=1)[None, :]
        elif SWAP and SCALE:
            acc_t += tl.dot(w, tl.trans(xq)) * w_scale[:, None] * x_scale[None, :]
        elif SWAP:
            acc_t = tl.dot(w, tl.trans(xq), acc_t)
        elif SCALE:
            acc += tl.dot(xq, tl.trans(w)) * x_scale[:, None] * w_scale[None, :]
        else:
            acc = tl.dot(xq, tl.trans(w), acc)
    if SWAP or not DOT:
        acc = tl.trans(acc_t)
    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    if SPLITS == 1:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask)
    else:
        # the engine's plane layout: reduce=4 sums these planes with the engine's _sum_planes
        offs, plane = _plane_offsets(pid_n, pid_m, tl.arange(0, BLOCK_M), tl.num_programs(0), tl.num_programs(2),
                                     BLOCK_M, BLOCK_N)  # fmt: skip
        tl.store(part_ptr + pid_k * plane + offs, acc, mask=m_mask)
        if REDUCE == 1 or REDUCE == 2 or REDUCE == 3:
            if REDUCE != 3:
                tl.debug_barrier()
            counter = count_ptr + (pid_m * tl.num_programs(0) + pid_n) * CSTRIDE
            if tl.atomic_add(counter, 1, sem="acq_rel") == SPLITS - 1:
                if REDUCE != 2:
                    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                    for i in tl.static_range(SPLITS):
                        total += tl.load(part_ptr + i * plane + offs, mask=m_mask, other=0.0,
                                         cache_modifier=".cg")  # fmt: skip
                    tl.store(out, total.to(out_ptr.dtype.element_ty), mask=m_mask)
                tl.atomic_xchg(counter, 0)


def tiled(w: torch.Tensor, block_n: int = 64) -> torch.Tensor:
    """[N, K] -> [N * K / 128, 128]: the BLOCK_N x 128 tiles one after another, a column tile's K blocks in a row."""
    n, k = w.shape
    return w.view(n // block_n, block_n, k // 128, 128).permute(0, 2, 1, 3).contiguous().view(-1, 128)


def launch(x: Quantized, w: torch.Tensor, s: torch.Tensor, block_n: int = 64, split_k: int | None = None,
           num_warps: int = 4, num_stages: int | None = None, tma: bool | None = None, swap: bool = True,
           scale: bool = True, reduce: int = 1, xfixed: bool = False, dot: bool = True, cstride: int = 1,
           rows: int = 16, sum_warps: int = 4, live_rows: bool = False,
           tiled: bool = False) -> torch.Tensor:  # fmt: skip
    """One probe GEMM with the pre-2026-12-03 launch rule for whatever is left as None. ``tiled``: ``w`` comes as
    tiled(w) makes it."""
    xq, xs, dtype, _ = x
    m, kp = xq.shape
    np_ = s.shape[0] * 128 if tiled else w.shape[0]
    block_m = min(64, max(16, triton.next_power_of_2(m)))
    tma = block_m == 16 if tma is None else tma
    num_stages = num_stages or (5 if block_m == 16 else 3)
    m_tiles, n_programs, k_blocks = triton.cdiv(m, block_m), np_ // block_n, kp // 128
    if split_k is None:
        splits = [k for k in range(1, min(k_blocks, 16) + 1) if k_blocks % k == 0]
        split_k = next((k for k in splits if n_programs * m_tiles * k >= 5 * sm_count(xq.device) // 2), splits[-1])
    out = torch.empty(m, np_, dtype=dtype, device=xq.device)
    tiles = n_programs * m_tiles
    part = torch.empty(max(1, split_k * tiles * block_m * block_n), dtype=torch.float32, device=xq.device)
    if cstride not in _COUNTERS:  # made by the first (uncaptured) call: zeroed inside a capture, it would be a node
        _COUNTERS[cstride] = torch.zeros(1 << 16, dtype=torch.int32, device=xq.device)
    counters = _COUNTERS[cstride]
    w_arg = _tensor_descriptor().from_tensor(w, [block_n, 128]) if tma else w
    pdl = pdl_enabled(xq.device)
    _probe_gemm[(n_programs, split_k, m_tiles)](
        xq, xs, w_arg, s, out, part, counters, m, xq.stride(0), xs.stride(1), w.stride(0), s.stride(0), out.stride(0),
        SPLITS=split_k, K_PER_SPLIT=kp // split_k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=128, TMA=tma,
        USE_PDL=pdl, SCALE=scale, REDUCE=reduce, CSTRIDE=cstride, XFIXED=xfixed, DOT=dot, SWAP=swap, TILED=tiled,
        K_BLOCKS=k_blocks,
        num_warps=num_warps, num_stages=num_stages, launch_pdl=pdl,
    )  # fmt: skip
    if reduce == 4 and split_k > 1:
        r = min(rows, block_m)
        row_programs = triton.cdiv(min(m, block_m), r) if live_rows else block_m // r  # live: no all-masked programs
        _sum_planes[(n_programs, m_tiles, row_programs)](part, out, m, out.stride(0), SPLITS=split_k, BLOCK_M=block_m,
                                                         BLOCK_N=block_n, ROWS=r, USE_PDL=pdl, num_warps=sum_warps,
                                                         launch_pdl=pdl)  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True, help="JSON file, rewritten after every row")
    parser.add_argument("--rows", default="1,16,64")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"any of {', '.join(VARIANTS)}")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows: list[dict[str, object]] = []
    for name, (n, k) in GEMMS.items():
        copies = weight_copies(n, k)  # cycled: more bytes than the L2 holds
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq = Quantized(*quantize_groups(x, m), x.dtype, m)
            ref = fp8_block_gemm(xq, *copies[0]).float()
            for label in args.variants.split(","):
                kw = VARIANTS[label]
                if (k // 128) % kw.get("split_k", 1):
                    continue
                weights = copies
                if kw.get("tiled"):
                    weights = [(tiled(w, kw.get("block_n", 64)), s) for w, s in copies]  # type: ignore[arg-type]
                try:
                    err = ((launch(xq, *weights[0], **kw).float() - ref).norm() / ref.norm()).item()
                    turn = itertools.cycle(weights)
                    us = graphed_us(lambda kw=kw: launch(xq, *next(turn), **kw), calls=2 * len(copies))
                except Exception as exc:  # a launch that does not fit (shared memory): recorded, skipped
                    row: dict[str, object] = {"gemm": name, "m": m, "variant": label, "error": str(exc)[:150]}
                else:
                    row = {"gemm": name, "m": m, "variant": label, "us": round(us, 2),
                           "tb_s": round(n * k / us / 1e6, 2), "err": round(err, 4)}  # fmt: skip
                del weights
                rows.append(row)
                print(json.dumps(row), flush=True)
                args.out.write_text(json.dumps(rows, indent=1))
        del copies
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
