"""Where an engine's weights come from: the cache process (attach), or the checkpoint on disk.

Policy (EngineConfig.weights): ``ipc`` attaches or fails; ``ipc-or-disk`` attaches, or loads
from disk when the cache is absent or holds other weights (logged, and reported by the
worker's /health); ``disk`` always loads and processes the checkpoint itself.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from cache.arena import Arena, attach_arena, dtype_of, tensor_views
from cache.checkpoint.reader import read_checkpoint
from cache.client import CacheClient, CacheRefused, CacheUnavailable
from cache.manifest import Manifest, expected_key
from cache.processors.native import ProcessedWeights, process_checkpoint
from common.events import log_event

log = logging.getLogger("warmgate.engine.weights")


class WeightKeyMismatch(RuntimeError):
    """The cache holds weights other than the ones this engine would produce (checkpoint or recipe differ)."""


@dataclass
class Attachment:
    """Keeps an attach alive: the cache connection (the lease) and the mapped arenas."""

    client: CacheClient
    lease: int
    arenas: list[Arena]
    manifest: Manifest


@dataclass(frozen=True)
class WeightOrigin:
    """Where an engine's weights came from, as its /health reports it (every backend)."""

    source: str  # "disk" or "ipc"
    key: str | None = None
    lease: int | None = None
    fallback_reason: str | None = None
    phases: dict[str, float] = field(default_factory=dict)


@dataclass
class LoadedWeights:
    config: dict[str, Any]  # the checkpoint's config.json
    weights: ProcessedWeights
    source: str  # "disk" or "ipc"
    key: str | None = None  # the cache key (ipc)
    attachment: Attachment | None = None
    fallback_reason: str | None = None  # ipc-or-disk: why the cache was not used
    phases: dict[str, float] = field(default_factory=dict)  # attach: key, connect, attach, map, bind (seconds)

    @property
    def origin(self) -> WeightOrigin:
        lease = self.attachment.lease if self.attachment else None
        return WeightOrigin(self.source, self.key, lease, self.fallback_reason, self.phases)


class WeightSource(Protocol):
    def load(self, device: torch.device, dtype: torch.dtype) -> LoadedWeights: ...


class DiskWeights:
    """Read and validate the checkpoint, then run the same processing the cache process runs."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self, device: torch.device, dtype: torch.dtype) -> LoadedWeights:
        ckpt = read_checkpoint(self.path)
        return LoadedWeights(ckpt.config, process_checkpoint(ckpt, device, dtype), "disk")


class CachedWeights:
    """Attach to a cache process: map its arenas read-only, bind the tensors, no processing, no copy.

    The expected key comes from the checkpoint's metadata (config, safetensors headers, file
    stats): no tensor data is read from disk.
    """

    def __init__(self, path: Path, socket_path: Path, name: str = "") -> None:
        self.path = path
        self.socket_path = socket_path
        self.name = name or f"engine-{os.getpid()}"

    def load(self, device: torch.device, dtype: torch.dtype) -> LoadedWeights:
        attachment, tensors, clock = attach_cache(self.path, self.socket_path, self.name, device, dtype, "native")
        try:
            manifest = attachment.manifest
            weights = ProcessedWeights(tensors, manifest.recipes(), dtype_of(manifest.dtype), device)
            clock.lap("bind")
        except BaseException:
            attachment.client.close()
            raise
        log_event(log, "attach", lease=attachment.lease, bytes=manifest.nbytes, **clock.laps)
        return LoadedWeights(manifest.config, weights, "ipc", key=manifest.key, attachment=attachment,
                             phases=clock.laps)  # fmt: skip


def attach_cache(path: Path, socket_path: Path, name: str, device: torch.device, dtype: torch.dtype,
                 backend: str) -> tuple[Attachment, dict[str, torch.Tensor], _Clock]:  # fmt: skip
    """Check the cache's key against ``path`` processed by ``backend`` for device/dtype, take a lease, map the
    arenas read-only: the attachment (keep it while the tensors are used) and a view of every tensor."""
    clock = _Clock()
    expected = expected_key(path, device, dtype, backend)
    clock.lap("key")
    client = CacheClient(socket_path, name=name)
    clock.lap("connect")
    try:
        if client.hello.key != expected:
            raise WeightKeyMismatch(
                f"the cache on {socket_path} holds {client.hello.model} for the "
                f"{client.hello.backend} backend on {client.hello.device} with key "
                f"{client.hello.key[:12]}, this engine expects {path} processed by the {backend} backend for "
                f"{device} {dtype} (key {expected[:12]})"
            )
        lease, manifest, fds = client.attach(name)
        clock.lap("attach")
        try:
            if manifest.device != str(device):
                raise WeightKeyMismatch(f"the cache holds weights on {manifest.device}, the engine is on {device}")
            arenas = [attach_arena(a.transport, fd, a.size, device)
                      for a, fd in zip(manifest.arenas, fds, strict=True)]  # fmt: skip
        finally:
            for fd in fds:
                os.close(fd)
        clock.lap("map")
        tensors: dict[str, torch.Tensor] = {}
        for index, arena in enumerate(arenas):
            tensors.update(tensor_views(arena.buffer(), [e for e in manifest.tensors if e.arena == index]))
    except BaseException:
        client.close()
        raise
    return Attachment(client, lease, arenas, manifest), tensors, clock


class _Clock:
    """Seconds between successive laps, by name."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = now - self._last
        self._last = now


class CachedOrDiskWeights:
    """``ipc-or-disk``: the cache when it serves this engine's key, else the checkpoint on disk."""

    def __init__(self, cached: CachedWeights, disk: DiskWeights) -> None:
        self.cached = cached
        self.disk = disk

    def load(self, device: torch.device, dtype: torch.dtype) -> LoadedWeights:
        try:
            return self.cached.load(device, dtype)
        except (CacheUnavailable, CacheRefused, WeightKeyMismatch) as exc:
            reason = f"{type(exc).__name__}: {exc}"
        log_event(log, "weights_fallback", policy="ipc-or-disk", reason=reason)
        loaded = self.disk.load(device, dtype)
        loaded.fallback_reason = reason
        return loaded


def weight_source(model: Path, policy: str, cache_socket: Path | None) -> WeightSource:
    """The weight source an engine config asks for."""
    if policy == "disk" or (policy == "ipc-or-disk" and cache_socket is None):  # no cache: the checkpoint
        return DiskWeights(model)
    if cache_socket is None:
        raise ValueError(f"weights={policy!r} needs cache_socket")
    cached = CachedWeights(model, cache_socket)
    if policy == "ipc":
        return cached
    if policy == "ipc-or-disk":
        return CachedOrDiskWeights(cached, DiskWeights(model))
    raise ValueError(f"unknown weights policy {policy!r} (supported: disk, ipc, ipc-or-disk)")
