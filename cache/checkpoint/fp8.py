"""FP8 e4m3 weight quantization and dequantization for the three served layouts.

Scales follow compressed-tensors: ``w ≈ q * scale`` with ``scale = amax / 448`` over a
tensor, a row (channel) or a 128x128 block; partial edge blocks use their own amax.
"""

from __future__ import annotations

import torch

from cache.checkpoint.schemes import FP8_BLOCK, FP8_MAX, WeightKind, ceil_div

FP8 = torch.float8_e4m3fn
# A zero block would get scale 0 and divide by zero; any tiny positive scale keeps q == 0 there.
MIN_SCALE = torch.finfo(torch.float32).tiny


def quantize_weight(w: torch.Tensor, kind: WeightKind) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize an [N, K] weight; returns (float8_e4m3fn [N, K], fp32 scale in the kind's shape)."""
    if w.dim() != 2:
        raise ValueError(f"expected a 2-D weight, got shape {tuple(w.shape)}")
    wf = w.float()
    if kind is WeightKind.FP8_TENSOR:
        scale = (wf.abs().amax() / FP8_MAX).clamp_min(MIN_SCALE).reshape(1)
        q = _to_fp8(wf / scale)
    elif kind is WeightKind.FP8_CHANNEL:
        scale = (wf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(MIN_SCALE)
        q = _to_fp8(wf / scale)
    elif kind is WeightKind.FP8_BLOCK:
        blocks = _blocked(wf)  # [nb, 128, kb, 128], zero-padded
        scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp_min(MIN_SCALE)  # [nb, kb]
        q = _unblocked(_to_fp8(blocks / scale[:, None, :, None]), *w.shape)
    else:
        raise ValueError(f"not an FP8 kind: {kind}")
    return q, scale.to(torch.float32)


def dequantize_weight(
    q: torch.Tensor, scale: torch.Tensor, kind: WeightKind, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Inverse of quantize_weight: ``q * scale`` broadcast over the kind's groups, in ``dtype``."""
    qf = q.float()
    s = scale.float()
    if kind is WeightKind.FP8_TENSOR:
        out = qf * s.reshape(())
    elif kind is WeightKind.FP8_CHANNEL:
        out = qf * s.reshape(-1, 1)
    elif kind is WeightKind.FP8_BLOCK:
        n, k = q.shape
        expanded = s.repeat_interleave(FP8_BLOCK, 0)[:n].repeat_interleave(FP8_BLOCK, 1)[:, :k]
        out = qf * expanded
    else:
        raise ValueError(f"not an FP8 kind: {kind}")
    return out.to(dtype)


def _to_fp8(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def _blocked(w: torch.Tensor) -> torch.Tensor:
    n, k = w.shape
    nb, kb = ceil_div(n, FP8_BLOCK), ceil_div(k, FP8_BLOCK)
    padded = torch.nn.functional.pad(w, (0, kb * FP8_BLOCK - k, 0, nb * FP8_BLOCK - n))
    return padded.reshape(nb, FP8_BLOCK, kb, FP8_BLOCK)


def _unblocked(blocks: torch.Tensor, n: int, k: int) -> torch.Tensor:
    nb, _, kb, _ = blocks.shape
    return blocks.reshape(nb * FP8_BLOCK, kb * FP8_BLOCK)[:n, :k].contiguous()
