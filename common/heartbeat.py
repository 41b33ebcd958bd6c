"""An engine's heartbeat: the time its engine thread and its event loop last made progress, in a small shared
file that the supervisor reads without asking anyone (and, the other way, the engine's state as the supervisor
sees it, which the engine shows in its process title).

Liveness used to poll each engine's /health over HTTP from the gateway's event loop; under load those polls
starved in the gateway's own loop and healthy engines were killed as hung. A read of this file costs a
memory access: it cannot be delayed by a busy relay, supervisor or engine HTTP loop. Both writers stamp
CLOCK_MONOTONIC (one clock for every process on the machine), so the reader needs no history of its own: a
supervisor stopped for a minute sees fresh stamps when it runs again, and kills nobody. A process that is
stopped (SIGSTOP) or stuck in a step stops stamping, and its stamps age.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
import time
from pathlib import Path

ENGINE_THREAD = 0  # stamped by the engine thread on every step, and at least every BEAT_INTERVAL while idle
EVENT_LOOP = 1  # stamped by the engine's HTTP event loop every BEAT_INTERVAL
STAMPS = 2
STATE = 2  # not a stamp: the engine's state as the supervisor sees it (an index into STATES), for its process title
STATES = ("starting", "ready", "active", "standby", "draining")
SLOTS = 3
BEAT_INTERVAL = 0.25  # seconds
_SLOT = struct.Struct("<Q")  # monotonic nanoseconds; an aligned 8-byte store, never seen half-written


class Heartbeat:
    """The stamps of one engine, mapped from ``path`` (``create`` makes the file: the supervisor does, before
    the engine starts)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        fd = os.open(self.path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, SLOTS * _SLOT.size)
        finally:
            os.close(fd)

    @classmethod
    def create(cls, path: Path) -> Heartbeat:
        """A new heartbeat file (mode 0600), no stamp in it yet."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, bytes(SLOTS * _SLOT.size))
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

    def close(self) -> None:
        self._map.close()
