"""The internal stream between an engine and the gateway's relays: the SSE a client gets, with comment lines.

A relay asks an engine for it with the RESUMABLE_HEADER. The engine writes the data events an OpenAI client
would get and, after each event that consumed tokens, a comment line (ignored by SSE clients, removed by the
relay) with what resuming the request needs (``engine.protocol.InternalEvent``); the stream opens with a
comment of the prompts' ids. Tokens that consumed no event (a tool call's, whose text is held until the answer
ends) get a comment of their own, an event with no data (``held``). This module is both ends of it: the engine
encodes (``opening``, ``annotated``, ``held``) and the relay decodes (``split``, ``is_opening``, ``is_usage``);
``[DONE]`` is defined here once.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.protocol import InternalEvent

RESUMABLE_HEADER = "x-warmgate-resumable"
COMMENT = ": warmgate "  # an internal comment line begins so
DONE = "data: [DONE]\n\n"

DONE_BYTES = DONE.encode()
DONE_EVENT = DONE_BYTES[:-2]  # the event without its blank line, as a reader splits events
COMMENT_BYTES = COMMENT.encode()
_NOTE = b"\n" + COMMENT_BYTES  # where an event's comment line begins
# The opening's comment begins so: prompt_ids is the first field it sets (InternalEvent's order); a held note's
# begins with its ids.
_OPENING = COMMENT_BYTES + b'{"prompt_ids":'
_NO_CHOICES = b'"choices":[]'


def opening(note: InternalEvent) -> str:
    """The stream's first event: a comment only (the prompts' ids, the response's id and its choices)."""
    return f"{COMMENT}{note.model_dump_json(exclude_defaults=True)}\n\n"


def annotated(event: str, note: InternalEvent) -> str:
    """A data event followed by its comment line (the token ids it consumed, the characters sent)."""
    return annotated_with(event, note.model_dump_json(exclude_defaults=True))


def token_note(ids: Sequence[int], chars: int, choice: int, cached: int | None = None) -> str:
    """``InternalEvent(ids=ids, chars=chars, choice=choice, cached=cached).model_dump_json(exclude_defaults=True)``,
    the comment of an event with no finish reason (most of a stream's), written without building the model: once
    per token."""
    fields = []
    if ids:
        fields.append(f'"ids":[{",".join(map(str, ids))}]')
    if chars:
        fields.append(f'"chars":{chars}')
    if choice:
        fields.append(f'"choice":{choice}')
    if cached is not None:
        fields.append(f'"cached":{cached}')
    return "{" + ",".join(fields) + "}"


def annotated_with(event: str, note_json: str) -> str:
    """``annotated`` with the comment's JSON already written."""
    return f"{event[:-1]}{COMMENT}{note_json}\n\n"


def held(note_json: str) -> str:
    """An event of a comment alone (``token_note``'s JSON): tokens a choice consumed with no text to show yet."""
    return f"{COMMENT}{note_json}\n\n"


def is_opening(event: bytes) -> bool:
    """Whether a comment-only event (without its blank line) is the stream's opening, not a ``held`` note."""
    return event.startswith(_OPENING)


def is_usage(event: bytes) -> bool:
    """Whether a data event (without its comment) is the usage chunk: the one chunk with no choices that an engine
    writes (``ChunkWriter.events``, pydantic's compact JSON)."""
    return _NO_CHOICES in event


def split(event: bytes) -> tuple[bytes, bytes | None]:
    """An event (without its blank line) as (the data event, its comment's JSON or None)."""
    at = event.find(_NOTE)
    if at < 0:
        return event, None
    return event[:at], event[at + len(_NOTE) :]
