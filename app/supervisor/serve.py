"""`warmgate serve`: the supervisor process, until SIGTERM.

It binds the gateway's port (a busy port fails the start at once), starts or adopts the cache process,
the fork server, the relay workers (they accept on that port) and the first engine, then carries out
restarts, reloads and crash recovery. SIGHUP (or POST /admin/reload) re-reads the config file.
SIGTERM or SIGINT, at any moment: the relays stop accepting and finish their requests, then the engines,
the fork server and the cache process stop, in that order.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import secrets
import signal
import time
from pathlib import Path
from typing import Any

from app.config import Settings, load_settings
from common.events import configure_logging, log_event, log_warning
from common.lifetime import name_supervisor
from common.uds import private_dir

log = logging.getLogger("warmgate.supervisor")
TOKEN_FILE = "admin-token"


class GatewayStartError(RuntimeError):
    """The gateway could not start (its first engine did not); the message says why, in one line."""


def admin_token(settings: Settings) -> str:
    """The configured token, or a new one written to the run dir (mode 0600) for the CLI to read."""
    token = settings.gateway.admin_token or os.environ.get("WARMGATE_ADMIN_TOKEN") or secrets.token_urlsafe(24)
    path = settings.run_dir / TOKEN_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def main(config_path: Path | None, **overrides: Any) -> int:
    """Every check a user can fail comes before anything starts: the run dir (ours, and not in use), the model,
    the port; each fails as one line (app/cli.py) within seconds, with nothing left running."""
    started = time.perf_counter()
    configure_logging()
    name_supervisor()  # engines and the fork server stop when this process dies, even by SIGKILL
    settings = load_settings(config_path, **overrides)
    private_dir(settings.run_dir)
    from app.supervisor.run_dir import RunDir, url_for

    run_dir = RunDir(settings.run_dir)
    run_dir.claim()
    from common.proctitle import set_title

    set_title(f"supervisor {settings.run_dir}")
    try:
        model = settings.model
        if model is not None:
            _looks_like_a_checkpoint(model)  # at once, before the imports a full check needs
            from cache.checkpoint.reader import read_checkpoint

            read_checkpoint(model)  # the errors `warmgate model check` gives, before any process starts
        from app.metrics import use_directory

        use_directory(settings.run_dir / "metrics", fresh=True)  # before any metric exists, here or in a child
        from app.supervisor.relays import open_listener

        gateway = settings.gateway
        try:
            listener = open_listener(gateway.host, gateway.port)
        except OSError as exc:
            raise ConnectionError(f"cannot listen on {gateway.host}:{gateway.port}: {exc.strerror or exc}") from None
        url = url_for(gateway.host, listener.getsockname()[1])  # the port chosen, with --port 0
        run_dir.record_address(url)
        token = admin_token(settings)
        from common.device import resolve_device

        # "auto" (the default) is resolved by each process with the same function; logged here so nobody guesses.
        log_event(log, "device", setting=settings.engine.device, engines=resolve_device(settings.engine.device),
                  cache=resolve_device(settings.cache_device or settings.engine.device))  # fmt: skip
        if model is None:
            from cache.checkpoint.demo import build_demo

            model = build_demo("fp8-block", progress=True)
        asyncio.run(_serve(settings, config_path, overrides, model.resolve(), token, listener, url, run_dir.generation,
                           started))  # fmt: skip
    finally:
        run_dir.release()
    return 0


def _looks_like_a_checkpoint(model: Path) -> None:
    """A directory with a readable config.json, or the error that says which it is not."""
    if not model.is_dir():
        raise FileNotFoundError(f"--model {model}: no such directory (a Hugging Face checkpoint directory)")
    config = model / "config.json"
    try:
        json.loads(config.read_text())
    except OSError as exc:
        raise FileNotFoundError(f"--model {model}: cannot read {config.name} ({exc.strerror}): not a Hugging Face "
                                "checkpoint directory") from None  # fmt: skip
    except ValueError as exc:
        raise ValueError(f"--model {model}: {config.name} is not valid JSON ({exc})") from None


async def _serve(settings: Settings, config_path: Path | None, overrides: dict[str, Any], model: Path, token: str,
                 listener: Any, url: str, generation: int, started: float) -> None:  # fmt: skip
    from app.metrics import SupervisorMetrics
    from app.supervisor.cache import CacheSpec, adopt_or_start
    from app.supervisor.forks import ForkServer, ForkServerUnavailable
    from app.supervisor.launcher import WorkerLauncher
    from app.supervisor.liveness import watch_heartbeats
    from app.supervisor.reconciler import Reconciler, Routing
    from app.supervisor.relays import Relays
    from app.supervisor.supervisor import Supervisor

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_stop(sig: signal.Signals) -> None:
        if not stop.is_set():  # say so at once: stopping waits for requests in flight (drain_timeout)
            log_event(log, "stopping", signal=sig.name, drain_timeout=settings.restart.drain_timeout,
                      seconds=time.perf_counter() - started)  # fmt: skip
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_stop, sig)
    run_dir, r = settings.run_dir, settings.restart
    metrics = SupervisorMetrics()
    forker = ForkServer(run_dir / "fork.sock", run_dir / "fork-server.log", settings.engine.backend) \
        if r.fork_server else None  # fmt: skip
    supervisor: Supervisor | None = None
    cache: Any = None  # the cache handle, once started or adopted
    reconciler: Reconciler | None = None
    relays: Relays | None = None
    tasks: list[asyncio.Task[Any]] = []

    async def start() -> None:
        nonlocal supervisor, cache, reconciler, relays
        forking = asyncio.create_task(forker.start()) if forker is not None else None  # imports torch meanwhile
        try:
            cache = await adopt_or_start(CacheSpec.of(settings, model), run_dir, run_dir / "cache.sock",
                                         run_dir / "cache.log")  # fmt: skip
            if forking is not None:
                await forking
        except ForkServerUnavailable as exc:  # engines are spawned instead; a restart tries the fork server again
            log_warning(log, "fork_fallback", reason=exc)
        finally:
            if forking is not None and not forking.done():
                forking.cancel()

        async def on_routing(routing: Routing) -> None:
            assert supervisor is not None
            await supervisor.on_routing(routing)

        reconciler = Reconciler(run_dir, r, WorkerLauncher(forker), metrics, on_routing, generation)
        supervisor = Supervisor(settings, config_path, overrides, model, cache, reconciler, metrics, token)
        relays = Relays(run_dir, settings.gateway.relay_count(), listener, r.drain_timeout, metrics, supervisor.admin,
                        supervisor.relay_failure)  # fmt: skip
        supervisor.relays = relays
        reconciler.start()
        tasks.append(asyncio.create_task(watch_heartbeats(reconciler, lambda: supervisor.settings.restart)))
        # The relays start beside the first engine: clients that connect meanwhile wait in them for it.
        relaying = asyncio.create_task(relays.start(supervisor.table()))
        try:
            report = await reconciler.restart(settings.engine_config(model, cache.socket), "overlap", reason="start")
            if not report.ok:
                raise GatewayStartError(f"the first engine did not start: {report.error}")
            await relaying
        finally:
            if not relaying.done():
                relaying.cancel()
        tasks.append(asyncio.create_task(supervisor.watch_cache()))
        tasks.append(asyncio.create_task(supervisor.refresh_cache_metrics()))

        def on_hup() -> None:
            tasks.append(asyncio.create_task(_reload_logged(supervisor)))

        loop.add_signal_handler(signal.SIGHUP, on_hup)

    starting = asyncio.create_task(start())
    stopping = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if starting.done():
            starting.result()  # a failed start raises here
            # Start-up's objects live as long as the supervisor: frozen out of the collector.
            gc.collect()
            gc.freeze()
            log_event(log, "ready", url=url, model=model, run_dir=run_dir, relays=settings.gateway.relay_count(),
                      seconds=time.perf_counter() - started)  # fmt: skip
            await stopping
    finally:
        for task in (starting, stopping, *tasks):
            task.cancel()
        await asyncio.gather(starting, stopping, *tasks, return_exceptions=True)
        if relays is not None:
            await relays.stop()  # first: no new requests; those in flight finish on the engines
        else:
            listener.close()
        if reconciler is not None:
            await reconciler.close()
        if forker is not None:
            await forker.stop()
        if supervisor is not None:
            await supervisor.cache.stop()  # the current one (a reload or the cache watcher may have replaced it)
        elif cache is not None:
            await cache.stop()
        log_event(log, "exit", seconds=time.perf_counter() - started)


async def _reload_logged(supervisor: Any) -> None:
    try:
        report = await supervisor.reload()
        log_event(log, "reload", signal="SIGHUP", changed=report.get("changed"), ok=report.get("ok"))
    except ValueError as exc:
        log_warning(log, "reload_refused", signal="SIGHUP", reason=exc)
