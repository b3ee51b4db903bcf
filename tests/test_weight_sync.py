"""Weight sync and the sender plan, in process: fake agents, so a push is a few method calls."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from fakes import FakeAgents, FakeClock, FakeProbe, run_pending, yield_until
from support import async_wait_until

from rollout_manager.config import Config
from rollout_manager.errors import BadRequest, Conflict
from rollout_manager.instances.health import HealthMonitor, HealthSettings
from rollout_manager.instances.registry import Instance, Kind, Registry, State
from rollout_manager.instances.version import WeightVersion
from rollout_manager.placement.ask import Ask
from rollout_manager.placement.dispatch import Dispatcher
from rollout_manager.placement.least_in_flight import LeastInFlight
from rollout_manager.rollout.sequence import version_check
from rollout_manager.weights.groups import SenderPlan
from rollout_manager.weights.protocol import CommitAnswer, CommitRequest
from rollout_manager.weights.sync import WeightSync
from rollout_manager.weights.sync_settings import SyncSettings

SETTINGS = SyncSettings(transport="tcp", drain_timeout_s=2.0, push_timeout_s=2.0, retry_s=0.01, max_attempts=3)


@dataclass
class Rig:
    registry: Registry
    version: WeightVersion
    dispatcher: Dispatcher
    senders: SenderPlan
    agents: FakeAgents
    sync: WeightSync
    ports: int = 30000

    def add(self, kind: Kind = Kind.REMOTE, state: State = State.ACTIVE) -> Instance:
        self.ports += 1
        inst = self.registry.add("127.0.0.1", self.ports, kind, receiver_port=self.ports + 1000)
        if state != State.PENDING:
            assert self.registry.transition(inst, state, "test")
        return inst

    async def settled(self, *insts: Instance, state: State = State.ACTIVE) -> None:
        await async_wait_until(lambda: all(i.state == state for i in insts), 2, interval_s=0.005,
                               message=lambda: f"{[(i.id, i.state.value) for i in insts]} to be {state.value}")


def sync_task(inst: Instance) -> asyncio.Task[object] | None:
    tasks = [t for t in asyncio.all_tasks() if t.get_name() == f"sync:{inst.id}"]
    return tasks[0] if tasks else None


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    registry = Registry()
    version = WeightVersion()
    dispatcher = Dispatcher(registry, LeastInFlight())
    senders = SenderPlan(registry, Config())
    senders.update([["127.0.0.1"]])
    agents = FakeAgents()
    sync = WeightSync(registry, version, senders, agents, SETTINGS, dispatcher.changed)
    yield Rig(registry, version, dispatcher, senders, agents, sync)
    await sync.close()


async def test_bump_syncs_active_remote_instances_and_returns_them_at_the_new_version(rig: Rig) -> None:
    a, b = rig.add(), rig.add()
    rig.agents.staged = 1
    assert rig.sync.bump(None) == 1 and rig.version.current == 1
    assert a.state == State.SYNCING and b.state == State.SYNCING  # out of service at once
    assert rig.dispatcher.try_acquire(Ask(10)) is None
    await rig.settled(a, b)
    assert a.weight_version == b.weight_version == 1
    assert sorted(rig.agents.pushed_to()) == [f"http://127.0.0.1:{i.weight_receiver_port}" for i in (a, b)]
    prepare = next(body for name, _, body in rig.agents.calls if name == "prepare")
    assert prepare == {"version": 1, "layout": FakeAgents.LAYOUT.model_dump(), "transport": "tcp"}
    assert [p.version for p in rig.sync.pushes] == [1, 1]
    assert set(a.versions.paused_s) == {1} and a.versions.paused_s[1] > 0  # out of service for version 1


async def test_a_sync_waits_for_in_flight_requests_to_finish(rig: Rig) -> None:
    a = rig.add()
    assert rig.dispatcher.try_acquire(Ask(10)) is a
    rig.agents.staged = 1
    rig.sync.bump(1)
    await run_pending()
    assert rig.agents.calls == [] and a.state == State.SYNCING  # SGLang is never told to abort them
    rig.dispatcher.release(a, 10)
    await rig.settled(a)
    assert a.weight_version == 1


async def test_local_instances_jump_to_the_version(rig: Rig) -> None:
    local = rig.add(Kind.LOCAL)
    rig.sync.bump(5)
    assert local.weight_version == 5 and local.state == State.ACTIVE
    await run_pending()
    assert rig.agents.calls == []  # the trainer updates its own instances


async def test_the_current_version_again_is_a_no_op_and_a_lower_one_is_refused(rig: Rig) -> None:
    a = rig.add()
    rig.agents.staged = 3
    rig.sync.bump(3)
    await rig.settled(a)
    pushes = len(rig.agents.calls)
    assert rig.sync.bump(3) == 3  # a trainer restarted from the checkpoint of the step the fleet serves
    await run_pending()
    assert a.state == State.ACTIVE and a.weight_version == 3 and len(rig.agents.calls) == pushes
    with pytest.raises(BadRequest, match="new_version 2 is below the current version 3: .*resume from step 3"):
        rig.sync.bump(2)
    assert rig.version.current == 3
    rig.agents.staged = 4
    assert rig.sync.bump(None) == 4
    await rig.settled(a)
    assert a.weight_version == 4


async def test_an_unavailable_sender_keeps_the_instance_syncing_until_it_is_back(rig: Rig) -> None:
    a = rig.add()
    rig.agents.staged, rig.agents.sender_down = 1, True
    rig.sync.bump(1)
    await async_wait_until(lambda: rig.agents.count("layout") >= 5, 2, interval_s=0.005,
                           message="several tries at the sender")
    assert rig.registry.get(a.id) is a and a.state == State.SYNCING  # not the instance's fault
    assert a.last_error is not None and "connection refused" in a.last_error
    assert rig.agents.count("push") == 0
    rig.agents.sender_down = False
    await rig.settled(a)
    assert a.weight_version == 1


async def test_a_sender_with_another_version_staged_is_waited_for(rig: Rig) -> None:
    a = rig.add()
    rig.agents.staged = 1  # still staging version 2
    rig.sync.bump(2)
    await async_wait_until(lambda: rig.agents.count("layout") >= 3, 2, interval_s=0.005)
    assert a.state == State.SYNCING and "has version 1 staged, not 2" in (a.last_error or "")
    rig.agents.staged = 2
    await rig.settled(a)
    assert a.weight_version == 2


async def test_push_failures_are_retried_then_the_instance_is_removed(rig: Rig) -> None:
    a, b = rig.add(), rig.add()
    rig.agents.staged, rig.agents.fail_pushes = 1, SETTINGS.max_attempts - 1  # shared: a and b fail once each
    rig.sync.bump(1)
    await rig.settled(a, b)  # retried and recovered
    rig.agents.staged, rig.agents.fail_pushes = 2, 100
    rig.sync.bump(2)
    await async_wait_until(lambda: rig.registry.get(a.id) is None and rig.registry.get(b.id) is None, 2,
                           interval_s=0.005, message="both removed")
    assert rig.agents.count("commit") == 2  # only the version-1 pushes got through
    reasons = [e.reason for e in rig.registry.events if e.new == State.DEAD]
    assert len(reasons) == 2 and all(r.startswith("weight push failed 3 times; last: ") for r in reasons)


async def test_a_removed_instance_s_sync_task_is_cancelled(rig: Rig) -> None:
    a = rig.add()
    rig.agents.staged, rig.agents.hold = 1, asyncio.Event()
    rig.sync.bump(1)
    await yield_until(lambda: rig.agents.count("push") == 1)  # mid-push
    task = sync_task(a)
    assert task is not None
    assert rig.registry.transition(a, State.DEAD, "removed by request")
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(asyncio.shield(task), 2)
    assert rig.agents.count("commit") == 0


async def test_a_bump_during_a_push_pushes_again(rig: Rig) -> None:
    a = rig.add()
    rig.agents.staged, rig.agents.hold = 1, asyncio.Event()
    rig.sync.bump(1)
    await yield_until(lambda: rig.agents.count("push") == 1)
    rig.agents.staged = 2
    rig.sync.bump(2)
    rig.agents.hold.set()
    await rig.settled(a)
    assert a.weight_version == 2 and [p.version for p in rig.sync.pushes] == [1, 2]
    assert [e.reason for e in rig.registry.events if e.new == State.ACTIVE][-1].startswith("weights at version 2")


async def test_wait_returns_when_enough_instances_are_at_the_version(rig: Rig) -> None:
    a, b = rig.add(), rig.add()
    rig.agents.staged, rig.agents.hold = 1, asyncio.Event()
    rig.sync.bump(1)
    waiter = asyncio.ensure_future(rig.sync.wait(1, 1, timeout_s=2))
    await run_pending()
    assert not waiter.done()
    rig.agents.hold.set()
    answer = await asyncio.wait_for(waiter, 2)
    assert answer["timed_out"] is False and answer["instances_at_version"] >= 1
    await rig.settled(a, b)
    answer = await rig.sync.wait(1, None, timeout_s=2)  # "all" is already true
    assert answer == {"timed_out": False, "waited_s": answer["waited_s"], "instances_at_version": 2}


async def test_wait_times_out_when_too_few_reach_the_version(rig: Rig) -> None:
    a = rig.add()
    rig.agents.staged, rig.agents.sender_down = 1, True
    rig.sync.bump(1)
    answer = await rig.sync.wait(1, None, timeout_s=0.05)
    assert answer["timed_out"] is True and answer["instances_at_version"] == 0
    assert 0.05 <= answer["waited_s"] < 1.0
    # End with no sync task retrying: cancelling one in its 10 ms retry wait can hang close() (see the report).
    rig.agents.sender_down = False
    await rig.settled(a)


async def test_a_new_instance_behind_the_fleet_is_bootstrapped(rig: Rig) -> None:
    clock = FakeClock()
    settings = HealthSettings(60.0, 1.0, 10.0, 5.0, "/health_generate", 3)
    health = HealthMonitor(rig.registry, rig.version, FakeProbe(), settings, sleep=clock.sleep)
    try:
        rig.agents.staged = 1
        rig.sync.bump(1)
        inst = rig.add(state=State.PENDING)
        await clock.parked()  # probed ready; behind the fleet, so syncing, then pushed
        await rig.settled(inst)
        assert inst.weight_version == 1 and rig.agents.count("commit") == 1
    finally:
        await health.close()


def test_sender_plan_re_deals_on_registration_and_removal() -> None:
    registry = Registry()
    plan = SenderPlan(registry, Config(num_mooncake_groups_per_sender=2))
    early = registry.add("127.0.0.1", 30000, Kind.REMOTE)
    assert (early.sender, early.group) == (None, None)  # no sender reported yet
    plan.update([["10.0.0.1"], ["10.0.0.2", "10.0.0.3"]])
    rest = [registry.add("127.0.0.1", 30001 + i, Kind.REMOTE) for i in range(3)]
    local = registry.add("127.0.0.1", 31000, Kind.LOCAL)

    def slots() -> list[tuple[int | None, int | None]]:
        return [(i.sender, i.group) for i in registry.in_state(*State, kind=Kind.REMOTE)]

    # group 0 of every sender, then group 1 of every sender: consecutive boxes on different nodes
    assert slots() == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert (local.sender, local.group) == (None, None)
    group = plan.group_of(rest[2])
    assert group is not None and group.ip == "10.0.0.3"  # bound round-robin to the node's interfaces
    assert registry.transition(early, State.DEAD, "test")
    assert slots() == [(0, 0), (1, 0), (0, 1)]  # the rest moved up: groups stay even
    assert plan.sender_url(1) == "http://10.0.0.2:17000"
    with pytest.raises(BadRequest, match="weight sender 0: none of its IPs"):
        SenderPlan(Registry(), Config(allowed_sender_ips="192.168.0.0/16")).update([["10.0.0.1"]])


async def test_an_instance_waits_for_senders_to_report_without_being_removed() -> None:
    registry, version = Registry(), WeightVersion()
    dispatcher = Dispatcher(registry, LeastInFlight())
    senders = SenderPlan(registry, Config())  # the trainer has not reported its senders yet
    settings = SyncSettings(transport="tcp", drain_timeout_s=1.0, push_timeout_s=0.02, retry_s=0.01, max_attempts=2)
    sync = WeightSync(registry, version, senders, FakeAgents(staged=1), settings, dispatcher.changed)
    try:
        sync.bump(1)  # no remote instance yet: nothing to deliver, so no sender is needed
        inst = registry.add("127.0.0.1", 30000, Kind.REMOTE, receiver_port=31000)
        assert registry.transition(inst, State.SYNCING, "bootstrap to weight version 1")
        answer = await sync.wait(1, None, timeout_s=0.2)  # several push timeouts long
        assert answer["timed_out"] is True
        assert registry.get(inst.id) is inst and inst.state == State.SYNCING
        assert inst.waiting_for == "the trainer's weight senders (PUT /update_weight_senders)"
        senders.update([["127.0.0.1"]])
        assert (await sync.wait(1, None, timeout_s=2))["timed_out"] is False
        assert inst.state == State.ACTIVE and inst.waiting_for is None
    finally:
        await sync.close()


async def test_a_bump_no_sender_can_deliver_is_refused_and_changes_nothing() -> None:
    registry, version = Registry(), WeightVersion()
    dispatcher = Dispatcher(registry, LeastInFlight())
    senders = SenderPlan(registry, Config())  # the trainer has not reported its senders yet
    sync = WeightSync(registry, version, senders, FakeAgents(staged=1), SETTINGS, dispatcher.changed)
    try:
        inst = registry.add("127.0.0.1", 30000, Kind.REMOTE, receiver_port=31000)
        assert registry.transition(inst, State.ACTIVE, "test")
        events = len(registry.events)
        with pytest.raises(Conflict, match=r"no weight sender.*PUT /update_weight_senders"):
            sync.bump(None)
        with pytest.raises(Conflict):
            sync.bump(3)
        assert version.current == 0 and inst.state == State.ACTIVE and len(registry.events) == events
        assert inst.waiting_for is None and dispatcher.try_acquire(Ask(10)) is inst
    finally:
        await sync.close()


async def test_a_bump_with_only_local_instances_needs_no_sender() -> None:
    registry, version = Registry(), WeightVersion()
    dispatcher = Dispatcher(registry, LeastInFlight())
    sync = WeightSync(registry, version, SenderPlan(registry, Config()), FakeAgents(), SETTINGS, dispatcher.changed)
    try:
        local = registry.add("127.0.0.1", 30000, Kind.LOCAL)
        assert registry.transition(local, State.ACTIVE, "test")
        assert sync.bump(None) == 1 and local.weight_version == 1
    finally:
        await sync.close()


async def test_a_syncing_instance_says_what_it_waits_for(rig: Rig) -> None:
    a = rig.add()
    assert a.waiting_for is None and a.to_dict(0.0)["waiting_for"] is None
    assert rig.dispatcher.try_acquire(Ask(10)) is a
    rig.agents.staged = 0  # the sender still stages version 1
    rig.sync.bump(1)
    await run_pending()
    assert a.waiting_for == "in-flight requests to drain (1 left)"
    rig.dispatcher.release(a, 10)
    await async_wait_until(lambda: a.waiting_for == "its sender to stage version 1", 2, interval_s=0.005,
                           message=lambda: f"waiting_for to name the sender, not {a.waiting_for!r}")
    assert a.to_dict(0.0)["waiting_for"] == "its sender to stage version 1"
    rig.agents.staged = 1
    await rig.settled(a)
    assert a.waiting_for is None


async def test_a_successful_push_clears_the_last_error(rig: Rig) -> None:
    a = rig.add()
    rig.agents.staged = 0
    rig.sync.bump(1)
    await async_wait_until(lambda: a.last_error is not None, 2, interval_s=0.005)
    assert a.last_error_at is not None and a.to_dict(0.0)["last_error_at"] == a.last_error_at
    rig.agents.staged = 1
    await rig.settled(a)
    assert a.last_error is None and a.last_error_at is None
    assert a.to_dict(0.0)["last_error"] is None and a.to_dict(0.0)["last_error_at"] is None


# ------------------------------------------------------------------ staged activation

STAGED = dataclasses.replace(SETTINGS, activation="staged")


@pytest.fixture
async def staged_rig(rig: Rig) -> AsyncIterator[Rig]:
    evicted: list[str] = []

    def evict(inst: Instance, reason: str) -> int:
        evicted.append(f"{inst.id}: {reason}")
        return 0

    await rig.sync.close()
    rig.registry.listeners.remove(rig.sync._on_event)  # the drain-mode sync must not act on these instances
    rig.sync = WeightSync(rig.registry, rig.version, rig.senders, rig.agents, STAGED, rig.dispatcher.changed, evict)
    rig.evicted = evicted  # type: ignore[attr-defined]
    yield rig
    await rig.sync.close()


async def test_staged_instances_keep_serving_while_they_stage_and_load_in_a_pause(staged_rig: Rig) -> None:
    rig = staged_rig
    a = rig.add()
    rig.agents.staged = 1
    rig.agents.hold = asyncio.Event()
    rig.sync.bump(1)
    await yield_until(lambda: rig.agents.count("push") == 1)
    assert a.state == State.ACTIVE and a.versions.staging == 1  # still serving version 0
    assert rig.dispatcher.try_acquire(Ask(10)) is a
    rig.dispatcher.release(a, 10)
    rig.agents.hold.set()
    await async_wait_until(lambda: a.weight_version == 1, 2, interval_s=0.005, message="version 1 active")
    commit = next(body for name, _, body in rig.agents.calls if name == "commit")
    assert commit["stage"] is True
    assert [body for name, _, body in rig.agents.calls if name == "activate"] == [{"version": 1, "mode": "retract"}]
    assert a.state == State.ACTIVE and a.versions.to_dict(a.weight_version) == {
        "active": 1, "staging": None, "staged": None, "activating": None, "paused_s": {"1": 0.25}}
    assert [e.new for e in rig.registry.events if e.instance_id == a.id] == [State.PENDING, State.ACTIVE]  # no syncing
    push = rig.sync.pushes[-1]
    assert (push.version, push.load_s, push.reloaded) == (1, 0.2, 3)  # the activation's load


async def test_a_version_superseded_while_it_stages_is_not_activated(staged_rig: Rig) -> None:
    rig = staged_rig
    a = rig.add()
    rig.agents.staged = 1
    rig.agents.hold = asyncio.Event()
    rig.sync.bump(1)
    await yield_until(lambda: rig.agents.count("push") == 1)
    rig.agents.staged = 2
    rig.sync.bump(2)
    rig.agents.hold.set()
    await async_wait_until(lambda: a.weight_version == 2, 2, interval_s=0.005, message="version 2 active")
    assert [body["version"] for name, _, body in rig.agents.calls if name == "commit"] == [1, 2]
    assert [body["version"] for name, _, body in rig.agents.calls if name == "activate"] == [2]


async def test_a_trainer_waiting_for_staged_instances_goes_on_before_they_load(staged_rig: Rig) -> None:
    rig = staged_rig
    a, b = rig.add(), rig.add()
    rig.agents.staged = 1
    rig.agents.activate_hold = asyncio.Event()
    rig.sync.bump(1)
    answer = await rig.sync.wait(1, None, 2.0, staged=True)
    assert not answer["timed_out"] and answer["instances_at_version"] == 2
    assert a.versions.activating == b.versions.activating == 1  # loading, still serving version 0:
    assert a.versions.serving(a.weight_version) == b.versions.serving(b.weight_version) == 0
    # SGLang sends version-1 chunks as soon as it continues, before the activation's answer: they are accepted.
    a.engine = dataclasses.replace(a.engine, joined_version="0")
    check = version_check(a, 0)
    assert check is not None and check("1") is None and check("0") is None
    assert (await rig.sync.wait(1, None, 0.05))["timed_out"]  # not serving it yet
    rig.agents.activate_hold.set()
    assert not (await rig.sync.wait(1, None, 2.0))["timed_out"]


async def test_a_failed_activation_takes_the_instance_out_of_service_and_a_full_push_recovers_it(
        staged_rig: Rig) -> None:
    rig = staged_rig
    a = rig.add()
    rig.agents.staged = 1
    rig.agents.fail_activations = 1
    rig.sync.bump(1)
    await async_wait_until(lambda: a.weight_version == 1 and a.state == State.ACTIVE, 2, interval_s=0.005,
                           message="version 1 active after the recovery")
    assert rig.evicted == [f"{a.id}: weight activation failed"]  # type: ignore[attr-defined]
    states = [e.new for e in rig.registry.events if e.instance_id == a.id]
    assert states == [State.PENDING, State.ACTIVE, State.SYNCING, State.ACTIVE]
    commits = [body.get("stage") for name, _, body in rig.agents.calls if name == "commit"]
    assert commits == [True, None]  # staged, then the drain-mode push loads it in full


async def test_staging_failures_follow_the_push_retry_rule_and_remove_the_instance(staged_rig: Rig) -> None:
    """The staged path retries a failed delivery as the drain path does: up to ``max_attempts``, then removed."""
    rig = staged_rig
    a = rig.add()
    rig.agents.staged, rig.agents.fail_pushes = 1, 100
    rig.sync.bump(1)
    await async_wait_until(lambda: rig.registry.get(a.id) is None, 2, interval_s=0.005, message="a removed")
    assert rig.agents.count("push") == SETTINGS.max_attempts and rig.agents.count("activate") == 0
    assert a.last_error is not None and a.last_error.startswith("weight staging: ")
    assert a.versions.staging is None and a.versions.staged is None
    reasons = [e.reason for e in rig.registry.events if e.new == State.DEAD]
    assert len(reasons) == 1 and reasons[0].startswith("weight push failed 3 times; last: ")


async def test_an_unexpected_error_while_staging_counts_as_a_failed_try(staged_rig: Rig) -> None:
    """A bug in one staging try is retried like a failed push, not the end of the instance's sync."""
    rig = staged_rig
    a = rig.add()
    rig.agents.staged = 1
    commit = rig.agents.commit
    tries = 0

    async def commit_with_a_bug(url: str, req: CommitRequest) -> CommitAnswer:
        nonlocal tries
        tries += 1
        if tries == 1:
            raise RuntimeError("a bug")
        return await commit(url, req)

    rig.agents.commit = commit_with_a_bug  # type: ignore[method-assign]
    rig.sync.bump(1)
    await async_wait_until(lambda: a.weight_version == 1, 2, interval_s=0.005, message="version 1 active")
    assert tries == 2 and a.state == State.ACTIVE and a.last_error is None
