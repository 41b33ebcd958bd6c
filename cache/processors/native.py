"""Weight processing: checkpoint tensors -> exactly the tensors the selected kernel consumes.

The cache process runs this once and keeps the result; the engine's disk path runs the
very same code. Each Linear layer gets a LinearRecipe (its kernel name, padding and
scheme) that the engine restores and checks; the engine refuses kernels it does not know.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from cache.checkpoint.fp8 import dequantize_weight
from cache.checkpoint.reader import Checkpoint
from cache.checkpoint.schemes import FP8_BLOCK, Activations, LinearScheme, WeightKind

LAYOUT_VERSION = 1

# Kernel names: the contract between processing and the engine's implementations.
DENSE = "dense"  # weight [N, K] in the compute dtype
# CPU and GPUs without FP8 units: dequantized once, here, to the compute dtype, then a dense matmul.
# Converting FP8 on every forward costs ~3 ns an element on CPU (2.4 tok/s for the demo, against 16.5).
FP8_DEQUANT = "fp8-dequantized"
FP8_BLOCK_SCALED_MM = "fp8-block-scaled-mm"  # CUDA cc >= 9.0: scaled_mm BlockWise1x128 x BlockWise128x128
FP8_ROWWISE_SCALED_MM = "fp8-rowwise-scaled-mm"  # CUDA cc >= 8.9: per-token x per-channel scales

ROWWISE_K_MULTIPLE = 16  # scaled_mm needs K (and N) to be multiples of 16


@dataclass(frozen=True)
class LinearRecipe:
    """What processing did to one Linear layer; recorded in the manifest, restored by the engine."""

    kernel: str
    weight: str  # WeightKind value
    activations: str  # Activations value
    out_features: int  # logical N, K (before padding)
    in_features: int
    padded_out: int  # stored N, K (after padding)
    padded_in: int
    has_bias: bool = False
    # A merged layer (q/k/v, gate/up): (module, first output column, columns) of each part.
    parts: tuple[tuple[str, int, int], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def part(self, name: str) -> slice:
        for module, offset, size in self.parts:
            if module == name:
                return slice(offset, offset + size)
        raise KeyError(f"{name} is not part of this merged layer")


# Projections that read the same input run as one GEMM: fewer launches, one weight stream.
MERGES = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


@dataclass
class ProcessedWeights:
    """All tensors an engine binds, by checkpoint name, plus a recipe per Linear module."""

    tensors: dict[str, torch.Tensor]
    recipes: dict[str, LinearRecipe]
    dtype: torch.dtype
    device: torch.device


def compute_dtype(device: torch.device, requested: str = "auto") -> torch.dtype:
    """fp32 on CPU (exact against references, and CPU bf16 matmuls are slow), bf16 on CUDA."""
    if requested != "auto":
        return getattr(torch, requested)  # type: ignore[no-any-return]
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def select_kernel(scheme: LinearScheme, device: torch.device) -> str:
    """The one kernel-selection function: the cache process and the engine both call it."""
    if not scheme.quantized:
        return DENSE
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if scheme.weight is WeightKind.FP8_BLOCK and major >= 9:
            return FP8_BLOCK_SCALED_MM
        dynamic_token = scheme.activations is Activations.DYNAMIC_TOKEN
        if scheme.weight is not WeightKind.FP8_BLOCK and dynamic_token and (major, minor) >= (8, 9):
            return FP8_ROWWISE_SCALED_MM
    return FP8_DEQUANT


def process_checkpoint(ckpt: Checkpoint, device: torch.device, dtype: torch.dtype) -> ProcessedWeights:
    """Run processing for every tensor of a validated checkpoint."""
    tensors: dict[str, torch.Tensor] = {}
    recipes: dict[str, LinearRecipe] = {}
    linears = ckpt.layout.linears
    for name in ckpt.tensors:
        module, _, leaf = name.rpartition(".")
        if ckpt.layout.ignored(name) or (module in linears and leaf != "weight"):
            continue  # scales and biases are taken with their weight
        if module not in linears:
            tensors[name] = ckpt.tensor(name).to(device=device, dtype=dtype)
            continue
        scheme = ckpt.schemes[module]
        parts = {leaf: ckpt.tensor(f"{module}.{leaf}") for leaf in ("weight", "weight_scale", "input_scale", "bias")
                 if f"{module}.{leaf}" in ckpt.tensors}  # fmt: skip
        out, recipe = process_linear(scheme, select_kernel(scheme, device), parts, dtype, device)
        recipes[module] = recipe
        tensors.update({f"{module}.{k}": v for k, v in out.items()})
    for i in range(ckpt.layout.shape.layers):
        for merged, members in MERGES.items():
            merge_linears(tensors, recipes, f"model.layers.{i}.{merged}", [f"model.layers.{i}.{m}" for m in members])
    return ProcessedWeights(tensors, recipes, dtype, device)


def merge_linears(tensors: dict[str, torch.Tensor], recipes: dict[str, LinearRecipe], merged: str,
                  members: list[str]) -> None:  # fmt: skip
    """Stack processed layers that share their input along N, when they share kernel and scheme."""
    first = recipes[members[0]]
    same = {(r.kernel, r.weight, r.activations, r.padded_in, r.has_bias) for r in (recipes[m] for m in members)}
    if len(same) != 1 or any(f"{m}.input_scale" in tensors for m in members):
        return  # mixed schemes stay separate layers
    parts, offset = [], 0
    for m in members:
        parts.append((m, offset, recipes[m].out_features))
        offset += recipes[m].padded_out
    # Rowwise scales are [1, N]; everything else stacks along dim 0 (block scales: rows of 128 outputs).
    for leaf in ("weight", "weight_scale", "bias"):
        pieces = [tensors.pop(f"{m}.{leaf}") for m in members if f"{m}.{leaf}" in tensors]
        if not pieces:
            continue
        if leaf == "bias":
            pieces = [
                _pad_vec_zeros(b, recipes[m].padded_out - b.shape[0]) for b, m in zip(pieces, members, strict=True)
            ]
        dim = 1 if leaf == "weight_scale" and first.kernel == FP8_ROWWISE_SCALED_MM else 0
        tensors[f"{merged}.{leaf}"] = torch.cat(pieces, dim=dim)
    for m in members:
        del recipes[m]
    recipes[merged] = LinearRecipe(first.kernel, first.weight, first.activations, offset, first.in_features, offset,
                                   first.padded_in, first.has_bias, tuple(parts))  # fmt: skip


def process_linear(
    scheme: LinearScheme, kernel: str, parts: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device
) -> tuple[dict[str, torch.Tensor], LinearRecipe]:
    """One Linear layer's checkpoint tensors -> its kernel's tensors and recipe."""
    w = parts["weight"]
    n, k = w.shape
    out: dict[str, torch.Tensor] = {}
    pad_n, pad_k = 0, 0
    if kernel == DENSE:
        out["weight"] = w.to(device=device, dtype=dtype)
    elif kernel == FP8_DEQUANT:
        out["weight"] = dequantize_weight(w.to(device), parts["weight_scale"].to(device), scheme.weight, dtype)
    elif kernel == FP8_BLOCK_SCALED_MM:
        # The block kernels tile N and K by 128: pad with zeros (the scale is already ceil(N/128) x ceil(K/128)).
        pad_n, pad_k = -n % FP8_BLOCK, -k % FP8_BLOCK
        out["weight"] = _pad(w.to(device), pad_n, pad_k)
        out["weight_scale"] = parts["weight_scale"].to(device=device, dtype=torch.float32).contiguous()
    elif kernel == FP8_ROWWISE_SCALED_MM:
        pad_n, pad_k = -n % ROWWISE_K_MULTIPLE, -k % ROWWISE_K_MULTIPLE
        out["weight"] = _pad(w.to(device), pad_n, pad_k)
        scale = parts["weight_scale"].to(device=device, dtype=torch.float32).reshape(-1)
        out["weight_scale"] = _pad_vec(scale.expand(n).contiguous(), pad_n).reshape(1, n + pad_n)
    else:
        raise ValueError(f"unknown kernel {kernel!r}")
    if "input_scale" in parts and kernel not in (DENSE, FP8_DEQUANT):
        out["input_scale"] = parts["input_scale"].to(device=device, dtype=torch.float32).reshape(())
    if "bias" in parts:
        out["bias"] = parts["bias"].to(device=device, dtype=dtype)
    recipe = LinearRecipe(kernel, scheme.weight.value, scheme.activations.value, n, k, n + pad_n, k + pad_k,
                          "bias" in parts)  # fmt: skip
    return out, recipe


def _pad(w: torch.Tensor, pad_n: int, pad_k: int) -> torch.Tensor:
    if not (pad_n or pad_k):
        return w.contiguous()
    out = torch.zeros(w.shape[0] + pad_n, w.shape[1] + pad_k, dtype=w.dtype, device=w.device)
    out[: w.shape[0], : w.shape[1]] = w
    return out


def _pad_vec_zeros(v: torch.Tensor, pad: int) -> torch.Tensor:
    return torch.cat([v, v.new_zeros(pad)]) if pad else v


def _pad_vec(v: torch.Tensor, pad: int) -> torch.Tensor:
    return torch.cat([v, torch.ones(pad, dtype=v.dtype, device=v.device)]) if pad else v
