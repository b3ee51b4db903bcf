"""The weight-push hook: where each training rank hands its updated weights over after a step.

verl 0.9.1 calls ``update_weights(weights, global_steps=...)`` on the rollout adapter of every
training rank after each update (the ``naive`` checkpoint manager that V1's sync trainer forces).
The adapter (:class:`trainer_plugin.verl_rollout.ManagerServerAdapter`) passes the call to the
function named by ``actor_rollout_ref.rollout.custom.rollout_manager.weight_push``
(``"module:function"``, imported in the worker process), with:

``weights``
    an iterator of ``(name, tensor)`` pairs (``wire_format="named_tensors"``). Every rank MUST
    iterate it to the end: with FSDP, producing each full tensor is a collective across ranks.
``global_steps``
    the step whose weights these are (the new weight version), or None at start-up.
``context``
    a :class:`WeightPushContext`: rank, world size, manager URL, the rollout config.

It may be a coroutine function. The default, :func:`discard_weights`, consumes the iterator and
warns once: remote instances keep the weights they have. The Mooncake push (stage into the
sender's registered host buffer, then ``POST /update_weight_version``) plugs in here.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterable

log = logging.getLogger("trainer_plugin.weight_push")

WeightPush = Callable[..., "Awaitable[Any] | Any"]
_warned = False


@dataclass
class WeightPushContext:
    rank: int
    world_size: int
    manager_url: str
    rollout_config: Any
    wire_format: str = "named_tensors"
    kwargs: dict | None = None


def discard_weights(weights: Iterable[Any], global_steps: int | None, context: WeightPushContext) -> dict:
    """Default hook: consume the weights (every rank must) and push nothing."""
    global _warned
    count = 0
    nbytes = 0
    for item in weights:
        count += 1
        tensor = item[1] if isinstance(item, tuple) and len(item) == 2 else None
        nbytes += int(getattr(tensor, "nbytes", 0) or 0)
    if not _warned and context.rank == 0:
        _warned = True
        log.warning("rollout-manager plugin: no weight push is configured (custom.rollout_manager.weight_push); "
                    "remote rollout instances keep their current weights (step %s, %d tensors, %.1f MB)",
                    global_steps, count, nbytes / 1e6)
    return {"tensors": count, "bytes": nbytes, "pushed": False}


def load_weight_push(path: str) -> WeightPush:
    """``"package.module:function"`` -> the function."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"weight_push must be 'module:function', got {path!r}")
    fn = getattr(importlib.import_module(module_name), attr, None)
    if not callable(fn):
        raise ValueError(f"weight_push {path!r}: {attr} is not a callable in {module_name}")
    return fn


async def call_weight_push(fn: WeightPush, weights: Iterable[Any], global_steps: int | None,
                           context: WeightPushContext) -> Any:
    result = fn(weights, global_steps, context)
    if inspect.isawaitable(result):
        result = await result
    return result
