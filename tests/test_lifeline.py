"""common/lifeline.py: an engine's death seen on its lifeline, a connection it holds from its start; the supervisor's
launcher reports it before the process's exit code is known (the gap is the CUDA driver's teardown on a GPU:
bench/kill_exit_probe.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from common.lifeline import Lifelines

ROOT = Path(__file__).resolve().parent.parent
HOLDER = "import sys, time; from pathlib import Path; from common.lifeline import hold; hold(Path(sys.argv[1])); " \
         "print('held', flush=True); time.sleep(60)"  # fmt: skip
pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_a_killed_holder_cuts_its_lifeline_and_one_that_never_held_it_does_not(tmp_path: Path) -> None:
    lifelines = Lifelines()
    path = await lifelines.listen(tmp_path / "lifeline.sock")
    assert await lifelines.listen(tmp_path / "other.sock") == path  # one listener
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(path)], cwd=ROOT, stdout=subprocess.PIPE)
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert holder.stdout is not None
        assert (await asyncio.to_thread(holder.stdout.readline)).strip() == b"held"
        cut = asyncio.ensure_future(lifelines.cut(holder.pid))
        stranger_cut = asyncio.ensure_future(lifelines.cut(stranger.pid))
        stranger.kill()
        await asyncio.to_thread(stranger.wait)  # gone, but it never connected: only its exit would tell
        await asyncio.sleep(0)
        assert not stranger_cut.done()
        assert not cut.done()  # alive: its lifeline holds
        os.kill(holder.pid, signal.SIGKILL)
        await asyncio.wait_for(cut, 5)
        stranger_cut.cancel()
    finally:
        for process in (holder, stranger):
            process.kill()
            process.wait()
        lifelines.close()
    assert not path.exists()
