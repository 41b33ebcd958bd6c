"""An engine's heartbeat: the time its engine thread and its event loop last made progress, in a small shared
file that the supervisor reads without asking anyone (and, the other way, the engine's state as the supervisor
sees it, which the engine shows in its process title).

Liveness used to poll each engine's /health over HTTP from the gateway's event loop; under load those polls
starved in the gateway's own loop and healthy engines were killed as hung. A read of this file costs a
memory access: it cannot be delayed by a busy relay, supervisor or engine HTTP loop. Both writers stamp
CLOCK_MONOTONIC (one clock for every process on the machine), so the reader needs no history of its own: a
supervisor stopped for a minute sees fresh stamps when it runs again, and kills nobody. A process that is
stopped (SIGSTOP) or stuck in a step stops stamping, and its stamps age.

The same file carries the engine's load for the relays' /metrics (what a Kubernetes inference router reads:
docs/operations.md, "Many replicas"): the engine thread writes its scheduler's figures after every step, and a
relay reads them when it is scraped, without asking the engine. What never changes (the model's name, the KV
block size and block count) is written once, before the engine serves. After the name come two counters that
only grow while the engine lives, its prefix cache's queries and hits in tokens (vLLM's figures), which the
supervisor adds up across engines (app/supervisor/liveness.py).
"""

from __future__ import annotations

import math
import mmap
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

ENGINE_THREAD = 0  # stamped by the engine thread on every step, and at least every BEAT_INTERVAL while idle
EVENT_LOOP = 1  # stamped by the engine's HTTP event loop every BEAT_INTERVAL
STAMPS = 2
STATE = 2  # not a stamp: the engine's state as the supervisor sees it (an index into STATES), for its process title
STATES = ("starting", "ready", "active", "standby", "draining")
# The engine's load: running, waiting, KV blocks used (every step), then block size, KV blocks in all and the
# length of the model's name (once), then the name's bytes.
LOAD, INFO, NAME = 3, 6, 9
NAME_BYTES = 256
SLOTS = NAME
LOAD_END = SLOTS * 8 + NAME_BYTES
COUNTERS = LOAD_END  # byte offset: prefix-cache queries and hits
SIZE = COUNTERS + 16  # a file of an earlier layout is shorter: stamps and state, no load, or a load and no counters
BEAT_INTERVAL = 0.25  # seconds
# Native order ("@"): struct packs a native integer with one memcpy, an aligned 8-byte store that a reader never
# sees half-written ("<" packs byte by byte). Every process that shares the file runs on this machine.
_SLOT = struct.Struct("@Q")  # monotonic nanoseconds
# Three such stores: a reader may see two consecutive steps' figures mixed, never a torn number.
_TRIPLE = struct.Struct("@3Q")
_PAIR = struct.Struct("@2Q")


@dataclass(frozen=True)
class EngineLoad:
    """An engine's scheduler as of its last step, and what it is (as the relays' /metrics reports it)."""

    running: int  # sequences in its running batch
    waiting: int  # requests queued in the engine, not yet running
    kv_blocks_used: int
    kv_blocks_total: int
    block_size: int  # KV cache positions per block
    model_name: str  # the served model name

    @property
    def kv_usage(self) -> float:
        """The fraction of the KV cache in use, 0..1."""
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


def beside(engine_socket: str | Path) -> Path:
    """An engine's heartbeat file: its socket's name with ``.beat`` (the supervisor names them so)."""
    return Path(engine_socket).with_suffix(".beat")


class Heartbeat:
    """The stamps of one engine, mapped from ``path`` (``create`` makes the file: the supervisor does, before
    the engine starts)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        fd = os.open(self.path, os.O_RDWR)
        try:  # the file's own size: one of an earlier layout (an engine adopted across an upgrade) is shorter
            self._map = mmap.mmap(fd, min(os.fstat(fd).st_size, SIZE))
        finally:
            os.close(fd)
        self._has_load = len(self._map) >= LOAD_END
        self._has_counters = len(self._map) >= SIZE

    @classmethod
    def create(cls, path: Path) -> Heartbeat:
        """A new heartbeat file (mode 0600), no stamp in it yet."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, bytes(SIZE))
        finally:
            os.close(fd)
        return cls(path)

    def beat(self, slot: int) -> None:
        _SLOT.pack_into(self._map, slot * _SLOT.size, time.monotonic_ns())

    def ages(self) -> list[float]:
        """Seconds since each slot's last stamp (infinite for a slot never stamped)."""
        now = time.monotonic_ns()
        stamps = [_SLOT.unpack_from(self._map, i * _SLOT.size)[0] for i in range(STAMPS)]
        return [math.inf if stamp == 0 else max(0.0, (now - stamp) / 1e9) for stamp in stamps]

    def silent_for(self) -> float:
        """Seconds since the staler of the two made progress."""
        return max(self.ages())

    def tell_state(self, state: str) -> None:
        """The supervisor: the engine's state now (one of STATES)."""
        _SLOT.pack_into(self._map, STATE * _SLOT.size, STATES.index(state))

    def state(self) -> str:
        """The engine: its state as the supervisor last told it."""
        index = _SLOT.unpack_from(self._map, STATE * _SLOT.size)[0]
        return STATES[index] if index < len(STATES) else STATES[0]

    def describe(self, model_name: str, block_size: int, kv_blocks_total: int) -> None:
        """The engine, once before it serves: what its load figures are about."""
        if not self._has_load:
            return
        name = model_name.encode()[:NAME_BYTES]
        self._map[SLOTS * _SLOT.size : SLOTS * _SLOT.size + len(name)] = name
        _TRIPLE.pack_into(self._map, INFO * _SLOT.size, block_size, kv_blocks_total, len(name))

    def publish(self, running: int, waiting: int, kv_blocks_used: int, prefix_queries: int = 0,
                prefix_hits: int = 0) -> None:  # fmt: skip
        """The engine thread, after each step: its scheduler's figures and its prefix cache's counters."""
        if self._has_load:
            _TRIPLE.pack_into(self._map, LOAD * _SLOT.size, running, waiting, kv_blocks_used)
        if self._has_counters:
            _PAIR.pack_into(self._map, COUNTERS, prefix_queries, prefix_hits)

    def prefix_cache(self) -> tuple[int, int]:
        """The engine's prefix-cache queries and hits (tokens) since it started; zeros in a file of an earlier
        layout."""
        return _PAIR.unpack_from(self._map, COUNTERS) if self._has_counters else (0, 0)  # type: ignore[return-value]

    def load(self) -> EngineLoad | None:
        """The engine's last published load; None before it described itself, or in a file of an earlier layout."""
        if not self._has_load:
            return None
        block_size, total, name_length = _TRIPLE.unpack_from(self._map, INFO * _SLOT.size)
        if block_size == 0:
            return None
        running, waiting, used = _TRIPLE.unpack_from(self._map, LOAD * _SLOT.size)
        offset = SLOTS * _SLOT.size
        name = bytes(self._map[offset : offset + name_length]).decode(errors="ignore")  # a name cut inside a character
        return EngineLoad(running, waiting, used, total, block_size, name)

    def close(self) -> None:
        self._map.close()
