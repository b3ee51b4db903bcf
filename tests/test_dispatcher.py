"""Dispatcher accounting and waiting, in process (registry and dispatcher only, no HTTP)."""

from __future__ import annotations

import asyncio
import time

import pytest
from fakes import FakeClock, run_pending

from rollout_manager.errors import Unavailable
from rollout_manager.instances.registry import Instance, Kind, Registry, State
from rollout_manager.placement.ask import Ask
from rollout_manager.placement.dispatch import Dispatcher
from rollout_manager.placement.least_in_flight import LeastInFlight


def active(registry: Registry, n: int, kind: Kind = Kind.REMOTE, first_port: int = 30000) -> list[Instance]:
    out = []
    for i in range(n):
        inst = registry.add("127.0.0.1", first_port + i, kind)
        assert registry.transition(inst, State.ACTIVE, "test: healthy")
        out.append(inst)
    return out


def make(max_in_flight: int | None = None, clock: FakeClock | None = None) -> tuple[Registry, Dispatcher]:
    registry = Registry(clock=clock) if clock else Registry()
    kw = {"clock": clock} if clock else {}
    return registry, Dispatcher(registry, LeastInFlight(max_in_flight), **kw)


async def test_acquire_and_release_account_requests_and_tokens() -> None:
    registry, d = make()
    a, b = active(registry, 2)
    first = d.try_acquire(Ask(100))
    second = d.try_acquire(Ask(50))
    assert (first, second) == (a, b)  # least in flight: the second goes to the idle one
    assert (a.load.in_flight, a.load.in_flight_tokens) == (1, 100)
    d.progress(a, 30, 0.0)  # 30 tokens streamed: 70 of the budget still outstanding
    assert a.load.in_flight_tokens == 70
    d.release(a, 100 - 30)  # finished early (a stop token): the unused budget is returned
    assert (a.load.in_flight, a.load.in_flight_tokens) == (0, 0)
    d.release(b, 50)
    assert (b.load.in_flight, b.load.in_flight_tokens) == (0, 0)
    d.release(b, 50)  # an extra release never goes negative
    assert (b.load.in_flight, b.load.in_flight_tokens) == (0, 0)


def test_registry_counts_follow_every_transition() -> None:
    """``Registry.count`` (read per request) agrees with a scan of the pool through joins, moves and removals."""
    registry = Registry()
    remote = active(registry, 3)
    local = active(registry, 2, Kind.LOCAL, first_port=31000)
    registry.add("127.0.0.1", 32000, Kind.REMOTE)  # pending
    registry.transition(remote[0], State.DRAINING, "test")
    registry.transition(remote[0], State.DEAD, "test")
    registry.transition(local[1], State.SYNCING, "test")
    for state in State:
        for kind in Kind:
            assert registry.count(state, kind) == len(registry.in_state(state, kind=kind)), (state, kind)
    assert (registry.count(State.ACTIVE, Kind.REMOTE), registry.count(State.ACTIVE, Kind.LOCAL)) == (2, 1)


async def test_only_active_instances_take_work() -> None:
    registry, d = make()
    pending = registry.add("127.0.0.1", 29999, Kind.REMOTE)
    (a,) = active(registry, 1)
    assert registry.transition(a, State.SYNCING, "test")
    assert d.try_acquire(Ask(10)) is None and pending.load.in_flight == 0
    assert registry.transition(a, State.ACTIVE, "test")
    assert d.try_acquire(Ask(10)) is a


async def test_local_instances_first_only_while_the_window_is_open() -> None:
    registry, d = make()
    (remote,) = active(registry, 1)
    (local,) = active(registry, 1, Kind.LOCAL, first_port=31000)
    assert d.try_acquire(Ask(10)) is remote  # window closed: remote only, even though the local one is idle
    assert d.local.open(budget_s=60)
    try:
        assert d.try_acquire(Ask(10)) is local
        assert d.try_acquire(Ask(10)) is local  # busier than the remote one, but local goes first
        assert d.local.close("test")
        assert d.try_acquire(Ask(10)) is remote
    finally:
        d.local.close("test")


async def test_full_local_instances_spill_to_remote_ones() -> None:
    registry, d = make(max_in_flight=1)
    (remote,) = active(registry, 1)
    (local,) = active(registry, 1, Kind.LOCAL, first_port=31000)
    assert d.local.open(budget_s=60)
    try:
        assert d.try_acquire(Ask(10)) is local
        assert d.try_acquire(Ask(10)) is remote
        assert d.try_acquire(Ask(10)) is None
    finally:
        d.local.close("test")


async def test_an_instance_the_sequence_failed_on_is_avoided_unless_it_recovered() -> None:
    registry, d = make()
    a, b = active(registry, 2)
    a.health.consecutive_failures = 1
    assert d.try_acquire(Ask(10, avoid=frozenset({a.id}))) is b
    d.release(b, 10)
    assert registry.transition(b, State.DEAD, "test")
    assert d.try_acquire(Ask(10, avoid=frozenset({a.id}))) is None  # the only one left still fails
    a.health.consecutive_failures = 0  # a health check or another request succeeded there
    assert d.try_acquire(Ask(10, avoid=frozenset({a.id}))) is a


async def test_instances_with_failures_are_used_only_when_no_clean_one_is_there() -> None:
    registry, d = make()
    a, b = active(registry, 2)
    a.health.consecutive_failures = 1
    assert [d.try_acquire(Ask(10)) for _ in range(3)] == [b, b, b]  # b is busier, but clean
    assert registry.transition(b, State.DEAD, "test")
    assert d.try_acquire(Ask(10)) is a  # a sequence that never failed there may still use it


async def test_acquire_waits_for_a_release() -> None:
    registry, d = make(max_in_flight=1)
    (a,) = active(registry, 1)
    assert d.try_acquire(Ask(10)) is a
    waiter = asyncio.ensure_future(d.acquire(Ask(20), timeout_s=5))
    await run_pending()
    assert not waiter.done()  # parked: the only instance is full
    d.release(a, 10)
    assert await asyncio.wait_for(waiter, 2) is a
    assert (a.load.in_flight, a.load.in_flight_tokens) == (1, 20)


async def test_acquire_waits_for_an_instance_to_become_active() -> None:
    registry, d = make()
    inst = registry.add("127.0.0.1", 30000, Kind.REMOTE)
    waiter = asyncio.ensure_future(d.acquire(Ask(20), timeout_s=5))
    await run_pending()  # the waiter is parked on the dispatcher's signal
    assert not waiter.done()
    assert registry.transition(inst, State.ACTIVE, "test: healthy")
    assert await asyncio.wait_for(waiter, 2) is inst


async def test_acquire_times_out_with_unavailable() -> None:
    """No instance it may use: it fails at the deadline (one that is only full is waited for: test_admission_bounds)."""
    registry, d = make(max_in_flight=1)
    (a,) = active(registry, 1)
    assert d.try_acquire(Ask(10)) is a
    t0 = time.monotonic()
    with pytest.raises(Unavailable, match=r"no rollout instance could take the request within 0.05s \(1 active\)"):
        await d.acquire(Ask(10, allow=lambda inst: False), timeout_s=0.05)
    assert 0.04 <= time.monotonic() - t0 < 1.0


async def test_close_fails_waiters_at_once() -> None:
    registry, d = make()
    waiters = [asyncio.ensure_future(d.acquire(Ask(10), timeout_s=60)) for _ in range(3)]
    await run_pending()  # the waiter is parked on the dispatcher's signal
    assert not any(w.done() for w in waiters)
    d.close()
    for w in waiters:
        with pytest.raises(Unavailable, match="shutting down"):
            await asyncio.wait_for(w, 1)
    active(registry, 1)
    with pytest.raises(Unavailable, match="shutting down"):  # nothing new is placed either
        await d.acquire(Ask(10), timeout_s=60)


async def test_streamed_tokens_are_counted_as_they_arrive() -> None:
    """The live tokens/s figure must move while sequences run, not only when they finish."""
    registry, d = make()
    (a,) = active(registry, 1)
    assert d.try_acquire(Ask(100)) is a and d.fleet.streamed_tokens == 0
    d.progress(a, 30, 0.0)
    d.progress(a, 12, 0.0)
    assert d.fleet.streamed_tokens == 42  # nothing finished yet
    d.release(a, 58)
    assert d.fleet.streamed_tokens == 42


async def test_requests_waiting_for_an_instance_are_counted_while_they_wait() -> None:
    registry, d = make(max_in_flight=1)
    (a,) = active(registry, 1)
    assert d.try_acquire(Ask(10)) is a and d.capacity.waiting == 0  # placed at once: never waiting
    waiters = [asyncio.ensure_future(d.acquire(Ask(10), timeout_s=5)) for _ in range(2)]
    timing_out = asyncio.ensure_future(d.acquire(Ask(10, allow=lambda inst: False), timeout_s=0.05))
    await run_pending()
    assert d.capacity.waiting == 3
    with pytest.raises(Unavailable):
        await asyncio.wait_for(timing_out, 2)
    assert d.capacity.waiting == 2  # a waiter that gave up is no longer counted
    d.release(a, 10)
    placed = await asyncio.wait_for(asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED), 2)
    assert len(placed[0]) == 1 and d.capacity.waiting == 1
    d.close()
    with pytest.raises(Unavailable):
        await asyncio.wait_for(placed[1].pop(), 2)
    assert d.capacity.waiting == 0


async def test_idle_time_is_accounted_per_active_instance() -> None:
    clock = FakeClock()
    registry, d = make(clock=clock)
    a, b = active(registry, 2)
    clock.advance(4)
    assert d.try_acquire(Ask(10)) is a  # a busy from t=4
    clock.advance(6)
    assert d.fleet.take_idle_seconds(Kind.REMOTE) == pytest.approx((4 + 10) / 2)  # mean of a (4) and b (10)
    clock.advance(3)
    d.release(a, 10)  # a idle again from t=13
    clock.advance(2)
    assert d.fleet.take_idle_seconds(Kind.REMOTE) == pytest.approx((2 + 5) / 2)  # counting restarted at t=10
    assert d.fleet.take_idle_seconds(Kind.LOCAL) == 0.0  # no local instances


async def test_idle_time_of_a_removed_instance_is_dropped() -> None:
    clock = FakeClock()
    registry, d = make(clock=clock)
    a, b = active(registry, 2)
    clock.advance(10)
    assert registry.transition(b, State.DEAD, "test")
    assert d.fleet.take_idle_seconds(Kind.REMOTE) == pytest.approx(10)  # a alone


async def test_time_spent_syncing_is_not_idle_time() -> None:
    clock = FakeClock()
    registry, d = make(clock=clock)
    (a,) = active(registry, 1)
    clock.advance(1)
    assert d.fleet.take_idle_seconds(Kind.REMOTE) == pytest.approx(1)
    assert registry.transition(a, State.SYNCING, "test: needs weight version 1")
    clock.advance(30)  # a weight push: the instance could not have taken work
    assert registry.transition(a, State.ACTIVE, "test: weights at version 1")
    clock.advance(2)
    assert d.fleet.take_idle_seconds(Kind.REMOTE) == pytest.approx(2)


async def test_waiting_requests_are_placed_first_come_first_served_in_one_pass() -> None:
    registry, d = make(max_in_flight=1)
    a, b = active(registry, 2)
    assert d.try_acquire(Ask(10)) is a and d.try_acquire(Ask(10)) is b
    waiters = [asyncio.ensure_future(d.acquire(Ask(10), timeout_s=5)) for _ in range(200)]
    await run_pending()
    tries = 0
    real = d.try_acquire

    def counting(*args, **kw):  # type: ignore[no-untyped-def]
        nonlocal tries
        tries += 1
        return real(*args, **kw)

    d.try_acquire = counting  # type: ignore[method-assign]
    d.release(a, 10)
    await run_pending()
    # One free slot: the oldest waiter gets it, and the 199 behind it are not each woken to try again.
    assert waiters[0].done() and waiters[0].result() is a
    assert not any(w.done() for w in waiters[1:]) and tries <= 2 and d.capacity.waiting == 199
    d.close()
    await asyncio.gather(*waiters, return_exceptions=True)
    assert d.capacity.waiting == 0


async def test_a_waiter_that_cannot_use_the_free_instance_does_not_hold_up_the_others() -> None:
    registry, d = make(max_in_flight=1)
    a, b = active(registry, 2)
    assert d.try_acquire(Ask(10)) is a and d.try_acquire(Ask(10)) is b
    # The first waiter may only run on b (say, a staleness bound): a frees up first.
    picky = asyncio.ensure_future(d.acquire(Ask(10, allow=lambda inst: inst is b), timeout_s=5))
    other = asyncio.ensure_future(d.acquire(Ask(10), timeout_s=5))
    await run_pending()
    d.release(a, 10)
    await run_pending()
    assert other.done() and other.result() is a and not picky.done()
    d.release(b, 10)
    assert await asyncio.wait_for(picky, 2) is b


async def test_a_waiter_cancelled_as_it_is_placed_gives_its_instance_back() -> None:
    registry, d = make(max_in_flight=1)
    (a,) = active(registry, 1)
    assert d.try_acquire(Ask(10)) is a
    waiter = asyncio.ensure_future(d.acquire(Ask(10), timeout_s=5))
    await run_pending()
    d.release(a, 10)  # placed: the future holds a, but the caller has not run yet
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    assert a.load.in_flight == 0 and a.load.in_flight_tokens == 0 and d.capacity.waiting == 0
    assert d.try_acquire(Ask(10)) is a
