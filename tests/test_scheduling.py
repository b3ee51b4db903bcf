import math
import random
from typing import Any

import pytest

from rollout_manager.placement.instance_load import InstanceLoad
from rollout_manager.placement.least_in_flight import LeastInFlight
from rollout_manager.placement.policy import PlacementPolicy
from rollout_manager.placement.policy_registry import DEFAULT_POLICY, POLICY_NAMES, make_policy
from rollout_manager.placement.rate_meter import TokenRateMeter
from rollout_manager.placement.round_robin import RoundRobin
from rollout_manager.placement.throughput_aware import ThroughputAware


def load(iid, reqs=0, toks=0, rate=None, kind="remote"):
    return InstanceLoad(iid, kind, reqs, toks, rate)


# --- policies: common contract -------------------------------------------------------------


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_make_policy_names_and_protocol(name):
    p = make_policy(name)
    assert p.name == name
    assert isinstance(p, PlacementPolicy)


def test_policy_names_and_default():
    assert POLICY_NAMES == ("round_robin", "least_in_flight", "throughput_aware", "makespan")
    assert DEFAULT_POLICY in POLICY_NAMES


def test_make_policy_passes_kwargs_and_rejects_unknown():
    p = make_policy("throughput_aware", target_drain_s=5.0, min_concurrency=2)
    assert isinstance(p, ThroughputAware)
    assert (p.target_drain_s, p.min_concurrency, p.probe_in_flight) == (5.0, 2, 2)
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("random")
    with pytest.raises(TypeError):
        make_policy("round_robin", target_drain_s=1.0)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_empty_candidates_give_none(name):
    assert make_policy(name).pick([], 100, 0.0) is None


@pytest.mark.parametrize(
    "name,kw,may_hold",
    [
        ("round_robin", {}, False),
        ("least_in_flight", {}, False),
        ("least_in_flight", {"max_in_flight": 4}, True),
        ("throughput_aware", {"target_drain_s": 2.0, "min_concurrency": 2}, True),
    ],
)
def test_never_returns_an_id_outside_candidates(name, kw, may_hold):
    rng = random.Random(7)
    policy = make_policy(name, **kw)
    pool = [f"i{k}" for k in range(6)]
    for step in range(2000):
        ids = rng.sample(pool, rng.randint(1, len(pool)))
        cands = [
            load(i, rng.randint(0, 8), rng.randint(0, 4000), rng.choice([None, 0.0, 50.0, 500.0]))
            for i in ids
        ]
        got = policy.pick(cands, rng.randint(1, 1000), float(step))
        if got is None:
            assert may_hold
        else:
            assert got in ids


# --- round robin ----------------------------------------------------------------------------


def test_round_robin_cycles_in_id_order():
    rr = RoundRobin()
    cands = [load("b"), load("c"), load("a")]
    assert [rr.pick(cands, 1, t) for t in range(7)] == ["a", "b", "c", "a", "b", "c", "a"]


def test_round_robin_survives_membership_changes():
    rr = RoundRobin()
    assert rr.pick([load("a"), load("b"), load("c")], 1, 0) == "a"
    assert rr.pick([load("a"), load("b"), load("c")], 1, 0) == "b"
    # b leaves: continue after it, not from the start
    assert rr.pick([load("a"), load("c")], 1, 0) == "c"
    # d joins after the cursor
    assert rr.pick([load("a"), load("c"), load("d")], 1, 0) == "d"
    assert rr.pick([load("a"), load("c"), load("d")], 1, 0) == "a"


# --- least in flight ------------------------------------------------------------------------


def test_least_in_flight_prefers_fewest_requests_then_tokens_then_id():
    lif = LeastInFlight()
    assert lif.pick([load("a", 3, 10), load("b", 1, 900), load("c", 2, 0)], 1, 0) == "b"
    assert lif.pick([load("a", 2, 500), load("b", 2, 100), load("c", 3, 0)], 1, 0) == "b"
    assert lif.pick([load("b", 2, 100), load("a", 2, 100)], 1, 0) == "a"


def test_least_in_flight_holds_only_with_a_cap():
    full = [load("a", 4, 10), load("b", 4, 10)]
    assert LeastInFlight().pick(full, 1, 0) == "a"
    assert LeastInFlight(max_in_flight=4).pick(full, 1, 0) is None
    assert LeastInFlight(max_in_flight=4).pick(full + [load("c", 3, 10**6)], 1, 0) == "c"


# --- throughput aware -----------------------------------------------------------------------


def drive(policy, rates, n, request_tokens=100):
    """Place n requests that never finish; return how many each instance got."""
    loads = {iid: load(iid, 0, 0, r) for iid, r in rates.items()}
    counts = dict.fromkeys(rates, 0)
    for t in range(n):
        got = policy.pick(list(loads.values()), request_tokens, float(t))
        if got is None:
            break
        counts[got] += 1
        loads[got].in_flight_requests += 1
        loads[got].in_flight_tokens += request_tokens
    return counts


def test_throughput_aware_shares_work_in_proportion_to_rate():
    ta = ThroughputAware(target_drain_s=1e9, min_concurrency=1)
    counts = drive(ta, {"fast": 400.0, "mid": 200.0, "slow": 100.0}, 700)
    assert sum(counts.values()) == 700
    assert counts["fast"] == pytest.approx(400, abs=2)
    assert counts["mid"] == pytest.approx(200, abs=2)
    assert counts["slow"] == pytest.approx(100, abs=2)


def test_throughput_aware_picks_earliest_expected_completion():
    ta = ThroughputAware(target_drain_s=1e9, min_concurrency=1)
    # a: (900 + 100) / 100 = 10 s; b: (3000 + 100) / 1000 = 3.1 s, though b has more in flight
    assert ta.pick([load("a", 1, 900, 100.0), load("b", 6, 3000, 1000.0)], 100, 0) == "b"


def test_throughput_aware_caps_by_drain_time_and_holds_when_all_full():
    ta = ThroughputAware(target_drain_s=10.0, min_concurrency=2)
    counts = drive(ta, {"fast": 400.0, "slow": 100.0}, 1000)
    # drain <= 10 s: fast holds 4000 tokens (40 requests), slow 1000 (10 requests); then hold
    assert counts == {"fast": 40, "slow": 10}
    full = [load("fast", 40, 4000, 400.0), load("slow", 10, 1000, 100.0)]
    assert ta.pick(full, 100, 0) is None
    # after some work drains from slow it takes the next request
    full[1].in_flight_tokens = 850
    assert ta.pick(full, 100, 0) == "slow"


def test_throughput_aware_keeps_a_minimum_batch():
    ta = ThroughputAware(target_drain_s=1.0, min_concurrency=4)
    # drain time is far above the target, but below min_concurrency it still accepts work
    assert ta.pick([load("slow", 3, 30_000, 10.0)], 1000, 0) == "slow"
    assert ta.pick([load("slow", 4, 40_000, 10.0)], 1000, 0) is None


def test_throughput_aware_probes_unknown_rate_instances():
    ta = ThroughputAware(target_drain_s=60.0, min_concurrency=8, probe_in_flight=2)
    known = load("known", 0, 0, 10_000.0)
    new = load("new", 0, 0, None)
    assert ta.pick([known, new], 100, 0) == "new"  # served before the fast, measured one
    new.in_flight_requests = 1
    assert ta.pick([known, new], 100, 0) == "new"
    new.in_flight_requests = 2  # probe share used up: wait for its measurement
    assert ta.pick([known, new], 100, 0) == "known"
    assert ta.pick([new], 100, 0) is None
    new.token_rate = 50_000.0  # measured, and faster: now it wins on completion time
    assert ta.pick([known, new], 100, 0) == "new"


def test_throughput_aware_all_unknown_spreads_probes():
    ta = ThroughputAware(min_concurrency=3)
    counts = drive(ta, {"a": None, "b": None, "c": None}, 100)
    assert counts == {"a": 3, "b": 3, "c": 3}


def test_throughput_aware_zero_rate_is_last_resort_and_hard_cap():
    ta = ThroughputAware(target_drain_s=60.0, min_concurrency=4, max_in_flight=5)
    stalled = load("stalled", 0, 0, 0.0)
    ok = load("ok", 4, 400, 100.0)
    assert ta.pick([stalled, ok], 100, 0) == "ok"
    ok.in_flight_requests = 5  # hard cap reached
    assert ta.pick([stalled, ok], 100, 0) == "stalled"  # still below its batching floor
    stalled.in_flight_requests = 4
    assert ta.pick([stalled, ok], 100, 0) is None


@pytest.mark.parametrize(
    "kw",
    [{"target_drain_s": 0}, {"min_concurrency": 0}, {"max_in_flight": 0}],
)
def test_throughput_aware_rejects_bad_parameters(kw):
    with pytest.raises(ValueError):
        ThroughputAware(**kw)


# --- token rate meter -----------------------------------------------------------------------


def feed(meter, rate, start, duration, step=0.1):
    """Stream `rate` tokens/s in chunks every `step` seconds; return the end time."""
    t = start
    for _ in range(round(duration / step)):
        t += step
        meter.observe(round(rate * step), t)
    return t


def test_meter_unknown_until_min_busy_time():
    m = TokenRateMeter(tau_s=5.0, min_busy_s=1.0)
    assert m.rate(0.0) is None
    m.set_in_flight(3, 0.0)
    t = feed(m, 1000, 0.0, 0.5)
    assert m.rate(t) is None
    t = feed(m, 1000, t, 0.6)
    assert m.rate(t) == pytest.approx(1000, rel=0.01)


def test_meter_is_unbiased_early_and_late():
    m = TokenRateMeter(tau_s=5.0, min_busy_s=1.0)
    m.set_in_flight(1, 0.0)
    t = feed(m, 800, 0.0, 1.0)
    assert m.rate(t) == pytest.approx(800, rel=0.01)
    t = feed(m, 800, t, 60.0)
    assert m.rate(t) == pytest.approx(800, rel=0.01)


def test_meter_tracks_a_change_with_time_constant_tau():
    m = TokenRateMeter(tau_s=5.0)
    m.set_in_flight(1, 0.0)
    t = feed(m, 1000, 0.0, 100.0)
    t = feed(m, 500, t, 5.0)  # one tau at the new rate: ~63% of the way
    assert m.rate(t) == pytest.approx(500 + 500 * math.exp(-1), rel=0.02)
    t = feed(m, 500, t, 50.0)
    assert m.rate(t) == pytest.approx(500, rel=0.01)


def test_meter_chunks_within_the_fold_interval_count_as_if_folded_one_by_one():
    """Thousands of chunks a second are summed between folds; the rate read at any time is what
    folding each chunk at once would give (within 0.1%), and nothing is lost across idle time."""
    each, summed = TokenRateMeter(tau_s=5.0, min_busy_s=0.1), TokenRateMeter(tau_s=5.0, min_busy_s=0.1)
    each.FOLD_S = 0.0
    for m in (each, summed):
        m.set_in_flight(4, 0.0)
    t = 0.0
    for k in range(3000):  # 2 ms apart, bursty sizes
        t += 0.002
        for m in (each, summed):
            m.observe(32 if k % 3 else 96, t)
        if k % 250 == 249:
            assert summed.rate(t + 0.001) == pytest.approx(each.rate(t + 0.001), rel=1e-3)
    for m in (each, summed):
        m.set_in_flight(0, t + 0.001)
    assert summed.rate(t + 100.0) == pytest.approx(each.rate(t + 100.0), rel=1e-3)
    assert summed._pending == 0


def test_meter_freezes_while_idle():
    m = TokenRateMeter(tau_s=5.0)
    m.set_in_flight(2, 0.0)
    t = feed(m, 1000, 0.0, 20.0)
    m.set_in_flight(0, t)
    before = m.rate(t)
    assert m.rate(t + 1000.0) == pytest.approx(before)
    # back to work at the same speed: no warm-up dip
    m.set_in_flight(1, t + 1000.0)
    t2 = feed(m, 1000, t + 1000.0, 1.0)
    assert m.rate(t2) == pytest.approx(1000, rel=0.01)


def test_meter_idle_time_does_not_count_towards_min_busy():
    m = TokenRateMeter(tau_s=5.0, min_busy_s=1.0)
    m.set_in_flight(1, 0.0)
    feed(m, 1000, 0.0, 0.5)
    m.set_in_flight(0, 0.5)
    assert m.rate(100.0) is None


def test_meter_decays_when_busy_but_stalled():
    m = TokenRateMeter(tau_s=5.0)
    m.set_in_flight(4, 0.0)
    t = feed(m, 1000, 0.0, 100.0)
    # work in flight, no tokens for one tau: the estimate falls toward zero
    assert m.rate(t + 5.0) == pytest.approx(1000 * math.exp(-1), rel=0.02)
    assert m.rate(t + 5.0) == m.rate(t + 5.0)  # rate() does not mutate
    m.observe(0, t + 5.0)
    assert m.rate(t + 5.0) == pytest.approx(1000 * math.exp(-1), rel=0.02)


def test_meter_rejects_bad_parameters():
    with pytest.raises(ValueError):
        TokenRateMeter(tau_s=0)
    with pytest.raises(ValueError):
        TokenRateMeter(min_busy_s=-1)


# --- the simulator's lower bound on any schedule (benchmarks/bench_scheduling.py) -------------


def _bench() -> Any:
    """benchmarks/bench_scheduling.py as a module (it is a script, not part of the package)."""
    pytest.importorskip("scipy")
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_scheduling.py"
    spec = importlib.util.spec_from_file_location("bench_scheduling", path)
    assert spec is not None and spec.loader is not None
    mod = sys.modules.get(spec.name)
    if mod is None:
        mod = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # its dataclasses look it up
        spec.loader.exec_module(mod)
    return mod


def test_opt_bound_is_exact_where_the_optimum_is_known() -> None:
    bench = _bench()
    args = bench.parse_args(["--speeds", "4", "--base-rate", "25", "--prompt-tokens", "500"])
    pre = 500 / (args.prefill_factor * 100)
    # one sequence: alone at the lone rate, after its prefill
    assert bench.opt_lower_bound([3000], args, None, None) == pytest.approx(pre + 3000 / 100, rel=1e-6)
    # two equal sequences: together in a batch of two beats one after the other
    both = 2 * 3000 / (2 * 100 / (1 + 1 / args.batch_half))
    assert bench.opt_lower_bound([3000, 3000], args, None, None) == pytest.approx(pre + both, rel=1e-3)


@pytest.mark.slow  # runs for seconds
def test_opt_bound_lies_between_the_tight_bound_and_every_simulated_schedule() -> None:
    """The bound must never exceed a makespan some schedule reached (else it proves nothing), and it
    adds the cost of running long sequences in small batches to the fluid bound."""
    bench = _bench()
    for preempt in ("none", "fastest"):
        args = bench.parse_args(["--requests", "96", "--seed", "3", "--preempt", preempt])
        lengths = bench.make_lengths(args)
        insts = bench.make_instances(args)
        victim = bench.preempt_index(args)
        peak = sum(i.peak for i in insts)
        t_p = args.preempt_frac * sum(lengths) / peak if victim is not None else None
        fluid = bench.fluid_bound(sum(lengths), peak, peak - (insts[victim].peak if victim is not None else 0), t_p)
        tight = max(fluid, bench.longest_alone_bound(max(lengths), args, victim, t_p))
        bound = bench.opt_lower_bound(lengths, args, victim, t_p)
        assert bound >= fluid
        clair = bench.simulate("c", bench.Clairvoyant(args.speeds, args.max_running), sorted(lengths, reverse=True),
                               args, t_p, victim, bench.TailMigration(batch_half=args.batch_half))
        online = bench.simulate("o", make_policy("throughput_aware"), lengths, args, t_p, victim,
                                bench.TailMigration(batch_half=args.batch_half))
        assert max(bound, tight) <= min(clair.makespan, online.makespan)
