"""The engines' load as a relay's /metrics reports it to a router: read from their heartbeat files, where each
engine's thread writes its scheduler's figures after every step (common/heartbeat.py).

A router scrapes every pod often (the Gateway API Inference Extension's picker: every 50 ms), so the scrape asks no
engine anything: it reads a few words of memory that the relay keeps mapped, one file per engine that serves,
opened when the engine appears in the table and closed when it leaves it.
"""

from __future__ import annotations

from app.control import Table
from app.metrics import ServingLoad
from common.heartbeat import EngineLoad, Heartbeat, beside


class EngineLoads:
    """The heartbeat files of the engines that serve, mapped while they do; ``read`` sums their figures."""

    def __init__(self) -> None:
        self._mapped: dict[str, Heartbeat] = {}  # engine socket -> its heartbeat file
        self._last: EngineLoad | None = None  # the last engine seen serving: its model and KV layout stay shown

    def read(self, table: Table | None) -> ServingLoad:
        """The load of the engines that serve in ``table``: the active one, then those draining."""
        routes = [] if table is None else [r for r in (table.active, *table.draining) if r is not None]
        for socket in set(self._mapped) - {r.socket for r in routes}:
            self._mapped.pop(socket).close()
        loads = [load for load in map(self._load, (r.socket for r in routes)) if load is not None]
        self._last = loads[0] if loads else self._last
        shown = self._last
        return ServingLoad(
            running=sum(load.running for load in loads),
            waiting=sum(load.waiting for load in loads),
            kv_usage=loads[0].kv_usage if loads else 0.0,
            block_size=shown.block_size if shown else 0,
            kv_blocks=shown.kv_blocks_total if shown else 0,
            model_name=shown.model_name if shown else "",
        )

    def _load(self, socket: str) -> EngineLoad | None:
        heartbeat = self._mapped.get(socket)
        if heartbeat is None:
            try:
                heartbeat = self._mapped[socket] = Heartbeat(beside(socket))
            except (FileNotFoundError, ValueError):  # gone already (the engine stopped), or not written yet
                return None
        return heartbeat.load()
