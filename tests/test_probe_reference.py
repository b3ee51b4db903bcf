"""The trainer's reference for the trust probe (issue 39, item 1: "where the trainer can provide the probe's
reference log-probs, use them too"): the plugin computes the probe prompt's log-probs with the trainer's model
(here the CPU engine's own model, ``build_model(0)``: the weights the engines serve) and the manager judges
each box's probe by them, with the same tolerance. CPU engines in this process stand for the boxes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import torch
from aiohttp.test_utils import TestClient
from test_quarantine import Fleet, make_fleet, perturb
from test_trust_probe import FP32_TOLERANCE

from rollout_manager.cpu_engine.model import build_model
from rollout_manager.instances.quarantine import QuarantineSettings
from rollout_manager.instances.registry import State
from rollout_manager.instances.trust import Probed, Trust, judge
from rollout_manager.manager import Manager
from rollout_manager.sglang.logprob_probe import probe_ids
from trainer_plugin.probe_reference import post_reference, reference_logprobs

IDS = probe_ids(256)


def trainer_reference(seed: int = 0) -> list[float]:
    """What the plugin posts: the prompt's log-probs under the trainer's model (seed 0: the served weights)."""
    model = build_model(seed)
    return reference_logprobs(lambda ids: model.forward(torch.tensor(ids)), IDS)


def test_the_reference_judges_each_box_and_checks_one_alone() -> None:
    ref = (-1.0, -2.0)
    near, far = (-1.0, -2.0005), (-1.5, -2.0)
    alone = judge({"a": Probed(near, FP32_TOLERANCE)}, ref)
    assert alone["a"].trust == Trust.CHECKED  # without a reference: provisional (nothing to compare with)
    verdicts = judge({"a": Probed(near, FP32_TOLERANCE), "b": Probed(far, FP32_TOLERANCE)}, ref)
    assert verdicts["a"].trust == Trust.CHECKED and verdicts["b"].trust == Trust.DISAGREES
    assert "trainer's reference" in verdicts["b"].detail


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    async for f in make_fleet(3, QuarantineSettings(enabled=True, min_active=1, recheck_s=0)):
        yield f


async def test_the_engines_agree_with_the_trainers_own_forward(fleet: Fleet) -> None:
    f = fleet
    f.probes.set_reference(0, IDS, trainer_reference())
    await f.probes.check_all()
    assert all(b.trust.state(0) == Trust.CHECKED and "trainer's reference" in (b.trust.detail or "")
               for b in f.boxes)
    assert max(b.trust.diff or 0.0 for b in f.boxes) < 1e-5  # the engines' log-probs are the model's own


async def test_a_box_alone_is_checked_by_the_reference_and_a_perturbed_one_is_quarantined(fleet: Fleet) -> None:
    f = fleet
    for box in f.boxes[1:]:
        f.registry.set_weight_version(box, 1)  # box 0 is alone at version 0
    await f.probes.check(f.boxes[0])
    assert f.boxes[0].trust.state(0) == Trust.PROVISIONAL
    f.probes.set_reference(0, IDS, trainer_reference())
    await f.probes.check(f.boxes[0])
    assert f.boxes[0].trust.state(0) == Trust.CHECKED
    f.registry.set_weight_version(f.boxes[0], 1)
    f.probes.set_reference(1, IDS, trainer_reference())
    await perturb(f.urls[2])
    await f.probes.check(f.boxes[2])  # probed first: off the reference, nobody else probed at version 1 yet
    assert f.boxes[2].trust.state(1) == Trust.DISAGREES and f.boxes[2].quarantined is None
    await f.probes.check(f.boxes[1])  # a box agrees with the trainer: the other one is at fault
    assert f.boxes[2].quarantined is not None and f.boxes[2].state == State.SYNCING
    assert all(b.state == State.ACTIVE for b in f.boxes[:2])


async def test_every_box_off_the_trainers_reference_is_fleet_wide_and_quarantines_nothing(fleet: Fleet) -> None:
    f = fleet
    f.probes.set_reference(0, IDS, trainer_reference(seed=1))  # the trainer holds other weights than the fleet
    await f.probes.check_all()
    assert {b.trust.state(0) for b in f.boxes} == {Trust.DISAGREES}
    assert all(b.state == State.ACTIVE for b in f.boxes) and f.quarantine.status()["fleet_wide"]


# ------------------------------------------------------------------ the endpoints, through the plugin
async def test_the_plugin_fetches_the_prompt_and_posts_its_reference(api: tuple[Manager, TestClient]) -> None:
    manager, client = api
    url = f"http://127.0.0.1:{client.server.port}"
    model = build_model(0)
    answer = await asyncio.to_thread(post_reference, url, 3, lambda ids: model.forward(torch.tensor(ids)), 256)
    assert answer["weight_version"] == 3 and answer["tokens"] == len(IDS)
    assert manager.probes.references() == [{"weight_version": 3, "tokens": len(IDS)}]
    r = await client.get("/probe_prompt?vocab_size=256")
    assert (await r.json())["input_ids"] == IDS
    r = await client.post("/update_probe_reference", json={"weight_version": 3, "input_ids": IDS, "logprobs": [-1.0]})
    assert r.status == 400 and "1 log-probs for a prompt of 32 tokens" in (await r.json())["error"]
    for bad in ("1", "x"):
        assert (await client.get(f"/probe_prompt?vocab_size={bad}")).status == 400
