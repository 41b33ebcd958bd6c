"""Tool calling: tools described to the model, its calls held to their schemas, and read back out of its text.

One mechanism for every model: the tools are described in a system message in the Hermes format (the
format Qwen, Hermes and many open models are trained on), whatever the model's chat template says, and a
call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. Earlier calls and their results in the
conversation are written the same way (results as ``<tool_response>`` in a user turn, which every template
accepts). What the model may write follows ``tool_choice``:

* ``auto``: free text, in which a call, once begun with ``<tool_call>``, must follow one tool's schema
  (an xgrammar structural tag);
* ``required``: only calls (a JSON list of them, or one when ``parallel_tool_calls`` is false);
* a named function: only a call to it.

The calls are cut out of the text as it is generated (``ToolCallText``): text before a call is streamed as
content, a call is held until the answer ends and then sent whole as ``tool_calls``, with finish reason
``tool_calls``.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

BEGIN, END = "<tool_call>", "</tool_call>"
_CALLS = re.compile(re.escape(BEGIN) + r"(.*?)" + re.escape(END), re.S)

Mode = Literal["auto", "required", "named"]


@dataclass(frozen=True)
class ToolCall:
    """A call the model made: a function's name and its arguments (JSON text)."""

    id: str
    name: str
    arguments: str


def call_schema(function: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema of one call to ``function`` (an OpenAI function definition)."""
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": function["name"]}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False}  # fmt: skip


def grammar_text(functions: list[dict[str, Any]], mode: Mode, parallel: bool) -> tuple[str, str]:
    """(kind, text) of the grammar the answer is held to: a structural tag for ``auto``, a JSON schema else
    (``functions``: the ones the model may call; one for ``named``)."""
    calls = [call_schema(f) for f in functions]
    one: dict[str, Any] = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if mode == "auto":
        tag = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": [BEGIN], "tags": [
            {"begin": BEGIN, "content": {"type": "json_schema", "json_schema": one}, "end": END}]}}  # fmt: skip
        return "structural_tag", json.dumps(tag)
    if mode == "required" and parallel:
        return "json_schema", json.dumps({"type": "array", "items": one, "minItems": 1})
    return "json_schema", json.dumps(one)


def system_prompt(functions: list[dict[str, Any]]) -> str:
    """What the model is told about the tools it may call."""
    described = "\n".join(json.dumps({"type": "function", "function": f}) for f in functions)
    example = '{"name": <function-name>, "arguments": <args-json-object>}'
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{described}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            f"{BEGIN}{END} XML tags:\n{BEGIN}\n{example}\n{END}")  # fmt: skip


def render_call(name: str, arguments: str) -> str:
    """An earlier call in the conversation, as the model writes one."""
    try:
        parsed: Any = json.loads(arguments)
    except ValueError:
        parsed = arguments
    return f"{BEGIN}\n{json.dumps({'name': name, 'arguments': parsed})}\n{END}"


def render_result(content: str) -> str:
    """A tool's result, as the user turn that brings it."""
    return f"<tool_response>\n{content}\n</tool_response>"


class ToolCallText:
    """Cuts the calls out of an answer's text as it comes: ``feed`` returns the text to show now, ``finish`` the
    rest and the calls. In ``auto`` mode text before a call is shown (a possible start of one is held back);
    otherwise the whole answer is the calls."""

    def __init__(self, mode: Mode, parallel: bool) -> None:
        self.mode, self.parallel = mode, parallel
        self._held = ""
        self._in_call = mode != "auto"

    def feed(self, text: str) -> str:
        text, self._held = self._held + text, ""
        if self._in_call:
            self._held = text
            return ""
        at = text.find(BEGIN)
        if at >= 0:
            self._in_call, self._held = True, text[at:]
            return text[:at]
        keep = next((n for n in range(min(len(BEGIN) - 1, len(text)), 0, -1) if BEGIN.startswith(text[-n:])), 0)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep]

    def finish(self, text: str) -> tuple[str, list[ToolCall]]:
        """The text still to show and the calls, once the answer is complete. Text that is not a well-formed call
        (an answer cut by max_tokens, say) is shown as text."""
        shown = self.feed(text)
        held, self._held = self._held, ""
        calls = self._parse(held)
        if calls is None:
            return shown + held, []
        if self.mode == "auto":
            shown += _CALLS.sub("", held).strip()
        return shown, calls

    def _parse(self, held: str) -> list[ToolCall] | None:
        try:
            if self.mode == "auto":
                found = [json.loads(body) for body in _CALLS.findall(held)]
            else:
                value = json.loads(held)
                found = value if isinstance(value, list) else [value]
        except ValueError:
            return None
        if not found or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in found):
            return None
        return [ToolCall(f"call_{uuid.uuid4().hex[:24]}", c["name"], json.dumps(c.get("arguments", {})))
                for c in found]  # fmt: skip
