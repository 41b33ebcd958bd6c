"""Client load for the fault suite: a few OpenAI-style clients that send requests the whole time and keep
every outcome (start, time to first token, end, and for a failure its kind), so a fault's effect can be
read off afterwards.

A request counts as served only if its answer is whole and correct (the load asks for ``ignore_eos``, so
every answer has exactly ``max_tokens`` tokens):

* a stream (it asks for ``stream_options.include_usage``): HTTP 200; at least one chunk that carries
  text; no error event; a usage chunk (one) whose ``completion_tokens`` is ``max_tokens``; a finish
  reason ``length``; ``data: [DONE]`` at its end, and nothing after it;
* a plain request: HTTP 200, ``completion_tokens == max_tokens``, ``finish_reason == "length"``.

Anything else is a failure of one kind (``Outcome.kind``, ``KINDS``), so a test can tell a connection
that was refused (nothing listened) from a request that failed in flight (cut, an error event, a short
stream). A client thread that dies of an exception the checker did not expect, or hangs, fails ``check()``
and ``stop()``; ``wait_for_more`` fails when the requests it waits for do not come.
"""

from __future__ import annotations

import collections
import json
import statistics
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

import httpx

KINDS = {
    "http": "an HTTP status other than 200",
    "refused": "the connection was refused (httpx.ConnectError): it never reached a gateway",
    "timeout": "an httpx timeout (connect, read, write or pool): the gateway did not answer in time",
    "transport": "the connection failed in flight (httpx.ReadError, RemoteProtocolError, ...): a cut",
    "error_event": "the stream carried an error event",
    "no_done": "the stream ended without data: [DONE]",
    "after_done": "data arrived after data: [DONE]",
    "short": "not max_tokens tokens: completion_tokens differs, no usage chunk, or no text at all",
    "finish": "a finish reason other than length",
    "malformed": "a body or an SSE line that is not what the OpenAI API sends",
    "client_died": "the client thread died of an unexpected exception during this request",
}
IN_FLIGHT_KINDS = frozenset({"transport", "error_event", "no_done", "after_done", "short"})
PROMPT = "Count: one, two,"


class LoadFailure(AssertionError):
    """The load itself says the run is not to be trusted: a client died or hung, or requests did not come."""


@dataclass(frozen=True)
class Outcome:
    start: float
    end: float
    ttft: float | None  # streams: seconds to the first text; None for plain requests (and streams without text)
    error: str | None  # None: a whole, correct answer; else "<kind>: <detail>"
    kind: str | None = None  # None when served; else one of KINDS
    stream: bool = False
    client: int = -1  # the load's client thread; -1 for a one-off request (``send``)
    status: int | None = None  # the HTTP status, when one came
    tokens: int | None = None  # completion_tokens as the answer reported them
    chunks: int = 0  # streams: chunks that carried text

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def refused(self) -> bool:
        """Never reached a gateway: nothing accepted the connection."""
        return self.kind == "refused"

    @property
    def cut(self) -> bool:
        """Failed after it reached a gateway: the connection failed in flight, or the stream was wrong."""
        return self.kind in IN_FLIGHT_KINDS


class _Failed(Exception):
    def __init__(self, kind: str, detail: str, **fields: Any) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind, self.fields = kind, fields


def body(stream: bool, max_tokens: int, prompt: str = PROMPT) -> dict[str, Any]:
    payload: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                               "stream": stream}  # fmt: skip
    if stream:
        payload["stream_options"] = {"include_usage": True}
    return payload


def send(http: httpx.Client, stream: bool, max_tokens: int, client: int = -1) -> Outcome:
    """One completion through ``http``, checked; its outcome. Only a bug of the checker raises."""
    start = time.monotonic()
    fields: dict[str, Any] = {}
    kind: str | None = None
    error: str | None = None
    try:
        fields = _stream(http, body(True, max_tokens), max_tokens, start) if stream else _plain(http, max_tokens)
    except _Failed as failed:
        kind, error, fields = failed.kind, str(failed), failed.fields
    except httpx.HTTPError as exc:
        if isinstance(exc, httpx.ConnectError):
            kind = "refused"
        elif isinstance(exc, httpx.TimeoutException):
            kind = "timeout"
        else:
            kind = "transport"
        error = f"{kind}: {type(exc).__name__}: {exc}"
    return Outcome(start=start, end=time.monotonic(), error=error, kind=kind, stream=stream, client=client,
                   **{"ttft": None, **fields})  # fmt: skip


def fresh(url: str, stream: bool = False, max_tokens: int = 4, timeout: float = 120) -> Outcome:
    """One checked completion on a new connection (a client of its own)."""
    with httpx.Client(base_url=url, timeout=timeout) as http:
        return send(http, stream, max_tokens)


def _plain(http: httpx.Client, max_tokens: int) -> dict[str, Any]:
    response = http.post("/v1/completions", json=body(False, max_tokens))
    if response.status_code != 200:
        raise _Failed("http", f"{response.status_code} {response.text[:200]}", status=response.status_code)
    try:
        data = response.json()
        tokens = data["usage"]["completion_tokens"]
        finish = data["choices"][0]["finish_reason"]
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise _Failed("malformed", f"{exc!r} in {response.text[:200]}", status=200) from None
    if tokens != max_tokens:
        raise _Failed("short", f"{tokens} tokens of {max_tokens}: {response.text[:200]}", status=200, tokens=tokens)
    if finish != "length":
        raise _Failed("finish", f"finish_reason {finish!r}: {response.text[:200]}", status=200, tokens=tokens)
    return {"status": 200, "tokens": tokens}


def _stream(http: httpx.Client, payload: dict[str, Any], max_tokens: int, start: float) -> dict[str, Any]:
    """Read the whole stream (to the end of the response, past [DONE]) and check it."""
    ttft: float | None = None
    chunks, tokens, finish, done, errors = 0, None, None, False, []
    seen = {"status": 200}

    def failed(kind: str, detail: str) -> _Failed:
        return _Failed(kind, detail, ttft=ttft, chunks=chunks, tokens=tokens, **seen)

    with http.stream("POST", "/v1/completions", json=payload) as response:
        if response.status_code != 200:
            text = response.read()[:200].decode(errors="replace")
            raise _Failed("http", f"{response.status_code} {text}", status=response.status_code)
        try:
            for line in response.iter_lines():
                if not line or line.startswith(":"):  # between events; an SSE comment
                    continue
                if done:
                    raise failed("after_done", f"after [DONE]: {line[:200]}")
                if not line.startswith("data: "):
                    raise failed("malformed", f"not an SSE data line: {line[:200]}")
                if line == "data: [DONE]":
                    done = True
                    continue
                try:
                    data = json.loads(line[6:])
                    if "error" in data:
                        errors.append(str(data["error"].get("message", data["error"]))[:200])
                        continue
                    for choice in data.get("choices") or []:
                        if choice.get("text"):
                            chunks += 1
                            ttft = time.monotonic() - start if ttft is None else ttft
                        finish = choice.get("finish_reason") or finish
                    if data.get("usage"):
                        if tokens is not None:
                            raise failed("malformed", f"a second usage chunk: {line[:200]}")
                        tokens = data["usage"]["completion_tokens"]
                except (ValueError, KeyError, TypeError, AttributeError) as exc:
                    raise failed("malformed", f"{exc!r} in {line[:200]}") from None
        except httpx.HTTPError as exc:  # cut in flight: keep what the stream had carried
            kind = "timeout" if isinstance(exc, httpx.TimeoutException) else "transport"
            raise failed(kind, f"{type(exc).__name__}: {exc} (after {chunks} text chunks, [DONE]: {done})") from None
    if errors:
        raise failed("error_event", f"{errors[0]} ([DONE]: {done})")
    if not done:
        raise failed("no_done", f"the stream ended after {chunks} text chunks without [DONE] (usage: {tokens})")
    if tokens != max_tokens or chunks == 0:
        raise failed("short", f"usage completion_tokens {tokens} of {max_tokens}, {chunks} text chunks")
    if finish != "length":
        raise failed("finish", f"finish_reason {finish!r}")
    return {"ttft": ttft, "chunks": chunks, "tokens": tokens, "status": 200}


def summary(outcomes: list[Outcome], examples: int = 3) -> str:
    """How many served, how many failed of each kind, and a few of the errors."""
    kinds = collections.Counter(o.kind for o in outcomes if not o.ok)
    served = sum(1 for o in outcomes if o.ok)
    text = f"{len(outcomes)} requests: {served} served" + "".join(f", {n} {k}" for k, n in sorted(kinds.items()))
    errors = [o.error for o in outcomes if o.error]
    return text + ("; e.g. " + " | ".join(e[:300] for e in errors[:examples]) if errors else "")


class Load:
    """``clients`` threads (every other one streaming) sending completions until ``stop()``."""

    def __init__(self, url: str, clients: int = 4, max_tokens: int = 16, timeout: float = 120.0) -> None:
        self.url, self.clients, self.max_tokens, self.timeout = url, clients, max_tokens, timeout
        self.hang_after = timeout + 30  # a request in flight longer than this, or a thread not done by then: hung
        self.outcomes: list[Outcome] = []
        self.deaths: list[str] = []  # the tracebacks of client threads that died
        self._current: dict[int, float | None] = {}  # client -> when its request in flight started
        self._died: set[int] = set()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(i, i % 2 == 0), daemon=True, name=f"load-{i}")
                         for i in range(clients)]  # fmt: skip
        for thread in self._threads:
            thread.start()

    def stop(self, join_timeout: float | None = None) -> None:
        """Stop sending; wait for every client's last request. Fails if a client died or hung."""
        self._stop.set()
        deadline = time.monotonic() + (self.hang_after if join_timeout is None else join_timeout)
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        self.check()

    def check(self) -> None:
        """Fail if a client thread died, or hangs: a request in flight longer than ``hang_after``, or (after
        ``stop()``) a thread still running."""
        problems = list(self.deaths)
        now = time.monotonic()
        for index, thread in enumerate(self._threads):
            started = self._current.get(index)
            if started is not None and now - started > self.hang_after:
                problems.append(f"client {index} hung: its request has been in flight for {now - started:.0f} s")
            elif self._stop.is_set() and thread.is_alive():
                problems.append(f"client {index} did not finish after stop()")
            elif not thread.is_alive() and not self._stop.is_set() and index not in self._died:
                problems.append(f"client {index} exited")
        if problems:
            raise LoadFailure("the load is broken: " + "\n".join(problems) + f"\nso far: {summary(self.outcomes)}")

    def _client(self, index: int, stream: bool) -> None:
        try:
            with httpx.Client(base_url=self.url, timeout=self.timeout) as http:
                while not self._stop.is_set():
                    self._current[index] = time.monotonic()
                    outcome = send(http, stream, self.max_tokens, client=index)
                    self.outcomes.append(outcome)
                    self._current[index] = None
                    if outcome.kind in ("refused", "transport", "timeout"):
                        time.sleep(0.2)  # a gateway that is gone refuses at once: do not spin
        except BaseException as exc:  # a bug of the checker, or of the client library: the run is not trusted
            self._died.add(index)
            self.deaths.append(f"client {index} died: {traceback.format_exc()}")
            started = self._current.get(index)
            if started is not None:
                self.outcomes.append(Outcome(start=started, end=time.monotonic(), ttft=None, stream=stream,
                                             client=index, kind="client_died",
                                             error=f"client_died: {type(exc).__name__}: {exc}"))  # fmt: skip
            self._current[index] = None

    # -- reading it --------------------------------------------------------------------------

    def during(self, t0: float, t1: float) -> list[Outcome]:
        """Requests that were in flight at some moment of [t0, t1]."""
        return [o for o in list(self.outcomes) if o.end >= t0 and o.start <= t1]

    def in_flight(self) -> dict[int, float]:
        """Client -> how many seconds its request in flight has been so (clients waiting for an answer now)."""
        now = time.monotonic()
        return {client: round(now - started, 1) for client, started in list(self._current.items()) if started}

    def served_since(self, t0: float) -> set[int]:
        """The clients that got a whole answer to a request sent after ``t0``."""
        return {o.client for o in list(self.outcomes) if o.start >= t0 and o.ok}

    def within(self, t0: float, t1: float) -> list[Outcome]:
        """Requests that started and ended inside [t0, t1]."""
        return [o for o in list(self.outcomes) if o.start >= t0 and o.end <= t1]

    def ttft_p50(self, t0: float, t1: float) -> float | None:
        """Median time to first token of the streams that started in [t0, t1)."""
        values = [o.ttft for o in list(self.outcomes) if t0 <= o.start < t1 and o.ttft is not None]
        return statistics.median(values) if values else None

    def wait_for_more(self, count: int, after: float, timeout: float = 60) -> list[Outcome]:
        """Wait until ``count`` requests that started after ``after`` have finished, and return them.
        Fails (LoadFailure, with the outcomes so far) if they do not come within ``timeout`` s, or the load
        breaks meanwhile."""
        deadline = time.monotonic() + timeout
        while True:
            self.check()
            later = [o for o in list(self.outcomes) if o.start >= after]
            if len(later) >= count:
                return later
            if time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        raise LoadFailure(f"{count} requests that started after {after:.1f} did not finish within {timeout} s (now "
                          f"{time.monotonic():.1f}): {summary(later)}; all: {summary(self.outcomes)}")  # fmt: skip
