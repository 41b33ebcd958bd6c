"""The gateway's OpenAPI document, with the request bodies of the routes it relays.

The gateway passes request bodies through to the engine unparsed (the engine validates them), so
FastAPI cannot see their shape; this adds the engine API's request models to the document, so
clients and API fuzzers (tests/test_fuzz.py) know what a valid body is.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel


def document_bodies(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> None:
    """Serve ``app``'s OpenAPI document with ``bodies`` (POST path -> request model) as request bodies."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for path, model in bodies.items():
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
                content = {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}
                schema["paths"][path]["post"]["requestBody"] = {"required": True, "content": content}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
