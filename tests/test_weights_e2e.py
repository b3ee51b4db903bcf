"""Weight versions end to end: trainer-side sender -> Mooncake TCP over loopback -> receivers -> CPU engines."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import torch
from support import Box, async_wait_until, free_port
from weight_fleet import engine_checksums, expected_checksums

from rollout_manager.cpu_engine.model import build_model, reference_generate
from rollout_manager.weights.sender_agent import SenderAgent

pytestmark = pytest.mark.slow  # every test here starts real processes

MODEL = {"hidden_size": 384, "intermediate_size": 1536, "num_hidden_layers": 4}  # ~9.6 M params
MODEL_JSON = json.dumps(MODEL)
SENDER_IPS = ["127.0.0.1", "127.0.0.2"]


def trainer_weights(step: int) -> dict[str, torch.Tensor]:
    """A new 'trained' state dict per step, in mixed dtypes (bf16, fp16, fp32) as trainers have."""
    model = build_model(100 + step, **MODEL)
    out = {}
    for i, (name, t) in enumerate(model.state_dict().items()):
        out[name] = t.to((torch.bfloat16, torch.float16, torch.float32)[i % 3])
    return out


@pytest.fixture
async def rig(start_manager, tmp_path, request):
    sender_port = free_port()
    param, _, activation = getattr(request, "param", "mooncake").partition("@")  # "...@staged": staged activation
    transport, _, auth = param.partition("+")
    token = "s3cret-token" if auth else ""
    m = await start_manager(weight_sender_base_port=str(sender_port), allowed_sender_ips="127.0.0.0/8",
                            weight_push_retry_s="0.2", weight_push_max_attempts="2",
                            weight_transport=transport, auth_token=token, weight_activation=activation or "drain")
    sender = SenderAgent(SENDER_IPS, sender_port, auth_token=token).start()
    boxes: list[Box] = []

    async def add_box(*flags: str) -> Box:
        box = Box(tmp_path, MODEL_JSON, *flags, token=token)
        boxes.append(box)
        await box.ready()
        await m.register(box, wait_active=False)
        return box

    try:
        status, _ = await m.put_senders([SENDER_IPS], 2, engines=2)
        assert status == 200
        yield m, sender, add_box
    finally:  # boxes first: nothing may outlive the test, whatever failed
        for box in boxes:
            box.stop()
        sender.stop()


async def greedy_via(m, prompt, n=8):
    status, out = await m.post("/generate", {"input_ids": prompt, "sampling_params": {"temperature": 0,
                                                                                     "max_new_tokens": n}})
    assert status == 200, out
    return out


@pytest.mark.parametrize("rig", ["mooncake", "tcp+auth", "mooncake@staged"], indirect=True)
async def test_push_to_three_engines_in_two_groups_is_bit_exact_and_changes_outputs(rig):
    m, sender, add_box = rig
    boxes = [await add_box() for _ in range(3)]
    for box in boxes:
        await async_wait_until(lambda b=box: _state(m, b, "active"), message="version-0 instances active")
    before = (await greedy_via(m, [1, 2, 3]))["output_ids"]
    groups = {(i["sender"], i["group"]) for i in (await m.status())["instances"]}
    assert groups == {(0, 0), (0, 1)}  # 3 instances dealt over the 2 groups

    weights = trainer_weights(1)
    layout = await asyncio.to_thread(sender.stage, weights, 1)
    assert layout.total_bytes > 20 << 20  # tens of MB
    status, res = await m.post("/update_weight_version", {"wait_for_instances": "all", "timeout_s": 60})
    assert status == 200 and res["new_weight_version"] == 1 and not res["timed_out"], res
    assert res["instances_at_version"] == 3
    want = expected_checksums(weights)
    for box in boxes:
        assert await engine_checksums(box.url) == want
    reference = build_model(0, **MODEL)
    reference.load_named_tensors([(n, t.to(torch.float32)) for n, t in weights.items()])
    out = await greedy_via(m, [1, 2, 3])
    assert out["output_ids"] == reference_generate(reference, [1, 2, 3], 8)[0] != before
    assert out["meta_info"]["weight_version"] == "1"
    st = await m.status()
    assert {i["weight_version"] for i in st["instances"]} == {1}
    pushes = st["recent_weight_pushes"]
    assert {p["ip"] for p in pushes} == set(SENDER_IPS) and all(p["bytes"] == layout.total_bytes for p in pushes)
    assert len({p["transport"] for p in pushes}) == 1


async def _state(m, box, state):
    return await m.state_of(box.endpoint) == state


async def test_consecutive_versions_bootstrap_and_faulty_receivers_kept_out(rig):
    m, sender, add_box = rig
    good = await add_box()
    await async_wait_until(lambda: _state(m, good, "active"))
    for step in (1, 2):
        weights = trainer_weights(step)
        await asyncio.to_thread(sender.stage, weights, step)
        status, res = await m.post("/update_weight_version", {"wait_for_instances": 1, "timeout_s": 60})
        assert status == 200 and res["new_weight_version"] == step and not res["timed_out"]
        assert await engine_checksums(good.url) == expected_checksums(weights)
    # A box registered mid-training is bootstrapped to the current version before it serves.
    late = await add_box()
    await async_wait_until(lambda: _state(m, late, "active"), timeout_s=60, message="late box bootstrapped")
    assert await engine_checksums(late.url) == expected_checksums(weights)
    # A receiver that corrupts what lands and one that dies mid-transfer never serve version 3.
    corrupt = await add_box("--fault-corrupt")
    dying = await add_box("--fault-die-after-prepare")
    for box in (corrupt, dying):  # they join at version 2 through the same (faulty) path
        await async_wait_until(lambda b=box: _gone(m, b), timeout_s=60, message="faulty box removed")
    weights = trainer_weights(3)
    await asyncio.to_thread(sender.stage, weights, 3)
    status, res = await m.post("/update_weight_version", {"wait_for_instances": "all", "timeout_s": 60})
    assert not res["timed_out"] and res["instances_at_version"] == 2
    st = await m.status()
    assert {i["endpoint"] for i in st["instances"]} == {good.endpoint, late.endpoint}
    assert {i["weight_version"] for i in st["instances"]} == {3}
    reasons = [e["reason"] for e in st["recent_events"] if e["to"] == "dead"]
    assert any("checksum mismatch" in r for r in reasons), reasons
    assert len(reasons) == 2
    assert await engine_checksums(corrupt.url) != expected_checksums(trainer_weights(2))  # never loaded


async def _gone(m, box):
    return await m.state_of(box.endpoint) is None


async def test_a_dead_sender_keeps_instances_out_of_service_without_removing_them(rig):
    m, sender, add_box = rig  # weight_push_max_attempts = 2, retry every 0.2 s
    box = await add_box()
    await async_wait_until(lambda: _state(m, box, "active"))
    port = int(sender.port)
    sender.stop()  # the trainer's sender agent crashed
    status, res = await m.post("/update_weight_version", {"wait_for_instances": "all", "timeout_s": 1.5})
    assert status == 200 and res["timed_out"]  # nobody can get version 1 ...
    inst = (await m.status())["instances"][0]
    assert inst["state"] == "syncing" and "sender 0" in inst["last_error"]  # ... and nobody was removed
    weights = trainer_weights(1)
    revived = SenderAgent(SENDER_IPS, port).start()  # the trainer restarts it and stages again
    try:
        await asyncio.to_thread(revived.stage, weights, 1)
        await async_wait_until(lambda: _state(m, box, "active"), timeout_s=30,
                               message="push after the sender came back")
        assert await engine_checksums(box.url) == expected_checksums(weights)
    finally:
        revived.stop()


@contextlib.asynccontextmanager
async def slow_loading_box(start_manager: Any, tmp_path: Any, load_delay_s: float,
                           *receiver_flags: str) -> AsyncIterator[Any]:
    """A drain-mode manager, one box whose every weight load takes ``load_delay_s``, registered, and a
    sender with version 1 staged; yields the manager."""
    port = free_port()
    m = await start_manager(weight_sender_base_port=str(port), allowed_sender_ips="127.0.0.0/8",
                            weight_activation="drain")
    sender = SenderAgent(SENDER_IPS, port).start()
    box = Box(tmp_path, MODEL_JSON, *receiver_flags)
    try:
        await box.ready()
        async with aiohttp.ClientSession() as s:
            async with s.post(box.url + "/debug/faults", json={"load_delay_s": load_delay_s}) as r:
                assert r.status == 200, await r.text()
        await m.register(box)
        await m.put_senders([SENDER_IPS], 1)
        await asyncio.to_thread(sender.stage, trainer_weights(1), 1)
        yield m
    finally:
        sender.stop()
        box.stop()


async def test_a_weight_load_longer_than_the_health_interval_is_not_taken_for_death(start_manager, tmp_path):
    """Health answers 503 for 2 s while the box loads; checks every 0.2 s, 2 failures would evict."""
    async with slow_loading_box(start_manager, tmp_path, 2.0) as m:
        status, res = await m.post("/update_weight_version", {"wait_for_instances": "all", "timeout_s": 60})
        assert status == 200 and not res["timed_out"] and res["instances_at_version"] == 1
        st = await m.status()
        assert [e["to"] for e in st["recent_events"]] == ["pending", "active", "syncing", "active"]
        push = st["recent_weight_pushes"][-1]
        assert push["load_s"] >= 2.0  # the load really outlasted ten health intervals


async def test_a_sequence_still_running_at_the_drain_timeout_moves_on_and_the_push_succeeds(start_manager, tmp_path):
    """SGLang >= 0.5.21 will not flush its cache while requests run, and the old weights' cache must go:
    after drain_timeout_s the manager moves what still runs elsewhere (from the tokens made), then pushes."""
    port = free_port()
    m = await start_manager(weight_sender_base_port=str(port), allowed_sender_ips="127.0.0.0/8",
                            weight_transport="tcp", drain_timeout_s="0.5", tail_migration="false",
                            engine_stream_interval="1", weight_activation="drain")
    sender = SenderAgent(SENDER_IPS, port).start()
    boxes = [Box(tmp_path, MODEL_JSON), Box(tmp_path, MODEL_JSON)]
    try:
        for box in boxes:
            await box.ready()
        await m.register(*boxes)
        await m.put_senders([SENDER_IPS], 1)
        async with aiohttp.ClientSession() as s:
            for box in boxes:
                async with s.post(box.url + "/debug/faults", json={"token_delay_s": 0.05}) as r:
                    assert r.status == 200
        gen = asyncio.ensure_future(m.post("/generate", {"input_ids": [3, 1, 4], "sampling_params": {
            "temperature": 0, "max_new_tokens": 200}}))  # about 10 s at 50 ms a token

        async def streaming() -> bool:
            return any(i["in_flight"] for i in (await m.status())["instances"])

        await async_wait_until(streaming, 20, message="the sequence is running")
        await asyncio.to_thread(sender.stage, trainer_weights(1), 1)
        status, res = await m.post("/update_weight_version", {"wait_for_instances": "all", "timeout_s": 60})
        assert status == 200 and not res["timed_out"] and res["instances_at_version"] == 2, res
        status, out = await gen
        assert status == 200, out
        segs = out["meta_info"]["segments"]
        assert segs[0]["outcome"] == "migrated to another instance (weight push)", segs
        assert segs[-1]["outcome"] == "finished" and segs[-1]["weight_version"] == "1"
        assert [s["start"] for s in segs[1:]] == [s["end"] for s in segs[:-1]] and segs[-1]["end"] == 200
        assert len(out["output_ids"]) == 200
        st = await m.status()
        assert len(st["instances"]) == 2 and all(i["state"] == "active" for i in st["instances"])
        assert st["generation"]["evicted"] == 1 and st["generation"]["failed"] == 0
    finally:
        sender.stop()
        for box in boxes:
            box.stop()


async def test_the_receivers_load_timeout_is_set_from_its_command_line(start_manager, tmp_path):
    """--load-timeout-s bounds one load into SGLang: a load that outlasts it fails the push, and says so,
    instead of holding the box for the default ten minutes."""
    async with slow_loading_box(start_manager, tmp_path, 5.0, "--load-timeout-s", "0.5") as m:
        status, res = await m.post("/update_weight_version", {"wait_for_instances": "all", "timeout_s": 4})
        assert status == 200 and res["instances_at_version"] == 0, res
        inst, = (await m.status())["instances"]
        error = inst["last_error"] or ""
        assert inst["weight_version"] == 0 and "load timeout (--load-timeout-s): 0.5 s" in error, error
