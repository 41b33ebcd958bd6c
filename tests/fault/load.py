"""Client load for the fault suite: a few OpenAI-style clients that send requests the whole time and keep
every outcome (start, time to first token, end, error), so a fault's effect can be read off afterwards."""

from __future__ import annotations

import json
import statistics
import threading
import time
from dataclasses import dataclass

import httpx


@dataclass(frozen=True)
class Outcome:
    start: float
    end: float
    ttft: float | None  # streams: seconds to the first text; None for plain requests
    error: str | None  # None: a whole, correct answer


class Load:
    """``clients`` threads (every other one streaming) sending completions until ``stop()``."""

    def __init__(self, url: str, clients: int = 4, max_tokens: int = 16) -> None:
        self.url = url
        self.max_tokens = max_tokens
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(i % 2 == 0,), daemon=True) for i in range(clients)]
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=120)

    def _client(self, stream: bool) -> None:
        body = {"prompt": "Count: one, two,", "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": stream}  # fmt: skip
        with httpx.Client(base_url=self.url, timeout=120) as http:
            while not self._stop.is_set():
                start = time.monotonic()
                ttft, error = None, None
                try:
                    if stream:
                        ttft, error = self._stream(http, body, start)
                    else:
                        response = http.post("/v1/completions", json=body)
                        if response.status_code != 200:
                            error = f"{response.status_code} {response.text[:200]}"
                        elif response.json()["usage"]["completion_tokens"] != self.max_tokens:
                            error = f"short answer: {response.text[:200]}"
                except httpx.HTTPError as exc:
                    error = f"{type(exc).__name__}: {exc}"
                    time.sleep(0.2)  # a gateway that is gone refuses at once: do not spin
                self.outcomes.append(Outcome(start, time.monotonic(), ttft, error))

    def _stream(self, http: httpx.Client, body: dict[str, object], start: float) -> tuple[float | None, str | None]:
        ttft, tokens = None, 0
        with http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                return None, f"{response.status_code} {response.read()[:200]!r}"
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    return ttft, f"error event: {data['error'].get('message', '')[:200]}"
                if data["choices"] and data["choices"][0]["text"] and ttft is None:
                    ttft = time.monotonic() - start
                if data.get("usage"):
                    tokens = data["usage"]["completion_tokens"]
        return ttft, None if tokens in (0, self.max_tokens) else f"short stream: {tokens} tokens"

    # -- reading it --------------------------------------------------------------------------

    def during(self, t0: float, t1: float) -> list[Outcome]:
        """Requests that were in flight at some moment of [t0, t1]."""
        return [o for o in list(self.outcomes) if o.end >= t0 and o.start <= t1]

    def ttft_p50(self, t0: float, t1: float) -> float | None:
        """Median time to first token of the streams that started in [t0, t1)."""
        values = [o.ttft for o in list(self.outcomes) if t0 <= o.start < t1 and o.ttft is not None]
        return statistics.median(values) if values else None

    def wait_for_more(self, count: int, after: float, timeout: float = 60) -> None:
        """Wait until ``count`` requests that started after ``after`` have finished."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if sum(1 for o in list(self.outcomes) if o.start >= after) >= count:
                return
            time.sleep(0.1)
