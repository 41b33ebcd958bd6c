"""Relay processes (app/relay/) started by the supervisor's relay pool (app/supervisor/relays.py) in front of stub
engines (bench/stub_engine.py: the engine's HTTP API on a Unix socket, tokens without a model), with this test
playing the supervisor: it publishes the tables and records the failures the relays report.

What it shows, through real processes and sockets: a draining engine's 503 moves a request to the next engine
without using up a resume; an engine that fails is reported and its request resumed once the table moves; the
relays together never hold more requests at an engine than its capacity (plus at most one per relay in a race);
a relay that drains loses no request of clients that keep their connections alive.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from processes import REPO

from app.control import EngineRoute, RelaySettings, Table
from app.metrics import SupervisorMetrics
from app.supervisor.relays import Relays, open_listener

pytestmark = pytest.mark.anyio
TOKENS = 12


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Stub:
    def __init__(self, root: Path, name: str, step_ms: float) -> None:
        self.socket = root / f"{name}.sock"
        self.log = root / f"{name}.log"
        cmd = [sys.executable, str(REPO / "bench" / "stub_engine.py"), "--socket", str(self.socket), "--step-ms",
               str(step_ms)]  # fmt: skip
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)

    def http(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=str(self.socket)), base_url="http://stub")

    async def ready(self) -> None:
        async with asyncio.timeout(30):
            while True:
                assert self.proc.poll() is None, self.log.read_text()
                try:
                    async with self.http() as client:
                        if (await client.get("/health")).status_code == 200:
                            return
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.05)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


class Gateway:
    """Two relays and the test as their supervisor."""

    def __init__(self, root: Path, resumes: int) -> None:
        self.failures: list[tuple[int, str]] = []
        self.listener = open_listener("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.relays = Relays(root, 2, self.listener, 5.0, SupervisorMetrics(), self._admin,
                             lambda engine, why: self.failures.append((engine, why)))  # fmt: skip
        self.settings = RelaySettings(admin_token="t", max_body_bytes=2**20, queue_timeout=30, max_queue=100,
                                      request_resumes=resumes)  # fmt: skip
        self.generation = 0

    async def _admin(self, op: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        return 503, {"error": {"message": "no supervisor here", "type": "service_unavailable"}}

    def table(self, engine: EngineRoute | None) -> Table:
        self.generation += 1
        return Table(generation=self.generation, active=engine, settings=self.settings)

    async def route(self, engine: EngineRoute | None) -> None:
        await self.relays.publish(self.table(engine))


@pytest.fixture
async def stubs(tmp_path: Path) -> AsyncIterator[list[Stub]]:
    started = [Stub(tmp_path, name, step_ms=50) for name in ("a", "b")]
    try:
        for stub in started:
            await stub.ready()
        yield started
    finally:
        for stub in started:
            stub.stop()


async def _stream(url: str, body: dict[str, Any]) -> tuple[int, list[dict[str, Any]], bool]:
    """A streamed completion: status, its data chunks, and whether it ended with [DONE]."""
    chunks, done = [], False
    async with httpx.AsyncClient(timeout=60) as client, client.stream("POST", f"{url}/v1/completions",
                                                                      json=body) as response:  # fmt: skip
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunks.append(json.loads(line[6:]))
    return response.status_code, chunks, done


def _whole(status: int, chunks: list[dict[str, Any]], done: bool) -> bool:
    texts = [c for c in chunks if c.get("choices")]
    usage = next((c["usage"] for c in chunks if c.get("usage")), None)
    counted = usage is not None and usage["completion_tokens"] == TOKENS
    return status == 200 and done and len(texts) == TOKENS and counted


BODY = {"prompt": "hi", "max_tokens": TOKENS, "stream": True, "stream_options": {"include_usage": True}}


async def test_a_draining_engine_hands_its_requests_on_without_using_a_resume(tmp_path: Path,
                                                                             stubs: list[Stub]) -> None:  # fmt: skip
    a, b = stubs
    gateway = Gateway(tmp_path, resumes=0)  # a single counted resume would fail these requests
    await gateway.relays.start(gateway.table(EngineRoute(id=1, socket=str(a.socket), capacity=16)))
    try:
        async with a.http() as client:
            await client.post("/drain", json={"timeout": 0})  # it answers 503 "draining" from now on
        streamed = asyncio.create_task(_stream(gateway.url, BODY))
        whole = asyncio.create_task(httpx.AsyncClient(timeout=60).post(f"{gateway.url}/v1/completions",
                                                                        json={**BODY, "stream": False}))  # fmt: skip
        await asyncio.sleep(0.5)  # both are bounced by the draining engine and wait for the table to move
        assert not streamed.done() and not whole.done()
        await gateway.route(EngineRoute(id=2, socket=str(b.socket), capacity=16))
        assert _whole(*await streamed)
        answer = await whole
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == TOKENS, answer.text
        assert gateway.failures == []  # draining is not a failure: nothing was reported
    finally:
        await gateway.relays.stop()


async def test_a_failed_engine_is_reported_and_its_request_resumed_on_the_next(tmp_path: Path,
                                                                             stubs: list[Stub]) -> None:  # fmt: skip
    a, b = stubs
    gateway = Gateway(tmp_path, resumes=1)
    await gateway.relays.start(gateway.table(EngineRoute(id=1, socket=str(a.socket), capacity=16)))
    try:
        a.stop()  # engine 1 dies before the table says so
        streamed = asyncio.create_task(_stream(gateway.url, BODY))
        async with asyncio.timeout(10):
            while not gateway.failures:  # the relay tells the supervisor
                await asyncio.sleep(0.02)
        assert gateway.failures[0][0] == 1
        await gateway.route(EngineRoute(id=2, socket=str(b.socket), capacity=16))
        assert _whole(*await streamed)
    finally:
        await gateway.relays.stop()


async def test_the_relays_together_hold_no_more_than_the_engines_capacity(tmp_path: Path,
                                                                         stubs: list[Stub]) -> None:  # fmt: skip
    a, _ = stubs
    capacity = 4
    gateway = Gateway(tmp_path, resumes=0)
    await gateway.relays.start(gateway.table(EngineRoute(id=1, socket=str(a.socket), capacity=capacity)))
    try:
        streams = [asyncio.create_task(_stream(gateway.url, BODY)) for _ in range(12)]  # 0.6 s each at the stub
        active: list[int] = []
        async with a.http() as client:
            while not all(s.done() for s in streams):
                active.append((await client.get("/stub/stats")).json()["active"])
                await asyncio.sleep(0.02)
        results = [s.result() for s in streams]
        assert all(_whole(*r) for r in results), [r[0] for r in results]
        # Full, never past the capacity by more than one per relay (two relays admitting at the same moment).
        assert max(active) >= capacity and max(active) <= capacity + 1, sorted(active)[-5:]
    finally:
        await gateway.relays.stop()


@pytest.mark.parametrize("step_ms", [0, 25])
async def test_relays_that_drain_lose_no_request_of_clients_that_keep_their_connections(
    tmp_path: Path, step_ms: float
) -> None:
    """Clients in tight loops on keep-alive connections (as an OpenAI client in a loop) while each relay in turn
    is told to stop (SIGTERM: its drain, as an upgrade does) and is started again: every request is answered.
    A relay that closed its idle connections at once reset the next request of a client that was sending it; one
    that closed a connection after an answer already streaming when the drain began (whose headers could no longer
    say ``connection: close``) reset the request the client sent next on it (``step_ms`` 25: most answers are
    streaming when a drain begins)."""
    stub = Stub(tmp_path, "fast", step_ms=step_ms)
    await stub.ready()
    gateway = Gateway(tmp_path, resumes=0)
    await gateway.relays.start(gateway.table(EngineRoute(id=1, socket=str(stub.socket), capacity=64)))
    outcomes: list[int | str] = []
    stopping = asyncio.Event()

    async def client(index: int) -> None:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as http:
            while not stopping.is_set():
                body = {"prompt": "hi", "max_tokens": 2 if step_ms == 0 else 4, "stream": index % 2 == 0}
                try:
                    outcomes.append((await http.post("/v1/completions", json=body)).status_code)
                except httpx.HTTPError as exc:
                    outcomes.append(f"{type(exc).__name__}: {exc}")

    def serving() -> dict[int, int]:
        """slot -> pid of the relays connected with the current table."""
        return {r.index: r.pid for r in gateway.relays.relays.values()
                if r.writer is not None and r.applied == gateway.generation}  # fmt: skip

    clients = [asyncio.create_task(client(i)) for i in range(8)]
    try:
        for _ in range(2):
            for slot, pid in sorted(serving().items()):
                served = len(outcomes)
                os.kill(pid, signal.SIGTERM)
                async with asyncio.timeout(30):
                    while serving().get(slot) in (None, pid) or len(outcomes) < served + 50:
                        await asyncio.sleep(0.05)
    finally:
        stopping.set()
        await asyncio.gather(*clients)
        await gateway.relays.stop()
        stub.stop()
    failed = [o for o in outcomes if o != 200]
    assert not failed and len(outcomes) >= 200, (len(outcomes), failed[:5])
