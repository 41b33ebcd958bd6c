"""Fault injection against `warmgate serve` (CPU, the bf16 demo), under load.

One gateway with a standby engine; four clients (two streaming) send requests the whole time. Each test
injects one fault, waits for recovery, and records what happened: requests in flight during the fault and
how many failed, the recovery time, the median TTFT of streams before and after, and what was lost.
The tests run in file order and share the gateway (the last one kills it and starts another).

Records go to the JSON-lines file named by ``WARMGATE_FAULT_REPORT`` (bench/fault_report.py sets it and
writes docs/reliability.md from it); without it they are only checked.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from load import Load
from processes import REPO, Gateway, start_gateway, wait_for, wait_until_ready

HEALTH_TIMEOUT = 4.0
AFTER = 6.0  # seconds of load after recovery whose TTFT is the "after" figure


def _config(model: Path, max_num_seqs: int = 4) -> str:
    return (f'model = "{model}"\nserved_model_name = "demo"\n\n'
            f"[engine]\nmax_num_seqs = {max_num_seqs}\nmax_model_len = 256\ndefault_max_tokens = 8\n\n"
            '[restart]\nstrategy = "overlap"\nstandby = 1\nhealth_interval = 0.5\n'
            f"health_timeout = {HEALTH_TIMEOUT}\ndrain_timeout = 30\nqueue_timeout = 120\n")  # fmt: skip


class Suite:
    """The gateway under test (replaced by the supervisor test), its load, and the report."""

    def __init__(self, root: Path, model: Path) -> None:
        self.root, self.model = root, model
        self.gateway = start_gateway(root, _config(model))
        self.load = Load(self.gateway.url)
        self.report = os.environ.get("WARMGATE_FAULT_REPORT")

    def record(self, fault: str, injected: float, recovered: float, *, expect_failures: bool = False,
               lost: str = "nothing", **details: Any) -> dict[str, Any]:  # fmt: skip
        """Measure the fault's window (injection to recovery + 1 s) once AFTER seconds of load followed it.

        ``failed`` counts the requests in flight at the injection or sent during the window that failed;
        ``refused`` those of them that never reached a gateway (nothing listened on its port)."""
        self.load.wait_for_more(4, after=recovered + AFTER, timeout=60)
        during = self.load.during(injected, recovered + 1.0)
        failed = [o.error for o in during if o.error]
        refused = [e for e in failed if e.startswith("ConnectError")]
        row = {
            "fault": fault,
            "requests": len(during),
            "failed": len(failed),
            "refused": len(refused),
            "in_flight_failed": sum(1 for o in during if o.error and o.start < injected),
            "recovery_s": round(recovered - injected, 3),
            "ttft_before_s": _round(self.load.ttft_p50(injected - 15, injected)),
            "ttft_after_s": _round(self.load.ttft_p50(recovered, recovered + AFTER)),
            "lost": lost,
            **details,
        }
        if self.report:
            with open(self.report, "a") as out:
                out.write(json.dumps(row) + "\n")
        if not expect_failures:
            assert not failed, (row, failed[:3])
        return row

    def restarts(self, reason: str) -> list[dict[str, Any]]:
        return [r for r in self.gateway.status()["restarts"] if r["reason"] == reason]

    def engines(self) -> dict[int, dict[str, Any]]:
        return {e["id"]: e for e in self.gateway.status()["engines"]}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


@pytest.fixture(scope="module")
def suite(demo_path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Suite]:
    s = Suite(tmp_path_factory.mktemp("faults"), demo_path("bf16"))  # the cheapest to rebuild, when the cache dies
    try:
        _standby_ready(s)
        yield s
    finally:
        s.load.stop()
        if s.gateway.proc.poll() is None:
            s.gateway.stop()


def _standby_ready(s: Suite) -> int:
    return int(wait_for(lambda: next(iter(s.gateway.status()["standbys"]), None), 120, "a standby was not ready"))


def test_kill_9_of_the_active_engine(suite: Suite) -> None:
    standby = _standby_ready(suite)
    crashes = len(suite.restarts("crash"))
    injected = time.monotonic()
    os.kill(suite.gateway.active_pid(), signal.SIGKILL)
    wait_for(lambda: len(suite.restarts("crash")) > crashes, 60, "no crash recovery")
    recovered = time.monotonic()
    report = suite.restarts("crash")[-1]
    assert report["ok"] and report["path"] == "standby" and report["engine"] == standby, report
    suite.record("kill -9 of the active engine", injected, recovered, lost="nothing: its requests resumed",
                 path=report["path"])  # fmt: skip


def test_kill_9_of_a_draining_engine(suite: Suite) -> None:
    _standby_ready(suite)
    old = suite.gateway.active_pid()
    done: list[httpx.Response] = []
    restart = threading.Thread(target=lambda: done.append(suite.gateway.admin("POST", "/admin/restart")))
    restart.start()

    def draining() -> int | None:
        return next((e["pid"] for e in suite.engines().values() if e["state"] == "draining" and e["pid"] == old), None)

    pid = wait_for(draining, 60, "the old engine did not drain")
    injected = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    restart.join(timeout=120)
    wait_for(lambda: all(e["pid"] != pid for e in suite.engines().values()), 30, "the killed engine stayed listed")
    recovered = time.monotonic()
    assert done and done[0].status_code == 200 and done[0].json()["ok"], done
    suite.record("kill -9 of a draining engine", injected, recovered, lost="nothing: its requests resumed")


def test_a_stopped_engine_is_replaced_within_the_health_timeout(suite: Suite) -> None:
    _standby_ready(suite)
    crashes = len(suite.restarts("crash"))
    hung = suite.gateway.active_pid()
    injected = time.monotonic()
    os.kill(hung, signal.SIGSTOP)
    try:
        wait_for(lambda: len(suite.restarts("crash")) > crashes, HEALTH_TIMEOUT + 30, "the hung engine stayed")
        recovered = time.monotonic()
        assert recovered - injected > HEALTH_TIMEOUT - 1, "replaced before it could have been found silent"
        assert suite.restarts("crash")[-1]["path"] == "standby"
        assert "event=engine_hung" in suite.gateway.log_path.read_text()
        suite.record("SIGSTOP of the active engine", injected, recovered,
                     lost="nothing: killed after health_timeout, its requests resumed")  # fmt: skip
    finally:
        if Path(f"/proc/{hung}").exists():
            os.kill(hung, signal.SIGKILL)


def test_an_engine_that_cannot_start_leaves_the_old_one_serving(suite: Suite) -> None:
    _standby_ready(suite)
    active = suite.gateway.status()["active"]
    injected = time.monotonic()
    # KV cache for 100,000 sequences of 256 tokens: about 1 TB, which no allocation here can hold.
    response = suite.gateway.admin("POST", "/admin/restart", json={"engine": {"max_num_seqs": 100_000}})
    recovered = time.monotonic()
    assert response.status_code == 422, response.text  # the admin API's answer to a failed restart: its report
    report = response.json()
    assert not report["ok"] and "Cannot allocate memory" in report["error"], report
    assert suite.gateway.status()["active"] == active
    suite.record("an engine that cannot start (KV cache too large)", injected, recovered,
                 lost="nothing: the old engine kept serving", error=report["error"][:120])  # fmt: skip


def test_a_reload_during_a_restart_and_two_restarts_at_once(suite: Suite) -> None:
    _standby_ready(suite)
    suite.gateway.config.write_text(_config(suite.model, max_num_seqs=3))  # type: ignore[union-attr]
    answers: dict[str, httpx.Response] = {}
    calls = {"restart": ("POST", "/admin/restart"), "reload": ("POST", "/admin/reload"),
             "restart2": ("POST", "/admin/restart")}  # fmt: skip
    threads = [threading.Thread(target=lambda k=k, m=m, p=p: answers.__setitem__(k, suite.gateway.admin(m, p)))
               for k, (m, p) in calls.items()]  # fmt: skip
    injected = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    recovered = time.monotonic()
    for name, answer in answers.items():
        assert answer.status_code == 200 and answer.json()["ok"], (name, answer.text)
    assert len(answers) == 3
    suite.record("a reload during a restart, and two restarts at once", injected, recovered,
                 lost="nothing: the requests were applied one after the other")  # fmt: skip


def test_kill_9_of_the_cache_process(suite: Suite) -> None:
    _standby_ready(suite)
    before = suite.gateway.status()["cache"]
    ready: list[int] = []
    stop = threading.Event()

    def poll_ready() -> None:
        while not stop.is_set():
            ready.append(httpx.get(f"{suite.gateway.url}/ready", timeout=30).status_code)
            time.sleep(0.2)

    poller = threading.Thread(target=poll_ready)
    poller.start()
    injected = time.monotonic()
    os.kill(before["pid"], signal.SIGKILL)
    try:
        moved = lambda: [r for r in suite.restarts("cache restarted") if r["ok"]]  # noqa: E731
        report = wait_for(moved, 180, "the cache did not come back with the engines on it")[-1]
        recovered = time.monotonic()
    finally:
        stop.set()
        poller.join()
    after = suite.gateway.status()["cache"]
    assert after["pid"] != before["pid"] and after["key"] == before["key"], after
    assert not Path(before["socket"]).exists(), "the dead cache's socket was left in the run dir"
    assert report["weight_source"] == "ipc", report  # the new engine attached the new cache, no disk read
    _standby_ready(suite)
    wait_for(lambda: len(suite.gateway.status()["cache"]["leases"]) == 2, 60, "engines not all on the new cache")
    assert ready and set(ready) == {200}, ready  # serving went on: engines keep the dead cache's mappings
    suite.record("kill -9 of the cache process", injected, recovered,
                 lost="nothing: engines served on their mappings; the cache was rebuilt from the checkpoint "
                      "and the engines moved to it")  # fmt: skip


def _cache_loads(root: Path) -> int:
    return (root / "run" / "cache.log").read_text().count("event=startup phase=load")


def test_kill_9_of_the_supervisor_keeps_the_model_resident(suite: Suite) -> None:
    _standby_ready(suite)
    old = suite.gateway
    cache = old.status()["cache"]
    engines = [e["pid"] for e in old.status()["engines"]]
    loads = _cache_loads(suite.root)
    injected = time.monotonic()
    old.proc.kill()
    old.proc.wait()
    # Its engines and fork server stop by themselves; its cache process stays, with the weights.
    wait_for(lambda: not any(Path(f"/proc/{pid}").exists() for pid in engines), 60, "engines outlived the gateway")
    assert Path(f"/proc/{cache['pid']}").exists()
    port = int(old.url.rsplit(":", 1)[1])
    cmd = [sys.executable, "-m", "app.cli", "serve", "--config", str(old.config), "--port", str(port),
           "--run-dir", str(old.run_dir)]  # fmt: skip
    log_path = suite.root / "serve-2.log"
    with log_path.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    suite.gateway = wait_until_ready(Gateway(proc, old.url, old.run_dir, old.config, log_path))
    recovered = time.monotonic()
    status = suite.gateway.status()
    assert status["cache"]["pid"] == cache["pid"], "the running cache was not adopted"
    assert _cache_loads(suite.root) == loads, "the checkpoint was read again"
    assert "event=cache_adopted" in log_path.read_text()
    assert status["restarts"][-1]["weight_source"] == "ipc"
    suite.record("kill -9 of the supervisor, then `warmgate serve` again", injected, recovered,
                 expect_failures=True,
                 lost="the requests in flight (their connections were the gateway's); the model stayed resident "
                      "(cache adopted, no disk read); recovery includes starting the new gateway")  # fmt: skip
