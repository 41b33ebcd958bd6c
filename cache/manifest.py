"""What the cache holds, and under which key: the manifest an engine receives when it attaches.

The cache key names exactly what was cached: the checkpoint's identity (config.json, every
safetensors header, file sizes and modification times), the processing recipe (per-layer
scheme and the kernel ``select_kernel`` picks for the device, compute dtype, device kind)
and warmgate's layout version. The cache process and the engine compute it with the same
function from the checkpoint's metadata alone, so an engine can tell whether the cached
weights are the ones it would have produced itself without reading any tensor data.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from cache.arena import TensorEntry
from cache.checkpoint.architecture import ModelLayout
from cache.checkpoint.quant_config import parse_schemes
from cache.checkpoint.reader import Checkpoint
from cache.checkpoint.schemes import LinearScheme, WeightKind
from cache.checkpoint.tensor_index import FileInfo, read_raw_header, safetensors_files
from cache.errors import CheckpointError
from cache.processors import processor_id
from cache.processors.native import LAYOUT_VERSION, MERGES, LinearRecipe, select_kernel

WEIGHT_LAYOUT = "NK"  # weights stay [out, in] (block FP8 untransposed); scales as compressed-tensors stores them


def cache_key(ckpt: Checkpoint, device: torch.device, dtype: torch.dtype, backend: str = "native") -> str:
    """sha256 over checkpoint identity + processor + processing recipe + layout version (hex, 64 chars)."""
    return _key(ckpt.config, ckpt.files, ckpt.schemes, device, dtype, backend)


def expected_key(path: Path, device: torch.device, dtype: torch.dtype, backend: str = "native") -> str:
    """The same key from metadata alone (config.json, raw safetensors headers, file stats): what an
    engine computes before attaching, in a few milliseconds, without validating or reading tensors."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read config.json: {exc}", path=str(path)) from None
    schemes = parse_schemes(config.get("quantization_config"), ModelLayout.from_config(config).linears)
    files = [read_raw_header(f) for f in safetensors_files(path)]
    return _key(config, files, schemes, device, dtype, backend)


def _key(config: dict[str, Any], files: list[FileInfo], schemes: dict[str, LinearScheme], device: torch.device,
         dtype: torch.dtype, backend: str) -> str:  # fmt: skip
    h = hashlib.sha256()

    def add(label: str, value: Any) -> None:
        h.update(f"{label}={json.dumps(value, sort_keys=True, default=str)}\n".encode())

    add("layout_version", LAYOUT_VERSION)
    add("processor", processor_id(backend))
    add("config", config)
    for f in files:
        add("file", [f.path.name, f.size, f.path.stat().st_mtime_ns])
        h.update(hashlib.sha256(f.header).digest())
    add("device", device.type)
    add("dtype", str(dtype))
    if backend == "native":  # vLLM picks its own kernels: its version, in the processor id, stands for them
        add("merges", MERGES)
        add("recipe", {m: [s.weight.value, s.activations.value, select_kernel(s, device)] for m, s in schemes.items()})
    else:
        add("schemes", {m: [s.weight.value, s.activations.value] for m, s in schemes.items()})
    return h.hexdigest()


@dataclass(frozen=True)
class ArenaInfo:
    index: int
    size: int
    transport: str  # arena.MEMFD or arena.CUDA_VMM


@dataclass(frozen=True)
class Manifest:
    key: str
    layout_version: int
    model: str  # the checkpoint directory the cache loaded
    device: str  # "cpu", "cuda:0"
    dtype: str  # compute dtype of unquantized tensors, e.g. "bfloat16"
    config: dict[str, Any]  # the checkpoint's config.json
    arenas: list[ArenaInfo]
    tensors: list[TensorEntry]
    layers: dict[str, dict[str, Any]]  # native: Linear module -> recipe + block size + weight layout
    backend: str = "native"  # whose processor laid the tensors out
    state: dict[str, Any] = field(default_factory=dict)  # what that backend's binding needs beyond tensors

    @property
    def nbytes(self) -> int:
        return sum(a.size for a in self.arenas)

    def recipes(self) -> dict[str, LinearRecipe]:
        """The per-layer recipes, checked against what this warmgate understands."""
        out = {}
        for module, layer in self.layers.items():
            if layer.get("weight_layout") != WEIGHT_LAYOUT:
                raise ValueError(f"{module}: weight layout {layer.get('weight_layout')!r}, expected {WEIGHT_LAYOUT}")
            block = layer.get("block_size")
            if layer["weight"] == WeightKind.FP8_BLOCK.value and block != [128, 128]:
                raise ValueError(f"{module}: block size {block}, expected [128, 128]")
            fields = {k: v for k, v in layer.items() if k not in ("block_size", "weight_layout", "input_scale")}
            fields["parts"] = tuple(tuple(p) for p in fields.get("parts", ()))
            out[module] = LinearRecipe(**fields)
        return out

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Manifest:
        return cls(
            key=data["key"],
            layout_version=int(data["layout_version"]),
            model=data["model"],
            device=data["device"],
            dtype=data["dtype"],
            config=data["config"],
            arenas=[ArenaInfo(**a) for a in data["arenas"]],
            tensors=[_entry(t) for t in data["tensors"]],
            layers=data["layers"],
            backend=data.get("backend", "native"),
            state=data.get("state", {}),
        )


def _entry(t: dict[str, Any]) -> TensorEntry:
    return TensorEntry(t["name"], int(t["arena"]), int(t["offset"]), t["dtype"], tuple(t["shape"]), tuple(t["stride"]))


def layer_metadata(recipe: LinearRecipe, has_input_scale: bool) -> dict[str, Any]:
    """What an engine must restore for one Linear layer, beyond its tensors."""
    block = [128, 128] if recipe.weight == WeightKind.FP8_BLOCK.value else None
    return {
        **recipe.to_dict(),
        "block_size": block,
        "weight_layout": WEIGHT_LAYOUT,
        "input_scale": "static" if has_input_scale else "dynamic" if recipe.activations != "none" else "none",
    }
