"""What one process can tell of another by its pid: whether it runs, and when it started (so a reused pid
is not mistaken for it)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import select
import signal
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn


def pid_alive(pid: int) -> bool:
    """The process runs (and is not a zombie: an orphan's new parent may be slow to reap it, or never do)."""
    state = _stat_fields(pid)
    return state is not None and state[0] != "Z"


def start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot, /proc/PID/stat field 22); None if there is none."""
    fields = _stat_fields(pid)
    return None if fields is None else int(fields[19])


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat from field 3 (the state) on; the command name before it may hold spaces and parentheses."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()


class AdoptedProcess:
    """A process of the gateway that this supervisor did not start (an earlier one did, and died): watched through
    a pidfd, so its exit is seen at once although it is not our child, and signalled through it, so a reused pid is
    never signalled. It offers what the supervisor uses of an asyncio subprocess (pid, returncode, wait,
    send_signal, kill); its exit code is not ours to read: ``wait`` returns EXIT_UNKNOWN."""

    EXIT_UNKNOWN = -1

    def __init__(self, pid: int, started: int | None = None) -> None:
        """ProcessLookupError if ``pid`` is gone, or is another process than the one that started at ``started``."""
        self.pid = pid
        self._code: int | None = None
        self._fd = os.pidfd_open(pid)
        if started is not None and start_time(pid) != started:
            os.close(self._fd)
            raise ProcessLookupError(f"pid {pid} is another process now")
        self._exited: asyncio.Future[int] | None = None

    @property
    def returncode(self) -> int | None:
        """None while it runs; EXIT_UNKNOWN once it has exited."""
        if self._code is None and select.select([self._fd], [], [], 0)[0]:  # a pidfd turns readable at its exit
            self._exit()
        return self._code

    def _exit(self) -> None:
        if self._code is None:
            self._code = self.EXIT_UNKNOWN
            with contextlib.suppress(RuntimeError, ValueError, OSError):  # RuntimeError: no loop runs
                asyncio.get_running_loop().remove_reader(self._fd)
            os.close(self._fd)
        if self._exited is not None and not self._exited.done():
            self._exited.set_result(self.EXIT_UNKNOWN)

    async def wait(self) -> int:
        if self.returncode is not None:
            return self.returncode
        if self._exited is None:
            self._exited = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().add_reader(self._fd, self._exit)
        return await asyncio.shield(self._exited)

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            signal.pidfd_send_signal(self._fd, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


@dataclass(frozen=True)
class TitledProcess:
    """A process of one gateway, found by its title (common/proctitle.py: ``warmgate: ROLE ... RUN_DIR``)."""

    pid: int
    role: str  # serve, supervisor, relay, fork server, engine, cache
    words: tuple[str, ...]  # what the title says between the role and the run dir (a relay's slot, an engine's name)


ROLES = ("fork server", "serve", "supervisor", "relay", "engine", "cache")


def gateway_processes(run_dir: Path) -> list[TitledProcess]:
    """Every live process of this user whose title names ``run_dir``: what a gateway on that run dir runs, found
    whether or not a supervisor knows of it (one that died may have started it)."""
    suffix = f" {run_dir.resolve()}"
    found = []
    uid = os.getuid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid != uid:
                continue
            title = (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        if not title.startswith("warmgate: ") or not title.endswith(suffix) or not pid_alive(int(entry.name)):
            continue
        what = title[len("warmgate: ") : -len(suffix)]
        role = next((r for r in ROLES if what == r or what.startswith(r + " ")), None)
        if role is not None:
            found.append(TitledProcess(int(entry.name), role, tuple(what[len(role) :].split())))
    return found


def _kilobytes(path: str, field: str) -> int:
    """A ``field:  N kB`` line of a /proc file, in bytes (0 where it does not say)."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def private_memory() -> int:
    """RssAnon of this process, in bytes (0 where /proc does not say)."""
    return _kilobytes("/proc/self/status", "RssAnon:")


def unshared_memory(pid: int) -> int:
    """Private_Dirty of ``pid`` in bytes (0 where /proc does not say): the pages it wrote that no other process maps.
    A forked child's RssAnon also counts the pages it still shares with its parent (an engine's front processes:
    ~200 MiB each against ~80 written on their own)."""
    return _kilobytes(f"/proc/{pid}/smaps_rollup", "Private_Dirty:")


PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In a forked child: the kernel kills this process (SIGKILL) when the thread that forked it ends."""
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def exit_after(run: Callable[[], int]) -> NoReturn:
    """In a forked child: run, then end the process with what it returned (a SystemExit's code; 1 and the traceback
    for any other exception), never unwinding into the parent's code that forked it."""
    code = 1
    try:
        code = run()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
