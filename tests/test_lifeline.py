"""common/lifeline.py: an engine's death seen on its lifeline, a robust mutex it holds from its start, while the kernel
is still tearing the process down (on a GPU that teardown is the CUDA driver's: bench/kill_exit_probe.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from common import lifeline

ROOT = Path(__file__).resolve().parent.parent
# Holds its lifeline, then 4 GB of touched memory, which the kernel frees before the process's files close and
# before it is seen exited (0.33 s on a CPU machine of 2 cores).
HOLDER = ("import sys, time; from pathlib import Path; from common.lifeline import hold; hold(Path(sys.argv[1])); "
          "big = b'1' * (4 << 30); print('held', flush=True); time.sleep(60)")  # fmt: skip
pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_a_killed_holder_is_seen_dying_before_its_memory_is_freed_and_one_that_never_held_it_is_not(
        tmp_path: Path) -> None:  # fmt: skip
    held, unheld = tmp_path / "held.life", tmp_path / "unheld.life"
    lifeline.create(held)
    lifeline.create(unheld)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(held)], cwd=ROOT, stdout=subprocess.PIPE)
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # never takes `unheld`
    try:
        assert holder.stdout is not None
        assert (await asyncio.to_thread(holder.stdout.readline)).strip() == b"held"
        cut = asyncio.ensure_future(lifeline.cut(held))
        stranger_cut = asyncio.ensure_future(lifeline.cut(unheld))
        stranger.kill()
        await asyncio.to_thread(stranger.wait)
        assert not cut.done()  # alive: its lifeline holds
        os.kill(holder.pid, signal.SIGKILL)
        await asyncio.wait_for(cut, 5)
        # Seen while the kernel still frees its 4 GB: not yet exited.
        assert os.waitpid(holder.pid, os.WNOHANG) == (0, 0)
        later = asyncio.ensure_future(lifeline.cut(held))  # a second watcher (an adopting supervisor) sees it too
        await asyncio.wait_for(later, 5)
        # The stranger died before the holder and was watched as long: its lifeline was never held, only its exit
        # tells.
        assert not stranger_cut.done()
        stranger_cut.cancel()
    finally:
        for process in (holder, stranger):
            process.kill()
            process.wait()


def test_an_engine_without_a_lifeline_file_holds_nothing_and_is_never_cut(tmp_path: Path) -> None:
    missing = tmp_path / "missing.life"
    lifeline.hold(missing)  # no file (a supervisor that made none): nothing held, no error
    assert not missing.exists()
    assert lifeline._wait(missing, threading.Event()) is False  # cut's watcher has nothing to report: cut waits on
