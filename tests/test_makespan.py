"""The makespan placement policy (placement.makespan): pure decisions, and the dispatcher running them.

No processes: the policy on hand-built loads, then the dispatcher with a registry of instances that are
never contacted.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from fakes import FakeClock, run_pending

from rollout_manager.instances.registry import Instance, Kind, Registry, State
from rollout_manager.placement.ask import Ask
from rollout_manager.placement.box_speed import StepModel
from rollout_manager.placement.dispatch import Dispatcher
from rollout_manager.placement.instance_load import InstanceLoad
from rollout_manager.placement.makespan import BoxWork, Makespan
from rollout_manager.placement.policy_registry import make_policy

FAST, SLOW = StepModel(0.01, 0.0005), StepModel(0.02, 0.001)


def load(iid: str, step: StepModel | None, n: int = 0, work: float = 0.0, longest: float = 0.0) -> InstanceLoad:
    return InstanceLoad(iid, "remote", n, 0, step=step, predicted_tokens=work, longest_tokens=longest)


def place(policy: Makespan, loads: list[InstanceLoad], predicted: float, **kw: object) -> str:
    iid = policy.place(loads, 4096, 0.0, predicted, **kw)  # type: ignore[arg-type]
    assert iid is not None
    c = next(c for c in loads if c.instance_id == iid)
    c.in_flight_requests += 1
    c.predicted_tokens += predicted
    c.longest_tokens = max(c.longest_tokens, predicted)
    return iid


def test_the_tail_goes_to_the_fastest_box_and_the_bulk_beside_it_elsewhere() -> None:
    """Longest first: the long one takes the fast box; the short ones fill the slow box while its drain
    stays under the fast box's, so none runs beside the tail to slow it."""
    policy, loads = Makespan(), [load("fast", FAST), load("slow", SLOW)]
    assert place(policy, loads, 3000) == "fast"
    assert {place(policy, loads, 200) for _ in range(40)} == {"slow"}
    assert loads[0].in_flight_requests == 1


def test_short_work_goes_to_the_tail_box_only_once_elsewhere_is_as_late() -> None:
    policy = Makespan()
    loads = [load("tail", FAST, n=1, work=3000, longest=3000), load("bulk", FAST, n=60, work=12000, longest=300)]
    # bulk drains in 0.01 * 300 + 0.0005 * 12000 = 9 s, the tail box in 31.5 s: short work goes to bulk
    assert place(policy, loads, 200) == "bulk"
    loads[1].predicted_tokens = 60000  # now bulk drains in 33 s: past the tail box, which takes it
    assert place(policy, loads, 200) == "tail"


def test_an_upper_quantile_keeps_short_work_off_a_box_given_a_group_predicted_long() -> None:
    """The longest of a group's samples is nearer their upper quantile than their median: counted so, the
    box that took one of a long group looks as late as it may be, and short work goes elsewhere."""
    slow = load("slow", StepModel(0.017, 0.00023), n=10, work=5000, longest=500)
    median_only = [load("fast", StepModel(0.006, 0.00008)), slow]
    assert place(Makespan(), median_only, 1000) == "fast"
    assert place(Makespan(), median_only, 300) == "fast"  # 6.1 s there against 9.7 s on the slow box
    policy = Makespan()
    loads = [load("fast", StepModel(0.006, 0.00008)), load("slow", StepModel(0.017, 0.00023), n=10, work=5000,
                                                              longest=500)]
    assert policy.place(loads, 4096, 0.0, 1000, high=2500) == "fast"
    loads[0].in_flight_requests, loads[0].predicted_tokens, loads[0].longest_tokens = 1, 1000, 2500
    assert place(policy, loads, 300) == "slow"  # the fast box may run 15 s: the slow box's 9.7 s is sooner
    box = BoxWork()
    box.placed(1000, 2500)
    assert (box.tokens, box.longest) == (1000, 2500)


def test_an_equal_batch_is_spread_by_speed() -> None:
    policy, loads = Makespan(), [load("fast", FAST), load("slow", SLOW)]
    chosen = [place(policy, loads, 500) for _ in range(90)]
    drains = [c.step.drain_s(c.longest_tokens, c.predicted_tokens) for c in loads]  # type: ignore[union-attr]
    assert abs(drains[0] - drains[1]) <= SLOW.b * 500  # both end together, within one sequence's share
    assert chosen.count("fast") > 2 * chosen.count("slow")  # twice as fast per step, and its fixed part too


def test_at_a_piece_boundary_it_stays_unless_moving_wins_more_than_a_prefill() -> None:
    policy = Makespan(prefill_factor=200.0, move_overhead_s=0.3)
    here = load("here", SLOW, n=10, work=5000, longest=1000)
    there = load("there", SLOW, n=8, work=4000, longest=1000)
    # There drains 1 s sooner with it (0.001 * 1000 fewer tokens beside it) but a move prefills 8,000
    # tokens: 8000 * 0.021 / 200 + 0.3 = 1.14 s. It stays.
    assert policy.place([here, there], 4096, 0.0, 1000, prefer="here", context_tokens=8000) == "here"
    # With a short context the move costs 0.3 s and wins.
    assert policy.place([here, there], 4096, 0.0, 1000, prefer="here", context_tokens=100) == "there"
    # Far busier here: it moves even with the long context.
    here.predicted_tokens = 40000
    assert policy.place([here, there], 4096, 0.0, 1000, prefer="here", context_tokens=8000) == "there"


def test_before_any_box_is_measured_it_places_by_predicted_work() -> None:
    policy = Makespan()
    loads = [load("a", None, n=3, work=900), load("b", None, n=5, work=600)]
    assert policy.place(loads, 4096, 0.0, 100) == "b"
    assert policy.place([], 4096, 0.0, 100) is None
    assert Makespan(max_in_flight=5).place(loads, 4096, 0.0, 100) == "a"


def test_without_a_prediction_it_counts_unknown_tokens_within_the_budget() -> None:
    policy = Makespan(unknown_tokens=512)
    assert policy.expected(4096, None) == 512 and policy.expected(100, None) == 100
    assert policy.expected(4096, 2000.0) == 2000 and policy.expected(1000, 2000.0) == 1000
    assert make_policy("makespan").name == "makespan"
    with pytest.raises(ValueError):
        Makespan(unknown_tokens=0)


def test_box_work_follows_chunks_and_ends() -> None:
    box = BoxWork()
    box.placed(1000)
    box.placed(200)
    assert (box.tokens, box.longest) == (1200, 1000)
    box.made(100, running=2)  # 100 tokens over two sequences: 50 steps
    assert (box.tokens, box.longest) == (1100, 950)
    box.ended(running_before=2)  # one of two ended: its mean share goes
    assert box.tokens == 550 and box.longest == 550
    box.ended(running_before=1)
    assert (box.tokens, box.longest) == (0.0, 0.0)


# ---------------------------------------------------------------------------- in the dispatcher
def pool(n: int, clock: FakeClock, bound: int = 0) -> tuple[Dispatcher, list[Instance]]:
    registry = Registry(clock=clock)
    d = Dispatcher(registry, Makespan(), clock=clock, max_in_flight_per_instance=bound)
    insts = []
    for k in range(n):
        inst = registry.add("127.0.0.1", 30000 + k, Kind.REMOTE)
        assert registry.transition(inst, State.ACTIVE, "test: healthy")
        insts.append(inst)
    return d, insts


async def test_waiting_sequences_are_placed_longest_predicted_first() -> None:
    clock = FakeClock()
    d, (inst,) = pool(1, clock, bound=1)
    first = d.try_acquire(Ask(100, predicted=10))
    assert first is inst
    order: list[float | None] = []

    async def wait(predicted: float | None) -> None:
        got = await d.acquire(Ask(4096, predicted=predicted), 60.0)
        order.append(predicted)
        await asyncio.sleep(0)
        d.release(got, 0)

    tasks = [asyncio.create_task(wait(p)) for p in (100.0, None, 3000.0, 700.0, None, 3000.0)]
    await run_pending()
    d.release(inst, 0)
    for _ in range(len(tasks)):
        await run_pending()
    await asyncio.gather(*tasks)
    assert order == [3000.0, 3000.0, 700.0, 100.0, None, None]


async def test_the_dispatcher_learns_box_speed_from_progress_and_counts_predicted_work() -> None:
    clock = FakeClock()
    d, (a, b) = pool(2, clock)
    assert d.try_acquire(Ask(4096, predicted=2000)) is a  # nothing measured: least predicted work, then id
    assert d.try_acquire(Ask(4096, predicted=100)) is b
    assert (d.fleet.work[a.id].tokens, d.fleet.work[b.id].longest) == (2000, 100)
    for _ in range(200):  # a streams a token every 20 ms
        clock.now += 0.02
        d.progress(a, 1, clock.now)
    model = d.fleet.speeds.model(a.id)
    assert model is not None and model.step_s(1) == pytest.approx(0.02, rel=0.01)
    assert d.fleet.work[a.id].tokens == pytest.approx(1800)
    assert d.fleet.speeds.model(b.id) == model  # b never streamed: it is the fleet's median box, not a slow one
    assert d.fleet.load_of(a, clock.now).step == model
    d.release(a, 0)
    assert d.fleet.work[a.id].tokens == 0


async def test_the_dispatcher_counts_the_upper_quantile_as_a_boxs_longest() -> None:
    """``high`` reaches the box's work: the box given a long group's sample counts its upper quantile as its
    longest (what the next placements read), its median in the total."""
    clock = FakeClock()
    d, (a, b) = pool(2, clock)
    for inst in (a, b):  # both measured alike: 10 ms a token
        d.try_acquire(Ask(4096, predicted=10))
        for _ in range(50):
            clock.now += 0.01
            d.progress(inst, 1, clock.now)
        d.release(inst, 0)
    first = d.try_acquire(Ask(4096, predicted=1000, high=2500))
    assert first is not None and (d.fleet.work[first.id].tokens, d.fleet.work[first.id].longest) == (1000, 2500)
    assert d.fleet.load_of(first, clock.now).longest_tokens == 2500


async def test_a_burst_is_placed_longest_predicted_first_even_with_room() -> None:
    """A step's requests arrive in one event-loop turn: with room for two of four, the two predicted
    longest get it, whatever the order they came in."""
    clock = FakeClock()
    d, (inst,) = pool(1, clock, bound=2)
    tasks = [asyncio.create_task(d.acquire(Ask(4096, predicted=p), 60.0)) for p in (100.0, 3000.0, 50.0, 700.0)]
    await run_pending()
    placed = [p for p, t in zip((100.0, 3000.0, 50.0, 700.0), tasks) if t.done()]
    assert sorted(placed) == [700.0, 3000.0] and inst.load.in_flight == 2
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_burst_over_several_turns_is_gathered_when_asked() -> None:
    """A step's requests reach the manager over many event-loop turns (one HTTP request each): with
    ``gather_s`` the burst is placed once, longest predicted first; without, the first comer takes the room."""
    for gather_s, first in ((0.0, 100.0), (0.05, 3000.0)):
        registry = Registry(clock=time.monotonic)
        d = Dispatcher(registry, Makespan(), max_in_flight_per_instance=1, gather_s=gather_s)
        inst = registry.add("127.0.0.1", 30000, Kind.REMOTE)
        assert registry.transition(inst, State.ACTIVE, "test: healthy")
        early = asyncio.create_task(d.acquire(Ask(4096, predicted=100.0), 60.0))
        await run_pending()  # the next request comes a turn later
        late = asyncio.create_task(d.acquire(Ask(4096, predicted=3000.0), 60.0))
        done, _ = await asyncio.wait([early, late], timeout=5.0, return_when=asyncio.FIRST_COMPLETED)
        assert [100.0 if t is early else 3000.0 for t in done] == [first], gather_s
        for t in (early, late):
            t.cancel()
        await asyncio.gather(early, late, return_exceptions=True)


def test_before_any_box_is_measured_a_sequence_stays_where_its_prefix_is() -> None:
    loads = [load("a", None, n=9, work=9000), load("b", None)]
    assert Makespan().place(loads, 4096, 0.0, 100, prefer="a") == "a"
    assert Makespan(max_in_flight=9).place(loads, 4096, 0.0, 100, prefer="a") == "b"


async def test_at_a_piece_boundary_the_dispatcher_keeps_it_where_its_prefix_is_unless_a_move_pays() -> None:
    """What a divided rollout meets at each piece boundary: ``acquire(prefer=<its box>, predicted=...,
    context=...)``. A little more work beside it does not pay a long prefill; a lot more does."""
    clock = FakeClock()
    d, (a, b) = pool(2, clock)
    for inst in (a, b):  # both measured: 20 ms a step with one running
        d.fleet.speeds.add(inst.id, 1, 0.02, 2.0)

    def load_a(sequences: int, predicted: float) -> None:  # what a holds besides the sequence at its boundary
        a.load.in_flight += sequences
        d.capacity.in_flight += sequences
        for _ in range(sequences):
            d.fleet.work.setdefault(a.id, BoxWork()).placed(predicted)

    load_a(3, 300)
    placed = await d.acquire(Ask(4096, prefer=a.id, predicted=500, context=20000), 60.0)
    assert placed is a  # b would end ~0.3 s sooner; a 20,000-token prefill costs 2 s
    d.release(placed, 0)
    load_a(40, 2000)
    placed = await d.acquire(Ask(4096, prefer=a.id, predicted=500, context=20000), 60.0)
    assert placed is b  # now a would end far later: the move pays
