"""How many boxes of each kind the rest of the step needs to end within a target: the number an autoscaler acts on.

The manager never starts or stops machines; it says what it would want. The figure comes from what placement
already knows: each box's decode step ``a + b * n`` (``box_speed.StepModel``) and bound ``B``, the tokens its
running sequences are still predicted to make (``W``, the longest of them ``L``: ``makespan.BoxWork``), and
the predicted tokens of each sequence still waiting. Under continuous batching a box that makes ``W`` tokens
with ``L`` the longest needs at least ``max(L, W / B)`` decode steps, and pays ``b`` for every token, so it
drains in ``a * max(L, W / B) + b * W`` seconds (``makespan``'s closed form with the batch bound). That is a
box full to the end; once nothing waits, its last batch drains with ever fewer running, about half full over
the last sequence's length, so the batch term counts ``W / B + m / 2`` steps (``m``: the step's mean predicted
length; in ``benchmarks/sim_preemption.py --scale``, without it three boxes the signal found enough ended 4%
past a target). Within ``target_s`` a box therefore holds at most the ``W`` that keeps this at ``target_s``:
its room.

:func:`fleet_demand` places the waiting sequences longest first into the room of the boxes there are (they are
paid for already), and where none has room, opens a box of the kind that makes a token cheapest (its price
per hour over its tokens per hour at its bound; kinds without a price after priced ones, fastest first) that
can still make the sequence within the target. Past the longest few hundred, sequences are short beside the
boxes' room and are poured in as a volume. A box is *wanted* while it has running work or is given some: once
the queue is drained and nothing runs, every kind wants none. Pure: plain values in, a plain value out; the
caller decides how often to ask.

What a box's kind is (``BoxKind.name``) is the caller's: the manager groups boxes by whether they are
preemptible and by their price per hour, which is how an operator tells machine types apart.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist

from rollout_manager.placement.box_speed import StepModel

__all__ = ["BoxKind", "BoxNow", "KindDemand", "FleetDemand", "fleet_demand", "room", "drain_s", "EXACT"]

EXACT = 256  # waiting sequences placed one by one, longest first; the rest as a volume of tokens
MAX_SIGMA = 1.5  # log-space spread a mean is read from at most (a wild upper quantile must not swamp the volume)


@dataclass(frozen=True, slots=True)
class BoxKind:
    """A kind of box the fleet can grow by: its step model (the median of its measured boxes), its bound,
    and what one costs (None: not told)."""

    name: str
    step: StepModel
    bound: int
    price_per_hour: float | None = None
    preemptible: bool = False

    def tokens_per_hour(self) -> float:
        return 3600.0 * self.step.rate(self.bound)


@dataclass(frozen=True, slots=True)
class BoxNow:
    """One box there is: its kind, its step model (None: its kind's), bound and the predicted work it runs
    (``tokens`` in all, ``longest`` the longest sequence's)."""

    kind: str
    step: StepModel | None
    bound: int
    running: int
    tokens: float
    longest: float


@dataclass(frozen=True, slots=True)
class KindDemand:
    """One kind's figures: boxes registered now, how many of them run work, and how many the step wants in
    all (``wanted``; ``wanted - boxes`` more when positive)."""

    kind: str
    price_per_hour: float | None
    preemptible: bool
    boxes: int
    busy: int
    wanted: int

    @property
    def more(self) -> int:
        return max(self.wanted - self.boxes, 0)


@dataclass(frozen=True, slots=True)
class FleetDemand:
    """The rest of the step as the signal sees it: its work, the boxes wanted per kind, and when the step
    is predicted to end with them (``predicted_end_s`` from now; above ``target_s``: some sequence is too
    long for any kind to make in time, or its box already holds more than the target allows)."""

    target_s: float
    running_tokens: float
    waiting_sequences: int
    waiting_tokens: float
    kinds: tuple[KindDemand, ...]
    predicted_end_s: float
    measured: bool = True  # False: no box's speed is known yet, and the counts only hold what there is

    @property
    def within_target(self) -> bool:
        return self.predicted_end_s <= self.target_s * (1.0 + 1e-9)

    @property
    def wanted(self) -> int:
        return sum(k.wanted for k in self.kinds)


def drain_s(step: StepModel, bound: int, tokens: float, longest: float, ramp: float = 0.0) -> float:
    """Seconds a box of ``step`` and ``bound`` needs to make ``tokens``, the longest sequence ``longest``, its last
    batch draining over ``ramp`` more steps than a full one would take."""
    if tokens <= 0:
        return 0.0
    return step.a * max(longest, tokens / max(bound, 1) + ramp) + step.b * tokens


def room(step: StepModel, bound: int, longest: float, target_s: float, ramp: float = 0.0) -> float:
    """The most tokens a box of ``step`` and ``bound`` whose longest sequence makes ``longest`` can make in
    ``target_s`` (0 when even that sequence cannot: :func:`drain_s` grows with the tokens, so this is where
    it reaches the target)."""
    a, b, bound = step.a, step.b, max(bound, 1)
    full = (target_s - a * ramp) / (a / bound + b)  # tokens when the batch bound, not the longest, sets the steps
    if full >= (longest - ramp) * bound:
        return max(full, 0.0)
    if b <= 0:
        return longest * bound if a * longest <= target_s else 0.0
    return max((target_s - a * longest) / b, 0.0)


class _Open:
    """A box in the plan: there now or opened by it, and the work it is given."""

    __slots__ = ("kind", "step", "bound", "tokens", "longest", "given", "ramp")

    def __init__(self, kind: str, step: StepModel, bound: int, tokens: float, longest: float, ramp: float) -> None:
        self.kind, self.step, self.bound = kind, step, bound
        self.tokens, self.longest = tokens, longest
        self.given = False
        self.ramp = ramp

    def room(self, target_s: float, longest: float = 0.0) -> float:
        return room(self.step, self.bound, max(self.longest, longest), target_s, self.ramp) - self.tokens

    def take(self, tokens: float, longest: float) -> None:
        self.tokens += tokens
        self.longest = max(self.longest, longest)
        self.given = True


def _rank(kinds: Sequence[BoxKind]) -> list[BoxKind]:
    """Kinds in the order boxes are opened: cheapest token first where priced (to three digits: kinds whose
    tokens cost about the same go fastest first, fewer boxes to start), then the unpriced, fastest first."""
    def key(k: BoxKind) -> tuple[bool, float, float, str]:
        rate = k.tokens_per_hour()
        cost = float(f"{k.price_per_hour / rate:.3g}") if k.price_per_hour is not None and rate > 0 else 0.0
        return (k.price_per_hour is None, cost, -rate, k.name)

    return sorted(kinds, key=key)


def _mean(median: float, high: float, quantile: float) -> float:
    """The mean of a lognormal length with this median and ``quantile``-quantile ``high``."""
    if high <= median:
        return median
    sigma = min(math.log(high / median) / NormalDist().inv_cdf(quantile), MAX_SIGMA)
    return median * math.exp(0.5 * sigma * sigma)


class _Plan:
    """One :func:`fleet_demand` call's working state: the boxes there are and those it opens, with the work each
    is given. Waiting sequences go in longest first (:meth:`place`), the rest as a volume (:meth:`pour`)."""

    def __init__(self, target_s: float, kinds: Sequence[BoxKind], ramp: float, there: list[_Open]) -> None:
        self.target_s, self.ramp = target_s, ramp
        self.ranked = _rank(kinds)
        self.boxes = there
        self.heap = [(-o.room(target_s), k) for k, o in enumerate(there)]  # most room first
        heapq.heapify(self.heap)

    def open_for(self, longest: float) -> _Open | None:
        """A new box of the first-ranked kind that makes ``longest`` within the target (else the fastest)."""
        if not self.ranked:
            return None
        fit = next((k for k in self.ranked if room(k.step, k.bound, longest, self.target_s, self.ramp) >= longest),
                   None)
        if fit is None:
            fit = min(self.ranked, key=lambda k: (k.step.a + k.step.b, k.name))
        o = _Open(fit.name, fit.step, fit.bound, 0.0, 0.0, self.ramp)
        self.boxes.append(o)
        return o

    def place(self, exact: Sequence[tuple[float, float]]) -> None:
        """Each ``(top, tokens)`` of the longest waiting sequences into the box with most room, when it has room
        for it, else into a new box; stops when no kind can be opened."""
        for top, r in exact:
            target: _Open | None = None
            if self.heap:
                _, k = self.heap[0]
                if self.boxes[k].room(self.target_s, top) >= r:
                    target = self.boxes[k]
                    heapq.heappop(self.heap)
            if target is None:
                target = self.open_for(top)
                if target is None:
                    break
                k = len(self.boxes) - 1
            target.take(r, top)
            heapq.heappush(self.heap, (-target.room(self.target_s), k))

    def pour(self, volume: float) -> None:
        """``volume`` tokens of short sequences into the room left, most room first, then into new boxes."""
        if volume <= 0 or not self.boxes:
            return
        for o in sorted(self.boxes, key=lambda o: -o.room(self.target_s)):
            if volume <= 0:
                break
            free = o.room(self.target_s)
            if free > 0:
                o.take(min(free, volume), 0.0)
                volume -= free
        while volume > 0:
            new = self.open_for(1.0)
            if new is None:
                break
            free = new.room(self.target_s)
            if free <= 0:  # no kind makes a token within the target: the rest on one box, late
                new.take(volume, 0.0)
                break
            new.take(min(free, volume), 0.0)
            volume -= free

    def end_s(self) -> float:
        return max((drain_s(o.step, o.bound, o.tokens, o.longest, self.ramp) for o in self.boxes), default=0.0)


def _waiting(waiting: Sequence[float], high: Sequence[float | None] | None,
             quantile: float) -> tuple[list[float], list[float]]:
    """Each waiting sequence's tokens as counted in a box's volume (its mean where its upper quantile is known,
    else its median) and in its box's longest term (its upper quantile where known)."""
    waits = [max(float(w), 1.0) for w in waiting]
    if high is None:
        return waits, waits
    means = [w if h is None else _mean(w, float(h), quantile) for w, h in zip(waits, high)]
    return means, [w if h is None else max(w, float(h)) for w, h in zip(means, high)]


def _kinds_wanted(kinds: Sequence[BoxKind], boxes: Sequence[BoxNow], plan: _Plan) -> tuple[KindDemand, ...]:
    """Per kind: the boxes there are, the busy ones, and the plan's boxes given work."""
    wanted: dict[str, int] = {}
    for o in plan.boxes:
        if o.given:
            wanted[o.kind] = wanted.get(o.kind, 0) + 1
    out = []
    for kind in kinds:
        mine = [b for b in boxes if b.kind == kind.name]
        out.append(KindDemand(kind.name, kind.price_per_hour, kind.preemptible, len(mine),
                              sum(1 for b in mine if b.running > 0 or b.tokens > 0), wanted.get(kind.name, 0)))
    return tuple(out)


def fleet_demand(target_s: float, kinds: Sequence[BoxKind], boxes: Sequence[BoxNow],
                 waiting: Sequence[float], high: Sequence[float | None] | None = None,
                 quantile: float = 0.9) -> FleetDemand:
    """The boxes of each of ``kinds`` the rest of the step needs to end within ``target_s`` seconds, given the
    ``boxes`` there are (a box whose kind is not among ``kinds`` is left out) and the predicted tokens of each
    waiting sequence (``waiting``: the length model's median). ``high``: beside each, its ``quantile``-quantile
    where the length model has one (``LengthModel.high``). It stands for the sequence in its box's longest term,
    as placement counts it (``Makespan.place``): a box ends with its longest sequence, and the longest of several
    alike in their median is nearer their upper quantile. With the median it also gives the sequence's mean
    (lognormal), which is what it counts for in a box's tokens: a thousand sequences make a thousand means,
    more than their medians by a seventh at the spread of a group's samples (in the simulator, a target 4% missed
    on the medians). Raises ValueError for a target that is not positive."""
    if not target_s > 0 or not math.isfinite(target_s):
        raise ValueError("target_s must be a positive number of seconds")
    by_name = {k.name: k for k in kinds}
    waits, tops = _waiting(waiting, high, quantile)
    counted = [b for b in boxes if b.kind in by_name]
    sequences = sum(b.running for b in counted) + len(waits)
    ramp = 0.5 * (sum(max(b.tokens, 0.0) for b in counted) + sum(waits)) / sequences if sequences else 0.0
    there = []
    for box in counted:
        o = _Open(box.kind, box.step or by_name[box.kind].step, box.bound, max(box.tokens, 0.0),
                  max(box.longest, 0.0), ramp)
        o.given = box.running > 0 or box.tokens > 0
        there.append(o)
    running_tokens = sum(o.tokens for o in there)
    plan = _Plan(target_s, kinds, ramp, there)
    pairs = list(zip(tops, waits))
    exact = heapq.nlargest(EXACT, pairs) if len(pairs) > EXACT else sorted(pairs, reverse=True)
    plan.place(exact)
    plan.pour(sum(waits) - sum(r for _, r in exact))
    return FleetDemand(target_s, round(running_tokens, 1), len(waits), round(sum(waits), 1),
                       _kinds_wanted(kinds, boxes, plan), round(plan.end_s(), 3))
