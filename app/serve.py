"""`warmgate serve`: cache process + engine workers + the OpenAI gateway, until SIGTERM.

SIGHUP (or POST /admin/reload) re-reads the config file: changed engine settings roll the
engines over on the same cached weights; a changed model is loaded by a new cache process
first, then the engines swap to it; an invalid file changes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import secrets
import signal
import time
from collections.abc import Generator
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from app.cache_process import CacheHandle, CacheSpec, CacheStartError, adopt_or_start, start_or_adopt
from app.config import ConfigError, Settings, load_settings
from app.engines import EngineManager
from app.fork_client import ForkServer, ForkServerUnavailable
from app.gateway import GatewayState, create_gateway
from app.metrics import GatewayMetrics
from cache import events
from cache.uds import private_dir
from common.device import resolve_device
from common.lifetime import name_supervisor

log = logging.getLogger("warmgate.gateway")
TOKEN_FILE = "admin-token"
CACHE_STATUS_TIMEOUT = 2.0  # seconds the status page waits for the cache's stats


class Supervisor:
    """Owns the settings, the cache process and the engine manager; carries out restarts and reloads."""

    def __init__(self, settings: Settings, config_path: Path | None, overrides: dict[str, Any], model: Path,
                 cache: CacheHandle, manager: EngineManager, metrics: GatewayMetrics) -> None:  # fmt: skip
        self.settings = settings
        self.config_path = config_path
        self.overrides = overrides
        self.model = model
        self.cache = cache
        self.manager = manager
        self.metrics = metrics
        self.caches_started = 1
        self.cache_down: str | None = None  # why the cache process is not serving, while it is restarted
        self.gateway: GatewayState | None = None  # the HTTP side, once it serves: a reload sets its limits too

    def _next_socket(self) -> Path:
        """A socket path no cache in the run dir uses (an adopted cache may hold a later number)."""
        while True:
            self.caches_started += 1
            path = self.settings.run_dir / f"cache-{self.caches_started}.sock"
            if not path.exists():
                return path

    async def watch_cache(self) -> None:
        """Keep a cache process serving: when the current one exits (not replaced by a reload), start another
        on a new socket, then roll the engines onto it.

        While it is down, engines keep serving: their weights are mappings of the dead cache's memory,
        which the kernel keeps while they are mapped. Only an engine start needs the cache (``ipc`` fails,
        ``ipc-or-disk`` reads the checkpoint). The roll returns memory to one copy of the weights.
        """
        wait = self.settings.restart.crash_backoff
        while True:
            handle = self.cache
            code = await handle.wait_exit()
            if handle is not self.cache:
                continue  # a reload replaced it and stopped it on purpose
            handle.remove_stale_socket()
            self.cache_down = f"the cache process (pid {handle.pid}) exited with {code}; restarting it"
            self.metrics.cache_restarts.inc()
            events.log_event(log, "cache_exited", pid=handle.pid, code=code, socket=handle.socket)
            while True:
                try:  # on a new socket: the engines' config changes, so every engine is replaced (standbys too)
                    cache = await start_or_adopt(handle.spec, self._next_socket(), self.settings.run_dir / "cache.log")
                    break
                except Exception as exc:  # CacheStartError, or the run dir gone: keep trying, with backoff
                    self.cache_down = f"the cache process exited and does not restart: {exc}"
                    events.log_event(log, "cache_restart_failed", reason=exc, retry_in=wait)
                    await asyncio.sleep(wait)
                    wait = min(wait * 2, self.settings.restart.crash_backoff_max)
            self.cache, self.cache_down, wait = cache, None, self.settings.restart.crash_backoff
            events.log_event(log, "cache_restarted", pid=cache.pid, key=cache.key[:12])
            config = self.settings.engine_config(self.model, cache.socket)
            report = await self.manager.restart(config, "overlap", reason="cache restarted")
            events.log_event(log, "engines_moved_to_cache", ok=report.ok, weight_source=report.weight_source)

    async def restart(self, body: dict[str, Any]) -> dict[str, Any]:
        strategy = body.get("strategy", self.settings.restart.strategy)
        if strategy not in ("overlap", "replace"):
            raise ValueError(f"strategy {strategy!r} is not supported (supported: overlap, replace)")
        overrides = body.get("engine") or {}
        if not isinstance(overrides, dict):
            raise ValueError("engine overrides must be an object of engine settings")
        try:
            config = self.settings.engine_config(self.model, self.cache.socket, overrides)
        except ValidationError as exc:  # an unknown key or a value the engine would refuse
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise ValueError(f"invalid engine override, nothing restarted: {problems}") from None
        keyed = [k for k in ("backend", "device", "dtype") if config[k] != getattr(self.settings.engine, k)]
        if keyed:
            raise ValueError(
                f"engine override of {', '.join(keyed)} needs other cached weights: change the config "
                "file and reload (a cache for the new settings is built first), nothing restarted"
            )
        report = await self.manager.restart(config, strategy, reason="admin")
        return report.to_json()

    async def reload(self) -> dict[str, Any]:
        try:
            new = load_settings(self.config_path, **self.overrides)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        new_model = new.model.resolve() if new.model else self.model
        strategy = new.restart.strategy
        spec = CacheSpec.of(new, new_model)
        if spec != self.cache.spec:  # model, backend, device or dtype: other weights, from another cache
            changed = "model" if spec.model != self.cache.spec.model else "cache"
            old_cache = self.cache
            try:
                cache = await start_or_adopt(spec, self._next_socket(), self.settings.run_dir / "cache.log")
            except CacheStartError as exc:
                raise ValueError(f"reload refused, the old engines keep serving: {exc}") from None
            report = await self.manager.restart(new.engine_config(new_model, cache.socket), strategy, reason="reload")
            if not report.ok:
                await cache.stop()
                return {"changed": changed, **report.to_json()}
            self.cache, self.model = cache, new_model
            await old_cache.stop()
            self._apply(new)
            return {"changed": changed, **report.to_json()}
        if new.engine != self.settings.engine or new.served_model_name != self.settings.served_model_name:
            report = await self.manager.restart(new.engine_config(self.model, self.cache.socket), strategy,
                                                reason="reload")  # fmt: skip
            if report.ok:
                self._apply(new)
            return {"changed": "engine", **report.to_json()}
        self._apply(new)
        return {"changed": None, "ok": True}

    def _apply(self, new: Settings) -> None:
        """The new settings, now; those a running gateway cannot change (its address, admin token, run dir and
        fork server) at the next start."""
        old = self.settings
        kept = {"host": old.gateway.host, "port": old.gateway.port, "admin_token": old.gateway.admin_token}
        restart = new.restart.model_copy(update={"fork_server": old.restart.fork_server})
        self.settings = new.model_copy(update={"gateway": new.gateway.model_copy(update=kept), "run_dir": old.run_dir,
                                               "restart": restart})  # fmt: skip
        self.manager.configure(self.settings.restart)
        if self.gateway is not None:
            self.gateway.configure(self.settings.gateway.api_keys, self.settings.gateway.max_body_bytes, restart)

    async def status(self) -> dict[str, Any]:
        """The status document: the model, the cache, the engines and the last restarts."""
        return {"model": str(self.model), "cache": await self.cache_stats(), **self.manager.status()}

    async def cache_stats(self) -> dict[str, Any]:
        """The cache's part of the status, its gauges updated on the way (status page and /metrics).

        The cache is asked in a thread, so a hung cache never stalls the gateway."""
        try:
            stats = await asyncio.to_thread(self.cache.stats, CACHE_STATUS_TIMEOUT)
        except Exception as exc:  # the status page and /metrics must answer even when the cache does not
            return {"error": f"{type(exc).__name__}: {exc}", "socket": str(self.cache.socket),
                    "backend": self.cache.spec.backend}  # fmt: skip
        self.metrics.cache_stats(stats["bytes"], len(stats["leases"]))
        keep = ("key", "device", "bytes", "leases", "attach_count", "uptime_s", "pid")
        return {**{k: stats[k] for k in keep}, "socket": str(self.cache.socket), "backend": self.cache.spec.backend}


def admin_token(settings: Settings) -> str:
    """The configured token, or a new one written to the run dir (mode 0600) for the CLI to read."""
    token = settings.gateway.admin_token or os.environ.get("WARMGATE_ADMIN_TOKEN") or secrets.token_urlsafe(24)
    path = settings.run_dir / TOKEN_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def main(config_path: Path | None, **overrides: Any) -> int:
    started = time.perf_counter()
    events.configure_logging()
    name_supervisor()  # engines and the fork server stop when this process dies, even by SIGKILL
    settings = load_settings(config_path, **overrides)
    private_dir(settings.run_dir)
    token = admin_token(settings)
    # "auto" (the default) is resolved by each process with the same function; logged here so nobody guesses.
    events.log_event(log, "device", setting=settings.engine.device, engines=resolve_device(settings.engine.device),
                     cache=resolve_device(settings.cache_device or settings.engine.device))  # fmt: skip
    model = settings.model
    if model is None:
        from cache.checkpoint.demo import build_demo

        model = build_demo("fp8-block", progress=True)
    asyncio.run(_serve(settings, config_path, overrides, model.resolve(), token, started))
    return 0


async def _serve(settings: Settings, config_path: Path | None, overrides: dict[str, Any], model: Path, token: str,
                 started: float) -> None:  # fmt: skip
    import uvicorn

    metrics = GatewayMetrics()
    run_dir = settings.run_dir
    r = settings.restart
    forker = None
    if r.fork_server:
        forker = ForkServer(run_dir / "fork.sock", run_dir / "fork-server.log", settings.engine.backend)
    forking = asyncio.create_task(forker.start()) if forker is not None else None  # imports torch meanwhile
    try:
        cache = await adopt_or_start(CacheSpec.of(settings, model), run_dir, run_dir / "cache.sock",
                                     run_dir / "cache.log")  # fmt: skip
        if forking is not None:
            await forking
    except ForkServerUnavailable as exc:  # engines are spawned instead; a restart tries the fork server again
        events.log_event(log, "fork_fallback", reason=exc)
    except BaseException:
        if forker is not None:
            await forker.stop()
        raise
    manager = EngineManager(run_dir, r, metrics, forker)
    supervisor = Supervisor(settings, config_path, overrides, model, cache, manager, metrics)
    watcher: asyncio.Task[None] | None = None
    try:
        report = await manager.start_first(settings.engine_config(model, cache.socket))
        if not report.ok:
            raise RuntimeError(f"the first engine did not start: {report.error}")
        watcher = asyncio.create_task(supervisor.watch_cache())
        state = GatewayState(manager, metrics, settings.gateway.api_keys, token, r.queue_timeout, r.max_queue,
                             r.request_resumes, settings.gateway.max_body_bytes, supervisor.restart,
                             supervisor.reload, supervisor.status, scrape=supervisor.cache_stats,
                             cache_down=lambda: supervisor.cache_down)  # fmt: skip
        supervisor.gateway = state
        app = create_gateway(state)
        config = uvicorn.Config(app, host=settings.gateway.host, port=settings.gateway.port, log_config=None,
                                log_level="warning", access_log=False, lifespan="off")  # fmt: skip
        server = _server_class()(config)
        loop = asyncio.get_running_loop()
        tasks: set[asyncio.Task[Any]] = set()

        def on_stop() -> None:
            server.should_exit = True

        def on_hup() -> None:
            task = loop.create_task(_reload_logged(supervisor))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

        loop.add_signal_handler(signal.SIGTERM, on_stop)
        loop.add_signal_handler(signal.SIGINT, on_stop)
        loop.add_signal_handler(signal.SIGHUP, on_hup)
        await _warm_up(app, settings.gateway.api_keys)
        # Start-up's objects (modules, settings, the app) live as long as the gateway: frozen out of the
        # collector, full collections while serving do not walk them (a pause lands on a request's TTFT).
        gc.collect()
        gc.freeze()
        events.log_event(log, "ready", url=f"http://{settings.gateway.host}:{settings.gateway.port}", model=model,
                         run_dir=run_dir, seconds=time.perf_counter() - started)  # fmt: skip
        await server.serve()
    finally:
        if watcher is not None:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        await manager.close()
        if forker is not None:
            await forker.stop()
        await supervisor.cache.stop()
        events.log_event(log, "exit", seconds=time.perf_counter() - started)


async def _warm_up(app: Any, api_keys: list[str]) -> None:
    """One streamed completion through the gateway's own routes and relay before it listens: first-use
    costs of the proxy path are paid here, not by the first client (whose TTFT measured 130-200 ms on the
    H200 against 15 ms for later ones)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_keys[0]}"} if api_keys else {}
    body = {"prompt": "Hi", "max_tokens": 2, "temperature": 0, "stream": True}
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://warmup", headers=headers) as client:
        response = await client.post("/v1/completions", json=body, timeout=60)
        if response.status_code != 200:
            log.warning("event=warmup_failed status=%d body=%s", response.status_code, response.text[:200])


async def _reload_logged(supervisor: Supervisor) -> None:
    try:
        report = await supervisor.reload()
        events.log_event(log, "reload", signal="SIGHUP", changed=report.get("changed"), ok=report.get("ok"))
    except ValueError as exc:
        events.log_event(log, "reload_refused", signal="SIGHUP", reason=exc)


def _server_class() -> Any:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn without its own signal handlers: the gateway stops engines and the cache first."""

        @contextlib.contextmanager
        def capture_signals(self) -> Generator[None, None, None]:
            yield

    return Server
