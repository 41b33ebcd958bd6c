"""Fused elementwise kernels for CUDA (Triton): residual-add + RMSNorm, rotary embedding.

A decode step at small batch is mostly tiny kernels; PyTorch spends six to ten launches
on each RMSNorm or rotary call. These do each in one. The torch versions in
engine/native/model.py stay the reference and the CPU path.

The norm and SiLU-and-multiply kernels can also hand their output to a block-FP8 GEMM already
quantized (``quantize_rows``: fp8 and the scales of each token's groups of 128, as
engine/native/triton_fp8.py's quantize_groups makes them, from the same bf16 values, so the
GEMM's operands are bit for bit the same): one launch fewer per GEMM, and for a prefill's
thousands of rows one pass over the activations fewer (cuBLAS' GEMM takes them padded to
rows in multiples of 4: the padding rows are zeros, as quantize_groups makes them).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from cache.checkpoint.schemes import FP8_BLOCK, FP8_MAX

GROUP = FP8_BLOCK  # activations are quantized in groups of a weight block's columns


class Quantized(NamedTuple):
    """Activations [M, K] quantized per token and group of 128: fp8 q [R, K] and fp32 scales [R, K/128] with
    strides (1, R), as quantize_groups(x, R) returns them (engine/native/triton_fp8.py), R >= M (the rows past M
    zeros: cuBLAS' blockwise GEMM takes rows in multiples of 4); ``dtype``: that of the values quantized, the GEMM's
    output's; ``rows``: M."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype
    rows: int


def quantized_like(x: torch.Tensor, rows: int) -> Quantized:
    """Room for ``x`` [M, K] quantized, in ``rows`` >= M rows."""
    cols = x.shape[1]
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(cols // GROUP * rows, dtype=torch.float32, device=x.device)
    return Quantized(q, scale.as_strided((rows, cols // GROUP), (1, rows)), x.dtype, x.shape[0])


@triton.jit
def group_codes(groups, FP8_MAX: tl.constexpr):
    """Rows of one quantization group each (fp32 holding the rounded values) -> their e4m3 codes (still fp32) and
    each row's scale: the one definition quantize_groups, the fused norm/activation stores and the attention's use,
    so that their codes agree bit for bit."""
    scale = tl.maximum(tl.max(tl.abs(groups), axis=1), 1e-12) / FP8_MAX
    return tl.clamp(groups / scale[:, None], -FP8_MAX, FP8_MAX), scale


@triton.jit
def store_groups(q_ptr, s_ptr, row, rows, n_cols, first, y, BLOCK: tl.constexpr, GROUP: tl.constexpr,
                 FP8_MAX: tl.constexpr):  # fmt: skip
    """Columns first..first+BLOCK-1 of one row (y: fp32 holding bf16 values, zeros past n_cols, a multiple of
    GROUP), quantized as quantize_groups does it: q at [row, col], the scale of group g at g * rows + row."""
    codes, scale = group_codes(tl.reshape(y, (BLOCK // GROUP, GROUP)), FP8_MAX)
    q = tl.reshape(codes, (BLOCK,))
    cols = first + tl.arange(0, BLOCK)
    tl.store(q_ptr + row * n_cols + cols, q.to(q_ptr.dtype.element_ty), mask=cols < n_cols)
    g = first // GROUP + tl.arange(0, BLOCK // GROUP)
    tl.store(s_ptr + g * rows + row, scale, mask=g < n_cols // GROUP)


# Programmatic dependent launch (Hopper+): a decode kernel is scheduled while the previous one
# finishes and waits (gdc_wait) before touching memory; saves launch gaps inside the CUDA
# graph (docs/benchmarks.md). Benchmarks switch it off to compare. Before its wait a kernel may
# read what the kernel ahead of it does not write (weights, the step's inputs): that one starts
# its dependents only once its own wait has returned, so everything before it has landed.
PDL = True
SMALL_ROWS = 64  # decode-sized launches only: a multi-wave kernel gains nothing from an early start


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the previous kernel has finished and its writes are visible
        tl.extra.cuda.gdc_launch_dependents()  # the next kernel may be scheduled now


@triton.jit
def prefetch_l2(ptrs):
    """One L2 prefetch a pointer (its 128-byte line): fire and forget, nothing held, through the load/store units
    (Hopper's bulk L2 prefetch, through the TMA unit, made the decode step slower, likely by queueing the weights'
    TMA loads behind it: docs/benchmarks.md). Before a PDL wait, for what the kernel ahead does not write."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)  # fmt: skip


@functools.cache
def pdl_enabled(device: torch.device) -> bool:
    return PDL and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (launch rules size grids by it); the Triton interpreter on the CPU
    counts as one H200's 132."""
    if device.type != "cuda":
        return 132
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(index).multi_processor_count


@triton.jit(do_not_specialize=["m"])
def _add_rms_norm(x_ptr, r_ptr, w_ptr, out_ptr, s_ptr, n_cols, m, eps, HAS_RESIDUAL: tl.constexpr,
                  QUANTIZE: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr, FP8_MAX: tl.constexpr,
                  USE_PDL: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)  # rows past m (quantized output's padding) read and write zeros
    cols = tl.arange(0, BLOCK)
    mask = cols < tl.where(row < m, n_cols, 0)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # never written: read before the wait (pdl_enter)
    pdl_enter(USE_PDL)
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x = x + tl.load(r_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        x = x.to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + row * n_cols + cols, x, mask=mask)  # the residual stream, updated in place
        x = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    normed = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)  # HF rounds before the weight
    y = (normed * w).to(x_ptr.dtype.element_ty)
    if QUANTIZE:
        store_groups(out_ptr, s_ptr, row, tl.num_programs(0), n_cols, 0, y.to(tl.float32), BLOCK, GROUP, FP8_MAX)
    else:
        tl.store(out_ptr + row * n_cols + cols, y, mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 quantize_rows: int = 0) -> torch.Tensor | Quantized:  # fmt: skip
    """If ``residual`` is given, ``x += residual`` in place; returns rms_norm(x) * weight. x is [rows, cols].
    ``quantize_rows`` (>= rows): returned quantized for a block-FP8 GEMM in that many rows (cols a multiple of 128)."""
    rows, cols = x.shape
    out = quantized_like(x, quantize_rows) if quantize_rows else torch.empty_like(x)
    dest, scales = out[:2] if quantize_rows else (out, out)  # unquantized: no scales are written
    _add_rms_norm[(quantize_rows or rows,)](
        x, residual if residual is not None else x, weight, dest, scales, cols, rows, eps,
        HAS_RESIDUAL=residual is not None, QUANTIZE=quantize_rows > 0, BLOCK=triton.next_power_of_2(cols), GROUP=GROUP,
        FP8_MAX=FP8_MAX, num_warps=4, USE_PDL=(pdl := pdl_enabled(x.device) and rows <= SMALL_ROWS), launch_pdl=pdl,
    )  # fmt: skip
    return out


@triton.jit
def _rope(x_ptr, cos_ptr, sin_ptr, out_ptr, heads, stride_t, stride_h, HALF: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    src = token * stride_t + head * stride_h
    dst = (token * heads + head) * 2 * HALF
    x1 = tl.load(x_ptr + src + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + src + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + token * HALF + offs, mask=mask, other=0.0)
    s = tl.load(sin_ptr + token * HALF + offs, mask=mask, other=0.0)
    tl.store(out_ptr + dst + offs, rotated(x1, -x2, c, s).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + dst + HALF + offs, rotated(x2, x1, c, s).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rotated(x, partner, c, s):
    """One rotate-half output in fp32: x * cos + partner * sin, partner being -x2 for the first half's x1 and x1 for
    the second half's x2. One explicit FMA, so that every kernel that rotates (the rotary kernels here, the decode
    attention that rotates its own queries and key) rounds alike: left to the compiler, the contraction differs
    between specializations."""
    return tl.fma(x, c, partner * s)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] (head_dim contiguous; rows may be a slice of a merged projection),
    cos/sin [T, head_dim/2] fp32 -> rotated contiguous copy (rotate-half layout)."""
    tokens, heads, dim = x.shape
    out = torch.empty(tokens, heads, dim, dtype=x.dtype, device=x.device)
    half = dim // 2
    _rope[(tokens, heads)](
        x, cos, sin, out, heads, x.stride(0), x.stride(1), HALF=half, BLOCK=triton.next_power_of_2(half), num_warps=1
    )
    return out


@triton.jit(do_not_specialize=["m"])
def _silu_mul(g_ptr, u_ptr, out_ptr, s_ptr, n_cols, m, stride_g, stride_u, QUANTIZE: tl.constexpr,
              BLOCK: tl.constexpr, GROUP: tl.constexpr, FP8_MAX: tl.constexpr, USE_PDL: tl.constexpr):  # fmt: skip
    pdl_enter(USE_PDL)
    row = tl.program_id(0)  # rows past m (quantized output's padding) read and write zeros
    first = tl.program_id(1) * BLOCK
    cols = first + tl.arange(0, BLOCK)
    mask = cols < tl.where(row < m, n_cols, 0)
    g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    y = (g / (1.0 + tl.exp(-g))).to(g_ptr.dtype.element_ty).to(tl.float32) * u  # silu rounds like torch's
    y = y.to(g_ptr.dtype.element_ty)
    if QUANTIZE:
        store_groups(out_ptr, s_ptr, row, tl.num_programs(0), n_cols, first, y.to(tl.float32), BLOCK, GROUP, FP8_MAX)
    else:
        tl.store(out_ptr + row * n_cols + cols, y, mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, quantize_rows: int = 0, block: int = 1024,
             num_warps: int = 4) -> torch.Tensor | Quantized:  # fmt: skip
    """silu(gate) * up for [T, I] views (rows may be slices of one merged gate/up output). ``quantize_rows``
    (>= T): returned quantized for a block-FP8 GEMM in that many rows (I a multiple of 128). ``block`` (columns a
    program, a multiple of 128) and ``num_warps``: launch choices (bench/decode_launch_probe.py tries others)."""
    rows, cols = gate.shape
    out = quantized_like(gate, quantize_rows) if quantize_rows else gate.new_empty(rows, cols)
    dest, scales = out[:2] if quantize_rows else (out, out)  # unquantized: no scales are written
    pdl = pdl_enabled(gate.device) and rows <= SMALL_ROWS
    _silu_mul[(quantize_rows or rows, triton.cdiv(cols, block))](
        gate, up, dest, scales, cols, rows, gate.stride(0), up.stride(0), QUANTIZE=quantize_rows > 0, BLOCK=block,
        GROUP=GROUP, FP8_MAX=FP8_MAX, USE_PDL=pdl, num_warps=num_warps, launch_pdl=pdl,
    )  # fmt: skip
    return out


@triton.jit(do_not_specialize=["tokens"])
def _rope_kv_write(qkv_ptr, cos_ptr, sin_ptr, q_ptr, kc_ptr, vc_ptr, slot_ptr, tokens, stride_t, stride_slot,
                   stride_head, HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr,
                   BLOCK_T: tl.constexpr, USE_PDL: tl.constexpr):  # fmt: skip
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1)  # 0..HEADS-1: a query head; HEADS..HEADS+KV_HEADS-1: a key/value head
    offs = tl.arange(0, HALF)
    live = (t < tokens)[:, None]
    # The step's own inputs (angles, cache slots), written before the kernel ahead of this one: read before the wait
    c = tl.load(cos_ptr + t[:, None] * HALF + offs[None, :], mask=live)
    s = tl.load(sin_ptr + t[:, None] * HALF + offs[None, :], mask=live)
    slot = tl.load(slot_ptr + t, mask=t < tokens).to(tl.int64)  # used by the key/value heads only
    pdl_enter(USE_PDL)
    src = qkv_ptr + t[:, None] * stride_t + h * 2 * HALF + offs[None, :]
    x1 = tl.load(src, mask=live).to(tl.float32)
    x2 = tl.load(src + HALF, mask=live).to(tl.float32)
    r1 = rotated(x1, -x2, c, s)
    r2 = rotated(x2, x1, c, s)
    if h < HEADS:
        _store_halves(q_ptr + (t[:, None] * HEADS + h) * 2 * HALF + offs[None, :], r1, r2, live, HALF)
    else:
        kv = h - HEADS
        cache = slot[:, None] * stride_slot + kv * stride_head
        _store_halves(kc_ptr + cache + offs[None, :], r1, r2, live, HALF)
        v_src = qkv_ptr + t[:, None] * stride_t + (HEADS + KV_HEADS + kv) * 2 * HALF + offs[None, :]
        _store_halves(vc_ptr + cache + offs[None, :], tl.load(v_src, mask=live), tl.load(v_src + HALF, mask=live),
                      live, HALF)  # fmt: skip


@triton.jit
def _store_halves(dst, first, second, mask, HALF: tl.constexpr):
    """A head's two halves, each rounded once to what ``dst`` holds (the queries' dtype, or a cache's: fp8 too)."""
    tl.store(dst, first.to(dst.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, second.to(dst.dtype.element_ty), mask=mask)


def rope_kv_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slots: torch.Tensor, heads: int, kv_heads: int,
                  block_t: int | None = None) -> torch.Tensor:  # fmt: skip
    """Attention's input side in one launch: from the merged projection qkv [T, (H + 2*KV) * D],
    rotate q and k (rotate-half), write k and v of token t into cache slot slots[t] of one layer's
    cache [slots, KV, D], and return the rotated queries [T, H, D]. D must be a power of two.
    A program takes one head of up to 8 tokens at decode sizes and of 32 tokens past them: a 2,048-token
    prefill of llama3-8b made 81,920 one-token programs a layer, each moving ~0.5 KB, 1,524 us a
    step on the H200 against 409 with 32 tokens a program (bench/results/gpu_step_profile_fused_prefill_*); at 64
    decode rows on the H100, 3.63 us a layer with one token a program against 1.55 with 8 (4 warps) and 1.71 with 4
    (bench/results/gpu_h100_decode_launch.json).
    ``block_t``: tokens a program, a launch choice (bench/decode_launch_probe.py tries others)."""
    t = qkv.shape[0]
    dim = k_cache.shape[-1]
    q = torch.empty(t, heads, dim, dtype=qkv.dtype, device=qkv.device)
    block_t = block_t or (min(8, triton.next_power_of_2(t)) if t <= SMALL_ROWS else 32)
    _rope_kv_write[(triton.cdiv(t, block_t), heads + kv_heads)](
        qkv, cos, sin, q, k_cache, v_cache, slots, t, qkv.stride(0), k_cache.stride(0), k_cache.stride(1),
        HEADS=heads, KV_HEADS=kv_heads, HALF=dim // 2, BLOCK_T=block_t, num_warps=1 if block_t < 8 else 4,
        USE_PDL=(pdl := pdl_enabled(qkv.device) and t <= SMALL_ROWS), launch_pdl=pdl,
    )  # fmt: skip
    return q
