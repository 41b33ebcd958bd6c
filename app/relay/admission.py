"""Admission control: how many requests the relays have at the active engine, and the bounded queue of the rest.

An engine can run ``max_num_seqs`` sequences; requests beyond a small backlog would only wait inside it,
each holding a connection and a place in its scheduler's queue. So the relays forward at most
``max_num_seqs + engine_backlog`` requests to an engine (its route's ``capacity``), counted together on the
admission board (app/relay/board.py), and the rest wait here, first come first served, at most
``max_queue`` per relay and ``queue_timeout`` seconds each, then get 503 with Retry-After. Waiting here
costs a future per request; the same request in the engine would cost a connection, a task and a socket
wake-up per step. Requests also wait here while no engine is active (a ``replace`` restart).

A slot freed in this relay goes to its first waiter at once; one freed in another relay is seen at the
next look at the board, every POLL_S while requests wait here.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass

from app.control import EngineRoute
from app.metrics import RelayMetrics
from app.relay.board import AdmissionBoard
from app.relay.table import TableView

RETRY_AFTER_S = 1  # what a refused client is told to wait before trying again
POLL_S = 0.002  # how often a relay with waiting requests looks at the board for slots freed elsewhere


@dataclass(frozen=True)
class Slot:
    """Permission to have one request at ``engine`` (give it back with Admission.release)."""

    engine: EngineRoute


@dataclass(frozen=True)
class Refusal:
    why: str


class Admission:
    def __init__(self, table: TableView, board: AdmissionBoard, metrics: RelayMetrics) -> None:
        self.table = table
        self.board = board
        self.metrics = metrics
        self.in_use: dict[int, int] = {}  # engine id -> requests this relay has there
        self._waiting: deque[asyncio.Future[Slot]] = deque()
        self._polling: asyncio.TimerHandle | None = None

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
        self.kick()  # starts looking at the board for slots other relays free
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
        engine = slot.engine.id
        left = self.in_use[engine] - 1
        if left:
            self.in_use[engine] = left
        else:
            del self.in_use[engine]
        self._post()
        self.kick()

    def kick(self) -> None:
        """Hand free slots to the requests waiting longest (a slot was freed, the table changed, or the board was
        looked at again); while some still wait, look at the board again in POLL_S."""
        self._post()  # the active engine may have changed
        while self._waiting:
            head = self._waiting[0]
            if head.done():  # its request gave up
                self._waiting.popleft()
                continue
            slot = self._take()
            if slot is None:
                if self._polling is None:
                    self._polling = asyncio.get_running_loop().call_later(POLL_S, self._look_again)
                return
            self._waiting.popleft()
            head.set_result(slot)

    def _look_again(self) -> None:
        self._polling = None
        self.kick()

    def _take(self) -> Slot | None:
        engine = self.table.active
        held = 0 if engine is None else self.in_use.get(engine.id, 0)
        if engine is None or not self.board.take(engine.id, held, engine.capacity):
            return None
        self.in_use[engine.id] = held + 1
        return Slot(engine)

    def _post(self) -> None:
        """This relay's count at the active engine, on the board."""
        engine = self.table.active
        if engine is not None:
            self.board.post(engine.id, self.in_use.get(engine.id, 0))
