"""`warmgate serve` as a new user meets it (CPU, the demo): refusals at start that are one line and quick, one
gateway per run dir, and a stop (Ctrl-C to the terminal's job, or SIGTERM) at any moment that leaves no process,
socket or address behind.

Each gateway runs in a session of its own, as a shell runs a foreground job: a Ctrl-C is SIGINT to that whole
process group (``os.killpg``), which is how a terminal delivers it. Leftovers are found by the run dir: every
process of a gateway names it on its command line or in its process title.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from processes import REPO, Gateway, wait_for, wait_until_ready

REFUSAL_S = 5.0  # a refusal at start: one line, a non-zero exit, within this
STOP_S = 60.0  # a stop: every process gone within this (requests in flight finish first)
CONFIG = "[engine]\nmax_num_seqs = 4\nmax_model_len = 256\n\n[restart]\nstandby = 0\n"


def _serve(root: Path, *args: str, config: str | None = CONFIG) -> tuple[subprocess.Popen[bytes], Path, Path]:
    """`warmgate serve` in a session of its own (a terminal's foreground job): the process, its run dir, its log."""
    run_dir, log = root / "run", root / "serve.log"
    cmd = [sys.executable, "-m", "app.cli", "serve", "--run-dir", str(run_dir), "--port", "0", *args]
    if config is not None:
        (root / "warmgate.toml").write_text(config)
        cmd += ["--config", str(root / "warmgate.toml")]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, run_dir, log


def _processes_of(run_dir: Path) -> list[str]:
    """Processes that name ``run_dir`` on their command line or in their title (every process of a gateway does)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if str(run_dir) in cmdline and state != "Z":
                found.append(f"{entry.name}: {cmdline[:160]}")
    return found


def _left_behind(run_dir: Path) -> list[str]:
    """Processes, sockets and the address of a gateway that stopped; [] when it left nothing."""
    files = [p.name for p in run_dir.glob("*.sock")] + [p.name for p in run_dir.glob("address")]
    shm = [p.name for p in Path("/dev/shm").glob("*warmgate*")]
    return _processes_of(run_dir) + files + shm


def _refusal(proc: subprocess.Popen[bytes], log: Path, started: float) -> str:
    """The one line a refused start printed; it must exit non-zero within REFUSAL_S."""
    code = proc.wait(timeout=60)
    seconds = time.monotonic() - started
    text = log.read_text()
    errors = [line for line in text.splitlines() if line.startswith("warmgate: error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in text, text
    assert seconds < REFUSAL_S, f"refused after {seconds:.1f} s: {errors[0]}"
    return errors[0]


@pytest.mark.parametrize("case", ["no such model", "an unreadable checkpoint", "a run dir that is not ours",
                                  "a busy port"])  # fmt: skip
def test_a_start_that_cannot_work_is_refused_in_one_line_at_once(case: str, tmp_path: Path) -> None:
    args: list[str] = []
    busy: socket.socket | None = None
    if case == "no such model":
        args = ["--model", str(tmp_path / "nowhere")]
    elif case == "an unreadable checkpoint":
        (tmp_path / "model").mkdir()
        (tmp_path / "model" / "config.json").write_text("{")
        args = ["--model", str(tmp_path / "model")]
    elif case == "a run dir that is not ours":
        (tmp_path / "run").mkdir(mode=0o777)
        (tmp_path / "run").chmod(0o777)  # open to every user: not a place for sockets and an admin token
    else:
        busy = socket.create_server(("127.0.0.1", 0))
    if busy is not None:
        args = ["--port", str(busy.getsockname()[1])]
    started = time.monotonic()
    proc, run_dir, log = _serve(tmp_path, *args)
    try:
        line = _refusal(proc, log, started)
    finally:
        if busy is not None:
            busy.close()
    said = {
        "no such model": "no such directory",
        "an unreadable checkpoint": "is not valid JSON",
        "a run dir that is not ours": "is open to other users",
        "a busy port": "Address already in use",
    }[case]
    assert said in line, line
    assert not _left_behind(run_dir), _left_behind(run_dir)


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[Gateway]:
    proc, run_dir, log = _serve(tmp_path)
    gw = wait_until_ready(Gateway(proc, "", run_dir, tmp_path / "warmgate.toml", log))
    yield gw
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)


def _ctrl_c(gw: Gateway) -> float:
    """Ctrl-C in the gateway's terminal (SIGINT to its process group); when it was sent."""
    sent = time.monotonic()
    os.killpg(gw.proc.pid, signal.SIGINT)
    return sent


def _stopped_cleanly(gw: Gateway, sent: float) -> None:
    """It said at once that it was stopping, exited 0, and left nothing behind."""
    wait_for(lambda: "event=stopping" in gw.log_path.read_text(), 5, "the gateway said it was stopping")
    assert gw.proc.wait(timeout=STOP_S) == 0, gw.log_path.read_text()[-3000:]
    wait_for(lambda: not _left_behind(gw.run_dir), 15, f"nothing left behind ({_left_behind(gw.run_dir)})")


def test_a_second_gateway_on_a_run_dir_in_use_is_refused_and_the_first_serves_on(gateway: Gateway,
                                                                                  tmp_path: Path) -> None:  # fmt: skip
    token = gateway.token()
    # Its metrics count clients only: no request of its own (start-up's probes) shows as one.
    assert "warmgate:requests_total{" not in httpx.get(f"{gateway.url}/metrics", timeout=30).text
    started = time.monotonic()
    cmd = [sys.executable, "-m", "app.cli", "serve", "--run-dir", str(gateway.run_dir), "--port", "0"]
    second = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert second.returncode == 2 and time.monotonic() - started < REFUSAL_S, second.stderr
    assert f"is in use by another warmgate serve (pid {gateway.proc.pid})" in second.stderr, second.stderr
    assert gateway.token() == token  # the first gateway's token, sockets and engines are untouched
    assert httpx.get(f"{gateway.url}/ready", timeout=30).status_code == 200
    assert json.loads((gateway.run_dir / "address").read_text())["pid"] == gateway.proc.pid
    # `ps` says what each process is: its title (common/proctitle.py) names its part and the run dir.
    titles = {line.split(": ", 1)[1].split(" /")[0] for line in _processes_of(gateway.run_dir)}
    active = gateway.status()["active"]
    assert {"warmgate: supervisor", "warmgate: relay 0", "warmgate: relay 1", "warmgate: fork server"} <= titles, titles
    assert any(t.startswith("warmgate: cache ") for t in titles), titles
    wait_for(lambda: any(t.startswith("warmgate: engine ") and t.endswith(f"-{active} active")
                         for t in {line.split(": ", 1)[1].split(" /")[0] for line in _processes_of(gateway.run_dir)}),
             5, "the active engine titled so")  # fmt: skip
    # And Ctrl-C when it is idle stops it, and everything it started.
    _stopped_cleanly(gateway, _ctrl_c(gateway))


def test_ctrl_c_during_a_stream_lets_it_finish_then_leaves_nothing(gateway: Gateway) -> None:
    lines: list[str] = []

    def stream() -> None:
        body = {"prompt": "Count:", "max_tokens": 40, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{gateway.url}/v1/completions", json=body, timeout=120) as response:
            lines.extend(response.iter_lines())

    client = threading.Thread(target=stream)
    client.start()
    wait_for(lambda: _running(gateway) > 0, 60, "the stream reached the engine")
    sent = _ctrl_c(gateway)
    client.join(timeout=STOP_S)
    assert "data: [DONE]" in lines, lines[-3:]  # the request in flight finished: relays drain before they exit
    _stopped_cleanly(gateway, sent)


def _running(gw: Gateway) -> int:
    status = gw.status()
    socket_path = next((e["socket"] for e in status["engines"] if e["id"] == status["active"]), None)
    if socket_path is None:
        return 0
    with httpx.Client(transport=httpx.HTTPTransport(uds=socket_path), base_url="http://engine") as engine:
        return int(engine.get("/health", timeout=10).json()["running"])


def test_ctrl_c_during_a_restart_leaves_nothing(gateway: Gateway) -> None:
    threading.Thread(target=lambda: gateway.admin("POST", "/admin/restart", json={"strategy": "replace"}),
                     daemon=True).start()  # fmt: skip
    wait_for(lambda: any(e["state"] == "starting" for e in gateway.status()["engines"]), 60,
             "a new engine starting")  # fmt: skip
    _stopped_cleanly(gateway, _ctrl_c(gateway))


def test_ctrl_c_during_start_up_leaves_nothing(tmp_path: Path) -> None:
    proc, run_dir, log = _serve(tmp_path)
    gw = Gateway(proc, "", run_dir, None, log)
    # Once the cache process or the fork server runs (they start first), before the gateway is ready.
    from common.processes import gateway_processes

    started = lambda: {p.role for p in gateway_processes(run_dir)} & {"cache", "fork server"}  # noqa: E731
    wait_for(started, 60, "start-up under way")
    assert "event=ready" not in log.read_text()
    _stopped_cleanly(gw, _ctrl_c(gw))


def test_engine_logs_are_kept_for_the_newest_engines_only(tmp_path: Path) -> None:
    from app.supervisor.logs import remove_old_logs

    for i in range(25):
        log = tmp_path / f"engine-1-{i}.log"
        log.write_text("x")
        os.utime(log, (1_000_000 + i, 1_000_000 + i))
    (tmp_path / "cache.log").write_text("kept: not an engine's")
    remove_old_logs(tmp_path, "engine-*.log", 20)
    assert sorted(p.name for p in tmp_path.glob("engine-*.log")) == sorted(f"engine-1-{i}.log" for i in range(5, 25))
    assert (tmp_path / "cache.log").exists()
