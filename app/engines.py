"""The engine manager: a reconciler that keeps one active engine and ``standby`` standbys running.

Explicit states, as in gunicorn's Arbiter:

    starting -> ready -> active -> draining -> stopped
                     \\-> standby -> active (promoted)
        \\-> failed (did not start)      active/standby -> failed (crashed, or hung and killed)

Desired state: an active engine that runs config C and was started (or promoted) for the latest
restart request, plus ``standby`` standbys running C. One loop compares it with what runs and acts
through small primitives: start an engine (forked, else spawned), promote one (a 1-token probe, then
the switch), retire one (drain, stop). Everything else is a change of desired state or of what runs:
an admin restart or a reload posts a request (new C, or the same C again) and waits for its report; a
crash of the active engine leaves no active engine, which the loop repairs (with backoff); a reload
of restart settings changes the standby count. A standby (weights attached, graphs captured, probe
answered, no traffic) turns a start into a switch. A liveness loop polls every engine's /health and
kills one that stops answering (SIGSTOP, a hung kernel), which then counts as a crash.

Strategies: ``overlap`` promotes (or starts) the new engine, switches once it answered a real
1-token probe, then drains and stops the old one; ``replace`` drains and stops the old one first,
while requests wait in the gateway's queue. A new engine that fails to start is stopped and reported;
the current engine keeps serving (overlap), or the last good config is brought back (replace).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol

import httpx

from app.config import RestartSettings
from app.fork_client import ForkServer, ForkServerUnavailable
from app.terminate import terminate
from cache.events import log_event

log = logging.getLogger("warmgate.gateway.engines")


class EngineState(StrEnum):
    STARTING = "starting"
    READY = "ready"
    ACTIVE = "active"
    STANDBY = "standby"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"


class WorkerProcess(Protocol):
    """What the manager needs of a worker process: a spawned asyncio subprocess or a ForkedProcess."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...


class EngineStartError(RuntimeError):
    """A new engine did not become ready; the message says why (with the end of its log)."""


@dataclass
class Engine:
    id: int
    socket: Path
    log_path: Path
    config: dict[str, Any]
    process: WorkerProcess
    state: EngineState = EngineState.STARTING
    started: float = field(default_factory=time.monotonic)
    health: dict[str, Any] = field(default_factory=dict)
    client: httpx.AsyncClient | None = None

    def http(self) -> httpx.AsyncClient:
        if self.client is None:
            transport = httpx.AsyncHTTPTransport(uds=str(self.socket))
            self.client = httpx.AsyncClient(transport=transport, base_url="http://engine", timeout=None)
        return self.client

    def describe(self) -> dict[str, Any]:
        weights = self.health.get("weights", {})
        return {
            "id": self.id,
            "state": self.state.value,
            "pid": self.process.pid,
            "socket": str(self.socket),
            "uptime_s": round(time.monotonic() - self.started, 3),
            "weight_source": weights.get("source"),
            "device_memory_bytes": self.health.get("device_memory_bytes"),
            "private_memory_bytes": self.health.get("private_memory_bytes"),
            "settings": {k: v for k, v in self.config.items() if k not in ("model", "cache_socket")},
        }


@dataclass
class RestartReport:
    reason: str
    strategy: str
    ok: bool
    engine: int | None = None
    weight_source: str | None = None
    path: str | None = None  # how the new engine's process began: "fork" (from the fork server) or "spawn"
    phases: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    at: float = field(default_factory=time.time)
    switched_at: float | None = None  # wall clock when the new engine took traffic

    def to_json(self) -> dict[str, Any]:
        return {
            "reason": self.reason,
            "strategy": self.strategy,
            "ok": self.ok,
            "engine": self.engine,
            "weight_source": self.weight_source,
            "path": self.path,
            "phases": {k: round(v, 4) for k, v in self.phases.items()},
            "error": self.error,
            "at": self.at,
            "switched_at": self.switched_at,
        }


@dataclass
class _Request:
    """A change of desired state: the active engine must run ``config``, started for this request."""

    config: dict[str, Any]
    strategy: str
    reason: str
    done: asyncio.Future[RestartReport]


class EngineManager:
    def __init__(
        self, run_dir: Path, limits: RestartSettings, metrics: Any = None, forker: ForkServer | None = None
    ) -> None:
        self.run_dir = run_dir
        self.forker = forker
        self.limits = limits
        self.standbys: list[Engine] = []
        self.metrics = metrics
        self.engines: dict[int, Engine] = {}
        self.active: Engine | None = None
        self.reports: deque[RestartReport] = deque(maxlen=20)
        self._ids = itertools.count(1)
        self._changed = asyncio.Condition()
        self._wake = asyncio.Event()  # what runs or what is wanted changed: reconcile
        self._requests: deque[_Request] = deque()
        self._config: dict[str, Any] = {}  # the desired config: the last one an active engine started with
        self._lost = "crash"  # why no engine is active, when none is: the reason of the recovery's report
        self._recovery_delay = limits.crash_backoff
        self._recover_after = 0.0  # monotonic time before which a failed recovery is not retried
        self._standby_delay = limits.crash_backoff
        self._standby_after = 0.0
        self._building: asyncio.Task[None] | None = None  # the standby being started
        self._tasks: set[asyncio.Task[Any]] = set()  # watchers, drains, builds
        self._loops: list[asyncio.Task[None]] = []
        self._closing = False

    # -- what the proxy uses ----------------------------------------------------------------

    async def wait_active(self, timeout: float) -> Engine:
        """The active engine, waiting up to ``timeout`` seconds while there is none (TimeoutError)."""
        async with asyncio.timeout(timeout), self._changed:
            while not self._serving(self.active):
                await self._changed.wait()
            assert self.active is not None
            return self.active

    @staticmethod
    def _serving(engine: Engine | None) -> bool:
        # An exited process may still be `active` for the moment until its watcher runs.
        return engine is not None and engine.state is EngineState.ACTIVE and engine.process.returncode is None

    async def engine_failed(self, engine: Engine) -> None:
        """The proxy saw the engine's socket fail: check whether the process is gone."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(engine.process.wait()), 0.5)

    # -- desired state ------------------------------------------------------------------------

    async def start_first(self, config: dict[str, Any]) -> RestartReport:
        if not self._loops:
            self._loops = [asyncio.create_task(self._reconcile_loop()), asyncio.create_task(self._liveness_loop())]
        return await self.restart(config, "overlap", reason="start")

    async def restart(self, config: dict[str, Any] | None, strategy: str, reason: str) -> RestartReport:
        """Want an active engine started for this request with ``config`` (none: the current config)."""
        done: asyncio.Future[RestartReport] = asyncio.get_running_loop().create_future()
        self._requests.append(_Request(config or self._config, strategy, reason, done))
        self._wake.set()
        return await done

    def configure(self, limits: RestartSettings) -> None:
        """New [restart] settings (a reload): timeouts and backoffs apply from the next use; the loop starts or
        retires standbys to match."""
        self.limits = limits
        self._wake.set()

    async def close(self) -> None:
        self._closing = True
        for task in [*self._tasks, *self._loops]:
            task.cancel()
        for request in self._requests:
            request.done.cancel()
        await asyncio.gather(*[self._stop(e) for e in list(self.engines.values())], return_exceptions=True)

    def status(self) -> dict[str, Any]:
        return {
            "active": self.active.id if self.active else None,
            "standbys": [e.id for e in self.standbys],
            "engines": [e.describe() for e in self.engines.values()],
            "restarts": [r.to_json() for r in self.reports],
        }

    # -- the reconcile loop -------------------------------------------------------------------

    async def _reconcile_loop(self) -> None:
        """Compare what runs with what is wanted, act, and sleep until either changes."""
        while not self._closing:
            await self._wake.wait()
            self._wake.clear()
            request: _Request | None = None
            try:
                if self._requests:
                    request = self._requests.popleft()
                    report = await self._replace_active(request.config, request.strategy, request.reason,
                                                        request.done)  # fmt: skip
                    self._after_attempt(report)
                elif self.active is None and self._config:
                    wait = self._recover_after - time.monotonic()
                    if wait > 0:  # a failed recovery: try again after the backoff
                        self._wake_in(wait)
                    else:
                        report = await self._replace_active(self._config, "replace", self._lost, None)
                        self._after_attempt(report)
                self._reconcile_standbys()
            except Exception as exc:  # the loop must outlive any one failure, and no caller waits forever
                log.exception("event=reconcile_failed")
                if request is not None and not request.done.done():
                    why = f"{type(exc).__name__}: {exc}"
                    failed = RestartReport(request.reason, request.strategy, False, error=why)
                    self._done(failed, time.perf_counter(), request.done)
                self._wake_in(self.limits.crash_backoff)
            if self._requests:
                self._wake.set()

    def _after_attempt(self, report: RestartReport) -> None:
        """Backoff bookkeeping: a failed attempt that leaves nothing serving is retried later, slower each time."""
        if report.ok:
            self._recovery_delay = self.limits.crash_backoff
        elif self.active is None:
            self._recover_after = time.monotonic() + self._recovery_delay
            self._recovery_delay = min(self._recovery_delay * 2, self.limits.crash_backoff_max)
            self._wake_in(self._recover_after - time.monotonic())

    def _wake_in(self, seconds: float) -> None:
        asyncio.get_running_loop().call_later(max(seconds, 0.0), self._wake.set)

    async def _replace_active(self, config: dict[str, Any], strategy: str, reason: str,
                              done: asyncio.Future[RestartReport] | None) -> RestartReport:  # fmt: skip
        """Promote a matching standby, else start an engine with ``config``, and switch to it.

        The old engine is drained in the background: the loop goes on while it finishes its requests;
        the report (and ``done``) is complete once it has stopped.
        """
        report = RestartReport(reason=reason, strategy=strategy, ok=False)
        t0 = time.perf_counter()
        old = self.active
        try:
            t = time.perf_counter()
            engine = await self._take_standby(config)
            if engine is not None:
                report.phases["probe"] = time.perf_counter() - t
                report.path = "standby"
            if strategy == "replace" and old is not None:
                await self._set_active(None)
                t = time.perf_counter()
                await self._retire(old)
                report.phases["drain"] = time.perf_counter() - t
            if engine is None:
                engine = await self._start(config, report)
            t = time.perf_counter()
            await self._set_active(engine)
            report.phases["switch"] = time.perf_counter() - t
            report.switched_at = time.time()
            self._config = config
            report.ok, report.engine = True, engine.id
            report.weight_source = engine.health.get("weights", {}).get("source")
        except EngineStartError as exc:
            report.error = str(exc)
            if self.active is None:  # `replace` stopped the old engine first: the last good config comes back
                self._lost = "replace failed"
        if report.ok and strategy == "overlap" and old is not None:
            self._background(self._finish_overlap(old, report, t0, done))
        else:
            self._done(report, t0, done)
        return report

    async def _finish_overlap(self, old: Engine, report: RestartReport, t0: float,
                              done: asyncio.Future[RestartReport] | None) -> None:  # fmt: skip
        t = time.perf_counter()
        await self._retire(old)
        report.phases["drain"] = time.perf_counter() - t
        self._done(report, t0, done)

    def _done(self, report: RestartReport, t0: float, done: asyncio.Future[RestartReport] | None) -> None:
        report.phases["total"] = time.perf_counter() - t0
        self.reports.append(report)
        if self.metrics is not None:
            self.metrics.restart_done(report)
        log_event(log, "restart", reason=report.reason, strategy=report.strategy, ok=report.ok, engine=report.engine,
                  weight_source=report.weight_source, path=report.path, error=report.error,
                  **{f"{k}_s": v for k, v in report.phases.items()})  # fmt: skip
        if done is not None and not done.done():
            done.set_result(report)

    def _reconcile_standbys(self) -> None:
        """Retire standbys of another config or beyond the wanted number; start one when one is missing."""
        current = [e for e in self.standbys if e.config == self._config]
        for stale in [e for e in self.standbys if e.config != self._config] + current[self.limits.standby :]:
            self.standbys.remove(stale)
            self._background(self._retire(stale))
        missing = self.limits.standby - len(self.standbys)
        if missing <= 0 or self._building is not None or self.active is None or self._closing:
            return
        wait = self._standby_after - time.monotonic()
        if wait > 0:
            self._wake_in(wait)
            return
        self._building = self._background(self._build_standby(self._config))

    async def _build_standby(self, config: dict[str, Any]) -> None:
        report = RestartReport(reason="standby", strategy="standby", ok=False)
        try:
            engine = await self._start(config, report)
        except EngineStartError as exc:
            log_event(log, "standby_failed", error=exc)
            self._standby_after = time.monotonic() + self._standby_delay
            self._standby_delay = min(self._standby_delay * 2, self.limits.crash_backoff_max)
            return
        finally:
            self._building = None
            self._wake.set()
        self._standby_delay = self.limits.crash_backoff
        if config != self._config or self._closing:  # the config changed while it started
            await self._retire(engine)
            return
        engine.state = EngineState.STANDBY
        self.standbys.append(engine)
        self._count_states()
        log_event(log, "standby_ready", engine=engine.id, path=report.path,
                  **{f"{k}_s": v for k, v in report.phases.items()})  # fmt: skip

    def _background(self, work: Any) -> asyncio.Task[Any]:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- standbys and liveness -----------------------------------------------------------------

    async def _take_standby(self, config: dict[str, Any]) -> Engine | None:
        """A standby started with ``config`` that still answers a 1-token probe, taken out of the pool."""
        while True:
            standby = next((e for e in self.standbys if e.config == config and e.process.returncode is None), None)
            if standby is None:
                return None
            self.standbys.remove(standby)
            try:
                await asyncio.wait_for(self._probe(standby), min(self.limits.start_timeout, 30))
                return standby
            except (TimeoutError, EngineStartError, httpx.HTTPError) as exc:
                log_event(log, "standby_refused", engine=standby.id, error=f"{type(exc).__name__}: {exc}")
                standby.state = EngineState.FAILED
                await self._stop(standby, final=EngineState.FAILED)

    async def _liveness_loop(self) -> None:
        """Poll every running engine's /health; one that has not answered for health_timeout is killed."""
        last_answer: dict[int, float] = {}
        while not self._closing:
            await asyncio.sleep(self.limits.health_interval)
            engines = [e for e in self.engines.values() if e.state in (EngineState.ACTIVE, EngineState.STANDBY)]
            results = await asyncio.gather(*(self._answers(e) for e in engines))
            now = time.monotonic()
            for engine, answered in zip(engines, results, strict=True):
                seen = last_answer.setdefault(engine.id, now)
                if answered:
                    last_answer[engine.id] = now
                elif now - seen > self.limits.health_timeout and engine.process.returncode is None:
                    log_event(log, "engine_hung", engine=engine.id, pid=engine.process.pid, silent_s=now - seen)
                    with contextlib.suppress(ProcessLookupError):
                        engine.process.kill()  # its watcher takes it from here, as for a crash
            for gone in set(last_answer) - {e.id for e in engines}:
                del last_answer[gone]

    async def _answers(self, engine: Engine) -> bool:
        try:
            response = await engine.http().get("/health", timeout=self.limits.health_interval + 1)
        except (httpx.HTTPError, OSError):
            return False
        if response.status_code == 200:
            with contextlib.suppress(ValueError):
                engine.health = response.json()  # fresh figures (memory, load) for the status page
            return True
        with contextlib.suppress(ValueError):  # 503 while draining is alive; "dead" (no scheduler thread) is not
            return bool(response.json().get("status") == "draining")
        return False

    # -- internals --------------------------------------------------------------------------

    async def _set_active(self, engine: Engine | None) -> None:
        async with self._changed:
            if engine is not None:
                engine.state = EngineState.ACTIVE
            self.active = engine
            self._changed.notify_all()
        self._count_states()

    async def _start(self, config: dict[str, Any], report: RestartReport) -> Engine:
        engine_id = next(self._ids)
        sock = self.run_dir / f"engine-{engine_id}.sock"
        log_path = self.run_dir / f"engine-{engine_id}.log"
        t = time.perf_counter()
        argv = ["engine", "--socket", str(sock), "--config", json.dumps(config)]
        process = await self._launch(argv, log_path, report)
        engine = Engine(engine_id, sock, log_path, config, process)
        self.engines[engine_id] = engine
        self._count_states()
        report.phases["spawn"] = time.perf_counter() - t
        try:
            t = time.perf_counter()
            await asyncio.wait_for(self._until_healthy(engine), self.limits.start_timeout)
            report.phases["init"] = time.perf_counter() - t
            for phase in ("weight_load", "model_init", "kv_alloc", "cuda_graphs", "warmup"):
                if phase in engine.health.get("startup_phases", {}):
                    report.phases[phase] = engine.health["startup_phases"][phase]
            t = time.perf_counter()
            await asyncio.wait_for(self._probe(engine), self.limits.start_timeout)
            report.phases["probe"] = time.perf_counter() - t
        except (TimeoutError, EngineStartError, httpx.HTTPError) as exc:
            engine.state = EngineState.FAILED
            await self._stop(engine, final=EngineState.FAILED)
            why = "did not become ready in time" if isinstance(exc, TimeoutError) else str(exc)
            raise EngineStartError(f"engine {engine_id} {why}; log: {_tail(log_path)}") from None
        engine.state = EngineState.READY
        self._background(self._watch(engine))
        return engine

    async def _launch(self, argv: list[str], log_path: Path, report: RestartReport) -> WorkerProcess:
        """Fork the worker from the fork server (Python and torch already imported there), else spawn it."""
        if self.forker is not None:
            try:
                process = await self.forker.spawn(argv, log_path)
                report.path = "fork"
                return process
            except ForkServerUnavailable as exc:
                log_event(log, "fork_fallback", reason=exc)
                self.forker.restart_in_background()
        with log_path.open("wb") as out:
            spawned = await asyncio.create_subprocess_exec(sys.executable, "-m", "app.cli", *argv, stdout=out,
                                                           stderr=asyncio.subprocess.STDOUT)  # fmt: skip
        report.path = "spawn"
        return spawned

    async def _until_healthy(self, engine: Engine) -> None:
        while True:
            if engine.process.returncode is not None:
                raise EngineStartError(f"exited with {engine.process.returncode} during start-up")
            if engine.socket.exists():
                try:
                    response = await engine.http().get("/health", timeout=5)
                    if response.status_code == 200:
                        engine.health = response.json()
                        return
                except httpx.TransportError:
                    pass
            await asyncio.sleep(0.05)

    async def _probe(self, engine: Engine) -> None:
        """A real 1-token generation: the engine can serve, not merely answer /health."""
        body = {"prompt": "Hello", "max_tokens": 1, "temperature": 0}
        response = await engine.http().post("/v1/completions", json=body, timeout=self.limits.start_timeout)
        if response.status_code != 200:
            raise EngineStartError(f"probe answered {response.status_code}: {response.text[:200]}")

    async def _retire(self, engine: Engine) -> None:
        """Drain the engine (its requests finish, new ones go elsewhere), then stop it."""
        engine.state = EngineState.DRAINING
        self._count_states()
        with contextlib.suppress(httpx.HTTPError, TimeoutError):
            await asyncio.wait_for(engine.http().post("/drain", json={"timeout": self.limits.drain_timeout}),
                                   self.limits.drain_timeout + 5)  # fmt: skip
        await self._stop(engine)

    async def _stop(self, engine: Engine, final: EngineState = EngineState.STOPPED) -> None:
        # Callers set DRAINING or FAILED first (close() sets _closing): the crash watcher ignores this exit.
        await terminate(engine.process, self.limits.drain_timeout + 10)
        if engine.client is not None:
            await engine.client.aclose()
        engine.socket.unlink(missing_ok=True)
        engine.state = final
        self.engines.pop(engine.id, None)
        self._count_states()

    async def _watch(self, engine: Engine) -> None:
        """Notice a crash at once (process exit): what runs changed, so the loop replaces it."""
        code = await engine.process.wait()
        if self._closing or engine.state in (EngineState.DRAINING, EngineState.STOPPED, EngineState.FAILED):
            return
        if engine in self.standbys:
            self.standbys.remove(engine)
        was_active = self.active is engine
        engine.state = EngineState.FAILED
        if was_active:
            self._lost = "crash"
            await self._set_active(None)
        self.engines.pop(engine.id, None)
        engine.socket.unlink(missing_ok=True)  # a killed worker cannot remove it itself
        log_event(log, "engine_crashed", engine=engine.id, pid=engine.process.pid, code=code, active=was_active)
        if self.metrics is not None:
            self.metrics.engine_crashed()
        if engine.client is not None:
            await engine.client.aclose()
        self._wake.set()

    def _count_states(self) -> None:
        if self.metrics is not None:
            self.metrics.engine_states([e.state.value for e in self.engines.values()])


def _tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return " | ".join(text[-lines:]) or "(empty)"
