"""A submitted request as the HTTP server sees it: an async stream of TokenEvents, fed from an engine thread.

Every backend's engine hands its server RequestStreams: the engine's own thread (EngineThread) pushes each
step's events into an Outbox, which wakes each event loop once per step, not once per token. After each step
the thread also writes its scheduler's figures into the heartbeat file (common/heartbeat.py), where the
relays' /metrics reads them.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from common.heartbeat import BEAT_INTERVAL, ENGINE_THREAD, Heartbeat
from common.processes import private_memory
from common.proctitle import ENGINE_THREAD_NAME, set_thread_title

log = logging.getLogger("warmgate.engine")
Item = TypeVar("Item")  # what a backend queues for its thread (a native Sequence, a vLLM request)


@dataclass(frozen=True)
class TokenLogprobs:
    """A sampled token's log-probability and the most likely alternatives, (id, logprob) best first, in the
    distribution it was drawn from: the logits after penalties, temperature, top-k and top-p, as vLLM's
    ``processed_logprobs`` (a greedy request's is the plain softmax)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class TokenEvent:
    """One step of a request: a new token, and/or the reason it finished."""

    token_id: int | None  # None only on a final event that carries no token (abort, error)
    finish_reason: str | None = None  # "stop" (eos / stop token), "length", "abort", "error"
    error: str | None = None
    logprobs: TokenLogprobs | None = None  # when the request asked for them
    # On a request's first event, when it asked for them: each prompt token's (None for the first, which nothing
    # predicts), in the plain softmax of the logits.
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None
    # On a request's first event: its prompt's tokens that the prefix cache held when it was admitted.
    cached_tokens: int = 0


# Where a step's events of some streams go, in one call from the engine thread: an event loop's (``Outbox.sink``),
# or the link to the engine's front process (engine/front.py).
Sink = Callable[[list[tuple["RequestStream", "TokenEvent"]]], None]


class RequestStream:
    """A submitted request; iterate it (async) to receive its TokenEvents until one has finish_reason.

    ``sink``: where the engine thread hands its events; by default ``loop``'s, the loop that iterates the stream (a
    stream with another sink is not iterated in this process)."""

    def __init__(self, request_id: str, prompt_tokens: int, loop: asyncio.AbstractEventLoop | None,
                 outbox: Outbox | None, sink: Sink | None = None) -> None:  # fmt: skip
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.loop = loop
        if sink is None:
            assert outbox is not None, "a stream's events go to its outbox's sink for its loop, or to its own sink"
            sink = outbox.sink(loop)
        self.sink = sink
        # Delivered, not yet read; and the reader's future while it waits. Lighter than an asyncio.Queue, which
        # this was (a queue's put and get cost more than the rest of a token's way through the loop).
        self._events: collections.deque[TokenEvent] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._outbox = outbox
        self.cancelled = False

    def push(self, event: TokenEvent) -> None:
        """Called from the engine thread: delivered with the rest of the step's events."""
        assert self._outbox is not None
        self._outbox.add(self, event)

    def cancel(self) -> None:
        """Stop generating (client went away, stop string hit); the stream ends with 'abort'."""
        self.cancelled = True

    async def __aiter__(self) -> AsyncIterator[TokenEvent]:
        events = self._events
        loop = self.loop
        assert loop is not None, "a stream delivered elsewhere is not iterated here"
        while True:
            while not events:
                self._waiter = loop.create_future()
                await self._waiter
            event = events.popleft()
            yield event
            if event.finish_reason is not None:
                return

    def _deliver(self, event: TokenEvent) -> None:
        """On the loop: the event is there to read; a reader waiting for it wakes up."""
        self._events.append(event)
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class Outbox:
    """Token events of one step, handed to each event loop in one call (not one wake-up per token)."""

    def __init__(self) -> None:
        self._events: list[tuple[RequestStream, TokenEvent]] = []
        self._sinks: dict[asyncio.AbstractEventLoop | None, Sink] = {}

    def sink(self, loop: asyncio.AbstractEventLoop | None) -> Sink:
        """The sink of streams iterated on ``loop`` (one per loop: a step's events reach each loop in one call)."""
        sink = self._sinks.get(loop)
        if sink is None:
            if loop is None:
                raise ValueError("a stream needs the loop that iterates it, or a sink")
            wake = loop.call_soon_threadsafe

            def sink(events: list[tuple[RequestStream, TokenEvent]]) -> None:
                wake(_deliver, events)

            self._sinks[loop] = sink
        return sink

    def add(self, stream: RequestStream, event: TokenEvent) -> None:
        self._events.append((stream, event))

    def flush(self) -> None:
        if not self._events:
            return
        by_sink: dict[Sink, list[tuple[RequestStream, TokenEvent]]] = {}
        for stream, event in self._events:
            by_sink.setdefault(stream.sink, []).append((stream, event))
        self._events = []
        for sink, events in by_sink.items():
            sink(events)


def _deliver(events: list[tuple[RequestStream, TokenEvent]]) -> None:
    for stream, event in events:
        stream._deliver(event)


class EngineThread(Generic[Item]):
    """The thread that steps a backend's engine: ``_enqueue`` (from the loop) hands it submitted requests,
    and each step's events go back through one Outbox flush. Subclasses say what a step is (``_work``),
    when there is nothing to do (``_idle``), and how requests end on failure (``_fail``) or stop (``_abort_all``).
    """

    def __init__(self) -> None:
        self._outbox = Outbox()
        self._inbox: list[Item] = []
        self._wake = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._heartbeat: Heartbeat | None = None

    def start(self, heartbeat: Heartbeat | None = None) -> None:
        """Start stepping; ``heartbeat`` is stamped on every step, and while idle at least every BEAT_INTERVAL, and
        carries the scheduler's figures after every step."""
        self._heartbeat = heartbeat
        if heartbeat is not None:
            heartbeat.describe(*self._description())
        self._publish()
        self._thread = threading.Thread(target=self._loop, name=f"warmgate-{type(self).__name__}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop stepping; unfinished requests end with finish_reason 'abort'."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()
        self._abort_all()
        self._outbox.flush()
        self._inbox.clear()

    @property
    def alive(self) -> bool:
        """The thread is running and accepting work."""
        return self._running_thread() and not self._stopping

    def _running_thread(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _enqueue(self, item: Item) -> None:
        with self._wake:
            self._inbox.append(item)
            self._wake.notify()

    def _loop(self) -> None:
        set_thread_title(ENGINE_THREAD_NAME)
        beat = self._heartbeat.beat if self._heartbeat is not None else lambda _slot: None
        while True:
            beat(ENGINE_THREAD)
            with self._wake:
                while not self._stopping and not self._inbox and self._idle():
                    if not self._wake.wait(BEAT_INTERVAL):
                        beat(ENGINE_THREAD)
                if self._stopping:
                    return
                pending, self._inbox = self._inbox, []
            try:
                self._work(pending)
                hand_over_later = self._steps_on()
            except Exception as exc:  # a failed step fails its requests, not the engine
                log.exception("event=step_failed")
                self._fail(f"{type(exc).__name__}: {exc}")
                hand_over_later = False
            self._publish()
            if not hand_over_later:
                self._outbox.flush()

    def private_memory_bytes(self) -> int:
        """RssAnon of this process, which serves the engine."""
        return private_memory()

    async def refresh(self) -> None:
        """Bring the figures /health reads up to date: an engine in this process reads its own, so nothing to do."""

    def _publish(self) -> None:
        """Write the scheduler's figures into the heartbeat file: after every step, and where a backend can, as soon
        as a step is scheduled (a long step would otherwise show the one before it)."""
        if self._heartbeat is not None:
            self._heartbeat.publish(*self._load())

    def _idle(self) -> bool:
        raise NotImplementedError

    def _steps_on(self) -> bool:
        """Another step follows at once, and it hands this step's events over (``_outbox.flush()``) itself, once
        its own work is on the device: the loop thread then turns them into chunks while the device computes,
        instead of holding the GIL the next step's scheduling needs. False: they are handed over now."""
        return False

    def _work(self, pending: list[Item]) -> None:
        """Take in ``pending`` (submitted since the last step), then run one step."""
        raise NotImplementedError

    def _fail(self, error: str) -> None:
        """A step raised: end the requests it was working on with finish_reason 'error'."""
        raise NotImplementedError

    def _abort_all(self) -> None:
        """After the thread stopped: end every request still queued or running with 'abort'."""
        raise NotImplementedError

    def _description(self) -> tuple[str, int, int]:
        """What its load figures are about: the served model's name, the KV block size, the usable KV blocks."""
        raise NotImplementedError

    def _load(self) -> tuple[int, int, int, int, int]:
        """The scheduler's figures now: sequences running, requests waiting, KV blocks in use; and the prefix
        cache's queries and hits (tokens) since the engine started."""
        raise NotImplementedError
