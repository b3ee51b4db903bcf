"""The agents' side of the shared token: the manager drives them with the same bearer token it requires.

Runs in: box, trainer.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from rollout_manager.bearer import TOKEN_ENV, bearer_matches


def token_middleware(token: str | None = None) -> Callable[..., Any]:
    """Require ``Authorization: Bearer <token>`` on everything but ``GET /health`` when a token is set
    (default: ``$ROLLOUT_MANAGER_AUTH_TOKEN``)."""
    secret = os.environ.get(TOKEN_ENV, "") if token is None else token

    @web.middleware
    async def check(request: web.Request,
                    handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        if secret and not (request.method == "GET" and request.path == "/health"):
            if not bearer_matches(request.headers.get("Authorization", ""), secret):
                return web.json_response({"error": "missing or wrong bearer token"}, status=401)
        return await handler(request)

    return check
