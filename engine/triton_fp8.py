"""Block-FP8 W8A8 GEMM in Triton, for the sizes cuBLAS' blockwise scaled_mm handles badly.

cuBLAS' blockwise kernel is built for large M and wants scale dimensions in multiples
of 4 blocks; at decode sizes it leaves most of HBM bandwidth unused. This kernel has the
same numerics (activations quantized to e4m3 per token and group of 128, FP8 x FP8 dot
per 128x128 weight block, both scales applied to the fp32 partial product), streams the
weight once, and splits K across programs so every SM has loads in flight. It consumes
the same processed tensors: weight [Np, Kp] (padded to 128), weight_scale [>=Np/128, >=Kp/128].
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

BLOCK_K = 128
FP8_MAX = tl.constexpr(448.0)


@triton.jit
def _fp8_block_gemm(
    x_ptr, w_ptr, s_ptr, out_ptr, M, stride_xm, stride_wn, stride_sn, stride_om, stride_split,
    K_PER_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m[:, None] < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_begin = pid_k * K_PER_SPLIT
    for k0 in range(k_begin, k_begin + K_PER_SPLIT, BLOCK_K):
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :], mask=m_mask, other=0.0).to(tl.float32)
        # Dynamic activation scale per token and group of 128, as the checkpoint's scheme says.
        x_scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12) / FP8_MAX
        xq = (x / x_scale[:, None]).to(tl.float8e4nv)
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + (k0 + offs_k)[None, :])
        w_scale = tl.load(s_ptr + (offs_n // 128) * stride_sn + k0 // 128)
        part = tl.dot(xq, tl.trans(w))
        acc += part * x_scale[:, None] * w_scale[None, :]
    # Split-K programs write fp32 partials to their own plane; _sum_splits adds them up.
    out = out_ptr + pid_k * stride_split + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask)


@triton.jit
def _sum_splits(part_ptr, out_ptr, numel, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(SPLITS):
        acc += tl.load(part_ptr + i * numel + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def fp8_block_gemm(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, block_n: int | None = None,
                   split_k: int | None = None, num_warps: int = 4, num_stages: int = 4,
                   reduce_block: int = 256) -> torch.Tensor:  # fmt: skip
    """x [M, Kp] bf16, w [Np, Kp] fp8, s [>=Np/128, >=Kp/128] fp32 -> [M, Np] in x's dtype."""
    m, kp = x.shape
    np_ = w.shape[0]
    block_m = min(64, max(16, triton.next_power_of_2(m)))
    if block_n is None:
        block_n = 128 if m <= 16 else 64  # measured best on the H200 (docs/benchmarks.md)
    m_tiles = triton.cdiv(m, block_m)
    n_programs = np_ // block_n
    k_blocks = kp // BLOCK_K
    if split_k is None:
        # Enough programs to keep every SM streaming: about two waves (the best split in the H200 sweep).
        split_k = max(1, min(k_blocks, (2 * _sm_count(x.device.index)) // max(1, n_programs * m_tiles)))
        while k_blocks % split_k:
            split_k -= 1
    partial = x.new_empty(split_k, m, np_, dtype=torch.float32) if split_k > 1 else x.new_empty(1, m, np_)
    _fp8_block_gemm[(n_programs, split_k, m_tiles)](
        x, w, s, partial, m, x.stride(0), w.stride(0), s.stride(0), partial.stride(1), partial.stride(0),
        K_PER_SPLIT=kp // split_k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK_K, num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
    if split_k == 1:
        return partial[0]
    out = x.new_empty(m, np_)
    numel = m * np_
    _sum_splits[(triton.cdiv(numel, reduce_block),)](partial, out, numel, SPLITS=split_k, BLOCK=reduce_block)
    return out


@functools.cache
def _sm_count(device_index: int | None) -> int:
    index = device_index if device_index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(index).multi_processor_count
