"""Engine settings: one pydantic model, read from a JSON/TOML file or a JSON string."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Path
    served_model_name: str | None = None  # default: the checkpoint directory's name
    device: str = "cpu"  # cpu, cuda, cuda:1
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: fp32 on CPU, bf16 on CUDA
    max_num_seqs: int = Field(16, ge=1)
    max_model_len: int | None = Field(None, ge=16)  # default: min(model's context, 4096)
    kv_cache_bytes: int | None = Field(None, ge=1)  # cap on KV memory; fewer sequences fit if it binds
    max_num_batched_tokens: int = Field(2048, ge=16)  # tokens per scheduler step (prompt chunks + decode)
    block_size: int = Field(16, ge=1, le=256)  # KV cache positions per block
    cuda_graphs: bool = True
    weights: Literal["disk", "ipc", "ipc-or-disk"] = "disk"
    cache_socket: Path | None = None
    default_max_tokens: int = Field(256, ge=1)

    @model_validator(mode="after")
    def _cache_socket_for_ipc(self) -> EngineConfig:
        if self.weights != "disk" and self.cache_socket is None:
            raise ValueError(f"weights={self.weights!r} needs cache_socket (the cache process's socket)")
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
