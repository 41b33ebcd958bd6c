"""The ``warmgate`` vLLM load format: bind the processed tensors of warmgate's cache process, read-only.

The model is built on the meta device (no weight memory), every cached parameter is bound to its view
of the mapped arena, and only the Python-side state processing would set is rebuilt
(cache/processors/vllm.py: ``restore_processed_state``); no weight is transformed a second time.
Buffers (rotary tables, attention scales: small runtime state that vLLM may update in place) are
private copies; a write into the read-only mapping would fault. Weight policy as for native engines:
``ipc`` attaches or fails, ``ipc-or-disk`` falls back to the checkpoint (logged, reported on /health),
``disk`` loads the checkpoint through the same processing code the cache process runs.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.model_loader.utils import initialize_model
from vllm.utils.torch_utils import set_default_torch_dtype

from cache.client import CacheRefused, CacheUnavailable
from cache.processors.vllm import LOAD_FORMAT, check_restorable, load_processed, restore_processed_state
from common.events import log_event
from engine.weights import WeightKeyMismatch, WeightOrigin, attach_cache

log = logging.getLogger("warmgate.engine.vllm")


@register_model_loader(LOAD_FORMAT)
class WarmgateLoader(BaseModelLoader):
    """Settings come in ``model_loader_extra_config``: ``cache_socket``, ``weights`` (policy), ``engine_name``."""

    def __init__(self, load_config: Any) -> None:
        super().__init__(load_config)
        extra = dict(load_config.model_loader_extra_config or {})
        self.cache_socket = Path(extra["cache_socket"]) if extra.get("cache_socket") else None
        self.policy = extra.get("weights", "ipc-or-disk")
        self.name = extra.get("engine_name") or f"vllm-engine-{os.getpid()}"
        if self.policy not in ("ipc", "ipc-or-disk", "disk"):
            raise ValueError(f"unknown weights policy {self.policy!r} (supported: disk, ipc, ipc-or-disk)")
        if self.policy == "ipc" and self.cache_socket is None:
            raise ValueError("weights='ipc' needs cache_socket (the cache process's socket)")
        self.external_bytes = 0

    def download_model(self, model_config: Any) -> None:
        """Nothing to download: the checkpoint is a local directory, and its weights are in the cache."""

    def load_weights(self, model: nn.Module, model_config: Any) -> None:
        raise NotImplementedError("load_format=warmgate binds processed weights; it does not reload a built model")

    def get_external_weight_memory(self, vllm_config: Any) -> int:
        """Weights held by the cache process, not by this engine (vLLM leaves them out of its KV budget)."""
        return self.external_bytes

    def load_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> nn.Module:
        reason = None
        if self.policy != "disk" and self.cache_socket is not None:
            try:
                return self._attach(vllm_config, model_config, prefix, self.cache_socket)
            except (CacheUnavailable, CacheRefused, WeightKeyMismatch) as exc:
                if self.policy == "ipc":
                    raise
                reason = f"{type(exc).__name__}: {exc}"
            log_event(log, "weights_fallback", policy=self.policy, reason=reason)
        model: Any = load_processed(vllm_config)
        model.warmgate_origin = WeightOrigin("disk", fallback_reason=reason)
        return model

    def _attach(self, vllm_config: Any, model_config: Any, prefix: str, socket_path: Path) -> nn.Module:
        device = torch.device(vllm_config.device_config.device)
        attachment, views, clock = attach_cache(Path(model_config.model), socket_path, self.name, device,
                                                model_config.dtype, "vllm")  # fmt: skip
        try:
            with set_default_torch_dtype(model_config.dtype), torch.device("meta"):
                model: Any = initialize_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)
            check_restorable(model)
            private = bind(model, views, attachment.manifest.state)
            restore_processed_state(model, vllm_config)
            missing = _meta_leftovers(model)
            if missing:
                raise RuntimeError(f"the cache has no tensor for {len(missing)} of the model's: {missing[:3]}")
            clock.lap("bind")
        except BaseException:
            attachment.client.close()
            raise
        model.warmgate_attachment = attachment  # the lease and the mappings live as long as the model
        model.warmgate_origin = WeightOrigin("ipc", attachment.manifest.key, attachment.lease, None, clock.laps)
        self.external_bytes = attachment.manifest.nbytes
        log_event(log, "attach", lease=attachment.lease, bytes=attachment.manifest.nbytes, private_bytes=private,
                  **clock.laps)  # fmt: skip
        return model.eval()


def bind(model: nn.Module, views: dict[str, torch.Tensor], state: dict[str, Any]) -> int:
    """Register each cached tensor on its module (parameters: the mapped view; buffers: a private copy),
    tied aliases to the same object, and parameters processing removed as None. Returns private bytes."""
    modules = dict(model.named_modules(remove_duplicate=False))
    kinds: dict[str, str] = state["kinds"]
    bound: dict[str, torch.Tensor] = {}
    private = 0

    def place(name: str, tensor: torch.Tensor, kind: str) -> None:
        module_name, _, leaf = name.rpartition(".")
        module = modules.get(module_name)
        if module is None:
            raise RuntimeError(f"the cached tensor {name} has no module {module_name!r} in this model")
        module._parameters.pop(leaf, None)
        module._buffers.pop(leaf, None)
        module.__dict__.pop(leaf, None)
        if kind == "param":
            module._parameters[leaf] = tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(tensor, False)
        else:
            module._buffers[leaf] = tensor
        bound[name] = getattr(module, leaf)

    for name, view in views.items():
        kind = kinds[name]
        if kind != "param":
            view = view.clone()
            private += view.numel() * view.element_size()
        place(name, view, kind)
    for alias, canonical in state["aliases"].items():
        place(alias, bound[canonical], kinds[canonical])
    for name in state["none_params"]:
        module_name, _, leaf = name.rpartition(".")
        modules[module_name]._parameters[leaf] = None
    return private


def _meta_leftovers(model: nn.Module) -> list[str]:
    return [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
