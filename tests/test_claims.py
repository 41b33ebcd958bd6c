"""README claims about `warmgate serve`, proven on real processes (CPU, the demo, small engines):

* ``[restart] fork_server = false`` spawns every engine (the first one and an admin restart's: reports say
  ``"path": "spawn"``, the engine is the supervisor's own child) and no fork server runs for the run dir; with the
  default, one runs and engines are forked (the same scan finds it: the check can see one);
* the admin token, from the config file or from ``WARMGATE_ADMIN_TOKEN``: the admin API accepts it and refuses
  another (401), and ``RUN_DIR/admin-token`` holds it, mode 0600;
* ``/ready`` answers 200 only once the first engine answered its 1-token probe (polled from the moment the gateway's
  address is known: a 503 or a refused connection comes first);
* requests that arrive during a ``replace`` restart wait in the relays and are served; with a short
  ``restart.queue_timeout`` (applied by a reload, no engine restarted) they get 503 with ``Retry-After`` in the OpenAI
  error shape instead, and requests are served again once the restart is done;
* a new `warmgate serve` stops a cache process of another key left in its run dir, and serves with its own cache.

Crash backoff is proven in tests/test_reconciler.py (fake workers: exact timing); the vLLM backend's kill -9 under
load in tests/test_vllm.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from fault.load import body, send
from processes import REPO, Gateway, launch_cache, start_gateway, wait_cache, wait_for

from cache.client import CacheClient

ENGINE = "[engine]\nmax_num_seqs = 4\nmax_model_len = 256\n"
START_S = 180.0  # a gateway's start, or an engine's, on two busy cores


def _config(model: Path, restart: str = "standby = 0\n", gateway: str = "") -> str:
    return f'model = "{model}"\n\n[gateway]\n{gateway}\n{ENGINE}\n[restart]\n{restart}'


@contextlib.contextmanager
def _serving(root: Path, config: str, env: dict[str, str] | None = None) -> Iterator[Gateway]:
    """A gateway for the test; stopped after it (SIGTERM: it must exit 0 and leave no socket), or, when the test
    failed, stopped without those checks."""
    gw = start_gateway(root, config, env)
    try:
        yield gw
    except BaseException:
        _terminate(gw.proc)
        raise
    gw.stop()


def _terminate(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM stops every process of a gateway (its cache too); SIGKILL only if it does not exit."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _processes_naming(run_dir: Path, *words: str) -> list[str]:
    """Live processes whose command line (or title) names ``run_dir`` and one of ``words``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and str(run_dir) in cmdline and any(word in cmdline for word in words):
            found.append(f"{entry.name}: {cmdline[:160]}")
    return found


def _fork_servers(run_dir: Path) -> list[str]:
    """The fork servers of a run dir: `app.cli fork-server --socket RUN/fork.sock`, titled `fork server RUN`."""
    return _processes_naming(run_dir, "fork-server", "fork server")


def _accepts(path: Path) -> bool:
    """Something listens on the Unix socket ``path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        try:
            sock.connect(str(path))
        except OSError:
            return False
        return True


def _parent(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("PPid:"):
            return int(line.split()[1])
    raise AssertionError(f"no PPid for {pid}")


def _admin_status(url: str, token: str) -> httpx.Response:
    return httpx.get(f"{url}/admin/status", headers={"authorization": f"Bearer {token}"}, timeout=60)


def _check_admin_token(gw: Gateway, token: str) -> None:
    """The admin API takes ``token`` and nothing else; the run dir's token file holds it, readable by its owner only."""
    path = gw.run_dir / "admin-token"
    assert path.read_text().strip() == token
    assert stat.S_IMODE(path.stat().st_mode) == 0o600, oct(path.stat().st_mode)
    for _ in range(3):  # new connections each time: both relays get asked, most likely
        accepted = _admin_status(gw.url, token)
        assert accepted.status_code == 200 and accepted.json()["supervisor"]["serve_pid"] == gw.proc.pid, accepted.text
        refused = _admin_status(gw.url, token + "-not")
        assert refused.status_code == 401, refused.text
        assert refused.json()["error"]["type"] == "authentication_error", refused.text
        anonymous = httpx.get(f"{gw.url}/admin/status", timeout=60)
        assert anonymous.status_code == 401, anonymous.text
        reload = httpx.post(f"{gw.url}/admin/reload", headers={"authorization": "Bearer wrong"}, timeout=60)
        assert reload.status_code == 401, reload.text


def _active(status: dict[str, Any]) -> dict[str, Any]:
    return next(e for e in status["engines"] if e["id"] == status["active"])


def test_fork_server_off_spawns_every_engine_and_the_config_token_guards_the_admin_api(
    demo_path: Any, tmp_path: Path
) -> None:
    token = "config-token-7f3a"
    config = _config(demo_path("fp8-block"), "standby = 0\nfork_server = false\n", f'admin_token = "{token}"\n')
    with _serving(tmp_path, config, env={"WARMGATE_ADMIN_TOKEN": "not-this-one"}) as gw:  # the file's token wins
        _check_admin_token(gw, token)
        status = gw.status()
        first = status["restarts"][0]
        assert first["reason"] == "start" and first["ok"] and first["path"] == "spawn", first
        supervisor = status["supervisor"]["pid"]
        assert _parent(_active(status)["pid"]) == supervisor  # spawned by the supervisor, not forked elsewhere
        # standby = 0: an admin restart starts an engine, spawned too
        restart = gw.admin("POST", "/admin/restart", json={"strategy": "overlap"})
        assert restart.status_code == 200 and restart.json()["ok"], restart.text
        assert restart.json()["path"] == "spawn", restart.json()
        status = gw.status()
        assert _active(status)["id"] == restart.json()["engine"] and _parent(_active(status)["pid"]) == supervisor
        assert [r["path"] for r in status["restarts"]] == ["spawn", "spawn"], status["restarts"]
        assert not _fork_servers(gw.run_dir), _fork_servers(gw.run_dir)
        assert not _accepts(gw.run_dir / "fork.sock")
        assert "fork_server_ready" not in gw.log_path.read_text()
        with httpx.Client(base_url=gw.url, timeout=120) as http:
            assert send(http, False, 4).ok


def test_the_environment_token_guards_the_admin_api_and_engines_are_forked_by_default(
    demo_path: Any, tmp_path: Path
) -> None:
    token = "environment-token-91c2"
    with _serving(tmp_path, _config(demo_path("fp8-block")), env={"WARMGATE_ADMIN_TOKEN": token}) as gw:
        _check_admin_token(gw, token)
        # The other half of the test above: with the default fork_server = true the same scan finds the fork server,
        # and engines are forked from it (their parent).
        servers = _fork_servers(gw.run_dir)
        assert servers and _accepts(gw.run_dir / "fork.sock")
        status = gw.status()
        assert status["restarts"][0]["path"] == "fork", status["restarts"][0]
        parent = _parent(_active(status)["pid"])
        assert parent != status["supervisor"]["pid"] and any(s.startswith(f"{parent}:") for s in servers), servers


def test_ready_answers_200_only_once_the_first_engine_answered_its_probe(demo_path, tmp_path: Path) -> None:
    (tmp_path / "warmgate.toml").write_text(_config(demo_path("fp8-block")))
    run_dir, log = tmp_path / "run", tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "app.cli", "serve", "--config", str(tmp_path / "warmgate.toml"), "--port", "0",
           "--run-dir", str(run_dir)]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    gw = Gateway(proc, "", run_dir, tmp_path / "warmgate.toml", log)
    try:

        def address() -> str | None:
            assert proc.poll() is None, log.read_text()
            with contextlib.suppress(OSError, ValueError, KeyError):
                return str(json.loads((run_dir / "address").read_text())["url"])
            return None

        gw.url = wait_for(address, START_S, "the gateway recorded its address")
        answers: list[int | str] = []
        deadline = time.monotonic() + START_S
        with httpx.Client(timeout=60) as http:
            while not answers or answers[-1] != 200:
                assert time.monotonic() < deadline and proc.poll() is None, (answers[-5:], log.read_text()[-3000:])
                try:
                    answers.append(http.get(f"{gw.url}/ready").status_code)
                except httpx.ConnectError:
                    answers.append("refused")
                if answers[-1] != 200:
                    time.sleep(0.02)  # a poll's interval, not a wait for anything
        ready_at = time.time()
        status = gw.status()  # at once: what the gateway had done when /ready first said 200
        before = answers[:-1]
        assert before, "the very first /ready answered 200: it was ready before any engine could have been probed"
        assert set(before) <= {503, "refused"}, before
        first = status["restarts"][0]
        assert first["reason"] == "start" and first["ok"] and "probe" in first["phases"], first
        assert first["switched_at"] <= ready_at, (first, ready_at)
        print(f"\n/ready: {len(before)} answers before the first 200 ({sorted(set(map(str, before)))}), start "
              f"{first['phases']}")  # fmt: skip
    except BaseException:
        _terminate(proc)
        raise
    gw.stop()


def _during_a_replace(gw: Gateway, pool: ThreadPoolExecutor, requests: Any) -> tuple[Any, dict[str, Any], float]:
    """Start a ``replace`` restart; once the gateway has no active engine (the old one drains, a new one is spawned),
    run ``requests()``. Returns what it returned, the restart's report, and when (wall clock) the requests were sent."""
    restart = pool.submit(gw.admin, "POST", "/admin/restart", json={"strategy": "replace"})
    wait_for(lambda: restart.done() or gw.status()["active"] is None, START_S, "no engine active during the replace")
    assert not restart.done(), f"the replace ended before its gap was seen: {restart.result().text}"
    sent_at = time.time()
    result = requests()
    response = restart.result(timeout=START_S)
    assert response.status_code == 200, response.text
    report = response.json()
    assert report["ok"] and report["strategy"] == "replace" and report["path"] == "spawn", report
    return result, report, sent_at


def _served(url: str, stream: bool) -> Any:
    """One checked completion (``.ok`` only for a whole answer) on a connection of its own."""
    with httpx.Client(base_url=url, timeout=120) as http:
        return send(http, stream, 8)


def _refused(url: str, stream: bool) -> tuple[httpx.Response, float, float]:
    """A request that must be refused: the response (its body read), how long it took, and when (wall clock) it
    was answered."""
    started = time.monotonic()
    with httpx.stream("POST", f"{url}/v1/completions", json=body(stream, 8), timeout=60) as response:
        response.read()
    return response, time.monotonic() - started, time.time()


def test_requests_wait_through_a_replace_or_get_503_after_a_short_queue_timeout(demo_path, tmp_path: Path) -> None:
    config = _config(demo_path("fp8-block"), "standby = 0\nfork_server = false\n")
    with _serving(tmp_path, config) as gw, ThreadPoolExecutor(4) as pool:
        # The default queue_timeout (60 s): requests sent while no engine is active are served by the new one.
        def served() -> list[Any]:
            waiting = [pool.submit(_served, gw.url, stream) for stream in (False, True)]
            return [w.result(timeout=START_S) for w in waiting]

        outcomes, report, sent_at = _during_a_replace(gw, pool, served)
        assert all(o.ok for o in outcomes), [o.error for o in outcomes]
        assert sent_at < report["switched_at"], (sent_at, report)  # they were sent before the new engine took traffic
        waited = [o.end - o.start for o in outcomes]

        # queue_timeout = 1, by a reload: [restart] settings apply at once, no engine restarts.
        before = gw.status()
        assert gw.config is not None
        gw.config.write_text(config.replace("[restart]\n", "[restart]\nqueue_timeout = 1\n"))
        reload = gw.admin("POST", "/admin/reload")
        assert reload.status_code == 200, reload.text
        assert reload.json()["ok"] and reload.json()["changed"] is None, reload.json()
        assert "restart.queue_timeout" in reload.json()["applied"], reload.json()
        after = gw.status()
        assert after["active"] == before["active"] and _active(after)["pid"] == _active(before)["pid"]
        assert len(after["restarts"]) == len(before["restarts"])

        def refused() -> list[tuple[httpx.Response, float, float]]:
            waiting = [pool.submit(_refused, gw.url, stream) for stream in (False, True)]
            return [w.result(timeout=60) for w in waiting]

        answers, report, _ = _during_a_replace(gw, pool, refused)
        for response, seconds, answered_at in answers:
            assert response.status_code == 503, response.text
            assert response.headers.get("retry-after") == "1", response.headers
            error = response.json()["error"]
            assert error["type"] == "service_unavailable" and "queue_timeout" in error["message"], error
            assert set(error) == {"message", "type", "param", "code"}, error
            # refused after waiting queue_timeout, while no engine was active
            assert 0.9 <= seconds < 10 and answered_at < report["switched_at"], (seconds, answered_at, report)

        # The restart done, requests are served again.
        assert _served(gw.url, False).ok and _served(gw.url, True).ok
        print(f"\nserved after waiting {[round(w, 2) for w in waited]} s; replace phases {report['phases']}")


def test_a_new_gateway_stops_a_cache_of_another_key_left_in_its_run_dir(demo_path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    run_dir.chmod(0o700)
    stale = launch_cache(tmp_path, demo_path("bf16"), device="cpu")  # on run/cache.sock, log in tmp_path/cache.log
    try:
        wait_cache(stale)
        with CacheClient(stale.socket) as client:
            stale_key, stale_pid = client.hello.key, client.hello.pid
        assert stale_pid == stale.pid
        with _serving(tmp_path, _config(demo_path("fp8-block"))) as gw:
            assert gw.run_dir == run_dir
            said = re.search(rf"event=cache_stale socket={re.escape(str(stale.socket))} pid={stale.pid} ", gw.log_path
                             .read_text())  # fmt: skip
            assert said, gw.log_path.read_text()[-3000:]
            assert f"event=cache_stopped socket={stale.socket} pid={stale.pid} adopted=True" in gw.log_path.read_text()
            assert stale.proc.poll() is not None, "the stale cache still runs"  # stopped before the gateway was ready
            cache = gw.status()["cache"]
            assert cache["key"] != stale_key and cache["pid"] != stale.pid, cache
            with httpx.Client(base_url=gw.url, timeout=120) as http:
                assert send(http, False, 4).ok
    finally:
        stale.stop()
