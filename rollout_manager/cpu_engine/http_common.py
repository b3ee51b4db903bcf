"""What the CPU engine's HTTP handlers share: the app's keys, the error answer, the JSON body reader."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from rollout_manager.cpu_engine.engine import Engine
from rollout_manager.cpu_engine.request import RequestRefused
from rollout_manager.cpu_engine.rwlock import RWLock
from rollout_manager.sglang import wire

ENGINE_KEY = web.AppKey("engine", Engine)


@dataclass
class WeightSession:
    """SGLang's weight-update session (one per server): open between begin and end_weight_update; and its
    model_update_lock, held shared by every /generate and exclusively by a weight update."""

    open: bool = False
    lock: RWLock = field(default_factory=RWLock)


WEIGHT_SESSION_KEY = web.AppKey("weight_session", WeightSession)




def error_response(message: str, status: int = 400, err_type: str = "BadRequest") -> web.Response:
    return web.json_response(wire.error_object(message, status, err_type), status=status)


async def json_body(request: web.Request, *, required: bool = True) -> Any:
    raw = await request.read()
    if not raw.strip():
        if required:
            raise RequestRefused("a JSON body is required")
        return {}
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestRefused(f"the body is not valid JSON: {exc}") from None


def engine_of(request: web.Request) -> Engine:
    return request.app[ENGINE_KEY]

