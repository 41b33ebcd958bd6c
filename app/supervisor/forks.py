"""The supervisor's side of the fork server (engine/fork_server.py): start it, ask it for workers.

A forked worker is handed to the engine manager as a ForkedProcess, which offers what the manager
uses of an asyncio subprocess (pid, returncode, wait, send_signal, kill): the exit code comes
from the fork server, which reaps its children, over the connection that asked for the worker.
When the fork server is gone the manager spawns workers itself and has this handle start a new
fork server in the background.

The fork server outlives a supervisor that dies, as the engines it forked do: the next supervisor adopts it
(``adopt``: the pid recorded in the run dir's state, still listening), watched through a pidfd.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from app.supervisor.terminate import terminate
from common.events import log_event
from common.framing import ProtocolError, read_message, write_message
from common.processes import AdoptedProcess, pid_alive
from engine.fork_protocol import ChildExit, SpawnReply, SpawnRequest

log = logging.getLogger("warmgate.supervisor.forks")
START_TIMEOUT = 120.0  # seconds for a new fork server to import torch and listen


class ForkServerUnavailable(RuntimeError):
    """No fork server answers; the caller spawns the worker itself."""


class ForkedProcess:
    """A worker forked by the fork server, seen as the asyncio subprocess the manager expects."""

    def __init__(self, pid: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._exited = asyncio.get_running_loop().create_task(self._exit_code(reader, writer))

    async def _exit_code(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> int:
        exit_notice: ChildExit | None = None
        try:
            message = await read_message(reader)
            exit_notice = ChildExit.model_validate(message) if message is not None else None
        except (OSError, ProtocolError, ValueError):
            pass
        finally:
            writer.close()
        if exit_notice is None:
            # The fork server died first; its orphaned child was re-parented: watch the pid instead.
            while pid_alive(self.pid):
                await asyncio.sleep(0.1)
            code = -signal.SIGKILL.value  # unknown; most likely killed
        else:
            code = exit_notice.exit
        self.returncode = code
        return code

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """A fork-server process of the gateway's, started on demand and restarted when it dies."""

    def __init__(self, socket: Path, log_path: Path, backend: str = "native") -> None:
        self.socket = socket
        self.log_path = log_path
        self.backend = backend  # whose modules the fork server imports before forking (vllm: ~10 s less per start)
        self.process: asyncio.subprocess.Process | AdoptedProcess | None = None
        self._starting: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.returncode is None and self.socket.exists()

    async def start(self) -> None:
        """Start the fork server and wait until it listens (it imports torch and the engine first)."""
        t = time.perf_counter()
        with self.log_path.open("ab") as out:
            self.process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "app.cli", "fork-server", "--socket", str(self.socket),
                "--backend", self.backend, stdout=out, stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C in a terminal is the supervisor's: it stops the fork server in order
            )  # fmt: skip
        deadline = time.monotonic() + START_TIMEOUT
        while not self._listening():
            if self.process.returncode is not None or time.monotonic() > deadline:
                raise ForkServerUnavailable(f"the fork server did not start; log: {self.log_path}")
            await asyncio.sleep(0.05)
        log_event(log, "fork_server_ready", pid=self.process.pid, seconds=time.perf_counter() - t)

    def adopt(self, pid: int, started: int | None) -> bool:
        """Take over an earlier supervisor's fork server (pid ``pid``, started at ``started``) if it still serves."""
        try:
            process = AdoptedProcess(pid, started)
        except (ProcessLookupError, PermissionError):
            return False
        if not self._listening():
            return False
        self.process = process
        log_event(log, "fork_server_adopted", pid=pid)
        return True

    @staticmethod
    async def stop_earlier(pid: int, started: int | None) -> None:
        """Stop an earlier supervisor's fork server (an upgrade: new engines are forked from the new code); the
        engines it forked serve on (each in its own session)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            await terminate(AdoptedProcess(pid, started), 10)
            log_event(log, "fork_server_replaced", pid=pid)

    def _listening(self) -> bool:
        if not self.socket.exists():
            return False
        with contextlib.suppress(OSError), open_socket(self.socket):
            return True
        return False

    def restart_in_background(self) -> None:
        """Start a new fork server unless one is running or starting."""
        if self.running or (self._starting is not None and not self._starting.done()):
            return

        async def restart() -> None:
            with contextlib.suppress(ForkServerUnavailable):
                await self.stop()
                await self.start()

        self._starting = asyncio.get_running_loop().create_task(restart())

    async def spawn(self, argv: list[str], log_path: Path) -> ForkedProcess:
        """A worker running ``warmgate <argv>`` forked from the server, its output in ``log_path``."""
        if not self.running:
            raise ForkServerUnavailable("the fork server is not running")
        try:
            reader, writer = await asyncio.open_unix_connection(str(self.socket))
            write_message(writer, SpawnRequest(argv=argv, log=str(log_path)).model_dump())
            await writer.drain()
            message = await asyncio.wait_for(read_message(reader), 30)
        except (OSError, ProtocolError, TimeoutError) as exc:
            raise ForkServerUnavailable(f"the fork server did not answer: {exc}") from None
        try:
            reply = SpawnReply.model_validate(message)
        except ValueError:
            writer.close()
            raise ForkServerUnavailable(f"the fork server refused: {message}") from None
        return ForkedProcess(reply.pid, reader, writer)

    async def stop(self) -> None:
        if self.process is not None:
            await terminate(self.process, 10)


def open_socket(path: Path) -> Any:
    import socket

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
    except OSError:
        sock.close()
        raise
    return sock
