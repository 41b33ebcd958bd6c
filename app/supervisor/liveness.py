"""Liveness: an engine whose heartbeat (common/heartbeat.py) has been silent for ``health_timeout`` is hung.

Every ``health_interval`` the supervisor reads the heartbeat files of the active engine and the standbys:
a memory read each, no request to anyone. The stamps are the engines' own (engine thread and HTTP loop),
on the machine's one monotonic clock, so a supervisor that was itself stopped or busy reads fresh stamps
when it runs again: only an engine that stopped making progress (SIGSTOP, a hung kernel, a dead engine
thread) is reported, and the reconciler kills it and replaces it as a crashed one.

The same read takes each engine's prefix-cache counters (draining ones too: they still admit what they had
queued) into the gateway's Prometheus counters, which keep growing across restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from app.config import RestartSettings
from app.supervisor.engines import Engine, EngineState
from app.supervisor.reconciler import Hung, Reconciler
from common.heartbeat import Heartbeat

WATCHED = (EngineState.ACTIVE, EngineState.STANDBY)  # a draining engine is on its way out: it is not replaced


async def watch_heartbeats(reconciler: Reconciler, limits: Callable[[], RestartSettings]) -> None:
    """Run until cancelled: post Hung for each watched engine silent longer than health_timeout."""
    beats: dict[int, Heartbeat] = {}
    reported: set[int] = set()
    try:
        while True:
            settings = limits()
            await asyncio.sleep(settings.health_interval)
            read = [e for e in reconciler.engines.values() if e.state in (*WATCHED, EngineState.DRAINING)]
            for engine in read:
                heartbeat = beats.get(engine.id) or _open(engine)
                if heartbeat is None:
                    continue
                beats[engine.id] = heartbeat
                reconciler.metrics.prefix_cache(engine.id, *heartbeat.prefix_cache())
                silent = heartbeat.silent_for()
                if engine.state in WATCHED and silent > settings.health_timeout and engine.id not in reported:
                    reported.add(engine.id)
                    reconciler.post(Hung(engine, silent))
            for gone in set(beats) - {e.id for e in read}:
                beats.pop(gone).close()
                reported.discard(gone)
                reconciler.metrics.forget_engine(gone)
    finally:
        for heartbeat in beats.values():
            heartbeat.close()


def _open(engine: Engine) -> Heartbeat | None:
    with contextlib.suppress(OSError, ValueError):
        return Heartbeat(engine.heartbeat_path)
    return None
