"""Device resolution: the one place where a device setting ("auto", "cpu", "cuda", "cuda:1") becomes a device; and
small host lists put on a device without waiting for it.

Every process resolves its setting with this function: the cache key and the manifest name the
device, so the cache process and the engines must arrive at the same name for the same setting.
"""

from __future__ import annotations

import torch

AUTO = "auto"  # CUDA when torch sees a GPU, else the CPU


def resolve_device(device: str | torch.device) -> torch.device:
    """A concrete device: "auto" becomes "cuda" when torch sees a GPU, else "cpu"; "cuda" becomes
    "cuda:N" (the current one)."""
    if device == AUTO:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    target = torch.device(device)
    if target.type == "cuda" and target.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return target


def to_device(values: list[int] | list[float], device: torch.device) -> torch.Tensor:
    """A small tensor of ``values`` on ``device``, copied from pinned memory on CUDA: a copy from pageable memory
    waits for the device to finish what was queued before it (in the engine: a step's forward, beside which the
    host means to launch the next step)."""
    host = torch.tensor(values)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
