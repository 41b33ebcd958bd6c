"""Fill a cache: read and validate a checkpoint, run the engine backend's weight processor, pack arenas.

Everything that can fail (validation, an unsupported scheme, running out of memory) happens
here, before the cache process binds its socket: a rejected checkpoint never becomes a
half-loaded cache.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from cache.arena import Arena, create_arena, dtype_name, plan_layout
from cache.checkpoint.reader import read_checkpoint
from cache.manifest import ArenaInfo, Manifest, cache_key, layer_metadata
from cache.processors import compute_dtype
from cache.processors.native import LAYOUT_VERSION, process_checkpoint

log = logging.getLogger("warmgate.cache")


@dataclass
class LoadedCache:
    manifest: Manifest
    arenas: list[Arena]
    phases: dict[str, float] = field(default_factory=dict)


def load_cache(model: Path, device: torch.device, dtype: str = "auto", backend: str = "native") -> LoadedCache:
    """Validated, processed, packed: the manifest and the sealed arenas that back it."""
    phases: dict[str, float] = {}
    t = time.perf_counter()
    ckpt = read_checkpoint(model)
    compute = compute_dtype(device, dtype, backend)
    key = cache_key(ckpt, device, compute, backend)
    phases["validate"] = time.perf_counter() - t

    t = time.perf_counter()
    layers: dict[str, dict[str, Any]] = {}
    state: dict[str, Any] = {}
    if backend == "vllm":
        from cache.processors import vllm

        processed_model = vllm.process(model, device, compute)
        tensors, state = processed_model.tensors, processed_model.state
    else:
        processed = process_checkpoint(ckpt, device, compute)
        tensors = {name: tensor.contiguous() for name, tensor in processed.tensors.items()}
    phases["process"] = time.perf_counter() - t

    t = time.perf_counter()
    entries, size = plan_layout(tensors)
    arena = create_arena(size, device)
    arena.fill(entries, tensors)
    arena.seal()
    if backend == "native":
        layers = {
            module: layer_metadata(recipe, any(e.name == f"{module}.input_scale" for e in entries))
            for module, recipe in processed.recipes.items()
        }
        del processed.tensors
    else:
        del processed_model
    del tensors
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the processed copies are in the arena now
    phases["pack"] = time.perf_counter() - t

    manifest = Manifest(
        key=key,
        layout_version=LAYOUT_VERSION,
        model=str(model.resolve()),
        device=str(device),
        dtype=dtype_name(compute),
        config=ckpt.config,
        arenas=[ArenaInfo(0, arena.size, arena.transport)],
        tensors=entries,
        layers=layers,
        backend=backend,
        state=state,
    )
    return LoadedCache(manifest, [arena], phases)
