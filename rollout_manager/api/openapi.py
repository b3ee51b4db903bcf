"""The API as an OpenAPI 3.1 document, built from the route table and the types that check each body
(pydantic models, ``api.http.accepts``; msgspec types for generation bodies, ``api.http.decodes``), so
the description is the validation."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
from pydantic.json_schema import models_json_schema

from rollout_manager.rollout.request import MAX_ITEMS, BatchedBody, OneSequenceBody, RequestId

REF = "#/components/schemas/{name}"

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
    described = {h: schema(REF) for _, _, h in routes if (schema := getattr(h, "body_schema", None)) is not None}
    for _, components in described.values():
        schemas.update(components)
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
        schema = keyed[(model, "validation")] if model is not None else described.get(handler, (None,))[0]
        if schema is not None:
            op["requestBody"] = {
                "required": not getattr(handler, "body_optional", False),
                "content": {"application/json": {"schema": schema}},
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


def generate_schema(ref_template: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A ``/generate`` body: one sequence or a batch (the first item of ``input_ids`` says which)."""
    (one, many), components = msgspec.json.schema_components([OneSequenceBody, BatchedBody], ref_template=ref_template)
    return {"anyOf": [one, many]}, components


def batch_schema(ref_template: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A ``/batch_generate_requests`` body: ``[[id, generate_body], ...]``, ids unique."""
    (rid,), _ = msgspec.json.schema_components([RequestId], ref_template=ref_template)
    body, components = generate_schema(ref_template)
    item = {"type": "array", "prefixItems": [rid, body], "minItems": 2, "maxItems": 2}
    return {"type": "array", "items": item, "minItems": 1, "maxItems": MAX_ITEMS,
            "description": "[id, generate body] pairs; ids must be unique within the batch, compared as JSON "
                           "values: the integer 1 and the string \"1\" are two requests, each answered with its "
                           "id as sent"}, components
