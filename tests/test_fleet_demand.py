"""The scaling signal's pure part (placement.fleet_demand): how many boxes of each kind the rest of a step needs."""

from __future__ import annotations

import math

import pytest

from rollout_manager.placement.box_speed import StepModel
from rollout_manager.placement.fleet_demand import BoxKind, BoxNow, drain_s, fleet_demand, room

STEP = StepModel(0.006, 0.00008)  # 6 ms + 0.08 ms a running sequence
SLOW = StepModel(0.006 / 0.35, 0.00008 / 0.35)
BOUND = 64
FAST = BoxKind("on_demand_4_per_hour", STEP, BOUND, 4.0)
CHEAP = BoxKind("preemptible_1_per_hour", SLOW, BOUND, 1.0, preemptible=True)  # 0.35x the speed, 1/4 the price


def idle(kind: BoxKind, n: int) -> list[BoxNow]:
    return [BoxNow(kind.name, None, kind.bound, 0, 0.0, 0.0) for _ in range(n)]


def wanted(demand, kind: BoxKind) -> int:
    return next(k.wanted for k in demand.kinds if k.kind == kind.name)


def test_room_is_where_the_drain_reaches_the_target() -> None:
    for longest in (0.0, 100.0, 2000.0, 4500.0):
        for ramp in (0.0, 300.0):
            w = room(STEP, BOUND, longest, 30.0, ramp)
            assert drain_s(STEP, BOUND, w, longest, ramp) == pytest.approx(30.0, rel=1e-9)
    assert room(STEP, BOUND, 6000.0, 30.0) == 0.0  # one sequence of 6000 tokens takes 36 s alone


def test_nothing_waiting_and_nothing_running_wants_no_box_of_any_kind() -> None:
    demand = fleet_demand(60.0, [FAST, CHEAP], idle(FAST, 3) + idle(CHEAP, 5), [])
    assert [k.wanted for k in demand.kinds] == [0, 0] and demand.wanted == 0
    assert [k.boxes for k in demand.kinds] == [3, 5] and demand.predicted_end_s == 0.0
    assert fleet_demand(60.0, [FAST], [], []).wanted == 0  # no box left either


def test_running_work_keeps_its_boxes_and_only_them() -> None:
    busy = [BoxNow(FAST.name, None, BOUND, 10, 4000.0, 800.0), BoxNow(FAST.name, None, BOUND, 2, 300.0, 200.0)]
    demand = fleet_demand(60.0, [FAST], busy + idle(FAST, 4), [])
    (k,) = demand.kinds
    assert (k.boxes, k.busy, k.wanted, k.more) == (6, 2, 2, 0)
    assert demand.predicted_end_s == pytest.approx(drain_s(STEP, BOUND, 4000.0, 800.0))


def test_waiting_work_asks_for_the_fewest_boxes_that_end_within_the_target() -> None:
    """Two thousand sequences of 400 tokens: the boxes asked for make them within the target, one fewer
    could not (their room in all is less than the work)."""
    target = 60.0
    waiting = [400.0] * 2000
    demand = fleet_demand(target, [FAST], idle(FAST, 2), waiting)
    n = wanted(demand, FAST)
    assert demand.within_target and demand.predicted_end_s <= target
    per_box = room(STEP, BOUND, 400.0, target, ramp=200.0)  # the last batch drains over half a length more
    assert (n - 1) * per_box < sum(waiting) <= n * per_box + 400.0
    assert demand.kinds[0].more == n - 2 and demand.waiting_sequences == 2000


def test_new_boxes_are_of_the_kind_whose_token_is_cheapest() -> None:
    # CHEAP: 0.35x the tokens at a quarter of the price, so its token costs 0.71x FAST's
    demand = fleet_demand(120.0, [FAST, CHEAP], idle(FAST, 1), [300.0] * 3000)
    assert wanted(demand, CHEAP) > 0 and wanted(demand, FAST) == 1  # the box there is used first
    demand = fleet_demand(120.0, [FAST, BoxKind(CHEAP.name, SLOW, BOUND, 3.0, True)], idle(FAST, 1),
                          [300.0] * 3000)
    assert wanted(demand, FAST) > 1 and wanted(demand, CHEAP) == 0  # at 3/h its token costs more


def test_a_sequence_too_long_for_the_cheap_kind_gets_a_kind_that_makes_it_in_time() -> None:
    target = 30.0
    long = 0.8 * target / (STEP.a + STEP.b)  # FAST makes it in 0.8 x the target, CHEAP in 2.3x
    demand = fleet_demand(target, [FAST, CHEAP], [], [long, 100.0, 100.0])
    assert wanted(demand, FAST) == 1 and demand.within_target
    assert wanted(demand, CHEAP) == 0  # the short ones fit beside the long one


def test_work_no_kind_can_make_in_time_is_said_to_end_late() -> None:
    target = 10.0
    too_long = 2 * target / (STEP.a + STEP.b)
    demand = fleet_demand(target, [FAST, CHEAP], [], [too_long])
    assert wanted(demand, FAST) == 1 and not demand.within_target  # the fastest kind, the best there is
    assert demand.predicted_end_s == pytest.approx(drain_s(STEP, BOUND, too_long, too_long))
    stuck = [BoxNow(CHEAP.name, None, BOUND, 1, 5000.0, 5000.0)]  # a box already holding more than the target
    assert not fleet_demand(target, [FAST, CHEAP], stuck, []).within_target


def test_a_long_queue_is_counted_as_a_volume_past_the_longest() -> None:
    waiting = [float(50 + (k * 7919) % 3000) for k in range(20_000)]
    target = 90.0
    demand = fleet_demand(target, [FAST], [], waiting)
    n = wanted(demand, FAST)
    assert demand.within_target
    ramp = 0.5 * sum(waiting) / len(waiting)
    assert n <= math.ceil(sum(waiting) / room(STEP, BOUND, 0.0, target, ramp)) + 2


def test_a_box_measured_on_its_own_uses_its_own_curve() -> None:
    own_slow = BoxNow(FAST.name, SLOW, BOUND, 0, 0.0, 0.0)
    base = fleet_demand(60.0, [FAST], idle(FAST, 1), [400.0] * 600)
    slow = fleet_demand(60.0, [FAST], [own_slow], [400.0] * 600)
    assert wanted(slow, FAST) > wanted(base, FAST)


@pytest.mark.parametrize("target", [0.0, -1.0, math.inf, math.nan])
def test_a_target_that_is_not_a_positive_number_is_refused(target: float) -> None:
    with pytest.raises(ValueError, match="target_s"):
        fleet_demand(target, [FAST], [], [])


def test_an_upper_quantile_stands_for_a_waiting_sequence_in_its_boxs_longest_term() -> None:
    """As placement counts it: a sequence predicted 100 tokens whose upper quantile is 3,000 needs a kind that
    makes 3,000 within the target (CHEAP takes 52 s for that alone)."""
    assert wanted(fleet_demand(30.0, [FAST, CHEAP], [], [100.0]), CHEAP) == 1
    demand = fleet_demand(30.0, [FAST, CHEAP], [], [100.0, 100.0], high=[3000.0, None])
    assert wanted(demand, FAST) == 1 and wanted(demand, CHEAP) == 0


def test_a_waiting_sequence_counts_its_mean_where_its_spread_is_known() -> None:
    """Median 400 and 0.9-quantile 800: a lognormal of sigma ln 2 / 1.2816, whose mean is 400 exp(sigma^2 / 2);
    without a quantile the median is all there is. A wild quantile is read at sigma 1.5 at most."""
    sigma = math.log(2.0) / 1.2815515655446004
    demand = fleet_demand(60.0, [FAST], [], [400.0, 400.0, 400.0], high=[800.0, None, 1e9])
    assert demand.waiting_tokens == pytest.approx(400 * math.exp(sigma ** 2 / 2) + 400 + 400 * math.exp(1.125),
                                                  abs=0.1)
