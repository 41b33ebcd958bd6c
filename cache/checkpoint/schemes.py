"""The per-layer weight schemes warmgate serves (DESIGN.md, "Weight formats")."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

FP8_BLOCK = 128  # the only weight block size served: 128 x 128
FP8_MAX = 448.0  # largest finite float8_e4m3fn


class WeightKind(StrEnum):
    UNQUANTIZED = "unquantized"
    FP8_TENSOR = "fp8-tensor"
    FP8_CHANNEL = "fp8-channel"
    FP8_BLOCK = "fp8-block"


class Activations(StrEnum):
    NONE = "none"  # unquantized layer: activations stay in the compute dtype
    DYNAMIC_TOKEN = "dynamic-per-token"
    DYNAMIC_GROUP = "dynamic-per-token-group-128"
    STATIC_TENSOR = "static-per-tensor"


@dataclass(frozen=True)
class LinearScheme:
    """How one Linear layer's weight is stored and how its input is quantized."""

    weight: WeightKind
    activations: Activations = Activations.NONE

    @property
    def quantized(self) -> bool:
        return self.weight is not WeightKind.UNQUANTIZED

    @property
    def block(self) -> tuple[int, int] | None:
        return (FP8_BLOCK, FP8_BLOCK) if self.weight is WeightKind.FP8_BLOCK else None

    def scale_shape(self, n: int, k: int) -> tuple[int, ...]:
        """Shape of ``weight_scale`` for an [n, k] weight (compressed-tensors layout)."""
        if self.weight is WeightKind.FP8_BLOCK:
            return (ceil_div(n, FP8_BLOCK), ceil_div(k, FP8_BLOCK))
        if self.weight is WeightKind.FP8_CHANNEL:
            return (n, 1)
        if self.weight is WeightKind.FP8_TENSOR:
            return (1,)
        return ()

    def describe(self) -> str:
        if not self.quantized:
            return "unquantized"
        if self.weight is WeightKind.FP8_BLOCK:
            return f"fp8-block {FP8_BLOCK}x{FP8_BLOCK}, activations {self.activations.value}"
        return f"{self.weight.value}, activations {self.activations.value}"


UNQUANTIZED = LinearScheme(WeightKind.UNQUANTIZED)

# The scheme each `--scheme` name writes; dynamic activations need no calibration data.
WRITE_SCHEMES: dict[str, LinearScheme] = {
    "bf16": UNQUANTIZED,
    "fp8-block": LinearScheme(WeightKind.FP8_BLOCK, Activations.DYNAMIC_GROUP),
    "fp8-channel": LinearScheme(WeightKind.FP8_CHANNEL, Activations.DYNAMIC_TOKEN),
    "fp8-tensor": LinearScheme(WeightKind.FP8_TENSOR, Activations.DYNAMIC_TOKEN),
}


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)
