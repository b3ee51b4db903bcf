"""verl 0.9.1's process layout, reduced to what a weight sync touches, for tests/test_verl_topology.py.

:class:`PushWorker` is a subclass of verl's own ``Worker`` (``single_controller/base/worker.py``), run
by verl's ``RayWorkerGroup`` in Ray actors on fake GPUs, so it gets verl's environment: ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``/``PORT`` from the group, and ``LOCAL_RANK=0`` on every rank. Its
``init_model`` builds what ``engine_workers.py``'s ``ActorRolloutRefWorker.init_model`` builds for a
weight sync: the rollout class verl resolves for ``rollout.name`` (the plugin's adapter), the
checkpoint engine of ``rollout.checkpoint_engine`` and the LoRA flags; its ``update_weights`` runs
``ActorRolloutRefWorker.update_weights`` itself (the checkpoint engine's backend picks the branch; in
``naive``: ``rollout.resume(["weights"])``, the base sync of an unmerged adapter once, the weights,
``rollout.resume(["kv_cache"])``). The training engine it reads is :class:`ShardedEngine`: each rank
holds an FSDP-like shard of every tensor (a slice of the flat, padded tensor), all-gathered tensor by
tensor as verl's generator is consumed (what ``DTensor.full_tensor()`` does).

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
from verl.plugin.platform.platform_cuda import PlatformCUDA
from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.base.worker import Worker

from rollout_manager.cpu_engine.model import build_model

Shards = dict[str, tuple[torch.Size, int, torch.Tensor]]


def rollout_config(rollout: dict[str, Any]) -> Any:
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import RolloutConfig

    return omega_conf_to_dataclass(OmegaConf.create(rollout), RolloutConfig)


def model_config(lora: dict[str, Any] | None) -> Any:
    """What the adapter and verl's ``init_model`` read of verl's ``HFModelConfig``: the two LoRA blocks."""
    lora = dict(lora or {})
    return SimpleNamespace(lora_rank=int(lora.pop("rank", 0)), lora=lora)


# What verl's weight sync asks of the device module, on a CPU: no cache to empty, nothing to wait for.
_CPU_DEVICE = SimpleNamespace(synchronize=lambda *_: None, empty_cache=lambda: None, memory_allocated=lambda: 0,
                              memory_reserved=lambda: 0, mem_get_info=lambda: (0, 0))


class CPUPlatform(PlatformCUDA):
    """verl's CUDA platform with the device calls of ``update_weights`` answered on CPU: the ranks hold
    Ray's fake GPUs, and this torch has no CUDA (``torch.cuda.synchronize`` would raise)."""

    @property
    def device_module(self) -> Any:
        return _CPU_DEVICE

    def synchronize(self, device_index: int | None = None) -> None:
        pass

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass


class ShardedEngine:
    """verl's training engine as its weight sync reads it (``fsdp/transformer_impl.py``'s
    ``get_per_tensor_param``): the full tensors, gathered as the generator is consumed, and
    ``peft_config`` None; with an unmerged LoRA adapter, the adapter under PEFT's names, or for the base
    sync (``base_sync_done=False``) the base under verl's base-sync names (``replace_lora_wrapper``),
    with the adapter's ``LoraConfig`` as ``peft_config``."""

    is_param_offload_enabled = False

    def __init__(self) -> None:
        self.shards: Shards = {}
        self.adapter_shards: Shards = {}

    def get_per_tensor_param(self, layered_summon: bool = False, base_sync_done: bool = False,
                             **_: Any) -> tuple[Iterator[tuple[str, torch.Tensor]], Any]:
        if not self.adapter_shards:
            return _full_tensors(self.shards), None
        config = lora_config()
        if base_sync_done:
            return _full_tensors(self.adapter_shards), config
        from verl.utils.fsdp_utils import replace_lora_wrapper

        return ((replace_lora_wrapper(n, config), t) for n, t in _full_tensors(self.shards)), config

    def to(self, *_: Any, **__: Any) -> None:
        pass


class PushWorker(Worker):
    def __init__(self, rollout: dict[str, Any], lora: dict[str, Any] | None = None):
        super().__init__()
        self.rollout_dict = rollout
        self.lora = lora
        self.actor = SimpleNamespace(engine=ShardedEngine())
        self.answers: list[dict[str, Any]] = []  # what the adapter answered to each update_weights
        self.resumed: list[list[str]] = []  # the tags of each rollout.resume

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict[str, Any]:
        from verl.checkpoint_engine import CheckpointEngineRegistry
        from verl.plugin.platform.platform_manager import set_platform
        from verl.utils.distributed import initialize_global_process_group_ray
        from verl.workers.rollout.base import get_rollout_class

        import trainer_plugin.verl_registration  # noqa: F401  (what `import verl` loads through the entry point)

        set_platform(CPUPlatform())
        initialize_global_process_group_ray(backend="gloo")
        config = rollout_config(self.rollout_dict)
        self.config = SimpleNamespace(rollout=config)  # verl's worker reads its rollout block only here
        cls = get_rollout_class(config.name, config.mode)
        self.rollout = cls(config=config, model_config=model_config(self.lora), device_mesh=None)
        self._record(self.rollout)
        # as ActorRolloutRefWorker.init_model sets them
        self.base_sync_done = "dummy" not in config.load_format
        self.layered_summon = config.get("layered_summon", False)
        self.peft_merge = model_config(self.lora).lora.get("merge", False)
        engine = config.checkpoint_engine
        self.checkpoint_engine = CheckpointEngineRegistry.new(
            engine.backend, is_master=dist.get_rank() == 0, bucket_size=engine.update_weights_bucket_megabytes << 20,
            **engine.engine_kwargs.get(engine.backend, {}))
        return {"rank": self.rank, "local_rank": os.environ.get("LOCAL_RANK"),
                "node_ip": ray.util.get_node_ip_address()}

    def _record(self, rollout: Any) -> None:
        """Keep what verl's path hands the adapter and gets back: verl's own method returns nothing."""
        push, resume = rollout.update_weights, rollout.resume

        async def update_weights(weights: Any, **kwargs: Any) -> Any:
            answer = await push(weights, **kwargs)
            self.answers.append(dict(answer or {}))
            return answer

        async def resumed(tags: list[str]) -> None:
            self.resumed.append(list(tags))
            await resume(tags)

        rollout.update_weights, rollout.resume = update_weights, resumed

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load(self, seed: int) -> None:
        """This rank's shard of ``build_model(seed)``: a slice of each flat tensor, padded to the world."""
        self.actor.engine.shards = _shard(build_model(seed).state_dict())

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_lora(self, base_seed: int, adapter_seed: int) -> None:
        """This rank's shards of the frozen base ``build_model(base_seed)`` and of the adapter a step left."""
        self.actor.engine.shards = _shard(build_model(base_seed).state_dict())
        self.actor.engine.adapter_shards = _shard(lora_adapter(adapter_seed))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int | None = None) -> dict[str, Any]:
        """verl's ``ActorRolloutRefWorker.update_weights`` on this rank. Returns the adapter's answer to the
        last push (to the base sync before it under ``base``), the resumed tags, and with LoRA the bytes of
        base weights this rank keeps to merge onto."""
        from verl.workers.engine_workers import ActorRolloutRefWorker

        self.answers, self.resumed = [], []
        await ActorRolloutRefWorker.update_weights(self, global_steps=global_steps)
        url = getattr(self.rollout, "_manager_url", None) or self.rollout.settings.manager_url
        out = {"rank": self.rank, "manager_url": url, "resumed": self.resumed, **self.answers[-1]}
        if len(self.answers) > 1:
            out["base"] = self.answers[0]
        if self.actor.engine.adapter_shards:
            out["lora_base_bytes"] = sum(t.nbytes for t in self.rollout._lora.base.values())
        return out


def _full_tensors(shards: Shards) -> Iterator[tuple[str, torch.Tensor]]:
    """One tensor at a time, each an all-gather across the ranks (a collective every rank must run)."""
    for name, (shape, numel, shard) in shards.items():
        parts = [torch.empty_like(shard) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, shard)
        yield name, torch.cat(parts)[:numel].reshape(shape)


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


def _shard(state: dict[str, torch.Tensor]) -> Shards:
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
        self.actor.engine.shards = _shard(trained_state(model_dir, step))
