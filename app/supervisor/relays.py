"""The relay workers, as the supervisor runs them: N processes sharing the gateway's listening socket (opened
by `warmgate serve` once, inherited by each, as nginx's master hands its socket to its workers), the control
channel they connect to (app/control.py), the engine table pushed to them, and a relay that dies started again.

Relays outlive the supervisor: when it dies they serve on and connect again, and the next supervisor adopts
every relay that says hello on its control channel (watched through a pidfd: app/supervisor's processes are
not all its children). A relay whose listening socket is not the gateway's is stopped. ``upgrade`` starts a
full set of new relays (new code) beside the old ones, then drains the old ones: zero requests fail, as
nginx's binary upgrade.

A table change is pushed to every connected relay; ``publish`` returns once each has acknowledged it (or
after ACK_TIMEOUT_S): the reconciler drains an engine it switched away from only then, so no relay sends
a new request to an engine that began draining.

Each relay has a slot (its place on the admission board, app/relay/board.py), from 0 to BOARD_SLOTS - 1:
old and new relays of an upgrade hold different slots.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
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
from common import handoff
from common.backoff import Backoff
from common.events import log_event, log_warning
from common.framing import ProtocolError, read_message, write_message
from common.processes import AdoptedProcess
from common.uds import bind_unix_socket, socket_is_stale

log = logging.getLogger("warmgate.supervisor.relays")
ACK_TIMEOUT_S = 1.0  # a relay that has not acknowledged a table by then is not waited for
START_TIMEOUT_S = 60.0  # for a relay to connect and take its first table
BACKLOG = 4096  # connections the kernel queues for the relays to accept (a burst of clients at once)
BOARD_SLOTS = 64  # relays at once, old and new of an upgrade together (gateway.workers is at most half)
ADOPT_WAIT_S = 5.0  # for an earlier supervisor's relays to connect (they try every 0.1 s)

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
    index: int  # its slot
    process: Any  # an asyncio subprocess, or an AdoptedProcess (started by an earlier supervisor)
    started: float = field(default_factory=time.monotonic)
    writer: asyncio.StreamWriter | None = None  # its control connection, once it said hello
    applied: int = -1  # the last table generation it acknowledged
    retiring: bool = False  # being drained (an upgrade replaced it, or it is one too many): not started again

    @property
    def pid(self) -> int:
        return self.process.pid


class Relays:
    def __init__(self, run_dir: Path, count: int, listener: socket.socket, drain_timeout: float,
                 metrics: SupervisorMetrics, admin: AdminHandler,
                 on_failure: Callable[[int, str], None]) -> None:  # fmt: skip
        self.run_dir = run_dir
        self.control_path = run_dir / "control.sock"
        self.board_path = run_dir / "admission.board"
        self.count = count
        self.listener = listener
        self.listener_id = handoff.identity(listener)
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
        self._channels: set[asyncio.Task[Any]] = set()  # one task per relay connection
        self._started = False  # start() has decided which relays to keep: a relay adopted later is one too many

    async def start(self, table: Table, *, adopt: bool = False, upgrade: bool = False) -> None:
        """Serve the control channel and return once ``count`` relays serve with the table. ``adopt``: an earlier
        supervisor's relays still run: they are waited for (ADOPT_WAIT_S) and kept, and only missing ones are
        started. ``upgrade``: a full set of new relays is started, then the adopted ones drain (in the
        background)."""
        self.table = table
        if not (adopt and self._board_fits()):
            AdmissionBoard.create(self.board_path, BOARD_SLOTS)
        control = bind_unix_socket(self.control_path)
        self._server = await asyncio.start_unix_server(self._serve, sock=control)
        if adopt:
            await self._await_adoptions()
        old = [r for r in self.relays.values()]
        wanted = self.count if upgrade else max(0, self.count - len(old))
        new = [await self._spawn(self._free_slot()) for _ in range(wanted)]
        await self._wait_applied(table.generation, START_TIMEOUT_S, among=new)
        retire = old if upgrade else sorted(old, key=lambda r: r.index)[self.count :]
        for relay in retire:
            self._retire(relay)
        self._started = True
        if adopt:
            log_event(log, "relays_adopted", kept=len(old) - len(retire), started=len(new), retiring=len(retire),
                      upgrade=upgrade)  # fmt: skip

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
                 "adopted": isinstance(r.process, AdoptedProcess), "retiring": r.retiring,
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
        await self.detach()
        self.control_path.unlink(missing_ok=True)
        self.board_path.unlink(missing_ok=True)
        for path in self.run_dir.glob(handoff.PATTERN):
            path.unlink(missing_ok=True)
        self.listener.close()

    async def detach(self) -> None:
        """Leave the relays serving (the supervisor hands over to the next one): only the channel closes."""
        self._stopping = True
        for task in list(self._tasks):
            task.cancel()
        if self._server is not None:
            self._server.close()
        for relay in self.relays.values():
            if relay.writer is not None:
                with contextlib.suppress(OSError):
                    relay.writer.close()
        if self._channels:  # each sees its connection closed and ends
            await asyncio.wait(self._channels, timeout=1.0)

    # -- relay processes ----------------------------------------------------------------------------------

    def _board_fits(self) -> bool:
        try:
            return self.board_path.stat().st_size == AdmissionBoard.size(BOARD_SLOTS)
        except OSError:
            return False

    def _free_slot(self) -> int:
        """A slot no relay holds: neither ours nor one whose relay offers its socket and has not said hello yet."""
        for slot in range(BOARD_SLOTS):
            offered = self.run_dir / f"handoff-{slot}.sock"
            if slot not in self.relays and not (offered.exists() and not socket_is_stale(offered)):
                return slot
        raise RuntimeError(f"no free relay slot of {BOARD_SLOTS}")

    async def _await_adoptions(self) -> None:
        """Until every relay that offers its socket in the run dir has said hello, or ADOPT_WAIT_S."""
        deadline = time.monotonic() + ADOPT_WAIT_S
        while time.monotonic() < deadline:
            offering = [p for p in self.run_dir.glob(handoff.PATTERN) if not socket_is_stale(p)]
            if len(self.relays) >= len(offering):
                return
            await asyncio.sleep(0.05)

    async def _spawn(self, index: int) -> RelayProcess:
        fd = self.listener.fileno()
        AdmissionBoard.clear(self.board_path, index)
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "app.cli", "relay", "--control", str(self.control_path), "--listen-fd", str(fd),
            "--index", str(index), "--board", str(self.board_path), "--drain-timeout", str(self.drain_timeout),
            pass_fds=(fd,), start_new_session=True,  # Ctrl-C in a terminal is the supervisor's: it stops relays first
        )  # fmt: skip
        relay = RelayProcess(index, process)
        self.relays[index] = relay
        self._background(self._watch(relay))
        return relay

    def _adopt(self, hello: RelayHello) -> RelayProcess | None:
        """An earlier supervisor's relay that said hello: kept (None if it is gone already)."""
        try:
            process = AdoptedProcess(hello.pid)
        except (ProcessLookupError, PermissionError):
            return None
        relay = RelayProcess(hello.relay, process)
        self.relays[hello.relay] = relay
        self._background(self._watch(relay))
        return relay

    def _retire(self, relay: RelayProcess) -> None:
        """Drain the relay (SIGTERM: it stops accepting, finishes its requests, exits); not started again."""
        relay.retiring = True
        with contextlib.suppress(ProcessLookupError):
            relay.process.send_signal(signal.SIGTERM)

    async def _watch(self, relay: RelayProcess) -> None:
        code = await relay.process.wait()
        forget_process(relay.pid)
        if self.relays.get(relay.index) is relay:
            del self.relays[relay.index]
        with contextlib.suppress(OSError):  # its requests went with it: free their places at the engine
            AdmissionBoard.clear(self.board_path, relay.index)
        (self.run_dir / f"handoff-{relay.index}.sock").unlink(missing_ok=True)  # offered by a process now gone
        if self._stopping or relay.retiring:
            return
        log_warning(log, "relay_exited", relay=relay.index, pid=relay.pid, code=code)
        self.metrics.relay_restarts.inc()
        if time.monotonic() - relay.started > 60:
            self._backoff.succeeded()  # it had served a while: this is not a crash loop
        await asyncio.sleep(self._backoff.failed())
        if not self._stopping and relay.index not in self.relays:
            await self._spawn(relay.index)

    # -- the control channel ------------------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        relay: RelayProcess | None = None
        channel = asyncio.current_task()
        if channel is not None:
            self._channels.add(channel)
            channel.add_done_callback(self._channels.discard)
        try:
            hello = to_supervisor(await read_message(reader) or {})
            if not isinstance(hello, RelayHello) or not 0 <= hello.relay < BOARD_SLOTS:
                raise BadMessage(f"expected a relay's hello, got {hello}")
            relay = self.relays.get(hello.relay)
            if relay is None:
                relay = self._adopt(hello)
                if relay is None:
                    return
                if self._started and len(self.relays) > self.count:  # late: another was started in its place
                    log_warning(log, "relay_late", relay=hello.relay, pid=hello.pid)
                    self._retire(relay)
            elif relay.pid != hello.pid:
                raise BadMessage(f"relay slot {hello.relay} is pid {relay.pid}'s, not {hello.pid}'s")
            if hello.listener != self.listener_id:  # it accepts on a socket that is not the gateway's any more
                log_warning(log, "relay_foreign_socket", relay=hello.relay, pid=hello.pid)
                self._retire(relay)
                return
            relay.writer = writer
            relay.applied = -1  # of this supervisor's tables: it acknowledges the one sent now
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

    async def _wait_applied(self, generation: int, timeout: float, among: list[RelayProcess] | None = None) -> None:
        """Until every connected relay (``among``: each of those, connected or not) has acknowledged ``generation``,
        or ``timeout``."""

        def done() -> bool:
            relays = among if among is not None else [r for r in self.relays.values() if r.writer is not None]
            return all(r.applied >= generation for r in relays)

        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout), self._acked:
                await self._acked.wait_for(done)
        if among is not None and not done():
            missing = [r.index for r in among if r.applied < generation]
            raise RuntimeError(f"relays {missing} did not start within {timeout:.0f}s")

    def _background(self, work: Any) -> None:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
