"""The evacuation plan (pure): which of a doomed box's sequences stay to finish there, which move, in what order;
and where placement puts the longest sequences in a fleet with preemptible boxes."""

from __future__ import annotations

import pytest

from rollout_manager.instances.registry import Instance, Kind, Registry
from rollout_manager.placement import preemptible
from rollout_manager.placement.box_speed import StepModel
from rollout_manager.placement.evacuation_plan import DoomedSequence, plan_evacuation

STEP = StepModel(a=0.02, b=0.001)  # 20 ms a step, 1 ms more per running sequence


def test_short_ones_stay_and_long_ones_move_longest_first() -> None:
    running = [DoomedSequence("short", 100, 50.0), DoomedSequence("long", 300, 5000.0),
               DoomedSequence("mid", 200, 900.0), DoomedSequence("tiny", 10, 5.0)]
    plan = plan_evacuation(running, STEP, time_left_s=30.0)
    # stayers alone: 50 steps of 20 ms and 55 sequence-steps of 1 ms = 1.055 s, well within 15 s;
    # "mid" would take 0.02 * 900 + 0.001 * 955 = 18.9 s > 15 s
    assert plan.stay == ("tiny", "short")
    assert plan.move == ("long", "mid")
    assert plan.stay_drain_s == pytest.approx(0.02 * 50 + 0.001 * 55)


def test_the_upper_quantile_and_the_budget_decide_where_given() -> None:
    # the median says 100 tokens, the evidence-backed upper quantile 2,000: counted at 2,000, it moves
    risky = DoomedSequence("risky", 0, 100.0, high=2000.0)
    assert plan_evacuation([risky], STEP, 30.0).move == ("risky",)
    # whatever the prediction, a sequence with 10 tokens of budget left stays
    capped = DoomedSequence("capped", 0, 5000.0, high=9000.0, budget_left=10)
    assert plan_evacuation([capped], STEP, 30.0).stay == ("capped",)


def test_no_figure_or_no_speed_moves_everything() -> None:
    unknown = DoomedSequence("unknown", 40, None)
    known = DoomedSequence("known", 900, 10.0)
    plan = plan_evacuation([known, unknown], STEP, 30.0)
    assert plan.stay == ("known",) and plan.move == ("unknown",)
    plan = plan_evacuation([known, unknown], None, 30.0)  # no box measured: nothing can be predicted
    assert plan.stay == () and plan.move == ("unknown", "known")
    assert plan_evacuation([known], STEP, 0.0).move == ("known",)  # at the deadline everything moves


def test_stayers_are_judged_together_and_ties_move_the_bigger_prefix_first() -> None:
    # n of them drain in 0.02 * 300 + 0.001 * 300 * n = 6 + 0.3 n s: five fit half of 15 s, six do not
    many = [DoomedSequence(f"s{k}", 10 * k, 300.0) for k in range(6)]
    plan = plan_evacuation(many, STEP, time_left_s=15.0)
    assert len(plan.stay) == 5 and plan.stay_drain_s <= 7.5
    assert plan.move == ("s0",)  # of equal lengths the one that made least moves
    assert plan_evacuation([], STEP, 15.0).stay == ()


# ------------------------------------------------------------ where the longest go (placement.preemptible)


def _boxes(*flags: bool) -> list[Instance]:
    registry = Registry()
    return [registry.add("127.0.0.1", 9000 + k, Kind.REMOTE, preemptible=p) for k, p in enumerate(flags)]


def test_the_longest_go_to_boxes_that_will_not_vanish_when_there_is_the_choice() -> None:
    spot, steady, spot2 = _boxes(True, False, True)
    assert preemptible.steady_first([spot, steady, spot2], 5000.0, 1024) == [steady]
    assert preemptible.steady_first([spot, steady, spot2], 500.0, 1024) == [spot, steady, spot2]  # short: any
    assert preemptible.steady_first([spot, steady], None, 1024) == [spot, steady]  # no prediction: unchanged
    assert preemptible.steady_first([spot, spot2], 5000.0, 1024) == [spot, spot2]  # no choice: unchanged
    assert preemptible.steady_first([spot, steady], 5000.0, 0) == [spot, steady]  # the rule off
    all_steady = _boxes(False, False)
    assert preemptible.steady_first(all_steady, 5000.0, 1024) == all_steady  # no preemptible box: unchanged
    status = preemptible.rule_status([spot, steady], 1024, predicted=True)
    assert status["applies"] and ">= 1024 tokens go to non-preemptible boxes" in status["rule"]
    assert not preemptible.rule_status(all_steady, 1024, predicted=True)["applies"]
