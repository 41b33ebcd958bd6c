"""A submitted request as the HTTP server sees it: an async stream of TokenEvents, fed from an engine thread.

Every backend's engine hands its server RequestStreams: the engine's own thread pushes each step's
events into an Outbox, which wakes each event loop once per step, not once per token.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass


@dataclass(frozen=True)
class TokenEvent:
    """One step of a request: a new token, and/or the reason it finished."""

    token_id: int | None  # None only on a final event that carries no token (abort, error)
    finish_reason: str | None = None  # "stop" (eos / stop token), "length", "abort", "error"
    error: str | None = None


class RequestStream:
    """A submitted request; iterate it (async) to receive its TokenEvents until one has finish_reason."""

    def __init__(self, request_id: str, prompt_tokens: int, loop: asyncio.AbstractEventLoop, outbox: Outbox) -> None:
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.loop = loop
        self.queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self._outbox = outbox
        self.cancelled = False

    def push(self, event: TokenEvent) -> None:
        """Called from the engine thread: delivered with the rest of the step's events."""
        self._outbox.add(self, event)

    def cancel(self) -> None:
        """Stop generating (client went away, stop string hit); the stream ends with 'abort'."""
        self.cancelled = True

    async def __aiter__(self) -> AsyncIterator[TokenEvent]:
        while True:
            event = await self.queue.get()
            yield event
            if event.finish_reason is not None:
                return


class Outbox:
    """Token events of one step, handed to each event loop in one call (not one wake-up per token)."""

    def __init__(self) -> None:
        self._events: list[tuple[RequestStream, TokenEvent]] = []

    def add(self, stream: RequestStream, event: TokenEvent) -> None:
        self._events.append((stream, event))

    def flush(self) -> None:
        if not self._events:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, TokenEvent]]] = {}
        for stream, event in self._events:
            by_loop.setdefault(stream.loop, []).append((stream, event))
        self._events = []
        for loop, events in by_loop.items():
            loop.call_soon_threadsafe(_deliver, events)


def _deliver(events: list[tuple[RequestStream, TokenEvent]]) -> None:
    for stream, event in events:
        stream.queue.put_nowait(event)
