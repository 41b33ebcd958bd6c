"""A stub engine for gateway benchmarks: the engine worker's HTTP API on a Unix socket, tokens without a model.

    .venv/bin/python bench/stub_engine.py --socket /tmp/stub.sock [--step-ms 0] [--sndbuf 4096]

It speaks what the gateway expects of an engine (engine/server.py at 9562034, engine/protocol.py):
``POST /v1/completions`` streamed with the ``x-warmgate-resumable`` header answers the internal stream,
an opening ``: warmgate {"prompt_ids":...}`` comment, then per token a CompletionChunk data line followed by
its ``: warmgate {"ids":[..],"chars":..}`` note, a usage chunk when asked, ``data: [DONE]``; without the
header, the plain OpenAI stream; without ``stream``, one CompletionResponse. ``GET /health``, ``POST /drain``,
``GET /v1/models`` as an engine answers them, and ``GET /stub/stats`` (counters for the benchmark).

Tokens come in steps, as from a real engine: one loop appends one token event to every active stream per
step and writes it as its own HTTP chunk (what uvicorn does for each event a generator yields), then yields
to the event loop (``--step-ms 0``: as fast as it can) or sleeps out the step. ``max_tokens`` is the number
of tokens a request streams. A stream whose connection is not draining (the reader is behind) skips the
step instead of queueing: the token comes a step later, never coalesced with the next one.

How far the stub runs ahead of a slow reader decides how many events the reader gets per read, and that
weighs as much as the reader's code: each connection's SO_SNDBUF is set small (``--sndbuf``, 4096: a few
events in flight). With the kernel's default (``--sndbuf 0``) a whole 64-token response fits in the socket,
and today's gateway measured 48 us/token at 100 streams where it measured 62-78 with 4096, and 150-200 when
paced so that it kept up (``--step-ms 25``, one event per read). Compare designs at the same settings.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import httptools
import uvloop

from engine.internal_stream import COMMENT_BYTES, DONE_BYTES

MODEL = "stub"
TOKEN = " tok"  # every token's text: 4 characters, no JSON escaping needed
TOKEN_BYTES = TOKEN.encode()
PROMPT_IDS = [1, 2, 3]
FIRST_ID = 1000  # token ids are FIRST_ID + position
INTERNAL = COMMENT_BYTES
SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
LAST_CHUNK = b"0\r\n\r\n"


def chunk(data: bytes) -> bytes:
    """One HTTP/1.1 chunk."""
    return b"%x\r\n%b\r\n" % (len(data), data)


class Tails:
    """The part of each token event after its text, which depends only on the position: encoded once."""

    def __init__(self) -> None:
        self._internal: dict[tuple[int, bool], bytes] = {}
        self._plain = {
            False: b'","finish_reason":null,"logprobs":null}]}\n\n',
            True: b'","finish_reason":"length","logprobs":null}]}\n\n',
        }

    def get(self, position: int, last: bool, internal: bool) -> bytes:
        if not internal:
            return self._plain[last]
        key = (position, last)
        tail = self._internal.get(key)
        if tail is None:
            finish = b'"length"' if last else b"null"
            note = b'{"ids":[%d],"chars":%d%b}' % (FIRST_ID + position, len(TOKEN) * (position + 1),
                                                   b',"finish":"length"' if last else b"")  # fmt: skip
            tail = b'","finish_reason":%b,"logprobs":null}]}\n%b%b\n\n' % (finish, INTERNAL, note)
            self._internal[key] = tail
        return tail


TAILS = Tails()


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    keep_alive: bool


@dataclass(eq=False)
class Stream:
    """A streamed completion in flight: the step loop writes its next token until it has sent ``total``."""

    conn: Connection
    head: bytes  # the token event up to its text: id, created and model fixed per request
    rid: str
    created: int
    total: int
    usage: bool
    internal: bool
    sent: int = 0

    def step(self) -> bool:
        """Write the next token's event (and the stream's end after the last one); True once it is done."""
        last = self.sent + 1 == self.total
        conn = self.conn
        conn.write(chunk(b"%b%b%b" % (self.head, TOKEN_BYTES, TAILS.get(self.sent, last, self.internal))))
        self.sent += 1
        if not last:
            return False
        if self.usage:
            usage = {"prompt_tokens": len(PROMPT_IDS), "completion_tokens": self.total,
                     "total_tokens": len(PROMPT_IDS) + self.total}  # fmt: skip
            body = {"id": self.rid, "object": "text_completion", "created": self.created, "model": MODEL,
                    "choices": [], "usage": usage}  # fmt: skip
            conn.write(chunk(b"data: %b\n\n" % json.dumps(body, separators=(",", ":")).encode()))
        conn.write(chunk(DONE_BYTES))
        conn.write(LAST_CHUNK)
        conn.response_done()
        return True


class Stub:
    """The engine: connections, the step loop and the counters /stub/stats reports."""

    def __init__(self, step_s: float, sndbuf: int) -> None:
        self.step_s = step_s
        self.sndbuf = sndbuf
        self.active: list[Stream] = []
        self.wake = asyncio.Event()  # a new stream, or a stalled connection drained
        self.draining = False
        self.drained = asyncio.Event()
        self.ids = 0
        self.stats = {"steps": 0, "events": 0, "skipped": 0, "requests": 0, "connections": 0, "errors": 0,
                      "cancelled": 0}  # fmt: skip
        self.started = time.time()

    async def run(self) -> None:
        """The step loop: one token to every stream whose connection can take it, per step."""
        while True:
            if not self.active:
                self.drained.set()
                self.wake.clear()
                await self.wake.wait()
                continue
            t0 = time.monotonic()
            still: list[Stream] = []
            wrote = skipped = 0
            for stream in self.active:
                conn = stream.conn
                if conn.closed:  # the reader went away mid-stream: the request is cancelled
                    self.stats["cancelled"] += 1
                    continue
                if conn.paused:
                    skipped += 1
                    still.append(stream)
                    continue
                wrote += 1
                if not stream.step():
                    still.append(stream)
            self.stats["steps"] += 1
            self.stats["events"] += wrote
            self.stats["skipped"] += skipped
            self.active = still
            if wrote == 0 and still:  # every reader is behind: sleep until one drains instead of spinning
                self.wake.clear()
                await self.wake.wait()
            elif self.step_s > 0:
                await asyncio.sleep(max(0.0, self.step_s - (time.monotonic() - t0)))
            else:
                await asyncio.sleep(0)

    def handle(self, conn: Connection, request: Request) -> None:
        """Answer one request on ``conn``; a stream is answered over the next steps."""
        self.stats["requests"] += 1
        route = (request.method, request.path.split("?", 1)[0])
        if route == ("POST", "/v1/completions"):
            self.completion(conn, request)
        elif route == ("GET", "/health"):
            conn.respond_json(503 if self.draining else 200, self.health())
        elif route == ("POST", "/drain"):
            asyncio.get_running_loop().create_task(self.drain(conn, request))
        elif route == ("GET", "/v1/models"):
            card = {"id": MODEL, "object": "model", "created": int(self.started), "owned_by": "warmgate",
                    "root": None, "max_model_len": 4096}  # fmt: skip
            conn.respond_json(200, {"object": "list", "data": [card]})
        elif route == ("GET", "/stub/stats"):
            conn.respond_json(200, {**self.stats, "active": len(self.active), "pid": os.getpid()})
        else:
            conn.respond_error(404, f"no route {request.method} {request.path}", "invalid_request_error")

    def completion(self, conn: Connection, request: Request) -> None:
        if self.draining:
            conn.respond_error(503, "the engine is draining and accepts no new requests", "service_unavailable",
                               "draining")  # fmt: skip
            return
        try:
            body = json.loads(request.body)
            total = int(body.get("max_tokens") or 16)
            streams = bool(body.get("stream"))
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
        except (ValueError, TypeError, AttributeError) as exc:
            conn.respond_error(400, f"invalid request: {exc}", "invalid_request_error")
            return
        if total < 1:
            conn.respond_error(400, "max_tokens must be at least 1", "invalid_request_error", param="max_tokens")
            return
        self.ids += 1
        rid, created = f"cmpl-stub{os.getpid()}x{self.ids}", int(time.time())
        if not streams:
            choice = {"index": 0, "text": TOKEN * total, "finish_reason": "length", "logprobs": None}
            usage_body = {"prompt_tokens": len(PROMPT_IDS), "completion_tokens": total,
                          "total_tokens": len(PROMPT_IDS) + total}  # fmt: skip
            conn.respond_json(200, {"id": rid, "object": "text_completion", "created": created, "model": MODEL,
                                    "choices": [choice], "usage": usage_body})  # fmt: skip
            return
        internal = request.headers.get("x-warmgate-resumable") == "1"
        head = b'data: {"id":"%s","object":"text_completion","created":%d,"model":"%s","choices":[{"index":0,' % (
            rid.encode(), created, MODEL.encode()) + b'"text":"'  # fmt: skip
        opening = b""
        if internal:
            note = {"prompt_ids": PROMPT_IDS, "id": rid, "created": created, "model": MODEL}
            opening = chunk(INTERNAL + json.dumps(note, separators=(",", ":")).encode() + b"\n\n")
        conn.write(SSE_HEAD + conn.connection_header() + b"\r\n" + opening)
        self.active.append(Stream(conn, head, rid, created, total, usage, internal))
        self.wake.set()

    def health(self) -> dict[str, Any]:
        weights: dict[str, Any] = {"source": "disk", "key": None, "lease": None, "fallbacks": 0,
                                   "fallback_reason": None, "attach_phases": {}}  # fmt: skip
        return {"status": "draining" if self.draining else "ok", "running": len(self.active), "waiting": 0,
                "in_flight": len(self.active), "preemptions": 0, "kv_blocks_free": 1024, "kv_blocks_total": 1024,
                "device_memory_bytes": 0, "private_memory_bytes": 0, "weights": weights,
                "startup_phases": {"weight_load": 0.0, "model_init": 0.0, "warmup": 0.0}}  # fmt: skip

    async def drain(self, conn: Connection, request: Request) -> None:
        try:
            timeout = (json.loads(request.body) if request.body else {}).get("timeout")
        except ValueError:
            timeout = None
        self.draining = True
        at_start = len(self.active)
        t0 = time.monotonic()
        self.drained.clear()
        self.wake.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.drained.wait(), timeout)
        conn.respond_json(200, {"drained": not self.active, "in_flight_at_start": at_start,
                                "remaining": len(self.active), "seconds": time.monotonic() - t0})  # fmt: skip


class Connection(asyncio.Protocol):
    """One HTTP/1.1 connection: httptools parses, requests are answered in order (keep-alive)."""

    def __init__(self, stub: Stub) -> None:
        self.stub = stub
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.paused = False
        self.closed = False
        self.busy = False  # a response is being written: a pipelined request waits for it
        self.pending: deque[Request] = deque()
        self.keep_alive = True
        self._url = b""
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []

    # -- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's
        transport = self.transport
        self.stub.stats["connections"] += 1
        sock = transport.get_extra_info("socket")
        if sock is not None and self.stub.sndbuf > 0:
            # A small kernel buffer keeps the stub only a few events ahead of a slow reader, as an engine
            # is when its output is read as it comes: otherwise a whole stream would sit in the socket and
            # the reader would get it in one read.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.stub.sndbuf)
        transport.set_write_buffer_limits(high=0)  # pause as soon as the kernel takes no more

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.stub.stats["errors"] += 1
            self.keep_alive = False
            self.respond_error(400, f"bad request: {exc}", "invalid_request_error")

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.paused:
            self.paused = False
            self.stub.wake.set()

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        self.stub.wake.set()

    # -- httptools callbacks ------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url, self._headers, self._body = b"", {}, []

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        method = self.parser.get_method().decode()
        request = Request(method, self._url.decode("latin-1"), self._headers, b"".join(self._body),
                          self.parser.should_keep_alive())  # fmt: skip
        if self.busy:
            self.pending.append(request)
        else:
            self.start(request)

    # -- responses ----------------------------------------------------------------------------

    def start(self, request: Request) -> None:
        self.busy = True
        self.keep_alive = self.keep_alive and request.keep_alive
        self.stub.handle(self, request)

    def write(self, data: bytes) -> None:
        if not self.closed and self.transport is not None:
            self.transport.write(data)

    def connection_header(self) -> bytes:
        return b"" if self.keep_alive else b"connection: close\r\n"

    def response_done(self) -> None:
        self.busy = False
        if not self.keep_alive:
            if self.transport is not None:
                self.transport.close()
            self.closed = True
            return
        if self.pending:
            self.start(self.pending.popleft())

    def respond_json(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body, separators=(",", ":")).encode()
        reason = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 503: b"Service Unavailable"}.get(status, b"")
        self.write(b"HTTP/1.1 %d %b\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%b\r\n%b" % (
            status, reason, len(data), self.connection_header(), data))  # fmt: skip
        self.response_done()

    def respond_error(self, status: int, message: str, kind: str, code: str | None = None,
                      param: str | None = None) -> None:  # fmt: skip
        self.respond_json(status, {"error": {"message": message, "type": kind, "param": param, "code": code}})


async def serve(path: Path, step_s: float, sndbuf: int) -> None:
    stub = Stub(step_s, sndbuf)
    path.unlink(missing_ok=True)
    loop = asyncio.get_running_loop()
    server = await loop.create_unix_server(lambda: Connection(stub), str(path), backlog=4096)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    steps = loop.create_task(stub.run())
    try:
        await stop.wait()
    finally:
        steps.cancel()
        server.close()
        path.unlink(missing_ok=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--socket", type=Path, required=True)
    parser.add_argument("--step-ms", type=float, default=0.0, help="time per step; 0: as fast as it can")
    parser.add_argument("--sndbuf", type=int, default=4096,
                        help="SO_SNDBUF of each connection (0: the kernel's default)")  # fmt: skip
    args = parser.parse_args()
    uvloop.run(serve(args.socket, args.step_ms / 1e3, args.sndbuf))


if __name__ == "__main__":
    main()
