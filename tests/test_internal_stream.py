"""The chunks most of a stream is made of, written without building models per token (engine/server.py's
TextChunks, engine/internal_stream.py's token_note), are the very bytes the models write."""

from __future__ import annotations

import json

import pytest

from engine.internal_stream import annotated, annotated_with, split, token_note
from engine.protocol import (
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    CompletionChoice,
    CompletionChunk,
    DeltaMessage,
    InternalEvent,
)
from engine.server import EngineAPI, TextChunks

TEXTS = ["Paris", " is", "", "naïve café 東京 🚀", 'quote " and \\ backslash', "line\nbreak\ttab", "\x00\x1f\x7f",
         "\u2028\u2029", "slash / </script>"]  # fmt: skip


def model_event(chat: bool, index: int, text: str) -> str:
    """The event as the models write it (engine/server.py's own path for a chunk that carries text alone)."""
    if chat:
        choice: ChatCompletionChunkChoice | CompletionChoice = ChatCompletionChunkChoice(
            index=index, delta=DeltaMessage(content=text or None), finish_reason=None, logprobs=None)
        chunk: ChatCompletionChunk | CompletionChunk = ChatCompletionChunk(id="chatcmpl-1", created=7, model="m",
                                                                             choices=[choice])  # type: ignore[list-item]
    else:
        choice = CompletionChoice(index=index, text=text, finish_reason=None, logprobs=None)
        chunk = CompletionChunk(id="cmpl-1", created=7, model="m", choices=[choice])  # type: ignore[list-item]
    return f"data: {chunk.model_dump_json()}\n\n"


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("index", [0, 3])
def test_a_text_chunk_from_its_template_is_the_models_event(chat: bool, index: int) -> None:
    texts = TextChunks(lambda i: model_event(chat, i, TextChunks.SLOT))
    for text in TEXTS:
        if not text and chat:
            continue  # a chat delta without text is never a text chunk
        fast, slow = texts.event(index, text), model_event(chat, index, text)
        assert json.loads(fast.removeprefix("data: ")) == json.loads(slow.removeprefix("data: "))
        assert fast == slow, (text, fast, slow)
    # The template is the models' own: the builder is the server's.
    assert EngineAPI.text_choice(chat, index, "x").index == index


@pytest.mark.parametrize(("ids", "chars", "choice"), [([5], 3, 0), ([5, 6, 7], 120, 2), ([], 0, 0), ([9], 0, 1),
                                                      ([], 4, 0)])  # fmt: skip
def test_a_token_note_is_the_models_json(ids: list[int], chars: int, choice: int) -> None:
    expected = InternalEvent(ids=ids, chars=chars, choice=choice).model_dump_json(exclude_defaults=True)
    assert token_note(ids, chars, choice) == expected
    event = 'data: {"x":1}\n\n'
    assert annotated_with(event, token_note(ids, chars, choice)) == annotated(event, InternalEvent(
        ids=ids, chars=chars, choice=choice))  # fmt: skip
    data, note = split(annotated_with(event, token_note(ids, chars, choice)).encode()[:-2])
    assert data == b'data: {"x":1}' and note is not None and json.loads(note) == json.loads(expected)
