"""The weight-push hook: where each training rank hands its updated weights over after a step.

verl 0.9.1 calls ``update_weights(weights, global_steps=...)`` on the rollout adapter of every
training rank after each update (the ``naive`` checkpoint manager that V1's sync trainer forces).
The adapter (:class:`trainer_plugin.verl_rollout.ManagerServerAdapter`) passes the call to the
function named by ``actor_rollout_ref.rollout.custom.rollout_manager.weight_push``
(``"module:function"``, imported in the worker process), with:

``weights``
    an iterator of ``(name, tensor)`` pairs (``wire_format="named_tensors"``). Every rank MUST
    iterate it to the end: with FSDP, producing each full tensor is a collective across ranks.
    With unmerged LoRA (verl's default) the merged weights reach only each node's lowest rank (the
    one that keeps the base, see :mod:`trainer_plugin.lora_merge`); the other ranks get no tensors.
``global_steps``
    the step whose weights these are (the new weight version). verl's sync trainer also calls it from
    ``on_init_end``, after loading a checkpoint: 0 on a fresh run (the model path every instance
    loaded), N on a run resumed from step N. None: verl re-syncs weights it has not changed (around
    validation with a colocated reward model).
``context``
    a :class:`WeightPushContext`: rank, world size, manager URL, the rollout config.

It may be a coroutine function. The default, :func:`push_to_rollout_manager`, runs one sender agent
per trainer node (on the node's lowest rank, which stages the full weights into it), so every node's
NICs carry weight traffic; rank zero reports all nodes' senders to the manager and publishes each
version once every node has staged it. :func:`discard_weights` pushes nothing.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import ipaddress
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .settings import PluginSettings

log = logging.getLogger("trainer_plugin.weight_push")

WeightPush = Callable[..., "Awaitable[Any] | Any"]
_warned = False


class NodeComm(Protocol):
    """The two collectives the push needs across training ranks."""

    def all_gather(self, obj: Any) -> list[Any]: ...

    def barrier(self) -> None: ...


class TorchDistComm:
    """``torch.distributed``'s default group; a single process when it is not initialised."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist = dist if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 else None

    def all_gather(self, obj: Any) -> list[Any]:
        if self.dist is None:
            return [obj]
        out: list[Any] = [None] * self.dist.get_world_size()
        self.dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.dist is not None:
            self.dist.barrier()


@dataclass
class WeightPushContext:
    rank: int
    world_size: int
    manager_url: str
    rollout_config: Any
    wire_format: str = "named_tensors"
    kwargs: dict[str, Any] | None = None
    # the node this rank runs on (ranks that name the same node share its sender; the lowest leads it)
    # and the node's address; None: from Ray (see trainer_plugin.node_layout), never from LOCAL_RANK
    node_id: str | None = None
    node_ip: str | None = None
    comm: NodeComm | None = None


def resolve_sender_ips(entries: Sequence[str], manager_url: str, node_ip: str | None = None) -> list[str]:
    """This node's weight-traffic IPs: plain IPs as given; a CIDR picks this node's addresses inside it
    (so one config line serves every node); nothing given: ``node_ip`` (the address Ray knows the node
    by), else the address of the route to the manager."""
    from rollout_manager.osutil import source_address_toward

    if not entries and node_ip:
        return [str(ipaddress.ip_address(node_ip))]
    if not entries:
        try:
            return [source_address_toward(manager_url)]
        except (OSError, ValueError) as exc:
            raise ValueError(f"no sender_ips given and no route to the manager at {manager_url} to take this "
                             f"node's address from ({exc}); set sender_ips") from None
    ips: list[str] = []
    local: list[str] | None = None
    for entry in entries:
        if "/" not in entry:
            ips.append(str(ipaddress.ip_address(entry)))
            continue
        net = ipaddress.ip_network(entry, strict=False)
        if local is None:
            local = _local_addresses()
        ips += [a for a in local if ipaddress.ip_address(a) in net and a not in ips]
    if not ips:
        raise ValueError(f"sender_ips {list(entries)}: no address of this node ({', '.join(local or [])}) matches")
    return ips


def _local_addresses() -> list[str]:
    import socket

    import psutil  # a dependency of ray, hence of verl

    return [a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs
            if a.family in (socket.AF_INET, socket.AF_INET6)]


def discard_weights(weights: Iterable[Any], global_steps: int | None, context: WeightPushContext) -> dict[str, Any]:
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
    """One node's sender agent, staging into it, and (on the reporting rank) the version bump.

    ``start()`` opens the sender agent on this node's IPs at the manager's ``weight_sender_base_port``
    and reports it with ``PUT /update_weight_senders`` (``report(client, all_node_ips)`` reports
    every trainer node's sender instead); ``push(state_dict, version)`` is ``stage`` (copy
    the full state dict into the agent's registered host buffer) then ``publish``
    (``/update_weight_version``, waiting as configured: ``wait_for`` "all", a count, or None to
    proceed at once; ``wait_until`` "serving" (they serve it) or "staged" (they hold it verified: with
    the manager's staged activation the boxes keep generating meanwhile and load it in a short pause)).
    Tensor names go through unchanged: give HF names, which is what SGLang's ``load_weights`` expects.
    """

    def __init__(self, manager_url: str, node_ips: list[str], sender_port: int, *, protocol: str = "tcp",
                 device_name: str = "", wait_for: int | str | None = "all", timeout_s: float = 600.0,
                 groups_per_sender: int | None = None, engines_per_group: int | None = None,
                 wait_until: str = "serving"):
        self.manager_url = manager_url.rstrip("/")
        self.node_ips = list(node_ips)
        self.sender_port = sender_port
        self.protocol = protocol
        self.device_name = device_name
        self.wait_for = wait_for
        self.wait_until = wait_until
        self.timeout_s = timeout_s
        self.groups_per_sender = groups_per_sender
        self.engines_per_group = engines_per_group
        self.sender: Any = None
        self.version = 0
        self.run_id: str | None = None
        self.all_node_ips: list[list[str]] = [self.node_ips]

    def start_sender(self) -> WeightPusher:
        from rollout_manager.weights.sender_agent import SenderAgent

        self.sender = SenderAgent(self.node_ips, self.sender_port, protocol=self.protocol,
                                  device_name=self.device_name, transfer_timeout_s=self.timeout_s).start()
        return self

    async def start(self, client: Any) -> dict[str, Any]:
        self.start_sender()
        return await self.report(client)

    async def report(self, client: Any, all_node_ips: list[list[str]] | None = None) -> dict[str, Any]:
        """Tell the manager where the senders are (``all_node_ips``: every node's IPs, kept for later
        reports); remember which manager run heard it."""
        if all_node_ips is not None:
            self.all_node_ips = [list(ips) for ips in all_node_ips]
        self.run_id = (await client.health()).get("run_id")
        return await client.update_weight_senders(
            self.all_node_ips, num_mooncake_groups_per_sender=self.groups_per_sender,
            num_mooncake_engines_per_group=self.engines_per_group)

    @property
    def _agent(self) -> Any:
        if self.sender is None:
            raise RuntimeError("WeightPusher.start() first")
        return self.sender

    def stage(self, state_dict: Any, version: int) -> None:
        """Copy ``state_dict`` (a mapping or ``(name, tensor)`` pairs) into this node's sender (blocking)."""
        self._agent.stage(dict(state_dict.items() if hasattr(state_dict, "items") else state_dict), int(version))

    def stage_stream(self, items: Iterable[Any], version: int) -> None:
        """Stage ``(name, tensor)`` pairs as they come (see ``SenderAgent.stage_stream``; blocking)."""
        self._agent.stage_stream(items, int(version))

    async def push(self, client: Any, state_dict: Any, version: int | None = None) -> dict[str, Any]:
        """Stage ``state_dict`` as ``version`` (default: the next one) and publish it."""
        version = self.version + 1 if version is None else int(version)
        await asyncio.to_thread(self.stage, state_dict, version)
        return await self.publish(client, version)

    async def publish(self, client: Any, version: int) -> dict[str, Any]:
        """Make ``version`` (staged on every node's sender) the manager's current one."""
        if (await client.health()).get("run_id") != self.run_id:  # the manager restarted: it forgot us
            log.warning("rollout manager restarted; reporting the weight senders again")
            await self.report(client)
        answer = await client.update_weight_version(version, wait_for=self.wait_for, timeout_s=self.timeout_s,
                                                    wait_until=self.wait_until)
        self.version = version
        if answer.get("timed_out"):
            log.warning("weight version %d: only %s instance(s) had it after %.0fs", version,
                        answer.get("instances_at_version"), self.timeout_s)
        return answer

    def stop(self) -> None:
        if self.sender is not None:
            self.sender.stop()
            self.sender = None


_PUSHER: tuple[WeightPusher | None, Any] | None = None


async def push_to_rollout_manager(weights: Iterable[Any], global_steps: int | None,
                                  context: WeightPushContext) -> dict[str, Any]:
    """Default hook: every node's lowest rank stages the full weights into its node's sender, one
    tensor at a time as they are gathered; rank zero publishes them as weight version ``global_steps``
    once all nodes have staged.

    Every rank drains the iterator (FSDP gathers are collective, and every rank gets full tensors).
    The first call gathers each node's sender IPs to rank zero, which reports them all with
    ``PUT /update_weight_senders`` (the manager deals instances over the nodes' groups). A barrier
    after staging keeps rank zero from publishing a version some node does not have yet; rank zero
    then waits as ``custom.rollout_manager.weight_push_wait`` says, and a second barrier holds the
    other nodes (and their senders' buffers) until it is done.

    Nothing is staged or pushed for ``global_steps`` None (unchanged weights) or 0 (a fresh run's
    start: the model path every instance loaded, version 0). For 0, rank zero checks that the manager
    is at version 0 too: instances that serve a later version hold another run's weights.
    """
    if global_steps is None or int(global_steps) == 0:
        for _ in weights:
            pass
        if global_steps is not None and context.rank == 0:
            await _check_model_path_version(context.manager_url)
        return {"pushed": False}
    comm = context.comm or TorchDistComm()
    pusher, client = await _pusher(context, comm)
    leader = pusher is not None and pusher.sender is not None  # the lowest rank of each node
    if leader:
        assert pusher is not None
        # Each tensor goes into the sender's buffer as the iterator yields it (in this thread: the
        # iterator's gathers are collectives bound to this thread's device), never a whole second copy.
        pusher.stage_stream(weights, int(global_steps))
    else:
        for _ in weights:
            pass
    comm.barrier()  # every node has staged: the version may be published
    if context.rank != 0:
        comm.barrier()  # and no node restages (or exits) while the instances may still pull from it
        return {"pushed": False, "staged": leader}
    assert pusher is not None  # rank zero holds every node's senders
    try:
        from .settings import from_rollout_config

        client = await _current_relay(pusher, client, from_rollout_config(context.rollout_config))
        answer = await pusher.publish(client, int(global_steps))
    finally:
        comm.barrier()
    return {"pushed": True, "senders": len(pusher.all_node_ips), **answer}


async def _check_model_path_version(manager_url: str) -> None:
    """A fresh run starts on the model path (version 0): refuse a manager whose instances serve a later one."""
    from .client import ManagerClient

    async with ManagerClient(manager_url) as client:
        current = int((await client.health()).get("weight_version") or 0)
    if current > 0:
        raise RuntimeError(
            f"weight version 0 (a fresh run starts from the model path) is below the rollout manager's current "
            f"version {current} at {manager_url}: its instances serve weights of an earlier run; restart the "
            f"manager and its instances, or resume this run from step {current} or later")


async def _current_relay(pusher: WeightPusher, client: Any, settings: PluginSettings) -> Any:
    """With the manager as Ray actors (``ray_relays``), a client of a relay that answers now: the relay rank zero
    found first may have been lost, or started again by Ray at another address, since. Otherwise ``client``."""
    global _PUSHER
    if not settings.manager.ray_relays:
        return client
    from . import manager_address
    from .client import ManagerClient

    url = (await asyncio.to_thread(manager_address.resolve, settings)).rstrip("/")
    if url == client.base_url:
        return client
    log.info("weight pushes go to the manager's relay at %s (%s is gone or moved)", url, client.base_url)
    fresh = ManagerClient(url)
    pusher.manager_url = url
    if _PUSHER is not None and _PUSHER[0] is pusher:  # the process's pusher: its next pushes start there
        _PUSHER = (pusher, fresh)
    await client.close()
    return fresh


async def _pusher(context: WeightPushContext, comm: NodeComm) -> tuple[WeightPusher | None, Any]:
    """Set up once per process (collective on the first call): the ranks learn which of them share a
    node, each node's lowest rank starts its sender, rank zero learns every node's IPs and reports them."""
    global _PUSHER
    if _PUSHER is None:
        from .client import ManagerClient
        from .node_layout import gather_layout
        from .settings import from_rollout_config

        leader = gather_layout(comm, context.rank, context.node_id).is_leader
        settings = from_rollout_config(context.rollout_config).manager
        client = ManagerClient(context.manager_url)
        pusher = None
        ips: list[str] | None = None
        error = None
        if leader or context.rank == 0:
            try:
                senders = (await client.get_instances_status())["weight_senders"]
                raw_wait = settings.weight_push_wait
                wait: int | str | None = (None if raw_wait == "none" else
                                          int(raw_wait) if str(raw_wait).isdigit() else raw_wait)
                ips = (resolve_sender_ips(settings.sender_ips, context.manager_url, context.node_ip)
                       if leader else None)
                pusher = WeightPusher(context.manager_url, ips or [], senders["weight_sender_base_port"],
                                      protocol=senders["mooncake_transfer_protocol"],
                                      device_name=senders["mooncake_transfer_device_name"],
                                      wait_for=wait, timeout_s=settings.weight_push_timeout_s,
                                      wait_until=settings.weight_push_wait_until)
                if leader:
                    pusher.start_sender()
            except Exception as exc:
                error = f"rank {context.rank}: {exc}"
        gathered = comm.all_gather({"ips": ips, "error": error})
        errors = [g["error"] for g in gathered if g["error"]]
        if errors:
            if pusher is not None:
                pusher.stop()
            await client.close()
            raise RuntimeError("weight push set-up failed: " + "; ".join(errors))
        if context.rank == 0:
            assert pusher is not None
            await pusher.report(client, [g["ips"] for g in gathered if g["ips"]])
            log.info("weight senders on %d node(s): %s", len(pusher.all_node_ips), pusher.all_node_ips)
        _PUSHER = (pusher, client)
    return _PUSHER
