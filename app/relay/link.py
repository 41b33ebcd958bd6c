"""A relay's end of the control channel (app/control.py): tables in, failures and admin calls out.

The relay serves with the last table it got, whatever the supervisor is doing: a supervisor that is busy
or stopped delays admin calls and table changes, never a client's request. When the channel closes (the
supervisor died, or is being replaced) the relay serves on and connects again every RECONNECT_S: the next
supervisor on the run dir adopts it by its hello. A relay stops only when it is told to (SIGTERM).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.control import AdminCall, AdminReply, BadMessage, EngineFailure, RelayHello, Table, TableApplied, to_relay
from common.events import log_event
from common.framing import ProtocolError, read_message, write_message

log = logging.getLogger("warmgate.relay.link")
RECONNECT_S = 0.1  # between attempts to reach a supervisor, while none answers


class SupervisorGone(ConnectionError):
    """The control channel is closed: no supervisor answers."""


class SupervisorLink:
    def __init__(self, path: Path, index: int, on_table: Callable[[Table], None], listener: int = 0) -> None:
        self.path = path
        self.index = index
        self.on_table = on_table
        self.listener = listener  # the inode of the socket it accepts on, for the hello
        self.generation = -1  # of the last table applied
        self.lost = asyncio.Event()  # set while no supervisor is connected
        self._writer: asyncio.StreamWriter | None = None
        self._reader: asyncio.StreamReader | None = None
        self._calls: dict[int, asyncio.Future[AdminReply]] = {}
        self._ids = itertools.count(1)

    async def connect(self) -> Table:
        """Connect, say who we are, and wait for the first table."""
        self._reader, self._writer = await asyncio.open_unix_connection(str(self.path))
        self._send(RelayHello(relay=self.index, pid=os.getpid(), generation=self.generation, listener=self.listener))
        first = await self._next()
        if not isinstance(first, Table):
            raise BadMessage("the supervisor's first message was not a table")
        self.lost.clear()
        self._apply(first)
        return first

    async def run(self) -> None:
        """Take the supervisor's messages; when the channel closes, connect again until one answers (until
        cancelled)."""
        while True:
            await self._follow()
            while True:
                await asyncio.sleep(RECONNECT_S)
                try:
                    await self.connect()
                except (OSError, ProtocolError, BadMessage, SupervisorGone, asyncio.IncompleteReadError):
                    self.close()
                    continue
                log_event(log, "supervisor_found", relay=self.index, generation=self.generation)
                break

    async def _follow(self) -> None:
        try:
            while True:
                message = await self._next()
                if isinstance(message, Table):
                    self._apply(message)
                else:
                    call = self._calls.pop(message.id, None)
                    if call is not None and not call.done():
                        call.set_result(message)
        except (SupervisorGone, OSError, ProtocolError, BadMessage, asyncio.IncompleteReadError) as exc:
            log_event(log, "supervisor_lost", relay=self.index, reason=f"{type(exc).__name__}: {exc}")
        finally:
            self.lost.set()
            self.close()
            for call in self._calls.values():
                if not call.done():
                    call.set_exception(SupervisorGone("the supervisor went away before it answered"))

    def report_failure(self, engine: int, why: str) -> None:
        if not self.lost.is_set():
            self._send(EngineFailure(engine=engine, why=why))

    async def admin(self, op: str, body: dict[str, Any]) -> AdminReply:
        """Carry out an admin operation in the supervisor (it may take as long as a restart takes)."""
        if self.lost.is_set():
            raise SupervisorGone("the supervisor is not reachable")
        call_id = next(self._ids)
        future: asyncio.Future[AdminReply] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        try:
            self._send(AdminCall(id=call_id, op=op, body=body))  # type: ignore[arg-type]
            return await future
        finally:
            self._calls.pop(call_id, None)

    def close(self) -> None:
        if self._writer is not None:
            with contextlib.suppress(OSError):
                self._writer.close()

    def _apply(self, table: Table) -> None:
        self.on_table(table)
        self.generation = table.generation
        self._send(TableApplied(generation=table.generation))

    def _send(self, message: RelayHello | TableApplied | EngineFailure | AdminCall) -> None:
        assert self._writer is not None
        if not self._writer.is_closing():
            write_message(self._writer, message.model_dump())

    async def _next(self) -> Table | AdminReply:
        assert self._reader is not None
        message = await read_message(self._reader)
        if message is None:
            raise SupervisorGone("the supervisor closed the control channel")
        return to_relay(message)
