"""An engine's death seen as soon as the kernel closes its files, before its exit.

A process killed with SIGKILL is seen exited (waitpid, a pidfd) only once the kernel has torn it down, and a CUDA
process's teardown frees its device memory first: on the H200 a process holding 57 GB was seen exited 0.15 s after
the kill (0.31 s when the memory was 3,648 allocations), and a crash's replacement waited that long. The kernel
closes a dying process's descriptors in order, lowest first: a socket the engine connects before it initializes
CUDA has a lower number than the driver's files and reads EOF on the supervisor's side after 0.04-0.06 s
(bench/kill_exit_probe.py, docs/benchmarks.md).

So each engine the supervisor starts connects to the supervisor's lifeline socket first thing, says its pid, and
keeps the connection open for its whole life (``hold``); the supervisor (``Lifelines``) takes the connection's EOF
as the engine's death. An engine that never connects (one adopted from an earlier supervisor) is seen at its exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from pathlib import Path

_held: list[socket.socket] = []  # the engine's end, open until the process ends


def hold(path: Path) -> None:
    """Engine side: connect to the supervisor's lifeline and keep it, before anything opens the CUDA driver's
    files (a new descriptor takes the lowest free number: theirs come after)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
        sock.sendall(f"{os.getpid()}\n".encode())
    except OSError:  # no lifeline: the supervisor sees this engine at its exit instead
        sock.close()
        return
    _held.append(sock)


class Lifelines:
    """Supervisor side: the engines' connections, by pid; ``cut`` returns once an engine's has closed."""

    def __init__(self) -> None:
        self.path: Path | None = None
        self._server: asyncio.Server | None = None
        self._cut: dict[int, asyncio.Event] = {}

    async def listen(self, path: Path) -> Path:
        """Listen at ``path`` (once; later calls return where it listens)."""
        if self._server is None:
            path.unlink(missing_ok=True)
            self._server = await asyncio.start_unix_server(self._connected, str(path))
            os.chmod(path, 0o600)
            self.path = path
        assert self.path is not None
        return self.path

    async def cut(self, pid: int) -> None:
        """Until the engine ``pid``'s connection closes (forever if it never connects)."""
        await self._cut.setdefault(pid, asyncio.Event()).wait()

    def forget(self, pid: int) -> None:
        self._cut.pop(pid, None)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        if self.path is not None:
            self.path.unlink(missing_ok=True)

    async def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await reader.readline()
            pid = int(line)
        except (ValueError, OSError):
            writer.close()
            return
        with contextlib.suppress(OSError):
            while await reader.read(4096):  # an engine says nothing more: only its end counts
                pass
        writer.close()
        event = self._cut.get(pid)  # awaited from the engine's start on; an engine dead before then is seen exited
        if event is not None:
            event.set()
