"""The agents' side of the shared token: the manager drives them with the same bearer token it requires."""

from __future__ import annotations

import hmac
import os
from typing import Awaitable, Callable

from aiohttp import web

TOKEN_ENV = "ROLLOUT_MANAGER_AUTH_TOKEN"


def token_middleware(token: str | None = None) -> Callable:
    """Require ``Authorization: Bearer <token>`` on everything but ``GET /health`` when a token is set
    (default: ``$ROLLOUT_MANAGER_AUTH_TOKEN``)."""
    secret = (os.environ.get(TOKEN_ENV, "") if token is None else token).encode()

    @web.middleware
    async def check(request: web.Request,
                    handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        if secret and not (request.method == "GET" and request.path == "/health"):
            scheme, _, value = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode(), secret):
                return web.json_response({"error": "missing or wrong bearer token"}, status=401)
        return await handler(request)

    return check
