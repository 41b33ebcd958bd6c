"""The supervisor's side of the cache process: start one for a spec, or adopt one already serving it.

A cache is known by its spec (model, engine backend, device, dtype), which fixes its key: a reload that
changes any of them needs another cache, and the one it replaces is stopped once the engines moved.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.supervisor.logs import last_error
from app.supervisor.terminate import terminate
from cache.client import CacheClient, CacheRefused, CacheUnavailable
from cache.manifest import expected_key
from cache.processors import compute_dtype
from cache.protocol import StatsReply
from common.device import resolve_device
from common.events import log_event
from common.processes import pid_alive
from common.uds import remove_if_stale

log = logging.getLogger("warmgate.supervisor.cache")


class CacheStartError(RuntimeError):
    """The cache process did not come up (bad checkpoint, out of memory); the message says why."""


@dataclass(frozen=True)
class CacheSpec:
    """What a cache holds: one checkpoint, processed by one engine backend's processor, for a device and dtype."""

    model: Path
    backend: str
    device: str
    dtype: str

    @classmethod
    def of(cls, settings: Any, model: Path) -> CacheSpec:
        """The cache that engines configured by ``settings`` (app/config.py's Settings) attach."""
        engine = settings.engine
        return cls(model, engine.backend, settings.cache_device or engine.device, engine.dtype)

    def key(self) -> str:
        """The key a cache for this spec has (from checkpoint metadata alone; raises if the backend is missing)."""
        target = resolve_device(self.device)
        return expected_key(self.model, target, compute_dtype(target, self.dtype, self.backend), self.backend)


@dataclass
class CacheHandle:
    spec: CacheSpec
    socket: Path
    key: str
    process: asyncio.subprocess.Process | None  # None: adopted (started by an earlier supervisor)
    pid: int | None = None

    @property
    def model(self) -> Path:
        return self.spec.model

    def stats(self, timeout: float = 10.0) -> StatsReply:
        """The cache's stats (a blocking call: from the event loop, run it in a thread)."""
        with CacheClient(self.socket, name="gateway", timeout=timeout) as client:
            return client.stats()

    async def wait_exit(self, poll: float = 1.0) -> int | None:
        """Return when the cache process has exited: its exit code (ours), or None (adopted: not our child,
        so it is polled)."""
        if self.process is not None:
            return await self.process.wait()
        while self.pid is not None and pid_alive(self.pid):
            await asyncio.sleep(poll)
        return None

    def remove_stale_socket(self) -> None:
        """The socket file of a cache process that died without removing it (kill -9), if nobody listens on it."""
        remove_if_stale(self.socket)

    async def stop(self) -> None:
        """Stop the cache process, ours or adopted; engines that attached keep their mappings."""
        if self.process is not None:
            await terminate(self.process, 30)
        elif self.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)  # the socket's peer check proved it runs as our user
            with contextlib.suppress(TimeoutError):  # not our child: poll until it is gone (it unlinks its socket)
                await asyncio.wait_for(self.wait_exit(poll=0.05), 30)
            log_event(log, "cache_stopped", socket=self.socket, pid=self.pid, adopted=True)


async def adopt_or_start(spec: CacheSpec, run_dir: Path, socket: Path, log_path: Path) -> CacheHandle:
    """The cache for ``spec`` at a gateway's start: one already serving it in the run dir (an earlier
    supervisor's, which died: the model is still resident, nothing is read from disk), else a new one on
    ``socket``. Caches in the run dir that hold other weights are left over from that supervisor: stopped."""
    key = _key(spec)
    adopted: CacheHandle | None = None
    for path in sorted(run_dir.glob("cache*.sock")):
        if remove_if_stale(path):  # left by a cache process that was killed
            continue
        with contextlib.suppress(CacheUnavailable, CacheRefused), CacheClient(path, name="gateway") as client:
            pid = client.hello.pid
            if adopted is None and client.hello.key == key:
                log_event(log, "cache_adopted", socket=path, pid=pid, key=key[:12])
                adopted = CacheHandle(spec, path, key, None, pid)
                continue
            log_event(log, "cache_stale", socket=path, pid=pid, key=client.hello.key[:12])
            await CacheHandle(spec, path, client.hello.key, None, pid).stop()
    return adopted or await start_or_adopt(spec, socket, log_path)


def _key(spec: CacheSpec) -> str:
    try:
        return spec.key()
    except RuntimeError as exc:  # the vllm backend without vLLM installed
        raise CacheStartError(str(exc)) from None


async def start_or_adopt(spec: CacheSpec, socket: Path, log_path: Path, timeout: float = 600.0) -> CacheHandle:
    """A cache for ``spec``: the one on ``socket`` if its key matches, else a new cache process."""
    key = _key(spec)
    with contextlib.suppress(CacheUnavailable, CacheRefused), CacheClient(socket, name="gateway") as client:
        if client.hello.key == key:
            log_event(log, "cache_adopted", socket=socket, pid=client.hello.pid, key=key[:12])
            return CacheHandle(spec, socket, key, None, client.hello.pid)
        serving = f"{client.hello.model}, {client.hello.backend} backend"
        raise CacheStartError(f"{socket} already serves other weights ({serving}); stop it or choose another run dir")
    with log_path.open("ab") as out:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "app.cli", "cache", "--model", str(spec.model), "--socket", str(socket),
            "--device", spec.device, "--dtype", spec.dtype, "--backend", spec.backend, stdout=out,
            stderr=asyncio.subprocess.STDOUT, start_new_session=True,  # Ctrl-C in a terminal is the supervisor's
        )  # fmt: skip
    handle = CacheHandle(spec, socket, key, process, process.pid)
    try:
        await _until_serving(handle, log_path, timeout)
    except BaseException:  # it failed, or the start was given up (a stop while it loads): nothing is left behind
        await handle.stop()
        raise
    log_event(log, "cache_started", socket=socket, pid=process.pid, key=key[:12])
    return handle


async def _until_serving(handle: CacheHandle, log_path: Path, timeout: float) -> None:
    process = handle.process
    assert process is not None
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        if process.returncode is not None:
            raise CacheStartError(f"the cache process exited with {process.returncode}: {last_error(log_path)}")
        try:
            with CacheClient(handle.socket, name="gateway") as client:
                if client.hello.key != handle.key:
                    raise CacheStartError("the cache process serves another key than expected")
            return
        except CacheUnavailable:
            await asyncio.sleep(0.1)
    raise CacheStartError(f"the cache process was not ready after {timeout:.0f}s")
