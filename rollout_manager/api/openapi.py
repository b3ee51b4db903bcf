"""The API as an OpenAPI 3.1 document, built from the route table and the pydantic models that
validate each body (``api.http.accepts``), so the description is the validation."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

from pydantic.json_schema import models_json_schema

ERROR_SCHEMA = {"type": "object", "properties": {"error": {"type": "string"}}, "required": ["error"]}
STREAMING = {
    "/generate": "application/json (or text/event-stream when the body says stream: true)",
    "/batch_generate_requests": "application/x-ndjson: one line per request, in completion order",
}


def build_openapi(routes: Sequence[tuple[str, str, Callable[..., Any]]], version: str) -> dict[str, Any]:
    models = {m for _, _, h in routes if (m := getattr(h, "body_model", None)) is not None}
    ordered = sorted(models, key=lambda m: m.__name__)
    keyed, defs = models_json_schema([(m, "validation") for m in ordered],
                                     ref_template="#/components/schemas/{model}")
    schemas = dict(defs.get("$defs", {}))
    schemas["Error"] = ERROR_SCHEMA
    paths: dict[str, dict[str, Any]] = {}
    for method, path, handler in routes:
        doc = inspect.getdoc(handler) or ""
        op: dict[str, Any] = {
            "operationId": handler.__name__,
            "summary": doc.splitlines()[0] if doc else path,
            "responses": {
                "200": {"description": STREAMING.get(path, "application/json")},
                "4XX": {"description": "the request was refused; nothing changed",
                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}},
            },
        }
        model = getattr(handler, "body_model", None)
        if model is not None:
            op["requestBody"] = {
                "required": not getattr(handler, "body_optional", False),
                "content": {"application/json": {"schema": keyed[(model, "validation")]}},
            }
        paths.setdefault(path, {})[method.lower()] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "rollout-manager", "version": version,
                 "description": "Async disaggregated rollout manager for RL training with SGLang instances."},
        "components": {"schemas": schemas,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}],
        "paths": paths,
    }
