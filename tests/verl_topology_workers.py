"""verl 0.9.1's process layout, reduced to what a weight sync touches, for tests/test_verl_topology.py.

:class:`PushWorker` is a subclass of verl's own ``Worker`` (``single_controller/base/worker.py``), run
by verl's ``RayWorkerGroup`` in Ray actors on fake GPUs, so it gets verl's environment: ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``/``PORT`` from the group, and ``LOCAL_RANK=0`` on every rank. Its
``init_model`` builds the rollout class verl resolves for ``rollout.name`` (the plugin's adapter), as
``engine_workers.py`` does; each rank holds an FSDP-like shard of every tensor (a slice of the flat,
padded tensor), and ``update_weights`` is ``engine_workers.py``'s naive path: a generator that
all-gathers each tensor (what ``DTensor.full_tensor()`` does) handed to
``rollout.update_weights(..., peft_config=..., base_sync_done=True, global_steps=...)``.

:class:`TaskRunner` stands where verl's ``TaskRunnerV1`` runs the trainer: it builds the plugin's
``DisaggregatedReplica`` and launches its servers (the manager), as ``LLMServerManager.create`` does.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import ray
import torch
import torch.distributed as dist
from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.base.worker import Worker

from rollout_manager.cpu_engine.model import build_model


def rollout_config(rollout: dict[str, Any]) -> Any:
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import RolloutConfig

    return omega_conf_to_dataclass(OmegaConf.create(rollout), RolloutConfig)


def model_config(lora: dict[str, Any] | None) -> Any:
    """What the adapter reads of verl's ``HFModelConfig``: the two LoRA blocks."""
    lora = dict(lora or {})
    return SimpleNamespace(lora_rank=int(lora.pop("rank", 0)), lora=lora)


class PushWorker(Worker):
    def __init__(self, rollout: dict[str, Any], lora: dict[str, Any] | None = None):
        super().__init__()
        self.rollout_dict = rollout
        self.lora = lora
        self.shards: dict[str, tuple[torch.Size, int, torch.Tensor]] = {}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict[str, Any]:
        from verl.utils.distributed import initialize_global_process_group_ray
        from verl.workers.rollout.base import get_rollout_class

        import trainer_plugin.verl_registration  # noqa: F401  (what `import verl` loads through the entry point)

        initialize_global_process_group_ray(backend="gloo")
        config = rollout_config(self.rollout_dict)
        cls = get_rollout_class(config.name, config.mode)
        self.rollout = cls(config=config, model_config=model_config(self.lora), device_mesh=None)
        return {"rank": self.rank, "local_rank": os.environ.get("LOCAL_RANK"),
                "node_ip": ray.util.get_node_ip_address()}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load(self, seed: int) -> None:
        """This rank's shard of ``build_model(seed)``: a slice of each flat tensor, padded to the world."""
        world, rank = dist.get_world_size(), dist.get_rank()
        self.shards = {}
        for name, tensor in build_model(seed).state_dict().items():
            flat = tensor.detach().flatten()
            size = -(-flat.numel() // world)
            padded = torch.zeros(size * world, dtype=flat.dtype)
            padded[:flat.numel()] = flat
            self.shards[name] = (tensor.shape, flat.numel(), padded[rank * size:(rank + 1) * size].clone())

    def _full_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """One tensor at a time, each an all-gather across the ranks (a collective every rank must run)."""
        for name, (shape, numel, shard) in self.shards.items():
            parts = [torch.empty_like(shard) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, shard)
            yield name, torch.cat(parts)[:numel].reshape(shape)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int | None = None, peft_config: dict[str, Any] | None = None) -> Any:
        result = await self.rollout.update_weights(self._full_tensors(), peft_config=peft_config, base_sync_done=True,
                                                   global_steps=global_steps)
        url = getattr(self.rollout, "_manager_url", None) or self.rollout.settings.manager_url
        return {"rank": self.rank, "manager_url": url, **(result or {})}


@ray.remote(num_cpus=0)
class TaskRunner:
    """Where verl's trainer runs: the replica launch starts the manager on this node and publishes its URL."""

    async def launch(self, rollout: dict[str, Any]) -> dict[str, Any]:
        from verl.workers.rollout.replica import get_rollout_replica_class

        import trainer_plugin.verl_registration  # noqa: F401

        replica = get_rollout_replica_class(rollout["name"])(replica_rank=0, config=rollout_config(rollout),
                                                             model_config=None, gpus_per_node=1)
        await replica.launch_servers()
        self.replica = replica
        return {"node_ip": ray.util.get_node_ip_address(), "server_address": replica._server_address,
                "manager_pid": replica.manager.pid if replica.manager else None}

    def stop(self) -> None:
        if self.replica.manager is not None:
            self.replica.manager.stop()
