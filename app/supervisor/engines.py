"""Engine workers as the supervisor sees them: one record per engine, its state, and the only way to change it.

    starting -> ready -> active -> draining -> stopped
                     \\-> standby -> active (promoted)
                     \\-> draining (not wanted any more)
    any running state -> failed (did not start, crashed, hung and killed, refused its promotion probe)

``transition`` is the one place a state changes; the reconciler (app/supervisor/reconciler.py) is its only
caller. Which engine is active and which are standbys is read off these states, never kept beside them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol

from common import lifeline
from engine.config import EngineConfig
from engine.protocol import HealthResponse


class EngineState(StrEnum):
    STARTING = "starting"
    READY = "ready"
    ACTIVE = "active"
    STANDBY = "standby"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"


_RUNNING = {EngineState.STARTING, EngineState.READY, EngineState.ACTIVE, EngineState.STANDBY, EngineState.DRAINING}
_ALLOWED: dict[EngineState, set[EngineState]] = {
    EngineState.STARTING: {EngineState.READY, EngineState.FAILED},
    EngineState.READY: {EngineState.ACTIVE, EngineState.STANDBY, EngineState.DRAINING, EngineState.FAILED},
    EngineState.STANDBY: {EngineState.ACTIVE, EngineState.DRAINING, EngineState.FAILED},
    EngineState.ACTIVE: {EngineState.DRAINING, EngineState.FAILED},
    EngineState.DRAINING: {EngineState.STOPPED, EngineState.FAILED},
    EngineState.STOPPED: set(),
    EngineState.FAILED: set(),
}


class IllegalTransition(RuntimeError):
    """A state change the state machine does not have: a bug in the reconciler."""


class WorkerProcess(Protocol):
    """What the supervisor needs of a worker process: a spawned asyncio subprocess or a ForkedProcess."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...


class EngineStartError(RuntimeError):
    """A new engine did not become ready; the message says why (with the end of its log)."""


@dataclass(eq=False)
class Engine:
    id: int
    socket: Path
    log_path: Path
    heartbeat_path: Path
    config: EngineConfig
    state: EngineState = EngineState.STARTING
    process: WorkerProcess | None = None  # set once launched
    path: str | None = None  # how its process began: "fork" (from the fork server) or "spawn"
    started: float = field(default_factory=time.monotonic)
    health: HealthResponse | None = None  # the last /health it answered (figures for the status page)

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def lifeline_path(self) -> Path:
        """Its lifeline (common/lifeline.py): beside its socket, as its heartbeat."""
        return lifeline.beside(self.socket)

    @property
    def running(self) -> bool:
        return self.state in _RUNNING

    def describe(self) -> dict[str, Any]:
        health = self.health
        return {
            "id": self.id,
            "state": self.state.value,
            "pid": self.pid,
            "socket": str(self.socket),
            "uptime_s": round(time.monotonic() - self.started, 3),
            "weight_source": health.weights.source if health is not None else None,
            "device_memory_bytes": health.device_memory_bytes if health is not None else None,
            "private_memory_bytes": health.private_memory_bytes if health is not None else None,
            "memory": health.memory if health is not None and health.memory else None,
            "settings": self.config.model_dump(mode="json", exclude={"model", "cache_socket"}),
        }


def transition(engine: Engine, to: EngineState) -> None:
    """Move ``engine`` to state ``to``; IllegalTransition if the state machine has no such edge."""
    if to not in _ALLOWED[engine.state]:
        raise IllegalTransition(f"engine {engine.id}: {engine.state.value} -> {to.value}")
    engine.state = to


@dataclass
class RestartReport:
    reason: str
    strategy: str
    ok: bool = False
    engine: int | None = None
    weight_source: str | None = None
    path: str | None = None  # how the new engine's process began: "standby", "fork" or "spawn"
    phases: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    at: float = field(default_factory=time.time)
    switched_at: float | None = None  # wall clock when the new engine took traffic
    drained: bool | None = None  # the old engine drained after the switch (None: none did: replace drains first)

    def to_json(self) -> dict[str, Any]:
        return {
            "reason": self.reason,
            "strategy": self.strategy,
            "ok": self.ok,
            "engine": self.engine,
            "weight_source": self.weight_source,
            "path": self.path,
            "phases": {k: round(v, 4) for k, v in self.phases.items()},
            "error": self.error,
            "at": self.at,
            "switched_at": self.switched_at,
            "drained": self.drained,
        }
