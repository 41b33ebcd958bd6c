"""The gateway's HTTP app: the OpenAI API proxied to the active engine, health, admin and metrics.

Requests wait (bounded queue, timeout) while no engine is active, so a ``replace`` restart
costs clients latency, not errors. A request whose engine fails (exits, hangs and is killed, or
stops with the request unfinished) is resumed on the next active engine from what its client
already has (app/resume.py), at most ``restart.request_resumes`` times; after that a stream ends
with an error event in the OpenAI shape and ``[DONE]``, never a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.config import RestartSettings
from app.engines import Engine, EngineManager
from app.metrics import GatewayMetrics
from app.openapi import document_bodies
from app.resume import DONE, EngineFailed, InFlight, split_events
from cache.events import log_event
from engine.protocol import RESUMABLE_HEADER, ChatCompletionRequest, CompletionRequest, ErrorInfo, ErrorResponse

log = logging.getLogger("warmgate.gateway")


def openai_error(
    status: int, message: str, kind: str = "invalid_request_error", code: str | None = None
) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=kind, code=code))
    return JSONResponse(body.model_dump(mode="json"), status_code=status)


@dataclass
class GatewayState:
    manager: EngineManager
    metrics: GatewayMetrics
    api_keys: list[str]
    admin_token: str
    queue_timeout: float
    max_queue: int
    resumes: int  # restart.request_resumes: how many times one request may move to another engine
    max_body_bytes: int  # gateway.max_body_bytes: larger request bodies get 413
    restart: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]  # admin restart (body -> report)
    reload: Callable[[], Awaitable[dict[str, Any]]]  # admin reload -> report (raises ValueError on a bad file)
    status: Callable[[], Awaitable[dict[str, Any]]]
    waiting: int = 0
    scrape: Callable[[], Awaitable[object]] | None = None  # refreshes gauges read elsewhere (the cache's) for /metrics
    cache_down: Callable[[], str | None] = lambda: None  # why the cache process is not serving, if it is not

    def configure(self, api_keys: list[str], max_body_bytes: int, restart: RestartSettings) -> None:
        """Settings a reload changes at once."""
        self.api_keys, self.max_body_bytes = api_keys, max_body_bytes
        self.queue_timeout = restart.queue_timeout
        self.max_queue = restart.max_queue
        self.resumes = restart.request_resumes


def create_gateway(state: GatewayState) -> FastAPI:
    app = FastAPI(title="warmgate", docs_url=None, redoc_url=None)
    document_bodies(app, {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest})
    app.state.gateway = state
    metrics = state.metrics

    def authorized(request: Request, tokens: list[str]) -> bool:
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        return scheme.lower() == "bearer" and any(secrets.compare_digest(token, t) for t in tokens)

    async def acquire() -> Engine:
        if state.waiting >= state.max_queue:
            raise _Unavailable(f"{state.waiting} requests are already waiting for an engine")
        state.waiting += 1
        metrics.queued.set(state.waiting)
        try:
            return await state.manager.wait_active(state.queue_timeout)
        except TimeoutError:
            raise _Unavailable(f"no engine became ready within {state.queue_timeout:.0f}s") from None
        finally:
            state.waiting -= 1
            metrics.queued.set(state.waiting)

    async def attempt(engine: Engine, request: InFlight, started: float) -> AsyncIterator[bytes]:
        """The request on one engine: what its client gets, up to [DONE]; EngineFailed if the engine fails.

        An engine's answer that is not a stream (a 400 for a bad request, say) is raised as _Answered.
        """
        client = engine.http()
        headers = {"content-type": "application/json", RESUMABLE_HEADER: "1"}
        try:
            upstream = await client.send(client.build_request("POST", request.route, content=request.body(),
                                                              headers=headers), stream=True)  # fmt: skip
        except httpx.TransportError as exc:
            raise EngineFailed(f"connect: {exc}") from None
        metrics.in_flight.inc()
        try:
            if upstream.status_code == 503:  # it began draining after we picked it: the next engine takes it
                raise EngineFailed("draining", draining=True)
            if not upstream.headers.get("content-type", "").startswith("text/event-stream"):
                raise _Answered(Response(await upstream.aread(), status_code=upstream.status_code,
                                         media_type=upstream.headers.get("content-type")))  # fmt: skip
            rest = b""
            async for raw in upstream.aiter_raw():
                events, rest = split_events(rest + raw)
                for event in events:
                    first_token = not request.output_ids
                    out = request.take(event)
                    if first_token and request.output_ids:  # output begins with the first token
                        metrics.ttft.labels(request.route).observe(time.perf_counter() - started)
                    if out is not None:
                        yield out
                    if request.done:
                        return
            raise EngineFailed("the stream ended before [DONE]")
        except httpx.TransportError as exc:
            raise EngineFailed(f"stream: {type(exc).__name__}") from None
        finally:
            metrics.in_flight.dec()
            await upstream.aclose()

    async def run(request: InFlight, started: float) -> AsyncGenerator[bytes]:
        """What the client gets, across as many engines as it takes (at most ``state.resumes`` moves)."""
        while True:
            engine = await acquire()
            try:
                async for out in attempt(engine, request, started):
                    yield out
                return
            except EngineFailed as failure:
                if failure.draining:
                    await asyncio.sleep(0.05)
                else:
                    await state.manager.engine_failed(engine)
                if request.finish is not None:  # the last token was relayed: only the ending was lost
                    for out in request.ending():
                        yield out
                    return
                if request.resumes >= state.resumes:
                    metrics.resume_failures.inc()
                    raise _Exhausted(request.resumes, str(failure)) from None
                request.resumes += 1
                metrics.resumes.inc()
                log_event(log, "resume", route=request.route, id=request.id, resumes=request.resumes,
                          tokens=len(request.output_ids), why=failure)  # fmt: skip

    async def while_connected(raw: Request, work: Awaitable[Any]) -> Any:
        """``work``'s result, abandoned (cancelled) as soon as the client disconnects."""
        task = asyncio.ensure_future(work)
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                return task.result()
            if await raw.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
                raise _ClientGone

    async def collect(request: InFlight, events: AsyncIterator[bytes]) -> Response:
        """A non-streaming client's response, assembled from the internal stream's events."""
        async for event in events:
            error = request.add(event)
            if error is not None:
                kind = error["error"].get("type")
                return JSONResponse(error, status_code=500 if kind == "server_error" else 503)
        return JSONResponse(request.response())

    async def read_body(raw: Request) -> bytes:
        """The request body, refused (413) beyond max_body_bytes before more of it is read."""
        limit = state.max_body_bytes
        declared = raw.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise _BadBody(413, f"the request body ({int(declared)} bytes) exceeds the limit of {limit} bytes")
        body = bytearray()
        async for chunk in raw.stream():
            body += chunk
            if len(body) > limit:
                raise _BadBody(413, f"the request body exceeds the limit of {limit} bytes")
        return bytes(body)

    async def proxy(raw: Request, route: str) -> Response:
        started = time.perf_counter()
        if state.api_keys and not authorized(raw, state.api_keys):
            metrics.requests.labels(route, "401").inc()
            return openai_error(401, "invalid or missing API key (Authorization: Bearer ...)", "authentication_error")
        try:
            payload = parse_object(await read_body(raw))
        except _BadBody as exc:
            metrics.requests.labels(route, str(exc.status)).inc()
            return openai_error(exc.status, str(exc))
        request = InFlight(route, payload)
        events = run(request, started)
        status = "200"
        try:
            if not request.streams:
                response = await while_connected(raw, collect(request, events))
                status = str(response.status_code)
                return response
            first = await while_connected(raw, anext(events))  # before any byte: errors keep their HTTP status
        except _ClientGone:
            status = "499"
            return Response(status_code=499)  # nobody reads it
        except _Answered as answered:
            status = str(answered.response.status_code)
            return answered.response
        except (_Unavailable, _Exhausted) as exc:
            status = "503"
            return openai_error(503, str(exc), "service_unavailable")
        finally:
            metrics.requests.labels(route, status).inc()
            if not request.streams or status != "200":
                await events.aclose()
                finished(request, route, started)
        return StreamingResponse(relay(request, first, events, route, started), media_type="text/event-stream")

    async def relay(request: InFlight, first: bytes, events: AsyncGenerator[bytes], route: str,
                    started: float) -> AsyncIterator[bytes]:  # fmt: skip
        try:
            yield first
            async for event in events:
                yield event
        except Exception as exc:  # the stream has begun: whatever went wrong ends it with an error event
            if isinstance(exc, _Answered):  # an engine refused the resumed request: say what it answered
                exc = RuntimeError(f"the engine refused to resume this request: {exc.response.body[:300]!r}")
            elif not isinstance(exc, (_Exhausted, _Unavailable)):
                log.exception("event=relay_failed route=%s id=%s", route, request.id)
            log_event(log, "stream_failed", route=route, id=request.id, resumes=request.resumes, error=exc)
            error = ErrorResponse(error=ErrorInfo(message=str(exc), type="server_error", code="engine_failed"))
            yield f"data: {error.model_dump_json()}\n\n".encode() + DONE
        finally:
            await events.aclose()
            finished(request, route, started)

    def finished(request: InFlight, route: str, started: float) -> None:
        """Count a request that ended: its latency and tokens (the prompt's and every one generated)."""
        metrics.latency.labels(route).observe(time.perf_counter() - started)
        if request.prompt_ids is not None:
            metrics.prompt_tokens.inc(len(request.prompt_ids))
        metrics.generation_tokens.inc(len(request.output_ids))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await proxy(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        if state.api_keys and not authorized(request, state.api_keys):
            return openai_error(401, "invalid or missing API key (Authorization: Bearer ...)", "authentication_error")
        try:
            engine = await acquire()
            upstream = await engine.http().get("/v1/models")
        except (_Unavailable, httpx.TransportError) as exc:
            return openai_error(503, f"no engine answered: {exc}", "service_unavailable")
        return Response(upstream.content, status_code=upstream.status_code, media_type="application/json")

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> Response:
        engine = state.manager.active
        cache_down = state.cache_down()
        if engine is None:
            why = f" ({cache_down})" if cache_down else ""
            return openai_error(503, f"no active engine{why}", "service_unavailable")
        try:
            response = await engine.http().post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=30)
        except httpx.HTTPError as exc:
            return openai_error(503, f"the active engine did not answer: {exc}", "service_unavailable")
        if response.status_code != 200:
            return openai_error(503, f"the active engine answered {response.status_code}", "service_unavailable")
        # Engines serve on their mappings while the cache process restarts: ready, and saying so.
        return JSONResponse({"status": "ready", "engine": engine.id, "cache": cache_down or "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        if state.scrape is not None:
            await state.scrape()
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def admin(request: Request) -> JSONResponse | None:
        if not authorized(request, [state.admin_token]):
            return openai_error(401, "admin token required (Authorization: Bearer ...)", "authentication_error")
        return None

    @app.post("/admin/restart")
    async def admin_restart(request: Request) -> Response:
        if (denied := admin(request)) is not None:
            return denied
        try:
            raw = await read_body(request)
            body = parse_object(raw) if raw else {}
            report = await state.restart(body)
        except _BadBody as exc:
            return openai_error(exc.status, str(exc))
        except ValueError as exc:
            return openai_error(400, str(exc))
        # A restart that failed is not a server error: the gateway serves on (the old engine, or the last good
        # config under `replace`); 422 says the engine asked for could not be started, the report says why.
        return JSONResponse(report, status_code=200 if report["ok"] else 422)

    @app.post("/admin/reload")
    async def admin_reload(request: Request) -> Response:
        if (denied := admin(request)) is not None:
            return denied
        try:
            report = await state.reload()
        except ValueError as exc:
            return openai_error(400, f"config not reloaded, nothing changed: {exc}")
        return JSONResponse(report, status_code=200 if report.get("ok", True) else 422)

    @app.get("/admin/status")
    async def admin_status(request: Request) -> Response:
        if (denied := admin(request)) is not None:
            return denied
        return JSONResponse(await state.status())

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        """404, 405 and the like in the OpenAI error shape."""
        return openai_error(exc.status_code, f"{exc.detail}", "invalid_request_error", code=str(exc.status_code))

    return app


def parse_object(body: bytes) -> dict[str, Any]:
    """A JSON object from a request body; _BadBody (400) for anything else, pathological nesting included."""
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError) as exc:
        why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise _BadBody(400, f"invalid JSON body: {why}") from None
    if not isinstance(payload, dict):
        raise _BadBody(400, "invalid JSON body: the body must be a JSON object")
    return payload


class _BadBody(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _Unavailable(Exception):
    """No engine to take the request (queue full, or none became active in time)."""


class _ClientGone(Exception):
    """The client disconnected before the engine answered."""


class _Answered(Exception):
    """The engine answered with a response that is not a stream (an error for a bad request)."""

    def __init__(self, response: Response) -> None:
        super().__init__(response.status_code)
        self.response = response


class _Exhausted(Exception):
    """The request's engine failed again after ``restart.request_resumes`` resumptions."""

    def __init__(self, resumes: int, why: str) -> None:
        super().__init__(f"the engine serving this request failed ({why}) after it had been resumed {resumes} "
                         f"times, the limit (restart.request_resumes)")  # fmt: skip
