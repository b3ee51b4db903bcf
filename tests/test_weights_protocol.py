"""The weight agents' typed control API: the models carry exactly what the agents send, and an agent
answers a bad body with 400 naming the field, changing nothing."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
import torch
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from support import free_port

from rollout_manager.sglang import wire
from rollout_manager.sglang.auth import SGLangAuth
from rollout_manager.sglang.weight_loader import LoadSettings
from rollout_manager.weights import activation
from rollout_manager.weights.agent_client import AgentClient, PushFailed, SenderUnavailable
from rollout_manager.weights.layout import WeightLayout, build_layout
from rollout_manager.weights.protocol import (
    ActivateRequest,
    BadBody,
    CommitAnswer,
    CommitRequest,
    LayoutAnswer,
    LayoutBody,
    PrepareAnswer,
    PrepareRequest,
    PushAnswer,
    PushRequest,
    parse_body,
)
from rollout_manager.weights.receiver import Receiver
from rollout_manager.weights.receiver_agent import create_app
from rollout_manager.weights.receiver_loader import Loader
from rollout_manager.weights.refused import CommitRefused
from rollout_manager.weights.sender_agent import SenderAgent


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"embed.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
            "layer.0.weight": torch.randn(32, 32, generator=g),
            "layer.0.bias": torch.randn(32, generator=g).to(torch.float16)}


def wire_round_trip(model: Any) -> Any:
    """What the other end gets: the model as JSON, parsed back with the same model."""
    return parse_body(json.dumps(model.model_dump()), type(model))


# ---------------------------------------------------------------- models alone


def test_layout_body_carries_a_real_layout_unchanged():
    layout = build_layout(weights(0))
    body = LayoutBody.model_validate(layout.to_dict())
    back = WeightLayout.from_dict(wire_round_trip(body).model_dump())
    assert back == layout and back.fingerprint() == layout.fingerprint()


def test_requests_and_answers_round_trip_through_json():
    layout = LayoutBody.model_validate(build_layout(weights(0)).to_dict())
    for model in [
        LayoutAnswer(version=3, layout=layout, fingerprint="f" * 64),
        LayoutAnswer(version=None, layout=layout, fingerprint="f" * 64),  # mid-restage
        PrepareRequest(version=3, layout=layout, transport="tcp"),
        PrepareAnswer(session_ids=["127.0.0.1:1234"], buffer_addr=1 << 40, buffer_bytes=4096, fingerprint="f"),
        PushRequest(version=3, ip="127.0.0.1", num_engines=2, session_ids=["127.0.0.1:1", "127.0.0.1:2"],
                    buffer_addr=1 << 40, transport="mooncake"),
        PushAnswer(version=3, bytes=4096, seconds=0.01, gbps=0.4, shards=[(0, 2048), (2048, 2048)],
                   checksums=["xxh3_64:1", "xxh3_64:2"], fingerprint="f"),
        PushAnswer(version=3, bytes=0, seconds=0.0, gbps=float("inf"), shards=[], checksums=[], fingerprint="f"),
        CommitRequest(version=3, fingerprint="f", shards=[(0, 4096)], checksums=["xxh3_64:1"]),
        CommitAnswer(ok=True, version=3, verify_s=0.001, load_s=0.2, buckets=1),
    ]:
        assert wire_round_trip(model) == model


GOOD_PUSH = {"version": 1, "ip": "127.0.0.1", "num_engines": 2, "session_ids": ["127.0.0.1:1"],
             "buffer_addr": 4096, "transport": "tcp"}
GOOD_COMMIT = {"version": 1, "fingerprint": "abc", "shards": [[0, 256]], "checksums": ["xxh3_64:0"]}


@pytest.mark.parametrize(("model", "body", "field"), [
    (PushRequest, {**GOOD_PUSH, "num_engines": 0}, "num_engines"),
    (PushRequest, {**GOOD_PUSH, "num_engines": True}, "num_engines"),
    (PushRequest, {**GOOD_PUSH, "version": "1"}, "version"),
    (PushRequest, {**GOOD_PUSH, "version": -1}, "version"),
    (PushRequest, {**GOOD_PUSH, "session_ids": []}, "session_ids"),
    (PushRequest, {**GOOD_PUSH, "session_ids": [7]}, "session_ids[0]"),
    (PushRequest, {**GOOD_PUSH, "transport": "rdma"}, "transport"),
    (PushRequest, {**GOOD_PUSH, "buffer_addr": -8}, "buffer_addr"),
    (PushRequest, {k: v for k, v in GOOD_PUSH.items() if k != "ip"}, "ip"),
    (PushRequest, {**GOOD_PUSH, "numengines": 2}, "numengines"),
    (CommitRequest, {**GOOD_COMMIT, "shards": [[0]]}, "shards[0][1]"),  # a pair needs its length
    (CommitRequest, {**GOOD_COMMIT, "shards": [[0, -1]]}, "shards[0][1]"),
    (CommitRequest, {**GOOD_COMMIT, "fingerprint": ""}, "fingerprint"),
    (PrepareRequest, {"version": 1, "layout": {"alignment": 0, "total_bytes": 0, "tensors": []}},
     "layout.alignment"),
    (PrepareRequest, {"version": 1, "layout": {"alignment": 256, "total_bytes": 4, "tensors": [{"name": "w"}]}},
     "layout.tensors[0].dtype"),
])
def test_bad_requests_are_refused_naming_the_field(model, body, field):
    with pytest.raises(BadBody, match=re.escape(f"field '{field}'")):
        parse_body(json.dumps(body), model)


def test_a_mistake_across_fields_is_refused_as_it_is():
    with pytest.raises(BadBody, match=r"^1 shards but 0 checksums$"):  # no made-up field name
        parse_body(json.dumps({**GOOD_COMMIT, "checksums": []}), CommitRequest)


@pytest.mark.parametrize(("raw", "message"), [(b"", "not JSON"), (b"{nope", "not JSON"), (b"[1, 2]", "an object")])
def test_a_body_that_is_not_a_json_object_is_refused(raw, message):
    with pytest.raises(BadBody, match=message):
        parse_body(raw, PushRequest)


# ---------------------------------------------------------------- the agents, in this process


@dataclass
class Rig:
    sender: SenderAgent
    sender_url: str
    receiver: Receiver
    receiver_client: TestClient
    receiver_url: str
    client: AgentClient
    loads: list[dict[str, Any]]  # bodies SGLang got on /update_weights_from_tensor
    versions: list[str]  # what /update_weight_version set, in order

    @property
    def sglang_version(self) -> str | None:
        return self.versions[-1] if self.versions else None


async def fake_sglang(loads: list[dict[str, Any]], versions: list[str]) -> web.Application:
    """What a load needs of SGLang: the tensors, a flush, the version set and reported."""
    async def update(request: web.Request) -> web.Response:
        loads.append(await request.json())
        return web.json_response({"success": True, "message": "ok"})

    async def flush(request: web.Request) -> web.Response:
        return web.Response(text="Cache flushed.")

    async def set_version(request: web.Request) -> web.Response:
        versions.append((await request.json())["new_version"])
        return web.json_response({"success": True, "message": "ok"})

    async def model_info(request: web.Request) -> web.Response:
        return web.json_response({"weight_version": versions[-1] if versions else "0"})

    async def server_info(request: web.Request) -> web.Response:
        return web.json_response({"tp_size": 1})

    async def pause_or_continue(request: web.Request) -> web.Response:  # a full load runs paused
        return web.json_response({"status": "ok"})

    app = web.Application(client_max_size=256 << 20)
    app.router.add_post(wire.UPDATE_WEIGHTS_FROM_TENSOR, update)
    app.router.add_get(wire.SERVER_INFO, server_info)
    app.router.add_post(wire.FLUSH_CACHE, flush)
    app.router.add_post(wire.UPDATE_WEIGHT_VERSION, set_version)
    app.router.add_get(wire.MODEL_INFO, model_info)
    app.router.add_post(wire.PAUSE_GENERATION, pause_or_continue)
    app.router.add_post(wire.CONTINUE_GENERATION, pause_or_continue)
    return app


@pytest.fixture
async def rig(monkeypatch) -> AsyncIterator[Rig]:
    monkeypatch.delenv("ROLLOUT_MANAGER_AUTH_TOKEN", raising=False)
    loads: list[dict[str, Any]] = []
    versions: list[str] = []
    sglang = TestServer(await fake_sglang(loads, versions), host="127.0.0.1")
    await sglang.start_server()
    receiver = Receiver("127.0.0.1", str(sglang.make_url("")))
    await receiver.start()
    receiver_client = TestClient(TestServer(create_app(receiver), host="127.0.0.1"))
    await receiver_client.start_server()
    port = free_port()
    sender = SenderAgent(["127.0.0.1"], port, auth_token="").start()
    sender.stage(weights(1), version=1)
    session = aiohttp.ClientSession()
    try:
        yield Rig(sender, f"http://127.0.0.1:{port}", receiver, receiver_client,
                  str(receiver_client.make_url("")).rstrip("/"), AgentClient(session, None, 60.0), loads, versions)
    finally:
        await session.close()
        sender.stop()
        await receiver_client.close()
        await receiver.close()
        await sglang.close()


async def push_once(rig: Rig, version: int) -> tuple[PushAnswer, CommitAnswer]:
    """One push as the manager's WeightSync._push does it, over TCP."""
    layout = await rig.client.layout(rig.sender_url, 0)
    assert layout.version == version
    prep = await rig.client.prepare(rig.receiver_url, PrepareRequest(version=version, layout=layout.layout,
                                                                     transport="tcp"))
    push = await rig.client.push(rig.sender_url, 0, PushRequest(
        version=version, ip="127.0.0.1", num_engines=2, transport="tcp", session_ids=prep.session_ids,
        buffer_addr=prep.buffer_addr))
    commit = await rig.client.commit(rig.receiver_url, CommitRequest(
        version=version, fingerprint=push.fingerprint, shards=push.shards, checksums=push.checksums))
    return push, commit


async def post(url: str, body: Any) -> tuple[int, dict[str, Any]]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with aiohttp.ClientSession() as s, s.post(url, data=data,
                                                    headers={"Content-Type": "application/json"}) as r:
        return r.status, await r.json()


async def test_a_push_through_the_typed_client_lands_and_loads(rig: Rig):
    push, commit = await push_once(rig, 1)
    layout = build_layout(weights(1))
    assert push.bytes == layout.total_bytes and push.fingerprint == layout.fingerprint()
    assert len(push.shards) == len(push.checksums) == 2
    assert commit.ok and commit.version == 1 and commit.buckets == len(rig.loads) == 1
    assert rig.sglang_version == "1" and rig.receiver.loader.version == 1


async def test_the_receiver_refuses_bad_bodies_naming_the_field_and_changes_nothing(rig: Rig):
    await push_once(rig, 1)
    before = rig.receiver.info()
    layout = (await rig.client.layout(rig.sender_url, 0)).layout.model_dump()
    overlapping = {**layout, "tensors": [{**t, "offset": 0} for t in layout["tensors"]]}
    cases = [
        ("/prepare", {"version": 2, "layout": layout, "transport": "udp"}, "field 'transport'"),
        ("/prepare", {"version": 2}, "field 'layout'"),
        ("/prepare", {"version": 2, "layout": overlapping}, "field 'layout'"),  # only WeightLayout sees it
        ("/prepare", {"version": 2, "layout": {**layout, "format": 9}}, "unsupported layout format"),
        ("/commit", {"version": 2, "fingerprint": "x", "shards": [[0, "256"]], "checksums": ["c"]},
         "field 'shards[0][1]'"),
        ("/commit", {"version": 2, "fingerprint": "x", "shards": [], "checksums": [], "extra": 1}, "field 'extra'"),
        ("/commit", b"not json", "not JSON"),
    ]
    for path, body, expected in cases:
        status, answer = await post(rig.receiver_url + path, body)
        assert status == 400, (path, body, answer)
        assert expected in answer["error"] and answer["error"].startswith(f"bad {path[1:]} body: "), answer
        assert rig.receiver.info() == before
    assert len(rig.loads) == 1  # nothing more reached SGLang

    rig.sender.stage(weights(2), version=2)  # the next good round still works
    _, commit = await push_once(rig, 2)
    assert commit.version == rig.receiver.loader.version == 2 and rig.sglang_version == "2"


async def test_the_sender_refuses_bad_bodies_naming_the_field(rig: Rig):
    prep = await rig.client.prepare(rig.receiver_url, PrepareRequest(
        version=1, layout=(await rig.client.layout(rig.sender_url, 0)).layout, transport="tcp"))
    good = {"version": 1, "ip": "127.0.0.1", "num_engines": 1, "session_ids": prep.session_ids,
            "buffer_addr": prep.buffer_addr, "transport": "tcp"}
    for body, expected in [({**good, "num_engines": 0}, "field 'num_engines'"),
                           ({**good, "session_ids": []}, "field 'session_ids'"),
                           ({**good, "transport": "rdma"}, "field 'transport'"),
                           ({k: v for k, v in good.items() if k != "buffer_addr"}, "field 'buffer_addr'"),
                           (b"{", "not JSON")]:
        status, answer = await post(rig.sender_url + "/push", body)
        assert status == 400 and expected in answer["error"], answer
        assert answer["error"].startswith("bad push body: ")

    # Refusals past the schema keep their status codes: not our interface (400), not staged (409).
    status, answer = await post(rig.sender_url + "/push", {**good, "ip": "127.0.0.9"})
    assert status == 400 and "not one of this sender's interfaces" in answer["error"]
    with pytest.raises(SenderUnavailable, match="version 7 is not staged"):
        await rig.client.push(rig.sender_url, 0, PushRequest.model_validate({**good, "version": 7}))

    status, answer = await post(rig.sender_url + "/push", good)  # and a good push still goes through
    assert status == 200, answer
    push = PushAnswer.model_validate(answer)
    commit = await rig.client.commit(rig.receiver_url, CommitRequest(
        version=1, fingerprint=push.fingerprint, shards=push.shards, checksums=push.checksums))
    assert commit.version == 1


async def test_the_client_treats_an_answer_that_does_not_fit_as_a_failed_push():
    async def wrong(request: web.Request) -> web.Response:
        return web.json_response({"session_ids": [], "buffer_addr": 1, "buffer_bytes": 1, "fingerprint": "f"})

    app = web.Application()
    app.router.add_post("/prepare", wrong)
    async with TestServer(app, host="127.0.0.1") as server, aiohttp.ClientSession() as session:
        client = AgentClient(session, None, 10.0)
        layout = LayoutBody.model_validate(build_layout(weights(0)).to_dict())
        with pytest.raises(PushFailed, match="unexpected answer: field 'session_ids'"):
            await client.prepare(str(server.make_url("")).rstrip("/"), PrepareRequest(version=1, layout=layout))


async def test_an_activation_is_refused_before_any_pause_when_nothing_is_staged_or_an_earlier_one_failed() -> None:
    """activate needs only the agent's SGLang part and what it staged: both refusals come before SGLang is
    asked anything (this loader has no session and no server behind it)."""
    loader = Loader("http://127.0.0.1:9", SGLangAuth(), LoadSettings())
    request = ActivateRequest(version=1, mode="retract")
    with pytest.raises(CommitRefused) as refused:
        await activation.activate(loader, activation.Staged(None), request)
    assert refused.value.status == 409 and "staged: None" in str(refused.value)
    loader.fail_activation("activation of version 1 (retract): lost")
    assert loader.dirty is None
    with pytest.raises(CommitRefused) as refused:
        await activation.activate(loader, activation.Staged(1), request)
    assert refused.value.status == 503 and "only a full load through /commit" in str(refused.value)
