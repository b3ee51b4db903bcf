"""The manager's scaling signal: its registry and dispatcher read into :func:`fleet_demand.fleet_demand`.

Read lazily (a ``/metrics`` scrape, a status call) and reused for ``reuse_s``: the computation is a pass over
the boxes and the waiting queue, cheap once a second, not on every scrape of several scrapers. A box's kind
is whether it is preemptible and its price per hour (the registration's ``preemptible`` and
``price_per_hour``); a kind's speed is the median of its measured boxes' step models (the fleet's median box
while none is measured). Kinds stay known after their last box left (a spot fleet preempted whole must still
be asked for), with the speed and bound they last had. Local (trainer-side) instances are the trainer's
GPUs, not the fleet's: they are left out.
"""

from __future__ import annotations

from collections.abc import Callable
from statistics import median
from typing import Any

from rollout_manager.instances.registry import Instance, Kind, Registry, State
from rollout_manager.placement.box_speed import StepModel
from rollout_manager.placement.dispatch import Dispatcher
from rollout_manager.placement.fleet_demand import BoxKind, BoxNow, FleetDemand, KindDemand, fleet_demand

__all__ = ["FleetSignal", "kind_name"]

# Boxes that serve or will: a pending or syncing box is coming, so it is counted rather than asked for again.
COUNTED = (State.PENDING, State.SYNCING, State.ACTIVE)
UNKNOWN_TOKENS = 512  # what a sequence without a prediction counts (the makespan policy's unknown_tokens)
MIN_LEFT = 128.0  # what a running sequence counts for at least (the makespan policy's min_left)


def kind_name(preemptible: bool, price_per_hour: float | None) -> str:
    """The label of a kind: ``preemptible`` or ``on_demand``, with its price where one was given."""
    head = "preemptible" if preemptible else "on_demand"
    return head if price_per_hour is None else f"{head}_{price_per_hour:g}_per_hour"


class FleetSignal:
    """The scaling signal of one manager (``scale_target_step_s``)."""

    def __init__(self, registry: Registry, dispatcher: Dispatcher, target_s: float, reuse_s: float = 1.0,
                 counted: Callable[[Instance], bool] | None = None) -> None:
        """``counted``: whether a box in a serving state counts as one the fleet has (default: all; an
        evacuating box does not)."""
        self.registry, self.dispatcher = registry, dispatcher
        self.target_s, self.reuse_s = target_s, reuse_s
        self.counted = counted
        self.kinds: dict[str, BoxKind] = {}  # every kind seen measured, as it last was
        self.unmeasured: dict[str, BoxKind] = {}  # kinds seen before any box was measured
        self._last: FleetDemand | None = None
        self._at = -1e300

    def demand(self) -> FleetDemand:
        """The fleet's demand now (at most ``reuse_s`` old)."""
        now = self.dispatcher.clock()
        if self._last is not None and 0 <= now - self._at < self.reuse_s:
            return self._last
        last = self._last = self._compute()
        self._at = now
        return last

    def _compute(self) -> FleetDemand:
        d = self.dispatcher
        models, fleet = d.fleet.speeds.models()
        boxes: list[tuple[Instance, str]] = []
        members: dict[str, list[Instance]] = {}
        traits: dict[str, tuple[bool, float | None]] = {}
        for inst in self.registry.in_state(*COUNTED, kind=Kind.REMOTE):
            if self.counted is not None and not self.counted(inst):
                continue
            preemptible, price = inst.preemptible, inst.price_per_hour  # what it said at registration
            name = kind_name(preemptible, price)
            traits[name] = (preemptible, price)
            members.setdefault(name, []).append(inst)
            boxes.append((inst, name))
        for name, insts in members.items():
            own = [m for i in insts if (m := models.get(i.id)) is not None]
            step = StepModel(median(m.a for m in own), median(m.b for m in own)) if own else fleet
            preemptible, price = traits[name]
            bound = int(median(d.capacity.bound_of(i) for i in insts))
            if step is not None:
                self.kinds[name] = BoxKind(name, step, bound, price, preemptible)
            elif name not in self.kinds:  # nothing measured anywhere yet: a stand-in the counts hold to
                self.unmeasured[name] = BoxKind(name, StepModel(1.0, 0.0), bound, price, preemptible)
        now_boxes = []
        for inst, name in boxes:
            n = inst.load.in_flight
            work = d.fleet.work.get(inst.id)
            if work is not None:
                tokens, longest = max(work.tokens, n * MIN_LEFT), max(work.longest, MIN_LEFT if n else 0.0)
            else:  # a policy that keeps no predicted work: each sequence counts what an unknown one does
                tokens = float(min(inst.load.in_flight_tokens, n * UNKNOWN_TOKENS))
                longest = float(min(tokens, UNKNOWN_TOKENS))
            now_boxes.append(BoxNow(name, models.get(inst.id), d.capacity.bound_of(inst), n, tokens if n else 0.0,
                                    longest if n else 0.0))
        waiters = d.capacity.waiters()
        waiting = [w.predicted if w.predicted is not None else float(min(w.tokens, UNKNOWN_TOKENS)) for w in waiters]
        high: list[float | None] = [w.high for w in waiters]
        held = d.fleet.last_predicted if d.fleet.last_predicted is not None else float(UNKNOWN_TOKENS)
        waiting += [held] * d.capacity.held_by_batches
        high += [None] * d.capacity.held_by_batches
        if self.kinds:
            return fleet_demand(self.target_s, list(self.kinds.values()), now_boxes, waiting, high)
        return _held(self.target_s, list(self.unmeasured.values()), now_boxes, waiting)

    def status(self) -> dict[str, Any]:
        """What ``/get_instances_status`` shows under ``fleet_demand``."""
        demand = self.demand()
        return {"measured": demand.measured, "target_s": demand.target_s, "predicted_end_s": demand.predicted_end_s,
                "within_target": demand.within_target, "running_tokens": demand.running_tokens,
                "waiting_sequences": demand.waiting_sequences, "waiting_tokens": demand.waiting_tokens,
                "wanted_boxes": demand.wanted,
                "kinds": [{"kind": k.kind, "preemptible": k.preemptible, "price_per_hour": k.price_per_hour,
                           "boxes": k.boxes, "busy": k.busy, "wanted": k.wanted, "more": k.more}
                          for k in demand.kinds]}


def _held(target_s: float, kinds: list[BoxKind], boxes: list[BoxNow], waiting: list[float]) -> FleetDemand:
    """Before any box is measured there is no speed to count boxes by: every box is wanted while work waits,
    the busy ones while only running work is left, none once nothing runs (``measured`` False)."""
    out = []
    for kind in kinds:
        mine = [b for b in boxes if b.kind == kind.name]
        busy = sum(1 for b in mine if b.running > 0)
        out.append(KindDemand(kind.name, kind.price_per_hour, kind.preemptible, len(mine), busy,
                              len(mine) if waiting else busy))
    return FleetDemand(target_s, round(sum(b.tokens for b in boxes), 1), len(waiting), round(sum(waiting), 1),
                       tuple(out), 0.0, measured=False)
