"""The manager's HTTP API: parse, validate, call the core, answer JSON. Nothing else lives here."""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from rollout_manager import __version__, jsonutil
from rollout_manager.api import status_page
from rollout_manager.api.metrics import METRICS, ManagerMetrics
from rollout_manager.api.openapi import build_openapi
from rollout_manager.api.schemas import (
    BatchGenerateRequests,
    Empty,
    GenerateRequest,
    RegisterLocalRolloutInstances,
    RegisterRolloutInstance,
    ShutdownInstances,
    UpdateMetrics,
    UpdateWeightSenders,
    UpdateWeightVersion,
)
from rollout_manager.bearer import bearer_matches
from rollout_manager.errors import ManagerError, TooLarge, Unauthorized
from rollout_manager.manager import Manager
from rollout_manager.rollout.generation import run_batch
from rollout_manager.sglang import wire

log = logging.getLogger("rollout_manager.http")

MANAGER: web.AppKey[Manager] = web.AppKey("manager", Manager)
MAX_BODY: web.AppKey[int] = web.AppKey("max_body", int)
MAX_ADMIN_BODY: web.AppKey[int] = web.AppKey("max_admin_body", int)
# Open without the token: liveness, scraping, the status page shell and the API description.
OPEN_PATHS = frozenset({("GET", "/health"), ("GET", "/metrics"), ("GET", "/"), ("GET", "/openapi.json")})
M = TypeVar("M", bound=BaseModel)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def json_response(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=jsonutil.dumps(data), status=status, content_type="application/json")


def error_response(status: int, message: str) -> web.Response:
    return json_response({"error": message}, status=status)


def format_loc(loc: tuple[int | str, ...]) -> str:
    """``("weight_sender_ips", 0, 1)`` -> ``weight_sender_ips[0][1]``; the body itself is ``body``."""
    out = ""
    for part in loc:
        if part == "root" or (isinstance(part, str) and (not part.isidentifier() or part[:1].isupper())):
            continue  # pydantic's names for union branches and models, not fields
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "body"


def describe_validation_error(exc: ValidationError) -> str:
    """Name the field and what was wrong with it, for the first few problems."""
    parts = []
    for err in exc.errors()[:3]:
        loc = format_loc(err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        parts.append(f"field '{loc}': {msg}")
    more = len(exc.errors()) - 3
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")


async def read_json(request: web.Request, *, optional: bool = False, large: bool = False) -> Any:
    """Read and decode a JSON body; raises ManagerError (400) when it is empty or not JSON.

    Admin bodies are small: past ``max_admin_body_kb`` they get 413; generation bodies (``large``)
    may go up to ``max_request_body_mb`` (the server's own cap).
    """
    limit = request.app[MAX_BODY] if large else request.app[MAX_ADMIN_BODY]
    if request.content_length is not None and request.content_length > limit:
        raise TooLarge(f"request body too large ({request.content_length} bytes; limit {limit})")
    raw = await request.read()
    if len(raw) > limit:
        raise TooLarge(f"request body too large ({len(raw)} bytes; limit {limit})")
    if not raw.strip() and optional:
        raw = b"{}"
    if not raw:
        raise ManagerError("request body is empty; expected JSON")
    try:
        return jsonutil.loads(raw)
    except (UnicodeDecodeError, jsonutil.JSONDecodeError) as exc:
        raise ManagerError(f"request body is not valid JSON: {exc}") from None


def validate(data: Any, model: type[M]) -> M:
    """Validate decoded JSON against a schema; raises ManagerError (400) naming the field."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ManagerError(describe_validation_error(exc)) from None




@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure becomes a JSON ``{"error": ...}`` with the right status; nothing escapes."""
    try:
        return await handler(request)
    except Unauthorized as exc:
        resp = error_response(401, str(exc))
        resp.headers["WWW-Authenticate"] = 'Bearer realm="rollout-manager"'
        return resp
    except ManagerError as exc:
        return error_response(exc.status, str(exc))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        if exc.status == 413:
            return error_response(413, f"request body too large (limit {request.app[MAX_BODY]} bytes)")
        if exc.status == 404:
            return error_response(404, f"no such endpoint: {request.method} {request.path}")
        if exc.status == 405:
            return error_response(405, f"method {request.method} not allowed on {request.path}")
        return error_response(exc.status, exc.reason)
    except Exception:  # the daemon answers 500 and keeps running
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(500, "internal error; see the manager's log")


@web.middleware
async def bearer_auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    """With ``auth_token`` set, everything but the open paths needs ``Authorization: Bearer <token>``."""
    token = request.app[MANAGER].config.auth_token
    if token and (request.method, request.path) not in OPEN_PATHS:
        if not bearer_matches(request.headers.get("Authorization", ""), token):
            raise Unauthorized("missing or wrong bearer token (Authorization: Bearer <auth_token>)")
    return await handler(request)


def manager_of(request: web.Request) -> Manager:
    return request.app[MANAGER]


def accepts(model: type[M], *, large: bool = False, optional: bool = False) -> Callable[..., Handler]:
    """Declare a handler's body schema: the body is decoded and validated before the handler runs,
    and the OpenAPI document (``openapi.py``) reads the same model, so the two cannot drift."""

    def wrap(fn: Callable[[web.Request, Any, Any], Awaitable[web.StreamResponse]]) -> Handler:
        @functools.wraps(fn)
        async def handler(request: web.Request) -> web.StreamResponse:
            data = await read_json(request, optional=optional, large=large)
            return await fn(request, validate(data, model), data)

        handler.body_model = model  # type: ignore[attr-defined]
        handler.body_optional = optional  # type: ignore[attr-defined]
        return handler

    return wrap


async def health(request: web.Request) -> web.Response:
    """Liveness: always open, even with an auth token."""
    m = manager_of(request)
    counts = m.registry.counts()
    return json_response({
        "status": "healthy", "service": "rollout-manager", "version": __version__, "weight_version": m.weight_version,
        "instances": counts, "run_id": m.run_id, "started_at": m.started_at,
    })


@accepts(RegisterRolloutInstance)
async def register_rollout_instance(request: web.Request, body: RegisterRolloutInstance, _: Any) -> web.Response:
    """Register a rollout box (pending until /health_generate succeeds); 409 if already registered."""
    await manager_of(request).check_registration_source(request.remote, body.host)
    result = manager_of(request).register_remote(body.host, body.port, body.mooncake_handshake_port,
                                                 body.weight_receiver_port)
    return json_response(result)


@accepts(RegisterLocalRolloutInstances)
async def register_local_rollout_instances(request: web.Request, body: RegisterLocalRolloutInstances,
                                           _: Any) -> web.Response:
    """Register trainer-side instances, all or none; the trainer updates their weights itself."""
    await manager_of(request).check_registration_source(request.remote, None)
    return json_response(manager_of(request).register_local(body.root))


async def get_instances_status(request: web.Request) -> web.Response:
    """Every instance with its state, kind, weight version, group and load, plus recent events."""
    return json_response(manager_of(request).status())


@accepts(ShutdownInstances)
async def shutdown_instances(request: web.Request, body: ShutdownInstances, _: Any) -> web.Response:
    """Drain and remove instances; answers which were removed, unknown or skipped."""
    result = await manager_of(request).shutdown_instances(body.endpoints, body.check_weight_update)
    return json_response(result)


@accepts(UpdateWeightSenders)
async def update_weight_senders(request: web.Request, body: UpdateWeightSenders, _: Any) -> web.Response:
    """The trainer nodes' IPs; groups per allowed interface, instances re-dealt round-robin."""
    result = manager_of(request).update_weight_senders(
        body.weight_sender_ips, body.num_mooncake_groups_per_sender, body.num_mooncake_engines_per_group
    )
    return json_response(result)


@accepts(GenerateRequest, large=True)
async def generate(request: web.Request, body: GenerateRequest, data: Any) -> web.StreamResponse:
    """SGLang's /generate through the pool, continued on another instance if one dies mid-sequence."""
    generator = manager_of(request).generator
    assert generator is not None
    if not body.stream:  # validated; the caller's own dict goes on unchanged
        return json_response(await generator.generate(data))
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    chunks = generator.generate_stream(data)
    try:
        async for ready in chunks:
            await resp.write(b"".join(wire.sse_frame(chunk) for chunk in ready))
    finally:
        await chunks.aclose()
    await resp.write(wire.DONE_FRAME)
    await resp.write_eof()
    return resp


@accepts(BatchGenerateRequests, large=True)
async def batch_generate_requests(request: web.Request, _: BatchGenerateRequests, data: Any) -> web.StreamResponse:
    """Many /generate bodies at once; NDJSON results in completion order, every id exactly once."""
    generator = manager_of(request).generator
    assert generator is not None
    items = [(rid, req) for rid, req in data]
    resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await resp.prepare(request)
    lines = run_batch(generator, items)
    try:
        async for ready in lines:
            await resp.write(b"".join(jsonutil.dumps(line) + b"\n" for line in ready))
    finally:
        await lines.aclose()  # on a client disconnect this aborts what is still running
    await resp.write_eof()
    return resp


@accepts(Empty, optional=True)
async def abort_local_requests(request: web.Request, _: Empty, __: Any) -> web.Response:
    """Close the local window now: sequences on trainer-side instances continue on remote ones."""
    return json_response(manager_of(request).abort_local_requests())


@accepts(UpdateMetrics)
async def update_metrics(request: web.Request, body: UpdateMetrics, _: Any) -> web.Response:
    """A step ended: adapt the local budget from the trainer's bubble and the remote idle time."""
    result = manager_of(request).update_metrics(body.step_time_s, body.trainer_bubble_time_s,
                                                body.step_throughput)
    return json_response(result)


@accepts(UpdateWeightVersion, optional=True)
async def update_weight_version(request: web.Request, body: UpdateWeightVersion, _: Any) -> web.Response:
    """New weights are staged: remote instances sync to the new version; optionally wait for them."""
    result = await manager_of(request).update_weight_version(body.new_version, body.wait_for_instances,
                                                              body.timeout_s)
    return json_response(result)


async def metrics_text(request: web.Request) -> web.Response:
    """Prometheus metrics (open, like /health)."""
    return request.app[METRICS].response()


async def status_page_html(request: web.Request) -> web.Response:
    """The live status page (HTML; it reads /get_instances_status every second)."""
    return status_page.response()


async def openapi_json(request: web.Request) -> web.Response:
    """This API described as OpenAPI 3.1, generated from the schemas that validate the bodies."""
    return json_response(build_openapi(ROUTES, __version__))


ROUTES: list[tuple[str, str, Handler]] = [
    ("GET", "/health", health),
    ("POST", "/register_rollout_instance", register_rollout_instance),
    ("POST", "/register_local_rollout_instances", register_local_rollout_instances),
    ("GET", "/get_instances_status", get_instances_status),
    ("POST", "/shutdown_instances", shutdown_instances),
    ("PUT", "/update_weight_senders", update_weight_senders),
    ("POST", "/generate", generate),
    ("POST", "/batch_generate_requests", batch_generate_requests),
    ("POST", "/abort_local_requests", abort_local_requests),
    ("POST", "/update_metrics", update_metrics),
    ("POST", "/update_weight_version", update_weight_version),
    ("GET", "/metrics", metrics_text),
    ("GET", "/", status_page_html),
    ("GET", "/openapi.json", openapi_json),
]


def create_app(manager: Manager) -> web.Application:
    max_body = int(manager.config.max_request_body_mb * 1024 * 1024)
    app = web.Application(middlewares=[json_errors, bearer_auth], client_max_size=max_body)
    app[MANAGER] = manager
    app[MAX_BODY] = max_body
    app[METRICS] = ManagerMetrics(manager)
    app[MAX_ADMIN_BODY] = int(manager.config.max_admin_body_kb * 1024)
    for method, path, handler in ROUTES:
        app.router.add_route(method, path, handler)
    return app
