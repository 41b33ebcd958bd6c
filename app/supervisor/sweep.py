"""Stopping a gateway's processes without a supervisor that knows them: `warmgate stop --run-dir DIR` for a gateway
whose supervisor is gone, `warmgate serve` stopped between two supervisors, and a supervisor's last step (any
process an earlier one started and did not record).

The processes are found by their titles, which name the run dir (common/processes.py), and stopped in the
order a supervisor stops them: relays first (they stop accepting and finish their requests), then engines
(each drains), the fork server, the cache. Each gets SIGTERM, and SIGKILL after its grace period.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections import Counter
from pathlib import Path

from common import handoff
from common.events import log_event
from common.processes import TitledProcess, gateway_processes, pid_alive

log = logging.getLogger("warmgate.supervisor.sweep")
ORDER = ("relay", "supervisor", "engine", "fork server", "cache")
LEFT_BEHIND = ("control.sock", "fork.sock", "admission.board", "state.json", "address")


def stop_processes(run_dir: Path, drain_timeout: float, *, spare: frozenset[int] = frozenset()) -> Counter[str]:
    """Stop every process of the gateway on ``run_dir`` (but ``spare``'s pids), in order; how many of each role."""
    stopped: Counter[str] = Counter()
    for role in ORDER:
        group = [p for p in gateway_processes(run_dir) if p.role == role and p.pid not in spare]
        grace = drain_timeout + 5 if role in ("relay", "engine") else 30.0
        _stop(group, grace)
        stopped.update(p.role for p in group)
    if stopped:
        log_event(log, "swept", run_dir=run_dir, **{role.replace(" ", "_"): n for role, n in stopped.items()})
    return stopped


def stop_group(group: list[TitledProcess], grace: float) -> None:
    """SIGTERM each, wait up to ``grace`` seconds, SIGKILL those left."""
    _stop(group, grace)
    if group:
        log_event(log, "swept", roles=",".join(sorted({p.role for p in group})), pids=[p.pid for p in group])


def remove_files(run_dir: Path) -> None:
    """What a stopped gateway's processes leave in the run dir (sockets of processes killed, its state)."""
    for path in [*run_dir.glob("*.sock"), *run_dir.glob(handoff.PATTERN)]:
        path.unlink(missing_ok=True)
    for name in LEFT_BEHIND:
        (run_dir / name).unlink(missing_ok=True)


def _stop(group: list[TitledProcess], grace: float) -> None:
    for process in group:
        _signal(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(pid_alive(p.pid) for p in group) and time.monotonic() < deadline:
        time.sleep(0.05)
    for process in group:
        if pid_alive(process.pid):
            _signal(process.pid, signal.SIGKILL)
    while any(pid_alive(p.pid) for p in group):
        time.sleep(0.01)


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)
