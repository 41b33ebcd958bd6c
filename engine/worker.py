"""The engine worker process: load one model, then serve the engine API on a Unix socket until SIGTERM.

Start-up is the cost of every engine restart, so each phase is logged with its duration, and the
heavy imports (torch, the model code, FastAPI) happen inside main() where they are timed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Generator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common import events

if TYPE_CHECKING:
    import uvicorn

    from common.heartbeat import Heartbeat
    from engine.server import EngineApp, ServingEngine

log = logging.getLogger("warmgate.engine.worker")

DEFAULT_DRAIN_TIMEOUT = 30.0  # seconds a SIGTERM waits for in-flight requests before the worker exits anyway


def log_event(event: str, **fields: Any) -> None:
    events.log_event(log, event, **fields)


def _server_class() -> type[uvicorn.Server]:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server without its signal handlers: the worker drains before it lets uvicorn stop."""

        @contextlib.contextmanager
        def capture_signals(self) -> Generator[None, None, None]:
            yield

    return Server


async def serve(app: EngineApp, engine: ServingEngine, sock: socket.socket, drain_timeout: float,
                stop_requested: list[str], heartbeat: Heartbeat | None, socket_path: Path, role: str = "engine",
                ended: asyncio.Event | None = None) -> None:  # fmt: skip
    """Serve ``app`` on ``sock`` until a signal's drain ends (or ``ended`` is set: the engine is gone), then stop the
    engine; the HTTP loop stamps ``heartbeat`` and shows the engine's state in the process title (``role`` first)."""
    import uvicorn

    api = app.api
    title_name, title_dir = socket_path.stem.removeprefix("engine-"), socket_path.parent
    # The socket is bound by bind_unix_socket (uvicorn's own uds binding would chmod it 0666). Requests get
    # their grace period from the drain; whatever outlives it is cut after a second, not waited for forever.
    # Relays keep their connections to an engine open between requests (app/relay/upstream.py closes its idle
    # ones after 20 s): uvicorn's default of 5 s would close them under the relays' feet.
    config = uvicorn.Config(app, log_config=None, log_level="warning", access_log=False, lifespan="off",
                            timeout_graceful_shutdown=1, timeout_keep_alive=60)  # fmt: skip
    server = _server_class()(config)
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task[None]] = set()

    async def drain_then_exit(signame: str) -> None:
        report = await api.admission.drain(drain_timeout)
        log_event(
            "shutdown",
            signal=signame,
            drained=report.drained,
            in_flight_at_start=report.in_flight_at_start,
            remaining=report.remaining,
            seconds=report.seconds,
        )
        server.should_exit = True

    def on_signal(sig: signal.Signals) -> None:
        if tasks:  # a second signal: stop waiting for the drain
            server.should_exit = server.force_exit = True
            return
        task = loop.create_task(drain_then_exit(sig.name))
        tasks.add(task)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    if heartbeat is not None:  # this loop's share of the liveness signal (common/heartbeat.py)
        from common.heartbeat import BEAT_INTERVAL, EVENT_LOOP
        from common.proctitle import set_title

        shown = [""]

        def beat() -> None:
            heartbeat.beat(EVENT_LOOP)
            state = heartbeat.state()  # what the supervisor says this engine is: its process title says it too
            if state != shown[0]:
                shown[0] = state
                set_title(f"{role} {title_name} {state} {title_dir}")
            loop.call_later(BEAT_INTERVAL, beat)

        beat()
    if stop_requested:  # signalled after start-up's last check (during the warm-up): drain and exit now
        on_signal(signal.Signals[stop_requested[0]])
    if ended is not None:

        async def stop_when_ended() -> None:
            await ended.wait()
            server.should_exit = server.force_exit = True

        watcher = loop.create_task(stop_when_ended())
    try:
        await server.serve(sockets=[sock])
    finally:
        if ended is not None:
            watcher.cancel()
        # Stop the engine while the loop still runs: requests it aborts are told so through this loop.
        engine.stop()


def _build_engine(config: Any) -> ServingEngine:
    """The engine of the configured backend; each logs its own start-up phases."""
    if config.backend == "vllm":
        from engine.vllm.engine import VllmEngine

        return VllmEngine(config)  # phases: vllm_import, vllm_engine (weights bound from the cache), warmup
    from engine.native.llm_engine import LLMEngine

    return LLMEngine(config)  # phases: device_init, weight_load, model_init, kv_alloc, cuda_graphs, warmup


SWITCH_INTERVAL = 0.0005  # seconds


async def warm_up(app: EngineApp) -> None:
    """A streamed completion and a streamed chat through the whole app before the worker reports ready:
    first-use costs (request validation, chat template, detokenizer, SSE framing) are paid here,
    not by the first client after a start."""
    import httpx

    requests = [
        ("/v1/completions", {"prompt": [1] * 8, "max_tokens": 2, "stream": True, "ignore_eos": True}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True}),
    ]
    if "xgrammar" in sys.modules:  # the fork server imported it: the grammar compiler is built now (0.1 s), not by
        # the first structured request, whose build used to take the GIL from the engine's thread while it served
        body = {
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 2,
            "stream": True,
            "response_format": {"type": "json_object"},
        }
        requests.append(("/v1/chat/completions", body))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://warmup") as client:
        # At once: their steps are shared (one after the other, each request's steps were a start-up's wait).
        responses = await asyncio.gather(*(client.post(path, json={**body, "temperature": 0})
                                           for path, body in requests))  # fmt: skip
    for (path, _), response in zip(requests, responses, strict=True):
        if response.status_code != 200:
            raise RuntimeError(f"warm-up request {path} failed: {response.status_code} {response.text[:200]}")


def main(socket_path: str | Path, config_source: str, drain_timeout: float = DEFAULT_DRAIN_TIMEOUT,
         heartbeat_path: Path | None = None) -> int:  # fmt: skip
    """Run an engine worker: build the engine from the config (file or inline JSON), serve it on socket_path.

    ``heartbeat_path``: a file made by the supervisor (common/heartbeat.py) that the engine thread and the HTTP
    loop stamp while they make progress: its liveness signal."""
    started = time.perf_counter()
    events.configure_logging()
    socket_path = Path(socket_path)
    # A stop asked for while we load (a supervisor giving up on a slow start) ends the start-up
    # cleanly once the current phase is done; the asyncio loop takes the signals over when serving.
    # Installed before the first log line, so a supervisor that saw it may signal safely.
    stop_requested: list[str] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: stop_requested.append(signal.Signals(signum).name))
    log_event("startup", phase="begin", socket=socket_path, pid=os.getpid())
    from common.proctitle import set_title

    name = socket_path.stem.removeprefix("engine-")  # the supervisor names it engine-GENERATION-ID
    set_title(f"engine {name} starting {socket_path.parent}")
    from common.uds import bind_unix_socket
    from engine.config import EngineConfig

    config = EngineConfig.load(config_source)  # before the heavy imports: a bad config fails at once

    t = time.perf_counter()
    import torch

    torch_seconds = time.perf_counter() - t
    from engine.server import create_app
    from engine.tokenizer import ChatTokenizer

    log_event(
        "startup", phase="import", seconds=time.perf_counter() - t, torch_seconds=torch_seconds, torch=torch.__version__
    )

    t = time.perf_counter()
    tokenizer = ChatTokenizer.load(config.model)
    log_event("startup", phase="tokenizer", seconds=time.perf_counter() - t)

    tokenizer_seconds = time.perf_counter() - t
    fronts: list[tuple[int, socket.socket]] = []
    count = config.front_processes if config.backend == "native" else 0  # vLLM has an engine-core process of its own
    if count:
        # The socket every front accepts on, made before they are forked (each inherits it) and bound by this process
        # once its engine is ready; and the board where they keep the engine's drain and in-flight count.
        from engine.front import run_front, start_front
        from engine.server import FrontBoard

        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        board = FrontBoard(count)
        for index in range(count):
            run = functools.partial(run_front, socket_path=socket_path, listener=listener, board=board, index=index,
                                    tokenizer=tokenizer, heartbeat_path=heartbeat_path, drain_timeout=drain_timeout,
                                    started=started)  # fmt: skip
            fronts.append(start_front(run, [sock for _, sock in fronts]))
        log_event("startup", phase="front", pids=",".join(str(pid) for pid, _ in fronts))
    t = time.perf_counter()
    engine = _build_engine(config)
    log_event("startup", phase="engine", seconds=time.perf_counter() - t, model=config.name, device=config.device)
    engine.startup_phases["tokenizer"] = tokenizer_seconds

    if stop_requested:
        log_event("exit", reason=f"{stop_requested[0]} during start-up", seconds=time.perf_counter() - started)
        return 0
    # Two threads share the GIL: the engine's (it feeds the GPU) and the server's loop (text and SSE
    # framing). After each step's GPU wait the engine thread asks for the GIL back; by default the
    # loop may keep it for up to 5 ms first, a whole decode step. A short interval bounds that wait.
    sys.setswitchinterval(SWITCH_INTERVAL)
    from common.heartbeat import Heartbeat

    heartbeat = Heartbeat(heartbeat_path) if heartbeat_path is not None else None
    engine.start(heartbeat)
    if fronts:
        return _serve_through_fronts(engine, fronts, listener, tokenizer, stop_requested, heartbeat, socket_path,
                                     started)  # fmt: skip
    try:
        app = create_app(engine, tokenizer)
        sock = bind_unix_socket(socket_path)
        sock.setblocking(False)
    except BaseException:
        engine.stop()
        raise
    t = time.perf_counter()
    import uvloop  # the HTTP loop on libuv, as the relays' (bench/engine_host.py: 67 -> 62 us of CPU per token)

    uvloop.run(warm_up(app))
    engine.startup_phases["server_warmup"] = time.perf_counter() - t
    log_event("startup", phase="server_warmup", seconds=engine.startup_phases["server_warmup"])
    # What start-up made (modules, the model's tensors and graphs) lives as long as the worker: moved out
    # of the collector's generations, it is not walked again by every full collection while serving.
    t = time.perf_counter()
    gc.collect()
    gc.freeze()
    engine.startup_phases["gc"] = time.perf_counter() - t
    log_event("ready", socket=socket_path, seconds=time.perf_counter() - started, **engine.startup_phases)
    try:
        uvloop.run(serve(app, engine, sock, drain_timeout, stop_requested, heartbeat, socket_path))
    finally:
        sock.close()
        socket_path.unlink(missing_ok=True)
    log_event("exit", seconds=time.perf_counter() - started)
    return 0


def _serve_through_fronts(engine: Any, fronts: list[tuple[int, socket.socket]], listener: socket.socket,
                          tokenizer: Any, stop_requested: list[str], heartbeat: Heartbeat | None, socket_path: Path,
                          started: float) -> int:  # fmt: skip
    """The worker's part while its front processes serve (engine/front.py): bind the socket they accept on, then the
    links' messages on this thread until every front has closed its link, signals passed on to the fronts (which
    drain), then the engine stopped. Exits 1 if a front did not end cleanly (a crash for the supervisor, which starts
    another engine; the other fronts end as their links close)."""
    from common.heartbeat import BEAT_INTERVAL
    from common.proctitle import set_title
    from common.uds import bind_unix_socket
    from engine.front import EngineLink, WorkerGrammars, serve_links

    pids = [pid for pid, _ in fronts]

    def forward(signum: int, _frame: object) -> None:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    if stop_requested:  # signalled after start-up's last check
        forward(signal.Signals[stop_requested[0]], None)
    name, run_dir, shown = socket_path.stem.removeprefix("engine-"), socket_path.parent, [""]

    def show_state() -> None:
        state = heartbeat.state() if heartbeat is not None else "ready"
        if state != shown[0]:
            shown[0] = state
            set_title(f"engine {name} {state} {run_dir}")

    grammars = WorkerGrammars(tokenizer, engine)
    links = {EngineLink(engine, sock, grammars, pids): pid for pid, sock in fronts}
    statuses: dict[int, int | None] = {}

    def ended(link: EngineLink) -> bool:
        pid = links[link]
        statuses[pid] = _reap(pid, 5.0)
        return statuses[pid] == 0

    gc.collect()
    gc.freeze()
    try:
        bind_unix_socket(socket_path, into=listener)
        for link in links:
            link.hello()
    except BaseException:
        engine.stop()
        raise
    finally:
        listener.close()  # the fronts accept on it; a worker whose fronts have ended must not keep it listening
    try:
        serve_links(list(links), ended, show_state, BEAT_INTERVAL)
    finally:
        engine.stop()
        for link in links:
            link.sock.close()  # a front still serving ends (a lost link), its connections cut for the relays
        socket_path.unlink(missing_ok=True)
    for pid in pids:
        if pid not in statuses:
            statuses[pid] = _reap(pid, 5.0)
    log_event("exit", seconds=time.perf_counter() - started,
              front_status=",".join(str(statuses[pid]) for pid in pids))  # fmt: skip
    return 0 if all(status == 0 for status in statuses.values()) else 1


def _reap(pid: int, timeout: float) -> int | None:
    """The front's exit code (negative: the signal that ended it), killing it if it outlives ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        time.sleep(0.01)
