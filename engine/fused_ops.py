"""Fused elementwise kernels for CUDA (Triton): residual-add + RMSNorm, rotary embedding.

A decode step at small batch is mostly tiny kernels; PyTorch spends six to ten launches
on each RMSNorm or rotary call. These do each in one. The torch versions in
engine/model.py stay the reference and the CPU path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm(x_ptr, r_ptr, w_ptr, out_ptr, n_cols, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x = x + tl.load(r_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        x = x.to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + row * n_cols + cols, x, mask=mask)  # the residual stream, updated in place
        x = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    normed = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)  # HF rounds before the weight
    tl.store(out_ptr + row * n_cols + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """If ``residual`` is given, ``x += residual`` in place; returns rms_norm(x) * weight. x is [rows, cols]."""
    rows, cols = x.shape
    out = torch.empty_like(x)
    _add_rms_norm[(rows,)](
        x, residual if residual is not None else x, weight, out, cols, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(cols), num_warps=4,
    )  # fmt: skip
    return out


@triton.jit
def _rope(x_ptr, cos_ptr, sin_ptr, out_ptr, heads, HALF: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    base = (token * heads + head) * 2 * HALF
    x1 = tl.load(x_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + base + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + token * HALF + offs, mask=mask, other=0.0)
    s = tl.load(sin_ptr + token * HALF + offs, mask=mask, other=0.0)
    tl.store(out_ptr + base + offs, (x1 * c - x2 * s).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + base + HALF + offs, (x2 * c + x1 * s).to(out_ptr.dtype.element_ty), mask=mask)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] (contiguous), cos/sin [T, head_dim/2] fp32 -> rotated copy (rotate-half layout)."""
    tokens, heads, dim = x.shape
    out = torch.empty_like(x)
    half = dim // 2
    _rope[(tokens, heads)](x, cos, sin, out, heads, HALF=half, BLOCK=triton.next_power_of_2(half), num_warps=1)
    return out
