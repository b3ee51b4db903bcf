"""Preemptible boxes and the step's tail: the sequences predicted longest go to boxes that will not vanish.

A preemptible box (registered with ``preemptible: true``) may be taken back at any time; a sequence it holds
then moves (after a notice) or is made again from its last chunk (without one). The sequences predicted to run
longest are the ones a loss costs most and the ones that set the step's end, so when placement has the choice
they go to non-preemptible boxes. The rule: a sequence predicted to make at least ``long_tokens`` more (the
length model's upper quantile where it has evidence, else its median) is placed among the non-preemptible boxes
with room, when the fleet has both kinds and at least one of those has room; otherwise, and for every shorter
sequence, placement is unchanged. A fleet with no preemptible box never sees a difference.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from rollout_manager.instances.registry import Instance

DEFAULT_LONG_TOKENS = 1024


def steady_first(candidates: list[Instance], tokens: float | None, long_tokens: int) -> list[Instance]:
    """``candidates`` (boxes with room), narrowed to the non-preemptible ones for a sequence predicted to make
    ``tokens`` >= ``long_tokens`` (0: the rule is off) when they are a strict, non-empty part of them."""
    if not long_tokens or tokens is None or tokens < long_tokens:
        return candidates
    steady = [i for i in candidates if not i.preemptible]
    return steady if steady and len(steady) < len(candidates) else candidates


def rule_status(instances: Iterable[Instance], long_tokens: int, predicted: bool) -> dict[str, Any]:
    """What the status says of the rule: whether it applies now and in words."""
    boxes: Sequence[Instance] = list(instances)
    preemptible = sum(1 for i in boxes if i.preemptible)
    applies = bool(long_tokens) and predicted and 0 < preemptible < len(boxes)
    if not long_tokens:
        words = "off (preemptible_long_tokens = 0)"
    elif not predicted:
        words = "inactive: lengths are not predicted (scheduler_policy is not makespan)"
    else:
        words = (f"sequences predicted to make >= {long_tokens} tokens go to non-preemptible boxes when one has room"
                 + ("" if applies else " (inactive: the fleet is not a mix of preemptible and other boxes)"))
    return {"rule": words, "applies": applies, "long_tokens": long_tokens, "preemptible_boxes": preemptible,
            "boxes": len(boxes)}
