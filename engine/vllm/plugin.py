"""vLLM general plugin (entry point ``vllm.general_plugins``): registers the ``warmgate`` load format.

vLLM calls ``register`` in every process it starts, so ``vllm serve --load-format warmgate`` works too,
with ``--model-loader-extra-config '{"cache_socket": "...", "weights": "ipc"}'``.
"""

from __future__ import annotations

import functools
from typing import Any


def register() -> None:
    import engine.vllm.loader  # noqa: F401  (registration happens at import)

    cpu_scaled_mm_without_onednn()


def cpu_scaled_mm_without_onednn() -> None:
    """FP8 layers that vLLM has no CPU kernel of its own for (per-channel everywhere; per-tensor without AMX) run
    ``torch._scaled_mm``. On a CPU with AMX tiles but no AMX-FP8, torch hands that product to oneDNN, which took
    0.15-0.66 s for a 4-17 x 576 x 1536 one where torch's own path (oneDNN off: the operands dequantized, then
    multiplied) took 0.01-0.02 s, to the same values within 4e-6; on the FP8 per-channel demo a 4-token prompt's first
    step went from 88 s to 4.0 s (docs/vllm.md). So CPU calls run with oneDNN off (torch's flag is the process's:
    vLLM's CPU engine runs its model on one thread); others are untouched. Once per process."""
    import torch

    original = torch._scaled_mm
    if getattr(original, "warmgate_cpu", False):
        return

    @functools.wraps(original)
    def scaled_mm(a: torch.Tensor, b: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if a.device.type != "cpu":
            return original(a, b, *args, **kwargs)
        enabled = torch.backends.mkldnn.enabled
        torch.backends.mkldnn.enabled = False  # type: ignore[assignment]  # a module property: sets the flag
        try:
            return original(a, b, *args, **kwargs)
        finally:
            torch.backends.mkldnn.enabled = enabled

    scaled_mm.warmgate_cpu = True  # type: ignore[attr-defined]
    torch._scaled_mm = scaled_mm  # type: ignore[assignment]
