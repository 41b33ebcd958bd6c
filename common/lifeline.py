"""An engine's death seen the moment it begins, before the kernel has torn the process down.

A process killed with SIGKILL is seen exited (waitpid, a pidfd) only once the kernel has torn it down, and a CUDA
process's teardown frees its memory first: on the H200 a process holding 57 GB was seen exited 0.15 s after the
kill (0.31 s when the memory was 3,648 allocations), and even a socket it held read EOF only after 0.04-0.06 s
(bench/kill_exit_probe.py, docs/benchmarks.md): a dying process's files are closed after its memory is freed.
What the kernel does first for each dying thread, before it frees any memory, is to release the robust futexes the
thread holds (its robust list): a process-shared robust pthread mutex held by the dead thread is handed to the
next waiter with EOWNERDEAD. Here a killed process holding 4 GB woke the waiter 0.2 ms after the kill, while its
socket read EOF after 330 ms (tests/test_lifeline.py shows the order).

So the supervisor makes one small file per engine holding such a mutex (``create``), before it starts the
engine; the engine locks it first thing and keeps it for its whole life (``hold``), then writes its pid after it;
the supervisor's ``cut`` waits for the mutex in a thread and takes EOWNERDEAD as the engine's death. An engine
that never holds its lifeline (one started by an earlier version) is seen at its exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import functools
import mmap
import os
import struct
import threading
import time
from pathlib import Path

SIZE = 4096  # one page: the mutex at 0 (40 bytes on x86-64 glibc, 48 on aarch64), the holder's pid at PID
PID = 64
_PID = struct.Struct("@q")
SLICE_S = 0.5  # a waiter's lock attempts last this long, so that one no longer wanted ends soon
HOLDER_POLL_S = 0.01  # a waiter's look for the holder's pid, before the engine has taken the lock

_held: list[object] = []  # the engine's mapping and mutex, locked until the process ends


def beside(engine_socket: str | Path) -> Path:
    """An engine's lifeline file: its socket's name with ``.life`` (the supervisor names them so)."""
    return Path(engine_socket).with_suffix(".life")


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library's pthread functions (the process's own symbols), or None where robust mutexes are missing."""
    libc = ctypes.CDLL(None, use_errno=True)
    return libc if hasattr(libc, "pthread_mutexattr_setrobust") else None


class _Mapped:
    """The lifeline file mapped: its mutex's address, and the holder's pid."""

    def __init__(self, path: Path) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            self.map = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        self._anchor = ctypes.c_char.from_buffer(self.map)  # keeps the mapping while its address is used
        self.mutex = ctypes.c_void_p(ctypes.addressof(self._anchor))

    @property
    def pid(self) -> int:
        return _PID.unpack_from(self.map, PID)[0]

    def close(self) -> None:
        del self._anchor
        self.map.close()


def create(path: Path) -> None:
    """Supervisor side: a new lifeline file (mode 0600) with its mutex unlocked, no holder yet."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, bytes(SIZE))
    finally:
        os.close(fd)
    libc = _libc()
    if libc is None:
        return
    mapped = _Mapped(path)
    attr = ctypes.create_string_buffer(64)  # pthread_mutexattr_t: 4 bytes on glibc
    try:
        for call, args in ((libc.pthread_mutexattr_init, ()), (libc.pthread_mutexattr_setpshared, (1,)),
                           (libc.pthread_mutexattr_setrobust, (1,))):  # fmt: skip
            if call(attr, *args) != 0:
                raise OSError(f"{call.__name__} failed")
        if (rc := libc.pthread_mutex_init(mapped.mutex, attr)) != 0:
            raise OSError(rc, f"pthread_mutex_init: {os.strerror(rc)}")
        libc.pthread_mutexattr_destroy(attr)
    finally:
        mapped.close()


def hold(path: Path) -> None:
    """Engine side: lock the lifeline for the rest of this process's life (call it from the main thread: a robust
    mutex is released when the thread that holds it ends), then say who holds it. Without the file, or where robust
    mutexes are missing, nothing: the supervisor sees this engine at its exit."""
    libc = _libc()
    if libc is None:
        return
    try:
        mapped = _Mapped(path)
    except OSError:
        return
    rc = libc.pthread_mutex_lock(mapped.mutex)
    if rc == errno.EOWNERDEAD:  # a file some dead process held: ours now
        libc.pthread_mutex_consistent(mapped.mutex)
    elif rc != 0:
        mapped.close()
        return
    _PID.pack_into(mapped.map, PID, os.getpid())
    _held.append(mapped)


def _wait(path: Path, stop: threading.Event) -> bool:
    """In a thread: True once the holder of ``path``'s lifeline has died; False if ``stop`` is set first, or there
    is no lifeline to watch."""
    libc = _libc()
    if libc is None:
        return False
    try:
        mapped = _Mapped(path)
    except (OSError, ValueError):
        return False
    try:
        while mapped.pid == 0:  # the engine has not taken it yet: locking now would take it from under it
            if stop.wait(HOLDER_POLL_S):
                return False
        lock = libc.pthread_mutex_timedlock
        while not stop.is_set():
            deadline = time.time() + SLICE_S  # the timeout is on CLOCK_REALTIME
            rc = lock(mapped.mutex, ctypes.byref(_Timespec(int(deadline), int(deadline % 1 * 1e9))))
            if rc == errno.EOWNERDEAD:  # left to us by the engine's dying thread
                # Unlocked without being made consistent, it stays out of this thread's robust list (the mapping
                # goes now) and answers ENOTRECOVERABLE to every later waiter: the engine is dead for them too.
                libc.pthread_mutex_unlock(mapped.mutex)
                return True
            if rc == errno.ENOTRECOVERABLE:  # an earlier waiter saw the death
                return True
            if rc == 0:  # released without dying: not our protocol; the exit will tell
                libc.pthread_mutex_unlock(mapped.mutex)
                return False
            if rc != errno.ETIMEDOUT:
                return False
        return False
    finally:
        mapped.close()


async def cut(path: Path) -> None:
    """Until the engine holding ``path``'s lifeline dies (forever if none ever holds it). The waiting is done by a
    thread blocked on the mutex, which ends within SLICE_S of this call's cancellation."""
    loop = asyncio.get_running_loop()
    died: asyncio.Future[None] = loop.create_future()
    stop = threading.Event()

    def watch() -> None:
        if _wait(path, stop):
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
                loop.call_soon_threadsafe(lambda: None if died.done() else died.set_result(None))

    threading.Thread(target=watch, name=f"lifeline {path.name}", daemon=True).start()
    try:
        await died
    finally:
        stop.set()
