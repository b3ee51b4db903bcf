"""verl 0.9.1's sync trainer start-up, as it really runs, with ``rollout.name=sglang-disaggregated``.

verl's V1 trainer (``trainer_base.py``) ends ``init()`` with ``_setup()`` -> ``checkpoint_manager.sleep_replicas()``,
``_load_checkpoint()`` (``global_steps = 0`` on a fresh run, ``N`` from ``.../global_step_N`` on a resume), then
``on_init_end()``, which ``PPOTrainerSync`` implements as ``checkpoint_manager.update_weights(self.global_steps)``.
``fit()`` then sets ``global_steps = 1`` and, per step, calls ``on_step_begin``, ``on_sample_begin``/``on_sample_end``
(replicas put to sleep) and ``on_step_end`` (``update_weights(global_steps)``). The naive checkpoint manager that
V1 forces hands that to every actor worker, whose ``update_weights`` gives the full tensors to the rollout class
verl resolves for the rollout name (the plugin's ``ManagerServerAdapter``) with ``global_steps``.

Run here: the plugin's trainer class (``PPOTrainerSyncWithManager``: verl's ``PPOTrainerSync`` hooks,
``_load_checkpoint`` and ``on_init_end`` unmodified), the adapter resolved through verl's ``get_rollout_class``,
the default weight-push hook, a real manager, and a box (CPU engine + receiver agent). Stand-ins, because
verl's own need Ray and a GPU (``update_weights`` on the worker synchronises CUDA): the actor worker group
(one rank holding a torch policy; its naive ``update_weights`` does what ``engine_workers.py`` does for a
rollout with no colocated engine: full tensors to ``rollout.update_weights(..., global_steps=...)``, run on one
event loop for the worker's lifetime as a Ray async actor's method is) and the naive checkpoint manager
(``ray.get(actor_wg.update_weights(global_steps=...))``; no replicas to put to sleep).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from support import Box, async_wait_until, free_port

from rollout_manager.cpu_engine.model import build_model, reference_generate

MISSING = [m for m in ("verl", "transfer_queue", "cachetools", "fastapi", "uvicorn")
           if importlib.util.find_spec(m) is None]
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(bool(MISSING), reason=f"verl 0.9.1's V1 trainers need {', '.join(MISSING)} "
                       "(scripts/install.sh installs them)"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

PROMPT = [5, 9, 2]


class ActorWorkers:
    """verl's actor worker group, one rank, reduced to what start-up and a step touch."""

    def __init__(self, rollout_config: Any, policy: torch.nn.Module, loop: asyncio.AbstractEventLoop):
        from verl.workers.rollout.base import get_rollout_class

        import trainer_plugin.verl_registration as registration

        registration.register()  # what `import verl` does through the plugin's entry point
        cls = get_rollout_class(rollout_config.name, rollout_config.mode)  # as engine_workers.py resolves it
        self.rollout = cls(config=rollout_config, model_config=None, device_mesh=None)
        self.policy = policy
        self.loop = loop  # the worker's event loop (a Ray async actor's): the push hook's client lives on it
        self.calls: list[tuple[int | None, int]] = []  # (global_steps, tensors the hook drained)

    def load_checkpoint(self, local_path: str, hdfs_path: str | None = None, del_local_after_load: bool = False):
        self.policy.load_state_dict(torch.load(os.path.join(local_path, "model.pt")))

    async def _update_weights(self, global_steps: int | None) -> Any:
        drained = 0

        def per_tensor_param():
            nonlocal drained
            for name, tensor in self.policy.state_dict().items():
                drained += 1
                yield name, tensor.detach()

        try:
            return await self.rollout.update_weights(per_tensor_param(), peft_config=None, base_sync_done=True,
                                                     global_steps=global_steps)
        finally:
            self.calls.append((global_steps, drained))

    def update_weights(self, global_steps: int | None = None, mode: str = "auto") -> Any:
        return asyncio.run_coroutine_threadsafe(self._update_weights(global_steps), self.loop).result(120)


class NaiveCheckpointManager:
    """verl's ``CheckpointEngineManager`` with the ``naive`` backend, without Ray."""

    def __init__(self, actor_wg: ActorWorkers):
        self.actor_wg = actor_wg

    def update_weights(self, global_steps: int | None = None) -> dict[str, Any]:
        self.actor_wg.update_weights(global_steps=global_steps, mode="naive")
        return {}

    def sleep_replicas(self) -> None:
        return None


def rollout_settings(manager_url: str) -> dict[str, Any]:
    return {"name": "sglang-disaggregated", "n": 2, "custom": {"rollout_manager": {
        "host": "127.0.0.1", "port": int(manager_url.rsplit(":", 1)[1]), "sender_ips": ["127.0.0.1"],
        "weight_push_timeout_s": 60}}}


def make_trainer(manager_url: str, policy: torch.nn.Module, resume_from: Path | None = None) -> Any:
    """The plugin's trainer mode with the state ``PPOTrainer.__init__``/``_setup`` leave behind (their
    Ray worker groups replaced by the stand-ins above)."""
    import verl.trainer.ppo.v1.trainer_sync  # noqa: F401  (verl loads its V1 trainers first, then the plugin's mode)
    from omegaconf import OmegaConf

    from trainer_plugin.verl_rollout import rollout_config_of
    from trainer_plugin.verl_trainer import PPOTrainerSyncWithManager

    t = object.__new__(PPOTrainerSyncWithManager)
    t.config = OmegaConf.create({
        "trainer": {"resume_mode": "resume_path" if resume_from else "disable",
                    "resume_from_path": str(resume_from) if resume_from else None,
                    "del_local_ckpt_after_load": False, "v1": {"trainer_mode": "sync"}},
        "data": {"train_batch_size": 2},
        "actor_rollout_ref": {"rollout": rollout_settings(manager_url)},
    })
    t.trainer_mode, t.use_critic = "sync", False
    t.actor_rollout_wg = ActorWorkers(rollout_config_of(t.config.actor_rollout_ref.rollout), policy,
                                      asyncio.get_running_loop())
    t.checkpoint_manager = NaiveCheckpointManager(t.actor_rollout_wg)
    t.timing_raw, t.curr_step_profile = {}, False
    return t


def init(t: Any) -> None:
    """The tail of ``PPOTrainer._setup`` and ``init``, in verl's order."""
    t.checkpoint_manager.sleep_replicas()
    t._load_checkpoint()
    t.on_init_end()


def step(t: Any, new_weights: dict[str, torch.Tensor]) -> None:
    """``fit``'s first step: the step counter, then the hooks around a step; the update lands before
    ``on_step_end`` syncs the weights."""
    t.global_steps += 1
    t.on_train_begin()
    t.on_step_begin()
    t.on_sample_begin()
    t.on_sample_end()
    t.actor_rollout_wg.policy.load_state_dict(new_weights)
    t.on_step_end()
    t._consume_sync_metrics()


async def forget_pusher() -> None:
    """A trainer process that ends takes its sender agent and manager client with it."""
    from trainer_plugin import weight_push

    if weight_push._PUSHER is not None:
        pusher, client = weight_push._PUSHER
        weight_push._PUSHER = None
        if pusher is not None:
            pusher.stop()
        await client.close()


async def greedy(m: Any, n: int = 8) -> dict[str, Any]:
    status, out = await m.post("/generate", {"input_ids": PROMPT, "sampling_params": {"temperature": 0,
                                                                                     "max_new_tokens": n}})
    assert status == 200, out
    return out


async def serves(m: Any, version: int, policy: torch.nn.Module) -> None:
    """Every instance is active at ``version`` and generates with ``policy``'s weights.

    The plugin's push returns once the boxes hold the version staged (``weight_push_wait_until`` "staged");
    a box then activates it at its next safe point, and a request sent before that crosses the activation.
    So the version must be served (``weight_versions.active``) before the tokens are compared."""
    st = await m.status()
    assert st["weight_version"] == version
    assert [(i["state"], i["weight_version"]) for i in st["instances"]] == [("active", version)], st["instances"]

    async def served() -> bool:
        return all(i["weight_versions"]["active"] == version and i["weight_versions"]["activating"] is None
                   for i in (await m.status())["instances"])

    await async_wait_until(served, timeout_s=30, message=f"every instance serving version {version}")
    out = await greedy(m)
    assert out["output_ids"] == reference_generate(policy, PROMPT, 8)[0]
    assert out["meta_info"]["weight_version"] == str(version)


@pytest.fixture
async def box(tmp_path):
    b = Box(tmp_path)
    try:
        await b.ready()
        yield b
    finally:
        await forget_pusher()
        b.stop()


async def start(start_manager, box: Box, sender_port: int) -> Any:
    m = await start_manager(weight_sender_base_port=str(sender_port), allowed_sender_ips="127.0.0.0/8")
    await m.register(box)
    return m


async def test_fresh_run_starts_on_the_model_path_and_step_one_pushes(start_manager, box):
    m = await start(start_manager, box, free_port())
    t = make_trainer(m.url, build_model(0))  # a fresh run starts from the model path the engines loaded
    await asyncio.to_thread(init, t)  # on_init_end -> update_weights(0)
    tensors = len(build_model(0).state_dict())
    assert t.global_steps == 0 and t.actor_rollout_wg.calls == [(0, tensors)]  # drained, as every rank must
    st = await m.status()
    assert st["recent_weight_pushes"] == [] and st["weight_senders"]["senders"] == []  # nothing staged or sent
    await serves(m, 0, build_model(0))

    trained = build_model(3)
    await asyncio.to_thread(step, t, trained.state_dict())  # fit: global_steps 1 -> on_step_end
    assert t.global_steps == 1 and t.actor_rollout_wg.calls[-1] == (1, tensors)
    await serves(m, 1, trained)


async def test_resume_publishes_the_checkpoint_step_and_a_restart_against_the_same_manager(start_manager, box,
                                                                                          tmp_path):
    def checkpoint(step: int, seed: int) -> Path:
        folder = tmp_path / "ckpt" / f"global_step_{step}"
        (folder / "actor").mkdir(parents=True)
        torch.save(build_model(seed).state_dict(), folder / "actor" / "model.pt")
        return folder

    step3, step2 = checkpoint(3, 5), checkpoint(2, 4)
    m = await start(start_manager, box, free_port())  # a manager started afresh: version 0
    t = make_trainer(m.url, build_model(0), resume_from=step3)
    await asyncio.to_thread(init, t)
    assert t.global_steps == 3
    await serves(m, 3, build_model(5))
    pushes = len((await m.status())["recent_weight_pushes"])

    # the trainer restarts from the same checkpoint; the manager (and its instances at version 3) survived
    await forget_pusher()
    t = make_trainer(m.url, build_model(0), resume_from=step3)
    await asyncio.to_thread(init, t)  # the weights the instances already serve: success, nothing pushed
    assert len((await m.status())["recent_weight_pushes"]) == pushes
    await serves(m, 3, build_model(5))

    # an older checkpoint (the manager's 400), or a fresh run (the plugin's check), against instances that
    # serve step 3: refused, saying why and what to do
    from trainer_plugin.client import ManagerHTTPError

    for folder, seen, error in ((step2, "2", ManagerHTTPError), (None, "0", RuntimeError)):
        await forget_pusher()
        t = make_trainer(m.url, build_model(0), resume_from=folder)
        with pytest.raises(error, match=rf"version {seen} .*below .*current version 3.*restart") as err:
            await asyncio.to_thread(init, t)
        assert not isinstance(err.value, ManagerHTTPError) or err.value.status == 400
    await serves(m, 3, build_model(5))
