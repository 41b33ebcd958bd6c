"""`warmgate supervisor`: the control plane, started (and restarted) by `warmgate serve` (app/supervisor/master.py).

It takes the listening socket from the master, then adopts what an earlier supervisor on the run dir left
running (the cache, the fork server, the engines recorded in state.json, the relays that say hello) or starts
it: the cache process, the fork server, the relay workers (they accept on the socket) and the first engine.
Then it carries out restarts, reloads and crash recovery. SIGHUP (or POST /admin/reload) re-reads the config.

SIGTERM or SIGINT, at any moment: the relays stop accepting and finish their requests, then the engines, the
fork server and the cache process stop, in that order. SIGUSR2 (an upgrade): it exits at once and leaves all
of them serving, for the next supervisor to adopt. SIGKILL: the same, less its last state.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import secrets
import signal
import socket
import time
from pathlib import Path
from typing import Any

from app.config import Settings, load_settings
from app.supervisor.run_dir import RunDir, url_for
from common.events import configure_logging, log_event, log_warning
from common.uds import private_dir

log = logging.getLogger("warmgate.supervisor")
TOKEN_FILE = "admin-token"


class GatewayStartError(RuntimeError):
    """The gateway could not start (its first engine did not); the message says why, in one line."""


def admin_token(settings: Settings, keep: bool) -> str:
    """The configured token, or (``keep``) the one an earlier supervisor wrote, or a new one; written to the run dir
    (mode 0600) for the CLI to read."""
    path = settings.run_dir / TOKEN_FILE
    earlier = path.read_text().strip() if keep and path.exists() else None
    token = settings.gateway.admin_token or os.environ.get("WARMGATE_ADMIN_TOKEN") or earlier
    token = token or secrets.token_urlsafe(24)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def main(config_path: Path | None, listen_fd: int, ready_fd: int, upgrade: bool, **overrides: Any) -> int:
    """The model is checked before anything starts (one line, exit 2, via app/cli.py); the master holds the run
    dir's lock and has checked the rest."""
    started = time.perf_counter()
    configure_logging()
    settings = load_settings(config_path, **overrides)
    private_dir(settings.run_dir)
    from common.proctitle import set_title

    set_title(f"supervisor {settings.run_dir}")
    run_dir = RunDir(settings.run_dir)
    generation = run_dir.next_generation()
    listener = socket.socket(fileno=listen_fd)
    model = settings.model
    if model is not None:
        _looks_like_a_checkpoint(model)  # at once, before the imports a full check needs
        from cache.checkpoint.reader import read_checkpoint

        read_checkpoint(model)  # the errors `warmgate model check` gives, before any process starts
    from app.metrics import use_directory
    from common.processes import gateway_processes

    earlier = [p for p in gateway_processes(settings.run_dir) if p.role in ("relay", "engine", "fork server")]
    use_directory(settings.run_dir / "metrics", fresh=not earlier)  # an earlier gateway's relays still write there
    url = url_for(settings.gateway.host, listener.getsockname()[1])
    token = admin_token(settings, keep=bool(earlier))
    from common.device import resolve_device

    # "auto" (the default) is resolved by each process with the same function; logged here so nobody guesses.
    log_event(log, "device", setting=settings.engine.device, engines=resolve_device(settings.engine.device),
              cache=resolve_device(settings.cache_device or settings.engine.device))  # fmt: skip
    if model is None:
        from cache.checkpoint.demo import build_demo

        model = build_demo("fp8-block", progress=True)
    asyncio.run(_serve(settings, config_path, overrides, model.resolve(), token, listener, url, generation, started,
                       ready_fd, upgrade))  # fmt: skip
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
                 listener: socket.socket, url: str, generation: int, started: float, ready_fd: int,
                 upgrade: bool) -> None:  # fmt: skip
    from app.metrics import SupervisorMetrics, forget_process
    from app.supervisor.adopt import adopt_engines
    from app.supervisor.cache import CacheSpec, adopt_or_start
    from app.supervisor.forks import ForkServer, ForkServerUnavailable
    from app.supervisor.launcher import WorkerLauncher
    from app.supervisor.liveness import watch_heartbeats
    from app.supervisor.reconciler import Reconciler, Routing
    from app.supervisor.relays import Relays
    from app.supervisor.state import GatewayState
    from app.supervisor.supervisor import Supervisor
    from app.supervisor.sweep import remove_files, stop_processes

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    hand_over = False  # SIGUSR2: leave everything serving for the next supervisor

    def on_stop(sig: signal.Signals) -> None:
        nonlocal hand_over
        if not stop.is_set():  # say so at once: stopping waits for requests in flight (drain_timeout)
            hand_over = sig is signal.SIGUSR2
            log_event(log, "handing_over" if hand_over else "stopping", signal=sig.name,
                      drain_timeout=settings.restart.drain_timeout, seconds=time.perf_counter() - started)  # fmt: skip
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2):
        loop.add_signal_handler(sig, on_stop, sig)
    run_dir, r = settings.run_dir, settings.restart
    earlier = GatewayState.load(run_dir)
    if earlier is not None:
        forget_process(earlier.supervisor)  # its gauges leave the sums
    metrics = SupervisorMetrics()
    forker = ForkServer(run_dir / "fork.sock", run_dir / "fork-server.log", settings.engine.backend) \
        if r.fork_server else None  # fmt: skip
    supervisor: Supervisor | None = None
    cache: Any = None  # the cache handle, once started or adopted
    reconciler: Reconciler | None = None
    relays: Relays | None = None
    tasks: list[asyncio.Task[Any]] = []
    adopted: list[int] = []  # the ids of the engines taken over from an earlier supervisor

    async def start() -> None:
        nonlocal supervisor, cache, reconciler, relays
        old_forks = earlier.fork_server if earlier is not None else None
        adopted_forks = forker is not None and old_forks is not None and not upgrade and \
            forker.adopt(old_forks.pid, old_forks.started)  # fmt: skip
        if forker is not None and old_forks is not None and not adopted_forks:
            await ForkServer.stop_earlier(old_forks.pid, old_forks.started)  # an upgrade: forks of the new code
        forking = asyncio.create_task(forker.start()) if forker is not None and not adopted_forks else None
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

        def on_change() -> None:
            if supervisor is not None:
                supervisor.save_state(forker)

        launcher = WorkerLauncher(forker)
        reconciler = Reconciler(run_dir, r, launcher, metrics, on_routing, generation, on_change)
        supervisor = Supervisor(settings, config_path, overrides, model, cache, reconciler, metrics, token)
        tasks.extend(await adopt_engines(earlier, launcher, reconciler, r.drain_timeout, r.health_timeout))
        adopted.extend(sorted(reconciler.engines))
        if earlier is not None:
            supervisor.engine_overrides = earlier.engine_overrides
            supervisor.continue_from(earlier.table_generation, reconciler.routing())
        relays = Relays(run_dir, settings.gateway.relay_count(), listener, r.drain_timeout, metrics, supervisor.admin,
                        supervisor.relay_failure)  # fmt: skip
        supervisor.relays = relays
        reconciler.start()
        supervisor.save_state(forker)
        tasks.append(asyncio.create_task(watch_heartbeats(reconciler, lambda: supervisor.settings.restart)))
        # The relays start beside the first engine: clients that connect meanwhile wait in them for it.
        relaying = asyncio.create_task(relays.start(supervisor.table(), adopt=earlier is not None, upgrade=upgrade))
        try:
            wanted = settings.engine_config(model, cache.socket, supervisor.engine_overrides)
            if reconciler.desired != wanted:  # nothing adopted, or the config (or the cache) changed meanwhile
                reason = "start" if reconciler.active is None else "config changed"
                report = await reconciler.restart(wanted, "overlap", reason=reason)
                if not report.ok and reconciler.active is None:
                    raise GatewayStartError(f"the first engine did not start: {report.error}")
                if not report.ok:  # the adopted engine serves on, as after any failed restart
                    log_warning(log, "config_not_applied", error=report.error)
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
                      adopted=adopted,
                      seconds=time.perf_counter() - started)  # fmt: skip
            os.write(ready_fd, b"1")
            os.close(ready_fd)
            await stopping
    finally:
        for task in (starting, stopping, *tasks):
            task.cancel()
        await asyncio.gather(starting, stopping, *tasks, return_exceptions=True)
        failed = starting.done() and not starting.cancelled() and starting.exception() is not None
        if failed and earlier is not None:  # a supervisor that could not take over stops nothing it found running
            hand_over = True
        if hand_over:
            if supervisor is not None:
                supervisor.save_state(forker)
            if reconciler is not None:
                await reconciler.close(stop_engines=False)
            if relays is not None:
                await relays.detach()
            log_event(log, "handed_over", seconds=time.perf_counter() - started)
        else:
            if relays is not None:
                await relays.stop()  # first: no new requests; those in flight finish on the engines
            if reconciler is not None:
                await reconciler.close()
            if forker is not None:
                await forker.stop()
            if supervisor is not None:
                await supervisor.cache.stop()  # the current one (a reload or the cache watcher may have replaced it)
            elif cache is not None:
                await cache.stop()
            # Anything an earlier supervisor started and nobody recorded (an engine starting when it died).
            await asyncio.to_thread(stop_processes, run_dir, r.drain_timeout, spare=frozenset({os.getpid()}))
            remove_files(run_dir)
            log_event(log, "exit", seconds=time.perf_counter() - started)


async def _reload_logged(supervisor: Any) -> None:
    try:
        report = await supervisor.reload()
        log_event(log, "reload", signal="SIGHUP", changed=report.get("changed"), ok=report.get("ok"))
    except ValueError as exc:
        log_warning(log, "reload_refused", signal="SIGHUP", reason=exc)
