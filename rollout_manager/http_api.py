"""The manager's HTTP API: parse, validate, call the core, answer JSON. Nothing else lives here."""

from __future__ import annotations

import logging
from typing import Any, Awaitable, Callable, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from . import __version__, jsonutil
from . import sglang_wire as wire
from .errors import ManagerError
from .generation import run_batch
from .manager import Manager
from .schemas import (
    BatchGenerateRequests,
    Empty,
    GenerateRequest,
    UpdateMetrics,
    UpdateWeightVersion,
    RegisterLocalRolloutInstances,
    RegisterRolloutInstance,
    ShutdownInstances,
    UpdateWeightSenders,
)

log = logging.getLogger("rollout_manager.http")

MANAGER: web.AppKey[Manager] = web.AppKey("manager", Manager)
MAX_BODY: web.AppKey[int] = web.AppKey("max_body", int)
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


async def read_json(request: web.Request, *, optional: bool = False) -> Any:
    """Read and decode a JSON body; raises ManagerError (400) when it is empty or not JSON."""
    raw = await request.read()
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


async def parse_body(request: web.Request, model: type[M], *, optional: bool = False) -> M:
    return validate(await read_json(request, optional=optional), model)


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure becomes a JSON ``{"error": ...}`` with the right status; nothing escapes."""
    try:
        return await handler(request)
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


def manager_of(request: web.Request) -> Manager:
    return request.app[MANAGER]


async def health(request: web.Request) -> web.Response:
    m = manager_of(request)
    counts = m.registry.counts()
    return json_response({
        "status": "healthy", "service": "rollout-manager", "version": __version__, "weight_version": m.weight_version,
        "instances": counts,
    })


async def register_rollout_instance(request: web.Request) -> web.Response:
    body = await parse_body(request, RegisterRolloutInstance)
    result = manager_of(request).register_remote(body.host, body.port, body.mooncake_handshake_port,
                                                 body.weight_receiver_port)
    return json_response(result)


async def register_local_rollout_instances(request: web.Request) -> web.Response:
    body = await parse_body(request, RegisterLocalRolloutInstances)
    return json_response(manager_of(request).register_local(body.root))


async def get_instances_status(request: web.Request) -> web.Response:
    return json_response(manager_of(request).status())


async def shutdown_instances(request: web.Request) -> web.Response:
    body = await parse_body(request, ShutdownInstances)
    result = await manager_of(request).shutdown_instances(body.endpoints, body.check_weight_update)
    return json_response(result)


async def update_weight_senders(request: web.Request) -> web.Response:
    body = await parse_body(request, UpdateWeightSenders)
    result = manager_of(request).update_weight_senders(
        body.weight_sender_ips, body.num_mooncake_groups_per_sender, body.num_mooncake_engines_per_group
    )
    return json_response(result)


async def generate(request: web.Request) -> web.StreamResponse:
    data = await read_json(request)
    body = validate(data, GenerateRequest)  # validated, then the caller's own dict goes on unchanged
    generator = manager_of(request).generator
    assert generator is not None
    if not body.stream:
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


async def batch_generate_requests(request: web.Request) -> web.StreamResponse:
    data = await read_json(request)
    validate(data, BatchGenerateRequests)
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


async def abort_local_requests(request: web.Request) -> web.Response:
    await parse_body(request, Empty, optional=True)
    return json_response(manager_of(request).abort_local_requests())


async def update_metrics(request: web.Request) -> web.Response:
    body = await parse_body(request, UpdateMetrics)
    result = manager_of(request).update_metrics(body.step_time_s, body.trainer_bubble_time_s,
                                                body.step_throughput)
    return json_response(result)


async def update_weight_version(request: web.Request) -> web.Response:
    body = await parse_body(request, UpdateWeightVersion, optional=True)
    result = await manager_of(request).update_weight_version(body.new_version, body.wait_for_instances,
                                                              body.timeout_s)
    return json_response(result)


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
]


def create_app(manager: Manager) -> web.Application:
    max_body = int(manager.config.max_request_body_mb * 1024 * 1024)
    app = web.Application(middlewares=[json_errors], client_max_size=max_body)
    app[MANAGER] = manager
    app[MAX_BODY] = max_body
    for method, path, handler in ROUTES:
        app.router.add_route(method, path, handler)
    return app
