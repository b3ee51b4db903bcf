"""The generic aiohttp plumbing under the manager's API: JSON answers, body reading and validation,
the error and bearer-token middlewares, and ``accepts`` (a handler's declared body schema).

Nothing here knows the manager: ``routes.py`` holds the handlers and wires these together.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Collection
from typing import TYPE_CHECKING, Any, TypeVar

from aiohttp import hdrs, web
from pydantic import BaseModel, ValidationError

from rollout_manager import jsonutil
from rollout_manager.api.lane_head import MAX_LENGTH_DIGITS
from rollout_manager.bearer import bearer_matches, bearer_value
from rollout_manager.errors import (
    INTERNAL_ERROR,
    BadRequest,
    InvalidField,
    InvalidJSON,
    ManagerError,
    TooLarge,
    Unauthorized,
)
from rollout_manager.validation import describe_validation_error

if TYPE_CHECKING:  # a Protocol in aiohttp's typedefs, not importable from every supported aiohttp
    from aiohttp.typedefs import Middleware

log = logging.getLogger("rollout_manager.http")

# Body limits in bytes, set by the app: generation bodies may be large, admin bodies are small.
MAX_BODY: web.AppKey[int] = web.AppKey("max_body", int)
MAX_ADMIN_BODY: web.AppKey[int] = web.AppKey("max_admin_body", int)
# Seconds a request's body may take to arrive (http_body_timeout_s), set by ``connections``; absent: no bound.
BODY_TIMEOUT: web.AppKey[float] = web.AppKey("body_timeout", float)
# On a request that passed with a box token instead of the shared one: that token (see bearer_auth).
BOX_TOKEN = "rollout_manager.box_token"
# Told of every 4xx answer: (endpoint, reason). The metrics count them; see json_errors.
ON_REJECT: web.AppKey[Callable[[str, str], None]] = web.AppKey("on_reject")
M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class BodyTimeout(ManagerError):
    """The body did not arrive in time: the connection trickles or stalled."""

    status = 408
    reason = "body_timeout"

    @classmethod
    def after(cls, timeout_s: float) -> BodyTimeout:
        return cls(f"request body not received within {timeout_s:g}s (http_body_timeout_s)")


def json_response(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=jsonutil.dumps(data), status=status, content_type="application/json")


def error_response(status: int, message: str) -> web.Response:
    return json_response({"error": message}, status=status)


async def read_json(request: web.Request, *, optional: bool = False, large: bool = False) -> Any:
    """Read and decode a JSON body; raises ManagerError (400) when it is empty or not JSON.

    Admin bodies are small: past ``MAX_ADMIN_BODY`` they get 413; generation bodies (``large``)
    may go up to ``MAX_BODY`` (the server's own cap).
    """
    limit = request.app[MAX_BODY] if large else request.app[MAX_ADMIN_BODY]
    declared = declared_length(request)
    if declared is not None and declared > limit:
        raise TooLarge(f"request body too large ({declared} bytes; limit {limit})")
    timeout = request.app.get(BODY_TIMEOUT)
    if request.content.is_eof():  # the whole body came with the headers: no wait, so no timer or task
        timeout = None
    try:
        raw = await (request.read() if timeout is None else asyncio.wait_for(request.read(), timeout))
    except asyncio.TimeoutError:
        if timeout is None:  # not the body's bound: someone else's timeout
            raise
        raise BodyTimeout.after(timeout) from None
    except web.RequestPayloadError as exc:  # e.g. a Content-Encoding the body is not in: the caller's mistake
        detail = str(exc).split("message:", 1)[-1].strip()
        raise BadRequest(f"request body could not be read: {detail}") from None
    return decode_json(raw, limit, optional=optional)


def declared_length(request: web.Request) -> int | None:
    """The body's ``Content-Length``, refused (400) when it has more digits than any real length.

    llhttp lets through only digits whose value fits 64 bits, but leading zeros are not counted, and
    aiohttp's ``request.content_length`` converts the text with ``int()``, which raises past 4,300
    digits (Python's limit on converting strings to integers): that was a 500."""
    text = request.headers.get(hdrs.CONTENT_LENGTH)
    if text is None:
        return None
    if len(text) > MAX_LENGTH_DIGITS:
        raise BadRequest(f"Content-Length has {len(text)} characters; at most {MAX_LENGTH_DIGITS} are taken")
    return request.content_length


def decode_json(raw: bytes, limit: int, *, optional: bool = False) -> Any:
    """A body as read -> its JSON; raises ManagerError (400, 413) when it is too large, empty or not
    JSON, or nested too deep to pass on."""
    if len(raw) > limit:
        raise TooLarge(f"request body too large ({len(raw)} bytes; limit {limit})")
    if optional and not raw.strip():  # in this order: strip() copies the body
        raw = b"{}"
    if not raw:
        raise InvalidJSON("request body is empty; expected JSON")
    try:
        data = jsonutil.loads(raw)
    except (UnicodeDecodeError, jsonutil.JSONDecodeError) as exc:
        if jsonutil.is_depth_error(exc):
            raise InvalidJSON(f"the body: JSON nested deeper than the limit of {jsonutil.MAX_DEPTH} levels") from None
        raise InvalidJSON(f"request body is not valid JSON: {exc}") from None
    # Passed-through fields go on to an engine as JSON: a body the manager could not encode again
    # would fail later, as an internal error, so too deep a value is refused here, by name.
    where = jsonutil.too_deep(data, raw)
    if where is not None:
        field = "the body" if where == "body" else f"field '{where}'"
        raise InvalidField(f"{field}: JSON nested deeper than the limit of {jsonutil.MAX_DEPTH} levels") from None
    return data


def validate(data: Any, model: type[M]) -> M:
    """Validate decoded JSON against a schema; raises ManagerError (400) naming the field."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise InvalidField(describe_validation_error(exc)) from None


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure becomes a JSON ``{"error": ...}`` with the right status; nothing escapes.

    A 4xx is the caller's mistake: logged at debug only (a misbehaving client must not flood the
    log) and counted per endpoint and reason through ``ON_REJECT``.
    """
    try:
        return await handler(request)
    except Unauthorized as exc:
        resp = _refused(request, exc.status, exc.reason, str(exc))
        resp.headers["WWW-Authenticate"] = 'Bearer realm="rollout-manager"'
        return resp
    except ManagerError as exc:
        return _refused(request, exc.status, exc.reason, str(exc))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        if exc.status == 413:
            return _refused(request, 413, "too_large", f"request body too large (limit {request.app[MAX_BODY]} bytes)")
        if exc.status == 404:
            return _refused(request, 404, "no_route", f"no such endpoint: {request.method} {request.path}")
        if exc.status == 405:
            return _refused(request, 405, "method_not_allowed",
                            f"method {request.method} not allowed on {request.path}")
        return _refused(request, exc.status, "http_error", exc.reason)
    except Exception:  # the daemon answers 500 and keeps running
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(500, INTERNAL_ERROR)


def _refused(request: web.Request, status: int, reason: str, message: str) -> web.Response:
    if 400 <= status < 500:
        resource = request.match_info.route.resource
        endpoint = resource.canonical if resource is not None else "unmatched"
        log.debug("%s %s refused with %d (%s): %s", request.method, request.path, status, reason, message)
        on_reject = request.app.get(ON_REJECT)
        if on_reject is not None:
            on_reject(endpoint, reason)
    return error_response(status, message)


def bearer_auth(token: str, open_paths: Collection[tuple[str, str]], *,
                box_paths: Collection[tuple[str, str]] = (),
                is_box_token: Callable[[str], bool] | None = None) -> Middleware:
    """With ``token`` set, everything but ``open_paths`` (``(method, path)``) needs
    ``Authorization: Bearer <token>``; ``json_errors`` turns the refusal into a 401.

    On ``box_paths`` a bearer that ``is_box_token`` recognises passes too; the handler finds it in
    ``request[BOX_TOKEN]`` and limits what it may touch.
    """

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        where = (request.method, request.path)
        if token and where not in open_paths:
            header = request.headers.get("Authorization", "")
            if not bearer_matches(header, token):
                presented = bearer_value(header)
                if not (presented and where in box_paths and is_box_token is not None and is_box_token(presented)):
                    raise Unauthorized("missing or wrong bearer token (Authorization: Bearer <auth_token>)")
                request[BOX_TOKEN] = presented
        return await handler(request)

    return middleware


def accepts(model: type[M], *, large: bool = False, optional: bool = False) -> Callable[..., Handler]:
    """Declare a handler's body schema: the body is decoded and validated before the handler runs,
    and the OpenAPI document (``openapi.py``) reads the same model, so the two cannot drift."""

    def wrap(fn: Callable[[web.Request, Any, Any], Awaitable[web.StreamResponse]]) -> Handler:
        @functools.wraps(fn)
        async def handler(request: web.Request) -> web.StreamResponse:
            data = await read_json(request, optional=optional, large=large)
            return await fn(request, validate(data, model), data)

        return _declared(handler, model, optional)

    return wrap


def _declared(handler: Handler, model: type[BaseModel], optional: bool) -> Handler:
    """``handler`` marked with its body's schema, which the OpenAPI document (``openapi.py``) reads."""
    handler.body_model = model  # type: ignore[attr-defined]
    handler.body_optional = optional  # type: ignore[attr-defined]
    return handler


BodySchema = Callable[[str], tuple[dict[str, Any], dict[str, Any]]]


def decodes(schema: BodySchema, decode: Callable[[web.Request, Any], T]) -> Callable[..., Handler]:
    """:func:`accepts` for a generation body: ``decode(request, data)`` checks the decoded JSON and types
    it in one pass (raising ManagerError, 400, naming the field), and the handler gets the typed value.
    Neither the caller's JSON nor any other form of it outlives the decode: a request held while its
    sequences run costs only its typed value. ``schema(ref_template)`` describes the body in the OpenAPI
    document (``openapi.py``): its JSON schema and the named schemas it refers to."""

    def wrap(fn: Callable[[web.Request, T], Awaitable[web.StreamResponse]]) -> Handler:
        @functools.wraps(fn)
        async def handler(request: web.Request) -> web.StreamResponse:
            return await fn(request, decode(request, await read_json(request, large=True)))

        handler.body_schema = schema  # type: ignore[attr-defined]
        return handler

    return wrap
