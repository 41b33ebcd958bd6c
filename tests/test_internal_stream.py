"""The chunks most of a stream is made of, written without building models per token (engine/chunks.py's
TextChunks and LogprobsJSON, engine/internal_stream.py's token_note), are what the models
write: the very bytes, or for logprobs the same JSON (numbers as Python writes them, which parse to the same
floats)."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import BaseModel

from engine.chunks import ChunkWriter, TextChunks, _opening
from engine.internal_stream import (
    COMMENT_BYTES,
    annotated,
    annotated_with,
    held,
    is_opening,
    is_usage,
    split,
    token_note,
)
from engine.protocol import (
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    CompletionChoice,
    CompletionChunk,
    DeltaMessage,
    InternalEvent,
    Usage,
)
from engine.request_stream import TokenLogprobs
from engine.text import Delta
from engine.tokenizer import ChatTokenizer

TEXTS = ["Paris", " is", "", "naïve café 東京 🚀", 'quote " and \\ backslash', "line\nbreak\ttab", "\x00\x1f\x7f",
         "\u2028\u2029", "slash / </script>"]  # fmt: skip


def model_event(chat: bool, index: int, text: str, logprobs: Any = None) -> str:
    """The event as the models write it (engine/chunks.py's own path for a chunk that carries text alone)."""
    if chat:
        choice: ChatCompletionChunkChoice | CompletionChoice = ChatCompletionChunkChoice(
            index=index, delta=DeltaMessage(content=text or None), finish_reason=None, logprobs=logprobs
        )
        chunk: ChatCompletionChunk | CompletionChunk = ChatCompletionChunk(
            id="chatcmpl-1",
            created=7,
            model="m",
            choices=[choice],  # type: ignore[list-item]
        )
    else:
        choice = CompletionChoice(index=index, text=text, finish_reason=None, logprobs=logprobs)
        chunk = CompletionChunk(id="cmpl-1", created=7, model="m", choices=[choice])  # type: ignore[list-item]
    return f"data: {chunk.model_dump_json()}\n\n"


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("index", [0, 3])
def test_a_text_chunk_from_its_template_is_the_models_event(chat: bool, index: int) -> None:
    texts = TextChunks(lambda i, _: model_event(chat, i, TextChunks.SLOT))
    for text in TEXTS:
        if not text and chat:
            continue  # a chat delta without text is never a text chunk
        fast, slow = texts.event(index, text), model_event(chat, index, text)
        assert json.loads(fast.removeprefix("data: ")) == json.loads(slow.removeprefix("data: "))
        assert fast == slow, (text, fast, slow)
    # The template is the models' own: the builder is the server's.
    assert ChunkWriter.text_choice(chat, index, "x").index == index


@pytest.mark.parametrize(("ids", "chars", "choice", "cached"), [
    ([5], 3, 0, None), ([5, 6, 7], 120, 2, None), ([], 0, 0, None), ([9], 0, 1, None), ([], 4, 0, None),
    ([5], 3, 0, 0), ([5, 6], 9, 3, 160),  # a choice's first note says how much of its prompt was cached
])  # fmt: skip
def test_a_token_note_is_the_models_json(ids: list[int], chars: int, choice: int, cached: int | None) -> None:
    expected = InternalEvent(ids=ids, chars=chars, choice=choice, cached=cached).model_dump_json(exclude_defaults=True)
    assert token_note(ids, chars, choice, cached) == expected
    event = 'data: {"x":1}\n\n'
    assert annotated_with(event, token_note(ids, chars, choice, cached)) == annotated(event, InternalEvent(
        ids=ids, chars=chars, choice=choice, cached=cached))  # fmt: skip
    data, note = split(annotated_with(event, token_note(ids, chars, choice, cached)).encode()[:-2])
    assert data == b'data: {"x":1}' and note is not None and json.loads(note) == json.loads(expected)


@pytest.fixture(scope="module")
def tokenizer(demo_path) -> ChatTokenizer:
    return ChatTokenizer(demo_path("bf16"))


@pytest.mark.parametrize("chat", [False, True])
def test_a_chunk_with_logprobs_from_its_template_is_the_models_json(chat: bool, tokenizer: ChatTokenizer) -> None:
    """Tokens of every kind (multi-byte and partial characters, quotes, special tokens, an id past the
    tokenizer's), alternatives that share a text or are the sampled token, tiny, floored and NaN values: the JSON
    written from cached pieces is the models' (engine/chunks.py's chat_logprobs and completion_logprobs)."""
    api = ChunkWriter(tokenizer, "m")
    ids = [*tokenizer.encode('naïve café 東京 🚀 "quoted" back\\slash\nline'), 0, 1, 2, tokenizer.vocab_size + 3]
    values = [-1e-05, -0.0, -9999.0, -2.5, float("nan"), -123.456789]
    logprobs = [(token, TokenLogprobs(values[i % len(values)], ((token, -0.5), (ids[i - 1], values[(i + 1) % 6]),
                                                                (ids[i - 1], -7.0), (ids[-1], -1e-30))))
                for i, token in enumerate(ids)]  # fmt: skip
    fast_gen = SimpleNamespace(text_offset=None, resumed_ids=ids[:3])
    slow_gen = SimpleNamespace(text_offset=None, resumed_ids=ids[:3])
    texts = TextChunks(lambda i, scores: model_event(chat, i, TextChunks.SLOT, scores), TextChunks.logprobs_slot(chat))
    for lo, hi in [(0, 1), (1, 5), (5, len(ids)), (len(ids), len(ids))]:
        delta = Delta("some text", None, tuple(ids[lo:hi]), tuple(logprobs[lo:hi]))
        fast = api.logprobs_of(chat, fast_gen, delta)  # type: ignore[arg-type]
        model: BaseModel = api.chat_logprobs(delta) if chat else api.completion_logprobs(slow_gen, delta)  # type: ignore[arg-type]
        assert _parsed(fast) == _parsed(model.model_dump_json())
        event, expected = texts.event(2, delta.text, fast), model_event(chat, 2, delta.text, model)
        assert _parsed(event.removeprefix("data: ")) == _parsed(expected.removeprefix("data: "))
        assert fast_gen.text_offset == slow_gen.text_offset


def _parsed(text: str) -> Any:
    """JSON with NaN written as null (as both ways write it): equal values compare equal."""
    value = json.loads(text)
    assert "NaN" not in text and not (isinstance(value, float) and math.isnan(value))
    return value


@pytest.mark.parametrize("prompts", [[[1, 2]], [[1, 2], [3]]])
def test_the_opening_and_a_held_note_are_told_apart(prompts: list[list[int]]) -> None:
    """Both are comments alone: the stream's opening (one prompt or several) and held tokens (a tool call's)."""
    answer = SimpleNamespace(prompts=prompts, count=2, request_id="x", created=7)
    opening = _opening(answer, "m").encode()[:-2]  # type: ignore[arg-type]
    assert is_opening(opening)
    assert InternalEvent.model_validate_json(opening[len(COMMENT_BYTES) :]).prompt_ids == prompts[0]
    note = held(token_note([3, 4], 5, 1)).encode()
    assert note.endswith(b"\n\n") and not is_opening(note[:-2]) and split(note[:-2]) == (note[:-2], None)
    assert json.loads(note[len(COMMENT_BYTES) :]) == {"ids": [3, 4], "chars": 5, "choice": 1}


@pytest.mark.parametrize("chat", [False, True])
def test_the_usage_chunk_is_told_from_the_others(chat: bool) -> None:
    """The relay must not write a second usage chunk after an engine that died before [DONE]: it knows the first."""
    kind = ChatCompletionChunk if chat else CompletionChunk
    usage = f"data: {kind(id='x', created=7, model='m', choices=[], usage=Usage.of(3, 4)).model_dump_json()}"
    assert is_usage(usage.encode())
    for text in ("Hi", '"choices":[]', ""):  # a token's text is escaped in its JSON string
        assert not is_usage(model_event(chat, 0, text).encode()), text
