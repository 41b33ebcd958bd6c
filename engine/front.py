"""An engine's front process: the engine API (engine/server.py) served apart from the process that steps the engine.

A native engine worker forks, before it builds its engine, a front process that serves the engine API on the
worker's socket: request parsing, prompts and chat templates, grammars, detokenizing and SSE framing run there, on an
interpreter (and GIL) of their own, while the worker's engine thread feeds the GPU. DESIGN.md asks it ("the step loop
owns its GIL"); vLLM v1 keeps the same work in a process apart from its engine core. In one process the HTTP loop
took 0.45-0.6 ms of the GIL per admitted request (bench/engine_host.py's bursts), so a wave of 64 requests reached
the scheduler over ~80 ms on the H200 while the step loop waited for the GIL between steps (docs/benchmarks.md).

The two talk over a socketpair made before the fork. The front's ``RemoteEngine`` is the ServingEngine its routes
use; the worker's ``EngineLink`` submits to the real engine and sends each step's events back in one message (the
engine thread's Outbox flush, as it woke a loop once per step). The messages are the dataclasses below, in
common/framing.py's length-prefixed JSON (``encode`` and ``decode`` below: nothing that crosses a socket is
unpickled).

Lifetimes: the front dies with its worker (PR_SET_PDEATHSIG: a kill -9 of the worker ends the front's connections at
once, so the relays resume its requests elsewhere), and the worker stops when its front's link closes. A SIGTERM to
the worker is passed on to the front, which drains as the worker did and exits; the worker then stops its engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import itertools
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common import events
from common.framing import ProtocolError, read_message, recv_message, send_message, write_message
from common.processes import die_with_parent, exit_after, unshared_memory
from engine.request_stream import RequestStream, TokenEvent, TokenLogprobs

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.grammar import Grammars, GrammarSpec
    from engine.native.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams
    from engine.server import FrontBoard
    from engine.tokenizer import ChatTokenizer
    from engine.weights import WeightOrigin

log = logging.getLogger("warmgate.engine.front")

BUFFER_BYTES = 4 * 1024 * 1024  # each way: a burst of prompts, or a step's events, never waits for the reader


# -- the messages (front -> worker: Submit, Cancel, Activate, AskFigures; worker -> front: Hello, Events, Reply) --


@dataclass(slots=True)
class Figures:
    """What /health reports that changes while the engine serves."""

    alive: bool
    running: int
    waiting: int
    preemptions: int
    prefix_cache: tuple[int, int]
    kv_blocks_free: int
    kv_blocks_total: int
    device_memory_bytes: int
    private_memory_bytes: int  # the worker's and its fronts'


@dataclass(slots=True)
class Hello:
    """The worker's engine is ready: what never changes about it, and its figures now."""

    config: EngineConfig
    max_num_seqs: int
    max_model_len: int
    memory: dict[str, Any]
    eos_token_ids: list[int]
    startup_phases: dict[str, float]
    vocab_size: int
    weight_origin: WeightOrigin
    figures: Figures


@dataclass(slots=True)
class Submit:
    """A choice to generate; ``grammar``: its compiled grammar's spec (the worker compiles its own copy)."""

    sid: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams  # its grammar left out
    grammar: GrammarSpec | None
    output_ids: list[int] | None


@dataclass(slots=True)
class Cancel:
    sid: int


@dataclass(slots=True)
class Activate:
    call: int
    timeout: float


@dataclass(slots=True)
class AskFigures:
    call: int


@dataclass(slots=True)
class Events:
    """One step's events, each with its stream's sid; a plain new token (no finish, no logprobs) as its id alone
    (most events: an object per event is what costs, in a step's message of 64)."""

    items: list[tuple[int, TokenEvent | int]]


@dataclass(slots=True)
class Reply:
    call: int
    value: Any = None
    error: str | None = None  # the call raised RuntimeError with this message


def encode(message: object) -> dict[str, Any]:
    """A message as the JSON object that crosses the link."""
    if isinstance(message, Events):
        items = [[sid, e if isinstance(e, int) else _event_out(e)] for sid, e in message.items]
        return {"type": "events", "items": items}
    if isinstance(message, Submit):
        params = {f.name: getattr(message.params, f.name) for f in fields(message.params) if f.name != "grammar"}
        grammar = None if message.grammar is None else [message.grammar.kind, message.grammar.schema]
        return {"type": "submit", "sid": message.sid, "request_id": message.request_id,
                "prompt_ids": message.prompt_ids, "params": params, "grammar": grammar,
                "output_ids": message.output_ids}  # fmt: skip
    if isinstance(message, Cancel):
        return {"type": "cancel", "sid": message.sid}
    if isinstance(message, Activate):
        return {"type": "activate", "call": message.call, "timeout": message.timeout}
    if isinstance(message, AskFigures):
        return {"type": "ask_figures", "call": message.call}
    if isinstance(message, Reply):
        value = _figures_out(message.value) if isinstance(message.value, Figures) else message.value
        return {"type": "reply", "call": message.call, "value": value, "error": message.error,
                "figures": isinstance(message.value, Figures)}  # fmt: skip
    if isinstance(message, Hello):
        return {"type": "hello", "config": message.config.model_dump(mode="json"), "max_num_seqs": message.max_num_seqs,
                "max_model_len": message.max_model_len, "memory": message.memory,
                "eos_token_ids": message.eos_token_ids, "startup_phases": message.startup_phases,
                "vocab_size": message.vocab_size, "weight_origin": asdict(message.weight_origin),
                "figures": _figures_out(message.figures)}  # fmt: skip
    raise TypeError(f"not a message of the link: {type(message).__name__}")


def decode(body: dict[str, Any]) -> object:
    """The message of a JSON object from the link (KeyError or TypeError for one that is not)."""
    kind = body["type"]
    if kind == "events":
        return Events([(sid, e if type(e) is int else _event_in(e)) for sid, e in body["items"]])
    if kind == "submit":
        from engine.grammar import GrammarSpec
        from engine.sampling_params import SamplingParams

        grammar = None if body["grammar"] is None else GrammarSpec(*body["grammar"])
        return Submit(body["sid"], body["request_id"], body["prompt_ids"], SamplingParams(**body["params"]), grammar,
                      body["output_ids"])  # fmt: skip
    if kind == "cancel":
        return Cancel(body["sid"])
    if kind == "activate":
        return Activate(body["call"], body["timeout"])
    if kind == "ask_figures":
        return AskFigures(body["call"])
    if kind == "reply":
        value = _figures_in(body["value"]) if body["figures"] else body["value"]
        return Reply(body["call"], value, body["error"])
    if kind == "hello":
        from engine.config import EngineConfig
        from engine.weights import WeightOrigin

        return Hello(EngineConfig.model_validate(body["config"]), body["max_num_seqs"], body["max_model_len"],
                     body["memory"], body["eos_token_ids"], body["startup_phases"], body["vocab_size"],
                     WeightOrigin(**body["weight_origin"]), _figures_in(body["figures"]))  # fmt: skip
    raise TypeError(f"not a message of the link: {kind!r}")


def _figures_out(figures: Figures) -> dict[str, Any]:
    return {f.name: getattr(figures, f.name) for f in fields(figures)}


def _figures_in(body: dict[str, Any]) -> Figures:
    return Figures(**{**body, "prefix_cache": tuple(body["prefix_cache"])})


def _logprobs_out(logprobs: TokenLogprobs | None) -> list[Any] | None:
    return None if logprobs is None else [logprobs.logprob, logprobs.top]


def _logprobs_in(body: list[Any] | None) -> TokenLogprobs | None:
    return None if body is None else TokenLogprobs(body[0], tuple((token, lp) for token, lp in body[1]))


def _event_out(event: TokenEvent) -> list[Any]:
    prompt = None if event.prompt_logprobs is None else [_logprobs_out(p) for p in event.prompt_logprobs]
    return [event.token_id, event.finish_reason, event.error, _logprobs_out(event.logprobs), prompt,
            event.cached_tokens]  # fmt: skip


def _event_in(body: list[Any]) -> TokenEvent:
    token, finish, error, logprobs, prompt, cached = body
    prompt_logprobs = None if prompt is None else tuple(_logprobs_in(p) for p in prompt)
    return TokenEvent(token, finish, error, _logprobs_in(logprobs), prompt_logprobs, cached)


def _sized(sock: socket.socket) -> socket.socket:
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, option, BUFFER_BYTES)
    return sock


# -- the worker's side ------------------------------------------------------------------------------------------------


def figures(engine: LLMEngine, fronts: list[int]) -> Figures:
    """The engine's figures now, as /health reports them (private memory: the worker's and what its ``fronts`` wrote
    on their own, not the pages they still share with it)."""
    memory = engine.private_memory_bytes() + sum(unshared_memory(pid) for pid in fronts)
    return Figures(engine.alive, engine.num_running, engine.num_waiting, engine.num_preemptions, engine.prefix_cache,
                   engine.kv_blocks_free, engine.kv_blocks_total, engine.device_memory_bytes(), memory)  # fmt: skip


class WorkerGrammars:
    """The worker's grammar compiler, one for all its links: built in a thread of its own the first time it is asked
    for; a grammar not cached yet compiles in a thread of its own too (one schema can take seconds)."""

    def __init__(self, tokenizer: ChatTokenizer, engine: LLMEngine) -> None:
        self._tokenizer, self._engine = tokenizer, engine
        self._grammars: Future[Grammars] | None = None
        self._compiling: ThreadPoolExecutor | None = None

    def started(self) -> Future[Grammars]:
        if self._grammars is None:
            from engine.grammar import Grammars

            future: Future[Grammars] = Future()
            self._grammars = future

            def build() -> None:
                try:
                    future.set_result(Grammars(self._tokenizer, self._engine.vocab_size, self._engine.eos_token_ids))
                except BaseException as exc:
                    future.set_exception(exc)

            threading.Thread(target=build, name="warmgate-grammars", daemon=True).start()
        return self._grammars

    def off_thread(self, work: Callable[[], None]) -> None:
        if self._compiling is None:
            self._compiling = ThreadPoolExecutor(1, thread_name_prefix="warmgate-link-grammar")
        self._compiling.submit(work)


class EngineLink:
    """The worker's end of one front's link: its requests submitted to the engine, the engine's events sent back."""

    def __init__(self, engine: LLMEngine, sock: socket.socket, grammars: WorkerGrammars, fronts: list[int]) -> None:
        """``fronts``: the pids of all the worker's fronts (their private memory is in the figures)."""
        self.engine = engine
        self.sock = sock
        self._grammars = grammars
        self._fronts = fronts
        # One frame at a time on the socket (the engine thread sends events, this thread replies), and a stream's
        # sid known before the engine thread can send its first event.
        self._lock = threading.Lock()
        self._sids: dict[RequestStream, int] = {}
        self._streams: dict[int, RequestStream] = {}
        self._waiting: dict[int, bool] = {}  # sids whose grammar compiles -> cancelled meanwhile
        self._sink = self._deliver  # one object: the Outbox groups a step's events by sink

    def hello(self) -> None:
        """Tell the front the engine is ready and serves on the socket the worker has bound (the front warms up
        through the link, then accepts on it)."""
        e = self.engine
        self._send(Hello(e.config, e.max_num_seqs, e.max_model_len, e.memory, e.eos_token_ids, e.startup_phases,
                         e.vocab_size, e.weight_origin, figures(e, self._fronts)))  # fmt: skip
        if "xgrammar" in sys.modules:  # the fork server imported it: the front's warm-up asks for a grammar, whose
            # compiler (0.1 s on the H200's host) is built here while the front starts, not after its own
            self._grammars.started()

    def receive(self) -> bool:
        """Handle the front's next message (select said one begins); False once the link has closed."""
        try:
            received = recv_message(self.sock)  # a whole message, blocking once it begins
        except (ProtocolError, OSError):
            return False
        if received is None:
            return False
        self._handle(decode(received[0]))
        return True

    def _handle(self, message: object) -> None:
        if isinstance(message, Submit):
            self._submit(message)
        elif isinstance(message, Cancel):
            with self._lock:
                stream = self._streams.get(message.sid)
                if message.sid in self._waiting:
                    self._waiting[message.sid] = True
            if stream is not None:
                stream.cancel()
        elif isinstance(message, Activate):
            call = message.call

            def done(future: Future[float]) -> None:
                exc = future.exception()
                self._send(Reply(call, None, str(exc)) if exc else Reply(call, future.result()))

            self.engine.activate(message.timeout).add_done_callback(done)
        elif isinstance(message, AskFigures):
            self._send(Reply(message.call, figures(self.engine, self._fronts)))
        else:
            raise TypeError(f"unexpected message from the front: {type(message).__name__}")

    def _submit(self, message: Submit, grammar: Any = None) -> None:
        """Submit to the engine. A grammar is the worker's own copy of the one the front compiled (a compiled grammar
        holds native objects): from the cache here, else compiled in a thread of its own (one schema can take
        seconds, in which every other request would wait) and then submitted from there."""
        spec = message.grammar
        try:
            if spec is not None and grammar is None:
                grammars = self._grammars.started()
                grammar = grammars.result().cached(spec) if grammars.done() else None
                if grammar is None:
                    with self._lock:
                        self._waiting[message.sid] = False
                    self._grammars.off_thread(functools.partial(self._compile_then_submit, message))
                    return
            params = message.params if grammar is None else replace(message.params, grammar=grammar)
            with self._lock:
                stream = self.engine.submit(message.prompt_ids, params, message.request_id, message.output_ids,
                                            sink=self._sink)  # fmt: skip
                self._sids[stream] = message.sid
                self._streams[message.sid] = stream
                cancelled = self._waiting.pop(message.sid, False)
            if cancelled:
                stream.cancel()
        except Exception as exc:  # the front checked it as the engine does: a difference, so say it as an error
            log.exception("event=submit_failed id=%s", message.request_id)
            with self._lock:
                self._waiting.pop(message.sid, None)
            self._send(Events([(message.sid, TokenEvent(None, "error", error=f"{type(exc).__name__}: {exc}"))]))

    def _compile_then_submit(self, message: Submit) -> None:
        try:
            assert message.grammar is not None
            grammar = self._grammars.started().result().compile(message.grammar)
        except Exception as exc:
            log.exception("event=submit_failed id=%s", message.request_id)
            with self._lock:
                self._waiting.pop(message.sid, None)
            self._send(Events([(message.sid, TokenEvent(None, "error", error=f"{type(exc).__name__}: {exc}"))]))
            return
        self._submit(message, grammar)

    def _deliver(self, batch: list[tuple[RequestStream, TokenEvent]]) -> None:
        """The engine thread's sink: a step's events, in one message."""
        items: list[tuple[int, TokenEvent | int]] = []
        with self._lock:
            for stream, event in batch:
                sid = self._sids[stream]
                if event.finish_reason is not None:
                    del self._sids[stream], self._streams[sid]
                elif (event.logprobs is None and event.prompt_logprobs is None and event.token_id is not None
                      and not event.cached_tokens):  # fmt: skip
                    items.append((sid, event.token_id))
                    continue
                items.append((sid, event))
            self._send_locked(Events(items))

    def _send(self, message: object) -> None:
        with self._lock:
            self._send_locked(message)

    def _send_locked(self, message: object) -> None:
        with contextlib.suppress(OSError):  # the front is gone: serve_links sees its link close
            send_message(self.sock, encode(message))


def serve_links(links: list[EngineLink], ended: Callable[[EngineLink], bool], every: Callable[[], None],
                interval: float) -> None:  # fmt: skip
    """Handle the fronts' messages on this thread until every link has closed, or until ``ended`` (called as a link
    closes: its front is done) says False (that front did not end cleanly); ``every`` runs about every ``interval``
    seconds."""
    live = {link.sock: link for link in links}
    due = time.monotonic() + interval
    while live:
        for sock in select.select(list(live), [], [], interval)[0]:
            link = live[sock]
            if not link.receive():
                del live[sock]
                if not ended(link):
                    return
        if (now := time.monotonic()) >= due:
            due = now + interval
            every()


def start_front(run: Callable[[socket.socket], int], others: list[socket.socket]) -> tuple[int, socket.socket]:
    """Fork a front process, which runs ``run(its end of the link)`` and exits with what it returns; the worker
    keeps the front's pid and its own end (``others``: its ends of the links of fronts forked before, closed in
    this one). Called before any thread or device exists (a fork copies neither)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    parent = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        theirs.close()
        return pid, _sized(ours)

    def child() -> int:
        ours.close()
        for sock in others:  # so that a front's link ends when the worker's end does
            sock.close()
        die_with_parent()
        if os.getppid() != parent:  # the worker died before the line above
            return 1
        return run(_sized(theirs))

    exit_after(child)


# -- the front's side -------------------------------------------------------------------------------------------------


class RemoteStream(RequestStream):
    """A choice generated in the worker: its events arrive from the link; a cancel goes back through it."""

    def __init__(self, request_id: str, prompt_tokens: int, loop: asyncio.AbstractEventLoop, engine: RemoteEngine,
                 sid: int) -> None:  # fmt: skip
        super().__init__(request_id, prompt_tokens, loop, None, sink=_not_here)
        self._engine = engine
        self.sid = sid

    def cancel(self) -> None:
        if not self.cancelled:
            super().cancel()
            self._engine.cancel(self.sid)


def _not_here(_: list[tuple[RequestStream, TokenEvent]]) -> None:
    raise AssertionError("a remote stream's events come from the link")


class RemoteEngine:
    """The ServingEngine the front's routes use: the worker's engine, over the link."""

    def __init__(self, hello: Hello, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 lost: Callable[[], None]) -> None:  # fmt: skip
        """``lost``: called when the link ends unasked (the worker died); it should end this process at once."""
        self.config = hello.config
        self.max_num_seqs = hello.max_num_seqs
        self.max_model_len = hello.max_model_len
        self.memory = hello.memory
        self.eos_token_ids = hello.eos_token_ids
        self.startup_phases = hello.startup_phases
        self.vocab_size = hello.vocab_size
        self.weight_origin = hello.weight_origin
        self._figures = hello.figures
        self._reader, self._writer = reader, writer
        self._lost = lost
        self._stopping = False
        self._streams: dict[int, RemoteStream] = {}
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._ids = itertools.count()
        self._task: asyncio.Task[None] | None = None
        self.closed = asyncio.Event()  # the link ended: the worker stopped or died

    def start(self, heartbeat: object = None) -> None:
        self._task = asyncio.get_running_loop().create_task(self._read())

    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
               output_ids: list[int] | None = None) -> RequestStream:  # fmt: skip
        """As the engine's own (the same checks, raised here), its events to come from the worker."""
        from engine.grammar import GrammarState
        from engine.sampling_params import check_request

        check_request(prompt_ids, params, self.max_model_len, output_ids)
        if params.grammar is not None and output_ids:
            GrammarState(params.grammar, output_ids)  # a resume that does not follow its grammar: refused here
        sid = next(self._ids)
        stream = RemoteStream(request_id or f"front-{sid}", len(prompt_ids), asyncio.get_running_loop(), self, sid)
        if self.closed.is_set():
            stream._deliver(TokenEvent(None, "abort"))
            return stream
        self._streams[sid] = stream
        spec = None
        if params.grammar is not None:  # the worker compiles its own (dataclasses.replace validates: only here)
            spec, params = params.grammar.spec, replace(params, grammar=None)
        self._write(Submit(sid, stream.request_id, prompt_ids, params, spec, output_ids))
        return stream

    def cancel(self, sid: int) -> None:
        if sid in self._streams:
            self._write(Cancel(sid))

    def activate(self, timeout: float) -> Future[float]:
        result: Future[float] = Future()
        call = asyncio.ensure_future(self._call(lambda c: Activate(c, timeout)))

        def done(task: asyncio.Future[Any]) -> None:
            if task.cancelled():
                result.cancel()
            elif (exc := task.exception()) is not None:
                result.set_exception(exc)
            else:
                result.set_result(task.result())

        call.add_done_callback(done)
        return result

    async def refresh(self) -> None:
        """Fetch the engine's figures (/health reads them)."""
        if not self.closed.is_set():
            self._figures = await self._call(AskFigures)

    def stop(self) -> None:
        """Close the link (the worker then stops its engine); what is unfinished ends with 'abort'."""
        self._stopping = True
        if not self._writer.is_closing():
            self._writer.close()
        self._end_all("abort")

    def device_memory_bytes(self) -> int:
        return self._figures.device_memory_bytes

    def private_memory_bytes(self) -> int:
        return self._figures.private_memory_bytes  # the worker's and every front's

    @property
    def alive(self) -> bool:
        return self._figures.alive and not self.closed.is_set()

    @property
    def num_running(self) -> int:
        return self._figures.running

    @property
    def num_waiting(self) -> int:
        return self._figures.waiting

    @property
    def num_preemptions(self) -> int:
        return self._figures.preemptions

    @property
    def prefix_cache(self) -> tuple[int, int]:
        return self._figures.prefix_cache

    @property
    def kv_blocks_free(self) -> int:
        return self._figures.kv_blocks_free

    @property
    def kv_blocks_total(self) -> int:
        return self._figures.kv_blocks_total

    async def _call(self, message: Callable[[int], object]) -> Any:
        call = next(self._ids)
        future = self._calls[call] = asyncio.get_running_loop().create_future()
        self._write(message(call))
        return await future

    def _write(self, message: object) -> None:
        if not self._writer.is_closing():
            write_message(self._writer, encode(message))

    async def _read(self) -> None:
        try:
            while True:
                message = await read(self._reader)
                if message is None:
                    break
                if isinstance(message, Events):
                    streams = self._streams
                    for sid, item in message.items:
                        stream = streams.get(sid)
                        if stream is None:
                            continue
                        if type(item) is int:
                            stream._deliver(TokenEvent(item))
                            continue
                        assert isinstance(item, TokenEvent)
                        if item.finish_reason is not None:
                            del streams[sid]
                        stream._deliver(item)
                elif isinstance(message, Reply):
                    future = self._calls.pop(message.call, None)
                    if future is not None and not future.done():
                        if message.error is not None:
                            future.set_exception(RuntimeError(message.error))
                        else:
                            future.set_result(message.value)
        finally:
            if not self._stopping:
                # The worker died (a kill -9 closes its end before its death signal reaches this process): its
                # streams must break as they did when one process served, not end with an error, so that the
                # relays resume them on another engine.
                self._lost()
            self.closed.set()
            self._end_all("error", "the engine process exited")

    def _end_all(self, reason: str, error: str | None = None) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream._deliver(TokenEvent(None, reason, error=error))
        calls, self._calls = self._calls, {}
        for future in calls.values():
            if not future.done():
                future.set_exception(RuntimeError("the engine process exited"))


async def read(reader: asyncio.StreamReader) -> Any:
    """The next message on the link, or None once it has closed."""
    try:
        body = await read_message(reader)
    except (ProtocolError, ConnectionError):
        return None
    return None if body is None else decode(body)


def run_front(link: socket.socket, socket_path: Path, listener: socket.socket, board: FrontBoard, index: int,
              tokenizer: ChatTokenizer, heartbeat_path: Path | None, drain_timeout: float,
              started: float) -> int:  # fmt: skip
    """A front process: wait for the worker's engine, then serve the engine API on ``listener`` (the socket at
    ``socket_path``, which the worker binds once its engine is ready and every front accepts on) until drained;
    ``board``: what the worker's fronts share, slot ``index`` this one's."""
    import uvloop

    from common.proctitle import set_title

    name = socket_path.stem.removeprefix("engine-")
    set_title(f"engine-front {name} starting {socket_path.parent}")
    board.index = index
    # The worker passes its signals on. One that comes while this process starts is acted on once it serves (a drain
    # of nothing, then a clean exit), as the worker does with one that comes while it loads.
    stop_requested: list[str] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: stop_requested.append(signal.Signals(signum).name))
    return uvloop.run(_front(link, socket_path, listener, board, tokenizer, heartbeat_path, drain_timeout, started,
                             stop_requested))  # fmt: skip


async def _front(link: socket.socket, socket_path: Path, listener: socket.socket, board: FrontBoard,
                 tokenizer: ChatTokenizer, heartbeat_path: Path | None, drain_timeout: float, started: float,
                 stop_requested: list[str]) -> int:  # fmt: skip
    from common.heartbeat import Heartbeat
    from engine import worker
    from engine.server import create_app

    link.setblocking(False)
    reader, writer = await asyncio.open_unix_connection(sock=link, limit=BUFFER_BYTES)
    hello = await read(reader)
    if not isinstance(hello, Hello):  # the worker failed to start (and says why in the log)
        return 1
    engine = RemoteEngine(hello, reader, writer, lambda: os._exit(1))
    engine.start()
    app = create_app(engine, tokenizer, board)
    listener.setblocking(False)
    try:
        t = time.perf_counter()
        await worker.warm_up(app)
        engine.startup_phases["server_warmup"] = time.perf_counter() - t
        events.log_event(log, "startup", phase="server_warmup", seconds=engine.startup_phases["server_warmup"])
        t = time.perf_counter()
        gc.collect()
        gc.freeze()  # as the worker does: start-up's objects out of the collector's generations
        engine.startup_phases["gc"] = time.perf_counter() - t
        events.log_event(log, "ready", socket=socket_path, seconds=time.perf_counter() - started,
                         front_pid=os.getpid(), **engine.startup_phases)  # fmt: skip
        heartbeat = Heartbeat(heartbeat_path) if heartbeat_path is not None else None
        await worker.serve(app, engine, listener, drain_timeout, stop_requested, heartbeat, socket_path,
                           "engine-front", engine.closed)  # fmt: skip
    finally:
        listener.close()
        socket_path.unlink(missing_ok=True)  # the engine takes no new connection (the others drain, or die with it)
    return 0
