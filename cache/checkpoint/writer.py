"""Write checkpoint directories: safetensors shards streamed to disk, config, tokenizer files.

Output goes to a temporary sibling directory that is renamed into place only once it is
complete and validated, so an interrupted run never leaves a half-written checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from cache.checkpoint.reader import TOKENIZER_FILES, read_checkpoint

DEFAULT_SHARD_BYTES = 2 * 1024**3


class ShardWriter:
    """Buffers tensors and flushes a safetensors shard whenever the buffer passes ``shard_bytes``."""

    def __init__(self, out: Path, shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
        self.out = out
        self.shard_bytes = shard_bytes
        self._buffer: dict[str, torch.Tensor] = {}
        self._buffered = 0
        self._shards: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        t = tensor.detach().to("cpu").contiguous()
        self._buffer[name] = t
        self._buffered += t.numel() * t.element_size()
        if self._buffered >= self.shard_bytes:
            self._flush()

    def _flush(self) -> None:
        if not self._buffer:
            return
        path = self.out / f"shard-{len(self._shards):05d}.tmp"
        save_file(self._buffer, str(path), metadata={"format": "pt"})
        self._shards.append((path, list(self._buffer)))
        self.total_bytes += self._buffered
        self._buffer, self._buffered = {}, 0

    def close(self) -> None:
        """Name the shards as Hugging Face does and write the index when there is more than one."""
        self._flush()
        count = len(self._shards)
        if count == 1:
            self._shards[0][0].rename(self.out / "model.safetensors")
            return
        weight_map = {}
        for i, (path, names) in enumerate(self._shards):
            final = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            path.rename(self.out / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


@contextlib.contextmanager
def staged_output(out: Path, *, force: bool = False) -> Iterator[Path]:
    """Yield a temporary directory that replaces ``out`` only if the block completes and validates."""
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not force:
        raise FileExistsError(f"{out} already exists and is not empty (pass --force to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield tmp
        read_checkpoint(tmp)  # never publish a checkpoint our own reader would refuse
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def write_config(out: Path, config: dict[str, Any]) -> None:
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def copy_tokenizer(src: Path, out: Path) -> list[str]:
    """Copy the tokenizer and generation files that exist in ``src``; returns their names."""
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)
            copied.append(name)
    return copied
