"""Bounds from docs/bounds.md that no other test exercised: each is hit on purpose, and what the table
says happens, happens."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import pytest
import torch
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from support import free_port

from rollout_manager.weights.agent_client import AgentClient, PushFailed
from rollout_manager.weights.protocol import CommitRequest, PrepareRequest, PushRequest
from rollout_manager.weights.receiver import Receiver
from rollout_manager.weights.receiver_agent import create_app
from rollout_manager.weights.sender_agent import SenderAgent


def _weights() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(1024, dtype=torch.float32), "b": torch.ones(16, dtype=torch.bfloat16)}


async def test_an_engine_that_never_answers_a_weight_load_fails_the_commit_within_load_timeout_s(monkeypatch) -> None:
    """A broken SGLang that takes the load request and never answers: the receiver's call to it ends at
    ``load_timeout_s`` and the commit fails, rather than hold the push (and the box) for ever."""
    monkeypatch.delenv("ROLLOUT_MANAGER_AUTH_TOKEN", raising=False)
    never = asyncio.Event()

    async def update(request: web.Request) -> web.Response:
        await never.wait()
        return web.json_response({"success": True})

    async def server_info(request: web.Request) -> web.Response:
        return web.json_response({"tp_size": 1})

    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/update_weights_from_tensor", update)
    app.router.add_get("/server_info", server_info)
    sglang = TestServer(app, host="127.0.0.1")
    await sglang.start_server()
    receiver = Receiver("127.0.0.1", str(sglang.make_url("")).rstrip("/"), load_timeout_s=1.0)
    await receiver.start()
    rclient = TestClient(TestServer(create_app(receiver), host="127.0.0.1"))
    await rclient.start_server()
    port = free_port()
    sender = SenderAgent(["127.0.0.1"], port, auth_token="").start()
    session = aiohttp.ClientSession()
    try:
        sender.stage(_weights(), version=1)
        agents = AgentClient(session, None, 60.0)
        sender_url, receiver_url = f"http://127.0.0.1:{port}", str(rclient.make_url("")).rstrip("/")
        layout = await agents.layout(sender_url, 0)
        prep = await agents.prepare(receiver_url, PrepareRequest(version=1, layout=layout.layout, transport="tcp"))
        push = await agents.push(sender_url, 0, PushRequest(
            version=1, ip="127.0.0.1", num_engines=1, transport="tcp", session_ids=prep.session_ids,
            buffer_addr=prep.buffer_addr))
        t0 = time.monotonic()
        with pytest.raises(PushFailed):
            await asyncio.wait_for(agents.commit(receiver_url, CommitRequest(
                version=1, fingerprint=push.fingerprint, shards=push.shards, checksums=push.checksums)), 20)
        assert time.monotonic() - t0 < 10
    finally:
        never.set()
        await session.close()
        sender.stop()
        await rclient.close()
        await receiver.close()
        await sglang.close()


async def test_a_sender_agent_refuses_a_control_body_over_8_mib(monkeypatch) -> None:
    monkeypatch.delenv("ROLLOUT_MANAGER_AUTH_TOKEN", raising=False)
    port = free_port()
    sender = SenderAgent(["127.0.0.1"], port, auth_token="").start()
    try:
        async with aiohttp.ClientSession() as s, s.post(f"http://127.0.0.1:{port}/push",
                                                        data=b"x" * (9 << 20)) as r:
            assert r.status == 413
    finally:
        sender.stop()


@pytest.mark.slow
async def test_a_batch_of_more_than_100000_requests_is_refused_naming_the_cap(start_manager_shared) -> None:
    m = start_manager_shared
    items: list[Any] = [[k, {"input_ids": [1]}] for k in range(100_001)]
    async with m.session.post(m.url + "/batch_generate_requests", data=json.dumps(items)) as r:
        answer = await r.json(content_type=None)
    assert r.status == 400 and "100000" in answer["error"], answer
