"""Staged activation on real SGLang 0.5.23 (CPU): a version is pushed into the receiver agent and verified while a
long greedy sequence streams from SGLang, then activated (pause in ``retract`` mode, load, version, continue).
The stream never aborts and every token arrives; its chunks after the swap carry the new weight_version; the
tokens before the swap are the old weights' greedy tokens and the tokens after it equal a float32
``transformers`` forward of the new weights continuing from the same prefix."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from real_sglang import RealSGLang
from safetensors.torch import load_file
from support import async_wait_until, free_port
from test_real_sglang_pushes import perturbed, transformers_greedy

from rollout_manager.weights.agent_client import AgentClient
from rollout_manager.weights.protocol import ActivateRequest, CommitRequest, PrepareRequest, PushRequest
from rollout_manager.weights.sender_agent import SenderAgent

pytestmark = [pytest.mark.real_sglang, pytest.mark.slow]

PROMPT = [5, 6, 7, 8]
N = 1000  # the tiny model's context is 1,024
VERSION = 7


async def stream(url: str, seen: list[dict[str, Any]]) -> None:
    body = {"input_ids": PROMPT, "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": N, "ignore_eos": True}}
    async with aiohttp.ClientSession() as s, s.post(url + "/generate", json=body) as r:
        assert r.status == 200, await r.text()
        async for raw in r.content:
            line = raw.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]":
                seen.append(json.loads(line[5:]))


async def test_a_stream_crossing_a_staged_activation_keeps_every_token_under_the_new_weights(
        real_sglang: RealSGLang) -> None:
    box, model_dir = real_sglang.box, real_sglang.model_dir
    checkpoint = load_file(str(model_dir / "model.safetensors"))
    new = perturbed(checkpoint, seed=VERSION)
    port = free_port()
    sender = SenderAgent(["127.0.0.1"], port).start()
    sender_url = f"http://127.0.0.1:{port}"
    try:
        await asyncio.to_thread(sender.stage, new, VERSION)  # the trainer side, before the stream starts
        seen: list[dict[str, Any]] = []
        task = asyncio.create_task(stream(box.url, seen))
        await async_wait_until(lambda: seen or task.done(), timeout_s=60, message="the stream to start")
        async with aiohttp.ClientSession() as session:
            agents = AgentClient(session, None, 120)
            layout = await agents.layout(sender_url, 0)
            prep = await agents.prepare(box.agent_url, PrepareRequest(version=VERSION, layout=layout.layout,
                                                                      transport="tcp"))
            push = await agents.push(sender_url, 0, PushRequest(
                version=VERSION, ip="127.0.0.1", num_engines=1, session_ids=prep.session_ids,
                buffer_addr=prep.buffer_addr, transport="tcp"))
            staged = await agents.commit(box.agent_url, CommitRequest(
                version=VERSION, fingerprint=push.fingerprint, shards=push.shards, checksums=push.checksums,
                stage=True))
            assert staged.staged and not task.done(), "the sequence ended before the version was staged"
            done = await agents.activate(box.agent_url, ActivateRequest(version=VERSION))
        await asyncio.wait_for(task, 300)
    finally:
        sender.stop()

    assert done.mode == "retract" and done.reloaded == len(new) and done.paused_s < 30
    final = seen[-1]["meta_info"]
    assert final["finish_reason"]["type"] == "length" and final["completion_tokens"] == N  # never aborted
    versions = [c["meta_info"]["weight_version"] for c in seen]
    swap = versions.index(str(VERSION))
    assert 0 < swap and all(v == str(VERSION) for v in versions[swap:]), versions
    out = [t for c in seen for t in c["output_ids"]] if len(seen[-1]["output_ids"]) < N else seen[-1]["output_ids"]
    assert len(out) == N
    spans = final["weight_versions"]
    assert [s["version"] for s in spans][-1] == str(VERSION) and len(spans) == 2, spans
    k = spans[1]["start"]
    assert 0 < k < N and spans[1]["end"] == N
    assert out[:k] == transformers_greedy(model_dir, checkpoint, [PROMPT], k)[0]  # the old weights up to the swap
    after = transformers_greedy(model_dir, new, [PROMPT + out[:k]], N - k)[0]
    assert out[k:] == after  # the new weights, continuing from the same prefix
