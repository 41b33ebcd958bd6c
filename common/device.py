"""Device resolution: the one place where a device setting ("auto", "cpu", "cuda", "cuda:1") becomes a device.

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
