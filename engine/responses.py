"""A whole (non-streaming) OpenAI response, assembled from the chunks of its stream; and the JSON of a chunk's
logprobs, written without the models.

Both the engine (a client that did not ask for a stream) and the gateway's relays (which always take the
engine's stream, to resume it on another engine) answer a whole response this way, so the two cannot differ:
the chunks' text, logprobs and finish reason per choice, joined in order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from json.encoder import encode_basestring  # json.dumps's own string encoder (ensure_ascii=False), in C
from typing import TYPE_CHECKING, Any

from engine.protocol import (
    AssistantMessage,
    ChatCompletionChoice,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    FinishReason,
    ToolCallFunction,
    ToolCallItem,
    Usage,
)

if TYPE_CHECKING:
    from engine.request_stream import TokenLogprobs


def assemble(chat: bool, chunks: list[dict[str, Any]], id: str, created: int, model: str,
             usage: Usage) -> tuple[int, dict[str, Any]]:  # fmt: skip
    """(status, body) of the response whose stream had these chunks (parsed JSON data events, in order). A chunk
    that is an error (the engine failed the request) is the answer: 500 for a server error, else 503."""
    texts: dict[int, list[str]] = {}
    finishes: dict[int, FinishReason] = {}
    logprobs: dict[int, list[dict[str, Any]]] = {}
    calls: dict[int, dict[int, dict[str, Any]]] = {}  # choice -> call index -> the call, its deltas merged
    for chunk in chunks:
        if "error" in chunk:
            return (500 if chunk["error"].get("type") == "server_error" else 503), chunk
        for choice in chunk.get("choices", ()):
            index = choice.get("index", 0)
            piece = choice["delta"].get("content") if chat else choice.get("text")
            texts.setdefault(index, []).append(piece or "")
            if choice.get("finish_reason") in ("stop", "length", "tool_calls"):
                finishes[index] = choice["finish_reason"]
            for call in (choice["delta"].get("tool_calls") or ()) if chat else ():
                _merge(calls.setdefault(index, {}), call)
            if choice.get("logprobs") is not None:
                logprobs.setdefault(index, []).append(choice["logprobs"])
    indexes = sorted(texts) or [0]
    body: ChatCompletionResponse | CompletionResponse
    if chat:
        chat_choices = [
            ChatCompletionChoice(index=i, message=_message("".join(texts.get(i, ())), calls.get(i)),
                                 finish_reason=finishes.get(i, "stop"),
                                 logprobs=_chat_logprobs(logprobs.get(i)))
            for i in indexes
        ]
        body = ChatCompletionResponse(id=id, created=created, model=model, choices=chat_choices, usage=usage)
    else:
        text_choices = [
            CompletionChoice(index=i, text="".join(texts.get(i, ())),
                             finish_reason=finishes.get(i, "stop"),
                             logprobs=_completion_logprobs(logprobs.get(i)))
            for i in indexes
        ]
        body = CompletionResponse(id=id, created=created, model=model, choices=text_choices, usage=usage)
    return 200, body.model_dump(mode="json")


def _merge(calls: dict[int, dict[str, Any]], delta: dict[str, Any]) -> None:
    """Fold one ``delta.tool_calls`` entry into the calls: id and name come once, arguments in pieces."""
    call = calls.setdefault(delta.get("index", 0), {"id": "", "name": "", "arguments": ""})
    function = delta.get("function") or {}
    call["id"] = delta.get("id") or call["id"]
    call["name"] += function.get("name") or ""
    call["arguments"] += function.get("arguments") or ""


def _message(text: str, calls: dict[int, dict[str, Any]] | None) -> AssistantMessage:
    if not calls:
        return AssistantMessage(content=text)
    items = [ToolCallItem(id=c["id"], function=ToolCallFunction(name=c["name"], arguments=c["arguments"]))
             for _, c in sorted(calls.items())]  # fmt: skip
    return AssistantMessage(content=text or None, tool_calls=items)


def _chat_logprobs(parts: list[dict[str, Any]] | None) -> ChatLogprobs | None:
    if parts is None:
        return None
    return ChatLogprobs(content=[entry for part in parts for entry in part.get("content") or ()])


def _completion_logprobs(parts: list[dict[str, Any]] | None) -> CompletionLogprobs | None:
    if parts is None:
        return None
    whole = CompletionLogprobs()
    for part in parts:
        whole.tokens += part.get("tokens", ())
        whole.token_logprobs += part.get("token_logprobs", ())
        whole.top_logprobs += part.get("top_logprobs", ())
        whole.text_offset += part.get("text_offset", ())
    return whole


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
