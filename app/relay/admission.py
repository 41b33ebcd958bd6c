"""Admission control: how many requests a relay has at the active engine, and the bounded queue of the rest.

An engine can run ``max_num_seqs`` sequences; requests beyond a small backlog would only wait inside it,
each holding a connection and a place in its scheduler's queue. So the relays forward at most
``max_num_seqs + engine_backlog`` requests to an engine (its route's ``capacity``), split evenly between
them (each relay keeps its own count: no state is shared between relays), and the rest wait here, first
come first served, at most ``max_queue`` per relay and ``queue_timeout`` seconds each, then get 503 with
Retry-After. Waiting here
costs a future per request; the same request in the engine would cost a connection, a task and a socket
wake-up per step. Requests also wait here while no engine is active (a ``replace`` restart).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from dataclasses import dataclass

from app.control import EngineRoute
from app.metrics import RelayMetrics
from app.relay.table import TableView

RETRY_AFTER_S = 1  # what a refused client is told to wait before trying again


@dataclass(frozen=True)
class Slot:
    """Permission to have one request at ``engine`` (give it back with Admission.release)."""

    engine: EngineRoute


@dataclass(frozen=True)
class Refusal:
    why: str


class Admission:
    def __init__(self, table: TableView, metrics: RelayMetrics) -> None:
        self.table = table
        self.metrics = metrics
        self.in_use: dict[int, int] = {}  # engine id -> requests this relay has there
        self._waiting: deque[asyncio.Future[Slot]] = deque()

    def capacity(self, engine: EngineRoute) -> int:
        """This relay's share of what the engine may hold."""
        return max(1, math.ceil(engine.capacity / self.table.settings.relays))

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    async def acquire(self, deadline: float) -> Slot | Refusal:
        """A slot at the active engine, waiting in line until ``deadline`` (time.monotonic()) if there is none."""
        if not self._waiting and (slot := self._take()) is not None:
            return slot
        settings = self.table.settings
        if len(self._waiting) >= settings.max_queue:
            return Refusal(f"{len(self._waiting)} requests are already waiting for an engine here (max_queue)")
        future: asyncio.Future[Slot] = asyncio.get_running_loop().create_future()
        self._waiting.append(future)
        self.metrics.queued.inc()
        started = time.monotonic()
        try:
            await asyncio.wait({future}, timeout=max(0.0, deadline - started))
        except asyncio.CancelledError:  # the client left
            if future.done() and not future.cancelled():
                self.release(future.result())  # it was given a slot at that moment: hand it on
            raise
        finally:
            self.metrics.queued.dec()
            self.metrics.queue_wait.observe(time.monotonic() - started)
            if not future.done():
                future.cancel()
                self._waiting.remove(future)
        if future.cancelled():
            why = "no engine became active" if self.table.active is None else "every engine slot stayed busy"
            return Refusal(f"{why} within {settings.queue_timeout:.0f}s (queue_timeout)")
        return future.result()

    def release(self, slot: Slot) -> None:
        left = self.in_use[slot.engine.id] - 1
        if left:
            self.in_use[slot.engine.id] = left
        else:
            del self.in_use[slot.engine.id]
        self.kick()

    def kick(self) -> None:
        """Hand free slots to the requests waiting longest (a slot was released, or the table changed)."""
        while self._waiting:
            head = self._waiting[0]
            if head.done():  # its request gave up
                self._waiting.popleft()
                continue
            slot = self._take()
            if slot is None:
                return
            self._waiting.popleft()
            head.set_result(slot)

    def _take(self) -> Slot | None:
        engine = self.table.active
        if engine is None:
            return None
        used = self.in_use.get(engine.id, 0)
        if used >= self.capacity(engine):
            return None
        self.in_use[engine.id] = used + 1
        return Slot(engine)
