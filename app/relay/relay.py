"""One client request across as many engines as it takes: admission, the engine's stream passed through,
and resumption when an engine fails.

A request waits for a slot at the active engine (app/relay/admission.py), is sent there, and its events are
passed to the client as they come. If the engine fails (its socket errors, the stream is cut, or it ends
the request with ``engine_stopped``), the relay tells the supervisor, waits briefly for the table to move
to another engine, and sends the request there with what the client already has (app/relay/inflight.py),
at most ``request_resumes`` times; after that a stream ends with an error event in the OpenAI shape and
``[DONE]``, never a hang. An engine that answers 503 because it began draining did not fail, nor did one
that was gone before the request reached it (nothing accepts on its socket): the request goes to the next
engine without using up a resume, waiting for one at most ``queue_timeout``.

Each attempt ends in a value (``Streamed``, ``Answered``, ``Failed``); what the client gets follows from
it in one place (``Relay.serve``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from app.control import EngineRoute, RelaySettings
from app.metrics import RelayMetrics
from app.relay.admission import RETRY_AFTER_S, Admission, Refusal
from app.relay.inflight import EngineStopped, InFlight, error_event
from app.relay.table import TableView
from app.relay.upstream import EngineConnection, EngineGone, EnginePool, EngineUnreachable, StreamCut, request_head
from common.events import log_event
from engine.internal_stream import RESUMABLE_HEADER
from engine.protocol import ErrorInfo, ErrorResponse

log = logging.getLogger("warmgate.relay")

_RESUMABLE = f"{RESUMABLE_HEADER}: 1\r\n".encode()
_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
_JSON = [(b"content-type", b"application/json")]
MOVE_WAIT_S = 1.0  # how long a failed or draining engine's request waits for the table to move on


@dataclass(frozen=True)
class Streamed:
    """The engine's answer reached its end ([DONE])."""


@dataclass(frozen=True)
class Answered:
    """The engine answered without a stream (an error for a bad request, say): the client gets it as it is."""

    status: int
    body: bytes
    content_type: bytes


@dataclass(frozen=True)
class Failed:
    """The engine failed the request before it ended. ``draining``: it refused it because it is draining;
    ``reached``: false when nothing reached the engine (it was gone before the request was sent)."""

    why: str
    draining: bool = False
    reached: bool = True


Outcome = Streamed | Answered | Failed
Send = Callable[[dict[str, Any]], Awaitable[None]]


class ResponseSink:
    """The client's side of one ASGI exchange: a whole response, or a stream begun once and written to."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.status = 0  # what the client was answered (0: nothing yet)
        self.complete = False  # the response's last message is sent (or being sent)
        self.client_left = False

    @property
    def begun(self) -> bool:
        return self.status != 0

    async def respond(self, status: int, body: bytes, headers: Iterable[tuple[bytes, bytes]] = _JSON) -> None:
        self.status, self.complete = status, True
        head = [*headers, (b"content-length", str(len(body)).encode())]
        await self._send({"type": "http.response.start", "status": status, "headers": head})
        await self._send({"type": "http.response.body", "body": body})

    async def error(self, status: int, message: str, kind: str, code: str | None = None, param: str | None = None,
                    headers: Iterable[tuple[bytes, bytes]] = ()) -> None:  # fmt: skip
        body = ErrorResponse(error=ErrorInfo(message=message, type=kind, code=code, param=param)).model_dump_json()
        await self.respond(status, body.encode(), [*_JSON, *headers])

    async def begin_stream(self) -> None:
        self.status = 200
        await self._send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})

    async def write(self, data: bytes) -> None:
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def end_stream(self) -> None:
        self.complete = True
        await self._send({"type": "http.response.body", "body": b""})


class Relay:
    def __init__(self, table: TableView, admission: Admission, pool: EnginePool, metrics: RelayMetrics,
                 report_failure: Callable[[int, str], None]) -> None:  # fmt: skip
        self.table = table
        self.admission = admission
        self.pool = pool
        self.metrics = metrics
        self.report_failure = report_failure  # tells the supervisor (engine id, why)

    async def serve(self, request: InFlight, sink: ResponseSink) -> None:
        """What the client gets, across as many engines as it takes."""
        settings = self.table.settings
        deadline = time.monotonic() + settings.queue_timeout
        try:
            await self._serve(request, sink, settings, deadline)
        except asyncio.CancelledError:
            sink.client_left = True
            raise
        finally:
            self._count(request, sink)

    async def _serve(self, request: InFlight, sink: ResponseSink, settings: RelaySettings, deadline: float) -> None:
        while True:
            slot = await self.admission.acquire(deadline)
            if isinstance(slot, Refusal):
                await self._unavailable(request, sink, slot.why)
                return
            self.metrics.in_flight.inc()
            try:
                outcome = await self._attempt(slot.engine, request, sink)
            finally:
                self.metrics.in_flight.dec()
                self.admission.release(slot)
            if isinstance(outcome, Streamed):
                await self._finished(request, sink)
                return
            if isinstance(outcome, Answered):
                await self._answered(request, sink, outcome)
                return
            if request.finish_seen:  # the last token was relayed: only the ending was lost
                if request.streams:
                    await sink.write(request.ending())
                    await sink.end_stream()
                else:
                    await self._finished(request, sink)
                return
            if not outcome.reached:
                self.report_failure(slot.engine.id, outcome.why)
            if outcome.draining or not outcome.reached:
                # Nothing of the request was lost there: the next engine takes it, no resume used. (A request
                # that meets a dead engine until the supervisor moves the table on must not use up its resumes:
                # on a busy machine that takes seconds.)
                if time.monotonic() > deadline:
                    why = "the engines kept draining" if outcome.draining else f"no engine answered ({outcome.why})"
                    await self._unavailable(request, sink, f"{why} for {settings.queue_timeout:.0f}s (queue_timeout)")
                    return
                await self.table.moved_past(slot.engine.id, MOVE_WAIT_S)
                continue
            self.report_failure(slot.engine.id, outcome.why)
            if request.resumes >= settings.request_resumes:
                self.metrics.resume_failures.inc()
                why = (f"the engine serving this request failed ({outcome.why}) after it had been resumed "
                       f"{request.resumes} times, the limit (restart.request_resumes)")  # fmt: skip
                await self._unavailable(request, sink, why, retry=False)
                return
            request.resumes += 1
            self.metrics.resumes.inc()
            log_event(log, "resume", route=request.route, id=request.id, resumes=request.resumes,
                      tokens=request.generated(), why=outcome.why)  # fmt: skip
            await self.table.moved_past(slot.engine.id, MOVE_WAIT_S)
            deadline = time.monotonic() + settings.queue_timeout

    async def _attempt(self, engine: EngineRoute, request: InFlight, sink: ResponseSink) -> Outcome:
        """The request on one engine, its events passed to the client as they come."""
        head = request_head("POST", request.route, request.body(), _RESUMABLE)
        connection: EngineConnection | None
        try:
            connection = await self.pool.send(engine.socket, head)
        except EngineGone as exc:
            return Failed(str(exc), reached=False)
        except EngineUnreachable as exc:
            return Failed(str(exc))
        try:
            if not connection.content_type.startswith(b"text/event-stream"):
                body = await connection.read_all()
                if connection.status == 503 and b'"draining"' in body:  # it began draining after we picked it
                    return Failed("draining", draining=True)
                return Answered(connection.status, body, connection.content_type)
            rest = b""
            while data := await connection.read():
                events = (rest + data if rest else data).split(b"\n\n")
                rest = events.pop()
                try:
                    out = request.take(events)
                except EngineStopped as exc:
                    return Failed(str(exc))
                if out:
                    if not sink.begun:
                        await sink.begin_stream()
                    await sink.write(out)
                if request.done:
                    # The engine's response ends right after [DONE]; the client does not wait for that end (on two
                    # busy cores it came milliseconds later): it is read in the background, and the connection kept.
                    self.pool.settle(engine.socket, connection)
                    connection = None
                    return Streamed()
            return Failed("the stream ended before [DONE]")
        except StreamCut as exc:
            return Failed(str(exc))
        finally:
            if connection is not None:
                self.pool.release(engine.socket, connection)

    async def _finished(self, request: InFlight, sink: ResponseSink) -> None:
        if request.streams:
            await sink.end_stream()
            return
        status, body = request.response()
        await sink.respond(status, json.dumps(body).encode())

    async def _answered(self, request: InFlight, sink: ResponseSink, answer: Answered) -> None:
        if not sink.begun and not request.started:
            await sink.respond(answer.status, answer.body, [(b"content-type", answer.content_type)])
            return
        # The engine refused the resumed request: the client's stream has begun, so say what it answered.
        why = f"the engine refused to resume this request: {answer.body[:300]!r}"
        log_event(log, "stream_failed", route=request.route, id=request.id, resumes=request.resumes, error=why)
        await self._end_with(request, sink, why)

    async def _unavailable(self, request: InFlight, sink: ResponseSink, why: str, retry: bool = True) -> None:
        """No engine can take the request (queue full, none in time, or its engines kept failing)."""
        if not sink.begun and not request.started:
            headers = [(b"retry-after", str(RETRY_AFTER_S).encode())] if retry else []
            await sink.error(503, why, "service_unavailable", headers=headers)
            return
        log_event(log, "stream_failed", route=request.route, id=request.id, resumes=request.resumes, error=why)
        await self._end_with(request, sink, why)

    async def _end_with(self, request: InFlight, sink: ResponseSink, why: str) -> None:
        """End a request that began: a stream with an error event and [DONE]; a whole response with a 503."""
        if request.streams:
            if not sink.begun:
                await sink.begin_stream()
            await sink.write(error_event(why))
            await sink.end_stream()
        else:
            await sink.error(503, why, "service_unavailable", code="engine_failed")

    def _count(self, request: InFlight, sink: ResponseSink) -> None:
        """A request that ended: its status (499: the client left first), latency, TTFT and tokens."""
        metrics = self.metrics
        status = 499 if sink.client_left or not sink.status else sink.status
        metrics.requests.labels(request.route, str(status)).inc()
        metrics.latency.labels(request.route).observe(time.perf_counter() - request.arrived)
        if request.first_token_at is not None:
            metrics.ttft.labels(request.route).observe(request.first_token_at - request.arrived)
        if request.prompt_ids is not None:
            metrics.prompt_tokens.inc(len(request.prompt_ids))
        generated = request.generated()
        if generated:
            metrics.generation_tokens.inc(generated)
