"""What "within FP8 rounding" means, as one check shared by the tests and the benchmark."""

from __future__ import annotations

import torch

from cache.checkpoint.schemes import FP8_BLOCK, WeightKind

# e4m3 has 3 mantissa bits: rounding moves a normal value by at most 2^-4 of itself; below
# the normal range the step is 2^-9 (times the scale). The bf16 result adds 2^-9 relative.
E4M3_REL, E4M3_SUBNORMAL_STEP, BF16_REL = 2.0**-4, 2.0**-9, 2.0**-8


def rounding_bound(w: torch.Tensor, scale: torch.Tensor, kind: WeightKind) -> torch.Tensor:
    """Per-element largest |dequant(quant(w)) - w| that FP8 rounding (then bf16) allows."""
    n, k = w.shape
    s = scale.float()
    if kind is WeightKind.FP8_BLOCK:
        s = s.repeat_interleave(FP8_BLOCK, 0)[:n].repeat_interleave(FP8_BLOCK, 1)[:, :k]
    else:
        s = s.reshape(-1, 1) if kind is WeightKind.FP8_CHANNEL else s.reshape(())
    wa = w.float().abs()
    return (E4M3_REL * wa + s * E4M3_SUBNORMAL_STEP / 2) * (1 + BF16_REL) + BF16_REL * wa


def max_relative_error(deq: torch.Tensor, w: torch.Tensor) -> float:
    """max |deq - w| / max |w|: the figure reported per scheme."""
    return float((deq.float() - w.float()).abs().max() / w.float().abs().max())
