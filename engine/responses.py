"""A whole (non-streaming) OpenAI response, assembled from the chunks of its stream.

Both the engine (a client that did not ask for a stream) and the gateway's relays (which always take the
engine's stream, to resume it on another engine) answer a whole response this way, so the two cannot differ:
the chunks' text, logprobs and finish reason per choice, joined in order.
"""

from __future__ import annotations

from typing import Any

from engine.protocol import (
    AssistantMessage,
    ChatCompletionChoice,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    FinishReason,
    Usage,
)


def assemble(chat: bool, chunks: list[dict[str, Any]], id: str, created: int, model: str,
             usage: Usage) -> tuple[int, dict[str, Any]]:  # fmt: skip
    """(status, body) of the response whose stream had these chunks (parsed JSON data events, in order). A chunk
    that is an error (the engine failed the request) is the answer: 500 for a server error, else 503."""
    texts: dict[int, list[str]] = {}
    finishes: dict[int, FinishReason] = {}
    logprobs: dict[int, list[dict[str, Any]]] = {}
    for chunk in chunks:
        if "error" in chunk:
            return (500 if chunk["error"].get("type") == "server_error" else 503), chunk
        for choice in chunk.get("choices", ()):
            index = choice.get("index", 0)
            piece = choice["delta"].get("content") if chat else choice.get("text")
            texts.setdefault(index, []).append(piece or "")
            if choice.get("finish_reason") in ("stop", "length"):
                finishes[index] = choice["finish_reason"]
            if choice.get("logprobs") is not None:
                logprobs.setdefault(index, []).append(choice["logprobs"])
    indexes = sorted(texts) or [0]
    body: ChatCompletionResponse | CompletionResponse
    if chat:
        chat_choices = [
            ChatCompletionChoice(index=i, message=AssistantMessage(content="".join(texts.get(i, ()))),
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
