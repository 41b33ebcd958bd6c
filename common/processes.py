"""What one process can tell of another by its pid: whether it runs, and when it started (so a reused pid
is not mistaken for it)."""

from __future__ import annotations

from pathlib import Path


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
