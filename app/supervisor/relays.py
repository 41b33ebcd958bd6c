"""The relay workers, as the supervisor runs them: N processes sharing the gateway's listening socket (opened
here once, inherited by each, as nginx's master hands its socket to its workers), the control channel they
connect to (app/control.py), the engine table pushed to them, and a relay that dies started again.

A table change is pushed to every connected relay; ``publish`` returns once each has acknowledged it (or
after ACK_TIMEOUT_S): the reconciler drains an engine it switched away from only then, so no relay sends
a new request to an engine that began draining.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.control import (
    AdminCall,
    AdminReply,
    BadMessage,
    EngineFailure,
    RelayHello,
    Table,
    TableApplied,
    to_supervisor,
)
from app.metrics import SupervisorMetrics, forget_process
from app.relay.board import AdmissionBoard
from app.supervisor.terminate import terminate
from common.backoff import Backoff
from common.events import log_warning
from common.framing import ProtocolError, read_message, write_message
from common.uds import bind_unix_socket

log = logging.getLogger("warmgate.supervisor.relays")
ACK_TIMEOUT_S = 1.0  # a relay that has not acknowledged a table by then is not waited for
START_TIMEOUT_S = 60.0  # for a relay to connect and take its first table
BACKLOG = 4096  # connections the kernel queues for the relays to accept (a burst of clients at once)

AdminHandler = Callable[[str, dict[str, Any]], Awaitable[tuple[int, dict[str, Any]]]]


def open_listener(host: str, port: int) -> socket.socket:
    """The gateway's listening socket: bound now, so a busy port fails the start at once, and inherited by
    every relay."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]  # fmt: skip
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(BACKLOG)
    except OSError:
        listener.close()
        raise
    return listener


@dataclass
class RelayProcess:
    index: int
    process: asyncio.subprocess.Process
    started: float = field(default_factory=time.monotonic)
    writer: asyncio.StreamWriter | None = None  # its control connection, once it said hello
    applied: int = -1  # the last table generation it acknowledged

    @property
    def pid(self) -> int:
        return self.process.pid


class Relays:
    def __init__(self, run_dir: Path, count: int, listener: socket.socket, drain_timeout: float,
                 metrics: SupervisorMetrics, admin: AdminHandler,
                 on_failure: Callable[[int, str], None]) -> None:  # fmt: skip
        self.control_path = run_dir / "control.sock"
        self.board_path = run_dir / "admission.board"
        self.count = count
        self.listener = listener
        self.drain_timeout = drain_timeout
        self.metrics = metrics
        self.admin = admin
        self.on_failure = on_failure
        self.relays: dict[int, RelayProcess] = {}
        self.table: Table | None = None
        self._acked = asyncio.Condition()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._backoff = Backoff(0.5, 30.0)
        self._stopping = False

    async def start(self, table: Table) -> None:
        """Serve the control channel, start every relay, and return once each has the table."""
        self.table = table
        AdmissionBoard.create(self.board_path, self.count)
        control = bind_unix_socket(self.control_path)
        self._server = await asyncio.start_unix_server(self._serve, sock=control)
        for index in range(self.count):
            await self._spawn(index)
        await self._wait_applied(table.generation, START_TIMEOUT_S, every=True)

    async def publish(self, table: Table) -> None:
        """Push the table to every relay; return once all connected relays acknowledged it (at most ACK_TIMEOUT_S)."""
        self.table = table
        payload = table.model_dump()
        for relay in self.relays.values():
            if relay.writer is not None and not relay.writer.is_closing():
                write_message(relay.writer, payload)
        await self._wait_applied(table.generation, ACK_TIMEOUT_S)

    def describe(self) -> list[dict[str, Any]]:
        return [{"index": r.index, "pid": r.pid, "generation": r.applied, "connected": r.writer is not None,
                 "uptime_s": round(time.monotonic() - r.started, 3)}
                for r in sorted(self.relays.values(), key=lambda r: r.index)]  # fmt: skip

    async def stop(self) -> None:
        """Stop every relay: they stop accepting and finish their requests (at most drain_timeout), then exit."""
        self._stopping = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*(terminate(r.process, self.drain_timeout + 5) for r in self.relays.values()),
                             return_exceptions=True)  # fmt: skip
        for relay in self.relays.values():
            forget_process(relay.pid)
        if self._server is not None:
            self._server.close()
        self.control_path.unlink(missing_ok=True)
        self.board_path.unlink(missing_ok=True)
        self.listener.close()

    # -- relay processes ----------------------------------------------------------------------------------

    async def _spawn(self, index: int) -> None:
        fd = self.listener.fileno()
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "app.cli", "relay", "--control", str(self.control_path), "--listen-fd", str(fd),
            "--index", str(index), "--board", str(self.board_path), "--drain-timeout", str(self.drain_timeout),
            pass_fds=(fd,), start_new_session=True,  # Ctrl-C in a terminal is the supervisor's: it stops relays first
        )  # fmt: skip
        relay = RelayProcess(index, process)
        self.relays[index] = relay
        self._background(self._watch(relay))

    async def _watch(self, relay: RelayProcess) -> None:
        code = await relay.process.wait()
        forget_process(relay.pid)
        with contextlib.suppress(OSError):  # its requests went with it: free their places at the engine
            AdmissionBoard.clear(self.board_path, relay.index)
        if self._stopping or self.relays.get(relay.index) is not relay:
            return
        log_warning(log, "relay_exited", relay=relay.index, pid=relay.pid, code=code)
        self.metrics.relay_restarts.inc()
        if time.monotonic() - relay.started > 60:
            self._backoff.succeeded()  # it had served a while: this is not a crash loop
        await asyncio.sleep(self._backoff.failed())
        if not self._stopping:
            await self._spawn(relay.index)

    # -- the control channel ------------------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        relay: RelayProcess | None = None
        try:
            hello = to_supervisor(await read_message(reader) or {})
            if not isinstance(hello, RelayHello) or hello.relay not in self.relays:
                raise BadMessage(f"expected a relay's hello, got {hello}")
            relay = self.relays[hello.relay]
            relay.writer = writer
            if self.table is not None:
                write_message(writer, self.table.model_dump())
            while (message := await read_message(reader)) is not None:
                parsed = to_supervisor(message)
                if isinstance(parsed, TableApplied):
                    relay.applied = parsed.generation
                    async with self._acked:
                        self._acked.notify_all()
                elif isinstance(parsed, EngineFailure):
                    self.on_failure(parsed.engine, parsed.why)
                elif isinstance(parsed, AdminCall):
                    self._background(self._carry_out(parsed, writer))
        except (OSError, ProtocolError, BadMessage, asyncio.IncompleteReadError) as exc:
            log_warning(log, "control_error", relay=relay.index if relay else None,
                      error=f"{type(exc).__name__}: {exc}")  # fmt: skip
        finally:
            if relay is not None and relay.writer is writer:
                relay.writer = None
            with contextlib.suppress(OSError):
                writer.close()

    async def _carry_out(self, call: AdminCall, writer: asyncio.StreamWriter) -> None:
        status, body = await self.admin(call.op, call.body)
        if not writer.is_closing():
            write_message(writer, AdminReply(id=call.id, status=status, body=body).model_dump())

    async def _wait_applied(self, generation: int, timeout: float, every: bool = False) -> None:
        """Until every connected relay (``every``: every relay) has acknowledged ``generation``, or ``timeout``."""

        def done() -> bool:
            relays = self.relays.values()
            return all(r.applied >= generation for r in relays if every or r.writer is not None)

        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout), self._acked:
                await self._acked.wait_for(done)
        if every and not done():
            missing = [r.index for r in self.relays.values() if r.applied < generation]
            raise RuntimeError(f"relays {missing} did not start within {timeout:.0f}s")

    def _background(self, work: Any) -> None:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def kill_all(relays: Relays) -> None:
    """Last resort on the way out (the supervisor failed): no relay outlives it."""
    for relay in relays.relays.values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(relay.pid, signal.SIGKILL)
