"""A request's answer as text: each choice's tokens detokenized into deltas, cut at stop strings, tool calls cut
out, logprobs carried along; the choices of one answer merged as they come.

The engine's HTTP API builds its chunks from these deltas (engine/chunks.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.protocol import ChoiceResume, ErrorInfo, FinishReason, cached_prompt_tokens
from engine.tools import ToolCall, ToolCallText

if TYPE_CHECKING:
    from engine.request_stream import RequestStream, TokenLogprobs
    from engine.tokenizer import ChatTokenizer


@dataclass(frozen=True)
class Delta:
    """New text of a request, the token ids consumed since the previous delta, the finish reason on the last."""

    text: str
    finish_reason: FinishReason | None = None
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[tuple[int, TokenLogprobs], ...] = ()  # of the shown tokens consumed, when they were asked for
    tool_calls: tuple[ToolCall, ...] = ()  # on the last delta: the calls cut out of the answer's text


class EngineFailure(Exception):
    """The engine ended a request with an error, or aborted it (the engine stopped)."""

    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        kind = "server_error" if status == 500 else "service_unavailable"
        self.info = ErrorInfo(message=message, type=kind, code=code)


class TextGeneration:
    """One choice of a request, as text: detokenized deltas, cut at the first stop string, with its tokens counted.

    A resumed choice (``resumed``) continues another engine's: its decoder is fed the tokens generated there, one
    by one as there, and the text after what the client already received comes first.
    """

    def __init__(self, index: int, prompt_ids: list[int], stream: RequestStream, tokenizer: ChatTokenizer,
                 stop: list[str], hidden_ids: set[int], resumed: ChoiceResume | None = None,
                 tools: ToolCallText | None = None) -> None:  # fmt: skip
        self.index = index  # of the choice in the response
        self.prompt_ids = prompt_ids
        self.stream = stream
        self.completion_tokens = 0
        self.chars = 0  # characters of text yielded so far
        self.finished = False
        self._decoder = tokenizer.incremental_decoder()
        self._stop = stop
        self._hidden_ids = hidden_ids  # eos and stop tokens end the text; they are not part of it
        # A stop string is recognised only once complete, so a stream keeps back its longest possible prefix.
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self._pending = ""
        self._tools = tools  # cuts tool calls out of the text (held until the answer ends, never counted in chars)
        self.text_offset: int | None = None  # where the next token's text begins, for completion logprobs
        self.prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None  # from the first event, if asked
        self.resumed_ids: list[int] = []  # the tokens another engine generated (a resume)
        # Its prompt's tokens found in the prefix cache: from its first event, or from the engine where a resumed
        # choice began (usage counts the prompt as that engine computed it); told once on the internal stream.
        self.cached_tokens: int | None = None
        self._cached_told = False
        if resumed is not None:
            self.cached_tokens = resumed.cached_tokens
            text = "".join(self._decoder.add(token) for token in resumed.output_ids)
            self.completion_tokens, self.chars = len(resumed.output_ids), resumed.chars
            self._pending = text[resumed.chars :]
            self.resumed_ids = list(resumed.output_ids)

    def close(self) -> None:
        """Cancel the engine request if it is still running (client gone, response abandoned)."""
        if not self.finished:
            self.finished = True
            self.stream.cancel()

    async def deltas(self) -> AsyncIterator[Delta]:
        """Text as it is generated; the last Delta carries the finish reason ("stop" or "length")."""
        pending, ids, logprobs = self._pending, [], []
        async for event in self.stream:
            if self.cached_tokens is None:  # its first event
                self.cached_tokens = event.cached_tokens
            if event.prompt_logprobs is not None:
                self.prompt_logprobs = event.prompt_logprobs
            if event.finish_reason == "error":
                self.finished = True
                raise EngineFailure(500, f"engine error: {event.error or 'unknown'}")
            if event.finish_reason == "abort":
                self.finished = True
                raise EngineFailure(503, "the engine stopped before the request finished", "engine_stopped")
            if event.token_id is not None:
                self.completion_tokens += 1
                ids.append(event.token_id)
                if not (event.finish_reason == "stop" and event.token_id in self._hidden_ids):
                    pending += self._decoder.add(event.token_id)
                    if event.logprobs is not None:
                        logprobs.append((event.token_id, event.logprobs))
            if event.finish_reason is not None:
                pending += self._decoder.flush()
            cut = self._find_stop(pending)
            if cut is not None:
                self.close()
                yield self._delta(pending[:cut], "stop", ids, logprobs)
                return
            if event.finish_reason is not None:
                self.finished = True
                yield self._delta(pending, "length" if event.finish_reason == "length" else "stop", ids, logprobs)
                return
            ready = len(pending) - self._holdback
            if ready > 0:
                yield self._delta(pending[:ready], None, ids, logprobs)
                pending, ids, logprobs = pending[ready:], [], []

    def cached_to_tell(self) -> int | None:
        """Its cached prompt tokens for its first note on the internal stream (None after, or while unknown)."""
        if self._cached_told or self.cached_tokens is None:
            return None
        self._cached_told = True
        return self.cached_tokens

    def _delta(self, text: str, finish: FinishReason | None, ids: list[int],
               logprobs: list[tuple[int, TokenLogprobs]]) -> Delta:  # fmt: skip
        calls: list[ToolCall] = []
        if self._tools is not None:
            if finish is None:
                text = self._tools.feed(text)
            else:
                text, calls = self._tools.finish(text)
                finish = "tool_calls" if calls else finish
        self.chars += len(text)
        return Delta(text, finish, tuple(ids), tuple(logprobs), tuple(calls))

    def _find_stop(self, text: str) -> int | None:
        hits = [i for i in (text.find(s) for s in self._stop) if i >= 0]
        return min(hits) if hits else None


@dataclass
class Answer:
    """An admitted request: its choices still to generate (one TextGeneration each), under one response id."""

    request_id: str
    created: int
    prompts: list[list[int]]
    count: int  # choices in the response: n times the prompts
    choices: list[TextGeneration]
    internal: bool  # the gateway's internal stream: token ids after every event
    started_before: bool = False  # a resumed request whose first events (role chunks, echo) the client has
    done_tokens: int = 0  # tokens of the choices a failed engine finished (a resume): in the usage
    done_cached: dict[int, int | None] = field(default_factory=dict)  # those choices' cached prompt tokens
    began: float = field(default_factory=time.monotonic)  # admitted
    received: float | None = None  # its request's receipt (before its body was read), where known
    first_token: float | None = None  # its first text came (a choice's first delta)

    def cached_tokens(self) -> int:
        """Its prompts' tokens found in the prefix cache (usage's ``prompt_tokens_details.cached_tokens``)."""
        cached = {**self.done_cached, **{c.index: c.cached_tokens for c in self.choices}}
        return cached_prompt_tokens(cached, len(self.prompts), self.count // len(self.prompts))

    async def deltas(self) -> AsyncIterator[tuple[TextGeneration, Delta]]:
        """Every choice's deltas, as they come."""
        if len(self.choices) == 1:
            choice = self.choices[0]
            async for delta in choice.deltas():
                if self.first_token is None:
                    self.first_token = time.monotonic()
                yield choice, delta
            return
        queue: asyncio.Queue[tuple[TextGeneration, Delta] | BaseException | None] = asyncio.Queue()

        async def pump(choice: TextGeneration) -> None:
            try:
                async for delta in choice.deltas():
                    queue.put_nowait((choice, delta))
                queue.put_nowait(None)
            except Exception as exc:  # an engine failure ends the whole answer
                queue.put_nowait(exc)

        tasks = [asyncio.ensure_future(pump(choice)) for choice in self.choices]
        try:
            left = len(tasks)
            while left:
                item = await queue.get()
                if item is None:
                    left -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    if self.first_token is None:
                        self.first_token = time.monotonic()
                    yield item
        finally:
            for task in tasks:
                task.cancel()
