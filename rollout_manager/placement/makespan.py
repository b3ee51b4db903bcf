"""Placement for the step's makespan: the longest predicted work first, each sequence where the step ends soonest.

An RL step is over when its last sequence is, so what placement must keep short is the time until the
busiest box is empty. Under continuous batching that time has a closed form: a box whose decode step
costs ``a + b * n`` (``box_speed.StepModel``), running sequences with ``r_1 >= r_2 >= ...`` tokens left,
is empty after ``r_1`` steps, and sequence ``k`` is in ``r_k`` of them, so it drains in
``a * r_1 + b * sum(r_k)`` seconds. :class:`Makespan` puts each sequence on the box whose drain time,
with the sequence added, is least (list scheduling on the boxes' own speed curves), and the dispatcher
offers its waiting sequences longest predicted first, which makes that LPT. What follows from the rule:

- a sequence predicted long goes to a fast box with few tokens beside it: ``a * r`` dominates there,
  and each sequence beside it adds ``b * r`` to it;
- short sequences are batched densely on the other boxes: one adds only ``b * its length`` to a box
  whose longest sequence is longer, so it goes where that total is still least;
- a box holding a tail sequence takes no short work that would push it past another box's drain: the
  tail box has the largest drain, so short work lands elsewhere while anywhere else is below it;
- at a piece boundary (``prefer``: the box the sequence is on, whose prefix cache holds it) every other
  box is charged one prefill of the sequence so far, so it moves only when that wins more than it costs.

Pure (no I/O, time an argument): the dispatcher and ``benchmarks/bench_scheduling.py`` run this code.
Predictions are the length model's (``lengths``); a sequence without one counts ``unknown_tokens``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rollout_manager.placement.instance_load import InstanceLoad

__all__ = ["BoxWork", "Makespan"]


@dataclass(slots=True)
class BoxWork:
    """What the length model predicts one box's sequences still make: in all, and the longest of them.

    The dispatcher knows which box a sequence was placed on but not which sequence each chunk or release
    belongs to, so this is an estimate kept in O(1) per event: a chunk of ``t`` tokens with ``n`` running
    takes ``t`` from the total and ``t / n`` from the longest (one step makes one token of each); a
    sequence that ends takes its mean share; an empty box forgets everything.
    """

    tokens: float = 0.0
    longest: float = 0.0

    def placed(self, predicted: float, longest: float | None = None) -> None:
        """A sequence predicted to make ``predicted`` tokens was placed here; ``longest`` (default
        ``predicted``) is what it counts for as the box's longest (:meth:`Makespan.counted`)."""
        self.tokens += predicted
        top = predicted if longest is None else longest
        if top > self.longest:
            self.longest = top

    def made(self, tokens: int, running: int) -> None:
        left = self.tokens - tokens
        self.tokens = left if left > 0 else 0.0
        longest = self.longest - tokens / (running if running > 1 else 1)
        self.longest = min(longest if longest > 0 else 0.0, self.tokens)

    def ended(self, running_before: int) -> None:
        if running_before <= 1:
            self.tokens = self.longest = 0.0
            return
        self.tokens -= self.tokens / running_before
        self.longest = min(self.longest, self.tokens)


class Makespan:
    """Each sequence where the step ends soonest, by the boxes' fitted speed curves and predicted work.

    ``unknown_tokens``: what a sequence with no prediction counts (at most its budget). ``min_left``: what
    each sequence running on a box counts for at least (one that outran its prediction is still running,
    and :class:`BoxWork` would count it as done).
    ``prefill_factor``: prefill runs this many times faster than a lone sequence decodes, which prices a
    move of ``context`` tokens (prompt and tokens made) at ``context * step_s(1) / prefill_factor``
    seconds, plus ``move_overhead_s``. ``max_in_flight``: an optional cap per box. Before any box is
    measured (no step model anywhere) it keeps a sequence where its prefix is (``prefer``), else places
    by least predicted work, then fewest in flight.
    """

    name = "makespan"
    orders_queue = True  # the dispatcher offers its waiting sequences longest predicted first

    def __init__(self, unknown_tokens: int = 512, prefill_factor: float = 200.0, move_overhead_s: float = 0.3,
                 max_in_flight: int | None = None, min_left: float = 128.0) -> None:
        if unknown_tokens < 1 or prefill_factor <= 0 or move_overhead_s < 0:
            raise ValueError("unknown_tokens must be >= 1, prefill_factor > 0, move_overhead_s >= 0")
        if max_in_flight is not None and max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        self.unknown_tokens = unknown_tokens
        self.prefill_factor = prefill_factor
        self.move_overhead_s = move_overhead_s
        self.max_in_flight = max_in_flight
        self.min_left = min_left

    def expected(self, request_tokens: int, predicted: float | None) -> float:
        """The tokens a sequence counts for: its prediction, else ``unknown_tokens``, never past its budget."""
        guess = float(self.unknown_tokens) if predicted is None else predicted
        return max(min(guess, float(request_tokens)), 1.0)

    def counted(self, request_tokens: int, predicted: float | None,
                high: float | None = None) -> tuple[float, float]:
        """What a sequence counts for in a box's total (:meth:`expected`) and in its longest term: ``high``
        where given (see :meth:`place`), never under the total's figure nor past the budget."""
        tokens = self.expected(request_tokens, predicted)
        return tokens, tokens if high is None else max(tokens, min(high, float(request_tokens)))

    def move_price_s(self, c: InstanceLoad, context_tokens: int | None) -> float:
        """Seconds a sequence of ``context_tokens`` (None: unknown, the overhead only) pays to start on ``c``
        rather than where its prefix is cached."""
        step = c.step
        if step is None or not context_tokens:
            return self.move_overhead_s
        return self.move_overhead_s + context_tokens * step.step_s(1) / self.prefill_factor

    def pick(self, candidates: Sequence[InstanceLoad], request_tokens: int, now: float) -> str | None:
        return self.place(candidates, request_tokens, now)

    def place(self, candidates: Sequence[InstanceLoad], request_tokens: int, now: float,
              predicted: float | None = None, prefer: str | None = None,
              context_tokens: int | None = None, high: float | None = None) -> str | None:
        """The box whose drain time with this sequence added is least (a move priced, see the class).

        ``high``: an upper quantile of what it makes, where the length model has the prompt's history or
        finished siblings to say so (``LengthModel.high``). It stands for the sequence in the box's longest
        term, the median in its total: a box's end is its longest sequence's, and the longest of a few
        samples alike in their median is nearer their upper quantile. So a box given a group predicted
        long takes less short work beside it (in ``benchmarks/sim_tail.py``, 16 seeds: epochs with
        history 1.10x and 1.09x of clairvoyant with the median alone, 1.06x and 1.07x with it).

        It never holds a sequence back while a box has room: in the simulator, holding it for a full box
        that drains sooner, or keeping the fastest box at half a batch for the tail, both made the step
        longer (the held work waits on one box while the others empty)."""
        tokens, top = self.counted(request_tokens, predicted, high)
        cap, min_left, overhead = self.max_in_flight, self.min_left, self.move_overhead_s
        # One pass (a thousand candidates per placement): the least drain among boxes with a step model and,
        # in case some box has none (nothing is measured yet: the fleet's figure stands in for a box not
        # measured, so it is all or none), the least predicted work, the prefix's box first.
        best: tuple[float, int, str] | None = None
        unmeasured: tuple[float, int, str] | None = None
        for c in candidates:
            n = c.in_flight_requests
            if cap is not None and n >= cap:
                continue
            iid = c.instance_id
            step = c.step
            if step is None:
                key = (-1.0 if iid == prefer else c.predicted_tokens + tokens, n, iid)
                if unmeasured is None or key < unmeasured:
                    unmeasured = key
                continue
            longest = c.longest_tokens
            if longest < top:
                longest = top
            if n and longest < min_left:
                longest = min_left
            work = c.predicted_tokens
            if work < n * min_left:
                work = n * min_left
            drain = step.a * longest + step.b * (work + tokens)
            if prefer is not None and iid != prefer:
                drain += self.move_price_s(c, context_tokens) if context_tokens else overhead
            if best is None or drain < best[0] or (drain == best[0] and (n, iid) < best[1:]):
                best = (drain, n, iid)
        if unmeasured is not None:
            if best is not None:  # some measured, some not (not from the dispatcher): by work, all of them
                return self._by_work(candidates, tokens, prefer)
            return unmeasured[2]
        return best[2] if best is not None else None

    def _by_work(self, candidates: Sequence[InstanceLoad], tokens: float, prefer: str | None) -> str | None:
        cap = self.max_in_flight
        open_ = [c for c in candidates if cap is None or c.in_flight_requests < cap]
        if not open_:
            return None
        return min(open_, key=lambda c: (-1.0 if c.instance_id == prefer else c.predicted_tokens + tokens,
                                         c.in_flight_requests, c.instance_id)).instance_id
