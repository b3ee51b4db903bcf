"""The step's tail off preemptible boxes (placement/preemptible.py), in process: the rule alone, and the
dispatcher with the rule wired as the manager wires it (``narrow_remote``)."""

from __future__ import annotations

from rollout_manager.instances.registry import Instance, Kind, Registry, State
from rollout_manager.placement import preemptible
from rollout_manager.placement.ask import Ask
from rollout_manager.placement.dispatch import Dispatcher
from rollout_manager.placement.least_in_flight import LeastInFlight

LONG = 1024


def fleet(*spot: bool) -> tuple[Registry, Dispatcher, list[Instance]]:
    registry = Registry()
    boxes = []
    for k, is_spot in enumerate(spot):
        inst = registry.add("127.0.0.1", 30000 + k, Kind.REMOTE, preemptible=is_spot)
        assert registry.transition(inst, State.ACTIVE, "test: healthy")
        boxes.append(inst)
    d = Dispatcher(registry, LeastInFlight(), max_in_flight_per_instance=4)  # bounded as manager.py bounds it
    d.narrow_remote = lambda cands, tokens: preemptible.steady_first(cands, tokens, LONG)  # as manager.py does
    return registry, d, boxes


def test_the_rule_narrows_only_long_sequences_and_only_in_a_mixed_fleet() -> None:
    _, _, (spot, steady) = fleet(True, False)
    assert preemptible.steady_first([spot, steady], LONG, LONG) == [steady]
    assert preemptible.steady_first([spot, steady], LONG - 1, LONG) == [spot, steady]
    assert preemptible.steady_first([spot, steady], None, LONG) == [spot, steady]  # no prediction
    assert preemptible.steady_first([spot, steady], 10 * LONG, 0) == [spot, steady]  # the rule off
    assert preemptible.steady_first([spot], 10 * LONG, LONG) == [spot]  # no steady box has room: as before
    assert preemptible.steady_first([steady], 10 * LONG, LONG) == [steady]
    status = preemptible.rule_status([spot, steady], LONG, predicted=True)
    assert status["applies"] and (status["preemptible_boxes"], status["boxes"]) == (1, 2)
    assert not preemptible.rule_status([steady], LONG, predicted=True)["applies"]
    assert not preemptible.rule_status([spot, steady], LONG, predicted=False)["applies"]
    assert not preemptible.rule_status([spot, steady], 0, predicted=True)["applies"]


def test_the_dispatcher_puts_the_long_ones_on_the_steady_box_while_it_has_room() -> None:
    _, d, (spot, steady) = fleet(True, False)
    # least in flight would alternate; the long ones all go to the steady box, up to its bound of 4
    for _ in range(4):
        assert d.try_acquire(Ask(4096, predicted=2000.0)) is steady
    assert d.try_acquire(Ask(4096, predicted=2000.0)) is spot  # the steady box is full: placed as before
    _, d, (spot, steady) = fleet(True, False)
    assert d.try_acquire(Ask(4096, predicted=100.0, high=1500.0)) is steady  # the upper quantile counts
    _, d, (spot, steady) = fleet(True, False)
    first, second = d.try_acquire(Ask(512, predicted=100.0)), d.try_acquire(Ask(512, predicted=100.0))
    assert sorted(i.port for i in (first, second)) == [spot.port, steady.port]  # short: least in flight, both
