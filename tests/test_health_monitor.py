"""HealthMonitor's lifecycle, in process: a fake probe and a fake clock, so no test waits in real time."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from fakes import FakeClock, FakeProbe, yield_until

from rollout_manager.instances.health import HealthMonitor, HealthSettings
from rollout_manager.instances.registry import Instance, Kind, Registry, State
from rollout_manager.instances.version import WeightVersion
from rollout_manager.sglang import wire

SETTINGS = HealthSettings(startup_grace_period_s=60.0, pending_poll_interval_s=2.0, check_interval_s=10.0,
                          check_timeout_s=5.0, check_path=wire.HEALTH_GENERATE, failure_threshold=3)


@dataclass
class World:
    clock: FakeClock
    registry: Registry
    version: WeightVersion
    probe: FakeProbe
    health: HealthMonitor

    def add(self, kind: Kind = Kind.REMOTE, port: int = 30000) -> Instance:
        return self.registry.add("127.0.0.1", port, kind)


@pytest.fixture
async def world() -> AsyncIterator[World]:
    clock = FakeClock()
    registry = Registry(clock=clock)
    version = WeightVersion()
    probe = FakeProbe()
    health = HealthMonitor(registry, version, probe, SETTINGS, sleep=clock.sleep)
    yield World(clock, registry, version, probe, health)
    await health.close()


async def finished(task: asyncio.Task[object]) -> None:
    """Wait for ``task`` to end (bounded, so a broken state machine fails the test instead of hanging it)."""
    await asyncio.wait_for(asyncio.shield(task), 2.0)


def state(inst: Instance) -> State:
    """Read the state afresh (a plain ``inst.state`` after an assert on it is narrowed by mypy)."""
    return inst.state


def watch_task(inst: Instance) -> asyncio.Task[object]:
    (task,) = [t for t in asyncio.all_tasks() if t.get_name() == f"health:{inst.id}"]
    return task


async def test_pending_becomes_active_on_the_first_ready_probe(world: World) -> None:
    inst = world.add()
    assert inst.state == State.PENDING
    await world.clock.parked()  # probed, then asleep until the first periodic check
    assert state(inst) == State.ACTIVE
    assert world.probe.calls == [(inst.url, wire.HEALTH_GENERATE)]


async def test_pending_polls_until_ready(world: World) -> None:
    world.probe.status = 503
    inst = world.add()
    await world.clock.parked()
    await world.clock.step(SETTINGS.pending_poll_interval_s)
    assert inst.state == State.PENDING and len(world.probe.calls) == 2
    assert inst.last_error == "HTTP 503"
    world.probe.status = 200
    await world.clock.step(SETTINGS.pending_poll_interval_s)
    assert state(inst) == State.ACTIVE and len(world.probe.calls) == 3


async def test_pending_goes_to_syncing_when_the_fleet_is_ahead(world: World) -> None:
    world.version.current = 2
    remote, local = world.add(), world.add(Kind.LOCAL, port=30001)
    await world.clock.parked(2)
    assert remote.state == State.SYNCING  # a remote box must get the weights first
    assert local.state == State.ACTIVE  # the trainer updates local instances itself
    assert [e.reason for e in world.registry.events if e.instance_id == remote.id][-1] == \
        "bootstrap to weight version 2"


async def test_pending_dies_after_the_startup_grace_period(world: World) -> None:
    world.probe.status = None
    inst = world.add()
    await world.clock.parked()
    await world.clock.step(SETTINGS.startup_grace_period_s - 1)  # probed once more, still inside the grace
    assert inst.state == State.PENDING and world.registry.get(inst.id) is inst
    world.clock.advance(SETTINGS.pending_poll_interval_s)  # the next probe is past the grace
    await finished(watch_task(inst))
    assert world.registry.get(inst.id) is None and state(inst) == State.DEAD
    last = world.registry.events[-1]
    assert last.new == State.DEAD and "start-up grace period (60s)" in last.reason
    assert "connection refused" in last.reason


async def test_the_managers_own_limits_neither_end_the_grace_period_nor_count_as_failures(world: World) -> None:
    world.probe.local = True  # the manager is out of descriptors: it cannot even ask
    inst = world.add()
    await world.clock.parked()
    for _ in range(2 * int(SETTINGS.startup_grace_period_s / SETTINGS.pending_poll_interval_s)):
        await world.clock.step(SETTINGS.pending_poll_interval_s)
    assert state(inst) == State.PENDING and world.registry.get(inst.id) is inst
    assert "Too many open files" in (inst.last_error or "")
    world.probe.local = False
    await world.clock.step(SETTINGS.pending_poll_interval_s)
    assert state(inst) == State.ACTIVE
    world.probe.local = True
    for _ in range(SETTINGS.failure_threshold + 1):
        await world.clock.step(SETTINGS.check_interval_s)
    assert state(inst) == State.ACTIVE and inst.health.consecutive_failures == 0


async def test_failures_count_to_the_threshold_then_the_instance_is_removed(world: World) -> None:
    inst = world.add()
    await world.clock.parked()
    world.probe.status = 500
    for n in range(1, SETTINGS.failure_threshold):
        await world.clock.step(SETTINGS.check_interval_s)
        assert inst.health.consecutive_failures == n and inst.state == State.ACTIVE
    task = watch_task(inst)
    world.clock.advance(SETTINGS.check_interval_s)
    await finished(task)
    assert world.registry.get(inst.id) is None
    assert "3 consecutive failures; last: health check: HTTP 500" in world.registry.events[-1].reason


async def test_a_4xx_probe_is_not_a_failure(world: World) -> None:
    inst = world.add()
    await world.clock.parked()
    world.probe.status = 404
    for _ in range(SETTINGS.failure_threshold + 1):
        await world.clock.step(SETTINGS.check_interval_s)
    assert inst.state == State.ACTIVE and inst.health.consecutive_failures == 0


async def test_a_success_resets_the_count(world: World) -> None:
    inst = world.add()
    await world.clock.parked()
    world.probe.status = 503
    for _ in range(SETTINGS.failure_threshold - 1):
        await world.clock.step(SETTINGS.check_interval_s)
    assert inst.health.consecutive_failures == SETTINGS.failure_threshold - 1
    world.probe.status = 200
    await world.clock.step(SETTINGS.check_interval_s)
    assert inst.health.consecutive_failures == 0
    world.probe.status = 503
    for _ in range(SETTINGS.failure_threshold - 1):  # the count starts again from zero
        await world.clock.step(SETTINGS.check_interval_s)
    assert inst.state == State.ACTIVE


async def test_request_failures_and_successes_count_like_probes(world: World) -> None:
    inst = world.add()
    await world.clock.parked()
    world.health.report_failure(inst, "stream cut")
    world.health.report_failure(inst, "stream cut")
    world.health.report_success(inst)
    assert inst.health.consecutive_failures == 0
    for _ in range(SETTINGS.failure_threshold):
        world.health.report_failure(inst, "HTTP 502")
    assert world.registry.get(inst.id) is None
    world.health.report_failure(inst, "late report")  # about an instance already gone: ignored
    assert inst.health.consecutive_failures == SETTINGS.failure_threshold


async def test_a_syncing_instance_is_not_probed(world: World) -> None:
    inst = world.add()
    await world.clock.parked()
    assert world.registry.transition(inst, State.SYNCING, "test: loading weights")
    world.probe.status = 500
    before = len(world.probe.calls)
    for _ in range(SETTINGS.failure_threshold + 2):
        await world.clock.step(SETTINGS.check_interval_s)
    assert len(world.probe.calls) == before
    assert inst.state == State.SYNCING and inst.health.consecutive_failures == 0


async def test_a_probe_answer_that_arrives_after_syncing_began_is_ignored(world: World) -> None:
    inst = world.add()
    await world.clock.parked()
    world.probe.status, world.probe.hold = 500, asyncio.Event()
    world.clock.advance(SETTINGS.check_interval_s)
    await yield_until(lambda: len(world.probe.calls) == 2)  # the periodic probe waits on hold
    assert world.registry.transition(inst, State.SYNCING, "test: loading weights")
    world.probe.hold.set()
    await world.clock.parked()
    assert inst.health.consecutive_failures == 0 and inst.state == State.SYNCING


async def test_removal_cancels_the_watch_task(world: World) -> None:
    world.probe.status, world.probe.hold = 503, asyncio.Event()
    inst = world.add()
    await yield_until(lambda: len(world.probe.calls) == 1)  # the first probe is in flight
    task = watch_task(inst)
    assert world.registry.transition(inst, State.DEAD, "removed by request")
    with pytest.raises(asyncio.CancelledError):
        await finished(task)
    assert task.cancelled() and world.clock.sleepers == 0


async def test_close_cancels_every_watch(world: World) -> None:
    insts = [world.add(port=30000 + n) for n in range(3)]
    await world.clock.parked(3)
    tasks = [watch_task(i) for i in insts]
    await world.health.close()
    assert all(t.cancelled() for t in tasks) and world.clock.sleepers == 0


async def test_a_pending_instance_says_it_waits_for_its_first_health_generate(world: World) -> None:
    world.probe.status = 503
    inst = world.add()
    await world.clock.parked()
    assert inst.waiting_for == f"first successful {wire.HEALTH_GENERATE}"
    assert inst.to_dict(0.0)["waiting_for"] == inst.waiting_for
    assert inst.last_error == "HTTP 503" and inst.last_error_at is not None
    world.probe.status = 200
    await world.clock.step(SETTINGS.pending_poll_interval_s)
    assert state(inst) == State.ACTIVE
    assert inst.waiting_for is None and inst.last_error is None and inst.last_error_at is None


async def test_a_successful_check_after_failures_clears_the_last_error(world: World) -> None:
    inst = world.add()
    await world.clock.parked()
    world.probe.status = 503
    await world.clock.step(SETTINGS.check_interval_s)
    assert inst.last_error == "health check: HTTP 503" and inst.last_error_at is not None
    world.probe.status = 200
    await world.clock.step(SETTINGS.check_interval_s)
    assert inst.health.consecutive_failures == 0 and inst.last_error is None and inst.last_error_at is None
    world.health.report_failure(inst, "stream cut")
    assert inst.last_error == "stream cut"
    world.health.report_success(inst)  # a request that went through: recovered as well
    assert inst.last_error is None and inst.last_error_at is None


@pytest.mark.parametrize("incremental, mode", [(True, "incremental"), (False, "cumulative"), (None, None)])
async def test_the_streaming_mode_is_read_once_and_a_cumulative_one_is_warned_about_once(
        incremental: bool | None, mode: str | None, caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    registry = Registry(clock=clock)
    reads: list[str] = []
    raw = {"version": "0.5.23", "stream_interval": 1}
    if incremental is not None:
        raw["incremental_streaming_output"] = incremental

    async def server_info(url: str, timeout_s: float) -> wire.ServerInfo:
        reads.append(url)
        return wire.ServerInfo.from_json(raw)

    health = HealthMonitor(registry, WeightVersion(), FakeProbe(), SETTINGS, sleep=clock.sleep,
                           server_info=server_info)
    try:
        with caplog.at_level("WARNING", logger="rollout_manager.health"):
            inst = registry.add("127.0.0.1", 30000, Kind.REMOTE)
            await clock.parked()
            assert state(inst) == State.ACTIVE
            for _ in range(3):  # periodic checks neither re-read /server_info nor warn again
                clock.advance(SETTINGS.check_interval_s)
                await clock.parked()
        assert reads == [inst.url]  # the one /server_info read, shared with the dp_size check
        status = inst.to_dict(clock())
        assert status["streaming"] == mode
        assert status["server_stream_interval"] == (1 if mode else None)
        warnings = [r.getMessage() for r in caplog.records if "streams cumulative" in r.getMessage()]
        assert len(warnings) == (1 if mode == "cumulative" else 0)
        assert all("--incremental-streaming-output" in w and inst.endpoint in w for w in warnings)
    finally:
        await health.close()


@pytest.mark.parametrize("said, shown", [("EAGLE", "EAGLE"), (None, None), ("", None), (3, None)])
async def test_a_box_that_drafts_says_so_in_the_status(said: object, shown: str | None) -> None:
    """``--speculative-algorithm`` from /server_info is shown per instance (placement needs no special case:
    the box's learned step curve says what drafting buys); anything but a name reads as not said."""
    clock = FakeClock()
    registry = Registry(clock=clock)

    async def server_info(url: str, timeout_s: float) -> wire.ServerInfo:
        return wire.ServerInfo.from_json({"version": "0.5.23", "speculative_algorithm": said})

    health = HealthMonitor(registry, WeightVersion(), FakeProbe(), SETTINGS, sleep=clock.sleep,
                           server_info=server_info)
    try:
        inst = registry.add("127.0.0.1", 30000, Kind.REMOTE)
        await clock.parked()
        assert state(inst) == State.ACTIVE
        assert inst.to_dict(clock())["speculative_algorithm"] == shown
    finally:
        await health.close()
