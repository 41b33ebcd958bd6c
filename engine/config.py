"""A worker's settings (common/settings.py's engine settings + model and cache), from a file or JSON."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

from pydantic import Field, model_validator

from common.settings import EngineSettings


class EngineConfig(EngineSettings):
    """One worker's settings: the shared engine settings, its model and the cache process's socket."""

    model: Path
    served_model_name: str | None = None  # default: the checkpoint directory's name
    cache_socket: Path | None = None  # none: no cache (ipc-or-disk reads the checkpoint)
    kv_share: int = Field(1, ge=1)  # engines holding a KV cache on the device at once (engine/memory_plan.py)
    engines: int = Field(1, ge=1)  # engines on the device at once, standbys too (engine/memory_plan.py)
    # The KV cache is only reserved at start and committed by POST /activate (engine/native/kv_memory.py): set by
    # the gateway, whose supervisor activates every engine before any request is routed to it. (A request to an
    # engine not activated would run on the placeholder: nobody else sets it.)
    reserve_kv: bool = False
    # Capture the CUDA graphs once serving, between steps (eager steps until each is captured): set by the gateway
    # for an engine a restart starts while clients wait for it (the fork path). On the H200 beside a busy engine the
    # graphs' warm-ups and captures took 1.1-1.6 s of its 2.1-2.8 s start. Standbys capture theirs before ready.
    graphs_while_serving: bool = False

    @model_validator(mode="after")
    def _cache_socket_for_ipc(self) -> EngineConfig:
        if self.weights == "ipc" and self.cache_socket is None:
            raise ValueError("weights='ipc' needs cache_socket (the cache process's socket)")
        return self

    @property
    def name(self) -> str:
        return self.served_model_name or self.model.name

    @classmethod
    def load(cls, source: str) -> EngineConfig:
        """From a path to a .json/.toml file, or from a JSON object given inline."""
        text = source.strip()
        if text.startswith("{"):
            return cls.model_validate(json.loads(text))
        path = Path(source)
        data = tomllib.loads(path.read_text()) if path.suffix == ".toml" else json.loads(path.read_text())
        return cls.model_validate(data)
