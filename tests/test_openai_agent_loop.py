"""The verl agent loop for OpenAI-speaking agents (trainer_plugin/openai_agent_loop.py) run by verl 0.9.1's own
``AgentLoopWorker`` on CPU: the worker, built from verl's composed ``ppo_trainer`` config, instantiates the loop
from verl's registry (``@register``) for each sample, the loop runs an agent written against the openai SDK
(a tool call, the tool's result, an answer) through a real manager and CPU engine, and the worker's padded
batch (prompts, responses, response_mask, rollout_log_probs, rm_scores) holds exactly the ids the manager's
ledger kept: the ids the agent's turns were sent and sampled, the tool result as template tokens with mask 0.

verl's worker is used as a plain object (it is a Ray actor only when ``AgentLoopManager`` makes it one) with no
LLM server client: this loop talks to the manager, not to verl's servers. The model directory is the test
tokenizer (tests/openai_tokenizer.py) with a tiny LlamaConfig beside it, never loaded as weights. The tiny
random model does not write a tool call: the agent makes the CPU engine write one (its ``script_tokens``
fault) for the first turn and lets it sample the second.
"""

from __future__ import annotations

import base64
import importlib.util
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from openai_tokenizer import eos_id, make

MISSING = [m for m in ("verl", "hydra", "ray", "openai") if importlib.util.find_spec(m) is None]
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(bool(MISSING), reason=f"needs {', '.join(MISSING)} (verl 0.9.1)"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]

MODEL = "tiny-chatml"
PROMPT_LEN, RESPONSE_LEN = 192, 96
LAYERS, EXPERTS, TOP_K = 2, 4, 2  # the CPU engine's MoE layers
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = '<tool_call> {"name": "get_weather", "arguments": {"city": "paris"}} </tool_call>'
SEEN: dict[str, list[tuple[list[int], list[int]]]] = {}  # session -> each turn's (prompt ids, sampled ids)


async def weather_agent(run: Any) -> float:
    """An agent harness as a user writes one: the SDK's chat calls with tools, the tool run, the result sent
    back; its reward is its own (1.0 when the answer came after the tool)."""
    turns = SEEN.setdefault(run.session_id, [])
    messages = list(run.messages)
    first = await run.client.chat.completions.create(model=run.model, messages=messages, tools=TOOLS, max_tokens=24,
                                                     **run.sampling)
    turns.append((first.model_extra["prompt_token_ids"], first.choices[0].model_extra["token_ids"]))
    async with aiohttp.ClientSession() as s:  # the engine samples on its own from here on
        async with s.post(run.sample["engine_url"] + "/debug/faults", json={"script_tokens": None}) as resp:
            assert resp.status == 200
    call = first.choices[0].message.tool_calls[0]
    result = {"paris": "sunny"}[json.loads(call.function.arguments)["city"]]
    messages += [first.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": result}]
    second = await run.client.chat.completions.create(model=run.model, messages=messages, tools=TOOLS, max_tokens=6,
                                                      extra_body={"ignore_eos": True}, **run.sampling)
    turns.append((second.model_extra["prompt_token_ids"], second.choices[0].model_extra["token_ids"]))
    return 1.0


def write_model(path: Path) -> Path:
    from transformers import LlamaConfig

    make(path)
    LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
                num_key_value_heads=4, max_position_embeddings=1024, eos_token_id=eos_id(), pad_token_id=0,
                num_experts_per_tok=TOP_K,  # the MoE shape routing replay reads (the CPU engine's)
                architectures=["LlamaForCausalLM"]).save_pretrained(path)
    return path


def compose_config(model_dir: Path, manager_port: int) -> Any:
    """verl's own ppo_trainer config with the plugin's manager address and a greedy rollout."""
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    with initialize_config_module("verl.trainer.config", version_base=None):
        cfg = compose("ppo_trainer", overrides=[
            f"actor_rollout_ref.model.path={model_dir}",
            "actor_rollout_ref.rollout.name=sglang-disaggregated",
            "actor_rollout_ref.rollout.temperature=0",
            "actor_rollout_ref.rollout.calculate_log_probs=true",
            "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
            f"data.max_prompt_length={PROMPT_LEN}",
            f"data.max_response_length={RESPONSE_LEN}",
            "+actor_rollout_ref.rollout.custom.rollout_manager.address=127.0.0.1",
            f"+actor_rollout_ref.rollout.custom.rollout_manager.port={manager_port}",
        ])
    OmegaConf.resolve(cfg)
    return cfg


async def test_verls_agent_loop_worker_gets_the_ledgers_exact_ids(tmp_path: Path, start_manager: Any,
                                                                  start_engines: Any) -> None:
    import numpy as np
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker, _agent_loop_registry
    from verl.protocol import DataProto

    from trainer_plugin import openai_agent_loop

    model_dir = write_model(tmp_path / "model")
    m = await start_manager(openai_tokenizer_path=str(model_dir), openai_model_name=MODEL)
    (engine,) = await start_engines(["--eos-token-id", str(eos_id()), "--num-experts", str(EXPERTS),
                                      "--num-experts-per-tok", str(TOP_K), "--enable-return-routed-experts"])
    await m.register(engine)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    async with aiohttp.ClientSession() as s:
        async with s.post(engine.url + "/debug/faults", json={
                "script_tokens": [*tok.encode(CALL, add_special_tokens=False), eos_id()]}) as resp:
            assert resp.status == 200

    assert openai_agent_loop.LOOP_NAME in _agent_loop_registry  # registered by importing the module
    worker = AgentLoopWorker(compose_config(model_dir, int(m.url.rsplit(":", 1)[1])), llm_client=None)
    prompt = [{"role": "system", "content": "you are a helpful agent"}, {"role": "user", "content": "weather in paris"}]
    batch = DataProto.from_dict(non_tensors={
        "raw_prompt": np.array([prompt], dtype=object),
        "agent_name": np.array([openai_agent_loop.LOOP_NAME], dtype=object),
        "openai_agent": np.array([f"{__name__}:weather_agent"], dtype=object),
        "engine_url": np.array([engine.url], dtype=object),
        "index": np.array([0]),
    })
    out = await worker.generate_sequences(batch)

    (session,) = out.non_tensor_batch["openai_session"]
    (p1, r1), (p2, r2) = SEEN[session]
    tail = p2[len(p1) + len(r1):]
    assert p2[:len(p1) + len(r1)] == p1 + r1 and tail == tok.encode(
        "\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
        add_special_tokens=False)
    prompts, responses = out.batch["prompts"][0].tolist(), out.batch["responses"][0].tolist()
    mask = out.batch["response_mask"][0].tolist()
    n = len(r1) + len(tail) + len(r2)
    assert prompts[PROMPT_LEN - len(p1):] == p1 and responses[:n] == r1 + tail + r2  # verl pads around them
    assert mask[:n] == [1] * len(r1) + [0] * len(tail) + [1] * len(r2) and not any(mask[n:])
    logprobs = out.batch["rollout_log_probs"][0].tolist()
    assert all(lp < 0 for lp, k in zip(logprobs[:n], mask[:n]) if k) and not any(logprobs[len(r1):len(r1) + len(tail)])
    assert out.batch["rm_scores"][0].tolist()[n - 1] == 1.0  # the agent's reward, on the last response token
    assert out.non_tensor_batch["openai_divergences"][0] == 0 and out.non_tensor_batch["__num_turns__"][0] == 4
    # routing replay: every turn asked for its experts; verl holds them at the kept ids' positions, the rows a
    # /generate of the whole sequence returns (the last id has none)
    async with aiohttp.ClientSession() as s, s.post(engine.url + "/generate", json={
            "input_ids": p2, "return_routed_experts": True,
            "sampling_params": {"max_new_tokens": len(r2), "temperature": 0, "ignore_eos": True}}) as resp:
        whole = await resp.json()
    assert whole["output_ids"] == r2
    rows = np.frombuffer(base64.b64decode(whole["meta_info"]["routed_experts"]), dtype="<i4").reshape(-1, LAYERS, TOP_K)
    routed = out.batch["routed_experts"][0].numpy()
    start = PROMPT_LEN - len(p1)
    assert routed.shape == (PROMPT_LEN + RESPONSE_LEN, LAYERS, TOP_K) and len(rows) == len(p1) + n - 1
    assert (routed[start:start + len(rows)] == rows).all() and not routed[:start].any()
    status, ledger = await m.get("/v1/sessions")
    assert status == 200 and ledger["sessions"] == 0  # the loop read and freed its session
