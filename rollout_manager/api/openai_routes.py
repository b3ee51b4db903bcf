"""The OpenAI-compatible front's HTTP layer: read the body, call ``openai_front``'s :class:`Front`, write
JSON or server-sent events.

Every refusal is OpenAI's error object (``openai_front.errors.OpenAIError``) whatever raised it. The session id comes
from the body field ``session_id`` or, when the body has none, the ``X-Session-Id`` header (the body wins,
as ``trajectory_key`` wins over ``X-Trajectory-Key`` on ``/generate``).

A session's caller is its owner key, the ``X-Session-Owner`` header its first turn sent (a secret the
caller picks; the ledger keeps its digest): later turns, reads and frees of that session must send the same
key or get 403 naming ``session_id``, and change nothing. The bearer token cannot tell callers apart (the
manager has one ``auth_token``), so the key is what does. A session opened without a key answers to anyone.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Awaitable, Callable
from functools import wraps
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry

from rollout_manager.api.http import json_response, read_json
from rollout_manager.errors import ManagerError
from rollout_manager.manager import Manager
from rollout_manager.openai_front.errors import OpenAIError, invalid
from rollout_manager.openai_front.front import Front, Prepared
from rollout_manager.openai_front.ledger_metrics import LedgerCollector
from rollout_manager.openai_front.schemas import (
    ChatRequest,
    CompletionRequest,
    check_messages,
    check_tools,
    check_unsupported,
    decode_body,
)
from rollout_manager.sglang import wire
from rollout_manager.sglang.sse import sse_frame

log = logging.getLogger("rollout_manager.api.openai_routes")
FRONT: web.AppKey[Front] = web.AppKey("openai_front", Front)
SESSION_HEADER = "X-Session-Id"
OWNER_HEADER = "X-Session-Owner"
# ``return_routed_experts`` for a client that cannot add body fields to every call (an agent's SDK client
# made by the verl agent loop): "true" asks for them as the body field does
EXPERTS_HEADER = "X-Return-Routed-Experts"
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# the ledger collector each manager's registry holds (one per registry: a second app replaces the first's)
_COLLECTORS: weakref.WeakKeyDictionary[CollectorRegistry, LedgerCollector] = weakref.WeakKeyDictionary()


def _openai_errors(fn: _Handler) -> _Handler:
    @wraps(fn)
    async def handler(request: web.Request) -> web.StreamResponse:
        try:
            return await fn(request)
        except OpenAIError as exc:
            return json_response(exc.to_json(), exc.status)
        except ManagerError as exc:  # the body's reading (size, JSON) and the manager's own refusals
            err = OpenAIError(exc.status, str(exc), None, exc.reason)
            return json_response(err.to_json(), exc.status)
    return handler


def _session_id(request: web.Request, body: ChatRequest | CompletionRequest) -> str | None:
    if body.session_id is not None:
        return body.session_id
    header = request.headers.get(SESSION_HEADER)
    if header is not None and not 1 <= len(header) <= 256:
        raise invalid(SESSION_HEADER, f"{SESSION_HEADER} must be 1 to 256 characters")
    return header


def _experts_header(request: web.Request, body: ChatRequest | CompletionRequest) -> None:
    value = request.headers.get(EXPERTS_HEADER)
    if value is None:
        return
    if value.lower() not in ("true", "false"):
        raise invalid(EXPERTS_HEADER, f"{EXPERTS_HEADER} must be true or false")
    body.return_routed_experts = body.return_routed_experts or value.lower() == "true"


def _owner(request: web.Request) -> str | None:
    key = request.headers.get(OWNER_HEADER)
    if key is not None and not 1 <= len(key) <= 256:
        raise invalid(OWNER_HEADER, f"{OWNER_HEADER} must be 1 to 256 characters")
    return key


async def _answer(request: web.Request, front: Front, prepared: Prepared, include_usage: bool) -> web.StreamResponse:
    if not prepared.request.stream:
        return json_response(await front.run(prepared))
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    chunks = front.stream(prepared, include_usage)
    try:
        await resp.prepare(request)
        async for obj in chunks:
            await resp.write(sse_frame(obj))
        await resp.write(wire.DONE_FRAME)
        await resp.write_eof()
    except ConnectionError:  # the caller went away: its turn is aborted below and not recorded
        pass
    finally:
        await chunks.aclose()  # closes the generator's stream (aborting what runs)
        front.close(prepared)  # frees the session even if the stream never started
    return resp


@_openai_errors
async def chat_completions(request: web.Request) -> web.StreamResponse:
    front = request.app[FRONT]
    body = decode_body(await read_json(request, large=True), ChatRequest)
    check_messages(body.messages)
    check_tools(body.tools, body.tool_choice)
    check_unsupported(body)
    _experts_header(request, body)
    prepared = await front.prepare_chat(body, _session_id(request, body), _owner(request))
    return await _answer(request, front, prepared, body.include_usage)


@_openai_errors
async def completions(request: web.Request) -> web.StreamResponse:
    front = request.app[FRONT]
    body = decode_body(await read_json(request, large=True), CompletionRequest)
    check_unsupported(body)
    _experts_header(request, body)
    prepared = await front.prepare_completion(body, _session_id(request, body), _owner(request))
    return await _answer(request, front, prepared, body.include_usage)


def _model(front: Front) -> dict[str, Any]:
    return {"id": front.model, "object": "model", "created": front.created, "owned_by": "rollout-manager"}


@_openai_errors
async def list_models(request: web.Request) -> web.StreamResponse:
    return json_response({"object": "list", "data": [_model(request.app[FRONT])]})


@_openai_errors
async def get_model(request: web.Request) -> web.StreamResponse:
    front = request.app[FRONT]
    name = request.match_info["model"]
    if name != front.model:
        raise OpenAIError(404, f"the model {name!r} does not exist", "model", "model_not_found")
    return json_response(_model(front))


@_openai_errors
async def sessions(request: web.Request) -> web.StreamResponse:
    """The ledger's bounds and use."""
    return json_response(request.app[FRONT].ledger.status())


def _unknown_session(session_id: str) -> OpenAIError:
    return OpenAIError(404, f"no session {session_id!r} (never opened, freed or expired)", "session_id",
                       "session_not_found")


@_openai_errors
async def trajectory(request: web.Request) -> web.StreamResponse:
    """A session's trajectory, kept (``DELETE /v1/sessions/{id}`` returns it and frees it)."""
    session_id = request.match_info["session_id"]
    front = request.app[FRONT]
    session = front.ledger.get(session_id)
    if session is None:
        raise _unknown_session(session_id)
    session.check_owner(_owner(request))
    await front.check(session)
    return json_response(session.to_json())


@_openai_errors
async def free_session(request: web.Request) -> web.StreamResponse:
    session_id = request.match_info["session_id"]
    ledger = request.app[FRONT].ledger
    session = ledger.get(session_id)
    if session is not None:
        session.check_owner(_owner(request))
    if session is not None and session.busy:
        raise OpenAIError(409, f"session {session_id!r} is running a turn", "session_id", "session_busy")
    session = ledger.release(session_id)
    if session is None:
        raise _unknown_session(session_id)
    await request.app[FRONT].check(session)
    return json_response(session.to_json())


ROUTES: list[tuple[str, str, _Handler]] = [
    ("GET", "/v1/models", list_models),
    ("GET", "/v1/models/{model}", get_model),
    ("POST", "/v1/chat/completions", chat_completions),
    ("POST", "/v1/completions", completions),
    ("GET", "/v1/sessions", sessions),
    ("GET", "/v1/sessions/{session_id}/trajectory", trajectory),
    ("DELETE", "/v1/sessions/{session_id}", free_session),
]


def register(app: web.Application, manager: Manager) -> None:
    """Add the front's routes to the manager's app (``api.routes.create_app``), and its ledger's figures to
    the manager's ``/metrics`` (in place of an earlier app's, when one was made for the same manager)."""
    front = app[FRONT] = Front(manager)
    for method, path, handler in ROUTES:
        app.router.add_route(method, path, handler)
    registry = manager.metrics.prometheus
    earlier = _COLLECTORS.pop(registry, None)
    if earlier is not None:
        registry.unregister(earlier)
    collector = _COLLECTORS[registry] = LedgerCollector(front.ledger)
    registry.register(collector)
