"""Quarantine and regenerate (issue 39, item 3): a box the trust probe or the trainer's mismatch singles out
leaves service, its running sequences are cut back to their last trusted token and finish elsewhere exactly,
and it serves again only after a reload and a passing probe. CPU engines in this process stand for the boxes."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from fakes import HealthRecorder
from support import as_json, async_wait_until
from test_trust_probe import register_active_fp32, start_cpu_engines, urls

from rollout_manager.cpu_engine.model import build_model
from rollout_manager.instances.mismatch import BoxReport, MismatchLedger, MismatchSettings
from rollout_manager.instances.probe import ProbeMonitor, ProbeSettings
from rollout_manager.instances.quarantine import Quarantine, QuarantineSettings
from rollout_manager.instances.registry import Instance, Registry, State
from rollout_manager.instances.trust import Trust
from rollout_manager.placement.dispatch import Dispatcher
from rollout_manager.placement.least_in_flight import LeastInFlight
from rollout_manager.placement.local_budget import LocalBudget
from rollout_manager.rollout.generation import GenerationSettings, Generator
from rollout_manager.rollout.migration import distrust
from rollout_manager.rollout.request import decode
from rollout_manager.rollout.sequence import Segment, SequenceState
from rollout_manager.sglang import tensor_payload, wire
from rollout_manager.sglang.client import SGLangClient

TENSOR = "model.layers.0.self_attn.q_proj.weight"
PROMPT = [5, 17, 42, 9]
SETTINGS = GenerationSettings(max_attempts=3, wait_timeout_s=5.0, connect_timeout_s=5.0, stall_timeout_s=30.0,
                              engine_stream_interval=1)


@dataclass
class Fleet:
    registry: Registry
    probes: ProbeMonitor
    ledger: MismatchLedger
    quarantine: Quarantine
    generator: Generator
    boxes: list[Instance]
    urls: list[str]


async def make_fleet(n: int, settings: QuarantineSettings, generation: GenerationSettings = SETTINGS,
                     health: HealthRecorder | None = None) -> AsyncIterator[Fleet]:
    """``health``: a failure counts against its box, as the health monitor does (None: failures count for
    nothing)."""
    servers = await start_cpu_engines(n)
    session = aiohttp.ClientSession()
    registry = Registry()
    client = SGLangClient(session)
    probes = ProbeMonitor(registry, client.prefill_logprobs, ProbeSettings(interval_s=0, timeout_s=30, tolerance=0))
    health = health or HealthRecorder(marks=False)
    generator = Generator(Dispatcher(registry, LeastInFlight()), client, generation, LocalBudget(0.0, 0.0, 1.0),
                          on_instance_failure=health.failure, on_instance_success=health.success)
    ledger = MismatchLedger(MismatchSettings(alpha=1.0, outlier_multiple=3.0, floor=0.05))
    quarantine = Quarantine(registry, probes, ledger, settings, generator.evict, generator.migrator.mark,
                            generator.migrator.provisional)
    boxes = register_active_fp32(registry, servers)
    try:
        yield Fleet(registry, probes, ledger, quarantine, generator, boxes, urls(servers))
    finally:
        await quarantine.close()
        await probes.close()
        await session.close()
        for server in servers:
            await server.close()


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    async for f in make_fleet(3, QuarantineSettings(enabled=True, min_active=1, recheck_s=0)):
        yield f


async def post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body) as r:
        assert r.status == 200, await r.text()
        return dict(await r.json())


def greedy(n: int, rid: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"input_ids": list(PROMPT), "sampling_params": {"temperature": 0, "max_new_tokens": n}}
    if rid is not None:
        body["rid"] = rid
    return body


async def perturb(url: str) -> None:
    """The box's tensor goes wrong silently on its next client request (which this sends)."""
    await post(url, "/debug/faults", {"perturb_tensor": TENSOR, "perturb_after_requests": 0, "perturb_scale": 0.5})
    await post(url, "/generate", greedy(1))


async def reload_clean(f: Fleet, box: Instance, version: int) -> None:
    """What the drain path does: load the trainer's weights (here the clean tensor) at a new version."""
    tensor = dict(build_model(0).named_parameters())[TENSOR].detach().clone()
    body = wire.update_weights_from_tensor_body([tensor_payload.serialize_named_tensors([(TENSOR, tensor)])],
                                                flush_cache=True, weight_version=str(version))
    await post(box.url, "/begin_weight_update", {})
    await post(box.url, "/update_weights_from_tensor", as_json(body))
    await post(box.url, "/end_weight_update", {})
    f.registry.set_weight_version(box, version)


# ------------------------------------------------------------------ the cut-back alone

def test_a_cut_back_keeps_the_vouched_tokens_and_earlier_segments() -> None:
    seq = SequenceState(decode(greedy(10)).sequences[0].body, "r")
    seq.output_ids.extend(range(10))
    seq.logprobs.extend([[-1.0, t, None] for t in range(10)])
    seq.segments[:] = [Segment("a", "a:1", "0", 0, 4, "failed"), Segment("b", "b:1", "0", 4, 10, "running", 7)]
    seq.versions[:] = [0]
    assert seq.cut_point("b") == 7 and seq.cut_point("a") == 0  # nothing of a's vouched for
    seq.segments[0].trusted = 4
    assert seq.cut_point("a") == 10
    seq.cut_back(7, "quarantined")
    assert list(seq.output_ids) == list(range(7)) and len(seq.logprobs) == 7
    assert [(s.instance, s.start, s.end) for s in seq.segments] == [("a", 0, 4), ("b", 4, 7)]
    assert [(s.start, s.end, s.outcome) for s in seq.discarded] == [(7, 10, "distrusted: quarantined")]
    seq.segments[-1].trusted = None  # nothing of b vouched for: back to where it began
    assert seq.cut_point("b") == 4
    distrust(seq, "b", "quarantined")  # what an answer that finished before its cut-back says
    assert seq.segments[0].outcome == "failed" and seq.segments[1].outcome.endswith("; distrusted: quarantined")


# ------------------------------------------------------------------ CPU engines

async def test_a_perturbed_box_is_quarantined_and_its_sequence_finishes_elsewhere_exactly(fleet: Fleet) -> None:
    f = fleet
    reference = as_json(await f.generator.generate(decode(greedy(40))))["output_ids"]
    await f.probes.check_all()
    await post(f.urls[0], "/debug/faults", {"token_delay_s": 0.01})  # slow: the sequence is running on it
    base = f.generator.dispatcher.fleet.streamed_tokens
    running = asyncio.ensure_future(f.generator.generate(decode(greedy(40))))
    fleet = f.generator.dispatcher.fleet
    await async_wait_until(lambda: f.boxes[0].load.in_flight == 1 and fleet.streamed_tokens > base + 5)
    assert await f.probes.check(f.boxes[0]) == Trust.CHECKED  # vouches for the tokens made before it was sent
    vouched = f.generator.dispatcher.fleet.streamed_tokens
    await async_wait_until(lambda: f.generator.dispatcher.fleet.streamed_tokens > vouched + 3)
    await perturb(f.urls[0])
    await f.probes.check_all()

    assert f.boxes[0].state == State.SYNCING and f.boxes[0].quarantined is not None
    answer = as_json(await running)
    assert answer["output_ids"] == reference  # cut back and continued elsewhere: as if never interrupted
    meta = answer["meta_info"]
    assert any(s["outcome"].startswith("distrusted: quarantined") for s in meta["discarded_segments"])
    assert meta["segments"][0]["instance"] == f.boxes[0].id and "cut back" in meta["segments"][0]["outcome"]
    assert {s["instance"] for s in meta["segments"][1:]} <= {f.boxes[1].id, f.boxes[2].id}
    assert f.generator.stats["cut_back_tokens"] > 0
    status = f.quarantine.status()
    assert status["quarantined"] == 1 and status["quarantined_now"] == [f.boxes[0].id]
    assert [s["instance"] for s in status["distrusted_spans"]] == [f.boxes[0].id]
    # nothing new goes to it
    later = as_json(await f.generator.generate(decode(greedy(5))))
    assert f.boxes[0].id not in {s["instance"] for s in later["meta_info"]["segments"]}


async def test_a_sequence_that_left_the_box_unvouched_is_cut_back_where_it_runs_now(fleet: Fleet) -> None:
    f = fleet
    reference = as_json(await f.generator.generate(decode(greedy(40))))["output_ids"]
    await f.probes.check_all()  # every box checked: the baselines a perturbation moves away from
    for url in f.urls[:2]:
        await post(url, "/debug/faults", {"token_delay_s": 0.01})
    base = f.generator.dispatcher.fleet.streamed_tokens
    running = asyncio.ensure_future(f.generator.generate(decode(greedy(40))))
    fleet = f.generator.dispatcher.fleet
    await async_wait_until(lambda: f.boxes[0].load.in_flight == 1 and fleet.streamed_tokens > base + 5)
    dispatcher = f.generator.dispatcher
    assert dispatcher.claim(f.boxes[0], 1)  # box 0 looks busy: the move goes to box 1
    assert f.generator.evict(f.boxes[0], "test move") == 1
    await async_wait_until(lambda: f.boxes[1].load.in_flight == 1)
    dispatcher.release(f.boxes[0], 1)
    await perturb(f.urls[0])
    await f.probes.check_all()
    assert f.boxes[0].quarantined is not None
    answer = as_json(await running)
    assert answer["output_ids"] == reference
    discarded = answer["meta_info"]["discarded_segments"]
    assert discarded[0]["instance"] == f.boxes[0].id and discarded[0]["start"] == 0  # nothing of it was vouched
    assert f.boxes[0].id not in {s["instance"] for s in answer["meta_info"]["segments"]}


async def test_a_clean_fleet_quarantines_nothing(fleet: Fleet) -> None:
    for _ in range(20):
        await fleet.probes.check_all()
        await fleet.generator.generate(decode(greedy(3)))
    assert all(b.state == State.ACTIVE and b.quarantined is None for b in fleet.boxes)
    assert fleet.quarantine.status()["quarantined"] == 0


async def test_the_floor_holds_and_says_so() -> None:
    async for f in make_fleet(3, QuarantineSettings(enabled=True, min_active=3, recheck_s=0)):
        await f.probes.check_all()
        await perturb(f.urls[1])
        await f.probes.check_all()
        assert f.boxes[1].trust.state(0) == Trust.DISAGREES and f.boxes[1].state == State.ACTIVE
        status = f.quarantine.status()
        assert status["held_by_floor"] and "quarantine_min_active=3" in status["held_by_floor"]
        assert status["quarantined"] == 0
        # it keeps serving, but what it delivers unvouched is distrusted: listed for the trainer to drop
        assert status["delivered"]["distrusting"] == [f.boxes[1].id]


async def test_every_box_disagreeing_with_the_trainer_quarantines_nothing(fleet: Fleet) -> None:
    f = fleet
    live = [b.id for b in f.boxes]
    f.ledger.report(1, [BoxReport(i, 100, 0.5, 0.1) for i in live])
    assert f.quarantine.on_mismatch(live) == []
    assert all(b.state == State.ACTIVE for b in f.boxes) and f.quarantine.status()["fleet_wide"]
    f.ledger.report(2, [BoxReport(live[0], 100, 0.01, 0.0), BoxReport(live[1], 100, 0.01, 0.0),
                        BoxReport(live[2], 100, 0.6, 0.2)])
    assert f.quarantine.on_mismatch(live) == [live[2]]  # one box far above the median: its fault
    assert f.boxes[2].state == State.SYNCING


async def test_no_probe_majority_quarantines_nothing() -> None:
    async for f in make_fleet(2, QuarantineSettings(enabled=True, min_active=0, recheck_s=0)):
        await perturb(f.urls[1])  # never checked before: two boxes that differ, nobody can tell which
        await f.probes.check_all()
        assert {b.trust.state(0) for b in f.boxes} == {Trust.DISAGREES}
        assert all(b.state == State.ACTIVE for b in f.boxes) and f.quarantine.status()["fleet_wide"]


async def test_a_quarantined_box_serves_again_after_a_reload_and_a_passing_probe(fleet: Fleet) -> None:
    f = fleet
    bad = f.boxes[0]
    await f.probes.check_all()
    await perturb(bad.url)
    await f.probes.check_all()
    assert bad.quarantined is not None
    assert not f.registry.transition(bad, State.ACTIVE, "weights pushed")  # a push alone does not readmit it
    await f.quarantine.readmit()  # not reloaded yet: not even probed
    assert bad.state == State.SYNCING
    for box in f.boxes[1:]:  # the fleet moves to version 1
        f.registry.set_weight_version(box, 1)
        await f.probes.check(box)
    await reload_clean(f, bad, 1)
    await f.quarantine.readmit()
    assert bad.state == State.ACTIVE and bad.quarantined is None and bad.trust.state(1) == Trust.CHECKED
    assert f.quarantine.status()["lifted"] == 1 and f.quarantine.status()["quarantined_now"] == []


async def test_answers_delivered_after_the_last_passing_probe_are_listed_when_the_box_is_quarantined(
        fleet: Fleet) -> None:
    f = fleet
    bad = f.boxes[0]
    await f.probes.check_all()
    for other in f.boxes[1:]:  # every answer here is made on the box that goes bad
        assert f.generator.dispatcher.claim(other, 10_000)

    async def on_bad(rid: str) -> dict[str, Any]:
        answer = as_json(await f.generator.generate(decode(greedy(6, rid))))
        assert {s["instance"] for s in answer["meta_info"]["segments"]} == {bad.id}
        return answer

    await on_bad("vouched")
    assert await f.probes.check(bad) == Trust.CHECKED  # sent after "vouched" was made: vouches for it
    late = await on_bad("late")  # made after the last passing probe: provisional when delivered
    assert f.generator.migrator.provisional.status()["pending_segments"] == 1
    await perturb(bad.url)
    for other in f.boxes[1:]:
        f.generator.dispatcher.release(other, 10_000)
    await f.probes.check_all()
    assert bad.quarantined is not None
    page = f.generator.migrator.provisional.since(0)
    assert [(s["request_id"], s["instance"], s["start"], s["end"]) for s in page["samples"]] == \
        [("late", bad.id, 0, len(late["output_ids"]))]


async def test_a_reload_at_the_same_version_and_a_passing_probe_lift_the_quarantine(fleet: Fleet) -> None:
    """Weight sync pushes a quarantined box again at the version it serves (no newer one exists); the
    registry notes the push when it refuses to make the box active; the next passing probe lifts it."""
    f = fleet
    bad = f.boxes[1]
    await f.probes.check_all()
    await perturb(bad.url)
    await f.probes.check_all()
    assert bad.quarantined is not None and not bad.reloaded_in_quarantine
    assert f.quarantine.reloaded() == []
    await reload_clean(f, bad, 0)  # the same version: what weight sync's push of it does
    assert not f.registry.transition(bad, State.ACTIVE, "weights at version 0")  # refused, noted as a reload
    assert bad.reloaded_in_quarantine and f.quarantine.reloaded() == [bad]
    await f.quarantine.readmit()
    assert bad.state == State.ACTIVE and bad.quarantined is None and bad.trust.state(0) == Trust.CHECKED
    # a reload that leaves it wrong (or none at all): the probe keeps it out
    await f.probes.check_all()
    await perturb(bad.url)
    await f.probes.check_all()
    assert bad.quarantined is not None
    assert not f.registry.transition(bad, State.ACTIVE, "weights at version 0")  # a push that did not heal it
    await f.quarantine.readmit()
    assert bad.state == State.SYNCING and bad.quarantined is not None


async def test_a_quarantined_box_that_is_removed_is_forgotten_but_its_span_stays_listed(fleet: Fleet) -> None:
    f = fleet
    await f.probes.check_all()
    await perturb(f.urls[2])
    await f.probes.check_all()
    assert f.quarantine.status()["quarantined_now"] == [f.boxes[2].id]
    f.registry.transition(f.boxes[2], State.DEAD, "removed by request")
    status = f.quarantine.status()
    assert status["quarantined_now"] == [] and [s["instance"] for s in status["distrusted_spans"]] == [f.boxes[2].id]


# ------------------------------------------------------------------ between two attempts (issue 46, item 5)

async def _caught_between_attempts(f: Fleet, health: HealthRecorder, readmit: bool) -> dict[str, Any]:
    """A sequence makes tokens on box 0 (a probe vouches for the first few), box 0 stalls and the attempt fails;
    while the sequence waits for another box (the others are syncing), box 0 is quarantined, and with
    ``readmit`` reloaded at the same version and readmitted; then the others serve again. Its answer."""
    bad, others = f.boxes[0], f.boxes[1:]
    await f.probes.check_all()  # every box checked: the peers a later probe is judged against
    for box in others:
        assert f.registry.transition(box, State.SYNCING, "test: busy elsewhere")
    await post(bad.url, "/debug/faults", {"token_delay_s": 0.01, "stall_after_tokens": 14})
    dispatcher = f.generator.dispatcher
    base = dispatcher.fleet.streamed_tokens
    running = asyncio.ensure_future(f.generator.generate(decode(greedy(40))))
    await async_wait_until(lambda: dispatcher.fleet.streamed_tokens > base + 4)
    assert await f.probes.check(bad) == Trust.CHECKED  # vouches for what it made before the probe was sent
    await async_wait_until(lambda: health.failures and dispatcher.capacity.waiting == 1)  # stalled: between attempts
    assert f.quarantine.quarantine(bad, "test: caught") and bad.quarantined is not None
    if readmit:
        await post(bad.url, "/debug/faults", {"token_delay_s": 0.0, "stall_after_tokens": None})
        await reload_clean(f, bad, 0)  # weight sync's push at the version it serves
        assert not f.registry.transition(bad, State.ACTIVE, "weights at version 0")
        await f.quarantine.readmit()
        assert bad.state == State.ACTIVE and bad.quarantined is None  # serves again, at the same version
    assert dispatcher.capacity.waiting == 1 and not running.done()
    for box in others:
        assert f.registry.transition(box, State.ACTIVE, "test: back")
    answer: dict[str, Any] = as_json(await running)
    return answer


def _cut_on(answer: dict[str, Any], box: Instance) -> int:
    """The answer's first segment is ``box``'s, cut back to its vouched tokens (more than none): where."""
    first = answer["meta_info"]["segments"][0]
    kept = int(first["end"])
    assert first["instance"] == box.id and kept > 0 and f"cut back at token {kept}" in first["outcome"], first
    assert all(s["instance"] != box.id for s in answer["meta_info"]["segments"][1:])
    discarded = [s for s in answer["meta_info"]["discarded_segments"] if s["instance"] == box.id]
    assert discarded and discarded[0]["start"] == kept and discarded[0]["outcome"].startswith("distrusted")
    return kept


async def test_a_sequence_between_attempts_when_its_box_is_caught_is_cut_back_and_made_again() -> None:
    """It was not streaming when the quarantine cut the others back; it used to go on with the box's unvouched
    tokens and be listed as distrusted when it finished (dropped by the trainer, lost). Now it is cut back to
    its last vouched token before its next attempt, like the others, and delivered whole and trusted."""
    health = HealthRecorder()
    generation = dataclasses.replace(SETTINGS, stall_timeout_s=0.5, wait_timeout_s=30.0)
    async for f in make_fleet(3, QuarantineSettings(enabled=True, min_active=0, recheck_s=0), generation, health):
        reference = as_json(await f.generator.generate(decode(greedy(40))))["output_ids"]
        answer = await _caught_between_attempts(f, health, readmit=False)
        assert answer["output_ids"] == reference
        kept = _cut_on(answer, f.boxes[0])
        assert not any("distrusted" in s["outcome"] for s in answer["meta_info"]["segments"])
        assert f.generator.migrator.provisional.since(0)["samples"] == []  # nothing for the trainer to drop
        assert f.generator.stats["cut_back_tokens"] >= 14 - kept - 1


async def test_a_box_readmitted_at_the_same_version_never_vouches_for_what_it_made_before_it_was_caught() -> None:
    """The box is reloaded at the version it was caught at and serves again before the sequence goes on: its
    tokens from before the catch used to ride along and be vouched for by its next passing probe. Now they are
    cut back, and a later probe finds nothing of it to vouch for."""
    health = HealthRecorder()
    generation = dataclasses.replace(SETTINGS, stall_timeout_s=0.5, wait_timeout_s=30.0)
    async for f in make_fleet(3, QuarantineSettings(enabled=True, min_active=0, recheck_s=0), generation, health):
        reference = as_json(await f.generator.generate(decode(greedy(40))))["output_ids"]
        bad = f.boxes[0]
        answer = await _caught_between_attempts(f, health, readmit=True)
        assert answer["output_ids"] == reference
        _cut_on(answer, bad)
        assert await f.probes.check(bad) == Trust.CHECKED
        assert f.generator.migrator.provisional.pending(bad.id) == []
        assert f.generator.migrator.provisional.since(0)["samples"] == []


def test_a_probe_after_a_readmission_vouches_only_for_what_the_box_made_since() -> None:
    """Migrator.mark (what a passing probe vouches for) passes over a readmitted box's segments from before its
    quarantine, in running sequences and in answers, and an answer that still holds some is listed."""
    from rollout_manager.instances.registry import Kind
    from rollout_manager.rollout.migration import Migrator
    from rollout_manager.sglang.finish import FinishReason

    registry = Registry()
    a, b = (registry.add("127.0.0.1", port, Kind.REMOTE) for port in (1, 2))
    migrator = Migrator(Dispatcher(registry, LeastInFlight()), None, None, 1.0, lambda seq: None, {})  # type: ignore[arg-type]
    ledger = migrator.provisional

    def running(rid: str, *segments: Segment) -> SequenceState:
        seq = SequenceState(decode(greedy(8)).sequences[0].body, rid)
        seq.output_ids.extend(range(segments[-1].end))
        seq.segments[:] = list(segments)
        return seq

    old = running("old", Segment(a.id, a.endpoint, "0", 0, 4, "failed", trusted=2),
                  Segment(b.id, b.endpoint, "0", 4, 6))
    migrator.enter(1, old, b, "r1")
    assert ledger.distrust(a.id, "quarantined: test", quarantined=True) == 0 and ledger.era(a.id) == 1
    ledger.trust_again(a.id)  # reloaded at the same version, its probe passed: it serves again
    assert ledger.cut_at(old) == (2, "quarantined: test")  # what generation cuts before its next attempt
    new = running("new", Segment(a.id, a.endpoint, "0", 0, 3, era=ledger.era(a.id)))
    migrator.enter(2, new, a, "r2")
    assert migrator.mark(a, 0)() == 1  # the new era's segment only
    assert new.segments[0].trusted == 3 and old.segments[0].trusted == 2
    assert ledger.cut_at(new) is None
    old.finish = FinishReason.of("length", length=8)
    migrator.leave(1, old, old.segments[-1])  # delivered anyway (say its cut-back could not land): listed
    assert [(s["request_id"], s["instance"], s["first"]) for s in ledger.since(0)["samples"]] == [("old", a.id, 2)]
    assert old.segments[0].outcome == "failed; distrusted: quarantined: test"
