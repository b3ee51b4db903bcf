"""Two holes a weight load must not leave (issue 39, item 4), on a CPU engine in this process whose prefix
cache records which weights computed each cached token, as SGLang 0.5.23's radix cache holds their KV:

- an ``in_place`` activation must leave no KV of the old weights for a later request to read (it never
  flushed: every request after it that shared a prefix with one before read the old weights' KV);
- the drain path's full load (``/commit``) must not let a request that reaches SGLang during the load run
  between two buckets on a half-loaded model (it loaded unpaused)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import torch
from aiohttp.test_utils import TestServer
from support import async_wait_until, free_port

from rollout_manager.cpu_engine.engine import Engine, EngineConfig
from rollout_manager.cpu_engine.http_common import ENGINE_KEY
from rollout_manager.cpu_engine.model import build_model, fixed_threads, reference_generate
from rollout_manager.cpu_engine.server import create_app
from rollout_manager.weights import activation
from rollout_manager.weights.layout import HostBuffer, build_layout, stage, unpack
from rollout_manager.weights.protocol import ActivateRequest
from rollout_manager.weights.receiver import Receiver

PROMPT = [5, 17, 3, 99, 42, 7]


def new_weights() -> dict[str, torch.Tensor]:
    return {n: t.contiguous() for n, t in build_model(1).state_dict().items()}


async def generate(url: str, prompt: list[int], n: int) -> dict[str, Any]:
    body = {"input_ids": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}}
    async with aiohttp.ClientSession() as s, s.post(url + "/generate", json=body) as r:
        assert r.status == 200, await r.text()
        return dict(await r.json())


async def first_chunk(url: str, prompt: list[int], n: int, started: asyncio.Event) -> dict[str, Any]:
    """A greedy stream; ``started`` is set at its first token. Returns its last chunk."""
    body = {"input_ids": prompt, "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}}
    last: dict[str, Any] = {}
    async with aiohttp.ClientSession() as s, s.post(url + "/generate", json=body) as r:
        async for raw in r.content:
            line = raw.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]":
                last = json.loads(line[5:])
                started.set()
    return last


async def get(url: str, path: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.get(url + path) as r:
        assert r.status == 200
        return dict(await r.json())


async def set_faults(url: str, **faults: Any) -> None:
    async with aiohttp.ClientSession() as s, s.post(url + "/debug/faults", json=faults) as r:
        assert r.status == 200, await r.text()


@pytest.fixture
async def box() -> AsyncIterator[tuple[str, Engine, Receiver]]:
    """A CPU engine (the default tiny model, seed 0) and a receiver agent holding ``new_weights()``."""
    server = TestServer(create_app(EngineConfig()), host="127.0.0.1", port=free_port())
    await server.start_server()
    url = str(server.make_url("")).rstrip("/")
    agent = Receiver("127.0.0.1", url, bucket_bytes=64 << 10)
    agent.loader.session = aiohttp.ClientSession()
    state = new_weights()
    agent.layout = build_layout(state)
    agent.buffer = HostBuffer.for_layout(agent.layout)
    stage(state, agent.layout, agent.buffer.array)
    try:
        yield url, server.app[ENGINE_KEY], agent
    finally:
        await agent.loader.session.close()
        await server.close()


async def test_an_in_place_activation_leaves_no_kv_of_the_old_weights_for_later_requests(box) -> None:
    """Fails before the fix: nothing flushed after an in_place load, so both later requests read the KV the
    old weights made (``stale_reads`` 2)."""
    url, engine, agent = box
    await generate(url, PROMPT[::-1], 4)  # finished before the activation: its prefix stays cached
    await set_faults(url, token_delay_s=0.02)
    started = asyncio.Event()
    in_flight = asyncio.create_task(first_chunk(url, PROMPT, 60, started))
    await asyncio.wait_for(started.wait(), 30)
    assert agent.layout is not None and agent.buffer is not None
    answer = await activation.activate(agent.loader, activation.Staged(1, agent.layout, agent.buffer),
                                       ActivateRequest(version=1, mode="in_place"))
    assert answer.mode == "in_place" and engine.weight_version == "1"
    await set_faults(url, token_delay_s=0.0)
    later = await asyncio.gather(generate(url, PROMPT, 4), generate(url, PROMPT[::-1], 4))
    done = await asyncio.wait_for(in_flight, 60)
    assert done["meta_info"]["finish_reason"]["type"] == "length" and len(done["output_ids"]) == 60
    assert [r["meta_info"]["weight_version"] for r in later] == ["1", "1"]
    assert (await get(url, "/debug/prefix_cache"))["stale_reads"] == 0


async def test_an_in_place_activation_of_an_idle_box_flushes_without_retracting(box) -> None:
    url, engine, agent = box
    await generate(url, PROMPT, 4)
    assert agent.layout is not None and agent.buffer is not None
    await activation.activate(agent.loader, activation.Staged(1, agent.layout, agent.buffer),
                              ActivateRequest(version=1, mode="in_place"))
    await generate(url, PROMPT, 4)
    cache = await get(url, "/debug/prefix_cache")
    assert cache["stale_reads"] == 0 and cache["flushes"] == 1


async def test_a_request_that_reaches_the_box_during_a_full_load_runs_on_the_whole_new_model(box) -> None:
    """Fails before the fix: ``/commit`` loaded unpaused, so the request ran between two buckets (on the
    first bucket's tensors and the old rest) and carried the old version."""
    url, engine, agent = box
    assert agent.layout is not None and agent.buffer is not None
    await set_faults(url, load_delay_s=0.2)
    named = unpack(agent.buffer, agent.layout)
    load = asyncio.create_task(agent.loader.commit(agent.layout, named, 1))
    await async_wait_until(lambda: engine.faults.loading, timeout_s=30)
    out = await generate(url, PROMPT, 8)  # arrives while the first bucket loads
    buckets = await load
    assert buckets > 1
    model = build_model(0)
    model.load_named_tensors(new_weights().items())
    with fixed_threads():
        expected = reference_generate(model, PROMPT, 8)[0]
    assert out["meta_info"]["weight_version"] == "1" and out["output_ids"] == expected
    assert not engine.paused  # generation continues after the load


async def test_a_full_load_that_fails_continues_generation(box) -> None:
    url, engine, agent = box
    assert agent.layout is not None and agent.buffer is not None
    await set_faults(url, load_fail=True)
    with pytest.raises(Exception, match="load_fail"):
        await agent.loader.commit(agent.layout, unpack(agent.buffer, agent.layout), 1)
    assert not engine.paused
    await set_faults(url, load_fail=False)
    assert (await generate(url, PROMPT, 2))["meta_info"]["finish_reason"]["type"] == "length"
