"""`warmgate stop` and `warmgate upgrade`: a gateway stopped or upgraded from outside, found by its run dir.

stop: a gateway whose `warmgate serve` runs gets SIGTERM (it stops everything in order) and is waited for; one
whose `warmgate serve` is gone (killed) has its processes stopped here, in the same order (app/supervisor/
sweep.py), under the run dir's lock so that no `warmgate serve` starts meanwhile.

upgrade: `warmgate serve` gets SIGUSR2 (app/supervisor/master.py) and the gateway's status is read until a new
supervisor and a new set of relays serve and the old relays are gone.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx

from app.supervisor.run_dir import RunDir, RunDirInUse, read_address
from app.supervisor.serve import TOKEN_FILE
from app.supervisor.sweep import remove_files, stop_processes
from common.processes import pid_alive

DRAIN_TIMEOUT_S = 30.0  # for the requests of a gateway stopped without its supervisor (restart.drain_timeout's default)


def stop_gateway(run_dir: Path, timeout: float) -> str:
    if not run_dir.is_dir():
        raise FileNotFoundError(f"no run dir {run_dir}")
    lock = RunDir(run_dir)
    try:
        lock.claim()
    except RunDirInUse:
        owner = int(lock.owner()) if lock.owner().isdigit() else None
        if owner is None:
            raise
        os.kill(owner, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while pid_alive(owner):
            if time.monotonic() > deadline:
                raise TimeoutError(f"warmgate serve (pid {owner}) did not stop within {timeout:.0f} s") from None
            time.sleep(0.1)
        return f"stopped the gateway on {run_dir} (warmgate serve pid {owner})"
    try:
        stopped = stop_processes(run_dir, DRAIN_TIMEOUT_S)
        remove_files(run_dir)
    finally:
        lock.release()
    if not stopped:
        return f"nothing runs on {run_dir}"
    what = ", ".join(f"{n} {role}{'s' if n > 1 else ''}" for role, n in stopped.items())
    return f"stopped what ran on {run_dir} without its warmgate serve: {what}"


def upgrade_gateway(run_dir: Path, timeout: float) -> str:
    address = read_address(run_dir)
    before = _status(run_dir, address.url)
    old_relays = {r["pid"] for r in before["relays"]}
    started = time.monotonic()
    try:
        os.kill(address.pid, signal.SIGUSR2)
    except ProcessLookupError:
        raise ConnectionError(f"warmgate serve (pid {address.pid}) does not run: start it again with "
                              f"`warmgate serve --run-dir {run_dir}`") from None  # fmt: skip
    while time.monotonic() - started < timeout:
        time.sleep(0.2)
        try:
            now = _status(run_dir, address.url)
        except (httpx.HTTPError, ValueError, KeyError):  # between two supervisors: the admin API is away
            continue
        relays = now.get("relays", [])
        if (now["supervisor"]["pid"] != before["supervisor"]["pid"] and relays
                and all(r["pid"] not in old_relays and r["connected"] for r in relays)
                and not any(pid_alive(pid) for pid in old_relays)):  # fmt: skip
            engines = ", ".join(f"{e['id']} ({e['state']})" for e in now["engines"]) or "none"
            return (f"upgraded in {time.monotonic() - started:.1f} s: supervisor {before['supervisor']['pid']} -> "
                    f"{now['supervisor']['pid']}, relays {sorted(old_relays)} -> {sorted(r['pid'] for r in relays)}; "
                    f"engines kept: {engines} (`warmgate restart` runs them on the new code); cache kept")  # fmt: skip
    raise TimeoutError(f"the upgrade did not finish within {timeout:.0f} s: see the gateway's log")


def _status(run_dir: Path, url: str) -> dict[str, Any]:
    token = os.environ.get("WARMGATE_ADMIN_TOKEN") or (run_dir / TOKEN_FILE).read_text().strip()
    response = httpx.get(f"{url}/admin/status", headers={"authorization": f"Bearer {token}"}, timeout=30)
    response.raise_for_status()
    document: dict[str, Any] = response.json()
    return document
