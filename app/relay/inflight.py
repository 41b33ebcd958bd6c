"""A request in flight through a relay: what its client has received, enough to resume it on another engine.

A relay always asks an engine for its internal stream (``stream: true`` and the resumable header): the SSE
data events a client would get, each token's event followed by a comment line with the token ids it
consumed and the characters of text sent so far (``engine.protocol.InternalEvent``), and before them a
comment with the prompt's ids. The relay passes the data lines on and keeps the comments. When the
engine fails (its socket errors, the stream is cut, or it ends the request with ``engine_stopped``), the
request goes to the next active engine with ``warmgate_resume``: same id, the prompt and generated ids,
the characters the client has. The client's stream goes on where it stopped; a non-streaming client
gets the response assembled from the events, as if nothing happened.

Per event the relay does byte searches only: the comments are kept as raw JSON and parsed together when
they are needed (a resume, the token counts at the end), in one ``json.loads`` of all of them.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from common import json_codec
from engine.internal_stream import COMMENT_BYTES, DONE_BYTES, DONE_EVENT, is_opening, is_usage, split
from engine.protocol import (
    ChatCompletionChunk,
    ChoiceResume,
    CompletionChunk,
    ErrorInfo,
    ErrorResponse,
    InternalEvent,
    Resume,
    Usage,
    cached_prompt_tokens,
)
from engine.responses import assemble

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
DONE = DONE_BYTES
_ERROR = b'data: {"error"'


class InvalidRequest(ValueError):
    """A field the relay acts on has the wrong type (the engine validates the rest)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class EngineStopped(Exception):
    """The engine ended the request with ``engine_stopped``: it stopped before the request finished."""


@dataclass
class Progress:
    """What the comments kept so far say of one choice: every generated id, the characters sent, and its prompt's
    tokens that the engine where it began found cached (its first note says)."""

    output_ids: list[int] = field(default_factory=list)
    chars: int = 0
    cached: int | None = None


@dataclass
class InFlight:
    route: str
    payload: dict[str, Any]  # the client's request (a client's own warmgate_resume is dropped)
    streams: bool = False
    wants_usage: bool = False
    arrived: float = field(default_factory=time.perf_counter)
    prompt_ids: list[int] | None = None
    prompts: list[list[int]] | None = None  # all of them, when the request has several
    choices: int = 1  # in the response (n times the prompts)
    id: str | None = None
    created: int | None = None
    model: str = ""
    started: bool = False  # a data event has reached the client (or the assembler)
    finish_seen: bool = False  # every choice's last token's event has been relayed
    usage_sent: bool = False  # the usage chunk has been relayed (it follows the last finish)
    failed: bool = False  # the engine ended the stream with a final error, which the client got
    done: bool = False  # [DONE] relayed: nothing more to come
    first_token_at: float | None = None
    resumes: int = 0
    _notes: list[bytes] = field(default_factory=list)
    _parsed: int = 0  # notes folded into _progress
    _progress: dict[int, Progress] = field(default_factory=dict)  # choice -> its progress
    _finished: set[int] = field(default_factory=set)  # choices whose last event was relayed
    _pieces: list[bytes] = field(default_factory=list)  # a non-streaming request's data events, as JSON

    @classmethod
    def of(cls, route: str, payload: dict[str, Any]) -> InFlight:
        """The request, with the fields the relay acts on checked: InvalidRequest names a wrong one."""
        stream = payload.get("stream")
        if stream is not None and not isinstance(stream, bool):
            raise InvalidRequest("stream", f"stream: must be a boolean, not {type(stream).__name__}")
        options = payload.get("stream_options")
        if options is not None and not isinstance(options, dict):
            raise InvalidRequest("stream_options", "stream_options: must be an object")
        usage = (options or {}).get("include_usage")
        if usage is not None and not isinstance(usage, bool):
            raise InvalidRequest("stream_options", "stream_options.include_usage: must be a boolean")
        payload.pop("warmgate_resume", None)
        return cls(route, payload, streams=bool(stream), wants_usage=bool(stream and usage))

    def body(self) -> bytes:
        """What to send to an engine: the client's request as a stream, with where to resume from."""
        payload = {**self.payload, "stream": True}
        if self.prompt_ids is not None and self.id is not None and self.created is not None:
            first = self.progress(0)
            resume = Resume(id=self.id, created=self.created, prompt_ids=self.prompt_ids, output_ids=first.output_ids,
                            chars=first.chars, started=self.started, prompts=self.prompts,
                            cached_tokens=first.cached)  # fmt: skip
            if self.choices > 1:
                resume.choices = [ChoiceResume(index=i, output_ids=self.progress(i).output_ids,
                                               chars=self.progress(i).chars, finished=i in self._finished,
                                               cached_tokens=self.progress(i).cached)
                                  for i in range(self.choices)]  # fmt: skip
            payload["warmgate_resume"] = resume.model_dump(exclude_none=True)
        return json_codec.dumps(payload)

    def take(self, events: list[bytes]) -> bytes:
        """Complete SSE events from the engine (without their blank line): what the client gets of them.

        The state follows them. Raises EngineStopped for the error event of an engine that stopped with the
        request unfinished."""
        out: list[bytes] = []
        for event in events:
            if event.startswith(COMMENT_BYTES):  # a comment alone: the opening (the prompts' ids), or held tokens
                if not is_opening(event):  # a tool call's tokens, its text held: nothing for the client yet
                    self._keep(event[len(COMMENT_BYTES) :])
                elif self.prompt_ids is None:  # the first opening (a resumed engine's repeats it: skipped)
                    opening = InternalEvent.model_validate_json(event[len(COMMENT_BYTES) :])
                    self.prompt_ids, self.id, self.created = opening.prompt_ids, opening.id, opening.created
                    self.prompts, self.choices, self.model = opening.prompts, opening.choices, opening.model or ""
                continue
            if event == DONE_EVENT:
                self.done = True
                if self.streams:
                    out.append(DONE)
                break
            event, note = split(event)
            if note is not None:
                self._keep(note)
            elif event.startswith(_ERROR):
                error = json.loads(event[6:])["error"]
                if error.get("code") == "engine_stopped":
                    raise EngineStopped(error.get("message", "engine stopped"))
                self.failed = True  # a final error: the client gets it, then [DONE]
            elif self.finish_seen and is_usage(event):
                self.usage_sent = True
            self.started = True
            if self.streams:
                out.append(event + b"\n\n")
            else:
                self._pieces.append(event[6:])
        return b"".join(out)

    def _keep(self, note: bytes) -> None:
        """A comment's JSON, kept for progress() (a last token's is parsed now: rare)."""
        self._notes.append(note)
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        if b'"finish"' in note:
            self._finished.add(json.loads(note).get("choice", 0))
            self.finish_seen = len(self._finished) >= self.choices

    def progress(self, choice: int = 0) -> Progress:
        """The ids and characters of ``choice`` sent so far (the comments not yet read are parsed now, all in one
        call)."""
        if self._parsed < len(self._notes):
            for note in json.loads(b"[" + b",".join(self._notes[self._parsed :]) + b"]"):
                progress = self._progress.setdefault(note.get("choice", 0), Progress())
                progress.output_ids += note.get("ids", ())
                progress.chars = note.get("chars", progress.chars)
                if progress.cached is None:  # the engine where it began says it (a resumed engine repeats it)
                    progress.cached = note.get("cached")
            self._parsed = len(self._notes)
        return self._progress.setdefault(choice, Progress())

    def generated(self) -> int:
        """Tokens generated so far, every choice's."""
        self.progress()
        return sum(len(p.output_ids) for p in self._progress.values())

    def usage(self) -> Usage:
        generated = self.generated()  # the notes not read yet parsed
        prompts = self.prompts or ([self.prompt_ids] if self.prompt_ids else [])
        cached = {choice: p.cached for choice, p in self._progress.items()}
        return Usage.of(sum(len(p) for p in prompts), generated,
                        cached_prompt_tokens(cached, len(prompts), self.choices // max(1, len(prompts))))  # fmt: skip

    def ending(self) -> bytes:
        """What a stream still needs after the last token's event, when its engine failed in between: the usage
        chunk if it was asked for and not yet relayed, then [DONE]."""
        if not self.wants_usage or self.failed or self.usage_sent:
            return DONE
        kind = ChatCompletionChunk if self.route == CHAT else CompletionChunk
        chunk = kind(id=self.id or "", created=self.created or 0, model=self.model, choices=[], usage=self.usage())
        return f"data: {chunk.model_dump_json()}\n\n".encode() + DONE

    # -- a non-streaming client ---------------------------------------------------------------------------

    def response(self) -> tuple[int, dict[str, Any]]:
        """The OpenAI response of a non-streaming request, from the events kept by take(): (status, body)."""
        chunks = json.loads(b"[" + b",".join(self._pieces) + b"]")
        return assemble(self.route == CHAT, chunks, self.id or "", self.created or 0, self.model, self.usage())


def error_event(message: str, code: str = "engine_failed") -> bytes:
    """The event that ends a stream that cannot go on (then [DONE]), in the OpenAI error shape."""
    error = ErrorResponse(error=ErrorInfo(message=message, type="server_error", code=code))
    return f"data: {error.model_dump_json()}\n\n".encode() + DONE
