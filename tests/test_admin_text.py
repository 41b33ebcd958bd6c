"""The admin documents as operator text: what `warmgate status | restart | reload` print (no gateway needed).

The documents come from the gateway's own classes (RestartReport); a status document from a real
gateway is printed by tests/test_gateway.py::test_status_restart_and_reload_commands_print_summaries_and_json.
"""

from __future__ import annotations

import time

from app.admin_text import reload_text, restart_text, status_text
from app.supervisor.engines import RestartReport


def test_a_failed_restart_says_so_first_and_why_in_one_line() -> None:
    why = "engine 7 exited with 1 during start-up: ValueError: kv_cache_bytes=1024 cannot hold one sequence"
    report = RestartReport("admin", "replace", ok=False, error=why, phases={"spawn": 0.012, "total": 4.5})
    head, *phases = restart_text(report.to_json()).splitlines()
    when = time.strftime("%H:%M:%S", time.localtime(report.at))
    assert head == f"FAILED  {when}  admin  replace: {why}"
    assert [p.split() for p in phases] == [["spawn", "12.0", "ms"]]


def test_a_promotion_names_its_path_and_each_phase_gets_a_line() -> None:
    report = RestartReport("crash", "replace", ok=True, engine=4, weight_source="ipc", path="standby",
                           phases={"probe": 0.0981, "switch": 0.0001, "total": 0.0983})  # fmt: skip
    lines = restart_text({**report.to_json(), "overrides": {"max_num_seqs": 4}}).splitlines()
    assert lines[0].startswith("ok  ") and lines[0].endswith("crash  replace  engine 4 (standby, ipc)  total 98.3 ms")
    assert lines[1] == "    overrides max_num_seqs=4"  # an admin restart's settings, kept until the next reload
    assert [line.split()[0] for line in lines[2:]] == ["probe", "switch"]  # total is on the first line, not twice


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
    assert "engine   -" in text  # no settings in this document
    status["engines"][0]["settings"] = {"max_num_seqs": 8, "dtype": "auto"}
    assert "engine   max_num_seqs=8 dtype=auto" in status_text(status)
    status["supervisor"] = {"pid": 7}
    status["relays"] = [{"index": 0, "pid": 8, "connected": True}, {"index": 1, "pid": 9, "connected": False}]
    assert "gateway  supervisor pid 7  2 relays (pids 8, 9 (not connected))" in status_text(status)


def test_reload_says_what_changed_what_waits_and_a_failure_first() -> None:
    assert reload_text({"config": None, "changed": None, "ok": True}).startswith(
        "nothing to re-read: the gateway was started without --config"
    )
    quiet = reload_text({"config": "/etc/w.toml", "changed": None, "ok": True, "applied": ["restart.standby"],
                         "pending": ["gateway.port"]})  # fmt: skip
    assert quiet.splitlines() == ["config re-read: no engine or model setting changed, no engine restarted",
                                  "applied now: restart.standby",
                                  "at the next start (a running gateway keeps them): gateway.port"]  # fmt: skip
    report = RestartReport("reload", "overlap", ok=True, engine=2, weight_source="ipc", path="fork",
                           phases={"total": 2.0})  # fmt: skip
    text = reload_text({"config": "/etc/w.toml", "changed": "engine", "applied": ["engine.max_num_seqs"],
                        **report.to_json()})  # fmt: skip
    first, second, third = text.splitlines()[:3]
    assert first == "config re-read: engine settings changed: the engines rolled over on the cached weights"
    assert second == "applied now: engine.max_num_seqs"
    assert "reload  overlap  engine 2 (fork, ipc)  total 2.00 s" in third
    failed = RestartReport("reload", "overlap", ok=False, error="engine 3 exited with 1 during start-up: ValueError: x")
    lines = reload_text({"config": "/etc/w.toml", "changed": "engine", **failed.to_json()}).splitlines()
    assert lines[0] == ("reload FAILED, the engines serve on with the settings they had: engine 3 exited with 1 "
                        "during start-up: ValueError: x")  # fmt: skip
    assert lines[1].startswith("FAILED  ")
