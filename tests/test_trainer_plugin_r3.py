"""verl's rollout routing replay (R3) through the plugin: the experts every sample gets, and the refusals.

The unit tests hold the decode (SGLang's base64 int32 to verl's ``(-1, layers, top_k)`` array), the fleet
check and the proxy's answers against a scripted manager. The end-to-end tests run a real manager with
MoE CPU engines (``--num-experts 8 --num-experts-per-tok 2 [--enable-return-routed-experts]``, the
conftest.py fixtures): every sample's experts equal what the engine gives directly, and a fleet started
without the flag fails at start, saying which flag is missing.
"""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import logging
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace
from typing import Any

import aiohttp
import numpy as np
import pytest
from aiohttp import web
from support import async_wait_until, free_port
from test_verl_v1_streaming import MISSING as V1_MISSING
from test_verl_v1_streaming import (
    QUESTIONS,
    RESPONSE_LEN,
    N,
    compose_config,
    expected_prompt_ids,
    local_ray,  # noqa: F401 - the fixture, reused
    prompt_batch,
    prompt_statuses,
    write_tiny_model,
)

from trainer_plugin.proxy import ManagerProxyServer, build_generate_body, token_output_fields
from trainer_plugin.routed_experts import (
    ExpertsLayout,
    FleetExperts,
    RoutedExpertsUnavailable,
    decode_routed_experts,
    refusal_error,
    require_routed_experts,
)

needs_verl = pytest.mark.skipif(importlib.util.find_spec("verl") is None, reason="verl 0.9.1 is not installed")
pytestmark = [pytest.mark.filterwarnings("ignore:Ray state API is no longer experimental:DeprecationWarning")]
LAYERS, TOP_K, EXPERTS = 2, 2, 8
LAYOUT = ExpertsLayout(LAYERS, TOP_K)
MOE_FLAGS = ["--num-experts", str(EXPERTS), "--num-experts-per-tok", str(TOP_K)]
R3_FLAG = "--enable-return-routed-experts"
MISSING = r"--enable-return-routed-experts.*enable_rollout_routing_replay=false"


def encode(rows: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(rows, dtype="<i4").tobytes()).decode()


def routes(rows: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, EXPERTS, (rows, LAYERS, TOP_K), dtype=np.int32)


def instance(endpoint: str, routed_experts: bool | None, state: str = "active") -> dict[str, Any]:
    return {"endpoint": endpoint, "state": state, "routed_experts": routed_experts}


# ---------------------------------------------------------------- decode and layout


def test_decode_gives_verls_array_and_refuses_what_would_misalign() -> None:
    want = routes(7)
    got = decode_routed_experts(encode(want), LAYOUT, rows=7, rid="r")
    assert got.dtype == np.int32 and got.shape == (7, LAYERS, TOP_K) and (got == want).all()
    assert decode_routed_experts("", LAYOUT, rows=0).shape == (0, LAYERS, TOP_K)
    with pytest.raises(ValueError, match=r"request r: .* 112 bytes, expected 8 rows of 2 layers x 2 experts"):
        decode_routed_experts(encode(want), LAYOUT, rows=8, rid="r")
    with pytest.raises(ValueError, match="not base64"):
        decode_routed_experts("@@@", LAYOUT, rows=1)
    with pytest.raises(RoutedExpertsUnavailable, match=r"request r: the answer carries no meta_info.routed_experts"):
        decode_routed_experts(None, LAYOUT, rows=1, rid="r")
    answer = {"output_ids": [], "meta_info": {"routed_experts": [[1, 2]]}}
    with pytest.raises(ValueError, match="meta_info.routed_experts is list, not base64 text"):
        token_output_fields(answer, False, experts=LAYOUT)


def test_layout_is_read_from_the_model_as_verls_sglang_server_reads_it() -> None:
    hf = SimpleNamespace(num_hidden_layers=48, num_experts_per_tok=8)
    assert ExpertsLayout.of_model(SimpleNamespace(hf_config=hf)) == ExpertsLayout(48, 8)
    for model in (None, SimpleNamespace(hf_config=SimpleNamespace(num_hidden_layers=2))):
        with pytest.raises(AttributeError, match="enable_rollout_routing_replay=true needs a MoE model"):
            ExpertsLayout.of_model(model)


def test_bodies_ask_for_experts_and_answers_hand_them_to_verl() -> None:
    body = build_generate_body([1, 2, 3], {}, "r", prompt_length=8, response_length=4, return_routed_experts=True)
    assert body["return_routed_experts"] is True and "routed_experts_start_len" not in body  # from position 0
    assert "return_routed_experts" not in build_generate_body([1], {}, "r", prompt_length=8, response_length=4)
    answer = {"output_ids": [7, 8], "meta_info": {"id": "r", "finish_reason": {"type": "length"},
                                                  "routed_experts": encode(routes(4))}}
    fields = token_output_fields(answer, False, experts=LAYOUT, prompt_len=3)  # 3 + 2 - 1 rows
    assert (fields["routed_experts"] == routes(4)).all()
    assert "routed_experts" not in token_output_fields(answer, False)  # replay off: nothing extra for verl
    with pytest.raises(ValueError, match="expected 5 rows"):
        token_output_fields(answer, False, experts=LAYOUT, prompt_len=4)


# ---------------------------------------------------------------- the fleet


def test_the_fleet_check_fails_only_when_no_instance_can_return_experts(caplog: pytest.LogCaptureFixture) -> None:
    none_can = FleetExperts.from_status({"instances": [instance("a:1", False), instance("b:2", False),
                                                       instance("c:3", True, state="dead")]})
    assert none_can == FleetExperts((), ("a:1", "b:2"), ())
    with pytest.raises(RoutedExpertsUnavailable, match=r"no instance of the rollout manager at http://m .* "
                       r"\(started without --enable-return-routed-experts: a:1, b:2\)") as err:
        require_routed_experts(none_can, "http://m")
    assert "enable_rollout_routing_replay=false" in str(err.value)
    # still starting (not said yet), nobody registered yet, or an older manager: the requests will tell
    for status in ({"instances": [instance("a:1", False), instance("b:2", None)]}, {"instances": []},
                   {"instances": [{"endpoint": "a:1", "state": "active", "streaming": "incremental"}]}):
        require_routed_experts(FleetExperts.from_status(status), "http://m")
    with caplog.at_level(logging.WARNING, logger="trainer_plugin.routed_experts"):
        require_routed_experts(FleetExperts.from_status({"instances": [instance("a:1", False),
                                                                       instance("b:2", True)]}), "http://m")
    assert "started without --enable-return-routed-experts serve no replay requests: a:1" in caplog.text


def test_a_refusal_naming_the_field_becomes_the_replay_error() -> None:
    text = "no registered instance can return routed experts (return_routed_experts)"
    for status in (400, 409, 503):
        err = refusal_error(status, text)
        assert isinstance(err, RoutedExpertsUnavailable) and str(status) in str(err) and R3_FLAG in str(err)
    assert refusal_error(500, text) is None and refusal_error(503, "no instance available") is None


# ---------------------------------------------------------------- the proxy against a scripted manager


class ScriptedManager:
    """``/get_instances_status`` and ``/generate`` answered by the test; counts the calls."""

    def __init__(self, status: dict[str, Any], generate: Callable[[dict[str, Any]], web.Response]):
        self.status, self.answer = status, generate
        self.status_calls = 0
        self.bodies: list[dict[str, Any]] = []

    async def _status(self, request: web.Request) -> web.Response:
        self.status_calls += 1
        return web.json_response(self.status)

    async def _generate(self, request: web.Request) -> web.Response:
        self.bodies.append(await request.json())
        return self.answer(self.bodies[-1])


@pytest.fixture
async def scripted() -> AsyncIterator[Callable[..., Any]]:
    runners: list[web.AppRunner] = []
    servers: list[ManagerProxyServer] = []

    async def start(status: dict[str, Any], answer: Callable[[dict[str, Any]], web.Response]
                    ) -> tuple[ScriptedManager, ManagerProxyServer]:
        manager = ScriptedManager(status, answer)
        app = web.Application()
        app.router.add_get("/get_instances_status", manager._status)
        app.router.add_post("/generate", manager._generate)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        server = ManagerProxyServer(f"http://127.0.0.1:{port}", prompt_length=8, response_length=4,
                                    batch_window_s=0, routed_experts=LAYOUT, client_options={"retries": 0})
        servers.append(server)
        return manager, server

    yield start
    for server in servers:
        await server.close()
    for runner in runners:
        await runner.cleanup()


def answer_with_experts(body: dict[str, Any]) -> web.Response:
    rows = len(body["input_ids"]) + 2 - 1
    return web.json_response({"output_ids": [5, 6], "meta_info": {
        "id": body.get("rid"), "finish_reason": {"type": "length"}, "weight_version": "0",
        "routed_experts": encode(routes(rows, seed=len(body["input_ids"])))}})


@needs_verl
async def test_the_proxy_checks_the_fleet_once_then_hands_verl_each_samples_experts(scripted: Any) -> None:
    manager, server = await scripted({"instances": [instance("a:1", None)]}, answer_with_experts)
    outs = await asyncio.gather(*(server.generate(list(range(1, n + 1)), {}, f"r{n}") for n in (1, 2, 3, 4)))
    assert manager.status_calls == 1  # one look shared by the first replay requests
    assert all(body["return_routed_experts"] is True for body in manager.bodies)
    for n, out in zip((1, 2, 3, 4), outs):
        assert out.token_ids == [5, 6] and (out.routed_experts == routes(n + 1, seed=n)).all()
    await server.generate([1], {}, "again")
    assert manager.status_calls == 1


@needs_verl
async def test_the_proxy_refuses_a_fleet_without_experts_before_any_request(scripted: Any) -> None:
    manager, server = await scripted({"instances": [instance("a:1", False)]}, answer_with_experts)
    for _ in range(2):  # the verdict stands for every later request
        with pytest.raises(RoutedExpertsUnavailable, match=MISSING):
            await server.generate([1, 2], {}, "r")
    assert manager.bodies == []


@needs_verl
async def test_the_proxy_turns_a_refusal_or_a_missing_field_into_the_replay_error(scripted: Any) -> None:
    def refuse(body: dict[str, Any]) -> web.Response:
        return web.json_response({"error": "no registered instance can serve return_routed_experts"}, status=503)

    def without(body: dict[str, Any]) -> web.Response:
        return web.json_response({"output_ids": [5], "meta_info": {"finish_reason": {"type": "length"}}})

    for answer, match in ((refuse, r"refused the request \(503: no registered instance"),
                          (without, r"carries no meta_info.routed_experts")):
        _, server = await scripted({"instances": []}, answer)
        with pytest.raises(RoutedExpertsUnavailable, match=match) as err:
            await server.generate([1, 2], {}, "r")
        assert R3_FLAG in str(err.value)


@needs_verl
async def test_replay_on_a_dense_model_config_is_refused_when_the_replica_is_built() -> None:
    from verl.workers.config import RolloutConfig

    from trainer_plugin.verl_rollout import DisaggregatedReplica

    config = RolloutConfig(name="sglang-disaggregated", enable_rollout_routing_replay=True)
    dense = SimpleNamespace(hf_config=SimpleNamespace(num_hidden_layers=2), lora={}, lora_rank=0)
    with pytest.raises(AttributeError, match="needs a MoE model"):
        DisaggregatedReplica(replica_rank=0, config=config, model_config=dense, gpus_per_node=1)
    moe = SimpleNamespace(hf_config=SimpleNamespace(num_hidden_layers=2, num_experts_per_tok=2), lora={}, lora_rank=0)
    replica = DisaggregatedReplica(replica_rank=0, config=config, model_config=moe, gpus_per_node=1)
    assert replica.routed_experts == ExpertsLayout(2, 2)


# ---------------------------------------------------------------- end to end: a manager and MoE CPU engines


async def direct(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with session.post(url + "/generate", json=body) as r:
        assert r.status == 200, await r.text()
        return dict(await r.json())


PROMPTS = [[11 + i, 22, 33 + 2 * i, 44][: 2 + i % 3] + [5] * (i % 4) for i in range(8)]
GREEDY = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "logprobs": True}


async def samples_through_the_proxy(m: Any, engines: list[Any]) -> list[Any]:
    """PROMPTS greedy through the proxy with replay on, all at once (coalesced into batch requests)."""
    server = ManagerProxyServer(m.url, prompt_length=16, response_length=6, routed_experts=LAYOUT)
    try:
        fleet = await server.check_routed_experts()
        assert sorted(fleet.capable) == sorted(e.endpoint for e in engines) and not fleet.incapable
        outs = await asyncio.gather(*(server.generate(p, dict(GREEDY), f"s{i}") for i, p in enumerate(PROMPTS)))
    finally:
        await server.close()
    assert server.batching_stats()["batches"] < len(PROMPTS)
    return outs


async def assert_the_engines_experts(outs: list[Any], engine: Any) -> None:
    """Each sample's tokens and experts equal ``engine``'s own greedy answer (every engine is seed 0)."""
    async with aiohttp.ClientSession() as session:
        for prompt, out in zip(PROMPTS, outs):
            assert len(out.token_ids) == 6 and out.routed_experts.shape == (len(prompt) + 6 - 1, LAYERS, TOP_K)
            assert ((out.routed_experts >= 0) & (out.routed_experts < EXPERTS)).all()
            body = {"input_ids": prompt, "return_routed_experts": True,
                    "sampling_params": {"max_new_tokens": 6, "temperature": 0.0}}
            own = await direct(session, engine.url, body)
            assert own["output_ids"] == out.token_ids
            want = decode_routed_experts(own["meta_info"]["routed_experts"], LAYOUT, rows=len(prompt) + 5)
            assert (out.routed_experts == want).all()


@pytest.mark.slow
@needs_verl
async def test_every_sample_gets_the_experts_the_engine_chose(start_manager: Any, start_engines: Any) -> None:
    m = await start_manager()
    engines = await start_engines([*MOE_FLAGS, R3_FLAG], [*MOE_FLAGS, R3_FLAG])
    await m.register(*engines)
    await assert_the_engines_experts(await samples_through_the_proxy(m, engines), engines[0])


@pytest.mark.slow
@needs_verl
async def test_samples_continued_on_another_box_keep_the_experts_of_an_uninterrupted_run(
        start_manager: Any, start_engines: Any) -> None:
    m = await start_manager()
    slow = ["--token-delay-s", "0.01"]
    engines = await start_engines([*MOE_FLAGS, R3_FLAG, *slow, "--die-after-tokens", "7"],
                                  [*MOE_FLAGS, R3_FLAG, *slow])
    await m.register(*engines)
    outs = await samples_through_the_proxy(m, engines)
    assert await asyncio.to_thread(engines[0].proc.wait, 10) != 0  # it died mid-step...
    assert any(len(out.extra_fields["segments"]) > 1 for out in outs)  # ...and its sequences went on elsewhere
    await assert_the_engines_experts(outs, engines[1])


@pytest.mark.slow
@needs_verl
async def test_a_fleet_started_without_the_flag_fails_at_start(start_manager: Any, start_engines: Any) -> None:
    m = await start_manager()
    engines = await start_engines(MOE_FLAGS, MOE_FLAGS)
    await m.register(*engines)
    server = ManagerProxyServer(m.url, prompt_length=16, response_length=6, routed_experts=LAYOUT)
    try:
        with pytest.raises(RoutedExpertsUnavailable, match=MISSING) as err:
            await server.check_routed_experts()
        for e in engines:
            assert e.endpoint in str(err.value)
        with pytest.raises(RoutedExpertsUnavailable, match=MISSING):
            await server.generate([1, 2, 3], {"temperature": 0.0}, "r")
        dense = ManagerProxyServer(m.url, prompt_length=16, response_length=6)  # replay off: served as ever
        try:
            assert (await dense.generate([1, 2, 3], {"temperature": 0.0}, "r")).routed_experts is None
        finally:
            await dense.close()
    finally:
        await server.close()


# ---------------------------------------------------------------- end to end: verl's own agent loops


def write_tiny_moe_model(path: Any, vocab_size: int) -> Any:
    """test_verl_v1_streaming's character-level model directory, its config a Qwen3-MoE of the engines' shape."""
    from transformers import Qwen3MoeConfig

    write_tiny_model(path, vocab_size)
    Qwen3MoeConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                   num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=4, num_experts=EXPERTS,
                   num_experts_per_tok=TOP_K, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
                   pad_token_id=0, architectures=["Qwen3MoeForCausalLM"]).save_pretrained(path)
    return path


@pytest.mark.slow
@pytest.mark.skipif(bool(V1_MISSING), reason=f"verl 0.9.1's V1 trainer path needs {', '.join(V1_MISSING)}")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore::UserWarning")
async def test_verls_agent_loops_replay_the_engines_experts_and_refuse_a_fleet_without_them(
        start_manager: Any, start_engines: Any, local_ray: Any, tmp_path: Any) -> None:  # noqa: F811
    """verl's V1 path as tests/test_verl_v1_streaming.py runs it, with ``enable_rollout_routing_replay``."""
    import torch
    import transfer_queue as tq
    from verl.trainer.ppo.v1 import AgentLoopManagerTQ
    from verl.workers.rollout.llm_server import LLMServerManager

    import trainer_plugin.verl_registration  # noqa: F401 - what verl's plugin entry point loads on `import verl`
    from rollout_manager.cpu_engine.model import build_model, reference_generate

    model = build_model(0, num_experts=EXPERTS, num_experts_per_tok=TOP_K)
    port = free_port()
    config = compose_config(write_tiny_moe_model(tmp_path / "tiny-moe", model.config.vocab_size), port)
    config.actor_rollout_ref.rollout.enable_rollout_routing_replay = True
    m = await start_manager(port=port)
    dense_fleet = await start_engines(MOE_FLAGS, MOE_FLAGS)  # MoE, but started without the flag
    await m.register(*dense_fleet)
    await asyncio.to_thread(local_ray, config)

    def setup() -> tuple[Any, Any]:
        actor_wg = SimpleNamespace(world_size=config.trainer.n_gpus_per_node, workers=[])
        servers = LLMServerManager.create(config=config, worker_group=actor_wg)
        agents = AgentLoopManagerTQ.create(config=config, llm_client=servers.get_client(), teacher_client=None,
                                           reward_loop_worker_handles=None)
        return servers, agents

    with pytest.raises(Exception, match=MISSING) as err:  # at start, before any prompt
        await asyncio.to_thread(setup)
    assert all(e.endpoint in str(err.value) for e in dense_fleet)

    status, answer = await m.post("/shutdown_instances", {"endpoints": [e.endpoint for e in dense_fleet]})
    assert status == 200, answer
    await m.register(*await start_engines([*MOE_FLAGS, R3_FLAG], [*MOE_FLAGS, R3_FLAG]))
    _, agents = await asyncio.to_thread(setup)

    batch = prompt_batch(1)
    uids = list(batch["uid"])
    tq.kv_batch_put(keys=uids, partition_id="train",
                    tags=[{"is_prompt": True, "status": "pending", "global_steps": 1} for _ in uids])
    await asyncio.to_thread(agents.generate_sequences, batch)

    async def all_finished() -> bool:
        statuses = await asyncio.to_thread(prompt_statuses)
        assert "failure" not in statuses.values(), statuses  # see the AgentLoopWorkerTQ log above
        return sum(s == "finished" for s in statuses.values()) == len(uids)

    await async_wait_until(all_finished, timeout_s=60, interval_s=0.05, message="every group finished")
    keys = [f"{u}_{s}_0" for u in uids for s in range(N)]
    data = await asyncio.to_thread(tq.kv_batch_get, keys=keys, partition_id="train")
    for row, key in enumerate(keys):
        prompt = expected_prompt_ids(QUESTIONS[uids.index(key.split("_")[0])])
        ref_ids, _ = reference_generate(model, prompt, RESPONSE_LEN)
        assert data["responses"][row].tolist() == ref_ids
        got = data["routed_experts"][row]
        # verl's agent loop: int16, one row per prompt and response token, the last (never fed) zero
        assert got.dtype == torch.int16 and tuple(got.shape) == (len(prompt) + RESPONSE_LEN, LAYERS, TOP_K)
        routes = model.logits_and_routes(prompt + ref_ids[:-1])[1]
        assert routes is not None and (got[:-1] == routes.to(torch.int16)).all(), key
        assert not got[-1].any()
