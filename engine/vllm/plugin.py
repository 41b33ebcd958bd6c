"""vLLM general plugin (entry point ``vllm.general_plugins``): registers the ``warmgate`` load format.

vLLM calls ``register`` in every process it starts, so ``vllm serve --load-format warmgate`` works too,
with ``--model-loader-extra-config '{"cache_socket": "...", "weights": "ipc"}'``.
"""

from __future__ import annotations


def register() -> None:
    import engine.vllm.loader  # noqa: F401  (registration happens at import)
