"""verl 0.9.1's process layout, reduced to what a weight sync touches, for tests/test_verl_topology.py.

:class:`PushWorker` is a subclass of verl's own ``Worker`` (``single_controller/base/worker.py``), run
by verl's ``RayWorkerGroup`` in Ray actors on fake GPUs, so it gets verl's environment: ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``/``PORT`` from the group, and ``LOCAL_RANK=0`` on every rank. Its
``init_model`` builds the rollout class verl resolves for ``rollout.name`` (the plugin's adapter), as
``engine_workers.py`` does; each rank holds an FSDP-like shard of every tensor (a slice of the flat,
padded tensor), and ``update_weights`` is ``engine_workers.py``'s naive path: a generator that
all-gathers each tensor (what ``DTensor.full_tensor()`` does) handed to
``rollout.update_weights(..., peft_config=..., base_sync_done=True, global_steps=...)``; ``sync_lora``
is its path for an unmerged LoRA adapter (base once, then the adapter).

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
        self.adapter_shards: dict[str, tuple[torch.Size, int, torch.Tensor]] = {}

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
        self.shards = _shard(build_model(seed).state_dict())

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_lora(self, base_seed: int, adapter_seed: int) -> None:
        """This rank's shards of the frozen base ``build_model(base_seed)`` and of the adapter a step left."""
        self.shards = _shard(build_model(base_seed).state_dict())
        self.adapter_shards = _shard(lora_adapter(adapter_seed))

    def _full_tensors(self, shards: dict[str, Any] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """One tensor at a time, each an all-gather across the ranks (a collective every rank must run)."""
        for name, (shape, numel, shard) in (self.shards if shards is None else shards).items():
            parts = [torch.empty_like(shard) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, shard)
            yield name, torch.cat(parts)[:numel].reshape(shape)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int | None = None, peft_config: dict[str, Any] | None = None) -> Any:
        result = await self.rollout.update_weights(self._full_tensors(), peft_config=peft_config, base_sync_done=True,
                                                   global_steps=global_steps)
        url = getattr(self.rollout, "_manager_url", None) or self.rollout.settings.manager_url
        return {"rank": self.rank, "manager_url": url, **(result or {})}


    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def sync_lora(self, global_steps: int, base_sync: bool) -> dict[str, Any]:
        """``engine_workers.py``'s sync with ``lora.merge`` False: on the first sync (``load_format`` dummy)
        the base under verl's base-sync names (``replace_lora_wrapper``), ``base_sync_done=False``; then the
        adapter under PEFT's names, ``base_sync_done=True``, both as ``global_steps``; ``peft_config`` as
        verl passes it (``LoraConfig.to_dict()``)."""
        from verl.utils.fsdp_utils import replace_lora_wrapper

        config = lora_config()
        out: dict[str, Any] = {"rank": self.rank}
        if base_sync:
            base = ((replace_lora_wrapper(n, config), t) for n, t in self._full_tensors())
            out["base"] = await self.rollout.update_weights(base, peft_config=config.to_dict(), base_sync_done=False,
                                                            global_steps=global_steps)
        result = await self.rollout.update_weights(self._full_tensors(self.adapter_shards),
                                                   peft_config=config.to_dict(), base_sync_done=True,
                                                   global_steps=global_steps)
        kept = sum(t.nbytes for t in self.rollout._lora.base.values())  # the base copy this rank holds
        return {**out, **(result or {}), "lora_base_bytes": kept}


LORA_R, LORA_ALPHA, LORA_TARGETS = 4, 8, ("q_proj", "v_proj")


def lora_config() -> Any:
    from peft import LoraConfig

    return LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, target_modules=list(LORA_TARGETS))


def lora_adapter(seed: int) -> dict[str, torch.Tensor]:
    """An adapter as PEFT's ``get_peft_model_state_dict`` names it, for ``build_model``'s q/v projections."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in build_model(0).state_dict().items():
        module = name.removesuffix(".weight")
        if module.rsplit(".", 1)[-1] in LORA_TARGETS:
            out[f"base_model.model.{module}.lora_A.weight"] = torch.randn(LORA_R, tensor.shape[1], generator=g)
            out[f"base_model.model.{module}.lora_B.weight"] = torch.randn(tensor.shape[0], LORA_R, generator=g)
    return out


def merged_reference(base_seed: int, adapter_seed: int) -> dict[str, torch.Tensor]:
    """``W + lora_alpha / r * B @ A`` (float32, the base's dtype) for every targeted tensor."""
    weights = build_model(base_seed).state_dict()
    adapter = lora_adapter(adapter_seed)
    for name, w in weights.items():
        a = adapter.get(f"base_model.model.{name.removesuffix('.weight')}.lora_A.weight")
        if a is not None:
            b = adapter[f"base_model.model.{name.removesuffix('.weight')}.lora_B.weight"]
            weights[name] = w + LORA_ALPHA / LORA_R * (b @ a)
    return weights


def _shard(state: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Size, int, torch.Tensor]]:
    """This rank's FSDP-like shard of each tensor: a slice of the flat tensor, padded to the world."""
    world, rank = dist.get_world_size(), dist.get_rank()
    shards = {}
    for name, tensor in state.items():
        flat = tensor.detach().flatten()
        size = -(-flat.numel() // world)
        padded = torch.zeros(size * world, dtype=flat.dtype)
        padded[:flat.numel()] = flat
        shards[name] = (tensor.shape, flat.numel(), padded[rank * size:(rank + 1) * size].clone())
    return shards


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


def trained_state(model_dir: str, step: int) -> dict[str, torch.Tensor]:
    """The trainer's model after ``step`` steps: a float32 ``transformers`` ``LlamaForCausalLM`` built from the
    checkpoint's config and loaded with its weights (so names and shapes are SGLang's), then moved by one
    seeded random step per training step (large enough to change greedy tokens)."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig.from_pretrained(model_dir)).to(torch.float32)
    model.load_state_dict(load_file(os.path.join(model_dir, "model.safetensors")))
    state = {name: t.detach().clone() for name, t in model.state_dict().items()}
    for s in range(1, step + 1):
        gen = torch.Generator().manual_seed(s)
        state = {name: (state[name] + torch.randn(state[name].shape, generator=gen) * 0.05).contiguous()
                 for name in sorted(state)}
    return state


class HFPushWorker(PushWorker):
    """:class:`PushWorker` whose shards are of the ``transformers`` model of :func:`trained_state`."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_hf(self, model_dir: str, step: int) -> None:
        self.shards = _shard(trained_state(model_dir, step))
