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

It may be a coroutine function. The default, :func:`push_to_rollout_manager`, stages the weights on
rank zero into this node's sender agent and publishes them as version ``global_steps`` (the other
ranks drain the iterator); :func:`discard_weights` pushes nothing.
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


class WeightPusher:
    """Rank zero's half of the weight push: this node's sender agent, staging, and the version bump.

    ``start()`` opens the sender agent on this node's IPs at the manager's ``weight_sender_base_port``
    and reports them with ``PUT /update_weight_senders``; ``push(state_dict, version)`` stages the
    full state dict into the agent's registered host buffer and calls ``/update_weight_version``,
    waiting as configured (``wait_for``: "all", a count, or None to proceed at once). Tensor names go
    through unchanged: give HF names, which is what SGLang's ``load_weights`` expects.
    """

    def __init__(self, manager_url: str, node_ips: list[str], sender_port: int, *, protocol: str = "tcp",
                 device_name: str = "", wait_for: int | str | None = "all", timeout_s: float = 600.0,
                 groups_per_sender: int | None = None, engines_per_group: int | None = None):
        self.manager_url = manager_url.rstrip("/")
        self.node_ips = list(node_ips)
        self.sender_port = sender_port
        self.protocol = protocol
        self.device_name = device_name
        self.wait_for = wait_for
        self.timeout_s = timeout_s
        self.groups_per_sender = groups_per_sender
        self.engines_per_group = engines_per_group
        self.sender: Any = None
        self.version = 0
        self.run_id: str | None = None

    async def start(self, client: Any) -> dict:
        from rollout_manager.weights.sender_agent import SenderAgent

        self.sender = SenderAgent(self.node_ips, self.sender_port, protocol=self.protocol,
                                  device_name=self.device_name).start()
        return await self._report(client)

    async def _report(self, client: Any) -> dict:
        """Tell the manager where the senders are; remember which manager run heard it."""
        self.run_id = (await client.health()).get("run_id")
        return await client.update_weight_senders(
            [self.node_ips], num_mooncake_groups_per_sender=self.groups_per_sender,
            num_mooncake_engines_per_group=self.engines_per_group)

    async def push(self, client: Any, state_dict: Any, version: int | None = None) -> dict:
        """Stage ``state_dict`` (a mapping or ``(name, tensor)`` pairs) as ``version`` and publish it."""
        import asyncio

        if self.sender is None:
            raise RuntimeError("WeightPusher.start() first")
        version = self.version + 1 if version is None else int(version)
        named = dict(state_dict.items() if hasattr(state_dict, "items") else state_dict)
        if (await client.health()).get("run_id") != self.run_id:  # the manager restarted: it forgot us
            log.warning("rollout manager restarted; reporting the weight senders again")
            await self._report(client)
        await asyncio.to_thread(self.sender.stage, named, version)
        answer = await client.update_weight_version(version, wait_for=self.wait_for, timeout_s=self.timeout_s)
        self.version = version
        if answer.get("timed_out"):
            log.warning("weight version %d: only %s instance(s) had it after %.0fs", version,
                        answer.get("instances_at_version"), self.timeout_s)
        return answer

    def stop(self) -> None:
        if self.sender is not None:
            self.sender.stop()
            self.sender = None


_PUSHER: "tuple[WeightPusher, Any] | None" = None


async def push_to_rollout_manager(weights: Iterable[Any], global_steps: int | None,
                                  context: WeightPushContext) -> dict:
    """Default hook: rank zero pushes the full state dict as weight version ``global_steps``.

    Every rank drains the iterator (FSDP gathers are collective); rank zero keeps the tensors, stages
    them into the sender agent's registered buffer and calls ``/update_weight_version``, waiting as
    ``custom.rollout_manager.weight_push_wait`` says. ``global_steps`` None (start-up) is version 0,
    which every instance loaded from the model path: nothing to push.
    """
    if context.rank != 0 or global_steps is None:
        for _ in weights:
            pass
        return {"pushed": False}
    named = {name: tensor.detach() for name, tensor in weights}
    pusher, client = await _pusher(context)
    answer = await pusher.push(client, named, version=int(global_steps))
    return {"pushed": True, **answer}


async def _pusher(context: WeightPushContext) -> "tuple[WeightPusher, Any]":
    """One pusher per process, set up from the plugin settings and the manager's sender settings."""
    global _PUSHER
    if _PUSHER is None:
        from rollout_manager.box import detect_host

        from .client import ManagerClient
        from .settings import from_rollout_config

        settings = from_rollout_config(context.rollout_config).manager
        client = ManagerClient(context.manager_url)
        senders = (await client.get_instances_status())["weight_senders"]
        ips = list(settings.sender_ips) or [detect_host(context.manager_url)]
        wait: int | str | None = settings.weight_push_wait
        wait = None if wait == "none" else (int(wait) if str(wait).isdigit() else wait)
        pusher = WeightPusher(context.manager_url, ips, senders["weight_sender_base_port"],
                              protocol=senders["mooncake_transfer_protocol"],
                              device_name=senders["mooncake_transfer_device_name"],
                              wait_for=wait, timeout_s=settings.weight_push_timeout_s)
        await pusher.start(client)
        _PUSHER = (pusher, client)
    return _PUSHER
