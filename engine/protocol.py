"""The OpenAI API subset an engine serves, as pydantic models, plus its internal health and drain messages.

Field names and shapes follow the OpenAI spec (as vLLM's server does); unknown request fields are
ignored, like OpenAI does, and options we cannot honour are refused with a 400 instead of ignored.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from engine.grammar import Grammar, GrammarSpec
from engine.sampling_params import MAX_LOGPROBS, SamplingParams
from engine.tools import grammar_text as tool_grammar
from engine.tools import render_call, render_result
from engine.tools import system_prompt as tool_system_prompt

FinishReason = Literal["stop", "length", "tool_calls"]


def random_id(prefix: str) -> str:
    """An OpenAI-style object id: prefix-<hex>."""
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


# --- errors -----------------------------------------------------------------------------------------------------


class ErrorInfo(OpenAIModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(OpenAIModel):
    error: ErrorInfo


# --- models -----------------------------------------------------------------------------------------------------


class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "warmgate"
    root: str | None = None
    max_model_len: int | None = None  # extension (vLLM has it too): the context the engine serves


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# --- requests ---------------------------------------------------------------------------------------------------


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class ContentPart(OpenAIModel):
    type: str
    text: str | None = None


class ToolCallFunction(OpenAIModel):
    name: str
    arguments: str  # JSON text


class ToolCallItem(OpenAIModel):
    """A tool call: in an assistant message, given back in the conversation, or in an answer."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallItem] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's result: the call it answers

    @field_validator("content")
    @classmethod
    def _text_only(cls, content: str | list[ContentPart] | None) -> str | list[ContentPart] | None:
        if isinstance(content, list):
            for part in content:
                if part.type != "text" or part.text is None:
                    raise ValueError(f"only text content parts are supported, got type {part.type!r}")
        return content

    def text(self) -> str:
        """The content as one string: text parts joined by newlines, as vLLM does for text-only templates."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text or "" for part in self.content)


MAX_CHOICES = 16  # choices per request (n times the prompts): each one is a sequence in the engine's batch


class ChoiceResume(OpenAIModel):
    """Where one choice of a request with several stood when its engine failed."""

    index: int = Field(ge=0, lt=MAX_CHOICES)
    output_ids: list[int] = Field(default_factory=list)
    chars: int = Field(0, ge=0)
    finished: bool = False  # its last event reached the client: nothing more to generate
    cached_tokens: int | None = Field(None, ge=0)  # its prompt's tokens found cached where it began, if known


class Resume(OpenAIModel):
    """Internal, gateway -> engine: continue a request whose engine failed, from what the client has.

    The engine skips tokenizing, prefills ``prompt_ids + output_ids`` and samples on from there; its
    text continues after the ``chars`` characters the client already received (text decoded but held
    back is sent again, as it never reached the client).
    """

    id: str
    created: int
    prompt_ids: Annotated[list[int], Field(min_length=1)]
    output_ids: list[int]
    chars: int = Field(ge=0)
    started: bool = False  # the client has the stream's first events (a chat's role chunks, an echo)
    prompts: list[Annotated[list[int], Field(min_length=1)]] | None = None  # a request with several prompts: all
    choices: list[ChoiceResume] | None = None  # a request with several choices: each one's (not the fields above)
    cached_tokens: int | None = Field(None, ge=0)  # the prompt's tokens found cached where it began, if known


class InternalEvent(OpenAIModel):
    """The comment line after an internal SSE event: token ids and text so far, for a resume."""

    ids: list[int] = []  # tokens consumed since the previous event
    chars: int = 0  # characters of text sent, this event included
    finish: FinishReason | None = None
    choice: int = 0  # the choice the event is of
    cached: int | None = None  # a choice's first note: its prompt's tokens found cached (usage's cached_tokens)
    prompt_ids: list[int] | None = None  # on the stream's first event only, with the response's id and model
    prompts: list[list[int]] | None = None  # the first event of a request with several prompts: all of them
    choices: int = 1  # the first event: how many choices the response has
    id: str | None = None
    created: int | None = None
    model: str | None = None


class JsonSchemaFormat(OpenAIModel):
    name: str = Field("response", max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    """What the answer must be: free text, any JSON object, or JSON by a schema (held to it token by token)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("a response_format of type json_schema needs its json_schema")
        return self

    def grammar(self) -> GrammarSpec | None:
        if self.type == "text":
            return None
        if self.json_schema is not None and self.json_schema.json_schema is not None:
            return GrammarSpec.of_schema(self.json_schema.json_schema)
        return GrammarSpec("json_object")  # json_object, or a json_schema without its schema


class SamplingRequest(OpenAIModel):
    """Fields chat and text completions share."""

    model: str | None = None  # OpenAI requires it; an engine serves one model, so leaving it out is fine
    max_tokens: int | None = Field(None, ge=1)
    # Optional fields accept an explicit null, which some clients send for "default".
    temperature: float | None = Field(None, ge=0, le=2)  # default 1.0, as OpenAI's
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # extension; 0 or -1 (vLLM's spelling) turns it off
    n: int | None = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    ignore_eos: bool = False  # extension
    user: str | None = None
    logit_bias: dict[str, float] | None = None  # OpenAI's: refused unless empty (not honoured)
    response_format: ResponseFormat | None = None  # vLLM takes it on text completions too
    warmgate_resume: Resume | None = None  # internal: set by the gateway only (it drops a client's)

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        if bias:
            raise ValueError("logit_bias is not supported")
        return bias

    def stop_strings(self) -> list[str]:
        """The stop strings, empty ones dropped."""
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return [s for s in stops if s]

    def requested_max_tokens(self) -> int | None:
        """The completion length the client asked for, if any."""
        return self.max_tokens

    def requested_logprobs(self) -> int | None:
        """How many alternatives each token's logprobs list, if the client asked for logprobs."""
        return None

    def requested_prompt_logprobs(self) -> int | None:
        """The same for the prompt's tokens (an echo with logprobs)."""
        return None

    def grammar(self) -> GrammarSpec | None:
        """What the answer is held to (response_format), if anything."""
        return self.response_format.grammar() if self.response_format is not None else None

    def include_usage(self) -> bool:
        """Whether a stream should end with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, max_tokens: int, grammar: Grammar | None = None, choice: int = 0) -> SamplingParams:
        """The engine's sampling settings for this request's choice ``choice`` (max_tokens resolved and grammar
        compiled by the server); a seeded request's choices draw from seed + choice, so that they differ."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(self.top_k or 0, 0),
            seed=None if self.seed is None else self.seed + choice,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=self.requested_logprobs(),
            prompt_logprobs=self.requested_prompt_logprobs(),
            grammar=grammar,
        )


class FunctionDefinition(OpenAIModel):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(OpenAIModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI's parameters this server does not honour: refused (400 naming them) unless they ask for nothing.
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _with_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top and not info.data.get("logprobs"):
            raise ValueError("logprobs must be true when top_logprobs is used")
        return top

    @field_validator("functions")
    @classmethod
    def _no_functions(cls, functions: list[Any] | None) -> list[Any] | None:
        if functions:
            raise ValueError("functions (deprecated) is not supported: use tools")
        return functions

    @field_validator("function_call")
    @classmethod
    def _no_function_call(cls, choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        if choice not in (None, "none"):
            raise ValueError("function_call (deprecated) is not supported: use tool_choice")
        return choice

    @field_validator("tool_choice")
    @classmethod
    def _choice_among_tools(cls, choice: Any, info: ValidationInfo) -> Any:
        tools = info.data.get("tools") or []
        if choice in ("auto", "required") and not tools:
            raise ValueError(f"tool_choice {choice!r} needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in [t.function.name for t in tools]:
            raise ValueError(f"tool_choice names the function {choice.function.name!r}, which is not among the tools")
        return choice

    @model_validator(mode="after")
    def _tools_or_a_format(self) -> ChatCompletionRequest:
        if self.tool_mode() is not None and self.response_format is not None and self.response_format.type != "text":
            raise ValueError("a response_format cannot be combined with tools the answer may call (tool_choice none)")
        return self

    def tool_mode(self) -> tuple[Literal["auto", "required", "named"], list[dict[str, Any]]] | None:
        """How the answer may call tools, and the functions it may call: None when it calls none (no tools, or
        tool_choice none). Tools given without a tool_choice are ``auto``, as in OpenAI's API."""
        choice = self.tool_choice
        if not self.tools or choice == "none":
            return None
        functions = [t.function.model_dump(exclude_none=True) for t in self.tools]
        if isinstance(choice, NamedToolChoice):
            return "named", [f for f in functions if f["name"] == choice.function.name]
        return ("required" if choice == "required" else "auto"), functions

    def grammar(self) -> GrammarSpec | None:
        tools = self.tool_mode()
        if tools is None:
            return super().grammar()
        kind, text = tool_grammar(tools[1], tools[0], self.parallel_tool_calls is not False)
        return GrammarSpec(kind, text)  # type: ignore[arg-type]

    @field_validator("prediction", "audio")
    @classmethod
    def _not_supported(cls, value: dict[str, Any] | None, info: ValidationInfo) -> dict[str, Any] | None:
        if value is not None:
            raise ValueError(f"{info.field_name} is not supported")
        return value

    @field_validator("modalities")
    @classmethod
    def _text_modality(cls, modalities: list[str] | None) -> list[str] | None:
        if modalities is not None and set(modalities) - {"text"}:
            raise ValueError("modalities other than text are not supported")
        return modalities

    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens wins over the deprecated max_tokens, as in OpenAI's API."""
        return self.max_completion_tokens or self.max_tokens

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as the chat template expects them: role and string content. Tools the answer may call are
        described in a system message; earlier calls and their results are written as the model writes them
        (engine/tools.py)."""
        out: list[dict[str, Any]] = []
        for message in self.messages:
            content = message.text()
            if message.role == "assistant" and message.tool_calls:
                calls = [render_call(c.function.name, c.function.arguments) for c in message.tool_calls]
                content = "\n".join([content, *calls] if content else calls)
            if message.role == "tool":
                out.append({"role": "user", "content": render_result(content)})
                continue
            item: dict[str, Any] = {"role": message.role, "content": content}
            if message.name is not None:
                item["name"] = message.name
            out.append(item)
        tools = self.tool_mode()
        if tools is not None:
            described = tool_system_prompt(tools[1])
            if out and out[0]["role"] in ("system", "developer"):
                out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{described}"}
            else:
                out.insert(0, {"role": "system", "content": described})
        return out


# A completion's prompt: text, token ids, or a list of either. Tried in this order, token ids strictly (JSON integers:
# neither "12" nor 1.0 nor true is a token id): a smart union tries every member and took ~0.5 ms for 2,000 ids, on
# the HTTP loop that shares the step loop's GIL; left to right it takes a seventh of that.
Prompt = Annotated[str | list[StrictInt] | list[list[StrictInt]] | list[str], Field(union_mode="left_to_right")]


class CompletionRequest(SamplingRequest):
    prompt: Prompt
    max_tokens: int | None = Field(None, ge=0)  # 0: only the prompt, scored (echo)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @field_validator("prompt")
    @classmethod
    def _some_prompt(cls, prompt: str | list[str] | list[int] | list[list[int]]) -> Any:
        if isinstance(prompt, list) and not prompt:
            raise ValueError("prompt must not be empty")
        return prompt

    def prompt_count(self) -> int:
        """How many prompts: a list of strings or of token-id lists is several."""
        prompt = self.prompt
        return len(prompt) if isinstance(prompt, list) and not isinstance(prompt[0], int) else 1

    @model_validator(mode="after")
    def _choices_within_the_limit(self) -> CompletionRequest:
        if (self.n or 1) * self.prompt_count() > MAX_CHOICES:
            raise ValueError(f"n ({self.n}) times the {self.prompt_count()} prompts passes {MAX_CHOICES} choices")
        return self

    @model_validator(mode="after")
    def _nothing_only_with_echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 asks for nothing: it needs echo (to score the prompt)")
        return self

    def echoes(self) -> bool:
        """Whether the prompt is echoed now: asked, and not already sent by the engine a resumed request left."""
        return self.echo and not (self.warmgate_resume is not None and self.warmgate_resume.started)

    def prompt_text(self, index: int = 0) -> str | None:
        """Prompt ``index`` as the client wrote it, when it was text."""
        if isinstance(self.prompt, str):
            return self.prompt
        return self.prompt[index] if isinstance(self.prompt[index], str) else None  # type: ignore[return-value]

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> str | None:
        if suffix:
            raise ValueError("suffix is not supported")
        return suffix

    @field_validator("best_of")
    @classmethod
    def _best_of_n(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        if best_of is not None and best_of != (info.data.get("n") or 1):
            raise ValueError("best_of other than n is not supported (every choice generated is returned)")
        return best_of

    def requested_logprobs(self) -> int | None:
        return self.logprobs

    def requested_prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echoes() else None


# --- responses --------------------------------------------------------------------------------------------------


class PromptTokensDetails(OpenAIModel):
    cached_tokens: int = 0  # prompt tokens whose keys and values came from the prefix cache


class Usage(OpenAIModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
        """Usage with the total and the cached prompt tokens filled in."""
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


def cached_prompt_tokens(cached: Mapping[int, int | None], prompts: int, n: int) -> int:
    """A response's cached prompt tokens (``usage.prompt_tokens_details.cached_tokens``) from each choice's: the
    tokens of its prompt it found in the prefix cache when it was admitted (``cached``, by choice index; None or
    missing: none). Each prompt counts once, as in ``prompt_tokens``: by the fewest of its n choices, since the
    choices after the first take the blocks the first computed."""
    return sum(min(cached.get(p * n + i) or 0 for i in range(n)) for p in range(prompts))


class TopLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(OpenAIModel):
    """A chat choice's logprobs: one entry per token of its content."""

    content: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(OpenAIModel):
    """A text completion choice's logprobs, in the legacy shape: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class AssistantMessage(OpenAIModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallItem] | None = None

    @model_serializer(mode="wrap")
    def _omit_absent(self, handler: SerializerFunctionWrapHandler) -> Any:
        return _without_nulls(self, handler, ("tool_calls",))


class DeltaFunction(OpenAIModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OpenAIModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction


class ChatCompletionChoice(OpenAIModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason | None
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(OpenAIModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: Usage


def _without_nulls(model: BaseModel, handler: SerializerFunctionWrapHandler, fields: tuple[str, ...]) -> Any:
    data = handler(model)
    return {k: v for k, v in data.items() if not (k in fields and v is None)}


class DeltaMessage(OpenAIModel):
    """What a chunk adds; absent fields are left out of the JSON, as OpenAI does."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _omit_absent(self, handler: SerializerFunctionWrapHandler) -> Any:
        return _without_nulls(self, handler, ("role", "content", "tool_calls"))


class ChatCompletionChunkChoice(OpenAIModel):
    index: int = 0
    delta: DeltaMessage
    finish_reason: FinishReason | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(OpenAIModel):
    """One SSE event of a chat stream; usage appears only on the last one, when the client asked for it."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionChunkChoice]
    usage: Usage | None = None

    @model_serializer(mode="wrap")
    def _omit_absent(self, handler: SerializerFunctionWrapHandler) -> Any:
        return _without_nulls(self, handler, ("usage",))


class CompletionChoice(OpenAIModel):
    index: int = 0
    text: str
    finish_reason: FinishReason | None
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(OpenAIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(OpenAIModel):
    """One SSE event of a text completion stream (OpenAI reuses the text_completion object)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None

    @model_serializer(mode="wrap")
    def _omit_absent(self, handler: SerializerFunctionWrapHandler) -> Any:
        return _without_nulls(self, handler, ("usage",))


# --- internal API (the supervisor's side) -----------------------------------------------------------------------


class WeightsInfo(OpenAIModel):
    source: Literal["disk", "ipc"]
    key: str | None = None  # the cache key, when attached
    lease: int | None = None
    fallbacks: int = 0  # 1 when ipc-or-disk loaded from disk instead of the cache
    fallback_reason: str | None = None
    attach_phases: dict[str, float] = Field(default_factory=dict)  # seconds: key, connect, attach, map, bind


class HealthResponse(OpenAIModel):
    status: Literal["ok", "draining", "dead"]
    running: int
    waiting: int
    in_flight: int
    preemptions: int = 0  # sequences whose KV blocks were taken back for others (recomputed later)
    prefix_cache_queries: int = 0  # tokens of the sequences admitted since the engine started (vLLM's names)
    prefix_cache_hits: int = 0  # those of them taken from the prefix cache, not computed
    kv_blocks_free: int = 0
    kv_blocks_total: int = 0
    device_memory_bytes: int = 0  # what this process holds on its GPU (CUDA context and graphs aside): 0 on CPU
    private_memory_bytes: int = 0  # its private resident memory (RssAnon): the cache's weights are not in it
    max_num_seqs: int = 0  # as planned at start-up (engine/memory_plan.py); 0: an engine from before the plan
    max_model_len: int = 0
    memory: dict[str, Any] = Field(default_factory=dict)  # the plan: KV cache budget and bytes, device memory shares
    weights: WeightsInfo
    startup_phases: dict[str, float]  # seconds: tokenizer, device_init, weight_load, ..., deep_gemm, ..., server_warmup


class DrainRequest(OpenAIModel):
    timeout: float | None = Field(None, ge=0)  # seconds; none waits until every in-flight request is done


class ActivateRequest(OpenAIModel):
    timeout: float = Field(default=30.0, ge=0)  # seconds the KV cache's commit may wait for device memory


class ActivateReport(OpenAIModel):
    seconds: float  # the commit of the KV cache's memory (0: nothing to commit)


class DrainReport(OpenAIModel):
    drained: bool
    in_flight_at_start: int
    remaining: int
    seconds: float
