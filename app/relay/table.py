"""A relay's view of the engine table: the last one the supervisor pushed, and waiting for the next."""

from __future__ import annotations

import asyncio
import contextlib

from app.control import EngineRoute, RelaySettings, Table


class TableView:
    def __init__(self) -> None:
        self.table: Table | None = None
        self._changed = asyncio.Event()

    @property
    def active(self) -> EngineRoute | None:
        return self.table.active if self.table is not None else None

    @property
    def settings(self) -> RelaySettings:
        assert self.table is not None, "a relay serves only once it has a table"
        return self.table.settings

    @property
    def generation(self) -> int:
        return self.table.generation if self.table is not None else -1

    def apply(self, table: Table) -> None:
        self.table = table
        self._changed.set()
        self._changed = asyncio.Event()  # those waiting hold the event that was set; later waiters the new one

    async def moved_past(self, engine: int, timeout: float) -> bool:
        """Wait (at most ``timeout`` seconds) until the active engine is another than ``engine``: whether it is."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.active is not None and self.active.id == engine:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except TimeoutError:
                return False
        return True

    async def changed(self, timeout: float) -> None:
        """Wait until the next table arrives, or ``timeout`` seconds."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout)
