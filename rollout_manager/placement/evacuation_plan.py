"""Which of a doomed box's sequences stay to finish there and which move now (pure; the simulator calls it too).

A box that got a preemption notice keeps running until its deadline. A sequence predicted to end well before
then is cheapest left where it is (a move costs a prefill on another box); every other one is cut at its last
streamed token and continued elsewhere now, longest first, so the fleet has the whole notice to absorb the long
ones. "Well before" is judged on the box's learned step curve (``box_speed.StepModel``) with only the staying
sequences running: they stay while that drain, with their upper-quantile lengths where the length model has one,
ends within ``stay_share`` of the time left. The same rule admits new work to the box (``admits``): a sequence
goes there only if it would stay too, beside every one that stays now. Time is an argument; nothing here reads a
clock.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from rollout_manager.placement.box_speed import StepModel

# The staying sequences must be predicted to be done within this share of the time left before the deadline:
# a prediction that is off by up to 2x still ends before the box goes.
DEFAULT_STAY_SHARE = 0.5


@dataclass(frozen=True, slots=True)
class DoomedSequence:
    """One sequence running on the doomed box, as the plan needs it."""

    seq_id: str
    made: int  # tokens it made so far (all boxes)
    left: float | None  # tokens it is predicted to make still (the length model's median rest; None: no figure)
    high: float | None = None  # an upper quantile of ``left`` where the prediction rests on evidence (None: none)
    budget_left: int | None = None  # what its max_new_tokens still allows (None: no limit)

    def expected(self) -> float:
        """Tokens it is counted at: the upper quantile where there is one, within its budget; inf unknown."""
        figure = self.high if self.high is not None else self.left
        if figure is None:
            figure = math.inf
        if self.budget_left is not None:
            figure = min(figure, float(self.budget_left))
        return max(figure, 0.0)


@dataclass(frozen=True, slots=True)
class EvacuationPlan:
    """The plan: ``stay`` finish on the box, ``move`` leave now in that order (longest expected first)."""

    stay: tuple[str, ...]
    move: tuple[str, ...]
    stay_drain_s: float  # predicted seconds until the staying ones are all done on the box (0: none stay)
    stay_longest: float = 0.0  # the longest stayer's expected tokens
    stay_tokens: float = 0.0  # the stayers' expected tokens in all


@dataclass(frozen=True, slots=True)
class EvacuationAdmission:
    """What a doomed box may still take, from its last plan: its step model and what stays there.

    A new sequence is admitted when the box running it beside the stayers drains within ``stay_share`` of the
    time left: exactly when a plan made with it would keep it and every stayer (draining is monotone in what
    stays, so if it fits, so does every prefix; a sequence longer than the first that moves cannot fit). Nothing
    without a step model, without a finite figure for it, or once no time is left."""

    step: StepModel | None
    longest: float = 0.0
    tokens: float = 0.0

    def admits(self, new: DoomedSequence, time_left_s: float, stay_share: float = DEFAULT_STAY_SHARE) -> bool:
        expected = new.expected()
        if self.step is None or time_left_s <= 0 or not math.isfinite(expected):
            return False
        return self.step.drain_s(max(self.longest, expected), self.tokens + expected) <= time_left_s * stay_share

    def taking(self, new: DoomedSequence) -> EvacuationAdmission:
        """The admission once ``new`` (admitted) stays there too."""
        expected = new.expected()
        return replace(self, longest=max(self.longest, expected), tokens=self.tokens + expected)


def plan_evacuation(running: Sequence[DoomedSequence], step: StepModel | None, time_left_s: float,
                    stay_share: float = DEFAULT_STAY_SHARE) -> EvacuationPlan:
    """Split ``running`` (the doomed box's sequences) into those that stay and those that move.

    ``step``: the box's decode step model (None: no box is measured, nothing can be predicted, everything
    moves); ``time_left_s``: seconds until the deadline. Shortest expected first, a sequence stays while the box
    running the stayers alone drains within ``stay_share * time_left_s`` (``StepModel.drain_s``: its longest
    stayer's steps plus each stayer in its own). The rest move longest expected first (no figure counts as
    longest). Of equal lengths the one that made more stays first: its prefix is the dearest to prefill again.
    """
    order = sorted(running, key=lambda s: (s.expected(), -s.made, s.seq_id))
    budget_s = max(time_left_s, 0.0) * stay_share
    stay: list[str] = []
    longest = total = drain = 0.0
    if step is not None:
        for s in order:
            tokens = s.expected()
            if not math.isfinite(tokens):
                break
            with_it = step.drain_s(max(longest, tokens), total + tokens)
            if with_it > budget_s:
                break  # sorted: every later one is at least as long
            stay.append(s.seq_id)
            longest, total, drain = max(longest, tokens), total + tokens, with_it
    staying = set(stay)
    move = tuple(s.seq_id for s in reversed(order) if s.seq_id not in staying)
    return EvacuationPlan(tuple(stay), move, drain, longest, total)


def admission(plan: EvacuationPlan, step: StepModel | None) -> EvacuationAdmission:
    """What the box ``plan`` was made for may still take (``step``: its step model, as the plan had it)."""
    return EvacuationAdmission(step, plan.stay_longest, plan.stay_tokens)


def admits(running: Sequence[DoomedSequence], new: DoomedSequence, step: StepModel | None, time_left_s: float,
           stay_share: float = DEFAULT_STAY_SHARE) -> bool:
    """Whether the doomed box running ``running`` may take ``new`` as well (``EvacuationAdmission.admits`` on a
    plan made now): with it, the plan keeps it and every sequence it keeps without it."""
    plan = plan_evacuation(running, step, time_left_s, stay_share)
    return admission(plan, step).admits(new, time_left_s, stay_share)
