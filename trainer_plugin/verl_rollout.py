"""verl 0.9.1 classes behind ``actor_rollout_ref.rollout.name=sglang-disaggregated``.

A rollout backend in verl 0.9.1 is two registrations under one name (see
:mod:`trainer_plugin.verl_registration`):

- :class:`DisaggregatedReplica` (``RolloutReplicaRegistry``): what the trainer's driver side
  (``LLMServerManager``) launches. Its ``launch_servers`` starts the rollout manager on this node
  (or attaches to one already there), and sets the server handle/address verl routes generation to:
  one shared :class:`~trainer_plugin.proxy.ManagerProxyServer` Ray actor (CPU only, no GPU pool
  sliced for it). All replicas share it and its address, so verl's load balancer sees one server:
  the manager, which does the real balancing over the remote instances.
- :class:`ManagerServerAdapter` (``_ROLLOUT_REGISTRY[(name, "async")]``): what each training rank
  builds. ``resume``/``release`` are no-ops (no colocated engine); ``update_weights`` hands the
  weights to the weight-push hook (:mod:`trainer_plugin.weight_push`) with this rank's node (from
  Ray, see :mod:`trainer_plugin.node_layout`) and the manager URL the replica published
  (:mod:`trainer_plugin.manager_address`).

Routing replay (``rollout.enable_rollout_routing_replay``): the proxy asks the manager for every sample's
routed experts and hands them to verl as its SGLang server does; a fleet that cannot return them fails
the start (:mod:`trainer_plugin.routed_experts`).

LoRA: merged (``actor_rollout_ref.model.lora.merge=True``): verl hands over full HF-named weights once
per step, pushed like any step. Unmerged (verl's default): verl calls ``update_weights`` with the base
weights once (``base_sync_done=False``) and then with the adapter every step, the first time under the
same ``global_steps``; the adapter keeps the base and pushes base + merged adapter as ONE payload per
version (:mod:`trainer_plugin.lora_merge`). Only each node's lowest rank keeps the base and merges:
verl hands every rank the full tensors, but only that rank stages them into the node's sender; the
others drain verl's iterators, check the adapter against the base's names and shapes (so every rank
refuses alike) and hand the push hook no tensors: a node holds one base copy. All this needs the base
sync, which verl does only with a ``dummy`` ``rollout.load_format``: anything else is refused at
start-up (:func:`refuse_lora_without_base_sync`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Generator, Iterable
from typing import Any

import ray
import torch
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica

from rollout_manager.osutil import format_endpoint

from . import manager_address, relay_actors
from .launcher import ManagerProcess
from .lora_merge import LoraMerge, LoraSpec
from .node_layout import gather_layout, this_node_id, this_node_ip
from .proxy import ManagerProxyServer
from .routed_experts import ExpertsLayout
from .settings import ROLLOUT_NAME, PluginSettings, from_rollout_config
from .weight_push import TorchDistComm, WeightPush, WeightPushContext, call_weight_push, load_weight_push

log = logging.getLogger("trainer_plugin.verl")

PROXY_ACTOR_NAME = "rollout_manager_proxy"
_MANAGERS: dict[tuple[str, int], ManagerProcess] = {}
_MANAGERS_LOCK = threading.Lock()


def ensure_manager(settings: PluginSettings) -> ManagerProcess | None:
    """Start (or attach to) the manager once per process; None when ``launch`` is off."""
    m = settings.manager
    if not m.launch:
        return None
    host = manager_address.bind_host(settings)
    key = (host, m.port)
    with _MANAGERS_LOCK:
        proc = _MANAGERS.get(key)
        if proc is not None and (proc.attached or proc.running()):
            return proc
        extra: list[str] = []
        for item in m.overrides:
            extra += ["--set", item]
        proc = ManagerProcess(host, m.port, m.config_path, extra_args=extra, log_path=m.log_path,
                              startup_timeout_s=m.startup_timeout_s, attach_existing=m.attach_existing)
        proc.start()
        _MANAGERS[key] = proc
        return proc


LORA_MERGE_KEY = "actor_rollout_ref.model.lora.merge"
LOAD_FORMAT_KEY = "actor_rollout_ref.rollout.load_format"


def unmerged_lora_rank(model_config: Any) -> int:
    """The LoRA rank when verl syncs the adapter unmerged (``lora.merge`` not true), else 0."""
    if model_config is None:
        return 0
    lora = getattr(model_config, "lora", None) or {}
    rank = max(int(getattr(model_config, "lora_rank", 0) or 0), int(lora.get("rank", 0) or 0))
    return 0 if lora.get("merge", False) else rank


def refuse_lora_without_base_sync(model_config: Any, rollout_config: Any) -> None:
    """Fail at start-up on unmerged LoRA that verl will never send the base weights for.

    verl syncs the base once only when ``rollout.load_format`` contains ``dummy`` (``engine_workers.py``:
    ``base_sync_done = "dummy" not in load_format``); otherwise every sync is adapter-only and there is
    no base to merge it onto (the remote instances' own load is out of the trainer's reach)."""
    rank = unmerged_lora_rank(model_config)
    load_format = str(getattr(rollout_config, "load_format", "dummy"))
    if rank > 0 and "dummy" not in load_format:
        raise NotImplementedError(
            f"rollout.name={ROLLOUT_NAME} with unmerged LoRA (rank {rank}) merges the adapter into the base "
            f"weights verl syncs once, which it does only with {LOAD_FORMAT_KEY}=dummy (got {load_format!r}); "
            f"set {LOAD_FORMAT_KEY}=dummy, or {LORA_MERGE_KEY}=true")


class DisaggregatedReplica(RolloutReplica):
    """A replica whose "server" is a proxy for the rollout manager."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        refuse_lora_without_base_sync(self.model_config, self.config)
        self.settings: PluginSettings = from_rollout_config(self.config)
        self.manager: ManagerProcess | None = None
        # verl's routing replay (R3): the experts' layout, read from the model as verl's SGLang server does
        self.routed_experts = (ExpertsLayout.of_model(_with_hf_config(self.model_config))
                               if getattr(self.config, "enable_rollout_routing_replay", False) else None)

    def rollout_worker_use_gpu(self) -> bool:
        return False

    async def init_standalone(self) -> None:
        # verl's standalone route (separate_async with hybrid_engine=false) reserves
        # rollout.nnodes x n_gpus_per_node local GPUs for rollout workers and syncs weights to them
        # over a checkpoint engine; here the rollout GPUs are the remote boxes, reached by the weight
        # push hook, so that route would only strand GPUs. Say so instead of hanging on a reservation.
        raise NotImplementedError(
            "rollout.name=sglang-disaggregated runs with the trainer's workers (hybrid engine): use "
            "trainer.v1.trainer_mode=rollout_manager_sync (or sync / colocate_async) with "
            "actor_rollout_ref.hybrid_engine=true; a standalone rollout pool (separate_async) would "
            "reserve local GPUs that the remote rollout boxes replace")

    async def launch_servers(self) -> None:
        # The blocking start-up (probe, spawn, wait for /health) runs off the event loop; the launcher
        # forks from its own long-lived thread so PR_SET_PDEATHSIG stays tied to this process.
        ray_relays = self.settings.manager.ray_relays > 0
        if ray_relays:  # the manager as Ray actors: relay 0's URL for the calls that are not batches
            url = (await asyncio.to_thread(relay_actors.ensure, self.settings))[0]
        else:
            self.manager = await asyncio.to_thread(ensure_manager, self.settings)
            url = manager_address.launch_url(self.settings)
        # published once, here (verl runs this in its TaskRunner, wherever Ray placed it): the training
        # ranks on every node read it instead of guessing it from their own node
        url = await asyncio.to_thread(manager_address.publish, url)
        proxy = ray.remote(ManagerProxyServer).options(
            name=PROXY_ACTOR_NAME, get_if_exists=True, num_cpus=0, max_concurrency=self.max_concurrency,
        ).remote(url, prompt_length=self.config.prompt_length, response_length=self.config.response_length,
                 max_model_len=self.config.max_model_len, timeout_s=self.settings.manager.request_timeout_s,
                 batch_window_s=self.settings.manager.batch_window_ms / 1000.0,
                 max_batch=self.settings.manager.batch_max_requests,
                 client_options=self.settings.manager.client_options(),
                 max_staleness=self.settings.manager.max_staleness, routed_experts=self.routed_experts,
                 ray_relays=ray_relays)
        health = await proxy.health.remote()  # fails fast if the workers cannot reach the manager
        if self.routed_experts is not None:  # fails fast on a fleet that cannot return routed experts
            await proxy.check_routed_experts.remote()
        log.info("replica %d -> rollout manager %s (%s)", self.replica_rank, url, health)
        self.servers = [proxy]
        self._server_handle = proxy
        host, port = await proxy.get_server_address.remote()
        self._server_address = format_endpoint(host, port)


class ManagerServerAdapter(BaseRollout):
    """Training-rank side: no engine to wake or put to sleep; weights go to the push hook."""

    def __init__(self, config: Any, model_config: Any, device_mesh: Any, replica_rank: int = -1, **kwargs: Any):
        super().__init__(config, model_config, device_mesh)
        refuse_lora_without_base_sync(model_config, self.config)  # every rank's init_model, before any step
        self.settings = from_rollout_config(self.config)
        self._lora = LoraMerge()
        self.replica_rank = replica_rank
        self._push: WeightPush | None = None
        self._manager_url: str | None = None
        self._last_steps: int | None = None

    async def resume(self, tags: list[str]) -> None:
        return None

    async def release(self) -> None:
        return None

    async def update_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None],
                             global_steps: int | None = None, wire_format: str = "named_tensors",
                             **kwargs: Any) -> Any:
        peft_config = kwargs.pop("peft_config", None)
        base_sync_done = bool(kwargs.pop("base_sync_done", True))
        self._refuse_published(global_steps)
        payload: Iterable[tuple[str, torch.Tensor]] = weights
        rank, world = _rank_and_world()
        if peft_config is not None and not base_sync_done:
            # verl's base sync (unmerged LoRA): kept where the merge happens, and published only merged with
            # the adapter that follows under the same global_steps, so one version never carries two payloads
            keep = gather_layout(TorchDistComm(), rank).is_leader  # collective: every rank syncs the base
            count = self._lora.keep_base(weights, keep=keep)
            return {"pushed": False, "lora_base_tensors": count, "lora_base_bytes": self._lora.base_bytes}
        if peft_config is not None:
            if not self._lora.synced:
                raise RuntimeError(f"LoRA adapter for global_steps={global_steps} arrived before any base weights: "
                                   f"verl syncs the base only with {LOAD_FORMAT_KEY}=dummy")
            # checked alike on every rank; merged only where the base was kept (the node's sender rank)
            payload = self._lora.merged(weights, LoraSpec.from_peft_config(peft_config))
        if self._push is None:
            self._push = load_weight_push(self.settings.manager.weight_push)
        if self._manager_url is None:
            self._manager_url = await asyncio.to_thread(manager_address.resolve, self.settings)
        context = WeightPushContext(rank=rank, world_size=world, manager_url=self._manager_url,
                                    rollout_config=self.config, wire_format=wire_format, kwargs=kwargs,
                                    node_id=this_node_id(), node_ip=this_node_ip())
        result = await call_weight_push(self._push, payload, global_steps, context)
        if global_steps is not None:
            self._last_steps = int(global_steps)
        return result

    def _refuse_published(self, global_steps: int | None) -> None:
        """One version, one payload: weights for a ``global_steps`` this rank already pushed are refused."""
        if global_steps is not None and self._last_steps is not None and int(global_steps) == self._last_steps:
            raise RuntimeError(f"update_weights called twice with global_steps={global_steps}: a second payload "
                               "may not be published under a version the instances already have")


def _with_hf_config(model_config: Any) -> Any:
    """verl hands replicas the model config as a DictConfig; its servers build ``HFModelConfig`` (which
    loads the model's ``config.json`` as ``hf_config``) from it, as here."""
    if model_config is None or hasattr(model_config, "hf_config"):
        return model_config
    from verl.workers.config import HFModelConfig

    return omega_conf_to_dataclass(model_config, dataclass_type=HFModelConfig)


def _rank_and_world() -> tuple[int, int]:
    if torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def rollout_config_of(config: Any) -> Any:
    """``RolloutConfig`` from a DictConfig/dict (helper for tests and tools)."""
    from verl.workers.config import RolloutConfig

    return omega_conf_to_dataclass(config, RolloutConfig)
