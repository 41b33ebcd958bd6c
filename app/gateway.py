"""The gateway's HTTP app: the OpenAI API proxied to the active engine, health, admin and metrics.

Requests wait (bounded queue, timeout) while no engine is active, so a ``replace`` restart
costs clients latency, not errors. A request whose engine vanished before it produced any
output is retried on the next active engine; a stream cut after its first chunk ends with an
error event in the OpenAI shape and ``[DONE]``, never a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from app.engines import Engine, EngineManager
from app.metrics import GatewayMetrics
from engine.protocol import ErrorInfo, ErrorResponse

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
    retries: int
    restart: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]  # admin restart (body -> report)
    reload: Callable[[], Awaitable[dict[str, Any]]]  # admin reload -> report (raises ValueError on a bad file)
    status: Callable[[], dict[str, Any]]
    waiting: int = 0


class _Retry(Exception):
    """The engine went away before this request produced output: try the next one."""


def create_gateway(state: GatewayState) -> FastAPI:
    app = FastAPI(title="warmgate", docs_url=None, redoc_url=None)
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

    async def forward(path: str, body: bytes) -> tuple[httpx.Response, AsyncIterator[bytes] | None, bytes]:
        """Send to the active engine; returns the response and, for a stream, its first chunk."""
        engine = await acquire()
        client = engine.http()
        try:
            upstream = await client.send(
                client.build_request("POST", path, content=body, headers={"content-type": "application/json"}),
                stream=True,
            )
        except httpx.TransportError:
            await state.manager.engine_failed(engine)
            raise _Retry from None
        if upstream.status_code == 503:  # it began draining after we picked it: the next engine takes it
            await upstream.aclose()
            await asyncio.sleep(0.05)
            raise _Retry
        try:
            if upstream.headers.get("content-type", "").startswith("text/event-stream"):
                chunks = upstream.aiter_raw()  # one iterator: a response's stream can be started only once
                first = await anext(chunks, b"")
                if not first:
                    raise httpx.RemoteProtocolError("empty stream")
                return upstream, chunks, first
            await upstream.aread()
            return upstream, None, b""
        except httpx.TransportError:  # died before any output reached the client
            await upstream.aclose()
            await state.manager.engine_failed(engine)
            raise _Retry from None
        except asyncio.CancelledError:  # our client hung up: closing the connection cancels it in the engine
            await upstream.aclose()
            raise

    async def forward_while_connected(request: Request, path: str, body: bytes) -> tuple[Any, ...]:
        """forward(), abandoned as soon as the client disconnects, so the engine stops generating for nobody."""
        task = asyncio.create_task(forward(path, body))
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, _Retry, _Unavailable, httpx.HTTPError):
                    await task
                raise _ClientGone

    async def proxy(request: Request, path: str) -> Response:
        route = path
        started = time.perf_counter()
        if state.api_keys and not authorized(request, state.api_keys):
            metrics.requests.labels(route, "401").inc()
            return openai_error(401, "invalid or missing API key (Authorization: Bearer ...)", "authentication_error")
        body = await request.body()
        try:
            payload = json.loads(body)
            if not isinstance(payload, dict):
                raise ValueError("the body must be a JSON object")
        except ValueError as exc:
            metrics.requests.labels(route, "400").inc()
            return openai_error(400, f"invalid JSON body: {exc}")
        attempt = 0
        metrics.in_flight.inc()
        try:
            while True:
                try:
                    upstream, chunks, first = await forward_while_connected(request, path, body)
                    break
                except _ClientGone:
                    metrics.requests.labels(route, "499").inc()
                    return Response(status_code=499)  # nobody reads it
                except _Retry:
                    attempt += 1
                    if attempt > state.retries:
                        metrics.requests.labels(route, "503").inc()
                        return openai_error(503, "the engine stopped before answering; retries exhausted",
                                            "service_unavailable")  # fmt: skip
                    metrics.retries.inc()
                except _Unavailable as exc:
                    metrics.requests.labels(route, "503").inc()
                    return openai_error(503, str(exc), "service_unavailable")
        finally:
            metrics.in_flight.dec()
        metrics.requests.labels(route, str(upstream.status_code)).inc()
        if chunks is None:
            metrics.latency.labels(route).observe(time.perf_counter() - started)
            _count_usage(metrics, upstream.content)
            return Response(upstream.content, status_code=upstream.status_code,
                            media_type=upstream.headers.get("content-type"))  # fmt: skip
        metrics.ttft.labels(route).observe(time.perf_counter() - started)
        return StreamingResponse(_relay(upstream, chunks, first, metrics, route, started),
                                 status_code=upstream.status_code, media_type="text/event-stream")  # fmt: skip

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
        if engine is None:
            return openai_error(503, "no active engine", "service_unavailable")
        try:
            response = await engine.http().post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=30)
        except httpx.HTTPError as exc:
            return openai_error(503, f"the active engine did not answer: {exc}", "service_unavailable")
        if response.status_code != 200:
            return openai_error(503, f"the active engine answered {response.status_code}", "service_unavailable")
        return JSONResponse({"status": "ready", "engine": engine.id})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def admin(request: Request) -> JSONResponse | None:
        if not authorized(request, [state.admin_token]):
            return openai_error(401, "admin token required (Authorization: Bearer ...)", "authentication_error")
        return None

    @app.post("/admin/restart")
    async def admin_restart(request: Request) -> Response:
        if (denied := admin(request)) is not None:
            return denied
        raw = await request.body()
        try:
            body = json.loads(raw) if raw else {}
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
            report = await state.restart(body)
        except ValueError as exc:
            return openai_error(400, str(exc))
        return JSONResponse(report, status_code=200 if report["ok"] else 500)

    @app.post("/admin/reload")
    async def admin_reload(request: Request) -> Response:
        if (denied := admin(request)) is not None:
            return denied
        try:
            report = await state.reload()
        except ValueError as exc:
            return openai_error(400, f"config not reloaded, nothing changed: {exc}")
        return JSONResponse(report, status_code=200 if report.get("ok", True) else 500)

    @app.get("/admin/status")
    async def admin_status(request: Request) -> Response:
        if (denied := admin(request)) is not None:
            return denied
        return JSONResponse(state.status())

    return app


class _Unavailable(Exception):
    """No engine to take the request (queue full, or none became active in time)."""


class _ClientGone(Exception):
    """The client disconnected before the engine answered."""


async def _relay(upstream: httpx.Response, chunks: AsyncIterator[bytes], first: bytes, metrics: GatewayMetrics,
                 route: str, started: float) -> AsyncIterator[bytes]:  # fmt: skip
    try:
        yield first
        async for chunk in chunks:
            yield chunk
    except httpx.TransportError:
        log.warning("event=stream_cut route=%s", route)
        error = {"error": {"message": "the engine stopped in the middle of this stream", "type": "server_error",
                           "param": None, "code": "engine_stopped"}}  # fmt: skip
        yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
    finally:
        await upstream.aclose()
        metrics.latency.labels(route).observe(time.perf_counter() - started)


def _count_usage(metrics: GatewayMetrics, content: bytes) -> None:
    try:
        usage = json.loads(content).get("usage") or {}
    except (ValueError, AttributeError):
        return
    metrics.prompt_tokens.inc(usage.get("prompt_tokens", 0))
    metrics.generation_tokens.inc(usage.get("completion_tokens", 0))
