"""An answer's SSE events: the chat and text completion chunks built from its text deltas (engine/text.py), one
writer for both (text, logprobs, tool calls, echoed prompts, finish reasons, usage), and the internal stream's
comment lines after them (engine/internal_stream.py).

Most chunks carry text alone, or text and its tokens' logprobs: those are written from a template per choice that
the models made once (``TextChunks``), with the logprobs' JSON from cached per-token pieces (``LogprobsJSON``),
the same JSON the models write, without building them per token. The rest go through the models
(engine/protocol.py). A whole response is assembled from these chunks (engine/responses.py).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator, Callable, Sequence
from json.encoder import encode_basestring  # json.dumps's own string encoder (ensure_ascii=False), in C
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from engine.internal_stream import DONE, annotated, annotated_with, held, opening, token_note
from engine.protocol import (
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionRequest,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    DeltaFunction,
    DeltaMessage,
    DeltaToolCall,
    ErrorResponse,
    InternalEvent,
    SamplingRequest,
    TopLogprob,
    Usage,
)
from engine.text import Answer, Delta, EngineFailure, TextGeneration

if TYPE_CHECKING:
    from engine.request_stream import TokenLogprobs
    from engine.tokenizer import ChatTokenizer


def sse(payload: BaseModel) -> str:
    """A model as one SSE data event."""
    return f"data: {payload.model_dump_json()}\n\n"


class ChunkWriter:
    """The SSE events of one engine's answers (its tokenizer names logprobs' tokens; its model names the chunks)."""

    def __init__(self, tokenizer: ChatTokenizer, model_name: str) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.logprobs_json = LogprobsJSON(tokenizer.token_text, tokenizer.token_bytes)

    async def events(self, request: SamplingRequest, answer: Answer) -> AsyncIterator[str]:
        """SSE events of an answer, chat or text completion: a chat's role chunk per choice, a text completion's
        echoed prompts when asked, each choice's deltas with its index and finish reason, usage if asked, [DONE]."""
        chat = isinstance(request, ChatCompletionRequest)
        kind = ChatCompletionChunk if chat else CompletionChunk

        def chunk(choices: list[Any], usage: Usage | None = None) -> str:
            return sse(kind(id=answer.request_id, created=answer.created, model=self.model_name, choices=choices,
                            usage=usage))  # fmt: skip

        if answer.internal:
            yield _opening(answer, self.model_name)
        if chat and not answer.started_before:
            for index in range(answer.count):
                yield chunk([ChatCompletionChunkChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])
        text = request if isinstance(request, CompletionRequest) else None
        echo = {c.index for c in answer.choices} if text is not None and text.echoes() else set()
        logprobs = request.requested_logprobs() is not None
        # Most chunks carry text alone, or text and its tokens' logprobs: written from a template the models made
        # once per choice (TextChunks).
        texts = TextChunks(lambda index, scores: chunk([self.text_choice(chat, index, TextChunks.SLOT, scores)]),
                           TextChunks.logprobs_slot(chat) if logprobs else None)  # fmt: skip
        try:
            async for choice, delta in answer.deltas():
                if choice.index in echo:  # its prompt first, with its logprobs (they came with the first token)
                    echo.discard(choice.index)
                    prompt = text.prompt_text(choice.index // (request.n or 1)) if text is not None else None
                    yield chunk([self.echo_choice(prompt, choice, logprobs)])
                if delta.text and not (delta.finish_reason or delta.tool_calls):
                    scores = self.logprobs_of(chat, choice, delta) if logprobs else ""
                    yield _with_ids(texts.event(choice.index, delta.text, scores), answer, choice, delta)
                elif delta.text or delta.finish_reason or delta.logprobs:
                    yield _with_ids(chunk([self.delta_choice(chat, choice, delta, logprobs)]), answer, choice, delta)
                elif answer.internal and delta.token_ids:  # a tool call's text, held: its tokens go on record
                    yield held(token_note(delta.token_ids, choice.chars, choice.index, choice.cached_to_tell()))
        except EngineFailure as exc:
            yield sse(ErrorResponse(error=exc.info))
            yield DONE
            return
        if request.include_usage():
            yield chunk([], self.usage(answer))
        yield DONE

    def delta_choice(self, chat: bool, choice: TextGeneration, delta: Delta,
                     logprobs: bool) -> ChatCompletionChunkChoice | CompletionChoice:  # fmt: skip
        """A chunk's choice: the delta's text (and tool calls) with the choice's index, its finish reason, and its
        tokens' logprobs when asked."""
        if not (delta.finish_reason or logprobs or delta.tool_calls):
            return self.text_choice(chat, choice.index, delta.text)
        if not chat:
            scores = self.completion_logprobs(choice, delta) if logprobs else None
            return CompletionChoice(index=choice.index, text=delta.text, finish_reason=delta.finish_reason,
                                    logprobs=scores)  # fmt: skip
        calls = [DeltaToolCall(index=i, id=c.id, type="function",
                               function=DeltaFunction(name=c.name, arguments=c.arguments))
                 for i, c in enumerate(delta.tool_calls)] or None  # fmt: skip
        return ChatCompletionChunkChoice(index=choice.index, delta=DeltaMessage(content=delta.text or None,
                                                                                tool_calls=calls),
                                         finish_reason=delta.finish_reason,
                                         logprobs=self.chat_logprobs(delta) if logprobs else None)  # fmt: skip

    @staticmethod
    def text_choice(chat: bool, index: int, text: str,
                    scores: BaseModel | None = None) -> ChatCompletionChunkChoice | CompletionChoice:  # fmt: skip
        """A chunk's choice that carries text alone, or text and its tokens' logprobs (``scores``)."""
        if chat:
            return ChatCompletionChunkChoice(index=index, delta=DeltaMessage(content=text or None),
                                             logprobs=scores)  # type: ignore[arg-type]  # fmt: skip
        return CompletionChoice(index=index, text=text, finish_reason=None, logprobs=scores)  # type: ignore[arg-type]

    def chat_logprobs(self, delta: Delta) -> ChatLogprobs:
        """A chat chunk's logprobs: each shown token of the delta, with its alternatives."""
        text, raw = self.tokenizer.token_text, self.tokenizer.token_bytes
        return ChatLogprobs(content=[
            ChatTokenLogprob(token=text(token), logprob=lp.logprob, bytes=list(raw(token)),
                             top_logprobs=[TopLogprob(token=text(t), logprob=v, bytes=list(raw(t))) for t, v in lp.top])
            for token, lp in delta.logprobs
        ])  # fmt: skip

    def echo_choice(self, prompt: str | None, generation: TextGeneration, logprobs: bool) -> CompletionChoice:
        """A choice's echoed prompt (``prompt``: as the client wrote it, if text): its text and, when asked, each
        token's logprob (the first one's is null); the completion's text_offset goes on after it."""
        text = self.tokenizer.token_text
        ids = generation.prompt_ids
        pieces = [text(t) for t in ids]
        generation.text_offset = sum(len(p) for p in pieces)
        index = generation.index
        if not logprobs:
            return CompletionChoice(index=index, text=prompt if prompt is not None else "".join(pieces),
                                    finish_reason=None)  # fmt: skip
        scores = generation.prompt_logprobs or (None,) * len(ids)
        lps = CompletionLogprobs(
            tokens=pieces,
            token_logprobs=[lp.logprob if lp is not None else None for lp in scores],
            top_logprobs=[{**{text(t): v for t, v in lp.top}, pieces[i]: lp.logprob} if lp is not None else None
                          for i, lp in enumerate(scores)],
            text_offset=list(itertools.accumulate((len(p) for p in pieces[:-1]), initial=0)),
        )  # fmt: skip
        return CompletionChoice(index=index, text=prompt if prompt is not None else "".join(pieces),
                                finish_reason=None, logprobs=lps)  # fmt: skip

    def logprobs_of(self, chat: bool, generation: TextGeneration, delta: Delta) -> str:
        """The JSON of a chunk's logprobs (``chat_logprobs`` or ``completion_logprobs``, written faster)."""
        if chat:
            return self.logprobs_json.chat(delta.logprobs)
        written, generation.text_offset = self.logprobs_json.completion(delta.logprobs, self.text_offset(generation))
        return written

    def text_offset(self, generation: TextGeneration) -> int:
        """Where the completion's next token's text begins (after what another engine generated, on a resume)."""
        if generation.text_offset is None:
            generation.text_offset = sum(len(self.tokenizer.token_text(t)) for t in generation.resumed_ids)
        return generation.text_offset

    def completion_logprobs(self, generation: TextGeneration, delta: Delta) -> CompletionLogprobs:
        """A text completion chunk's logprobs, in the legacy shape; ``top_logprobs`` holds the sampled token too,
        as OpenAI's and vLLM's do, and ``text_offset`` counts the tokens' text from the completion's start."""
        text = self.tokenizer.token_text
        generation.text_offset = self.text_offset(generation)
        out = CompletionLogprobs()
        for token, lp in delta.logprobs:
            piece = text(token)
            out.tokens.append(piece)
            out.token_logprobs.append(lp.logprob)
            out.top_logprobs.append({**{text(t): v for t, v in lp.top}, piece: lp.logprob})
            out.text_offset.append(generation.text_offset)
            generation.text_offset += len(piece)
        return out

    def usage(self, answer: Answer) -> Usage:
        """Token counts: the prompts (each once, whatever n), and every token generated (an eos included, though
        not shown), by every choice."""
        generated = answer.done_tokens + sum(c.completion_tokens for c in answer.choices)
        return Usage.of(sum(len(p) for p in answer.prompts), generated, answer.cached_tokens())


class TextChunks:
    """The SSE events of chunks that carry text alone, or text and its tokens' logprobs, written from a template per
    choice: the event the models write for a placeholder text (and placeholder logprobs), cut around them (the same
    JSON, without building three models per token, or nine with logprobs)."""

    SLOT = "warmgate-text-slot-5f0c1e"
    LOGPROBS_SLOT = "warmgate-logprobs-slot-5f0c1e"

    def __init__(self, render: Callable[[int, BaseModel | None], str], logprobs: BaseModel | None = None) -> None:
        self._render = render  # the event of choice ``index`` whose text is SLOT and whose logprobs are the 2nd
        self._logprobs = logprobs  # the logprobs' placeholder; None: the chunks carry none
        self._templates: dict[int, tuple[str, ...]] = {}

    @classmethod
    def logprobs_slot(cls, chat: bool) -> BaseModel:
        """Placeholder logprobs of a chat or a text completion chunk (their JSON is in the event once)."""
        if chat:
            return ChatLogprobs(content=[ChatTokenLogprob(token=cls.LOGPROBS_SLOT, logprob=0.0)])
        return CompletionLogprobs(tokens=[cls.LOGPROBS_SLOT])

    def event(self, index: int, text: str, logprobs: str = "") -> str:
        """The event of choice ``index`` carrying ``text`` and, if the chunks carry them, ``logprobs`` (their JSON)."""
        template = self._templates.get(index)
        if template is None:
            template = self._templates[index] = self._cut(index)
        if self._logprobs is None:
            return f"{template[0]}{encode_basestring(text)}{template[1]}"
        return f"{template[0]}{encode_basestring(text)}{template[1]}{logprobs}{template[2]}"

    def _cut(self, index: int) -> tuple[str, ...]:
        before, slot, after = self._render(index, self._logprobs).partition(json.dumps(self.SLOT))
        assert slot and self.SLOT not in after, "the text's placeholder is in the event once"
        if self._logprobs is None:
            return before, after
        middle, slot, end = after.partition(self._logprobs.model_dump_json())
        assert slot, "the logprobs' placeholder comes after the text's"
        return before, middle, end


def _opening(answer: Answer, model: str) -> str:
    """The internal stream's first event: the prompts' ids, the response's id and its choices."""
    return opening(InternalEvent(prompt_ids=answer.prompts[0], prompts=answer.prompts if len(answer.prompts) > 1
                                 else None, choices=answer.count, id=answer.request_id, created=answer.created,
                                 model=model))  # fmt: skip


def _with_ids(event: str, answer: Answer, choice: TextGeneration, delta: Delta) -> str:
    """An SSE data event, followed on the internal stream by the comment line of its choice's token ids."""
    if not answer.internal:
        return event
    cached = choice.cached_to_tell()
    if delta.finish_reason is None:
        return annotated_with(event, token_note(delta.token_ids, choice.chars, choice.index, cached))
    return annotated(event, InternalEvent(ids=list(delta.token_ids), chars=choice.chars, finish=delta.finish_reason,
                                          choice=choice.index, cached=cached))  # fmt: skip


class LogprobsJSON:
    """The JSON of a chunk's logprobs, as the protocol's models write it (``ChatLogprobs``, ``CompletionLogprobs``:
    the same fields in the same order, numbers that parse to the same floats), written from per-token pieces kept
    on first use. Building and serializing a chat entry's six models per token cost the HTTP loop more than the
    rest of the token's way through it; tests/test_internal_stream.py checks the two agree."""

    def __init__(self, token_text: Callable[[int], str], token_bytes: Callable[[int], bytes]) -> None:
        self._text = token_text
        self._bytes = token_bytes
        self._pieces: dict[int, _Piece] = {}

    def chat(self, logprobs: Sequence[tuple[int, TokenLogprobs]]) -> str:
        """``ChatLogprobs(content=[...]).model_dump_json()``: each token with its alternatives."""
        piece, entries = self._piece, []
        for token, lp in logprobs:
            own = piece(token)
            tops = ",".join(f"{p.head}{_number(v)}{p.tail}}}" for p, v in ((piece(t), v) for t, v in lp.top))
            entries.append(f'{own.head}{_number(lp.logprob)}{own.tail},"top_logprobs":[{tops}]}}')
        return f'{{"content":[{",".join(entries)}]}}'

    def completion(self, logprobs: Sequence[tuple[int, TokenLogprobs]], offset: int) -> tuple[str, int]:
        """``CompletionLogprobs(...).model_dump_json()`` for tokens whose text begins at ``offset`` of the
        completion, and the offset after them. ``top_logprobs`` holds the sampled token too, as OpenAI's and
        vLLM's do (a dict by text: alternatives of the same text are one entry, the sampled token's value last)."""
        piece = self._piece
        tokens, values, tops, offsets = [], [], [], []
        for token, lp in logprobs:
            own = piece(token)
            tokens.append(own.name)
            values.append(_number(lp.logprob))
            top = {piece(t).name: v for t, v in lp.top}
            top[own.name] = lp.logprob
            tops.append("{" + ",".join(f"{name}:{_number(v)}" for name, v in top.items()) + "}")
            offsets.append(str(offset))
            offset += own.length
        return (f'{{"tokens":[{",".join(tokens)}],"token_logprobs":[{",".join(values)}],'
                f'"top_logprobs":[{",".join(tops)}],"text_offset":[{",".join(offsets)}]}}'), offset  # fmt: skip

    def _piece(self, token: int) -> _Piece:
        piece = self._pieces.get(token)
        if piece is None:
            text = self._text(token)
            piece = self._pieces[token] = _Piece(encode_basestring(text), len(text),
                                                 ",".join(map(str, self._bytes(token))))  # fmt: skip
        return piece


class _Piece:
    """One token's parts of the JSON: its text as a JSON string, the text's length, and a chat entry's JSON before
    and after its logprob."""

    __slots__ = ("head", "length", "name", "tail")

    def __init__(self, name: str, length: int, raw: str) -> None:
        self.name, self.length = name, length
        self.head, self.tail = f'{{"token":{name},"logprob":', f',"bytes":[{raw}]'


def _number(value: float) -> str:
    """A float as JSON writes it; a NaN or infinity as null, as the models write them."""
    return repr(value) if value - value == 0 else "null"
