"""The relay's HTTP server: uvicorn on httptools, with a drain that does not race keep-alive clients.

uvicorn's graceful shutdown closes every idle keep-alive connection at once. A client that has just read an
answer and is sending its next request on the same connection (an OpenAI client in a loop does so within a
millisecond) then writes into a closed socket and gets a connection reset: a request lost that no server
ever saw, on every upgrade or relay replacement (the fault suite's upgrade under load caught one). HTTP/1.1
has no way to take back a keep-alive connection without that race, only to announce its end; so a draining
relay, as Envoy's drain does, announces it:

* a request that arrives on a connection after the drain began is served as usual, and its answer carries
  ``connection: close`` (the client opens its next connection on the shared socket, where a live relay
  accepts it); so does the answer to a request in flight when the drain begins, if its headers are not sent yet;
* a connection idle when the drain begins, or whose answer was already streaming then (its headers went out
  without ``connection: close``: closing it after the answer would reset the request a client sends next on it,
  the fault suite's upgrade under load lost one so), is closed once it has been idle for ``DRAIN_IDLE_S``: a
  client sending a request meanwhile gets it answered, as above. Only a client that sends at that very moment
  can still meet a closed connection: the race every keep-alive timeout has.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

DRAIN_IDLE_S = 1.0  # a connection idle when the drain begins is closed after this long idle


class DrainingProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol whose ``shutdown`` (the server's drain) announces the end of the connection
    on its next answer instead of closing it idle."""

    draining = False

    def shutdown(self) -> None:
        self.draining = True
        if self.cycle is None or self.cycle.response_complete:
            self._close_when_idle()
        elif not self.cycle.response_started:  # its answer says connection: close, and the connection ends after it
            self.cycle.keep_alive = False
        # else an answer streaming without that header: the connection is closed once idle after it

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.draining and not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self._close_when_idle()

    def _close_when_idle(self) -> None:
        """Closed if it stays idle DRAIN_IDLE_S (the keep-alive timer, shortened; a request cancels it)."""
        self._unset_keepalive_if_required()
        self.timeout_keep_alive_task = self.loop.call_later(DRAIN_IDLE_S, self.timeout_keep_alive_handler)

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        if self.draining and self.cycle is not None:
            self.cycle.keep_alive = False  # its answer says connection: close, and the connection ends after it


class Server(uvicorn.Server):
    """uvicorn without its own signal handlers: the relay decides when to stop (``should_exit``)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def server(app: Any, drain_timeout: float, **options: Any) -> Server:
    """A server for ``app`` that drains (at most ``drain_timeout`` s) without racing keep-alive clients."""
    config = uvicorn.Config(app, http=DrainingProtocol, log_config=None, log_level="warning", access_log=False,
                            lifespan="off", timeout_graceful_shutdown=max(1, int(drain_timeout)),
                            **options)  # fmt: skip
    return Server(config)
