"""The trust probe (issue 39, item 1): a short prefill with per-token log-probs, compared across the boxes at
one weight version. CPU engines in this process (bit-exact, fp32) stand for the boxes; one of them gets a
fault that silently perturbs a tensor, which the probe must find, while a clean fleet never disagrees."""

from __future__ import annotations

import math
import random
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import torch
from aiohttp.test_utils import TestServer
from support import async_wait_until, free_port

from rollout_manager.cpu_engine.engine import EngineConfig
from rollout_manager.cpu_engine.model import build_model
from rollout_manager.cpu_engine.server import create_app
from rollout_manager.instances.instance import EngineFacts
from rollout_manager.instances.probe import ProbeMonitor, ProbeSettings
from rollout_manager.instances.registry import Instance, Kind, Registry, State
from rollout_manager.instances.served_ids import note_served
from rollout_manager.instances.trust import (
    BF16_TOLERANCE,
    FP32_TOLERANCE,
    TP_FACTOR,
    Probed,
    Trust,
    judge,
    tolerance,
)
from rollout_manager.sglang.client import SGLangClient
from rollout_manager.sglang.logprob_probe import (
    PROBE_RID_PREFIX,
    ProbeFailed,
    parse_input_logprobs,
    probe_ids,
    probe_limit,
)

TENSOR = "model.layers.0.self_attn.q_proj.weight"


# ------------------------------------------------------------------ the judgement alone

def test_the_tolerance_follows_dtype_quantization_and_tp() -> None:
    assert tolerance("float32", None, 1) == FP32_TOLERANCE
    assert tolerance("bfloat16", None, 1) == tolerance("auto", None, 1) == tolerance(None, None, None) == BF16_TOLERANCE
    assert tolerance("float32", None, 4) == FP32_TOLERANCE * TP_FACTOR
    assert tolerance("bfloat16", "fp8", 1) > BF16_TOLERANCE


def test_the_box_out_of_three_is_the_one_that_disagrees() -> None:
    good, bad = (-1.0, -2.0, -3.0), (-1.0, -2.5, -3.0)
    verdicts = judge({"a": Probed(good, 1e-3), "b": Probed(good, 1e-3), "c": Probed(bad, 1e-3)})
    assert {k: v.trust for k, v in verdicts.items()} == {"a": Trust.CHECKED, "b": Trust.CHECKED, "c": Trust.DISAGREES}


def test_two_boxes_that_differ_both_disagree_unless_one_moved_since_it_was_checked() -> None:
    one, two = (-1.0, -2.0), (-1.0, -2.5)
    assert {v.trust for v in judge({"a": Probed(one, 1e-3), "b": Probed(two, 1e-3)}).values()} == {Trust.DISAGREES}
    moved = judge({"a": Probed(one, 1e-3, baseline=one), "b": Probed(two, 1e-3, baseline=one)})
    assert moved["a"].trust == Trust.CHECKED and moved["b"].trust == Trust.DISAGREES


def test_the_tolerance_widens_to_the_fleets_own_spread_and_still_finds_the_wrong_box() -> None:
    # A model whose logits are large spreads more between batch compositions than the bf16 floor (measured
    # on an H100: 0.39 at logits of deviation 8). Five honest boxes 0.4 apart at most, and one far off.
    noise = random.Random(0)
    honest = [tuple(-5.0 - 0.1 * j + noise.gauss(0.0, 0.35) for j in range(32)) for _ in range(5)]
    boxes = {f"h{k}": Probed(v, BF16_TOLERANCE) for k, v in enumerate(honest)}
    assert all(v.trust == Trust.CHECKED for v in judge(boxes).values())
    assert any(v.trust == Trust.DISAGREES for v in judge(boxes, calibrate=False).values())  # the floor alone
    wrong = tuple(x - 3.0 for x in honest[0])
    verdicts = judge({**boxes, "bad": Probed(wrong, BF16_TOLERANCE)})
    assert {k for k, v in verdicts.items() if v.trust == Trust.DISAGREES} == {"bad"}
    # and a box that moved since its check by more than the widened tolerance is caught as changed
    moved = judge({**boxes, "h0": Probed(wrong, BF16_TOLERANCE, baseline=honest[0])})
    assert moved["h0"].trust == Trust.DISAGREES and "moved" in moved["h0"].detail


def test_two_boxes_give_no_spread_to_widen_by() -> None:
    one, two = (-1.0, -2.0), (-1.0, -2.0 + 2 * BF16_TOLERANCE)
    assert {v.trust for v in judge({"a": Probed(one, BF16_TOLERANCE), "b": Probed(two, BF16_TOLERANCE)}).values()} \
        == {Trust.DISAGREES}


def test_a_box_alone_at_its_version_stays_provisional() -> None:
    assert judge({"a": Probed((-1.0,), 1e-3)})["a"].trust == Trust.PROVISIONAL


def test_an_answer_without_the_prompts_log_probs_is_no_probe() -> None:
    ids = [3, 4, 5]
    answer = {"meta_info": {"input_token_logprobs": [[None, 3, None], [-1.5, 4, None], [-0.5, 5, None]]}}
    assert parse_input_logprobs(answer, ids) == [-1.5, -0.5]
    for broken in ({"meta_info": {}}, {"meta_info": {"input_token_logprobs": [[None, 3, None]]}},
                   {"meta_info": {"input_token_logprobs": [[None, 3, None], [-1.5, 9, None], [-0.5, 5, None]]}}):
        with pytest.raises(ProbeFailed):
            parse_input_logprobs(broken, ids)


# ------------------------------------------------------------------ CPU engines behind a probe monitor

Fleet = tuple[Registry, ProbeMonitor, list[Instance], list[str]]


async def start_cpu_engines(n: int) -> list[TestServer]:
    """``n`` CPU engines in process (seed 0: the same weights), listening on free 127.0.0.1 ports."""
    servers = [TestServer(create_app(EngineConfig()), host="127.0.0.1", port=free_port()) for _ in range(n)]
    for server in servers:
        await server.start_server()
    return servers


def register_active_fp32(registry: Registry, servers: list[TestServer]) -> list[Instance]:
    """Each server registered and active at version 0, serving float32 at TP 1 (the probe's tightest
    tolerance)."""
    boxes = []
    for server in servers:
        inst = registry.add("127.0.0.1", server.port or 0, Kind.REMOTE)
        # the CPU engine reports its vocabulary itself: a checked size
        inst.engine = EngineFacts(vocab_size=256, vocab_checked=True, dtype="float32", tp_size=1)
        registry.transition(inst, State.ACTIVE, "healthy")
        boxes.append(inst)
    return boxes


def urls(servers: list[TestServer]) -> list[str]:
    return [str(s.make_url("")).rstrip("/") for s in servers]


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    """Three CPU engines (seed 0, the same weights) registered and active at version 0."""
    servers = await start_cpu_engines(3)
    session = aiohttp.ClientSession()
    registry = Registry()
    client = SGLangClient(session)
    monitor = ProbeMonitor(registry, client.prefill_logprobs, ProbeSettings(interval_s=0, timeout_s=30, tolerance=0))
    boxes = register_active_fp32(registry, servers)
    try:
        yield registry, monitor, boxes, urls(servers)
    finally:
        await monitor.close()
        await session.close()
        for server in servers:
            await server.close()


async def post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body) as r:
        assert r.status == 200, await r.text()
        return dict(await r.json())


async def test_the_cpu_engine_answers_the_prompts_log_probs_as_sglang_does(fleet: Fleet) -> None:
    _, _, _, urls = fleet
    ids = probe_ids(256)
    answer = await post(urls[0], "/generate", {"input_ids": ids, "return_logprob": True, "logprob_start_len": 0,
                                               "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
    entries = answer["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in entries] == ids and entries[0][0] is None
    logits = build_model(0)(torch.tensor(ids))
    expected = torch.log_softmax(logits, dim=-1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
    assert all(math.isclose(e[0], x, abs_tol=1e-5) for e, x in zip(entries[1:], expected))


async def test_a_clean_fleet_never_disagrees_over_many_probes(fleet: Fleet) -> None:
    registry, monitor, boxes, urls = fleet
    assert {b.to_dict(0)["trust"]["state"] for b in boxes} == {"provisional"}  # nothing probed yet
    for _ in range(30):
        await monitor.check_all()
        await post(urls[0], "/generate", {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}})
    assert [b.trust.state(0) for b in boxes] == [Trust.CHECKED] * 3
    assert all(b.trust.probes == 30 and b.trust.disagreements == 0 and b.trust.diff == 0.0 for b in boxes)


async def test_the_probe_finds_the_box_whose_tensor_was_perturbed_and_only_reports_it(fleet: Fleet) -> None:
    registry, monitor, boxes, urls = fleet
    await monitor.check_all()
    assert [b.trust.state(0) for b in boxes] == [Trust.CHECKED] * 3
    await post(urls[1], "/debug/faults", {"perturb_tensor": TENSOR, "perturb_after_requests": 1})
    for _ in range(2):  # the second client request runs on the perturbed tensor; nothing tells the client
        await post(urls[1], "/generate", {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}})
    await monitor.check_all()
    assert [b.trust.state(0) for b in boxes] == [Trust.CHECKED, Trust.DISAGREES, Trust.CHECKED]
    bad = boxes[1].to_dict(0)
    assert bad["trust"]["state"] == "disagrees" and bad["trust"]["disagreements"] == 1
    assert boxes[1].trust.diff is not None and boxes[1].trust.diff > FP32_TOLERANCE
    assert all(b.state == State.ACTIVE for b in boxes)  # reported, not quarantined
    await monitor.check_all()  # still disagreeing: counted once
    assert boxes[1].trust.disagreements == 1 and registry.get(boxes[1].id) is boxes[1]


async def test_a_box_that_changes_version_is_provisional_until_probed_there(fleet: Fleet) -> None:
    registry, monitor, boxes, _ = fleet
    await monitor.check_all()
    registry.set_weight_version(boxes[0], 1)  # as weight sync does once an activation is done
    assert boxes[0].to_dict(0)["trust"]["state"] == "provisional"
    boxes[1].versions.activating, boxes[1].versions.serving_before = 1, 0  # in the pause: never probed
    assert await monitor.check(boxes[1]) is None
    assert await monitor.check(boxes[0]) == Trust.PROVISIONAL  # alone at version 1: nothing to compare with
    boxes[1].versions.activating = boxes[1].versions.serving_before = None
    registry.set_weight_version(boxes[1], 1)
    await monitor.check(boxes[1])
    assert boxes[0].trust.state(1) == boxes[1].trust.state(1) == Trust.CHECKED


async def test_an_activation_nudge_probes_the_box_out_of_the_pause(fleet: Fleet) -> None:
    registry, monitor, boxes, _ = fleet
    seen: list[str] = []
    prefill = monitor.prefill

    async def recording(url: str, ids: list[int], rid: str, timeout_s: float) -> list[float]:
        assert rid.startswith(PROBE_RID_PREFIX)
        seen.append(url)
        return await prefill(url, ids, rid, timeout_s)

    monitor.prefill = recording
    monitor.start()
    monitor.nudge(boxes[2])
    await monitor.check_all(boxes[:2])  # the loop's probe of boxes[2] runs beside these
    await async_wait_until(lambda: boxes[2].trust.probes == 1)
    assert seen.count(boxes[2].url) == 1


# ------------------------------------------------------------------ only ids the box is known to take (issue 46)
async def test_the_probe_sends_only_ids_a_box_is_known_to_take_and_waits_without_any() -> None:
    """A box whose vocabulary nobody vouched for (declared by hand, or not at all) is probed only below what it
    served; with nothing served it is not probed, and its status says why."""
    registry = Registry()
    sent: list[tuple[str, list[int]]] = []

    async def prefill(url: str, ids: list[int], rid: str, timeout_s: float) -> list[float]:
        sent.append((url, ids))
        return [-1.0] * (len(ids) - 1)

    monitor = ProbeMonitor(registry, prefill, ProbeSettings(interval_s=0, timeout_s=5, tolerance=1e-3))
    by_hand = registry.add("127.0.0.1", 30001, Kind.REMOTE, declared_vocab_size=150000)  # perhaps wrong
    launched = registry.add("127.0.0.1", 30002, Kind.REMOTE, declared_vocab_size=1000, vocab_from_config=True)
    for inst in (by_hand, launched):
        registry.transition(inst, State.ACTIVE, "healthy")
    assert await monitor.check(by_hand) is None and sent == []  # nothing known to be safe: nothing sent
    assert by_hand.trust.waiting and "vocab_source" in by_hand.trust.waiting
    assert by_hand.to_dict(0)["trust"]["waiting"] == by_hand.trust.waiting
    await monitor.check(launched)  # its launcher read the model's config.json: ids below 512 (the rung under 1000)
    assert sent[-1][0] == launched.url and max(sent[-1][1]) < 512 and launched.trust.probes == 1

    note_served(by_hand, [5, 300, 17], [40, 41])  # it answered ids up to 300: 256 is its rung
    await monitor.check(by_hand)
    assert sent[-1][0] == by_hand.url and max(sent[-1][1]) < 256 and sent[-1][1] == probe_ids(256)
    assert by_hand.trust.waiting is None and by_hand.trust.probes == 1
    assert probe_limit(63) is None and probe_limit(300) == 256 and probe_limit(151936) == 32000


async def test_a_waiting_box_is_probed_soon_after_it_has_served_safe_ids() -> None:
    """The probe loop looks at a waiting box again on its own (every few seconds), not at the next round."""
    registry = Registry()
    sent: list[list[int]] = []

    async def prefill(url: str, ids: list[int], rid: str, timeout_s: float) -> list[float]:
        sent.append(ids)
        return [-1.0] * (len(ids) - 1)

    monitor = ProbeMonitor(registry, prefill, ProbeSettings(interval_s=3600, timeout_s=5, tolerance=1e-3))
    inst = registry.add("127.0.0.1", 30001, Kind.REMOTE)
    monitor.start()
    try:
        registry.transition(inst, State.ACTIVE, "healthy")
        await async_wait_until(lambda: inst.trust.waiting, 5, message="the probe to wait")
        note_served(inst, list(range(100)), [])
        await async_wait_until(lambda: inst.trust.probes == 1, 10, message="the probe after the box served ids")
        assert sent == [probe_ids(64)] and inst.trust.waiting is None
    finally:
        await monitor.close()
