"""The plugin against what verl 0.9.1 really does around it: node layout, LoRA, multi-turn request ids,
and the order its modules are imported in. (The Ray layouts themselves: tests/test_verl_topology.py.)"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import textwrap
import uuid
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
import torch
from support import PY, ROOT

from trainer_plugin.node_layout import NodeLayout
from trainer_plugin.trajectory_keys import TrajectoryKeys

HAVE_VERL = importlib.util.find_spec("verl") is not None
needs_verl = pytest.mark.skipif(not HAVE_VERL, reason="verl 0.9.1 is not installed (scripts/install.sh)")
V1_MISSING = [m for m in ("verl", "transfer_queue", "cachetools") if importlib.util.find_spec(m) is None]


def test_node_leaders_come_from_where_ranks_run_not_from_local_rank():
    layout = NodeLayout(rank=3, node_ids=("a", "a", "b", "b", "a"))
    assert (layout.leader_rank, layout.is_leader, layout.node_ranks, layout.leaders) == (2, False, [2, 3], [0, 2])
    assert NodeLayout(rank=4, node_ids=layout.node_ids).node_ranks == [0, 1, 4]
    assert [NodeLayout(rank=r, node_ids=layout.node_ids).is_leader for r in range(5)] == [True, False, True, False,
                                                                                         False]


def test_trajectory_keys_follow_a_conversation_and_keep_siblings_apart():
    keys = TrajectoryKeys(capacity=8)
    prompt = [1, 2, 3]
    a, b = keys.key_for(prompt, "a1"), keys.key_for(prompt, "b1")  # two samples of one prompt
    assert (a, b) == ("a1", "b1")
    keys.finished(a, prompt, [7, 7, 0])
    keys.finished(b, prompt, [8])
    assert keys.key_for([*prompt, 8, 50, 51], "b2") == "b1"  # b's next turn: its context plus a tool answer
    assert keys.key_for([*prompt, 7, 7, 60], "a2") == "a1"  # the stop token 0 dropped at the junction
    assert keys.key_for([*prompt, 9], "c1") == "c1"  # extends no finished context: a new trajectory
    assert keys.key_for([*prompt, 5], "d1") == "d1"  # shares only the prompt: a sibling's turn is not it
    assert (keys.continued, keys.started) == (2, 4)
    for i in range(20):  # bounded
        keys.finished(f"k{i}", [i], [i])
    assert len(keys) == 8


def model_config(rank: int, merge: bool | None) -> Any:
    lora = {} if merge is None else {"merge": merge}
    return SimpleNamespace(lora_rank=rank, lora=lora)


@needs_verl
async def test_unmerged_lora_is_refused_at_start_up_and_one_version_never_carries_two_payloads():
    from verl.workers.config import RolloutConfig

    from trainer_plugin.verl_rollout import DisaggregatedReplica, ManagerServerAdapter

    config = RolloutConfig(name="sglang-disaggregated", custom={"rollout_manager": {
        "port": 6010, "weight_push": "trainer_plugin.weight_push:discard_weights"}})
    makers = (lambda mc: ManagerServerAdapter(config, mc, None),  # each training rank's init_model
              lambda mc: DisaggregatedReplica(replica_rank=0, config=config, model_config=mc, gpus_per_node=1))
    for make in makers:
        with pytest.raises(NotImplementedError, match=r"actor_rollout_ref\.model\.lora\.merge=true"):
            make(model_config(8, False))
        with pytest.raises(NotImplementedError, match=r"lora\.merge=true"):  # merge unset: verl's default
            make(model_config(8, None))
    megatron_style = SimpleNamespace(lora_rank=0, lora={"rank": 4})  # megatron keeps the rank in model.lora
    with pytest.raises(NotImplementedError, match="rank 4"):
        ManagerServerAdapter(config, megatron_style, None)

    adapter = ManagerServerAdapter(config, model_config(8, True), None)  # merged: full weights, once a step

    def weights() -> Any:
        yield "w", torch.zeros(2)

    assert (await adapter.update_weights(weights(), global_steps=1, peft_config=None))["tensors"] == 1
    # engine_workers.py with lora.merge False: base, then adapter tensors, both under global_steps 2
    with pytest.raises(NotImplementedError, match="peft_config"):
        await adapter.update_weights(weights(), global_steps=2, peft_config={"r": 8}, base_sync_done=True)
    await adapter.update_weights(weights(), global_steps=2)
    with pytest.raises(RuntimeError, match="twice with global_steps=2"):
        await adapter.update_weights(weights(), global_steps=2)
    await adapter.update_weights(weights(), global_steps=None)  # an unchanged re-sync: nothing published


@pytest.mark.slow
@pytest.mark.skipif(bool(V1_MISSING), reason=f"verl 0.9.1's V1 trainers need {', '.join(V1_MISSING)}")
def test_importing_the_trainer_mode_before_verl_v1_still_registers_it():
    code = textwrap.dedent("""
        import trainer_plugin.verl_trainer as mode
        from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY
        print(TRAINER_REGISTRY.get(mode.TRAINER_MODE).__name__)
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([PY, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "PPOTrainerSyncWithManager"
    assert "could not register" not in out.stderr


async def affinity_hits(url: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    m = re.search(r"^rollout_manager_affinity_hits_total (\S+)$", text, re.M)
    assert m, text[:2000]
    return float(m.group(1))


@needs_verl
@pytest.mark.slow
async def test_multi_turn_agents_through_verls_llm_server_client_keep_their_instance(start_manager, start_engines):
    """verl's ``LLMServerClient.generate`` (the agent loops' request path) sends the server a fresh uuid
    on every turn; each trajectory's later turns still carry one trajectory key, so the manager puts
    them where their conversation is cached. (Only the load balancer, a Ray actor that holds the server
    handles, is replaced: it returns the proxy.)"""
    from omegaconf import OmegaConf
    from verl.workers.rollout.llm_server import LLMServerClient

    from trainer_plugin.proxy import ManagerProxyServer

    m = await start_manager()
    await m.register(*await start_engines([], []))
    proxy = ManagerProxyServer(m.url, prompt_length=128, response_length=64, batch_window_s=0)
    seen_ids: list[str] = []

    async def generate(request_id: str, **kwargs: Any) -> Any:
        seen_ids.append(request_id)
        return await proxy.generate(request_id=request_id, **kwargs)

    class Client(LLMServerClient):
        async def _acquire_server(self, request_id: str, **extra: Any) -> Any:
            return "proxy", SimpleNamespace(generate=SimpleNamespace(remote=generate))

        def _release_server(self, server_id: str, request_id: str | None = None) -> None:
            return None

    config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": "sglang-disaggregated",
                                                                 "full_determinism": False}}})
    client = Client(config)
    turns, tool_answer = 3, list(range(40, 60))  # a tool answer longer than the context so far
    endpoints: dict[str, list[str]] = {}
    try:
        for start in ([5, 9, 2], [3, 1, 4], [6, 6, 1]):  # three agent trajectories, one request_id each
            request_id = uuid.uuid4().hex
            prompt = list(start)
            for _ in range(turns):
                out = await client.generate(request_id, prompt_ids=prompt,
                                            sampling_params={"temperature": 0, "max_new_tokens": 4})
                endpoints.setdefault(request_id, []).append(out.extra_fields["segments"][-1]["endpoint"])
                prompt = [*prompt, *out.token_ids, *tool_answer]
        assert len(set(seen_ids)) == len(seen_ids) == 3 * turns  # verl: a new id per turn
        assert all(len(set(e)) == 1 for e in endpoints.values()), endpoints
        assert await affinity_hits(m.url) == 3 * (turns - 1)  # every later turn found its trajectory
        assert (proxy.trajectories.started, proxy.trajectories.continued) == (3, 3 * (turns - 1))
    finally:
        await proxy.close()
