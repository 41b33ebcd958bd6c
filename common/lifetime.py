"""Processes that must not outlive the gateway: engine workers and the fork server stop when it dies.

A gateway killed with SIGKILL cannot stop its children. Its cache process lives on on purpose (the
model stays resident, and the next `warmgate serve` on the run dir adopts it); engines and the fork
server would be orphans nobody routes to, holding memory and sockets. The gateway names itself in
the environment its children inherit (``WARMGATE_SUPERVISOR_PID``); a watcher thread in each of
them checks once a second that this process still lives (same pid, same start time: a reused pid
is not mistaken for it) and, when it does not, sends its own process SIGTERM: it drains and exits as
on any SIGTERM. Forked workers are grandchildren (their parent is the fork server), which is why this
is not PR_SET_PDEATHSIG: the fork server dying must not take the engines with it.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

from common.events import log_event
from common.processes import start_time

ENV = "WARMGATE_SUPERVISOR_PID"
INTERVAL = 1.0  # seconds between checks

log = logging.getLogger("warmgate.lifetime")


def name_supervisor() -> None:
    """In the gateway: make this process the one its children (started from now on) watch."""
    os.environ[ENV] = str(os.getpid())


class SupervisorWatch:
    """Whether the gateway named in the environment still lives (no gateway named: it never goes)."""

    def __init__(self) -> None:
        value = os.environ.get(ENV)
        self.pid = int(value) if value else None
        self.started = start_time(self.pid) if self.pid is not None else None

    def gone(self) -> bool:
        return self.pid is not None and (self.started is None or start_time(self.pid) != self.started)


def stop_with_supervisor() -> None:
    """In an engine worker: SIGTERM to this process once the gateway that started it is gone (a thread)."""
    watch = SupervisorWatch()
    if watch.pid is None:
        return

    def check() -> None:
        stop = threading.Event()
        while not watch.gone():
            stop.wait(INTERVAL)
        log_event(log, "supervisor_gone", supervisor=watch.pid)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=check, name="warmgate-lifetime", daemon=True).start()

