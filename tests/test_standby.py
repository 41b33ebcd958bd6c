"""Standby engines behind `warmgate serve` (CPU, the fp8-block demo): promotion on restart, and twenty
restarts under load that leave nothing behind. Promotion on a crash and on a hang: tests/fault/."""

from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fault.load import send
from processes import Gateway, proc_status, start_gateway, wait_for

HEALTH_TIMEOUT = 10.0  # restart.health_timeout's default: CI's loaded cores had healthy steps of 2.5 s
KV_BYTES = 1 << 30  # each engine's KV cache: more than the weights (513 MiB), so that a committed one would show
WEIGHTS_BYTES = 538_060_032


@pytest.fixture(scope="module")
def gateway(demo_path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    root = tmp_path_factory.mktemp("standby")
    config = (f'model = "{demo_path("fp8-block")}"\nserved_model_name = "demo"\n\n'
              "[engine]\nmax_num_seqs = 4\nmax_model_len = 256\ndefault_max_tokens = 8\n"
              f"kv_cache_bytes = {KV_BYTES}\n\n"
              '[restart]\nstrategy = "overlap"\nstandby = 1\nhealth_interval = 0.5\n'
              f"health_timeout = {HEALTH_TIMEOUT}\ndrain_timeout = 30\nqueue_timeout = 120\n")  # fmt: skip
    gw = start_gateway(root, config)
    yield gw
    gw.stop()


def _standby(gateway: Gateway, other_than: int | None = None) -> int:
    """The id of a ready standby (not ``other_than``), waiting for one."""

    def ready() -> int | None:
        ids = gateway.status()["standbys"]
        return next((i for i in ids if i != other_than), None)

    return int(wait_for(ready, 120, "a standby was not ready"))


def _complete(gateway: Gateway) -> str:
    body = {"model": "demo", "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    response = httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


def test_a_restart_promotes_the_standby_and_a_new_one_is_built(gateway: Gateway) -> None:
    standby = _standby(gateway)
    before = _complete(gateway)
    report = gateway.admin("POST", "/admin/restart", json={"wait": "drained"}).json()
    assert report["ok"] and report["path"] == "standby" and report["engine"] == standby, report
    assert report["drained"] is True and "drain" in report["phases"], report
    assert "draining" not in {e["state"] for e in gateway.status()["engines"]}
    assert "spawn" not in report["phases"], "a promotion starts nothing"
    assert gateway.status()["active"] == standby
    assert _complete(gateway) == before
    _standby(gateway, other_than=standby)  # the pool is refilled in the background
    engines = gateway.status()["engines"]
    assert Counter(e["state"] for e in engines) == {"active": 1, "standby": 1}, engines
    metrics = httpx.get(f"{gateway.url}/metrics", timeout=30).text
    assert 'warmgate:engines{state="standby"} 1.0' in metrics and 'warmgate:engines{state="active"} 1.0' in metrics
    for engine in engines:  # the status page shows each engine's memory: its own, the weights are the cache's
        # Neither the weights (the cache's) nor the KV cache: on the CPU it is anonymous memory the kernel commits
        # page by page as sequences write it, so a standby holds none of its 1 GiB until it serves.
        assert 0 < engine["private_memory_bytes"] < WEIGHTS_BYTES < KV_BYTES, engine
        assert engine["memory"]["kv_cache_bytes"] >= KV_BYTES - (16 << 20), engine["memory"]  # whole blocks
        assert engine["device_memory_bytes"] == 0  # CPU


def test_a_restart_answers_at_the_switch_while_the_old_engine_drains(gateway: Gateway) -> None:
    """By default an admin restart answers once the new engine takes traffic: a long stream on the old engine
    goes on after the answer (the old engine shown draining), then ends whole; the restart's entry in the status
    gets its drain phase when the drain ends."""
    old = gateway.status()["active"]
    _standby(gateway)
    body = {"model": "demo", "prompt": "Once upon a time", "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    chunks: list[str] = []

    def stream() -> None:
        with httpx.stream("POST", f"{gateway.url}/v1/completions", json=body, timeout=300) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    chunks.append(line)

    reader = threading.Thread(target=stream)
    reader.start()
    wait_for(lambda: len(chunks) >= 3, 60, "the stream did not start")
    report = gateway.admin("POST", "/admin/restart").json()
    assert report["ok"] and report["drained"] is False and "drain" not in report["phases"], report
    assert {e["id"]: e["state"] for e in gateway.status()["engines"]}[old] == "draining"
    reader.join(timeout=300)
    assert chunks[-1] == "data: [DONE]" and len(chunks) > 200, chunks[-3:]
    wait_for(lambda: all(e["id"] != old for e in gateway.status()["engines"]), 60, "the old engine stayed")
    listed = next(r for r in gateway.status()["restarts"] if r["engine"] == report["engine"])
    assert listed["drained"] is True and "drain" in listed["phases"], listed


def _gateway_children(gateway: Gateway) -> set[int]:
    """Every live process below the gateway, forked engines (children of the fork server) included."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if stat[0] != "Z":
                parents[int(entry.name)] = int(stat[1])
    found, frontier = set(), {gateway.proc.pid}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def test_twenty_restarts_under_load_fail_no_request_and_leave_nothing_behind(gateway: Gateway) -> None:
    _standby(gateway)
    _complete(gateway)
    supervisor = gateway.status()["supervisor"]["pid"]  # what could leak: it starts and stops every engine
    processes, fds = len(_gateway_children(gateway)), len(os.listdir(f"/proc/{supervisor}/fd"))
    rss = proc_status(supervisor)["VmRSS"]
    failures: list[str] = []
    done = Counter()
    stop = threading.Event()

    def client(stream: bool) -> None:
        # Checked as the fault suite checks (tests/fault/load.py): a stream needs its usage, every token and [DONE].
        with httpx.Client(base_url=gateway.url, timeout=120) as http:
            while not stop.is_set():
                outcome = send(http, stream, max_tokens=6)
                if not outcome.ok:
                    failures.append(outcome.error or "?")
                done[stream] += 1

    threads = [threading.Thread(target=client, args=(i % 2 == 0,)) for i in range(4)]
    for t in threads:
        t.start()
    paths = Counter()
    try:
        for i in range(20):
            report = gateway.admin("POST", "/admin/restart", json={"strategy": "overlap" if i % 2 else "replace"})
            assert report.status_code == 200 and report.json()["ok"], report.text
            paths[report.json()["path"]] += 1
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
    assert not failures, failures[:5]
    assert done[True] > 20 and done[False] > 20, done
    assert paths["standby"] >= 1, paths
    _standby(gateway)
    wait_for(lambda: Counter(e["state"] for e in gateway.status()["engines"]) == {"active": 1, "standby": 1}, 60,
              "old engines did not go away")  # fmt: skip
    cache = gateway.status()["cache"]
    assert len(cache["leases"]) == 2, cache  # the active engine's and the standby's, no leftovers
    assert len(_gateway_children(gateway)) == processes, "engines left running"
    assert gateway.status()["supervisor"]["pid"] == supervisor
    assert len(os.listdir(f"/proc/{supervisor}/fd")) <= fds + 4, "file descriptors leak"
    assert proc_status(supervisor)["VmRSS"] < rss + 64 * 2**20, "the supervisor grew by more than 64 MiB"
