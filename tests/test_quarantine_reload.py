"""A quarantined box comes back through weight sync's own reload (issue 39, item 3: "it serves again only after
a full reload and a passing probe"): with no newer version to push, weight sync pushes it the version it
serves again, in full (the receiver loads every tensor), the registry notes the reload when it refuses the
box's move to ``active``, and the next passing probe lifts the quarantine. Real processes: a manager, the
trainer's sender agent, and CPU engines behind receiver agents (``test_weights_e2e``'s rig)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from support import async_wait_until
from test_weights_e2e import SENDER_IPS, _state, trainer_weights
from weight_fleet import engine_checksums, expected_checksums

from rollout_manager.weights.sender_agent import SenderAgent

pytestmark = pytest.mark.slow  # real processes

TENSOR = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture
async def rig(start_manager, tmp_path):
    from support import Box, free_port
    from test_weights_e2e import MODEL_JSON

    sender_port = free_port()
    m = await start_manager(weight_sender_base_port=str(sender_port), allowed_sender_ips="127.0.0.0/8",
                            weight_push_retry_s="0.2", trust_probe_interval_s="0.2", quarantine_recheck_s="0.2")
    sender = SenderAgent(SENDER_IPS, sender_port).start()
    boxes = [Box(tmp_path, MODEL_JSON) for _ in range(3)]
    try:
        for box in boxes:
            await box.ready()
            await m.register(box, wait_active=False)
        status, _ = await m.put_senders([SENDER_IPS], 2, engines=2)
        assert status == 200
        yield m, sender, boxes
    finally:
        for box in boxes:
            box.stop()
        sender.stop()


async def test_a_quarantined_box_is_reloaded_at_the_same_version_and_serves_again(rig):
    m, sender, boxes = rig
    weights = trainer_weights(1)
    await asyncio.to_thread(sender.stage, weights, 1)
    status, res = await m.post("/update_weight_version", {"wait_for_instances": "all", "timeout_s": 60})
    assert status == 200 and not res["timed_out"], res

    async def trust_of(box) -> dict:
        st = await m.status()
        return next(i for i in st["instances"] if i["endpoint"] == box.endpoint)

    for box in boxes:
        await async_wait_until(lambda b=box: _checked(trust_of(b)), message="every box checked at version 1")
    bad = boxes[0]
    async with aiohttp.ClientSession() as s:
        async with s.post(bad.url + "/debug/faults", json={"perturb_tensor": TENSOR, "perturb_after_requests": 0,
                                                            "perturb_scale": 0.5}) as r:
            assert r.status == 200
        async with s.post(bad.url + "/generate", json={"input_ids": [1, 2], "sampling_params": {
                "max_new_tokens": 1}}) as r:
            assert r.status == 200
    assert await engine_checksums(bad.url) != expected_checksums(weights)
    await async_wait_until(lambda: _quarantined(m), timeout_s=30, message="the perturbed box quarantined")
    # no newer version: weight sync reloads it at version 1, in full, and its probe passes
    await async_wait_until(lambda: _state(m, bad, "active"), timeout_s=60, message="readmitted after the reload")
    inst = await trust_of(bad)
    assert inst["quarantined"] is None and inst["weight_version"] == 1 and inst["trust"]["state"] == "checked"
    assert await engine_checksums(bad.url) == expected_checksums(weights)  # healed by the reload
    q = (await m.status())["quarantine"]
    assert q["quarantined"] == 1 and q["lifted"] == 1 and q["quarantined_now"] == []


async def _checked(inst) -> bool:
    return (await inst)["trust"]["state"] == "checked"


async def _quarantined(m) -> bool:
    return (await m.status())["quarantine"]["quarantined"] == 1
