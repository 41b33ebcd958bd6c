"""The supervisor's side of the cache process: start one for a model, or adopt one already serving it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.terminate import terminate
from cache.client import CacheClient, CacheRefused, CacheUnavailable
from cache.events import log_event
from cache.manifest import expected_key
from cache.processing import compute_dtype
from common.device import resolve_device

log = logging.getLogger("warmgate.gateway.cache")


class CacheStartError(RuntimeError):
    """The cache process did not come up (bad checkpoint, out of memory); the message says why."""


@dataclass
class CacheHandle:
    model: Path
    socket: Path
    key: str
    process: asyncio.subprocess.Process | None  # None: adopted, not ours to stop

    def stats(self, timeout: float = 10.0) -> dict[str, Any]:
        """The cache's stats (a blocking call: from the event loop, run it in a thread)."""
        with CacheClient(self.socket, name="gateway", timeout=timeout) as client:
            return client.stats()

    async def stop(self) -> None:
        if self.process is not None:
            await terminate(self.process, 30)


def _expected(model: Path, device: str, dtype: str) -> str:
    target = resolve_device(device)
    return expected_key(model, target, compute_dtype(target, dtype))


async def start_or_adopt(model: Path, socket: Path, device: str, dtype: str, log_path: Path,
                         timeout: float = 600.0) -> CacheHandle:  # fmt: skip
    """A cache serving ``model`` for engines on ``device``: the one on ``socket`` if its key matches."""
    key = _expected(model, device, dtype)
    with contextlib.suppress(CacheUnavailable, CacheRefused), CacheClient(socket, name="gateway") as client:
        if client.hello["key"] == key:
            log_event(log, "cache_adopted", socket=socket, pid=client.hello.get("pid"), key=key[:12])
            return CacheHandle(model, socket, key, None)
        raise CacheStartError(f"{socket} already serves another model ({client.hello.get('model')}); "
                              "stop it or choose another run dir")  # fmt: skip
    with log_path.open("ab") as out:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "app.cli", "cache", "--model", str(model), "--socket", str(socket),
            "--device", device, "--dtype", dtype, stdout=out, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
    handle = CacheHandle(model, socket, key, process)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        if process.returncode is not None:
            tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
            raise CacheStartError(f"the cache process exited with {process.returncode}: {tail[0]}")
        try:
            with CacheClient(socket, name="gateway") as client:
                if client.hello["key"] != key:
                    raise CacheStartError("the cache process serves another key than expected")
            log_event(log, "cache_started", socket=socket, pid=process.pid, key=key[:12])
            return handle
        except CacheUnavailable:
            await asyncio.sleep(0.1)
    await handle.stop()
    raise CacheStartError(f"the cache process was not ready after {timeout:.0f}s")
