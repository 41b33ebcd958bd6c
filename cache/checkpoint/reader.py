"""Open a Hugging Face checkpoint directory: config, per-layer schemes, tensor index, validation.

Every component reads checkpoints through ``read_checkpoint``; it either returns a
checkpoint warmgate can serve or raises a CheckpointError naming the layer and field.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from cache.checkpoint.architecture import ModelLayout
from cache.checkpoint.fp8 import dequantize_weight
from cache.checkpoint.quant_config import parse_schemes
from cache.checkpoint.schemes import LinearScheme
from cache.checkpoint.tensor_index import FileInfo, TensorInfo, index_tensors
from cache.checkpoint.validate import check_scales, check_tensors
from cache.errors import CheckpointError, CorruptCheckpoint

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
    "generation_config.json", "vocab.json", "merges.txt",
)  # fmt: skip


@dataclass
class Checkpoint:
    path: Path
    config: dict[str, Any]
    layout: ModelLayout
    schemes: dict[str, LinearScheme]  # Linear module name -> scheme
    files: list[FileInfo]
    tensors: dict[str, TensorInfo]
    _handles: dict[Path, Any] = field(default_factory=dict, repr=False)

    def tensor(self, name: str) -> torch.Tensor:
        """Load one tensor (memory-mapped read of its file)."""
        info = self.tensors[name]
        handle = self._handles.get(info.file)
        if handle is None:
            try:
                handle = self._handles[info.file] = safe_open(str(info.file), framework="pt")
            except Exception as exc:  # safetensors raises its own error types
                raise CorruptCheckpoint(f"cannot open: {exc}", path=str(info.file)) from None
        return handle.get_tensor(name)

    def dequantized_state_dict(self, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
        """A plain float state dict: FP8 weights multiplied out (for references and tests, not serving)."""
        out: dict[str, torch.Tensor] = {}
        for name in self.tensors:
            module, _, leaf = name.rpartition(".")
            scheme = self.schemes.get(module)
            if scheme is None or not scheme.quantized:
                if not self.layout.ignored(name):
                    out[name] = self.tensor(name).to(dtype)
            elif leaf == "weight":
                out[name] = dequantize_weight(self.tensor(name), self.tensor(f"{module}.weight_scale"),
                                              scheme.weight, dtype)  # fmt: skip
        return out

    @property
    def weight_bytes(self) -> int:
        return sum(t.offsets[1] - t.offsets[0] for t in self.tensors.values())

    def summary(self) -> list[str]:
        """Human-readable per-layer scheme summary (layers grouped across depth)."""
        s = self.layout.shape
        lines = [
            f"{self.path}",
            f"  {s.model_type}: {s.layers} layers, hidden {s.hidden}, intermediate {s.intermediate}, "
            f"heads {s.heads}/{s.kv_heads} kv, head_dim {s.head_dim}, vocab {s.vocab}, "
            f"tied embeddings {'yes' if s.tied_embeddings else 'no'}",
            f"  {len(self.tensors)} tensors, {self.weight_bytes / 1e6:.1f} MB in {len(self.files)} file(s)",
        ]
        groups: dict[tuple[str, str], list[str]] = defaultdict(list)
        for module, scheme in self.schemes.items():
            m = re.match(r"model\.layers\.(\d+)\.(.*)", module)
            key = (f"model.layers.*.{m.group(2)}" if m else module, scheme.describe())
            groups[key].append(m.group(1) if m else "")
        width = max(len(k[0]) for k in groups)
        for (pattern, desc), idx in groups.items():
            n, k = self.layout.linears[pattern.replace("*", idx[0]) if idx[0] else pattern]
            count = f"x{len(idx)}" if idx[0] else "  "
            lines.append(f"  {pattern:<{width}} {count:>4}  [{n}, {k}]  {desc}")
        if self.layout.shape.tied_embeddings:
            lines.append(f"  {'lm_head':<{width}}       tied to model.embed_tokens (unquantized)")
        return lines


def read_checkpoint(path: str | Path, *, check_values: bool = True) -> Checkpoint:
    """Parse and validate a checkpoint directory; raises CheckpointError with a one-line reason."""
    ckpt_dir = Path(path)
    config_path = ckpt_dir / "config.json"
    if not config_path.is_file():
        raise CheckpointError("no config.json (not a Hugging Face checkpoint directory)", path=str(ckpt_dir))
    try:
        config = json.loads(config_path.read_text())
    except ValueError as exc:
        raise CorruptCheckpoint(f"config.json is not valid JSON: {exc}", path=str(config_path)) from None
    layout = ModelLayout.from_config(config)
    schemes = parse_schemes(config.get("quantization_config"), layout.linears)
    files, tensors = index_tensors(ckpt_dir)
    check_tensors(layout, schemes, tensors)
    ckpt = Checkpoint(ckpt_dir, config, layout, schemes, files, tensors)
    if check_values:
        check_scales(ckpt)
    return ckpt
