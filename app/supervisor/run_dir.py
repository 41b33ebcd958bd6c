"""The run dir as one gateway owns it: a lock held for the life of `warmgate serve` (app/supervisor/master.py), its
address for the CLI, and a generation number (one per supervisor started) that keeps the names of its engines
apart from an earlier supervisor's.

A second `warmgate serve` on a run dir in use used to adopt the first one's cache, overwrite its admin token and
its engines' sockets (both numbered engines from 1). Now it stops at the lock (``flock`` on ``serve.lock``; the
kernel drops it when the process dies, kill -9 included) with an error naming the owner's pid.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from pathlib import Path

from pydantic import BaseModel

LOCK_FILE = "serve.lock"
ADDRESS_FILE = "address"
GENERATION_FILE = "generation"


class RunDirInUse(RuntimeError):
    """Another live gateway owns the run dir."""


class Address(BaseModel):
    """What the CLI reads to find the gateway that owns a run dir."""

    url: str
    pid: int


class RunDir:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.generation = 0
        self._lock: int | None = None

    def claim(self) -> None:
        """Take the run dir for this process (RunDirInUse if a live gateway has it)."""
        fd = os.open(self.path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunDirInUse(f"run dir {self.path} is in use by another warmgate serve (pid {self.owner()}): stop "
                              "it, or give this one another --run-dir") from None  # fmt: skip
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock = fd

    def inherit(self, fd: int) -> None:
        """The lock, held already: this process was exec'd by its holder (an upgrade of `warmgate serve`)."""
        os.set_inheritable(fd, False)
        self._lock = fd

    @property
    def lock_fd(self) -> int | None:
        return self._lock

    def owner(self) -> str:
        """The pid the lock file names (its holder, if it is held)."""
        try:
            return (self.path / LOCK_FILE).read_text().strip() or "unknown"
        except OSError:
            return "unknown"

    def next_generation(self) -> int:
        """A number no earlier supervisor on this run dir had (each supervisor takes one; the lock's holder starts
        them one at a time)."""
        counter = self.path / GENERATION_FILE
        with contextlib.suppress(OSError, ValueError):
            self.generation = int(counter.read_text())
        self.generation += 1
        counter.write_text(f"{self.generation}\n")
        return self.generation

    def record_address(self, url: str) -> None:
        """Where this gateway listens (mode 0600: the run dir's files are its owner's). Written aside and renamed
        into place: a reader polling for it (the CLI, a test) sees no file or the whole address, never an empty
        one."""
        staging = self.path / f".{ADDRESS_FILE}.{os.getpid()}"
        fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(Address(url=url, pid=os.getpid()).model_dump_json() + "\n")
        os.replace(staging, self.path / ADDRESS_FILE)

    def release(self) -> None:
        """The gateway stopped: its address goes; the lock with the file descriptor."""
        (self.path / ADDRESS_FILE).unlink(missing_ok=True)
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None


def read_address(run_dir: Path) -> Address:
    """The address a gateway recorded in ``run_dir``; OSError or ValueError (naming the file) if there is none."""
    path = run_dir / ADDRESS_FILE
    try:
        return Address.model_validate(json.loads(path.read_text()))
    except OSError as exc:
        raise FileNotFoundError(f"no gateway address in {path} ({exc.strerror}): is `warmgate serve` running with "
                                f"--run-dir {run_dir}? (or pass --url)") from None  # fmt: skip
    except ValueError as exc:
        raise ValueError(f"{path} is not a gateway address: {exc}") from None


def url_for(host: str, port: int) -> str:
    """The URL a local client reaches the gateway at (a wildcard address is reached on loopback)."""
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
