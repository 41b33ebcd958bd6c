"""What a supervisor leaves in the run dir for the next one: the processes it runs and what each is for.

Relays, engines, the fork server and the cache outlive the supervisor (a kill -9 of it, or of `warmgate serve`):
they serve on with what they have. The next supervisor on the run dir adopts them, as it adopts the cache, from
this file (``state.json``): which engine is active and which are standbys, with their configs, sockets and pids
(with start times: a pid the kernel gave to another process since is not mistaken for ours), the fork server,
the admin-restart overrides in force. Written by the supervisor after every change (a new file renamed over the
old: a reader never sees half of one). Relays are not in it: they find the new supervisor themselves (they
reconnect to ``control.sock`` and say who they are).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from common.processes import start_time
from engine.config import EngineConfig

STATE_FILE = "state.json"


class ProcessRecord(BaseModel):
    pid: int
    started: int | None  # /proc start time (clock ticks since boot)

    @classmethod
    def of(cls, pid: int) -> ProcessRecord:
        return cls(pid=pid, started=start_time(pid))

    def alive(self) -> bool:
        """Still the process that was recorded (same pid, same start time)."""
        return self.started is not None and start_time(self.pid) == self.started


class EngineRecord(BaseModel):
    id: int
    state: str  # an EngineState value
    process: ProcessRecord
    socket: Path
    log_path: Path
    heartbeat_path: Path
    config: EngineConfig
    path: str | None  # "fork" or "spawn"


class GatewayState(BaseModel):
    supervisor: int  # the pid that wrote it
    engines: list[EngineRecord] = []
    fork_server: ProcessRecord | None = None
    engine_overrides: dict[str, Any] = {}
    table_generation: int = 0

    def save(self, run_dir: Path) -> None:
        path = run_dir / STATE_FILE
        temporary = path.with_suffix(".tmp")
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(self.model_dump_json())
        os.replace(temporary, path)

    @classmethod
    def load(cls, run_dir: Path) -> GatewayState | None:
        """The state an earlier supervisor left (None: none, or one this version cannot read: nothing is adopted)."""
        with contextlib.suppress(OSError, ValidationError, ValueError):
            return cls.model_validate_json((run_dir / STATE_FILE).read_text())
        return None

    @staticmethod
    def remove(run_dir: Path) -> None:
        (run_dir / STATE_FILE).unlink(missing_ok=True)
