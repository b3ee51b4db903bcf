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


def plugin_config(**rollout: Any) -> Any:
    from verl.workers.config import RolloutConfig

    return RolloutConfig(name="sglang-disaggregated", custom={"rollout_manager": {
        "port": 6010, "weight_push": "trainer_plugin.weight_push:discard_weights"}}, **rollout)


@needs_verl
async def test_lora_without_a_base_sync_is_refused_at_start_up_and_one_version_never_carries_two_payloads():
    from trainer_plugin.verl_rollout import DisaggregatedReplica, ManagerServerAdapter

    config = plugin_config(load_format="safetensors")  # verl then never syncs the base weights
    makers = (lambda mc: ManagerServerAdapter(config, mc, None),  # each training rank's init_model
              lambda mc: DisaggregatedReplica(replica_rank=0, config=config, model_config=mc, gpus_per_node=1))
    for make in makers:
        with pytest.raises(NotImplementedError, match=r"actor_rollout_ref\.rollout\.load_format=dummy"):
            make(model_config(8, False))
        with pytest.raises(NotImplementedError, match=r"lora\.merge=true"):  # merge unset: verl's default
            make(model_config(8, None))
        make(model_config(8, True))  # merged: full weights every step, no base sync needed
    megatron_style = SimpleNamespace(lora_rank=0, lora={"rank": 4})  # megatron keeps the rank in model.lora
    with pytest.raises(NotImplementedError, match="rank 4"):
        ManagerServerAdapter(config, megatron_style, None)
    ManagerServerAdapter(plugin_config(), model_config(8, False), None)  # load_format dummy (verl's default)

    adapter = ManagerServerAdapter(plugin_config(), model_config(8, True), None)  # merged: once a step

    def weights() -> Any:
        yield "w", torch.zeros(2)

    assert (await adapter.update_weights(weights(), global_steps=1, peft_config=None))["tensors"] == 1
    await adapter.update_weights(weights(), global_steps=2)
    with pytest.raises(RuntimeError, match="twice with global_steps=2"):
        await adapter.update_weights(weights(), global_steps=2)
    await adapter.update_weights(weights(), global_steps=None)  # an unchanged re-sync: nothing published


class TinyLM(torch.nn.Module):
    """HF-shaped names (``model.layers.N.self_attn.q_proj``...) in bfloat16, the dtype verl's rollout gets."""

    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(16, 8)
        self.model.layers = torch.nn.ModuleList()
        for _ in range(2):
            layer = torch.nn.Module()
            layer.self_attn = torch.nn.Module()
            for proj, shape in (("q_proj", (8, 8)), ("k_proj", (4, 8)), ("v_proj", (4, 8)), ("o_proj", (8, 8))):
                setattr(layer.self_attn, proj, torch.nn.Linear(shape[1], shape[0], bias=proj != "o_proj"))
            self.model.layers.append(layer)
        self.lm_head = torch.nn.Linear(8, 16, bias=False)
        self.to(torch.bfloat16)


def verl_lora_sync(peft_model: Any, base_sync_done: bool) -> tuple[Any, Any]:
    """What ``FSDPEngine.get_per_tensor_param`` hands the rollout with ``lora.merge`` False (no FSDP
    wrapper, so verl's own ``collect_lora_params`` takes its plain-module branch)."""
    from verl.utils.fsdp_utils import collect_lora_params, replace_lora_wrapper

    peft_config = peft_model.peft_config["default"]
    params = collect_lora_params(module=peft_model, layered_summon=False, base_sync_done=base_sync_done)
    if not base_sync_done:
        params = {replace_lora_wrapper(k, peft_config): v for k, v in params.items()}
    return iter(list(params.items())), peft_config


def reference_merge(peft_model: Any, base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """W + lora_alpha / r * B @ A in float32, cast to W's dtype, from the PEFT modules themselves."""
    config = peft_model.peft_config["default"]
    out = dict(base)
    for name, module in peft_model.base_model.model.named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
            w = base[f"{name}.weight"]
            out[f"{name}.weight"] = (w.float() + config.lora_alpha / config.r * (b.float() @ a.float())).to(w.dtype)
    return out


@needs_verl
async def test_unmerged_lora_is_pushed_as_merged_weights_one_version_per_step():
    """verl's ``lora.merge: False`` sync (engine_workers.py): base weights then the adapter under the first
    ``global_steps``, the adapter alone after it. The push gets one payload per step: the HF-named base
    with ``W + scale * B @ A`` for every targeted module, bit-exact with a reference merge, each step
    merged onto the base (not onto the previous merge)."""
    import copy

    peft = pytest.importorskip("peft")
    from trainer_plugin.verl_rollout import ManagerServerAdapter

    torch.manual_seed(0)
    hf_names = list(TinyLM().state_dict())
    lora_config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = peft.get_peft_model(TinyLM(), lora_config)
    base = {n.replace(".base_layer", ""): t.detach().clone()
            for n, t in model.base_model.model.state_dict().items() if "lora_" not in n}
    assert list(base) == hf_names

    adapter = ManagerServerAdapter(plugin_config(), model_config(4, None), None)  # verl's default: unmerged
    pushed: list[tuple[int | None, dict[str, torch.Tensor]]] = []

    def record(weights: Any, global_steps: int | None, context: Any) -> dict[str, Any]:
        pushed.append((global_steps, {n: t.clone() for n, t in weights}))
        return {"pushed": True}

    adapter._push = record
    expected: dict[int, dict[str, torch.Tensor]] = {}
    for step in (3, 4, 5):  # a run resumed at step 3: on_init_end's sync, then two steps
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_" in n:
                    p.add_(torch.randn_like(p))  # the step trained the adapter only
        expected[step] = reference_merge(model, base)
        if step == 3:  # base_sync_done starts False with load_format dummy: the base goes first, once
            weights, peft_config = verl_lora_sync(model, base_sync_done=False)
            answer = await adapter.update_weights(weights, peft_config=peft_config, base_sync_done=False,
                                                  global_steps=step)
            base_bytes = sum(t.nbytes for t in base.values())  # one process: its own node's sender rank keeps it
            assert answer == {"pushed": False, "lora_base_tensors": len(hf_names), "lora_base_bytes": base_bytes}
            assert pushed == []
        weights, peft_config = verl_lora_sync(model, base_sync_done=True)
        assert all(".lora_A." in n or ".lora_B." in n for n, _ in verl_lora_sync(model, True)[0])
        await adapter.update_weights(weights, peft_config=peft_config, base_sync_done=True, global_steps=step)

    assert [steps for steps, _ in pushed] == [3, 4, 5]  # exactly one payload per version
    for steps, payload in pushed:
        assert list(payload) == hf_names
        for name in hf_names:
            assert payload[name].dtype == torch.bfloat16
            assert payload[name].view(torch.uint8).equal(expected[steps][name].view(torch.uint8)), (steps, name)
    q, k = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"
    assert not pushed[2][1][q].equal(base[q]) and pushed[2][1][k].equal(base[k])  # targeted / not targeted
    # PEFT's own merge agrees (up to its bfloat16 arithmetic)
    peft_merged = copy.deepcopy(model).merge_and_unload().state_dict()
    for name in hf_names:
        torch.testing.assert_close(pushed[2][1][name].float(), peft_merged[name].float(), atol=0.07, rtol=0.02)

    with pytest.raises(RuntimeError, match="twice with global_steps=5"):
        weights, peft_config = verl_lora_sync(model, base_sync_done=True)
        await adapter.update_weights(weights, peft_config=peft_config, base_sync_done=True, global_steps=5)


@needs_verl
async def test_an_adapter_whose_names_map_to_no_base_tensor_is_refused_and_nothing_is_published():
    peft = pytest.importorskip("peft")
    from trainer_plugin.verl_rollout import ManagerServerAdapter

    model = peft.get_peft_model(TinyLM(), peft.LoraConfig(r=2, lora_alpha=2, target_modules=["q_proj"]))
    adapter = ManagerServerAdapter(plugin_config(), model_config(2, False), None)
    pushed: list[int | None] = []
    adapter._push = lambda weights, global_steps, context: pushed.append(global_steps)
    with pytest.raises(RuntimeError, match="before any base weights"):
        weights, peft_config = verl_lora_sync(model, base_sync_done=True)
        await adapter.update_weights(weights, peft_config=peft_config, base_sync_done=True, global_steps=1)
    weights, peft_config = verl_lora_sync(model, base_sync_done=False)
    await adapter.update_weights(weights, peft_config=peft_config, base_sync_done=False, global_steps=1)

    renamed = [(n.replace("self_attn.q_proj", "attn.query"), t) for n, t in verl_lora_sync(model, True)[0]]
    with pytest.raises(NotImplementedError, match=r"'model\.layers\.0\.attn\.query\.weight'.*not among"):
        await adapter.update_weights(iter(renamed), peft_config=peft_config, base_sync_done=True, global_steps=1)
    embedding = [("base_model.model.model.embed_tokens.lora_embedding_A", torch.zeros(2, 16))]
    with pytest.raises(NotImplementedError, match="not a lora_A/lora_B weight"):
        await adapter.update_weights(iter(embedding), peft_config=peft_config, base_sync_done=True, global_steps=1)
    wrong_shape = [(n, t[:, :-1] if ".lora_A." in n else t) for n, t in verl_lora_sync(model, True)[0]]
    with pytest.raises(ValueError, match=r"q_proj\.weight: B \(8, 2\) @ A \(2, 7\) does not fit"):
        await adapter.update_weights(iter(wrong_shape), peft_config=peft_config, base_sync_done=True, global_steps=1)
    dora = peft.LoraConfig(r=2, lora_alpha=2, target_modules=["q_proj"], use_dora=True)
    with pytest.raises(NotImplementedError, match="use_dora"):
        await adapter.update_weights(verl_lora_sync(model, True)[0], peft_config=dora, base_sync_done=True,
                                     global_steps=1)
    assert pushed == []
    # the same step's adapter, named as verl names it, is then published once
    weights, peft_config = verl_lora_sync(model, base_sync_done=True)
    await adapter.update_weights(weights, peft_config=peft_config, base_sync_done=True, global_steps=1)
    assert pushed == [1]


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


def test_a_node_ip_bind_listens_on_the_ray_node_address_and_needs_ray():
    """``host: node_ip`` binds (and publishes) the address Ray knows the launching node by; the
    two-node test in tests/test_verl_topology.py runs it. Outside a Ray job there is no such address."""
    from trainer_plugin import manager_address
    from trainer_plugin.settings import from_rollout_config

    settings = from_rollout_config({"custom": {"rollout_manager": {"host": "node_ip", "port": 6011}}})
    for fn in (manager_address.bind_host, manager_address.launch_url):
        with pytest.raises(RuntimeError, match=r"rollout_manager\.host=node_ip binds .* not in a Ray job"):
            fn(settings)
    wildcard = from_rollout_config({"custom": {"rollout_manager": {"port": 6011}}})
    assert manager_address.bind_host(wildcard) == "0.0.0.0"
