"""The engine worker's front processes (engine/front.py): the engine API served from processes apart from the one that
steps the engine, sharing its socket, as real processes on the CPU with the bf16 demo model."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from processes import Worker, launch_worker, proc_status, start_worker, wait_for

pytestmark = pytest.mark.xdist_group("front")
COUNT = "Count to one hundred: one, two, three,"


@pytest.fixture(scope="module")
def model(demo_path) -> Path:
    return demo_path("bf16")


def fronts_of(worker: Worker) -> list[int]:
    """The pids of the worker's front processes (its children titled ``engine-front``)."""
    pid, fronts = worker.proc.pid, []
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        try:
            if Path(f"/proc/{child}/cmdline").read_bytes().startswith(b"warmgate: engine-front "):
                fronts.append(int(child))
        except OSError:
            continue
    return fronts


def gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2] == "Z"  # a zombie has ended; its parent has not reaped it yet


def completions(worker: Worker, prompts: list[str]) -> list[str]:
    async def run() -> list[str]:
        async with worker.client() as client:
            responses = await asyncio.gather(*(client.post("/v1/completions", json={
                "prompt": p, "max_tokens": 12, "temperature": 0}) for p in prompts))  # fmt: skip
        for response in responses:
            assert response.status_code == 200, response.text
        return [r.json()["choices"][0]["text"] for r in responses]

    return asyncio.run(run())


def test_the_fronts_serve_what_one_process_serves_and_report_every_process(model: Path, tmp_path: Path) -> None:
    fronted = launch_worker(tmp_path, model, "fronted", front_processes=3)
    single = launch_worker(tmp_path, model, "single", front_processes=0)
    try:
        fronted.wait_ready()
        single.wait_ready()
        fronts = fronts_of(fronted)
        assert len(fronts) == 3, fronted.log()
        assert fronts_of(single) == []
        prompts = [COUNT, "The capital of France is", "def fibonacci(n):", "x" * 300] * 2
        assert completions(fronted, prompts) == completions(single, prompts)
        with fronted.sync_client() as client:
            health = client.get("/health").json()
        # The engine's private memory is every process's: the worker's (its KV cache, the model's buffers) and what
        # each front wrote on its own, not the pages the fronts still share with the worker (RssAnon counts those).
        worker = proc_status(fronted.proc.pid)["RssAnon"]
        shared_too = sum(proc_status(pid)["RssAnon"] for pid in fronts)
        assert worker < health["private_memory_bytes"] < worker + shared_too, (health, worker, shared_too)
        assert health["status"] == "ok" and health["kv_blocks_free"] == health["kv_blocks_total"], health
    finally:
        fronted.stop()
        single.stop()


def test_a_drain_asked_of_one_front_is_the_engines(model: Path, tmp_path: Path) -> None:
    """Whichever front takes /drain, every front stops admitting, /health counts every front's requests, and the
    drain waits for the streams of all of them (the kernel hands each connection to any front)."""
    worker = start_worker(tmp_path, model, front_processes=2)
    streams = 6

    async def run() -> tuple[list[list[str]], list[int], dict, list[int]]:  # type: ignore[type-arg]
        clients = [worker.client() for _ in range(streams + 1)]  # a connection each
        started = asyncio.Event()
        begun = 0

        async def stream(client: httpx.AsyncClient) -> list[str]:
            nonlocal begun
            body = {"prompt": COUNT, "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True}
            lines: list[str] = []
            async with client.stream("POST", "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line and not lines:
                        begun += 1
                        if begun == streams:
                            started.set()
                    if line:
                        lines.append(line)
            return lines

        # /health answers once one front serves; another may still run its warm-up requests (worker.warm_up),
        # which count as in flight like any other: the streams start once none is.
        deadline = time.monotonic() + 60
        while (await clients[streams].get("/health")).json()["in_flight"]:
            assert time.monotonic() < deadline, "a front's warm-up did not end"
            await asyncio.sleep(0.01)
        tasks = [asyncio.create_task(stream(c)) for c in clients[:streams]]
        await asyncio.wait_for(started.wait(), 60)
        in_flight = (await clients[streams].get("/health")).json()["in_flight"]
        draining = asyncio.create_task(clients[streams].post("/drain", json={"timeout": 60}))
        deadline = time.monotonic() + 30
        while (await clients[streams].get("/health")).json()["status"] != "draining":
            assert not draining.done(), draining.result().text
            assert time.monotonic() < deadline, "no front reported the drain"
            await asyncio.sleep(0.01)
        refused = []
        for _ in range(4):  # new connections, to whichever front takes them
            async with worker.client() as fresh:
                answer = await fresh.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            refused.append(answer.status_code)
        lines = await asyncio.gather(*tasks)
        report = (await draining).json()
        for client in clients:
            await client.aclose()
        return lines, [in_flight], report, refused

    try:
        lines, (in_flight,), report, refused = asyncio.run(run())
        worker.proc.send_signal(signal.SIGTERM)
        code = worker.exit_code(timeout=30)
    finally:
        worker.stop()
    assert in_flight == streams
    assert all(line[-1] == "data: [DONE]" for line in lines)
    assert report["drained"] is True and report["in_flight_at_start"] == streams and report["remaining"] == 0, report
    assert refused and set(refused) == {503}, refused
    assert code == 0, worker.log()


def test_a_killed_worker_takes_its_fronts_and_its_streams_with_it(model: Path, tmp_path: Path) -> None:
    """kill -9 of the worker must break its streams as one process's death did (no error event, no [DONE]), so
    that the relays resume them elsewhere, and no front may outlive it."""
    worker = start_worker(tmp_path, model, front_processes=2)
    fronts = fronts_of(worker)
    assert len(fronts) == 2

    async def run() -> tuple[list[str], BaseException | None]:
        lines: list[str] = []
        body = {"prompt": COUNT, "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
        try:
            async with worker.client() as client, client.stream("POST", "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line and len(lines) == 3:  # tokens are flowing: the request is in flight
                        os.kill(worker.proc.pid, signal.SIGKILL)
                    if line:
                        lines.append(line)
        except httpx.HTTPError as exc:
            return lines, exc
        return lines, None

    try:
        lines, error = asyncio.run(run())
        wait_for(lambda: all(gone(front) for front in fronts), 10, "every front gone after its worker")
    finally:
        worker.stop()
    assert len(lines) >= 3
    assert "data: [DONE]" not in lines and not any('"error"' in line for line in lines), (lines[-3:], error)


def test_a_dead_front_ends_its_worker_and_the_other_fronts_as_a_crash(model: Path, tmp_path: Path) -> None:
    worker = start_worker(tmp_path, model, front_processes=2)
    try:
        victim, other = fronts_of(worker)
        os.kill(victim, signal.SIGKILL)
        code = worker.exit_code(timeout=30)
        wait_for(lambda: gone(other), 10, "the other front gone after its worker")
    finally:
        worker.stop()
    assert code == 1, worker.log()
    assert "front_status=" in worker.log() and "-9" in worker.log().split("front_status=")[-1].split()[0]


def test_every_message_of_the_link_crosses_it_as_json_and_back() -> None:
    """The link's messages are JSON (common/framing.py), never pickles: each kind, encoded, dumped, read back."""
    import json

    from engine import front
    from engine.config import EngineConfig
    from engine.grammar import GrammarSpec
    from engine.request_stream import TokenEvent, TokenLogprobs
    from engine.sampling_params import SamplingParams
    from engine.weights import WeightOrigin

    figures = front.Figures(True, 1, 2, 3, (4, 5), 6, 7, 8, 9)
    scored = TokenEvent(5, "stop", None, TokenLogprobs(-0.5, ((5, -0.5), (7, -1.25))), (None, TokenLogprobs(-1.0)))
    params = SamplingParams(max_tokens=3, temperature=0, stop_token_ids=[9], logprobs=2)
    messages = [
        front.Events([(1, 42), (2, scored), (3, TokenEvent(None, "error", error="boom"))]),
        front.Submit(1, "cmpl-1-0", [1, 2, 3], params, GrammarSpec.of_schema({"type": "object"}), [4]),
        front.Submit(2, "cmpl-2-0", [7], SamplingParams(), None, None),
        front.Cancel(3),
        front.Activate(4, 1.5),
        front.AskFigures(5),
        front.Reply(6, figures),
        front.Reply(7, 0.25),
        front.Reply(8, None, "no memory"),
        front.Hello(
            EngineConfig(model=Path("/m")),
            8,
            1024,
            {"kv": 1},
            [2],
            {"warmup": 0.1},
            100,
            WeightOrigin("ipc", key="k", lease=3),
            figures,
        ),
    ]
    for message in messages:
        assert front.decode(json.loads(json.dumps(front.encode(message)))) == message
