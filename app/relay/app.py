"""A relay's HTTP app: the OpenAI routes relayed to the active engine, health, readiness, metrics, and the admin
API (authorized here, carried out by the supervisor).

Per request the routes do the checks a client must get from the gateway itself (API key, body size, a JSON
object, the fields the relay acts on); the engine validates the rest. The response of a relayed request
is a bare ASGI callable (``RelayedResponse``): it runs the relay with uvicorn's ``send`` and watches
``receive`` for the client's disconnect, so per streamed token there is no framework code at all.
"""

from __future__ import annotations

import asyncio
import math
import secrets
from typing import Any
from urllib.parse import quote

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from app.metrics import CONTENT_TYPE, render
from app.relay.engine_load import EngineLoads
from app.relay.inflight import CHAT, COMPLETIONS, InFlight, InvalidRequest
from app.relay.link import SupervisorGone, SupervisorLink
from app.relay.openapi import document_bodies
from app.relay.relay import Relay, ResponseSink
from app.relay.table import TableView
from app.relay.upstream import EngineUnreachable, StreamCut, request_head
from common import json_codec
from common.disconnect import cancelled_on_disconnect
from common.heartbeat import Heartbeat, beside
from engine.protocol import ChatCompletionRequest, CompletionRequest, ErrorInfo, ErrorResponse

RELAYED = (COMPLETIONS, CHAT)
READY_TIMEOUT_S = 30.0  # for the active engine's model list
READY_SILENCE_S = 10.0  # an active engine whose heartbeat is older is not ready (restart.health_timeout's default)


def openai_error(status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:  # fmt: skip
    body = ErrorResponse(error=ErrorInfo(message=message, type=kind, code=code, param=param))
    return JSONResponse(body.model_dump(mode="json"), status_code=status, headers=headers)


class RelayApp:
    """The relay's ASGI app. A POST to a generation route goes straight to the relay: the checks a client must get
    from the gateway itself, then the relay writing to uvicorn's ``send``, with no framework code per request or
    per token (each ``send`` through Starlette's middleware passed a dozen wrapper frames; measured 38.5 us of
    relay CPU per token before, see docs/benchmarks.md). Everything else (admin, health, readiness, metrics, the
    model list, the OpenAPI document, 404s) goes to the FastAPI app."""

    def __init__(self, table: TableView, relay: Relay, link: SupervisorLink) -> None:
        self.table = table
        self.relay = relay
        self.api = create_api(table, relay, link, self.relayed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in RELAYED:
            await self.relayed(scope, receive, send)
        else:
            await self.api(scope, receive, send)

    async def relayed(self, scope: Scope, receive: Receive, send: Send) -> None:
        """One request to a generation route, from its headers to the end of its answer."""
        route: str = scope["path"]
        sink = ResponseSink(send)
        settings = self.table.settings
        headers = dict(scope["headers"])
        if settings.api_keys and not _bearer(headers.get(b"authorization", b""), settings.api_keys):
            await self._refuse(sink, route, 401, "invalid or missing API key (Authorization: Bearer ...)",
                               "authentication_error")  # fmt: skip
            return
        payload = await _read_object(receive, headers.get(b"content-length", b""), settings.max_body_bytes)
        if isinstance(payload, tuple):
            await self._refuse(sink, route, *payload)
            return
        try:
            request = InFlight.of(route, payload)
        except InvalidRequest as exc:
            await self._refuse(sink, route, 400, str(exc), param=exc.param)
            return
        await self._serve(request, sink, receive)

    async def _serve(self, request: InFlight, sink: ResponseSink, receive: Receive) -> None:
        """The relay, cancelled when the client disconnects (uvicorn's ``receive`` says so): that closes the
        engine's connection, and the engine stops generating for it."""
        await cancelled_on_disconnect(self.relay.serve(request, sink), receive, lambda: sink.complete)

    async def _refuse(self, sink: ResponseSink, route: str, status: int, message: str,
                      kind: str = "invalid_request_error", param: str | None = None) -> None:  # fmt: skip
        self.relay.metrics.requests.labels(route, str(status)).inc()
        await sink.error(status, message, kind, param=param)


def _bearer(header: bytes, tokens: list[str]) -> bool:
    scheme, _, token = header.decode("latin-1").partition(" ")
    return scheme.lower() == "bearer" and any(secrets.compare_digest(token, t) for t in tokens)


async def _read_object(receive: Receive, declared: bytes, limit: int) -> dict[str, Any] | tuple[int, str]:
    """The request body as a JSON object, or (status, message): 413 beyond ``limit`` (refused before more is
    read), 400 for anything but a JSON object (pathological nesting included)."""
    if declared.isdigit() and int(declared) > limit:
        return 413, f"the request body ({int(declared)} bytes) exceeds the limit of {limit} bytes"
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        body += message.get("body", b"")
        if len(body) > limit:
            return 413, f"the request body exceeds the limit of {limit} bytes"
        if not message.get("more_body"):
            break
    try:
        payload = json_codec.loads(body) if body else {}
    except (ValueError, RecursionError) as exc:
        return 400, f"invalid JSON body: {'nested too deeply' if isinstance(exc, RecursionError) else exc}"
    if not isinstance(payload, dict):
        return 400, "invalid JSON body: the body must be a JSON object"
    return payload


class _Relayed(Response):
    """What FastAPI's routes for the generation paths answer (they carry the paths' OpenAPI documentation;
    RelayApp dispatches those requests before FastAPI sees them): the same handler."""

    def __init__(self, handler: ASGIApp) -> None:  # no super().__init__(): no body, no headers of its own
        self.handler = handler
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.handler(scope, receive, send)


def _silence(engine_socket: str) -> float:
    """Seconds since the engine's heartbeat last moved (infinite: no heartbeat file)."""
    try:
        heartbeat = Heartbeat(beside(engine_socket))
    except (OSError, ValueError):
        return math.inf
    try:
        return heartbeat.silent_for()
    finally:
        heartbeat.close()


def create_api(table: TableView, relay: Relay, link: SupervisorLink, relayed: ASGIApp) -> FastAPI:
    """The FastAPI app of a relay: every route but the relayed requests themselves."""
    app = FastAPI(title="warmgate", docs_url=None, redoc_url=None)
    document_bodies(app, {COMPLETIONS: CompletionRequest, CHAT: ChatCompletionRequest})

    def authorized(request: Request, tokens: list[str]) -> bool:
        return _bearer(request.headers.get("authorization", "").encode("latin-1"), tokens)

    def unauthorized() -> JSONResponse:
        return openai_error(401, "invalid or missing API key (Authorization: Bearer ...)", "authentication_error")

    @app.post(COMPLETIONS, response_model=None)
    async def completions(request: Request) -> Response:
        return _Relayed(relayed)

    @app.post(CHAT, response_model=None)
    async def chat_completions(request: Request) -> Response:
        return _Relayed(relayed)

    async def ask_active(method: str, path: str, body: bytes, timeout: float) -> tuple[int, bytes] | str:
        """One exchange with the active engine, outside admission (a probe, the model list): its status and
        body, or why there is none."""
        engine = table.active
        if engine is None:
            cache = table.table.cache_down if table.table is not None else None
            return f"no active engine ({cache})" if cache else "no active engine"
        try:
            connection = await asyncio.wait_for(relay.pool.send(engine.socket, request_head(method, path, body)),
                                                timeout)  # fmt: skip
            try:
                return connection.status, await asyncio.wait_for(connection.read_all(), timeout)
            finally:
                relay.pool.release(engine.socket, connection)
        except (EngineUnreachable, StreamCut, TimeoutError) as exc:
            return f"the active engine did not answer: {type(exc).__name__}: {exc}"

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await model_answer(request, "/v1/models")

    @app.get("/v1/models/{model:path}")
    async def model(request: Request, model: str) -> Response:
        return await model_answer(request, "/v1/models/" + quote(model, safe="/"))

    async def model_answer(request: Request, path: str) -> Response:
        """The active engine's answer to GET ``path`` (the model list, or one model)."""
        if table.settings.api_keys and not authorized(request, table.settings.api_keys):
            return unauthorized()
        answer = await ask_active("GET", path, b"", READY_TIMEOUT_S)
        if isinstance(answer, str):
            return openai_error(503, answer, "service_unavailable")
        return Response(answer[1], status_code=answer[0], media_type="application/json")

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> Response:
        """Ready while there is an active engine that makes progress. The supervisor makes an engine active only
        once it answered a real 1-token generation; from then on its heartbeat says whether it makes progress
        (common/heartbeat.py). The engine is asked nothing: a probe would wait in a saturated engine's queue
        (24 s measured on CPU) and take a busy pod out of its Service, the one thing a router must not do."""
        probed = table.active
        if probed is None:
            cache = table.table.cache_down if table.table is not None else None
            return openai_error(503, f"no active engine ({cache})" if cache else "no active engine",
                                "service_unavailable")  # fmt: skip
        silent = _silence(probed.socket)
        if silent > READY_SILENCE_S:
            return openai_error(503, f"the active engine has made no progress for {silent:.1f} s",
                                "service_unavailable")  # fmt: skip
        cache = table.table.cache_down if table.table is not None else None
        # Engines serve on their mappings while the cache process restarts: ready, and saying so.
        return JSONResponse({"status": "ready", "engine": probed.id, "cache": cache or "ok"})

    loads = EngineLoads()

    @app.get("/metrics")
    async def metrics() -> Response:
        # The engines' figures: a read of their heartbeat files' memory, on the loop (no engine is asked).
        serving = loads.read(table.table)
        return Response(await asyncio.to_thread(render, serving), media_type=CONTENT_TYPE)

    async def admin(request: Request, op: str) -> Response:
        if not authorized(request, [table.settings.admin_token]):
            return openai_error(401, "admin token required (Authorization: Bearer ...)", "authentication_error")
        body: dict[str, Any] | tuple[int, str] = {}
        if op == "restart":
            declared = request.headers.get("content-length", "").encode("latin-1")
            body = await _read_object(request.receive, declared, table.settings.max_body_bytes)
        if isinstance(body, tuple):
            return openai_error(*body)
        try:
            reply = await link.admin(op, body)
        except SupervisorGone as exc:
            return openai_error(503, f"the supervisor did not answer: {exc}", "service_unavailable")
        return JSONResponse(reply.body, status_code=reply.status)

    @app.post("/admin/restart")
    async def admin_restart(request: Request) -> Response:
        return await admin(request, "restart")

    @app.post("/admin/reload")
    async def admin_reload(request: Request) -> Response:
        return await admin(request, "reload")

    @app.get("/admin/status")
    async def admin_status(request: Request) -> Response:
        return await admin(request, "status")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        """404, 405 and the like in the OpenAI error shape."""
        return openai_error(exc.status_code, f"{exc.detail}", "invalid_request_error", code=str(exc.status_code))

    return app
