"""The box speed model (placement.box_speed): decode step time by running count, learned from stream timing.

Synthetic streams of a box whose step costs ``a + b * n``, no processes, time an argument; and what the
manager's status and metrics show of the learned curves (its real app, in process).
"""

from __future__ import annotations

import random

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support import free_port

from rollout_manager.instances.registry import Kind, State
from rollout_manager.ops import render_status
from rollout_manager.placement.box_speed import BoxSpeeds, StepFit, StepModel
from rollout_manager.placement.instance_load import InstanceLoad
from rollout_manager.placement.makespan import Makespan
from rollout_manager.placement.rate_meter import TokenRateMeter
from rollout_manager.placement.throughput_aware import ThroughputAware

A, B = 0.02, 0.001  # seconds per step, and per running sequence per step (a 7B-class GPU box, roughly)


def stream(iid: str, n: int, seconds: float, t0: float, speeds: BoxSpeeds, meter: TokenRateMeter | None = None,
           a: float = A, b: float = B, every: int = 4) -> float:
    """``n`` sequences decode on ``iid`` for ``seconds`` from ``t0``; each streams a chunk every ``every``
    steps, as SGLang's stream interval does. Returns the end time."""
    step = a + b * n
    t, k = t0, 0
    speeds.busy(iid)
    if meter is not None:
        meter.set_in_flight(n, t)
    while t < t0 + seconds:
        t += step
        k += 1
        if k % every == 0:
            for _ in range(n):
                speeds.observe(iid, every, n, t)
                if meter is not None:
                    meter.observe(every, t)
    if meter is not None:
        meter.set_in_flight(0, t)
    return t


def test_step_model_drain_time_is_the_sum_of_its_steps() -> None:
    """``a * longest + b * total``: what stepping the batch one token at a time gives."""
    model, left = StepModel(0.02, 0.001), [300, 120, 120, 40, 7]
    t, rem = 0.0, list(left)
    while any(rem):
        running = [r for r in rem if r]
        t += model.step_s(len(running))
        rem = [max(r - 1, 0) for r in rem]
    assert model.drain_s(max(left), sum(left)) == pytest.approx(t)


def test_the_fit_recovers_a_and_b_from_a_box_seen_at_several_counts() -> None:
    speeds = BoxSpeeds()
    t = 0.0
    for n in (1, 4, 16, 48):
        t = stream("x", n, 5.0, t, speeds) + 1.0
    m = speeds.model("x")
    assert m is not None
    assert m.a == pytest.approx(A, rel=0.05) and m.b == pytest.approx(B, rel=0.05)


def test_the_first_chunk_after_idle_does_not_count() -> None:
    """It arrives after a prefill and a queue wait, not after decode steps: counting it would make a box
    that is given work in short bursts look slow."""
    fit = StepFit(window_s=0.5, tau_s=60.0)
    fit.restart()
    assert not fit.observe(1, 1, 100.0)  # the first token after 100 s of prefill and waiting: opens the window
    t = 100.0
    for _ in range(100):
        t += 0.021
        fit.observe(1, 1, t)
    m = fit.fit(StepModel(1.0, 1 / 64))
    assert m is not None and m.step_s(1) == pytest.approx(0.021, rel=0.01)


def bursty_stream(speeds: BoxSpeeds, a: float, b: float, interval: int, gaps: bool) -> StepModel:
    """64 sequences start together on one box (``a + b n`` a step), lognormal lengths, a chunk each for its
    first token and then every ``interval``: their chunks come in bursts, as from SGLang under a GRPO step.
    ``gaps``: each sequence's chunks timed from its previous one (what the dispatcher reports), else the
    box's chunks windowed."""
    rng = random.Random(1)
    lengths = [max(8, min(4096, int(rng.lognormvariate(6.0, 1.0)))) for _ in range(64)]
    made, sent, last = [0] * 64, [0] * 64, [None] * 64
    running, t = set(range(64)), 0.33  # a prefill first
    speeds.busy("x")
    while running:
        n = len(running)
        t += a + b * n
        for i in list(running):
            made[i] += 1
            if made[i] == 1 or made[i] % interval == 0 or made[i] == lengths[i]:
                tokens, sent[i] = made[i] - sent[i], made[i]
                if not gaps:
                    speeds.observe("x", tokens, n, t)
                elif last[i] is not None:
                    speeds.observe_gap("x", tokens, n, t - last[i], t)
                last[i] = t
            if made[i] == lengths[i]:
                running.discard(i)
    model = speeds.model("x")
    assert model is not None
    return model


def test_a_boxs_curve_is_right_from_bursty_chunks_timed_per_sequence() -> None:
    """Chunks every 64 tokens from sequences that started together come in bursts: windows over the box's
    chunks close inside a burst and count a fraction of the tokens made, and put the whole step on the
    per-sequence part; each sequence's gaps between chunks give the curve exactly."""
    for a, b in ((0.006, 0.00008), (0.0171, 0.000229)):
        model = bursty_stream(BoxSpeeds(), a, b, 64, gaps=True)
        assert model.a == pytest.approx(a, rel=0.03) and model.b == pytest.approx(b, rel=0.1)
    windowed = bursty_stream(BoxSpeeds(), 0.006, 0.00008, 64, gaps=False)
    assert windowed.a < 0.003  # what the windows made of it: the fixed part lost


def test_a_box_never_measured_is_the_fleets_median_box_and_none_before_any() -> None:
    speeds = BoxSpeeds()
    assert speeds.model("new") is None
    stream("a", 8, 3.0, 0.0, speeds, a=0.02)
    stream("b", 8, 3.0, 0.0, speeds, a=0.04)
    stream("c", 8, 3.0, 0.0, speeds, a=0.03)
    fleet = speeds.model("new")
    assert fleet is not None and not speeds.measured("new")
    assert fleet.step_s(8) == pytest.approx(speeds.model("c").step_s(8), rel=0.01)  # type: ignore[union-attr]
    speeds.forget("b")
    assert speeds.model("b") is not None and not speeds.measured("b")


def test_a_box_seen_at_one_count_takes_the_fleets_slope_at_its_own_level() -> None:
    """Its level is measured; its slope is not, so it is the fleet's, scaled: a lightly loaded box is
    judged at higher counts as the boxes that ran them show, not as a constant-rate box."""
    speeds = BoxSpeeds()
    t = 0.0
    for n in (2, 16, 48):
        t = stream("busy", n, 4.0, t, speeds) + 1.0
    stream("light", 1, 4.0, 0.0, speeds, a=2 * A, b=2 * B)  # twice as slow, seen with one sequence only
    busy, light = speeds.model("busy"), speeds.model("light")
    assert busy is not None and light is not None
    assert light.step_s(1) == pytest.approx(2 * (A + B), rel=0.02)
    assert light.step_s(32) == pytest.approx(2 * busy.step_s(32), rel=0.1)


def pick_four(policy: ThroughputAware | Makespan, loads: list[InstanceLoad], tokens: int = 1900) -> list[str]:
    """Place four sequences of ``tokens`` one after the other, counting each placement as the dispatcher
    does."""
    chosen = []
    for _ in range(4):
        iid = policy.pick(loads, tokens, 10.0)
        assert iid is not None
        c = next(c for c in loads if c.instance_id == iid)
        c.in_flight_requests += 1
        c.in_flight_tokens += tokens
        c.predicted_tokens += tokens
        c.longest_tokens = max(c.longest_tokens, tokens)
        chosen.append(iid)
    return chosen


def test_a_box_given_little_no_longer_looks_slow() -> None:
    """The reported failure: two idle, identical boxes; one had served one sequence at a time, the other
    a batch of sixteen that finished a few at a time. Ranked by the aggregate rate each measured, the first looks
    several times slower than it is, and four 1,900-token sequences all go to the other. Ranked by the
    step model at the count a placement would leave, they are the same box, and the four are split two
    and two."""
    speeds = BoxSpeeds()
    meters = {"a": TokenRateMeter(), "b": TokenRateMeter()}
    stream("a", 1, 6.0, 0.0, speeds, meters["a"])
    t = 0.0
    for n in (16, 16, 16, 12, 8, 4):
        t = stream("b", n, 1.2, t, speeds, meters["b"])
    now = 10.0

    def loads(with_model: bool) -> list[InstanceLoad]:
        return [InstanceLoad(i, "remote", 0, 0, meters[i].rate(now), step=speeds.model(i) if with_model else None)
                for i in ("a", "b")]

    old = loads(with_model=False)
    assert old[1].token_rate > 4 * old[0].token_rate  # type: ignore[operator]
    assert pick_four(ThroughputAware(), old) == ["b"] * 4  # the failure, reproduced
    assert sorted(pick_four(ThroughputAware(), loads(with_model=True))) == ["a", "a", "b", "b"]
    assert sorted(pick_four(Makespan(), loads(with_model=True))) == ["a", "a", "b", "b"]


def test_a_box_not_yet_measured_gets_work_beside_measured_ones() -> None:
    speeds = BoxSpeeds()
    stream("a", 8, 5.0, 0.0, speeds)
    loads = [InstanceLoad(i, "remote", 0, 0, step=speeds.model(i)) for i in ("a", "new")]
    assert sorted(pick_four(Makespan(), loads)) == ["a", "a", "new", "new"]


async def test_each_boxs_learned_speed_curve_shows_in_status_and_metrics(api) -> None:
    """An operator sees what the scheduler places by: each box's step curve, its own once measured, the
    fleet's median box until then (status), and the measured ones' base and per-sequence parts (metrics)."""
    manager, client = api  # nothing calls these boxes: the curves are fed to the manager's own model
    fast, slow = (manager.registry.add("127.0.0.1", free_port(), Kind.REMOTE) for _ in range(2))
    for inst in (fast, slow):
        assert manager.registry.transition(inst, State.ACTIVE, "test: healthy")

    async def boxes() -> dict[str, object]:
        r = await client.get("/get_instances_status")
        assert r.status == 200
        return {i["endpoint"]: i["decode_step"] for i in (await r.json())["instances"]}

    assert await boxes() == {fast.endpoint: None, slow.endpoint: None}  # nothing measured: nothing to show
    speeds = manager.dispatcher.fleet.speeds
    for n in (4, 16, 32):  # the fast box seen at several counts: 6 ms + 0.08 ms a sequence
        speeds.add(fast.id, n, 0.006 + 0.00008 * n, 1.0)
    shown = await boxes()
    mine, fleets = shown[fast.endpoint], shown[slow.endpoint]
    assert mine["measured"] and mine["base_ms"] == pytest.approx(6.0, rel=0.01)
    assert mine["per_sequence_ms"] == pytest.approx(0.08, rel=0.05)
    assert mine["lone_tokens_per_s"] == pytest.approx(1 / 0.00608, rel=0.01) and mine["seen_s"] == 3.0
    assert mine["full_running"] == manager.dispatcher.capacity.bound_of(fast)
    assert not fleets["measured"] and fleets["base_ms"] == mine["base_ms"]  # the fleet's median box stands in
    st = await (await client.get("/get_instances_status")).json()
    lines = {line.split()[0]: line for line in render_status(st, "http://m").splitlines()[2:]}
    assert " 6+0.08ms " in lines[fast.endpoint] and " ~6+0.08ms " in lines[slow.endpoint]  # `rollout-manager status`

    r = await client.get("/metrics")
    samples = {(s.name, s.labels.get("endpoint"), s.labels.get("part")): s.value
               for f in text_string_to_metric_families(await r.text()) for s in f.samples}
    name = "rollout_manager_instance_decode_step_seconds"
    assert samples[(name, fast.endpoint, "base")] == pytest.approx(0.006, rel=0.01)
    assert samples[(name, fast.endpoint, "per_sequence")] == pytest.approx(0.00008, rel=0.05)
    assert (name, slow.endpoint, "base") not in samples  # absent until measured
