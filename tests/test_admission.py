"""Admission in the relays (app/relay/admission.py, app/relay/board.py): two relays in one process, sharing a real
board file, as two relay processes share it. What must hold: together they never pass the engine's capacity
(not even when they admit at the same moment), a slot freed in one relay reaches the other's waiters, waiters are
served first come first served, and a full queue or a timeout is a refusal, not a hang."""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from pathlib import Path
from typing import Any

import pytest

from app.control import EngineRoute, RelaySettings, Table
from app.metrics import RelayMetrics
from app.relay.admission import POLL_S, Admission, Refusal, Slot
from app.relay.board import AdmissionBoard
from app.relay.table import TableView

pytestmark = pytest.mark.anyio
ENGINE = EngineRoute(id=7, socket="/nowhere", capacity=4)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _relays(tmp_path: Path, count: int = 2, max_queue: int = 8, active: EngineRoute | None = ENGINE) -> list[Admission]:
    path = tmp_path / "admission.board"
    AdmissionBoard.create(path, count)
    settings = RelaySettings(admin_token="t", max_body_bytes=1024, queue_timeout=5, max_queue=max_queue,
                             request_resumes=3)  # fmt: skip
    relays = []
    for index in range(count):
        table = TableView()
        table.apply(Table(generation=1, active=active, settings=settings))
        relays.append(Admission(table, AdmissionBoard(path, index), RelayMetrics()))
    return relays


async def test_relays_share_the_engine_capacity_and_hand_freed_slots_across(tmp_path: Path) -> None:
    a, b = _relays(tmp_path)
    deadline = time.monotonic() + 5
    held = [await a.acquire(deadline) for _ in range(3)]  # the kernel gave relay a most connections
    assert all(isinstance(s, Slot) for s in held)
    assert isinstance(await b.acquire(deadline), Slot)  # the engine's 4th place, taken through the other relay
    waiting = asyncio.create_task(b.acquire(deadline))
    await asyncio.sleep(10 * POLL_S)
    assert not waiting.done() and b.board.total(ENGINE.id) == 4  # full: it waits, nothing beyond capacity
    a.release(held.pop())  # freed in relay a: relay b's waiter sees it at its next look at the board
    slot = await asyncio.wait_for(waiting, 1.0)
    assert isinstance(slot, Slot) and a.board.total(ENGINE.id) == 4


async def test_waiters_are_served_in_order_and_bounded(tmp_path: Path) -> None:
    (relay,) = _relays(tmp_path, count=1, max_queue=2)
    deadline = time.monotonic() + 5
    held = [await relay.acquire(deadline) for _ in range(4)]
    first = asyncio.create_task(relay.acquire(deadline))
    await asyncio.sleep(0)
    second = asyncio.create_task(relay.acquire(deadline))
    await asyncio.sleep(0)
    refused = await relay.acquire(deadline)  # a third waiter: the queue is full
    assert isinstance(refused, Refusal) and "max_queue" in refused.why
    relay.release(held.pop())  # type: ignore[arg-type]
    await asyncio.sleep(0.01)
    assert first.done() and not second.done()  # first come, first served
    relay.release(first.result())  # type: ignore[arg-type]
    assert isinstance(await asyncio.wait_for(second, 1.0), Slot)


async def test_a_request_that_waits_too_long_or_leaves_gives_its_place_back(tmp_path: Path) -> None:
    (relay,) = _relays(tmp_path, count=1)
    held = [await relay.acquire(time.monotonic() + 5) for _ in range(4)]
    late = await relay.acquire(time.monotonic() + 0.05)
    assert isinstance(late, Refusal) and "queue_timeout" in late.why and relay.waiting == 0
    leaving = asyncio.create_task(relay.acquire(time.monotonic() + 5))
    await asyncio.sleep(0)
    leaving.cancel()  # the client disconnected while it waited
    with pytest.raises(asyncio.CancelledError):
        await leaving
    assert relay.waiting == 0 and relay.board.total(ENGINE.id) == 4
    relay.release(held.pop())  # type: ignore[arg-type]
    assert relay.board.total(ENGINE.id) == 3  # nobody took it: the place is free, not leaked


async def test_no_active_engine_holds_requests_until_one_is(tmp_path: Path) -> None:
    (relay,) = _relays(tmp_path, count=1, active=None)
    waiting = asyncio.create_task(relay.acquire(time.monotonic() + 5))
    await asyncio.sleep(5 * POLL_S)
    assert not waiting.done()
    table = relay.table.table
    assert table is not None
    relay.table.apply(table.model_copy(update={"generation": 2, "active": ENGINE}))
    relay.kick()  # what the relay does with every new table
    slot = await asyncio.wait_for(waiting, 1.0)
    assert isinstance(slot, Slot) and slot.engine == ENGINE


def _race_for_the_last_place(path: str, index: int, rounds: int, barrier: Any, took: Any) -> None:
    """One relay process: in each round, take the engine's one place at the same moment as the other, then
    give it back."""
    board = AdmissionBoard(Path(path), index)
    for round_ in range(rounds):
        barrier.wait()
        if board.take(ENGINE.id, 0, 1):
            took[round_] += 1
        barrier.wait()
        board.post(ENGINE.id, 0)
        barrier.wait()
    board.close()


def test_two_relay_processes_never_both_take_the_last_place(tmp_path: Path) -> None:
    """Two processes reach for an engine's last place at once, 2,000 times: exactly one gets it each time (a look
    at the sum and the raise of one's count, done apart, let both in; this test saw it within a few hundred
    rounds on a two-core machine)."""
    path = tmp_path / "admission.board"
    AdmissionBoard.create(path, 2)
    rounds = 2000
    context = multiprocessing.get_context("fork")
    barrier, took = context.Barrier(2), context.Array("i", rounds, lock=True)
    racers = [context.Process(target=_race_for_the_last_place, args=(str(path), i, rounds, barrier, took))
              for i in range(2)]  # fmt: skip
    for racer in racers:
        racer.start()
    for racer in racers:
        racer.join(120)
        assert racer.exitcode == 0
    assert sorted(set(took[:])) == [1], {n: list(took[:]).count(n) for n in set(took[:])}
