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
    ToolCallFunction,
    ToolCallItem,
    Usage,
)


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
            ChatCompletionChoice(
                index=i,
                message=_message("".join(texts.get(i, ())), calls.get(i)),
                finish_reason=finishes.get(i, "stop"),
                logprobs=_chat_logprobs(logprobs.get(i)),
            )
            for i in indexes
        ]
        body = ChatCompletionResponse(id=id, created=created, model=model, choices=chat_choices, usage=usage)
    else:
        text_choices = [
            CompletionChoice(
                index=i,
                text="".join(texts.get(i, ())),
                finish_reason=finishes.get(i, "stop"),
                logprobs=_completion_logprobs(logprobs.get(i)),
            )
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
