"""A request in flight through the gateway: what its client has received, enough to resume it elsewhere.

The gateway always asks an engine for its internal stream (``stream: true`` and the resumable
header): the SSE data events a client would get, each followed by a comment line with the token ids
it consumed and the characters of text sent so far (``engine.protocol.InternalEvent``), and before
them a comment with the prompt's ids. The gateway relays the data events without the comments and
keeps the ids. When the engine fails (its socket errors, the stream is cut, or it ends the request
with ``engine_stopped``), the request goes to the next active engine with ``warmgate_resume``: same
id, the prompt and generated ids, the characters the client has. The client's stream goes on where
it stopped; a non-streaming client gets the response assembled from the events, as if nothing happened.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from engine.protocol import (
    SSE_INTERNAL,
    AssistantMessage,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionChunk,
    CompletionResponse,
    FinishReason,
    InternalEvent,
    Resume,
    Usage,
)

CHAT = "/v1/chat/completions"
DONE = b"data: [DONE]\n\n"
_INTERNAL = SSE_INTERNAL.encode()


class EngineFailed(Exception):
    """The engine serving a request failed before the request ended: resume it on the next one."""

    def __init__(self, why: str, draining: bool = False) -> None:
        super().__init__(why)
        self.draining = draining  # it refused the request because it is draining: it did not fail


def split_events(buffer: bytes) -> tuple[list[bytes], bytes]:
    """Complete SSE events (each ending in a blank line) and the incomplete rest."""
    *events, rest = buffer.split(b"\n\n")
    return [e + b"\n\n" for e in events], rest


@dataclass
class InFlight:
    route: str
    payload: dict[str, Any]  # the client's request (a client's own warmgate_resume is dropped)
    prompt_ids: list[int] | None = None
    output_ids: list[int] = field(default_factory=list)
    chars: int = 0
    id: str | None = None
    created: int | None = None
    model: str = ""
    started: bool = False  # a data event has reached the client (or the assembler)
    finish: str | None = None  # the last token's event has been relayed
    done: bool = False  # [DONE] relayed: nothing more to come
    resumes: int = 0
    _pieces: list[str] = field(default_factory=list)  # a non-streaming request's text

    def __post_init__(self) -> None:
        self.payload.pop("warmgate_resume", None)

    @property
    def streams(self) -> bool:
        return bool(self.payload.get("stream"))

    def body(self) -> bytes:
        """What to send to an engine: the client's request as a stream, with where to resume from."""
        payload = {**self.payload, "stream": True}
        if self.prompt_ids is not None and self.id is not None and self.created is not None:
            resume = Resume(id=self.id, created=self.created, prompt_ids=self.prompt_ids, output_ids=self.output_ids,
                            chars=self.chars, started=self.started)  # fmt: skip
            payload["warmgate_resume"] = resume.model_dump()
        return json.dumps(payload).encode()

    def take(self, event: bytes) -> bytes | None:
        """One SSE event from the engine: what the client gets of it (None: nothing); the state follows it.

        Raises EngineFailed for the error event of an engine that stopped with the request unfinished.
        """
        if event.startswith(_INTERNAL):  # the opening comment: the prompt's ids
            note = InternalEvent.model_validate_json(event[len(_INTERNAL) :])
            if self.prompt_ids is None:
                self.prompt_ids, self.id, self.created = note.prompt_ids, note.id, note.created
                self.model = note.model or ""
            return None
        if event == DONE:
            self.done = True
            return event
        data, _, comment = event.partition(b"\n" + _INTERNAL)
        if not comment and data.startswith(b'data: {"error"'):
            error = json.loads(data[len(b"data: ") :])["error"]
            if error.get("code") == "engine_stopped":
                raise EngineFailed(error.get("message", "engine stopped"))
            self.finish = "error"  # a final error: the client gets it, then [DONE]
            self.started = True
            return event
        self.started = True
        if comment:
            note = InternalEvent.model_validate_json(comment)
            self.output_ids += note.ids
            self.chars = note.chars
            self.finish = note.finish or self.finish
            return data + b"\n\n"
        return event

    def ending(self) -> list[bytes]:
        """The events after the last token's (its engine failed in between): usage if asked, then [DONE]."""
        wants_usage = bool((self.payload.get("stream_options") or {}).get("include_usage"))
        if not (self.streams and wants_usage) or self.finish == "error":
            return [DONE]
        kind = ChatCompletionChunk if self.route == CHAT else CompletionChunk
        chunk = kind(id=self.id or "", created=self.created or 0, model=self.model, choices=[], usage=self.usage())
        return [f"data: {chunk.model_dump_json()}\n\n".encode(), DONE]

    def usage(self) -> Usage:
        return Usage.of(len(self.prompt_ids or ()), len(self.output_ids))

    # -- a non-streaming client ---------------------------------------------------------------

    def add(self, event: bytes) -> dict[str, Any] | None:
        """Keep a relayed event's text for the response; a final error event is returned as it came."""
        if event == DONE:
            return None
        chunk = json.loads(event[len(b"data: ") :])
        if "error" in chunk:
            return chunk
        for choice in chunk.get("choices", []):
            piece = choice["delta"].get("content") if self.route == CHAT else choice.get("text")
            if piece:
                self._pieces.append(piece)
        return None

    def response(self) -> dict[str, Any]:
        """The OpenAI response of a non-streaming request, from the text kept by add()."""
        text = "".join(self._pieces)
        finish: FinishReason = "length" if self.finish == "length" else "stop"
        rid, created, usage = self.id or "", self.created or 0, self.usage()
        if self.route == CHAT:
            choice = ChatCompletionChoice(message=AssistantMessage(content=text), finish_reason=finish)
            chat = ChatCompletionResponse(id=rid, created=created, model=self.model, choices=[choice], usage=usage)
            return chat.model_dump(mode="json")
        completion = CompletionResponse(id=rid, created=created, model=self.model, usage=usage,
                                        choices=[CompletionChoice(text=text, finish_reason=finish)])  # fmt: skip
        return completion.model_dump(mode="json")
