"""In process: which evacuating boxes the dispatcher may place a new sequence on (``Evacuator.admitting``, asked
by ``Dispatcher.try_acquire``): a cloud notice's box takes what it would keep, a SIGTERM notice's box nothing, nor
a box behind the weight version, nor one within the margin of its deadline."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from rollout_manager.instances.registry import Instance, Kind, Registry, State
from rollout_manager.instances.version import WeightVersion
from rollout_manager.placement.ask import Ask
from rollout_manager.placement.box_speed import StepModel
from rollout_manager.placement.dispatch import Dispatcher
from rollout_manager.placement.least_in_flight import LeastInFlight
from rollout_manager.rollout.evacuation import EvacuationSettings, Evacuator

STEP = StepModel(a=0.02, b=0.001)  # every box: 20 ms a step, 1 ms more per running sequence


def _fleet(n: int) -> tuple[Registry, Dispatcher, WeightVersion, Evacuator, list[Instance]]:
    registry = Registry()
    dispatcher = Dispatcher(registry, LeastInFlight(), clock=lambda: 100.0)  # time stands still: no race
    dispatcher.fleet.speeds.model = lambda iid: STEP  # type: ignore[method-assign]  # measured boxes
    version = WeightVersion()
    migrator: Any = SimpleNamespace(on=lambda inst: [], failed=None)  # nothing runs on the boxes
    evacuator = Evacuator(registry, version, dispatcher, migrator, None, EvacuationSettings())
    boxes = [registry.add("127.0.0.1", 9000 + k, Kind.REMOTE, preemptible=True) for k in range(n)]
    for box in boxes:
        assert registry.transition(box, State.ACTIVE, "healthy")
    return registry, dispatcher, version, evacuator, boxes


async def test_a_cloud_notice_box_takes_what_it_would_keep_a_sigterm_one_nothing() -> None:
    _, dispatcher, _, evacuator, (cloud, stopping) = _fleet(2)
    evacuator.start(cloud, 60.0, "aws", None)
    evacuator.start(stopping, 60.0, "sigterm", None)
    try:
        # 57 s to the margin, half of it to drain in: 16 tokens take 0.34 s, 5,000 take 105 s
        assert dispatcher.try_acquire(Ask(16)) is cloud
        assert dispatcher.try_acquire(Ask(5000)) is None
        assert dispatcher.try_acquire(Ask(5000, predicted=100.0)) is cloud  # the prediction within the budget
        assert dispatcher.try_acquire(Ask(16, high=5000.0)) is cloud  # the budget bounds the upper quantile
        assert dispatcher.try_acquire(Ask(5000, predicted=100.0, high=3000.0)) is None  # the upper quantile counts
        assert evacuator.active[cloud.id].admitted == 3
        assert evacuator.admitting(Ask(16)) == [cloud]  # never the box whose process is stopping
    finally:
        await evacuator.close()


async def test_nothing_goes_to_a_box_behind_the_weights_or_near_its_deadline() -> None:
    _, dispatcher, version, evacuator, (behind, soon) = _fleet(2)
    evacuator.start(behind, 60.0, "gce", None)
    evacuator.start(soon, 3.6, "azure", None)  # 0.6 s to the margin: 0.3 s to drain in
    try:
        version.current = 1  # a weight version came out after both notices; ``soon`` is behind too
        assert dispatcher.try_acquire(Ask(4)) is None
        version.current = 0
        assert evacuator.admitting(Ask(4)) == [behind, soon]  # 4 tokens: 0.084 s
        assert evacuator.admitting(Ask(16)) == [behind]  # 16 tokens: 0.34 s, past the 0.3 s left to drain in
    finally:
        await evacuator.close()
