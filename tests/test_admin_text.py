"""The admin documents as operator text: what `warmgate status | restart | reload` print (no gateway needed).

The documents come from the gateway's own classes (RestartReport); a status document from a real
gateway is printed by tests/test_gateway.py::test_status_restart_and_reload_commands_print_summaries_and_json.
"""

from __future__ import annotations

import time

from app.admin_text import reload_text, restart_text, status_text
from app.supervisor.engines import RestartReport


def test_a_failed_restart_says_why_on_its_first_line() -> None:
    report = RestartReport("admin", "replace", ok=False, error="engine 7 exited with 1 during start-up; log: OOM",
                           phases={"spawn": 0.012, "total": 4.5})  # fmt: skip
    head, *phases = restart_text(report.to_json()).splitlines()
    assert time.strftime("%H:%M:%S", time.localtime(report.at)) in head
    assert "admin  replace  FAILED: engine 7 exited with 1 during start-up; log: OOM" in head and "total 4.50 s" in head
    assert [p.split() for p in phases] == [["spawn", "12.0", "ms"]]


def test_a_promotion_names_its_path_and_each_phase_gets_a_line() -> None:
    report = RestartReport("crash", "replace", ok=True, engine=4, weight_source="ipc", path="standby",
                           phases={"probe": 0.0981, "switch": 0.0001, "total": 0.0983})  # fmt: skip
    lines = restart_text(report.to_json()).splitlines()
    assert "crash  replace  ok: engine 4 (standby, ipc)  total 98.3 ms" in lines[0]
    assert [line.split()[0] for line in lines[1:]] == ["probe", "switch"]  # total is on the first line, not twice


def test_a_status_whose_cache_does_not_answer_still_prints_the_engines() -> None:
    status = {"model": "/models/m", "cache": {"error": "TimeoutError: timed out", "socket": "/run/cache.sock"},
              "active": 1, "standbys": [], "restarts": [],
              "engines": [{"id": 1, "state": "active", "pid": 42, "uptime_s": 3725.0, "weight_source": "disk",
                           "private_memory_bytes": 3 * 2**30, "device_memory_bytes": None}]}  # fmt: skip
    text = status_text(status)
    assert "cache    not answering (TimeoutError: timed out) on /run/cache.sock" in text
    row = next(line for line in text.splitlines() if line.startswith("1 "))
    assert row.split() == ["1", "active", "42", "disk", "1h02m", "3.0", "GiB", "-"]
    assert "restarts" not in text
    assert "gateway  supervisor pid -  0 relays" in text  # a document without them (an older gateway's)
    status["supervisor"] = {"pid": 7}
    status["relays"] = [{"index": 0, "pid": 8, "connected": True}, {"index": 1, "pid": 9, "connected": False}]
    assert "gateway  supervisor pid 7  2 relays (pids 8, 9 (not connected))" in status_text(status)


def test_reload_says_what_changed() -> None:
    assert "nothing restarted" in reload_text({"changed": None, "ok": True})
    report = RestartReport("reload", "overlap", ok=True, engine=2, weight_source="ipc", path="fork",
                           phases={"total": 2.0})  # fmt: skip
    text = reload_text({"changed": "engine", **report.to_json()})
    first = text.splitlines()[0]
    assert first == "config re-read: engine settings changed: the engines rolled over on the cached weights"
    assert "reload  overlap  ok: engine 2 (fork, ipc)  total 2.00 s" in text
