"""Stopping a child process the supervisor started: SIGTERM, then SIGKILL after a grace period."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from typing import Any


async def terminate(process: Any, grace: float) -> None:
    """SIGTERM ``process`` (an asyncio subprocess or a ForkedProcess) and wait; SIGKILL it after ``grace`` seconds."""
    if process.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        process.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(process.wait(), grace)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()
