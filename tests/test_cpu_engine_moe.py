"""The CPU engine's MoE layers and its answers to routed-expert replay (R3), in-process.

What SGLang does is measured in tests/test_real_sglang_moe.py; here the stand-in's own promises: the
format and alignment of ``meta_info.routed_experts``, its refusals, and that a token's experts depend only
on the tokens before it (whatever runs beside it, and across a continuation), which the manager's R3
continuation relies on.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer

from rollout_manager.cpu_engine.engine import EngineConfig
from rollout_manager.cpu_engine.model import build_model
from rollout_manager.cpu_engine.server import create_app

EXPERTS, TOP_K, LAYERS = 8, 2, 2
MOE = {"num_experts": EXPERTS, "num_experts_per_tok": TOP_K}
PROMPT = [11, 22, 33, 44, 55]


def greedy(n: int) -> dict[str, Any]:
    return {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}


def experts(meta: dict[str, Any]) -> np.ndarray:
    """``meta_info.routed_experts`` decoded: base64 of little-endian int32 ``[rows, layers, top_k]``."""
    return np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype="<i4").reshape(-1, LAYERS, TOP_K)


async def _client(**config: Any) -> TestClient:
    client = TestClient(TestServer(create_app(EngineConfig(seed=0, model_overrides=MOE, **config))))
    await client.start_server()
    return client


@pytest.fixture
async def r3() -> AsyncIterator[TestClient]:
    client = await _client(enable_return_routed_experts=True)
    try:
        yield client
    finally:
        await client.close()


async def generate(client: TestClient, body: dict[str, Any]) -> tuple[int, Any]:
    async with client.post("/generate", json=body) as r:
        return r.status, await r.json()


async def stream(client: TestClient, body: dict[str, Any]) -> list[dict[str, Any]]:
    async with client.post("/generate", json={**body, "stream": True}) as r:
        raw = (await r.read()).decode()
    return [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]


def test_a_moe_model_names_its_experts_as_hugging_face_qwen3_moe_and_routes_every_token() -> None:
    model = build_model(0, **MOE)
    names = set(model.named_tensors())
    assert "model.layers.1.mlp.gate.weight" in names and "model.layers.0.mlp.experts.7.down_proj.weight" in names
    assert not any(".mlp.gate_proj." in n for n in names)  # no dense MLP left
    logits, routes = model.logits_and_routes(PROMPT)
    assert routes is not None and tuple(routes.shape) == (len(PROMPT), LAYERS, TOP_K)
    assert ((routes >= 0) & (routes < EXPERTS)).all()
    assert all(len(set(row.tolist())) == TOP_K for row in routes.reshape(-1, TOP_K))  # k distinct experts
    assert len({tuple(r.flatten().tolist()) for r in routes}) > 1  # tokens do go to different experts
    assert build_model(0).logits_and_routes(PROMPT)[1] is None  # a dense model routes nothing


async def test_routed_experts_cover_every_token_but_the_last_on_the_final_output_only(r3: TestClient) -> None:
    body = {"input_ids": PROMPT, "sampling_params": greedy(4), "return_routed_experts": True}
    status, out = await generate(r3, body)
    assert status == 200
    whole = experts(out["meta_info"])
    assert whole.shape == (len(PROMPT) + 4 - 1, LAYERS, TOP_K)
    assert ((whole >= 0) & (whole < EXPERTS)).all()
    frames = await stream(r3, body)
    assert [("routed_experts" in f["meta_info"]) for f in frames] == [False] * (len(frames) - 1) + [True]
    assert (experts(frames[-1]["meta_info"]) == whole).all()
    # start_len: positions [start, seqlen - 1); at the prompt length, only the generated tokens but the last
    for start in (3, len(PROMPT)):
        status, out = await generate(r3, {**body, "routed_experts_start_len": start})
        assert (experts(out["meta_info"]) == whole[start:]).all()
    status, out = await generate(r3, {**body, "sampling_params": greedy(0)})  # prefilled all the same
    assert out["output_ids"] == [] and (experts(out["meta_info"]) == whole[:len(PROMPT) - 1]).all()
    status, out = await generate(r3, {**body, "sampling_params": greedy(1), "routed_experts_start_len": 5})
    assert out["meta_info"]["routed_experts"] == ""


async def test_a_tokens_experts_do_not_depend_on_its_neighbours_nor_on_a_continuation(r3: TestClient) -> None:
    body = {"input_ids": PROMPT, "sampling_params": greedy(6), "return_routed_experts": True}
    alone = await generate(r3, body)
    others = [{"input_ids": [7] * n, "sampling_params": greedy(9), "return_routed_experts": True} for n in (3, 40)]
    beside = await asyncio.gather(generate(r3, body), *(generate(r3, o) for o in others))
    assert beside[0][0] == 200 and (experts(beside[0][1]["meta_info"]) == experts(alone[1]["meta_info"])).all()
    # continued after 2 tokens elsewhere: ask only for the new positions (the last prompt token on)
    made = alone[1]["output_ids"]
    tail = {"input_ids": PROMPT + made[:2], "sampling_params": greedy(4), "return_routed_experts": True,
            "routed_experts_start_len": len(PROMPT) + 1}
    status, cont = await generate(r3, tail)
    assert cont["output_ids"] == made[2:]
    assert (experts(cont["meta_info"]) == experts(alone[1]["meta_info"])[len(PROMPT) + 1:]).all()


async def test_refusals_are_sglangs(r3: TestClient) -> None:
    body = {"input_ids": PROMPT, "sampling_params": greedy(2), "return_routed_experts": True}
    for start in (len(PROMPT) + 1, -1):  # the scheduler's check: an abort that carries 400
        status, out = await generate(r3, {**body, "routed_experts_start_len": start})
        assert status == 400 and "routed_experts_start_len" in out["error"]["message"]
        frames = await stream(r3, {**body, "routed_experts_start_len": start})
        finish = frames[-1]["meta_info"]["finish_reason"]
        assert finish["type"] == "abort" and finish["status_code"] == 400
    for bad in ([True], None, 2, "maybe"):  # FastAPI's model of the body
        status, out = await generate(r3, {**body, "return_routed_experts": bad})
        assert status == 400 and out["object"] == "error" and "return_routed_experts" in out["message"]
    status, out = await generate(r3, {**body, "routed_experts_start_len": None})
    assert status == 400 and out["object"] == "error"
    status, out = await generate(r3, {**body, "routed_experts_start_len": "2"})  # pydantic reads it; the contract not
    assert status == 400 and isinstance(out["error"], str)
    status, out = await generate(r3, {**body, "return_routed_experts": "yes"})  # pydantic reads it as true
    assert status == 200 and "routed_experts" in out["meta_info"]
    batch = {**body, "input_ids": [PROMPT, PROMPT[:2]], "routed_experts_start_len": 3}  # one start for all items
    status, out = await generate(r3, batch)
    assert status == 400


async def test_without_the_flag_the_request_is_answered_without_experts() -> None:
    client = await _client()
    try:
        body = {"input_ids": PROMPT, "sampling_params": greedy(2), "return_routed_experts": True}
        status, out = await generate(client, body)
        assert status == 200 and "routed_experts" not in out["meta_info"]
        assert "routed_experts" not in (await stream(client, body))[-1]["meta_info"]
        status, out = await generate(client, {**body, "routed_experts_start_len": 9})  # still checked
        assert status == 400
        async with client.get("/server_info") as r:
            assert (await r.json())["enable_return_routed_experts"] is False
    finally:
        await client.close()


def test_the_flag_needs_a_moe_model() -> None:
    from rollout_manager.cpu_engine.engine import Engine

    with pytest.raises(ValueError, match="MoE"):
        Engine(EngineConfig(enable_return_routed_experts=True))
