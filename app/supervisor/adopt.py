"""Taking over the engines an earlier supervisor left running (it died, or handed over for an upgrade).

The run dir's state (app/supervisor/state.py) names them. An active engine and standbys that still run (same
pid, same start time) and are alive are adopted as they are: no request of theirs is disturbed, no engine is
started anew. Alive is what liveness (app/supervisor/liveness.py) calls it, a heartbeat younger than
``health_timeout``, or an answer to /health (asked for what the supervisor shows of the engine). An engine whose
HTTP loop is slow to answer on a loaded machine is not dropped for that alone (it was, after 5 s without an
answer, before liveness's rule was applied here too).

Any other engine that still runs (one starting, ready or draining when the supervisor died, or one started and
not yet recorded, found by its title) is of no use now: it is drained and stopped. With no active engine left,
the supervisor's start is an ordinary restart, which promotes a standby of the wanted config if one was adopted.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from app.supervisor.engines import Engine, EngineState
from app.supervisor.launcher import WorkerLauncher
from app.supervisor.reconciler import Reconciler
from app.supervisor.state import GatewayState
from app.supervisor.sweep import stop_group
from common import lifeline
from common.events import log_event
from common.heartbeat import Heartbeat
from common.processes import AdoptedProcess, gateway_processes

log = logging.getLogger("warmgate.supervisor.adopt")
HEALTH_TIMEOUT_S = 5.0
KEPT = (EngineState.ACTIVE, EngineState.STANDBY)


async def adopt_engines(earlier: GatewayState | None, launcher: WorkerLauncher, reconciler: Reconciler,
                        drain_timeout: float, health_timeout: float) -> list[asyncio.Task[Any]]:  # fmt: skip
    """Adopt the earlier supervisor's active engine and standbys into ``reconciler`` (before its loop starts); the
    tasks that stop the rest."""
    if earlier is None:
        return []
    kept: list[tuple[Engine, EngineState]] = []
    unwanted: list[Engine] = []
    candidates: list[tuple[Engine, EngineState]] = []
    for record in earlier.engines:
        try:
            process = AdoptedProcess(record.process.pid, record.process.started)
        except (ProcessLookupError, PermissionError):
            record.socket.unlink(missing_ok=True)  # it died meanwhile: what it left
            record.heartbeat_path.unlink(missing_ok=True)
            lifeline.beside(record.socket).unlink(missing_ok=True)
            continue
        engine = Engine(record.id, record.socket, record.log_path, record.heartbeat_path, record.config,
                        process=process, path=record.path)  # fmt: skip
        state = EngineState(record.state)
        if state in KEPT and not (state is EngineState.ACTIVE and any(s is state for _, s in candidates)):
            candidates.append((engine, state))
        else:
            unwanted.append(engine)
    answers = await asyncio.gather(*(launcher.health(engine, HEALTH_TIMEOUT_S) for engine, _ in candidates))
    for (engine, state), health in zip(candidates, answers, strict=True):
        alive = health.status == "ok" if health is not None else _beating(engine, health_timeout)
        if alive:
            kept.append((engine, state))
        else:
            unwanted.append(engine)
    reconciler.adopt(kept)
    log_event(log, "engines_adopted", active=[e.id for e, s in kept if s is EngineState.ACTIVE],
              standbys=[e.id for e, s in kept if s is EngineState.STANDBY],
              stopping=[e.id for e in unwanted])  # fmt: skip
    names = {e.socket.stem.removeprefix("engine-") for e, _ in kept} | \
        {e.socket.stem.removeprefix("engine-") for e in unwanted}  # fmt: skip
    tasks = [asyncio.create_task(launcher.retire(engine, drain_timeout)) for engine in unwanted]
    # Engines nobody recorded: started by a supervisor that died before it wrote its state (found now, before
    # this supervisor starts any).
    orphans = [p for p in gateway_processes(reconciler.run_dir) if p.role == "engine" and p.words[:1] and
               p.words[0] not in names]  # fmt: skip
    tasks.append(asyncio.create_task(asyncio.to_thread(stop_group, orphans, drain_timeout + 5)))
    return tasks


def _beating(engine: Engine, health_timeout: float) -> bool:
    """Whether the engine's heartbeat is younger than ``health_timeout`` (liveness's rule)."""
    try:
        heartbeat = Heartbeat(engine.heartbeat_path)
    except (OSError, ValueError):
        return False
    try:
        return heartbeat.silent_for() <= health_timeout
    finally:
        heartbeat.close()
