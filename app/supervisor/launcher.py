"""What the supervisor does to one engine worker: start it (forked, else spawned), wait until it serves, probe
it with a real 1-token generation, drain it, stop it. The reconciler decides when; these only do it, and
never change an engine's state.

The supervisor speaks to an engine over its Unix socket with httpx: a handful of calls per engine
lifetime, off every request's path (relays carry the requests).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from pathlib import Path
from typing import Protocol

import httpx
from pydantic import ValidationError

from app.supervisor.engines import Engine, EngineStartError, RestartReport, WorkerProcess
from app.supervisor.forks import ForkServer, ForkServerUnavailable
from app.supervisor.logs import last_error
from app.supervisor.terminate import terminate
from common import lifeline
from common.events import log_event
from common.heartbeat import Heartbeat
from engine.protocol import ActivateRequest, DrainRequest, HealthResponse

log = logging.getLogger("warmgate.supervisor.launcher")
# An engine's start-up as it reports it (/health's startup_phases), copied into the restart's report.
STARTUP_PHASES = ("tokenizer", "device_init", "weight_load", "model_init", "kv_alloc", "deep_gemm", "cuda_graphs",
                  "graph_inputs", "graph_warmup", "graph_capture", "graph_free", "graph_replay", "warmup",
                  "server_warmup", "gc")  # fmt: skip
PROBE = {"prompt": "Hello", "max_tokens": 1, "temperature": 0}


class Launcher(Protocol):
    """The primitives the reconciler acts through (a fake one drives it in unit tests)."""

    async def start(self, engine: Engine, report: RestartReport, timeout: float) -> None:
        """Launch the engine's process, wait until it serves and answers a probe; EngineStartError if it does not
        (its process is stopped then)."""

    async def probe(self, engine: Engine, timeout: float) -> None:
        """A real 1-token generation; EngineStartError (or TimeoutError) if it fails."""

    async def activate(self, engine: Engine, timeout: float) -> None:
        """Have the engine commit its KV cache's memory (engine/native/kv_memory.py), waiting up to ``timeout`` for
        the device to have it; EngineStartError if it cannot."""

    async def retire(self, engine: Engine, drain_timeout: float) -> None:
        """Drain the engine (its requests finish, it takes no new ones), then stop it."""

    async def stop(self, engine: Engine, grace: float) -> None:
        """Stop the engine's process (SIGTERM, SIGKILL after ``grace``) and remove its files."""

    async def health(self, engine: Engine, timeout: float) -> HealthResponse | None:
        """What the engine says of itself (None: no answer)."""

    async def gone(self, engine: Engine) -> int | None:
        """Once the engine's process is dead: its exit code, or None when its death is seen before its exit."""

    def announce(self, engine: Engine) -> None:
        """Tell the engine its state (it shows it in its process title)."""


class WorkerLauncher:
    """The real thing: `warmgate engine` processes on Unix sockets in the run dir."""

    def __init__(self, forker: ForkServer | None) -> None:
        self.forker = forker
        self._clients: dict[int, httpx.AsyncClient] = {}

    def _http(self, engine: Engine) -> httpx.AsyncClient:
        client = self._clients.get(engine.id)
        if client is None:
            transport = httpx.AsyncHTTPTransport(uds=str(engine.socket))
            client = httpx.AsyncClient(transport=transport, base_url="http://engine", timeout=None)
            self._clients[engine.id] = client
        return client

    async def start(self, engine: Engine, report: RestartReport, timeout: float) -> None:
        t = time.perf_counter()
        Heartbeat.create(engine.heartbeat_path).close()
        lifeline.create(engine.lifeline_path)
        argv = ["engine", "--socket", str(engine.socket), "--heartbeat", str(engine.heartbeat_path),
                "--lifeline", str(engine.lifeline_path), "--config", engine.config.model_dump_json()]  # fmt: skip
        engine.process, engine.path = await self._launch(argv, engine.log_path)
        report.phases["spawn"] = time.perf_counter() - t
        try:
            t = time.perf_counter()
            await asyncio.wait_for(self._until_healthy(engine), timeout)
            report.phases["init"] = time.perf_counter() - t
            assert engine.health is not None
            for phase in STARTUP_PHASES:
                if phase in engine.health.startup_phases:
                    report.phases[phase] = engine.health.startup_phases[phase]
            t = time.perf_counter()
            await self.probe(engine, timeout)
            report.phases["probe"] = time.perf_counter() - t
        except (TimeoutError, EngineStartError, httpx.HTTPError) as exc:
            await self.stop(engine, grace=10)
            why = "did not become ready in time" if isinstance(exc, TimeoutError) else str(exc)
            raise EngineStartError(f"engine {engine.id} {why}: {last_error(engine.log_path)}") from None

    async def _launch(self, argv: list[str], log_path: Path) -> tuple[WorkerProcess, str]:
        """Fork the worker from the fork server (Python and torch already imported there), else spawn it."""
        if self.forker is not None:
            try:
                return await self.forker.spawn(argv, log_path), "fork"
            except ForkServerUnavailable as exc:
                log_event(log, "fork_fallback", reason=exc)
                self.forker.restart_in_background()
        with log_path.open("wb") as out:
            # In its own session, as a forked worker is: Ctrl-C in a terminal is the supervisor's to pass on.
            spawned = await asyncio.create_subprocess_exec(sys.executable, "-m", "app.cli", *argv, stdout=out,
                                                           stderr=asyncio.subprocess.STDOUT,
                                                           start_new_session=True)  # fmt: skip
        return spawned, "spawn"

    async def _until_healthy(self, engine: Engine) -> None:
        assert engine.process is not None
        while True:
            if engine.process.returncode is not None:
                raise EngineStartError(f"exited with {engine.process.returncode} during start-up")
            health = await self.health(engine, 5) if engine.socket.exists() else None
            if health is not None and health.status == "ok":
                return
            await asyncio.sleep(0.05)

    async def probe(self, engine: Engine, timeout: float) -> None:
        response = await asyncio.wait_for(self._http(engine).post("/v1/completions", json=PROBE), timeout)
        if response.status_code != 200:
            raise EngineStartError(f"probe answered {response.status_code}: {response.text[:200]}")

    async def activate(self, engine: Engine, timeout: float) -> None:
        try:
            body = ActivateRequest(timeout=timeout).model_dump()
            response = await asyncio.wait_for(self._http(engine).post("/activate", json=body), timeout + 5)
        except (httpx.HTTPError, OSError, TimeoutError) as exc:
            raise EngineStartError(f"activation failed: {type(exc).__name__}: {exc}") from None
        if response.status_code != 200:
            raise EngineStartError(f"activation answered {response.status_code}: {response.text[:300]}")

    async def gone(self, engine: Engine) -> int | None:
        assert engine.process is not None and engine.pid is not None
        exited = asyncio.ensure_future(engine.process.wait())
        cut = asyncio.ensure_future(lifeline.cut(engine.lifeline_path))
        try:
            await asyncio.wait({exited, cut}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            cut.cancel()
        return exited.result() if exited.done() else None

    async def retire(self, engine: Engine, drain_timeout: float) -> None:
        with contextlib.suppress(httpx.HTTPError, TimeoutError):
            body = DrainRequest(timeout=drain_timeout).model_dump()
            await asyncio.wait_for(self._http(engine).post("/drain", json=body), drain_timeout + 5)
        await self.stop(engine, grace=10)

    async def stop(self, engine: Engine, grace: float) -> None:
        if engine.process is not None:
            await terminate(engine.process, grace)
        client = self._clients.pop(engine.id, None)
        if client is not None:
            await client.aclose()
        engine.socket.unlink(missing_ok=True)  # a killed worker cannot remove it itself
        engine.heartbeat_path.unlink(missing_ok=True)
        engine.lifeline_path.unlink(missing_ok=True)

    def announce(self, engine: Engine) -> None:
        with contextlib.suppress(OSError, ValueError):  # its file is gone: it is being stopped
            heartbeat = Heartbeat(engine.heartbeat_path)
            try:
                heartbeat.tell_state(engine.state.value)
            finally:
                heartbeat.close()

    async def health(self, engine: Engine, timeout: float) -> HealthResponse | None:
        try:
            response = await self._http(engine).get("/health", timeout=timeout)
            health = HealthResponse.model_validate_json(response.content)
        except (httpx.HTTPError, OSError, ValidationError):
            return None
        engine.health = health
        return health
