"""Process titles: `ps` says what each warmgate process is (`warmgate: engine 1-3 standby /tmp/warmgate`), not
`python -m app.cli fork-server` for every forked engine; and the threads' OS names, by which /proc tells their CPU
time apart (bench/serve_load.py reads the engine thread's)."""

from __future__ import annotations

import setproctitle


def set_title(title: str) -> None:
    setproctitle.setproctitle(f"warmgate: {title}")


ENGINE_THREAD_NAME = "wg-engine"  # the thread that steps an engine (engine/request_stream.py): 15 bytes at most


def set_thread_title(name: str) -> None:
    """The calling thread's OS name (/proc/PID/task/TID/comm; Python's thread names stay in Python)."""
    setproctitle.setthreadtitle(name)
