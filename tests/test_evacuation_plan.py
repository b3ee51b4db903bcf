"""The evacuation plan (pure): which of a doomed box's sequences stay to finish there, which move, in what order;
and where placement puts the longest sequences in a fleet with preemptible boxes."""

from __future__ import annotations

import random

import pytest

from rollout_manager.instances.registry import Instance, Kind, Registry
from rollout_manager.placement import preemptible
from rollout_manager.placement.box_speed import StepModel
from rollout_manager.placement.evacuation_plan import DoomedSequence, admits, plan_evacuation

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


# ------------------------------------------------------------ new work on a doomed box (admits)


def test_new_work_is_admitted_only_where_it_would_stay() -> None:
    # an empty box, 30 s left: half is 15 s; 40 tokens drain in 0.84 s, 900 in 18.9 s
    assert admits([], DoomedSequence("new", 0, 40.0), STEP, 30.0)
    assert not admits([], DoomedSequence("new", 0, 900.0), STEP, 30.0)
    # the upper quantile counts where there is one; the budget bounds it whatever the prediction
    assert not admits([], DoomedSequence("new", 0, 40.0, high=900.0), STEP, 30.0)
    assert admits([], DoomedSequence("new", 0, 5000.0, high=9000.0, budget_left=40), STEP, 30.0)
    # what moves off the box anyway does not count against it
    assert admits([DoomedSequence("long", 300, 5000.0)], DoomedSequence("new", 0, 40.0), STEP, 30.0)


def test_new_work_never_pushes_a_stayer_off() -> None:
    # 15 s left, 7.5 s to drain in: four of 300 take 7.2 s, five 7.5 s, six do not fit
    four = [DoomedSequence(f"s{k}", 10 * (k + 1), 300.0) for k in range(4)]
    assert admits(four, DoomedSequence("new", 0, 300.0), STEP, 15.0)
    five = [*four, DoomedSequence("s4", 50, 300.0)]
    assert not admits(five, DoomedSequence("new", 0, 300.0), STEP, 15.0)
    # shorter than every stayer, it would stay first, but one of the five would then move: refused
    assert not admits(five, DoomedSequence("new", 0, 100.0), STEP, 15.0)


def test_nothing_is_admitted_near_the_margin_or_without_figures() -> None:
    short = DoomedSequence("new", 0, 40.0)  # 0.84 s alone
    assert admits([], short, STEP, 2.0)  # 1 s to drain in
    assert not admits([], short, STEP, 1.6)  # 0.8 s: too close to the last moves
    assert not admits([], short, STEP, 0.0) and not admits([], short, STEP, -1.0)  # past them
    assert not admits([], short, None, 30.0)  # the box's speed unknown
    assert not admits([], DoomedSequence("new", 0, None), STEP, 30.0)  # no prediction, no budget
    assert admits([], DoomedSequence("new", 0, None, budget_left=40), STEP, 30.0)  # the budget is a bound


def test_admission_is_the_plan_made_with_the_new_sequence() -> None:
    """``admits`` reads only the stayers' longest and total: the same answer as a plan made with the new sequence
    that keeps it and every stayer, over random boxes."""
    rng = random.Random(5)
    for _ in range(500):
        running = [DoomedSequence(f"r{k}", rng.randrange(0, 400), rng.choice([None, rng.uniform(1, 2000)]),
                                  budget_left=rng.choice([None, rng.randrange(1, 3000)]))
                   for k in range(rng.randrange(0, 12))]
        new = DoomedSequence("new", 0, rng.uniform(1, 2000), budget_left=rng.randrange(1, 3000))
        left = rng.uniform(-1, 60)
        before = plan_evacuation(running, STEP, left)
        after = plan_evacuation([*running, new], STEP, left)
        replanned = left > 0 and "new" in after.stay and set(after.stay) == {*before.stay, "new"}
        assert admits(running, new, STEP, left) == replanned


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
