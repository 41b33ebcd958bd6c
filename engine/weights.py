"""Where an engine's weights come from. Disk now; the cache process adds an attach source."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from cache.checkpoint.reader import read_checkpoint
from cache.processing import ProcessedWeights, process_checkpoint


@dataclass
class LoadedWeights:
    config: dict[str, Any]  # the checkpoint's config.json
    weights: ProcessedWeights
    source: str  # "disk" or "ipc"


class WeightSource(Protocol):
    def load(self, device: torch.device, dtype: torch.dtype) -> LoadedWeights: ...


class DiskWeights:
    """Read and validate the checkpoint, then run the same processing the cache process runs."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self, device: torch.device, dtype: torch.dtype) -> LoadedWeights:
        ckpt = read_checkpoint(self.path)
        return LoadedWeights(ckpt.config, process_checkpoint(ckpt, device, dtype), "disk")
