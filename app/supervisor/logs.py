"""The logs of the processes a supervisor starts, read for what a person needs: why one failed, in one line; and
a bound on how many are kept."""

from __future__ import annotations

import re
from pathlib import Path

# "SomeError: why" (a traceback's last line; a module path allowed) or the CLI's one-line error
_EXCEPTION_LINE = re.compile(r"^(warmgate: error: |[A-Za-z_][\w.]*(Error|Exception|Refused|Mismatch|Unavailable)\b)")


def last_error(log_path: Path) -> str:
    """The line of a process's log that says why it failed: the last exception line of its traceback (`Name: why`,
    or `warmgate: error: ...`), else its last line."""
    try:
        lines = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "(no log)"
    for line in reversed(lines):
        if _EXCEPTION_LINE.match(line):
            return line.strip()
    return lines[-1].strip() if lines else "(no output)"


def remove_old_logs(run_dir: Path, pattern: str, keep: int) -> None:
    """The oldest logs matching ``pattern`` beyond the newest ``keep`` (a log being written is among the newest)."""

    def modified(path: Path) -> float:
        try:
            return path.stat().st_mtime
        except OSError:  # removed meanwhile
            return 0.0

    logs = sorted(run_dir.glob(pattern), key=modified)
    for old in logs[: max(0, len(logs) - keep)]:
        old.unlink(missing_ok=True)
