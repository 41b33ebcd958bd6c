"""Linear-layer kernels, by the names weight processing records (cache/processors/native.py).

Each kernel takes activations [M, K] and the processed tensors of one layer and returns
[M, N]. The engine refuses a recipe whose kernel name is not in KERNELS.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from cache.checkpoint.schemes import FP8_BLOCK, FP8_MAX
from cache.processors.native import DENSE, FP8_BLOCK_SCALED_MM, FP8_DEQUANT, FP8_ROWWISE_SCALED_MM, LinearRecipe

if TYPE_CHECKING:
    from engine.native.deep_gemm import DeepGemm

FP8 = torch.float8_e4m3fn
Tensors = dict[str, torch.Tensor]
Kernel = Callable[[torch.Tensor, Tensors, LinearRecipe], torch.Tensor]


class UnknownKernel(RuntimeError):
    """A recipe names a kernel this engine build does not implement."""


def dense(x: torch.Tensor, t: Tensors, r: LinearRecipe) -> torch.Tensor:
    return F.linear(x, t["weight"], t.get("bias"))


def quantize_per_token_group(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] (K a multiple of 128) -> fp8 [M, K] and fp32 scales [M, K/128] with strides (1, M)."""
    m, k = x.shape
    groups = x.view(m, k // FP8_BLOCK, FP8_BLOCK).float()
    scale = groups.abs().amax(dim=-1).clamp_min(1e-12) / FP8_MAX
    q = (groups / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(m, k)
    # The blockwise kernel wants column-major activation scales: strides (1, M), also when M == 1.
    return q, scale.t().contiguous().as_strided((m, k // FP8_BLOCK), (1, m))


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> fp8 [M, K] and fp32 scales [M, 1]."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / FP8_MAX
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def _pad_k(x: torch.Tensor, r: LinearRecipe) -> torch.Tensor:
    pad = r.padded_in - r.in_features
    return F.pad(x, (0, pad)) if pad else x


def _finish(y: torch.Tensor, t: Tensors, r: LinearRecipe) -> torch.Tensor:
    if r.padded_out != r.out_features:
        y = y[:, : r.out_features]
    bias = t.get("bias")
    return y + bias if bias is not None else y


# Up to this many rows the Triton kernel is used rather than cuBLAS' blockwise scaled_mm: on the H200, for
# llama3-8b's four layer GEMMs (weights read from HBM, not L2), Triton takes 98 us against cuBLAS' 111 at 32 rows
# and 103 against 111 at 64 (bench/results/gpu_gemm_small_m_splits.json), and cuBLAS wins above: 113 against 134 us
# at 96 rows (bench/results/gpu_step_profile_fused_quant.json's "gemms", one weight copy). WARMGATE_FP8_SMALL_M
# overrides it, for benchmarks.
SMALL_M = int(os.environ.get("WARMGATE_FP8_SMALL_M", "64"))
# Above this many rows DeepGEMM's kernel is used where the engine has one built (engine/native/deep_gemm.py): on the
# H100, llama3-8b's four layer GEMMs (weights from HBM) take 90.7 us against Triton's 99.3 at 64 rows and 103.7
# against 93.9 at 32 (bench/results/gpu_h100_deep_gemm_s46.json); the graphed batch-64 decode step 4.600 -> 4.470 ms.
# WARMGATE_DEEP_GEMM_SMALL_M overrides it, for benchmarks.
DEEP_GEMM_SMALL_M = int(os.environ.get("WARMGATE_DEEP_GEMM_SMALL_M", "32"))
# cuBLAS' blockwise kernels (torch 2.11 + CUDA 13 on the H200) refuse every M that is not a multiple
# of 4 (CUBLAS_STATUS_NOT_SUPPORTED from the heuristic query): the fp32 activation scales are
# column-major with leading dimension M (16-byte alignment would explain the rule). torch insists
# on strides (1, M), so the rows themselves are padded (bench/results/cublas_blockwise_rule.json).
CUBLAS_BLOCKWISE_ROWS = 4


def _cublas_blockwise(r: LinearRecipe) -> bool:
    """cuBLAS' blockwise scaled_mm takes this layer's weights: its scale dimensions in multiples of 4 blocks."""
    return (r.padded_out // FP8_BLOCK) % 4 == 0 and (r.padded_in // FP8_BLOCK) % 4 == 0


def fp8_block_scaled_mm(x: torch.Tensor, t: Tensors, r: LinearRecipe, deep: DeepGemm | None = None) -> torch.Tensor:
    """Hopper+: activations quantized per token and group of 128, weights in 128x128 blocks.

    cuBLAS' blockwise scaled_mm for large M when its layout rules hold (rows padded to
    CUBLAS_BLOCKWISE_ROWS, scale dimensions in multiples of 4 blocks), or DeepGEMM's kernel on the same
    operands where ``deep`` has one built for these sizes (engine/native/deep_gemm.py); the Triton kernel, with
    the same numerics, otherwise. ``x`` may come quantized (quantized_rows).
    """
    from torch.nn.functional import ScalingType, scaled_mm

    from engine.native.fused_ops import Quantized
    from engine.native.triton_fp8 import fp8_block_gemm, quantize_groups

    quantized = x if isinstance(x, Quantized) else None
    m = quantized.rows if quantized else x.shape[0]
    w, ws = t["weight"], t["weight_scale"]
    dtype = quantized.dtype if quantized else x.dtype
    deep = deep if deep is not None and _deep_gemm_takes(deep, m, dtype, t, r) else None
    if deep is None and (m <= SMALL_M or not _cublas_blockwise(r)):
        y = fp8_block_gemm(quantized or _pad_k(x, r).contiguous(), w, ws)
    else:
        if quantized:
            xq, xs = quantized.q, quantized.scale
        else:
            xq, xs = quantize_groups(_pad_k(x, r), _cublas_rows(m))  # as quantize_per_token_group, in one kernel
        if deep is not None:
            y = deep.gemm(xq, xs, w, ws)
        else:
            y = scaled_mm(xq, w.t(), xs, ScalingType.BlockWise1x128, ws.t(), ScalingType.BlockWise128x128,
                          output_dtype=dtype)  # fmt: skip
    return _finish(y[:m] if y.shape[0] != m else y, t, r)  # the padding rows' outputs dropped


def cublas_sized(recipe: LinearRecipe) -> bool:
    """This layer's GEMM goes to cuBLAS' blockwise kernel above SMALL_M rows (DeepGEMM's above DEEP_GEMM_SMALL_M)."""
    return recipe.kernel == FP8_BLOCK_SCALED_MM and _cublas_blockwise(recipe)


def deep_gemm_rows(step_rows: list[int]) -> list[int]:
    """The GEMM rows (padded) at which steps of these sizes may call DeepGEMM's kernel."""
    return sorted({_cublas_rows(m) for m in step_rows if m > DEEP_GEMM_SMALL_M})


def _deep_gemm_takes(deep: DeepGemm, m: int, dtype: torch.dtype, t: Tensors, r: LinearRecipe) -> bool:
    """DeepGEMM's kernel can take these ``m`` rows: above DEEP_GEMM_SMALL_M, cuBLAS' operand layout, bf16 out, and a
    kernel built for these sizes (deep.ready)."""
    w, ws = t["weight"], t["weight_scale"]
    return (m > DEEP_GEMM_SMALL_M and _cublas_blockwise(r) and dtype == torch.bfloat16 and ws.is_contiguous()
            and deep.ready(_cublas_rows(m), *w.shape))  # fmt: skip


def _cublas_rows(m: int) -> int:
    return m + -m % CUBLAS_BLOCKWISE_ROWS


def quantized_rows(recipe: LinearRecipe, rows: int) -> int:
    """The rows in which this layer's kernel takes ``rows`` of activations already quantized (engine/native/
    fused_ops.py's Quantized, made by the norm or activation kernel before it), or 0 where it does not: block FP8
    with no padding of K; padded to CUBLAS_BLOCKWISE_ROWS where cuBLAS' or DeepGEMM's GEMM may take them (the
    Triton GEMM takes rows past M too), else as they are."""
    if recipe.kernel != FP8_BLOCK_SCALED_MM or recipe.padded_in != recipe.in_features:
        return 0
    return _cublas_rows(rows) if rows > min(SMALL_M, DEEP_GEMM_SMALL_M) and _cublas_blockwise(recipe) else rows


def fp8_rowwise_scaled_mm(x: torch.Tensor, t: Tensors, r: LinearRecipe) -> torch.Tensor:
    """Ada/Hopper+: per-token activation scales times per-channel (or broadcast per-tensor) weight scales."""
    xq, xs = quantize_per_token(_pad_k(x, r))
    y = torch._scaled_mm(xq, t["weight"].t(), scale_a=xs, scale_b=t["weight_scale"], out_dtype=x.dtype)
    return _finish(y, t, r)


KERNELS: dict[str, Kernel] = {
    DENSE: dense,
    FP8_DEQUANT: dense,  # processing already multiplied the scales in
    FP8_BLOCK_SCALED_MM: fp8_block_scaled_mm,
    FP8_ROWWISE_SCALED_MM: fp8_rowwise_scaled_mm,
}


def kernel_for(recipe: LinearRecipe) -> Kernel:
    try:
        return KERNELS[recipe.kernel]
    except KeyError:
        raise UnknownKernel(
            f"weights were processed for kernel {recipe.kernel!r}, which this engine does not implement "
            f"(known: {', '.join(KERNELS)})"
        ) from None


TRITON_MODULES = ("engine.native.fused_ops", "engine.native.triton_fp8", "engine.native.triton_attention",
                  "engine.native.triton_logprobs")  # fmt: skip


def preload_triton() -> None:
    """Triton's once-per-process work that needs no device, done by the fork server before it forks, so that every
    engine it forks inherits it: our Triton modules, the hash of Triton's own sources and library that every kernel's
    cache key includes, the Gluon modules its first launch imports, and each of our kernels' source hash. py-spy of
    the fork path on the H200 (docs/benchmarks.md): ~0.4 s of a forked engine's start went to the first of these,
    ~0.15 s to the Gluon imports, all of it in the first CUDA-graph warm-up."""
    import importlib

    import triton

    try:
        from triton.runtime.cache import triton_key
    except ImportError:  # another Triton: its first launch pays for whatever it has instead
        pass
    else:
        triton_key()  # functools.cache'd for the process
    with contextlib.suppress(ImportError):
        importlib.import_module("triton.experimental.gluon")
    for name in TRITON_MODULES:
        for value in vars(importlib.import_module(name)).values():
            if isinstance(value, triton.runtime.JITFunction):
                value.cache_key  # noqa: B018 (a property that hashes the kernel's source once)
