"""Start a box only when the manager wants one of its kind: ``launch_sglang.sh --start-when-wanted``.

The manager computes how many boxes of each kind (preemptible or not, price per hour) the step needs to end
by its target and shows it under ``fleet_demand`` in ``/get_instances_status`` (the scaling signal). A
launcher started ahead of need (a warm pool, a node an autoscaler brought up early) waits here, before it
loads the model, until that signal asks for more boxes of its kind; a kind the manager has not seen yet
starts when the fleet wants more boxes of any kind. Standard library only, like the rest of the box helper.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any

from rollout_manager.launch.box_common import BoxError, manager_call, normalize_addr, say
from rollout_manager.manager_client import INSTANCES_STATUS


@dataclass(frozen=True)
class StartVerdict:
    """Whether to start now, and why (one log line)."""

    start: bool
    why: str


def _same_price(a: Any, b: float | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return isinstance(a, (int, float)) and abs(float(a) - b) < 1e-9


def _count(value: Any) -> int:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0


def verdict(status: Any, preemptible: bool, price_per_hour: float | None) -> StartVerdict:
    """Read the manager's status document for a box of this kind."""
    demand = status.get("fleet_demand") if isinstance(status, dict) else None
    if not isinstance(demand, dict):
        return StartVerdict(True, "the manager shows no scaling signal (fleet_demand)")
    kinds = [k for k in demand.get("kinds") or [] if isinstance(k, dict)]
    mine = [k for k in kinds if bool(k.get("preemptible")) == preemptible
            and _same_price(k.get("price_per_hour"), price_per_hour)]
    if mine:
        more = _count(mine[0].get("more"))
        name = mine[0].get("kind", "this kind")
        return StartVerdict(more > 0, f"the manager wants {more} more box(es) of kind {name}")
    more = sum(_count(k.get("more")) for k in kinds)
    if more > 0:
        return StartVerdict(True, f"the manager wants {more} more box(es) and has seen none of this kind yet")
    if not kinds and _count(demand.get("waiting_sequences")) > 0:
        return StartVerdict(True, "sequences wait and the manager has no box")
    return StartVerdict(False, "the manager wants no more boxes")


def cmd_wait_wanted(args: argparse.Namespace) -> None:
    """Returns once the manager wants this box; says why it waits once, and once when it starts."""
    said = ""
    interval = max(args.interval, 0.1)
    while True:
        try:
            answer = manager_call(args.manager, "GET", INSTANCES_STATUS, timeout=min(max(interval, 1.0), 10.0))
            v = verdict(answer.body, args.preemptible, args.price_per_hour) if answer.status == 200 else \
                StartVerdict(False, f"the manager's status answers HTTP {answer.status}")
        except BoxError as exc:
            v = StartVerdict(False, f"the manager at {normalize_addr(args.manager)} does not answer ({exc})")
        if v.start:
            say(f"{v.why}: starting")
            return
        if v.why != said:
            said = v.why
            say(f"not starting yet: {v.why}; checking every {interval:g}s (--start-when-wanted)")
        time.sleep(interval)
