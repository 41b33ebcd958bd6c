"""The supervisor (control plane): the settings, the cache process, the engine reconciler and the relays, and the
admin operations (restart, reload, status) the relays forward to it.

It is never on a request's path: relays route with the table it pushes them (app/control.py) and go on
with the last one while it is busy or stopped.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from app.config import ConfigError, Settings, load_settings
from app.control import EngineRoute, RelaySettings, Table
from app.metrics import SupervisorMetrics
from app.supervisor.cache import CacheHandle, CacheSpec, CacheStartError, start_or_adopt
from app.supervisor.engines import Engine, EngineState
from app.supervisor.forks import ForkServer
from app.supervisor.reconciler import Reconciler, Routing, Suspected
from app.supervisor.relays import Relays
from app.supervisor.state import EngineRecord, GatewayState, ProcessRecord
from common.backoff import Backoff
from common.events import log_error, log_event, log_warning
from common.processes import start_time
from engine.protocol import ErrorInfo, ErrorResponse

log = logging.getLogger("warmgate.supervisor")
CACHE_STATUS_TIMEOUT = 2.0  # seconds the status page waits for the cache's stats
HEALTH_STATUS_TIMEOUT = 2.0  # seconds the status page waits for an engine's /health
CACHE_METRICS_INTERVAL = 5.0  # seconds between refreshes of the cache's gauges
SERVING = (EngineState.READY, EngineState.ACTIVE, EngineState.STANDBY, EngineState.DRAINING)
# Settings a running gateway keeps until its next start: where it listens and who it lets in, its processes.
AT_NEXT_START = ("gateway.host", "gateway.port", "gateway.admin_token", "gateway.workers", "run_dir",
                 "restart.fork_server")  # fmt: skip


class AdminRestart(BaseModel):
    """The body of POST /admin/restart."""

    model_config = ConfigDict(extra="forbid")

    strategy: Literal["overlap", "replace"] | None = None  # none: the configured one
    # "switch": answer once the new engine takes traffic (the old one drains on, in /admin/status); "drained":
    # once the old engine has drained and stopped as well.
    wait: Literal["switch", "drained"] = "switch"
    # Engine settings over the config file's, checked like it; they stay until a reload (or other overrides).
    # None: the ones in force (an earlier restart's, or none).
    engine: dict[str, Any] | None = None


class Supervisor:
    def __init__(self, settings: Settings, config_path: Path | None, overrides: dict[str, Any], model: Path,
                 cache: CacheHandle, reconciler: Reconciler, metrics: SupervisorMetrics,
                 admin_token: str) -> None:  # fmt: skip
        self.settings = settings
        self.config_path = config_path
        self.overrides = overrides
        self.model = model
        self.cache = cache
        self.reconciler = reconciler
        self.metrics = metrics
        self.admin_token = admin_token
        self.relays: Relays | None = None  # once they run
        self.engine_overrides: dict[str, Any] = {}  # an admin restart's engine settings, until the next reload
        self.caches_started = 1
        self.cache_down: str | None = None  # why the cache process is not serving, while it is restarted
        self._routing = Routing(None, (), ())
        self._generation = 0
        self._saved: str | None = None  # the state last written to the run dir
        self._started: dict[int, int | None] = {}  # pid -> its start time, for the state

    # -- the relays' table ------------------------------------------------------------------------------

    def table(self) -> Table:
        """The table for the relays: the routing, the cache's state and the relay settings, a new generation."""
        self._generation += 1
        r, g = self.settings.restart, self.settings.gateway
        settings = RelaySettings(api_keys=g.api_keys, admin_token=self.admin_token, max_body_bytes=g.max_body_bytes,
                                 queue_timeout=r.queue_timeout, max_queue=r.max_queue,
                                 request_resumes=r.request_resumes)  # fmt: skip
        routing = self._routing
        return Table(generation=self._generation, active=self._route(routing.active),
                     standbys=[self._route(e) for e in routing.standbys],
                     draining=[self._route(e) for e in routing.draining], cache_down=self.cache_down,
                     settings=settings)  # fmt: skip

    def continue_from(self, generation: int, routing: Routing) -> None:
        """Adopted relays serve an earlier supervisor's tables, up to ``generation``, with ``routing``: go on from
        there."""
        self._generation, self._routing = generation, routing

    def save_state(self, forker: ForkServer | None) -> None:
        """What the next supervisor adopts if this one dies (app/supervisor/state.py); written when it changed."""
        engines = [EngineRecord(id=e.id, state=e.state.value, process=self._record(e.pid), socket=e.socket,
                                log_path=e.log_path, heartbeat_path=e.heartbeat_path, config=e.config, path=e.path)
                   for e in self.reconciler.engines.values() if e.pid is not None]  # fmt: skip
        forks = forker.process if forker is not None else None
        state = GatewayState(supervisor=os.getpid(), engines=engines, engine_overrides=self.engine_overrides,
                             fork_server=self._record(forks.pid) if forks is not None and forks.returncode is None
                             else None, table_generation=self._generation)  # fmt: skip
        text = state.model_dump_json()
        if text != self._saved:
            state.save(self.settings.run_dir)
            self._saved = text

    def _record(self, pid: int) -> ProcessRecord:
        if pid not in self._started:
            self._started[pid] = start_time(pid)
        return ProcessRecord(pid=pid, started=self._started[pid])

    def _route(self, engine: Engine | None) -> Any:
        if engine is None:
            return None
        backlog = self.settings.gateway.engine_backlog
        seqs = (engine.health.max_num_seqs if engine.health else 0) or engine.config.max_num_seqs or 16
        capacity = seqs + (backlog if backlog is not None else max(4, seqs // 4))
        return EngineRoute(id=engine.id, socket=str(engine.socket), capacity=capacity)

    async def on_routing(self, routing: Routing) -> None:
        """The reconciler changed where requests go: tell the relays (returns once they have it)."""
        self._routing = routing
        await self.publish()

    async def publish(self) -> None:
        if self.relays is not None:
            await self.relays.publish(self.table())

    def relay_failure(self, engine: int, why: str) -> None:
        self.reconciler.post(Suspected(engine, why))

    # -- the cache ------------------------------------------------------------------------------------------

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

        While it is down, engines keep serving: their weights are mappings of the dead cache's memory, which
        the kernel keeps while they are mapped. Only an engine start needs the cache (``ipc`` fails,
        ``ipc-or-disk`` reads the checkpoint). The roll returns memory to one copy of the weights.
        """
        limits = self.settings.restart
        backoff = Backoff(limits.crash_backoff, limits.crash_backoff_max)
        while True:
            handle = self.cache
            code = await handle.wait_exit()
            if handle is not self.cache:
                continue  # a reload replaced it and stopped it on purpose
            handle.remove_stale_socket()
            self.cache_down = f"the cache process (pid {handle.pid}) exited with {code}; restarting it"
            await self.publish()
            self.metrics.cache_restarts.inc()
            log_warning(log, "cache_exited", pid=handle.pid, code=code, socket=handle.socket)
            while True:
                try:  # on a new socket: the engines' config changes, so every engine is replaced (standbys too)
                    cache = await start_or_adopt(handle.spec, self._next_socket(), self.settings.run_dir / "cache.log")
                    break
                except Exception as exc:  # CacheStartError, or the run dir gone: keep trying, with backoff
                    self.cache_down = f"the cache process exited and does not restart: {exc}"
                    wait = backoff.failed()
                    log_error(log, "cache_restart_failed", reason=exc, retry_in=wait)
                    await asyncio.sleep(wait)
            self.cache, self.cache_down = cache, None
            backoff.succeeded()
            await self.publish()
            log_event(log, "cache_restarted", pid=cache.pid, key=cache.key[:12])
            config = self.settings.engine_config(self.model, cache.socket, self.engine_overrides)
            report = await self.reconciler.restart(config, "overlap", reason="cache restarted")
            log_event(log, "engines_moved_to_cache", ok=report.ok, weight_source=report.weight_source)

    async def refresh_cache_metrics(self) -> None:
        """The cache's gauges, refreshed now and then (relays render /metrics from what every process wrote)."""
        while True:
            await self.cache_stats()
            await asyncio.sleep(CACHE_METRICS_INTERVAL)

    async def cache_stats(self) -> dict[str, Any]:
        """The cache's part of the status, its gauges updated on the way. Asked in a thread: a hung cache never
        stalls the supervisor."""
        try:
            stats = await asyncio.to_thread(self.cache.stats, CACHE_STATUS_TIMEOUT)
        except Exception as exc:  # the status page must answer even when the cache does not
            return {"error": f"{type(exc).__name__}: {exc}", "socket": str(self.cache.socket),
                    "backend": self.cache.spec.backend}  # fmt: skip
        self.metrics.cache_stats(stats.bytes, len(stats.leases))
        shown = stats.model_dump(include={"key", "device", "bytes", "leases", "attach_count", "uptime_s", "pid"})
        return {**shown, "socket": str(self.cache.socket), "backend": self.cache.spec.backend}

    # -- admin operations -------------------------------------------------------------------------------------

    async def admin(self, op: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """An admin call a relay forwarded: its HTTP status and JSON body."""
        try:
            if op == "status":
                return 200, await self.status()
            if op == "restart":
                report = await self.restart(body)
                # A restart that failed is not a server error: the gateway serves on (the old engine, or the last
                # good config under `replace`); 422 says the engine asked for could not be started.
                return (200 if report["ok"] else 422), report
            report = await self.reload()
            return (200 if report.get("ok", True) else 422), report
        except ValueError as exc:
            prefix = "config not reloaded, nothing changed: " if op == "reload" else ""
            error = ErrorResponse(error=ErrorInfo(message=f"{prefix}{exc}", type="invalid_request_error"))
            return 400, error.model_dump(mode="json")
        except Exception as exc:  # the relay's client must get an answer, whatever went wrong here
            log.exception("event=admin_failed op=%s", op)
            error = ErrorResponse(error=ErrorInfo(message=f"{op} failed: {type(exc).__name__}: {exc}",
                                                  type="server_error"))  # fmt: skip
            return 500, error.model_dump(mode="json")

    async def restart(self, body: dict[str, Any]) -> dict[str, Any]:
        """An admin restart. Its engine overrides (``{"engine": {...}}``) stay for later restarts and crash recoveries
        until another restart gives others (``{}``: none) or a reload brings the file's settings back."""
        try:
            request = AdminRestart.model_validate(body)
        except ValidationError as exc:
            raise ValueError(_problems(exc)) from None
        overrides = self.engine_overrides if request.engine is None else request.engine
        try:
            config = self.settings.engine_config(self.model, self.cache.socket, overrides)
        except ValidationError as exc:  # an unknown key or a value the engine would refuse
            raise ValueError(f"invalid engine override, nothing restarted: {_problems(exc)}") from None
        keyed = [k for k in ("backend", "device", "dtype") if getattr(config, k) != getattr(self.settings.engine, k)]
        if keyed:
            raise ValueError(
                f"engine override of {', '.join(keyed)} needs other cached weights: change the config "
                "file and reload (a cache for the new settings is built first), nothing restarted"
            )
        strategy = request.strategy or self.settings.restart.strategy
        report = await self.reconciler.restart(config, strategy, reason="admin", at_switch=request.wait == "switch")
        if report.ok:
            self.engine_overrides = dict(overrides)
        return {**report.to_json(), "overrides": self.engine_overrides}

    async def reload(self) -> dict[str, Any]:
        """Re-read the config file: what it changes is applied now (restarting the engines when engine settings or the
        model changed, which also ends admin-restart overrides), except what waits for the next start."""
        if self.config_path is None:  # the environment and the command line were read at start: nothing to re-read
            return {"config": None, "changed": None, "ok": True}
        try:
            new = load_settings(self.config_path, **self.overrides)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        changes = _changed(self.settings, new)
        pending = [key for key in changes if key in AT_NEXT_START]
        note = {"config": str(self.config_path), "pending": pending}
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
            report = await self.reconciler.restart(new.engine_config(new_model, cache.socket), strategy, "reload")
            if not report.ok:
                await cache.stop()
                return {**note, "changed": changed, **report.to_json()}
            self.cache, self.model = cache, new_model
            await old_cache.stop()
            await self._apply(new)
            return {**note, "changed": changed, "applied": _applied(changes, pending), **report.to_json()}
        engine_changed = new.engine != self.settings.engine or new.served_model_name != self.settings.served_model_name
        if engine_changed or self.engine_overrides:  # the file's engine settings, overrides or not
            report = await self.reconciler.restart(new.engine_config(self.model, self.cache.socket), strategy,
                                                   "reload")  # fmt: skip
            if not report.ok:
                return {**note, "changed": "engine", **report.to_json()}
            await self._apply(new)
            return {**note, "changed": "engine", "applied": _applied(changes, pending), **report.to_json()}
        await self._apply(new)
        return {**note, "changed": None, "applied": _applied(changes, pending), "ok": True}

    async def _apply(self, new: Settings) -> None:
        """The new settings, now; those a running gateway cannot change (AT_NEXT_START) at the next start."""
        old = self.settings
        kept = {"host": old.gateway.host, "port": old.gateway.port, "admin_token": old.gateway.admin_token,
                "workers": old.gateway.workers}  # fmt: skip
        restart = new.restart.model_copy(update={"fork_server": old.restart.fork_server})
        self.settings = new.model_copy(update={"gateway": new.gateway.model_copy(update=kept), "run_dir": old.run_dir,
                                               "restart": restart})  # fmt: skip
        self.engine_overrides = {}  # the file's engine settings are the engines' now
        self.reconciler.configure(self.settings.restart)
        await self.publish()  # the relays' limits and API keys

    async def status(self) -> dict[str, Any]:
        """The status document: the model, the cache, the processes, the engines and the last restarts."""
        serving = [e for e in self.reconciler.engines.values() if e.state in SERVING]
        await asyncio.gather(*(self.reconciler.launcher.health(e, HEALTH_STATUS_TIMEOUT) for e in serving))
        return {
            "model": str(self.model),
            "cache": await self.cache_stats(),
            "supervisor": {"pid": os.getpid(), "serve_pid": os.getppid(), "generation": self.reconciler.generation},
            "relays": self.relays.describe() if self.relays is not None else [],
            **self.reconciler.status(),
        }


def _problems(exc: ValidationError) -> str:
    """One line naming each invalid field, its problem and the value given."""
    return "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']} (given: {e['input']!r:.80})" for e in exc.errors())


def _changed(old: Settings, new: Settings) -> list[str]:
    """The settings that differ, as dotted names (``engine.max_num_seqs``), none of their values."""
    before, after = _flat(old.model_dump(mode="json")), _flat(new.model_dump(mode="json"))
    return sorted(key for key in before.keys() | after.keys() if before.get(key) != after.get(key))


def _applied(changes: list[str], pending: list[str]) -> list[str]:
    return [key for key in changes if key not in pending]


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
