"""The relay's one timer for every call in flight (sglang.deadline.DeadlineClock)."""

from __future__ import annotations

import asyncio

from rollout_manager.sglang.deadline import DeadlineClock


class Call:
    """A call as the clock sees it: told when its entry comes due."""

    def __init__(self, clock: DeadlineClock, name: str, log: list[tuple[str, float]]) -> None:
        self.clock, self.name, self.log = clock, name, log
        self.armed = 0
        self.fired = asyncio.Event()

    def arm(self, due: float) -> None:
        if self.armed:
            self.armed = 0
            self.clock.dropped()
        self.armed = self.clock.add(due, self)

    def disarm(self) -> None:
        if self.armed:
            self.armed = 0
            self.clock.dropped()

    def on_due(self) -> None:
        self.log.append((self.name, self.clock.loop.time()))
        self.fired.set()


async def test_entries_fire_in_due_order_never_early_and_only_while_armed() -> None:
    loop = asyncio.get_running_loop()
    clock = DeadlineClock(loop)
    log: list[tuple[str, float]] = []
    t0 = loop.time()
    late, early, moved, ended = (Call(clock, n, log) for n in ("late", "early", "moved", "ended"))
    late.arm(t0 + 0.15)
    early.arm(t0 + 0.05)  # earlier than the timer set so far: the timer moves up
    moved.arm(t0 + 0.02)
    moved.arm(t0 + 0.10)  # re-armed: its first entry no longer counts
    ended.arm(t0 + 0.03)
    ended.disarm()
    await asyncio.wait_for(late.fired.wait(), 5)
    assert [name for name, _ in log] == ["early", "moved", "late"]
    for (name, at), due in zip(log, (0.05, 0.10, 0.15)):
        assert at >= t0 + due - 0.002, (name, at - t0)  # within the loop's clock resolution
    assert not ended.fired.is_set() and clock.handle is None and not clock.heap


async def test_ended_calls_do_not_pile_up() -> None:
    """Short calls that end long before their deadline leave no heap behind them (one entry each
    would grow by the call rate times the stall timeout)."""
    loop = asyncio.get_running_loop()
    clock = DeadlineClock(loop)
    log: list[tuple[str, float]] = []
    held = Call(clock, "held", log)
    held.arm(loop.time() + 600)
    for i in range(100_000):
        call = Call(clock, f"c{i}", log)
        call.arm(loop.time() + 600)
        call.disarm()
    assert len(clock.heap) < 1_000
    assert any(entry[2] is held for entry in clock.heap)
    held.arm(loop.time())  # still fires after the rebuilds
    await asyncio.wait_for(held.fired.wait(), 5)
    assert log[0][0] == "held" and len(log) == 1
