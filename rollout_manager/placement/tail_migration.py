"""Tail migration's decision (pure): which running sequences to move, at the end of a batch, to boxes where
they finish sooner, and the values it decides on.

No I/O, time an argument: the daemon (``rollout/migration.py`` tracks what streams where and starts the
moves) and the simulators (``benchmarks/sim_pool.py``, ``benchmarks/sim_tail.py``) run the same plan. Before a
box has a learned step curve its step is read from the batch model of ``rate_meter.per_sequence_rate``.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from rollout_manager.placement.box_speed import StepModel
from rollout_manager.placement.instance_load import InstanceLoad

__all__ = ["Rest", "RunningSequence", "Move", "TailMigration"]


class Rest(NamedTuple):
    """What the length model says of a running sequence: the ``tokens`` it still makes (its conditional
    median's rest), and whether evidence ``informed`` that (the prompt's earlier lengths or a sibling that
    finished, ``LengthModel.informed``) rather than the fleet's figure alone."""

    tokens: float
    informed: bool = False


@dataclass
class RunningSequence:
    """One sequence in flight, as the manager knows it (never its true length)."""

    seq_id: str
    instance_id: str
    made: int  # tokens made so far, over every segment
    prompt_tokens: int
    budget_left: int | None  # None: no limit (the engine stops at its context)
    moves: int = 0  # migrations so far
    last_moved_at: float | None = None
    visited: frozenset[str] = frozenset()  # instances it has run on (never moved back to one)


@dataclass(frozen=True)
class Move:
    seq_id: str
    source: str
    target: str
    gain_s: float  # expected seconds saved, after the re-prefill
    swap: bool = False  # made while requests wait: the target is at its bound and takes it into its next free slot


class TailMigration:
    """Which running sequences to move, at the end of a batch, to instances where they finish sooner.

    Only while nothing waits in the manager (otherwise an idle instance gets that waiting work, and
    moving would only reshuffle). Each box's step time at each running count is its learned curve
    (``InstanceLoad.step``; before one, the batch model of ``rate_meter`` from its measured lone rate): a configured
    ``batch_half`` says nothing true of a fleet it was not set for (64 against 34 on a fleet of
    10 + 0.3 n ms made full boxes look 1.3x faster per sequence than they are). A sequence's tokens left
    are the larger of its age (a sequence that made ``m`` tends to make about as many more; at least
    ``min_tokens``) and the length model's figure (``predict``), never past its budget: the model's
    conditional median of a sequence far past its siblings is small ("about to end") and would price every
    move of the tail below ``min_gain_s``. Moving costs the re-prefill of prompt plus tokens made, at
    ``prefill_factor`` times the target's lone step, plus ``move_overhead_s`` (abort, reconnect, scheduling).

    Candidates go latest expected finish first; each searches the targets fastest first (its step there with
    the moves already planned and it added) and takes the first it would finish on sooner by ``min_speedup``
    and ``min_gain_s``; a target it ran on, or (for the predicted tail) a crowded one, is passed over and the
    search goes on (it used to end there, leaving the sequence where it was). Sequences on a ``draining``
    instance move whenever a target exists. Where the length model predicts, a sequence predicted to end
    where it runs before ``tail_share`` of the step's predicted end stays: it is not the tail. That end is
    the latest drain of the *other* boxes (``makespan.BoxWork``'s figures): the sequence's own box's drain
    counts it at its upper quantile, so compared with it a tail sequence alone on a slow box was "not the
    tail" for as long as that estimate stayed above the model's median (issue 46). With ``tail_slowdown``
    set, a sequence whose prediction evidence informed (``Rest.informed``) is the predicted tail: it moves
    only to a box where its step, with it added, is at most that many times a lone sequence's there, so the
    tail runs with few beside it rather than joining a full batch. Hysteresis: never to an instance the
    sequence already ran on, at most ``max_moves`` per sequence, ``cooldown_s`` between two moves of one
    sequence; so no sequence ever moves back and forth.

    Cost: O(S log T) for S sequences and T instances (a heap of targets, at most ``MAX_TRIES`` looked at per
    sequence; ``benchmarks/bench_scheduling.py --plan-cost``); sequences with no faster target cost a compare.
    """

    MAX_TRIES = 8  # targets one sequence's search looks at, at most (a plan stays O(S log T))

    def __init__(
        self,
        batch_half: float = 64.0,
        min_speedup: float = 1.25,
        min_gain_s: float = 1.0,
        prefill_factor: float = 200.0,
        move_overhead_s: float = 0.5,
        max_moves: int = 3,
        cooldown_s: float = 5.0,
        min_tokens: int = 64,
        max_target_in_flight: int | None = None,
        tail_share: float = 0.0,
        tail_slowdown: float | None = None,
        swap_queue: int = 0,
    ) -> None:
        if batch_half <= 0 or prefill_factor <= 0:
            raise ValueError("batch_half and prefill_factor must be > 0")
        if min_speedup < 1.0:
            raise ValueError("min_speedup must be >= 1")
        if min_gain_s < 0 or move_overhead_s < 0 or cooldown_s < 0:
            raise ValueError("min_gain_s, move_overhead_s and cooldown_s must be >= 0")
        if max_moves < 0 or min_tokens < 0:
            raise ValueError("max_moves and min_tokens must be >= 0")
        if max_target_in_flight is not None and max_target_in_flight < 1:
            raise ValueError("max_target_in_flight must be >= 1")
        if tail_share < 0:
            raise ValueError("tail_share must be >= 0")
        if tail_slowdown is not None and tail_slowdown < 1.0:
            raise ValueError("tail_slowdown must be >= 1")
        if swap_queue < 0:
            raise ValueError("swap_queue must be >= 0")
        self.swap_queue = swap_queue
        self.tail_share = tail_share
        self.tail_slowdown = tail_slowdown
        self.batch_half = batch_half
        self.min_speedup = min_speedup
        self.min_gain_s = min_gain_s
        self.prefill_factor = prefill_factor
        self.move_overhead_s = move_overhead_s
        self.max_moves = max_moves
        self.cooldown_s = cooldown_s
        self.min_tokens = min_tokens
        self.max_target_in_flight = max_target_in_flight

    def _step_of(self, c: InstanceLoad) -> StepModel | None:
        """``c``'s decode step by running count: its learned curve, else the batch model of ``rate_meter`` from
        its measured lone rate; None while neither is known (it neither gives nor takes a sequence)."""
        if not c.lone_rate:
            return None
        if c.step is not None:
            return c.step
        per = 1.0 / (c.lone_rate * self.batch_half)
        return StepModel(1.0 / c.lone_rate - per, per)

    def _move_cost(self, context_tokens: int, step: StepModel) -> float:
        """Seconds a move of a sequence with ``context_tokens`` (prompt and tokens made) costs on a box stepping
        as ``step``: one prefill of them there, plus the fixed overhead (abort, reconnect, scheduling)."""
        return self.move_overhead_s + context_tokens * step.step_s(1) / self.prefill_factor

    def _crowded(self, step: StepModel, n: int) -> bool:
        """Whether one more sequence on a box of ``step`` running ``n`` would run past ``tail_slowdown`` of
        its lone speed there."""
        limit = self.tail_slowdown
        return limit is not None and step.step_s(n + 1) > limit * step.step_s(1)

    def plan(
        self,
        instances: Sequence[InstanceLoad],
        running: Sequence[RunningSequence],
        waiting: int,
        now: float,
        draining: Collection[str] = (),
        predict: Callable[[RunningSequence], Rest | None] | None = None,
        waiting_left: float | None = None,
    ) -> list[Move]:
        """The moves to make now (each sequence at most once). ``instances``: where work may go.

        ``running`` may include sequences on instances not in ``instances`` (draining ones, named in
        ``draining``); a sequence on an instance with no measured rate stays where it is. ``predict``:
        what the length model expects a sequence still makes (None, or answering None: its age stands in);
        asked only of the sequences a faster box could take.

        Each candidate's finish where it runs (its tokens left at the step time its box has now) is set
        against its finish on each faster target (the re-prefill, then its tokens left at the target's step
        with it added), fastest target first: it moves to the first target it reaches sooner by
        ``min_speedup`` and ``min_gain_s``, skipping targets it ran on and, for the predicted tail, crowded
        ones; a target that does not take it does not end its search.
        """
        if not running or self.max_moves == 0:
            return []
        if waiting > 0:
            return self._swaps(instances, running, now, draining, predict, waiting_left) if self.swap_queue else []
        n: dict[str, int] = {c.instance_id: c.in_flight_requests for c in instances}
        steps = self._steps(instances)
        cap = self.max_target_in_flight
        # Min-heap of targets by the step one more sequence would get there (the fastest first).
        heap = [(st.step_s(n[i] + 1), i) for i, st in steps.items()
                if i not in draining and (cap is None or n[i] < cap)]
        if not heap:
            return []
        heapq.heapify(heap)
        # The step's predicted end without each box: the latest drain of the others (a sequence on the box that
        # ends last is the tail whatever that box's estimate of it says).
        ends = self._ends(instances, steps) if predict is not None and self.tail_share else None
        moves: list[Move] = []
        for left, s, informed in self._tail_candidates(running, n, steps, heap[0][0], now, draining, predict, ends):
            drain = s.instance_id in draining
            src = steps.get(s.instance_id)
            here = src.step_s(n.get(s.instance_id, 1)) if src is not None else math.inf  # earlier moves sped it up
            gain = self._tail_gain(s, left, left * here, n, steps, informed and not drain)
            chosen = self._search(heap, s, here, gain, drain)
            if chosen is None:
                continue
            tid, gained = chosen
            moves.append(Move(s.seq_id, s.instance_id, tid, gained))
            n[tid] += 1
            if s.instance_id in n:
                n[s.instance_id] = max(n[s.instance_id] - 1, 0)
            if cap is None or n[tid] < cap:
                heapq.heappush(heap, (steps[tid].step_s(n[tid] + 1), tid))
        return moves

    def _steps(self, instances: Sequence[InstanceLoad]) -> dict[str, StepModel]:
        """Each instance's step by running count, where one is known (:meth:`_step_of`)."""
        steps: dict[str, StepModel] = {}
        for c in instances:
            st = self._step_of(c)
            if st is not None:
                steps[c.instance_id] = st
        return steps

    def _may_move(self, s: RunningSequence, now: float) -> bool:
        """Whether ``s`` may move at all now: moves left, budget left, and its cool-down over."""
        if s.moves >= self.max_moves or s.budget_left == 0:
            return False
        return s.last_moved_at is None or now - s.last_moved_at >= self.cooldown_s

    def _tail_candidates(
        self,
        running: Sequence[RunningSequence],
        n: dict[str, int],
        steps: dict[str, StepModel],
        best_step: float,
        now: float,
        draining: Collection[str],
        predict: Callable[[RunningSequence], Rest | None] | None,
        ends: Callable[[str], float] | None,
    ) -> list[tuple[float, RunningSequence, bool]]:
        """The sequences :meth:`plan` tries to move, latest expected finish where they run first: each with its
        tokens left and whether evidence informs its prediction. Left out: those no target is fast enough for
        (``best_step``: the fastest target's), and, where ``ends`` is given, those predicted to end where they
        run before ``tail_share`` of the step's end without their box (not the tail)."""
        cands: list[tuple[float, float, RunningSequence, bool]] = []
        for s in running:
            if not self._may_move(s, now):
                continue
            drain = s.instance_id in draining
            src = steps.get(s.instance_id)
            if src is None and not drain:
                continue
            here = src.step_s(n.get(s.instance_id, 1)) if src is not None else math.inf
            if not drain and best_step * self.min_speedup > here:
                continue  # no target is fast enough for it: the common case, kept cheap
            rest = predict(s) if predict is not None and not drain else None
            left = self._left(s, rest)
            if ends is not None and rest is not None and here < math.inf and \
                    left * here < self.tail_share * ends(s.instance_id):
                continue  # it ends where it is before the step does: not the tail
            cands.append((left * here, left, s, rest is not None and rest.informed))
        cands.sort(key=lambda c: (-c[0], c[2].seq_id))
        return [(left, s, informed) for _, left, s, informed in cands]

    def _tail_gain(self, s: RunningSequence, left: float, t_here: float, n: dict[str, int],
                   steps: dict[str, StepModel], guard: bool) -> Callable[[float, str], float | None]:
        """What moving ``s`` (``left`` tokens, ``t_here`` seconds where it is) to a target whose step with it is
        ``key`` saves, after the re-prefill; None for a crowded target where ``guard`` (the predicted tail)."""
        def gain(key: float, tid: str) -> float | None:
            st = steps[tid]
            if guard and self._crowded(st, n[tid]):
                return None
            return t_here - (self._move_cost(s.prompt_tokens + s.made, st) + left * key)
        return gain

    def _search(self, heap: list[tuple[float, str]], s: RunningSequence, here: float,
                gain: Callable[[float, str], float | None], drain: bool = False) -> tuple[str, float] | None:
        """The first target on ``heap`` (fastest first, at most ``MAX_TRIES`` looked at) that takes ``s``, whose
        step where it runs is ``here``: fast enough by ``min_speedup`` (any target for a sequence on a draining
        box), not one it ran on, and ``gain`` (None: passed over) at least ``min_gain_s`` (any for a draining
        one). The chosen target is taken off the heap; those looked at and passed over go back."""
        skipped: list[tuple[float, str]] = []
        chosen: tuple[str, float] | None = None
        while heap and len(skipped) < self.MAX_TRIES:
            key, tid = heapq.heappop(heap)
            if not drain and key * self.min_speedup > here:
                heapq.heappush(heap, (key, tid))  # this and every later target: too slow for it
                break
            skipped.append((key, tid))
            if tid in s.visited or tid == s.instance_id:
                continue
            gained = gain(key, tid)
            if gained is not None and (drain or gained >= self.min_gain_s):
                skipped.pop()
                chosen = (tid, gained)
                break
        for item in skipped:
            heapq.heappush(heap, item)
        return chosen

    def _swaps(
        self,
        instances: Sequence[InstanceLoad],
        running: Sequence[RunningSequence],
        now: float,
        draining: Collection[str],
        predict: Callable[[RunningSequence], Rest | None] | None,
        waiting_left: float | None,
    ) -> list[Move]:
        """The moves to make while requests wait for a slot (``swap_queue`` > 0): a sequence on a slower box
        takes a faster box's next free slot (it waits there, past the box's bound, as one of at most
        ``swap_queue``), and the slot it leaves goes to a waiting request.

        Every box stays full, so what a swap changes is who runs where: the sequence expected to make more
        (``left``, as :meth:`plan` has it: a sequence's age says it is long before anything else can) on the
        faster box, the waiting request (``waiting_left``: what the head of the queue is predicted to make;
        None: ``min_tokens``) on the slower. It is made where it brings the later of the two finishes
        forward by ``min_gain_s`` after the re-prefill: ``left x here`` against the larger of ``cost + left x
        there`` and ``waiting_left x here``. Without it nothing moves until the queue is empty, and a long
        sequence that began on a slow full box spends the first epoch's start there (issue 46)."""
        n: dict[str, int] = {c.instance_id: c.in_flight_requests for c in instances}
        steps = self._steps(instances)
        room = {c.instance_id: (1 << 30) if c.max_in_flight is None else c.max_in_flight + self.swap_queue
                - n[c.instance_id] for c in instances if c.instance_id in steps}
        # Targets by the step they run at once full (a swap leaves every box's count as it is).
        full = {c.instance_id: (n[c.instance_id] if c.max_in_flight is None else max(c.max_in_flight, 1))
                for c in instances}
        heap = [(st.step_s(min(n[i] + 1, full[i])), i) for i, st in steps.items()
                if i not in draining and room[i] > 0]
        if not heap:
            return []
        heapq.heapify(heap)
        other = float(self.min_tokens) if waiting_left is None else waiting_left
        moves: list[Move] = []
        for left, here, s in self._swap_candidates(running, n, steps, heap[0][0], now, draining, predict, other):
            if not heap:
                break
            chosen = self._search(heap, s, here, self._swap_gain(s, left, here, other, steps))
            if chosen is None:
                continue
            tid, gained = chosen
            moves.append(Move(s.seq_id, s.instance_id, tid, gained, swap=True))
            room[tid] -= 1
            if room[tid] > 0:
                heapq.heappush(heap, (steps[tid].step_s(min(n[tid] + 1, full[tid])), tid))
        return moves

    def _swap_candidates(
        self,
        running: Sequence[RunningSequence],
        n: dict[str, int],
        steps: dict[str, StepModel],
        best_step: float,
        now: float,
        draining: Collection[str],
        predict: Callable[[RunningSequence], Rest | None] | None,
        other: float,
    ) -> list[tuple[float, float, RunningSequence]]:
        """The sequences :meth:`_swaps` tries to move, latest expected finish first: each with its tokens left and
        its step where it runs. Left out: those on draining boxes, those no target is fast enough for, and those
        not expected to run longer than the waiting request (``other``): the faster slot is as well its."""
        cands: list[tuple[float, float, float, RunningSequence]] = []
        for s in running:
            if s.instance_id in draining or not self._may_move(s, now):
                continue
            src = steps.get(s.instance_id)
            if src is None:
                continue
            here = src.step_s(max(n.get(s.instance_id, 1), 1))
            if best_step * self.min_speedup > here:
                continue
            left = self._left(s, predict(s) if predict is not None else None)
            if left <= other:
                continue
            cands.append((left * here, left, here, s))
        cands.sort(key=lambda c: (-c[0], c[3].seq_id))
        return [(left, here, s) for _, left, here, s in cands]

    def _swap_gain(self, s: RunningSequence, left: float, here: float, other: float,
                   steps: dict[str, StepModel]) -> Callable[[float, str], float | None]:
        """What swapping ``s`` to a target whose step is ``key`` saves: the later of its finish there (after the
        re-prefill) and the waiting request's where ``s`` was, against ``s``'s finish where it is."""
        def gain(key: float, tid: str) -> float:
            return left * here - max(self._move_cost(s.prompt_tokens + s.made, steps[tid]) + left * key, other * here)
        return gain

    def _left(self, s: RunningSequence, rest: Rest | None) -> float:
        """Tokens ``s`` is taken to make still: the length model's figure where it gives one, else its age (a
        sequence that made ``m`` tends to make about as many more), never past its budget."""
        left = float(max(s.made, self.min_tokens))
        if rest is not None and rest.tokens > left:
            left = rest.tokens
        return left if s.budget_left is None else min(left, float(s.budget_left))

    @staticmethod
    def _ends(instances: Sequence[InstanceLoad], steps: dict[str, StepModel]) -> Callable[[str], float]:
        """For each box, the latest predicted drain of the *other* boxes (``makespan.BoxWork``'s figures)."""
        first, second, top = 0.0, 0.0, ""
        for c in instances:
            st = steps.get(c.instance_id)
            if st is None:
                continue
            d = st.drain_s(c.longest_tokens, c.predicted_tokens)
            if d > first:
                first, second, top = d, first, c.instance_id
            elif d > second:
                second = d
        return lambda iid: second if iid == top else first
