"""The engine worker's HTTP API: the OpenAI subset, /health and /drain, served from one LLMEngine.

Request admission (prompts, grammars, choices submitted to the engine, in-flight requests counted so a drain
can wait for them) and the routes. An answer's chunks are written by engine/chunks.py from its text deltas
(engine/text.py), a whole response is assembled from them (engine/responses.py), and the gateway's internal
stream adds comment lines to them (engine/internal_stream.py).

The generation routes are a bare ASGI app (``EngineApp``), as the relays' are: the body parsed by pydantic from its
JSON, the answer written with uvicorn's ``send``, no framework code per request or per token (this loop shares the
GIL with the engine's step loop; bench/engine_host.py, docs/benchmarks.md). The rest is a FastAPI app.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import mmap
import os
import time
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Literal, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from common.disconnect import cancelled_on_disconnect
from engine.chunks import ChunkWriter
from engine.grammar import Grammar, GrammarError, Grammars
from engine.internal_stream import RESUMABLE_HEADER
from engine.protocol import (
    ActivateReport,
    ActivateRequest,
    ChatCompletionRequest,
    ChoiceResume,
    CompletionRequest,
    DrainReport,
    DrainRequest,
    ErrorInfo,
    ErrorResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    Resume,
    SamplingRequest,
    WeightsInfo,
    random_id,
)
from engine.responses import assemble
from engine.text import Answer, TextGeneration
from engine.tokenizer import ChatTemplateError, ChatTokenizer
from engine.tools import ToolCallText

if TYPE_CHECKING:
    from common.heartbeat import Heartbeat
    from engine.config import EngineConfig
    from engine.request_stream import RequestStream
    from engine.sampling_params import SamplingParams
    from engine.weights import WeightOrigin

log = logging.getLogger("warmgate.engine.server")


class ServingEngine(Protocol):
    """What the HTTP API needs of an engine, whatever its backend (engine/native/, engine/vllm/)."""

    config: EngineConfig
    max_num_seqs: int
    max_model_len: int
    memory: dict[str, Any]  # the memory plan, as /health shows it
    eos_token_ids: list[int]
    startup_phases: dict[str, float]

    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
               output_ids: list[int] | None = None) -> RequestStream: ...  # fmt: skip

    def start(self, heartbeat: Heartbeat | None = None) -> None: ...

    async def refresh(self) -> None: ...  # bring the figures below up to date (an engine in another process)

    def activate(self, timeout: float) -> Future[float]: ...  # commit what is only reserved; seconds it took

    def stop(self) -> None: ...

    def device_memory_bytes(self) -> int: ...

    def private_memory_bytes(self) -> int: ...  # RssAnon of the processes serving it: the cache's weights are not in it

    @property
    def vocab_size(self) -> int: ...  # the model's (its outputs may lie beyond the tokenizer's vocabulary)

    @property
    def weight_origin(self) -> WeightOrigin: ...

    @property
    def alive(self) -> bool: ...

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def num_preemptions(self) -> int: ...

    @property
    def prefix_cache(self) -> tuple[int, int]:
        """Tokens queried and found in the prefix cache since the engine started."""
        ...

    @property
    def kv_blocks_free(self) -> int: ...

    @property
    def kv_blocks_total(self) -> int: ...


class ApiError(Exception):
    """An error for the client, rendered in the OpenAI error shape with its HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)


def error_response(error: ApiError) -> JSONResponse:
    """The OpenAI error body for an ApiError."""
    return JSONResponse(ErrorResponse(error=error.info).model_dump(mode="json"), status_code=error.status)


def _draining_error() -> ApiError:
    return ApiError(503, "the engine is draining and accepts no new requests", "service_unavailable", None, "draining")


class FrontBoard:
    """What an engine's front processes share (engine/front.py): a draining flag and each front's count of requests
    in flight, in an anonymous shared mapping the worker makes before it forks them. Each front writes its own slot
    (``index``); any of them reads them all, so a drain asked of one is the engine's and /health counts every
    front's requests."""

    def __init__(self, fronts: int) -> None:
        self.index = 0  # this process's slot: each front sets its own after the fork
        self._slots = memoryview(mmap.mmap(-1, 8 * (fronts + 1))).cast("q")  # MAP_SHARED: forks share it

    @property
    def draining(self) -> bool:
        return self._slots[0] != 0

    def drain(self) -> None:
        self._slots[0] = 1

    def count(self, in_flight: int) -> None:
        self._slots[self.index + 1] = in_flight

    def total(self) -> int:
        return sum(self._slots[1:])


DRAIN_POLL_S = 0.01  # how often a drain looks at the other fronts' counts once its own requests are done


class Admission:
    """Counts in-flight requests; once draining, refuses new ones and lets drain() wait for the count to reach 0.
    With a ``board`` (several front processes), the flag and the count are the engine's: every front's."""

    def __init__(self, board: FrontBoard | None = None) -> None:
        self._own = 0
        self._draining = False
        self._board = board
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def draining(self) -> bool:
        return self._draining or (self._board is not None and self._board.draining)

    @property
    def in_flight(self) -> int:
        return self._own if self._board is None else self._board.total()

    def enter(self) -> None:
        """Admit a request, or raise the 503 a draining engine answers."""
        if self.draining:
            raise _draining_error()
        self._own += 1
        if self._board is not None:
            self._board.count(self._own)
        self._idle.clear()

    def leave(self) -> None:
        """A request admitted by enter() is done (its response, stream included, has ended)."""
        self._own -= 1
        if self._board is not None:
            self._board.count(self._own)
        if self._own == 0:
            self._idle.set()

    async def drain(self, timeout: float | None) -> DrainReport:
        """Stop admitting, then wait (at most timeout seconds) until no request is in flight."""
        self._draining = True
        if self._board is not None:
            self._board.drain()
        start = time.monotonic()
        at_start = self.in_flight
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout)
            while self.in_flight and (timeout is None or time.monotonic() - start < timeout):
                await asyncio.sleep(DRAIN_POLL_S)  # the other fronts' requests: they say nothing when they end
        remaining = self.in_flight
        return DrainReport(
            drained=remaining == 0,
            in_flight_at_start=at_start,
            remaining=remaining,
            seconds=round(time.monotonic() - start, 3),
        )


class ClientGone(Exception):
    """The client closed the connection before its (non-streaming) answer was ready."""


async def _disconnected(receive: Receive) -> None:
    """Return once the client has closed the connection (the request body is already read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _body(receive: Receive) -> bytes:
    """The request's body, whole."""
    parts = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        parts.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(parts)


def _validation_message(errors: Sequence[Any]) -> tuple[str, str | None]:
    """One line naming each invalid field (pydantic's or FastAPI's errors), and the first one as the error's param."""
    parts: list[str] = []
    param: str | None = None
    for error in errors:
        if error.get("type") == "json_invalid":
            return f"the request body is not valid JSON: {error.get('ctx', {}).get('error', 'parse error')}", None
        loc = [str(p) for p in error.get("loc", ()) if p != "body"]
        msg = str(error.get("msg", "invalid")).removeprefix("Value error, ")
        parts.append(f"{'.'.join(loc)}: {msg}" if loc else msg)
        if param is None and loc:
            param = loc[0]
    return "; ".join(dict.fromkeys(parts)), param


class EngineAPI:
    """What the routes do: admission, prompt checks, submission to the engine, responses and streams."""

    def __init__(self, engine: ServingEngine, tokenizer: ChatTokenizer, board: FrontBoard | None = None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.chunks = ChunkWriter(tokenizer, engine.config.name)
        self.admission = Admission(board)
        self.model_name = engine.config.name
        self._grammars: asyncio.Future[Grammars] | None = None
        # Test-only fault: a request with this `user` makes the worker exit (a poison request).
        self.crash_user = os.environ.get("WARMGATE_TEST_CRASH_USER") or None

    def check_model(self, model: str | None) -> None:
        """404 unless the request names this engine's model (or none)."""
        if model is not None and model != self.model_name:
            raise ApiError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")

    def max_tokens(self, prompt_len: int, requested: int | None, prompt_param: str) -> int:
        """The completion budget: what was asked, or the default capped by the context that is left."""
        limit = self.engine.max_model_len
        room = limit - prompt_len
        if room < 1:
            raise ApiError(
                400,
                f"This model's maximum context length is {limit} tokens, but the prompt has {prompt_len} tokens "
                f"and leaves no room for a completion. Please shorten the prompt.",
                param=prompt_param,
            )
        if requested is None:
            return min(self.engine.config.default_max_tokens, room)
        if requested > room:
            raise ApiError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the completion). "
                f"Please reduce the length of the prompt or max_tokens.",
                param="max_tokens",
            )
        return requested

    async def grammar(self, request: SamplingRequest) -> Grammar | None:
        """The request's compiled grammar (its response_format), if it has one; compiled in a worker thread, and a
        schema that cannot be compiled is a 400. The compiler is built at the first request that needs one."""
        spec = request.grammar()
        if spec is None:
            return None
        if self._grammars is None:
            tokenizer, engine = self.tokenizer, self.engine
            self._grammars = asyncio.ensure_future(
                asyncio.to_thread(Grammars, tokenizer, engine.vocab_size, engine.eos_token_ids)
            )
        grammars = await asyncio.shield(self._grammars)
        try:
            return await asyncio.to_thread(grammars.compile, spec)
        except GrammarError as exc:
            tools = isinstance(request, ChatCompletionRequest) and request.tool_mode() is not None
            raise ApiError(400, str(exc), param="tools" if tools else "response_format") from None

    def admit(self, request: SamplingRequest, prompts: list[list[int]], prompt_param: str, id_prefix: str,
              internal: bool = False, grammar: Grammar | None = None) -> Answer:  # fmt: skip
        """Check the request, admit it and submit its choices (n per prompt); end it with release() (stream() does).

        ``internal``: the gateway asked for the internal stream (token ids with every event); ``grammar``: what
        the answer is held to (``grammar()`` compiled it). A resumed request submits the choices it has not
        finished, each from its own tokens.
        """
        if self.crash_user is not None and request.user == self.crash_user:
            log.error("event=test_fault user=%s: exiting as asked by WARMGATE_TEST_CRASH_USER", request.user)
            os._exit(70)
        resume, n = request.warmgate_resume, request.n or 1
        budgets = [self.max_tokens(len(p), request.requested_max_tokens(), prompt_param) for p in prompts]
        request_id, created = (resume.id, resume.created) if resume else (random_id(id_prefix), int(time.time()))
        answer = Answer(request_id, created, prompts, n * len(prompts), [], internal,
                        started_before=bool(resume and resume.started))  # fmt: skip
        states = _choice_states(resume)
        stops = request.stop_strings()
        try:
            for index in range(answer.count):
                state = states.get(index)
                if state is not None and state.finished:
                    answer.done_tokens += len(state.output_ids)
                    answer.done_cached[index] = state.cached_tokens
                    continue
                prompt = prompts[index // n]
                params = request.sampling_params(budgets[index // n], grammar, index)
                output = state.output_ids if state is not None else None
                stream = self.engine.submit(prompt, params, f"{answer.request_id}-{index}", output)
                hidden = {*self.engine.eos_token_ids, *self.tokenizer.eos_token_ids, *params.stop_token_ids}
                tools = None
                if isinstance(request, ChatCompletionRequest) and (mode := request.tool_mode()) is not None:
                    tools = ToolCallText(mode[0], request.parallel_tool_calls is not False)
                text = TextGeneration(index, prompt, stream, self.tokenizer, stops, hidden, state, tools)
                answer.choices.append(text)
        except BaseException as exc:
            self.release(answer)
            if isinstance(exc, ValueError):
                raise ApiError(400, str(exc)) from exc
            raise
        return answer

    def release(self, answer: Answer) -> None:
        """End an admitted request: cancel what is unfinished, log it."""
        for choice in answer.choices:
            choice.close()
        received = answer.received or answer.began
        first = "-" if answer.first_token is None else f"{1e3 * (answer.first_token - received):.1f}"
        # admit_ms: receipt to admission (body, parsing, prompt, grammar); ttft_ms: receipt to the first token's text
        # (none: no token came): what the relays and the clients add is the rest of a client's TTFT. received_at: the
        # receipt on the host's monotonic clock, which other processes' traces share (a load client's sends).
        log.info(
            "event=request id=%s choices=%d prompt_tokens=%d completion_tokens=%d seconds=%.3f admit_ms=%.1f "
            "ttft_ms=%s received_at=%.4f",
            answer.request_id, answer.count, sum(len(p) for p in answer.prompts),
            sum(c.completion_tokens for c in answer.choices), time.monotonic() - answer.began,
            1e3 * (answer.began - received), first, received,
        )  # fmt: skip

    async def stream(self, answer: Answer, events: AsyncIterator[str], receive: Receive, send: Send) -> None:
        """Write the SSE response of an admitted request with ``send``; released however it ends. A client that
        hangs up (uvicorn's ``receive`` says so) cancels the request: the engine stops generating for it."""
        sent = False

        async def write() -> None:
            nonlocal sent
            await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
            async for event in events:
                await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
            sent = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            await cancelled_on_disconnect(write(), receive, lambda: sent)
        finally:
            self.release(answer)

    async def whole(self, answer: Answer, events: AsyncIterator[str], receive: Receive, chat: bool) -> JSONResponse:
        """The whole response of an admitted request, assembled from its stream's events; released when done.

        A client that hangs up (a timeout, say) cancels the request: the engine stops generating for it.
        """

        async def chunks() -> list[dict[str, object]]:
            return [json.loads(event[6 : event.index("\n")]) async for event in events if event.startswith("data: {")]

        work = asyncio.ensure_future(chunks())
        gone = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                work.cancel()
                raise ClientGone()
            status, body = assemble(chat, work.result(), answer.request_id, answer.created, self.model_name,
                                    self.chunks.usage(answer))  # fmt: skip
            return JSONResponse(body, status_code=status)
        finally:
            gone.cancel()
            self.release(answer)

    async def prompts(self, request: GenerationRequest) -> list[list[int]]:
        """Token ids of the request's prompts. A long text is tokenized in a worker thread: the tokenizer lets go of
        the GIL, so this loop goes on serving the other streams (and the engine thread stepping, where it shares the
        process) for the milliseconds that takes, and a burst of such requests tokenizes on several cores."""

        def build() -> list[list[int]]:
            if isinstance(request, ChatCompletionRequest):
                return self.chat_prompts(request)
            return self.completion_prompts(request)

        return build() if _text_chars(request) < THREADED_TEXT_CHARS else await asyncio.to_thread(build)

    def completion_prompts(self, request: CompletionRequest) -> list[list[int]]:
        """Token ids of a text completion's prompts: text, token ids, or a list of either (several prompts)."""
        if request.warmgate_resume is not None:
            return self._resumed_prompts(request.warmgate_resume)
        prompt = request.prompt
        items: list[str | list[int]]
        if isinstance(prompt, str):
            items = [prompt]
        elif isinstance(prompt[0], int):
            items = [prompt]  # type: ignore[list-item]
        else:
            items = list(prompt)  # type: ignore[arg-type]
        prompts = []
        vocab = self.tokenizer.vocab_size
        for item in items:
            if isinstance(item, str):
                ids = self.tokenizer.encode(self.checked_text(item, "prompt"))
            else:
                ids = item  # JSON integers (engine/protocol.py: Prompt)
                if ids and (min(ids) < 0 or max(ids) >= vocab):
                    bad = [i for i in ids if not 0 <= i < vocab]
                    raise ApiError(400, f"prompt token ids out of range [0, {vocab}): {bad[:5]}", param="prompt")
            if not ids:
                raise ApiError(400, "the prompt is empty", param="prompt")
            prompts.append(ids)
        return prompts

    def _resumed_prompts(self, resume: Resume) -> list[list[int]]:
        vocab = self.engine.vocab_size  # the model's: its outputs may lie beyond the tokenizer's vocabulary
        prompts = resume.prompts or [resume.prompt_ids]
        outputs = [c.output_ids for c in resume.choices] if resume.choices is not None else [resume.output_ids]
        bad = [i for ids in [*prompts, *outputs] for i in ids if not 0 <= i < vocab]
        if bad:
            raise ApiError(400, f"resumed token ids out of range [0, {vocab}): {bad[:5]}", param="warmgate_resume")
        return prompts

    def chat_prompts(self, request: ChatCompletionRequest) -> list[list[int]]:
        """Token ids of the chat, through the model's chat template (one prompt)."""
        if request.warmgate_resume is not None:
            return self._resumed_prompts(request.warmgate_resume)
        try:
            text = self.tokenizer.render_chat(request.template_messages())
        except ChatTemplateError as exc:
            raise ApiError(400, str(exc), param="messages") from exc
        return [self.tokenizer.encode_rendered(self.checked_text(text, "messages"))]

    def checked_text(self, text: str, param: str) -> str:
        """The text, if it is valid Unicode and could fit the context; checked before any tokenizing.

        A token stands for at most ``max_token_chars`` characters, so a text that long cannot have
        fewer than len(text) / max_token_chars tokens: a huge prompt is refused at once, not tokenized.
        """
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ApiError(400, f"the {param} is not valid Unicode text: {exc.reason} at character {exc.start}",
                           param=param) from None  # fmt: skip
        limit = self.engine.max_model_len
        if len(text) > limit and (at_least := len(text) // self.tokenizer.max_token_chars) > limit:
            raise ApiError(400, f"This model's maximum context length is {limit} tokens, but the {param} has at "
                                f"least {at_least} tokens ({len(text)} characters). Please shorten it.",
                           param=param)  # fmt: skip
        return text


def _choice_states(resume: Resume | None) -> dict[int, ChoiceResume]:
    """Where each choice of a resumed request stood (a request with one choice says it in Resume's own fields)."""
    if resume is None:
        return {}
    if resume.choices is not None:
        return {c.index: c for c in resume.choices}
    return {0: ChoiceResume(index=0, output_ids=resume.output_ids, chars=resume.chars,
                            cached_tokens=resume.cached_tokens)}  # fmt: skip


SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
GenerationRequest = CompletionRequest | ChatCompletionRequest
# route -> its request's model, the field its prompt comes from, its answers' id prefix
GENERATION: dict[str, tuple[type[GenerationRequest], str, str]] = {
    "/v1/completions": (CompletionRequest, "prompt", "cmpl"),
    "/v1/chat/completions": (ChatCompletionRequest, "messages", "chatcmpl"),
}


# Prompts of at least this many characters are tokenized off the event loop (EngineAPI.prompts): 2,048 characters of
# English are ~420 tokens, 0.42 ms of SmolLM2's tokenizer on the CI machine, against 0.055 ms for a hand-off to a
# thread and back.
THREADED_TEXT_CHARS = 2048


def _text_chars(request: GenerationRequest) -> int:
    """The characters of text a request's prompts are made of: what tokenizing them costs grows with it."""
    if isinstance(request, ChatCompletionRequest):
        return sum(len(m.content) if isinstance(m.content, str) else sum(len(p.text or "") for p in m.content or ())
                   for m in request.messages)  # fmt: skip
    prompt = request.prompt
    if isinstance(prompt, str):
        return len(prompt)
    return sum(len(p) for p in prompt) if isinstance(prompt[0], str) else 0  # token ids: nothing to tokenize


def _parse(kind: type[GenerationRequest], body: bytes) -> GenerationRequest:
    """The request from its JSON body: read by pydantic's own parser; a body that parser refuses as JSON is read by
    Python's, as FastAPI did (it takes lone surrogate escapes, which the prompt checks then name, and NaN)."""
    try:
        return kind.model_validate_json(body)
    except ValidationError as exc:
        if not any(e["type"] == "json_invalid" for e in exc.errors()):
            raise _invalid_request(exc.errors()) from None
    try:
        payload = json.loads(body)
    except ValueError as exc:  # not JSON, or not UTF-8
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    try:
        return kind.model_validate(payload)
    except ValidationError as exc:
        raise _invalid_request(exc.errors()) from None


def _invalid_request(errors: Sequence[Any]) -> ApiError:
    """The 400 for a request that failed validation (pydantic's or FastAPI's errors)."""
    message, param = _validation_message(errors)
    return ApiError(400, message, param=param)


def _internal_error(exc: Exception) -> JSONResponse:
    log.exception("event=request_failed error=%s", type(exc).__name__)
    return error_response(ApiError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error"))


class EngineApp:
    """The ASGI app an engine worker serves on its Unix socket: a POST to a generation route goes straight to
    ``EngineAPI`` (``generate``), everything else to the FastAPI app. ``api`` is what the worker drains."""

    def __init__(self, api: EngineAPI, rest: FastAPI) -> None:
        self.api = api
        self.rest = rest

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = GENERATION.get(scope["path"]) if scope["type"] == "http" else None
        if route is None:
            await self.rest(scope, receive, send)
            return
        admission = self.api.admission
        try:
            if scope["method"] != "POST":
                raise ApiError(405, f"{scope['method']} is not allowed here: POST a request")
            # In flight from its receipt to its response's end: a drain waits for a request still reading its body
            # or compiling its grammar as for one generating (counted at admission only, such a request was cut by
            # the server's stop once the drain had seen none in flight: a 500 the relays passed on).
            admission.enter()
        except ApiError as exc:
            await error_response(exc)(scope, receive, send)
            return
        try:
            try:
                response = await self.generate(route, scope, receive, send)
            except ApiError as exc:
                response = error_response(exc)
            except ClientGone:
                response = Response(status_code=499)  # nobody reads it; the request was cancelled in the engine
            except Exception as exc:
                response = _internal_error(exc)
            if response is not None:
                await response(scope, receive, send)
        finally:
            admission.leave()

    async def generate(self, route: tuple[type[GenerationRequest], str, str],
                       scope: Scope, receive: Receive, send: Send) -> Response | None:  # fmt: skip
        """One completion or chat completion: its whole response, or None once its stream has been written."""
        kind, prompt_param, id_prefix = route
        api = self.api
        received = time.monotonic()
        request = _parse(kind, await _body(receive))
        api.check_model(request.model)
        prompts = await api.prompts(request)
        grammar = await api.grammar(request)
        internal = (RESUMABLE_HEADER.encode(), b"1") in scope["headers"]
        answer = api.admit(request, prompts, prompt_param, id_prefix, internal, grammar)
        answer.received = received
        events = api.chunks.events(request, answer)
        if request.stream:
            await api.stream(answer, events, receive, send)
            return None
        return await api.whole(answer, events, receive, isinstance(request, ChatCompletionRequest))


def create_app(engine: ServingEngine, tokenizer: ChatTokenizer, board: FrontBoard | None = None) -> EngineApp:
    """The app an engine worker (or each of its front processes, sharing ``board``) serves on its Unix socket."""
    api = EngineAPI(engine, tokenizer, board)
    app = FastAPI(title="warmgate engine", docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        # OpenAI answers 400 for any invalid request; FastAPI's default is 422.
        return error_response(_invalid_request(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return error_response(ApiError(exc.status_code, str(exc.detail), kind))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        return _internal_error(exc)

    origin = engine.weight_origin
    weights_info = WeightsInfo(
        source=origin.source,  # type: ignore[arg-type]
        key=origin.key,
        lease=origin.lease,
        fallbacks=int(origin.fallback_reason is not None),
        fallback_reason=origin.fallback_reason,
        attach_phases=origin.phases,
    )

    @app.get("/health")
    async def health() -> JSONResponse:
        await engine.refresh()
        # A dead scheduler thread would hang every request: report it so the supervisor replaces us.
        status: Literal["ok", "draining", "dead"] = (
            "draining" if api.admission.draining else "ok" if engine.alive else "dead"
        )
        body = HealthResponse(
            status=status,
            running=engine.num_running,
            waiting=engine.num_waiting,
            in_flight=api.admission.in_flight,
            preemptions=engine.num_preemptions,
            prefix_cache_queries=engine.prefix_cache[0],
            prefix_cache_hits=engine.prefix_cache[1],
            kv_blocks_free=engine.kv_blocks_free,
            kv_blocks_total=engine.kv_blocks_total,
            device_memory_bytes=engine.device_memory_bytes(),
            private_memory_bytes=engine.private_memory_bytes(),
            max_num_seqs=engine.max_num_seqs,
            max_model_len=engine.max_model_len,
            memory=engine.memory,
            weights=weights_info,
            startup_phases=engine.startup_phases,
        )
        return JSONResponse(body.model_dump(mode="json"), status_code=200 if status == "ok" else 503)

    @app.post("/activate")
    async def activate(request: ActivateRequest | None = None) -> ActivateReport:
        """The supervisor, before the engine takes traffic: commit its KV cache (engine/native/kv_memory.py)."""
        timeout = (request or ActivateRequest()).timeout
        try:
            seconds = await asyncio.wrap_future(engine.activate(timeout))
        except RuntimeError as exc:
            raise ApiError(503, f"the engine cannot serve: {exc}", "service_unavailable", None, "no_memory") from None
        log.info("event=activated seconds=%.3f", seconds)
        return ActivateReport(seconds=seconds)

    @app.post("/drain")
    async def drain(request: DrainRequest | None = None) -> DrainReport:
        report = await api.admission.drain(request.timeout if request else None)
        log.info(
            "event=drain drained=%s in_flight_at_start=%d remaining=%d seconds=%.3f",
            report.drained, report.in_flight_at_start, report.remaining, report.seconds,
        )  # fmt: skip
        return report

    def card() -> ModelCard:
        return ModelCard(id=api.model_name, root=str(engine.config.model), max_model_len=engine.max_model_len)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[card()])

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> ModelCard:
        """One model (the openai client's ``models.retrieve``): this engine's, or the 404 a request naming another
        model gets."""
        api.check_model(model)
        return card()

    return EngineApp(api, app)
