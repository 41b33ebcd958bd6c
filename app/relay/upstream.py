"""HTTP/1.1 to an engine's Unix socket, as lean as the relay's hot path needs: an asyncio protocol around
httptools' response parser (the parser uvicorn's httptools mode uses), connections kept alive and reused.

A relay passes every token of every stream through here. httpx costs a request object, a pool and
several layers of async iterators per chunk; here a chunk from the engine is one parser callback that
appends bytes to a list, and a reader takes everything that arrived since its last read in one call.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import defaultdict

import httptools

HIGH_WATER = 256 * 1024  # bytes held for a slow client before the engine's connection stops being read
IDLE_SECONDS = 20.0  # a kept-alive connection unused this long is closed (the engine's own limit is longer)
MAX_IDLE = 64  # kept-alive connections per engine
SETTLE_S = 1.0  # for the end of a response whose content was all read (a connection not ended by then is closed)


class EngineUnreachable(Exception):
    """The exchange failed before any response arrived (no engine on the socket, or it closed the connection)."""


class EngineGone(EngineUnreachable):
    """Nothing accepts connections on the engine's socket (it died, or was retired): the request did not reach it."""


class StreamCut(Exception):
    """The engine's connection closed in the middle of a response."""


class EngineConnection(asyncio.Protocol):
    """One connection to an engine; one exchange (request, response) at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._chunks: list[bytes] = []
        self._held = 0
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False
        self._headers_done = False
        self._complete = False
        self.status = 0
        self.content_type = b""
        self.used = 0  # exchanges begun on this connection
        self.idle_since = 0.0

    # -- asyncio and httptools callbacks ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._wake()

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"content-type":
            self.content_type = value

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self._headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._held += len(body)
        if self._held > HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self._complete = True
        self._wake()

    # -- the exchange -----------------------------------------------------------------------------------

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def exchange(self, request: bytes) -> None:
        """Send a whole request and wait for the response's head (status, content type)."""
        assert self.transport is not None
        self.used += 1
        self._chunks, self._held, self._headers_done, self._complete = [], 0, False, False
        self.status, self.content_type = 0, b""
        self.transport.write(request)
        while not self._headers_done:
            if self._closed:
                raise EngineUnreachable("the engine closed the connection before answering")
            await self._wait()

    async def read(self) -> bytes:
        """The body bytes that arrived since the last read (waiting for some); b"" once the response is complete.

        Raises StreamCut if the connection closes first."""
        while not self._chunks:
            if self._complete:
                return b""
            if self._closed:
                raise StreamCut("the engine's connection closed in the middle of the response")
            await self._wait()
        data = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks, self._held = [], 0
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return data

    async def read_all(self) -> bytes:
        parts = []
        while data := await self.read():
            parts.append(data)
        return b"".join(parts)

    @property
    def reusable(self) -> bool:
        """The last response was read to its end and the engine keeps the connection open."""
        return self._complete and not self._chunks and not self._closed and self._parser.should_keep_alive()

    def close(self) -> None:
        self._closed = True
        if self.transport is not None:
            self.transport.close()
        self._wake()


_HEAD = b"%s %s HTTP/1.1\r\nhost: engine\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%b\r\n%b"


def request_head(method: str, path: str, body: bytes, extra: bytes = b"") -> bytes:
    """An HTTP/1.1 request with a JSON body (``extra``: more header lines, each ending in CRLF)."""
    return _HEAD % (method.encode(), path.encode(), len(body), extra, body)


class EnginePool:
    """Kept-alive connections per engine socket: an exchange reuses an idle one when it can."""

    def __init__(self) -> None:
        self._idle: defaultdict[str, list[EngineConnection]] = defaultdict(list)
        self._settling: set[asyncio.Task[None]] = set()

    async def send(self, socket: str, request: bytes) -> EngineConnection:
        """A connection whose response head has arrived. A reused connection that the engine had closed
        (it may close idle ones) is replaced by a new one once; EngineUnreachable if that fails too."""
        idle = self._idle.get(socket)
        while idle:
            connection = idle.pop()
            if connection._closed or time.monotonic() - connection.idle_since > IDLE_SECONDS:
                connection.close()
                continue
            try:
                await connection.exchange(request)
                return connection
            except EngineUnreachable:
                connection.close()  # closed by the engine meanwhile: a fresh connection instead
                break
        loop = asyncio.get_running_loop()
        try:
            _, connection = await loop.create_unix_connection(EngineConnection, socket)
        except OSError as exc:
            raise EngineGone(f"cannot connect to {socket}: {exc.strerror or exc}") from None
        try:
            await connection.exchange(request)
        except BaseException:
            connection.close()
            raise
        return connection

    def release(self, socket: str, connection: EngineConnection) -> None:
        """Done with the exchange: keep the connection for the next one, or close it (a response not read to its
        end is abandoned: closing tells the engine to stop generating it)."""
        idle = self._idle[socket]
        if connection.reusable and len(idle) < MAX_IDLE:
            connection.idle_since = time.monotonic()
            idle.append(connection)
        else:
            connection.close()

    def settle(self, socket: str, connection: EngineConnection) -> None:
        """Done with the exchange, whose response ends right after what was read: read its end in the background,
        then keep the connection (release it now if the end is already here)."""
        if connection.reusable:
            self.release(socket, connection)
            return

        async def settle() -> None:
            with contextlib.suppress(TimeoutError, StreamCut):
                await asyncio.wait_for(connection.read_all(), SETTLE_S)
            self.release(socket, connection)

        task = asyncio.get_running_loop().create_task(settle())
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    def forget(self, keep: set[str]) -> None:
        """Close the kept connections of engines no longer in ``keep`` (they were retired)."""
        for socket in [s for s in self._idle if s not in keep]:
            for connection in self._idle.pop(socket):
                connection.close()

    def close(self) -> None:
        self.forget(set())
