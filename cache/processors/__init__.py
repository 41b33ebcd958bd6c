"""One weight processor per engine backend: checkpoint tensors -> exactly the tensors its kernels consume.

``native`` is warmgate's own (processors/native.py); ``vllm`` lets vLLM build the model and run its own
``process_weights_after_loading`` (processors/vllm.py). The cache process runs a processor once; that
backend's disk path runs the very same code. The processor's id (name and version) is part of the cache
key, so an engine never attaches weights another backend's processor laid out.
"""

from __future__ import annotations

import torch

from cache.processors import native

BACKENDS = ("native", "vllm")


def processor_id(backend: str) -> str:
    """``name/version`` of a backend's processor (cheap: the vLLM one reads package metadata, not vLLM)."""
    if backend == "native":
        return f"native/{native.LAYOUT_VERSION}"
    if backend == "vllm":
        from cache.processors import vllm

        return vllm.processor_id()
    raise ValueError(f"unknown engine backend {backend!r} (supported: {', '.join(BACKENDS)})")


def compute_dtype(device: torch.device, requested: str = "auto", backend: str = "native") -> torch.dtype:
    """The dtype unquantized tensors are kept in: as requested, else the backend's default for the device."""
    if backend == "vllm":
        return getattr(torch, requested) if requested != "auto" else torch.bfloat16  # type: ignore[no-any-return]
    return native.compute_dtype(device, requested)
