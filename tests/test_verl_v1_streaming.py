"""verl 0.9.1's V1 streaming trainer path with ``rollout.name=sglang-disaggregated``, on CPU.

verl's own code, unmodified and not mocked: the ``ppo_trainer`` Hydra config (composed with overrides and
checked by ``validate_config`` as ``main_ppo.main`` does), ``get_ppo_ray_runtime_env`` and
``transfer_queue.init`` as ``run_ppo``/``TaskRunnerV1.run`` call them; ``LLMServerManager``, which
resolves ``sglang-disaggregated`` through the plugin's registration and starts
:class:`~trainer_plugin.verl_rollout.DisaggregatedReplica` (its ``launch_servers`` attaches to the test's
manager and starts the CPU-only ``ManagerProxyServer`` Ray actor); verl's global load balancer and
``LLMServerClient``; ``AgentLoopManagerTQ``/``AgentLoopWorkerTQ`` running ``SingleTurnAgentLoop`` (chat
template -> token ids -> ``generate`` -> TransferQueue under ``{uid}_{session}_{index}``, prompt tags
pending/running/finished); ``collate_fn`` for the prompt batch; and ``ReplayBuffer.sample`` handing the
trainer whole finished groups, two groups at a time, as ``PPOTrainer._step_once`` does with
``sample_batch_size = train_batch_size / parameter_sync_step``. Behind them: a real rollout manager
and two CPU engines (the tests/conftest.py fixtures). The driver-side steps run in a thread, as in
``TaskRunnerV1.run`` (synchronous code); the prompt registration and submission are
``PPOTrainer._submit_batch_to_rollout`` (sync mode) written out, because the trainer object itself
needs the FSDP workers.

The model: verl needs an HF model directory (config + tokenizer) and there is no network, so the test
writes a tiny one: a character-level tokenizer whose 256 ids are exactly the CPU engine model's
vocabulary, with a one-line chat template, and a 2-layer LlamaConfig (never loaded as weights).
``rollout.temperature=0`` (greedy) makes every response the engine's deterministic output, checked
token by token against ``reference_generate``.

The one stand-in, because there is no GPU: the trainer builds ``LLMServerManager`` with its actor
worker group (``worker_group=self.actor_rollout_wg``, FSDP workers holding the policy on GPUs); verl
reads only ``world_size`` and ``workers`` from it, to size the replicas and give each its slice
(``RolloutReplica.init_hybrid``), and ``DisaggregatedReplica`` never uses those workers. The test passes
an object with just those two attributes. (The other route, ``worker_group=None`` ->
``init_standalone``, reserves ``rollout.nnodes * rollout.n_gpus_per_node`` GPUs in a Ray placement group
and fails at once without GPUs.) Nothing in verl is patched.

Not installed with verl 0.9.1 but imported by it on this path: ``fastapi``/``uvicorn``, and ``cachetools`` (by
``verl/workers/rollout/router.py``, the load balancer); the test is skipped, saying so, without it.
The test imports ``trainer_plugin.verl_registration`` itself (what the ``verl.plugins`` entry point does
on ``import verl``), so it also holds with an install whose metadata predates that entry point.
Everything listens on 127.0.0.1; Ray runs locally with 4 logical CPUs, no GPU, no dashboard.
"""

from __future__ import annotations

import asyncio
import importlib.util
import types
import uuid
from pathlib import Path

import aiohttp
import pytest
from conftest import FAST
from support import async_wait_until, free_port

from rollout_manager.cpu_engine.model import build_model, reference_generate

V1_MODULES = ("verl", "transfer_queue", "ray", "hydra", "tokenizers", "cachetools", "uvicorn", "fastapi")
MISSING = [m for m in V1_MODULES if importlib.util.find_spec(m) is None]
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(bool(MISSING), reason=f"verl 0.9.1's V1 trainer path needs {', '.join(MISSING)} (pip install "
                       "-c tests/verl_constraints.txt verl==0.9.1 TransferQueue cachetools fastapi uvicorn, "
                       "after torch==2.13.0)"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

N = 4  # rollout.n: samples per prompt, one GRPO group
GROUPS_PER_SAMPLE = 2  # groups the trainer takes per ReplayBuffer.sample
PROMPT_LEN, RESPONSE_LEN = 48, 6
QUESTIONS = ["hi", "What is 2+2?", "Name a colour.", "Say something long and polite, please."]
SPECIAL = ["<pad>", "<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>"]
FIRST_CHAR_ID = len(SPECIAL)  # printable ASCII follows the special tokens, one id per character
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def write_tiny_model(path: Path, vocab_size: int) -> Path:
    """A character-level tokenizer (ids 0..vocab_size-1) with a chat template, and a tiny Llama config."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)]
    vocab = {tok: i for i, tok in enumerate(SPECIAL + chars)}
    vocab.update({f"<x{i}>": i for i in range(len(vocab), vocab_size)})
    assert len(vocab) == vocab_size
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))  # no merges: one token per character
    tok.add_special_tokens(SPECIAL)
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                            unk_token="<unk>", chat_template=CHAT_TEMPLATE).save_pretrained(path)
    LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024, bos_token_id=1,
                eos_token_id=2, pad_token_id=0, architectures=["LlamaForCausalLM"]).save_pretrained(path)
    return path


def expected_prompt_ids(question: str) -> list[int]:
    """The chat template applied by hand: <|user|> question </s> <|assistant|>."""
    return ([SPECIAL.index("<|user|>")] + [FIRST_CHAR_ID + ord(c) - 32 for c in question]
            + [SPECIAL.index("</s>"), SPECIAL.index("<|assistant|>")])


def compose_config(model_dir: Path, manager_port: int, relays_config: Path | None = None):
    """verl's own ppo_trainer config, as ``python -m verl.trainer.main_ppo ...`` composes and checks it; with
    ``relays_config`` the plugin runs the manager as a control actor and two relay actors with that config."""
    manager = ([f"+actor_rollout_ref.rollout.custom.rollout_manager.port={manager_port}",
                "+actor_rollout_ref.rollout.custom.rollout_manager.launch=true"]  # attaches: one is listening there
               if relays_config is None else
               ["+actor_rollout_ref.rollout.custom.rollout_manager.ray_relays=2",
                f"+actor_rollout_ref.rollout.custom.rollout_manager.config_path={relays_config}"])
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    with initialize_config_module("verl.trainer.config", version_base=None):
        cfg = compose("ppo_trainer", overrides=[
            f"actor_rollout_ref.model.path={model_dir}",
            "actor_rollout_ref.rollout.name=sglang-disaggregated",
            f"actor_rollout_ref.rollout.n={N}",
            "actor_rollout_ref.rollout.temperature=0",
            "actor_rollout_ref.rollout.calculate_log_probs=true",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
            "actor_rollout_ref.rollout.agent.num_workers=1",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
            "algorithm.adv_estimator=grpo",
            f"data.max_prompt_length={PROMPT_LEN}",
            f"data.max_response_length={RESPONSE_LEN}",
            f"data.train_batch_size={len(QUESTIONS)}",
            "trainer.n_gpus_per_node=2",
            "trainer.nnodes=1",
            "trainer.v1.trainer_mode=sync",
            "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
            "+actor_rollout_ref.rollout.custom.rollout_manager.host=127.0.0.1",
            *manager,
        ])
    validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    cfg.transfer_queue.enable = True  # TaskRunnerV1.run sets it, then resolves
    OmegaConf.resolve(cfg)
    return cfg


@pytest.fixture
def model():
    return build_model(0)


@pytest.fixture
def local_ray():
    """Start a small local Ray as ``run_ppo`` does, its node on 127.0.0.2 (Ray swaps 127.0.0.1 for the host's
    own address, and actors listen on their node's address), then TransferQueue as ``TaskRunnerV1.run`` does;
    both are shut down at the end."""
    import ray
    import transfer_queue as tq

    started = []

    def start(config) -> None:
        from omegaconf import OmegaConf
        from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

        runtime_env = OmegaConf.to_container(OmegaConf.create(get_ppo_ray_runtime_env(config)))
        runtime_env.setdefault("env_vars", {})["TRANSFER_QUEUE_ENABLE"] = "1"
        ray.init(address="local", _node_ip_address="127.0.0.2", num_cpus=4, num_gpus=0, include_dashboard=False,
                 object_store_memory=200 << 20,
                 runtime_env=runtime_env, logging_level="WARNING")
        started.append(True)
        tq.init(config.transfer_queue)

    yield start
    if started:
        try:
            tq.close()
        finally:
            ray.shutdown()



def prompt_batch(global_steps: int):
    """One dataloader batch: RLHFDataset-shaped rows through verl's collate_fn, plus the trainer's uid/global_steps."""
    import numpy as np
    import torch
    from verl.utils import tensordict_utils as tu
    from verl.utils.dataset.rl_dataset import collate_fn

    rows = [{"raw_prompt": [{"role": "user", "content": q}], "dummy_tensor": torch.tensor([0], dtype=torch.uint8),
             "data_source": "toy", "reward_model": {"ground_truth": str(i)}, "extra_info": {"index": i},
             "index": i, "tools_kwargs": {}, "interaction_kwargs": {}} for i, q in enumerate(QUESTIONS)]
    batch_dict = collate_fn(rows)
    # PPOTrainer._fetch_one_gen_batch / _next_train_batch
    batch_dict["uid"] = np.array([str(uuid.uuid4()) for _ in rows], dtype=object)
    batch = tu.get_tensordict(batch_dict)
    tu.assign_non_tensor_data(batch, "global_steps", global_steps)
    return batch


def prompt_statuses(partition_id: str = "train") -> dict[str, str]:
    """uid -> status of the prompts registered in TransferQueue (what ReplayBuffer polls)."""
    import transfer_queue as tq

    data = tq.kv_list(partition_id) or {}
    return {k: t["status"] for k, t in data.get(partition_id, {}).items() if t.get("is_prompt")}


async def test_v1_agent_loops_stream_whole_greedy_groups_through_the_manager(start_manager, start_engines,
                                                                             local_ray, model, tmp_path):
    # Ray and TransferQueue start (run_ppo, TaskRunnerV1.run) while the manager and the engines come up.
    port = free_port()
    config = compose_config(write_tiny_model(tmp_path / "tiny-model", model.config.vocab_size), port)

    async def manager_and_engines():
        m = await start_manager(port=port)
        engines = await start_engines(["--token-delay-s", "0.002"], ["--token-delay-s", "0.004"])
        await m.register(*engines)

    # both run to the end before anything fails, so no half-started Ray outlives the test
    for outcome in await asyncio.gather(asyncio.to_thread(local_ray, config), manager_and_engines(),
                                        return_exceptions=True):
        if isinstance(outcome, BaseException):
            raise outcome
    await one_streamed_step(config, model, f"127.0.0.1:{port}")


@pytest.mark.skip(reason="a relay actor here sometimes gets no fleet from the control actor for over a minute after "
                  "it starts (its hello or fleet stream through the local door stalls, cause not found yet; "
                  "docs/relays.md, 'Limits now'): the step then waits on relays with no boxes")
async def test_v1_agent_loops_through_the_manager_as_ray_relay_actors(start_engines, local_ray, model, tmp_path):
    """The same step with ``custom.rollout_manager.ray_relays = 2``: verl's replica launch starts the manager as
    a control actor and two relay actors in the job's Ray, the boxes register through a relay, and the agent
    loops' batches spread over the relays, which answer every sample exactly."""
    from trainer_plugin import relay_actors

    settings = tmp_path / "manager.toml"
    settings.write_text("".join(f"{k} = {v}\n" for k, v in {**FAST, "relay_report_s": "0.1"}.items()))
    config = compose_config(write_tiny_model(tmp_path / "tiny-model", model.config.vocab_size), 0, settings)
    outcomes = await asyncio.gather(asyncio.to_thread(local_ray, config),
                                    start_engines(["--token-delay-s", "0.002"], ["--token-delay-s", "0.004"]),
                                    return_exceptions=True)
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome
    engines = outcomes[1]
    try:
        await one_streamed_step(config, model, None, engines)
        urls = await asyncio.to_thread(relay_actors.find)
        assert len(urls) == 2

        async def answered() -> list[int]:
            async with aiohttp.ClientSession() as s, s.get(urls[0] + "/get_instances_status") as r:
                relays = (await r.json())["relays"]
            return [int(relay["finished"]) for relay in relays]

        async def all_answered() -> bool:
            return sum(await answered()) == len(QUESTIONS) * N

        await async_wait_until(all_answered, 20, message="the relays' reports count every sample once")
    finally:
        await asyncio.to_thread(relay_actors.stop_all)


async def one_streamed_step(config, model, address: str | None, engines=()) -> None:
    """One sync-mode step through verl's V1 streaming path against the manager (at ``address``; None: the
    relay actors the replica launch starts, with ``engines`` registered through a relay once they run)."""
    import torch
    import transfer_queue as tq
    from verl.trainer.ppo.v1 import AgentLoopManagerTQ
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer
    from verl.workers.rollout.llm_server import LLMServerClient, LLMServerManager

    import trainer_plugin.verl_registration  # noqa: F401 - what verl's plugin entry point loads on `import verl`
    from trainer_plugin.verl_rollout import DisaggregatedReplica

    # ---- TaskRunnerV1.run and PPOTrainer._setup, the rollout side (synchronous code: off the event loop)
    def setup():
        actor_wg = types.SimpleNamespace(world_size=config.trainer.n_gpus_per_node, workers=[])  # see docstring
        servers = LLMServerManager.create(config=config, worker_group=actor_wg)
        agents = AgentLoopManagerTQ.create(config=config, llm_client=servers.get_client(), teacher_client=None,
                                           reward_loop_worker_handles=None)
        return servers, agents

    servers, agents = await asyncio.to_thread(setup)
    replicas = servers.get_replicas()
    assert [type(r) for r in replicas] == [DisaggregatedReplica] * 2  # actor world size 2 / rollout tp 1
    assert len({r.server_handle for r in replicas}) == 1  # one shared proxy actor...
    if address is not None:
        assert servers.get_addresses() == [address] * 2  # ...whose address is the manager's
    assert type(servers.get_client()) is LLMServerClient  # what the sync trainer hands the agent loops
    if engines:
        await register_through_a_relay(engines)

    # ---- PPOTrainer._submit_batch_to_rollout (sync mode)
    step = 1
    batch = prompt_batch(step)
    uids = list(batch["uid"])
    tq.kv_batch_put(keys=uids, partition_id="train",
                    tags=[{"is_prompt": True, "status": "pending", "global_steps": step} for _ in uids])
    await asyncio.to_thread(agents.generate_sequences, batch)  # returns once the agent loops are spawned

    def refill(n):
        raise AssertionError(f"the replay buffer asked for {n} replacement prompts: a group failed")

    sampler = config.trainer.v1.sampler  # the arguments PPOTrainer._build_replay_buffer passes in sync mode
    buffer = ReplayBuffer(trainer_mode="sync", trainer_config=config.trainer.v1.get("sync", {}),
                          max_off_policy_threshold=sampler.max_off_policy_threshold,
                          max_off_policy_strategy=sampler.max_off_policy_strategy,
                          sampler_kwargs=sampler.sampler_kwargs, refill_fn=refill, filter_groups_metric=None,
                          sync_refill_failed_groups=False, train_batch_size=len(QUESTIONS),
                          gen_batch_size=len(QUESTIONS), max_inflight_gen_batches=1)

    async def finished_groups(k):
        statuses = await asyncio.to_thread(prompt_statuses)
        assert "failure" not in statuses.values(), statuses  # see the AgentLoopWorkerTQ log above
        return sum(s == "finished" for s in statuses.values()) >= k

    # ---- PPOTrainer._step_once: take groups as they finish. ReplayBuffer.sample polls TransferQueue itself
    # (every 2 s, with no deadline); waiting here first keeps the test bounded and the call immediate.
    batches = []
    for _ in range(len(QUESTIONS) // GROUPS_PER_SAMPLE):
        await async_wait_until(lambda: finished_groups(GROUPS_PER_SAMPLE), timeout_s=45, interval_s=0.05,
                               message=f"{GROUPS_PER_SAMPLE} finished groups in TransferQueue")
        before = await asyncio.to_thread(prompt_statuses)
        meta, metrics = await asyncio.to_thread(buffer.sample, global_steps=step, partition_id="train",
                                                batch_size=GROUPS_PER_SAMPLE)
        assert metrics == {}  # nothing evicted, nothing refilled
        taken = list(dict.fromkeys(key.split("_")[0] for key in meta.keys))
        assert len(taken) == GROUPS_PER_SAMPLE and set(taken) <= set(before)
        # the other groups stay in TransferQueue (running, or finished and waiting for the next sample)
        assert set(await asyncio.to_thread(prompt_statuses)) == set(before) - set(taken)
        batches.append((taken, meta))

    sampled = []
    for taken, meta in batches:
        sampled += taken
        assert meta.partition_id == "train" and len(meta) == GROUPS_PER_SAMPLE * N
        assert sorted(meta.keys) == sorted(f"{u}_{s}_0" for u in taken for s in range(N))  # whole groups
        data = await asyncio.to_thread(tq.kv_batch_get, keys=meta.keys, partition_id="train")
        # what the trainer's later stages read (reward, old log-probs, balancing, advantages, metrics)
        for key in ("prompts", "responses", "response_mask", "loss_mask", "rollout_log_probs", "input_ids",
                    "position_ids", "uid", "raw_prompt", "data_source", "reward_model", "num_turns", "extra_fields"):
            assert key in data.keys(), key
        rows = len(meta)
        prompt_ids = [expected_prompt_ids(QUESTIONS[uids.index(key.split("_")[0])]) for key in meta.keys]
        assert data["prompts"].offsets().diff().tolist() == [len(p) for p in prompt_ids]  # as _compute_reward_colocate
        responses = data["responses"].to_padded_tensor(0)
        assert responses.dtype == torch.int64 and tuple(responses.shape) == (rows, RESPONSE_LEN)
        log_probs = data["rollout_log_probs"].to_padded_tensor(0.0)
        assert log_probs.dtype == torch.float32 and tuple(log_probs.shape) == (rows, RESPONSE_LEN)
        for row, (key, tag) in enumerate(zip(meta.keys, meta.tags)):
            uid, session, _ = key.split("_")
            ref_ids, ref_lps = reference_generate(model, prompt_ids[row], RESPONSE_LEN)
            assert data["uid"][row] == uid and int(data["session_id"][row]) == int(session)
            assert data["raw_prompt"][row] == [{"role": "user", "content": QUESTIONS[uids.index(uid)]}]
            assert data["prompts"][row].tolist() == prompt_ids[row]
            assert responses[row].tolist() == ref_ids, (uid, session)  # greedy: the engine's reference tokens
            assert log_probs[row].tolist() == pytest.approx(ref_lps, abs=1e-4)
            assert data["response_mask"][row].tolist() == [1] * RESPONSE_LEN == data["loss_mask"][row].tolist()
            assert data["input_ids"][row].tolist() == prompt_ids[row] + ref_ids
            assert data["position_ids"][row].tolist() == list(range(len(prompt_ids[row]) + RESPONSE_LEN))
            # the tags ReplayBuffer, _balance_batch and _compute_metrics read
            assert tag["status"] == "success" and tag["global_steps"] == step
            assert (tag["prompt_len"], tag["response_len"]) == (len(prompt_ids[row]), RESPONSE_LEN)
            assert tag["seq_len"] == len(prompt_ids[row]) + RESPONSE_LEN
            assert tag["min_global_steps"] == 0 == tag["max_global_steps"]  # the manager's weight version "0"
            extra = data["extra_fields"][row]
            extra = getattr(extra, "data", extra)
            assert extra["weight_versions"] == ["0"] and extra["global_steps"] == 0, extra
            assert extra["min_global_steps"] == 0 == extra["max_global_steps"]
    assert sorted(sampled) == sorted(uids)  # every group arrived, each once
    assert await asyncio.to_thread(prompt_statuses) == {}
    # the agent loops' 16 per-sample calls reached the manager coalesced into batch requests
    stats = await replicas[0].server_handle.batching_stats.remote()
    assert stats["requests"] == len(QUESTIONS) * N and stats["batches"] < stats["requests"], stats


async def register_through_a_relay(engines) -> None:
    """Register ``engines`` at the first relay the plugin finds through Ray and wait until both are active."""
    from trainer_plugin import relay_actors

    url = (await asyncio.to_thread(relay_actors.find))[0]
    async with aiohttp.ClientSession() as s:
        for engine in engines:
            async with s.post(url + "/register_rollout_instance", json={"host": "127.0.0.1", "port": engine.port}) as r:
                assert r.status == 200, await r.text()

        async def active() -> bool:
            async with s.get(url + "/get_instances_status") as r:
                listed = (await r.json())["instances"]
            return len(listed) == len(engines) and all(i["state"] == "active" for i in listed)

        await async_wait_until(active, 30, message="the engines active behind the relays")
