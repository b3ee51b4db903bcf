"""Which rollout instance gets the next generation request.

Pure policy code: no I/O, no asyncio, and time is an argument, so the daemon and the discrete-event
simulator (``benchmarks/bench_scheduling.py``) run exactly the same decisions. The manager dispatches
every request itself, so it knows each instance's in-flight requests and tokens without asking SGLang
(0.5.23's ``/server_info`` has no running/queued counts), and it measures each instance's token rate
from its own streams with :class:`TokenRateMeter`.

A policy may answer ``None`` ("hold it in the manager's queue"): the manager keeps the request and
offers it again when something completes. Holding is what keeps instance-side queues short, and a
short queue is what makes a preemption cheap: what has to move is what sat on the dead instance.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol, runtime_checkable

from rollout_manager.placement.box_speed import StepModel
from rollout_manager.placement.instance_load import InstanceLoad
from rollout_manager.placement.makespan import Makespan

__all__ = [
    "InstanceLoad",
    "TokenRateMeter",
    "PlacementPolicy",
    "RoundRobin",
    "LeastInFlight",
    "ThroughputAware",
    "Makespan",
    "POLICY_NAMES",
    "DEFAULT_POLICY",
    "make_policy",
    "lone_rate_weight",
    "per_sequence_rate",
    "RunningSequence",
    "Move",
    "Rest",
    "TailMigration",
]


class TokenRateMeter:
    """Exponentially weighted aggregate token rate of one instance, on a *busy-time* clock.

    Why busy time: the figure the scheduler needs is capacity (tokens/s the instance delivers while
    it has work), not utilisation. Time with nothing in flight says nothing about capacity, so the
    clock stops while idle and the estimate stays frozen instead of decaying to zero between
    batches. Time with work in flight but no tokens (a stall, a slow prefill) is real evidence of a
    slow instance, so the clock runs and the estimate decays toward the truth.

    Maths: ``S`` is the token count decayed by ``exp(-busy_dt / tau)``; for a constant rate ``r``
    after busy time ``T``, ``S = r * tau * (1 - exp(-T / tau))``, so dividing by that factor gives an
    unbiased estimate from the first second on (a plain average while ``T << tau``, an EWMA with time
    constant ``tau`` later). The rate is unknown (None) until ``min_busy_s`` of busy time was seen.

    Call :meth:`set_in_flight` whenever the instance's in-flight count changes and :meth:`observe`
    for every streamed chunk (tokens newly produced, summed over its sequences); observe a
    request's last chunk before lowering the count, so its tokens land in busy time.
    """

    # Chunks observed within this many seconds of the last fold are summed and folded in together (by
    # the next observe past it, set_in_flight, or read by rate()): the fold spreads tokens over the
    # interval anyway, and relaying thousands of chunks a second, one fold each was measurable.
    FOLD_S = 0.01

    def __init__(self, tau_s: float = 5.0, min_busy_s: float = 1.0) -> None:
        if tau_s <= 0 or min_busy_s < 0:
            raise ValueError("tau_s must be > 0 and min_busy_s >= 0")
        self.tau_s = tau_s
        self.min_busy_s = min_busy_s
        self._decayed_tokens = 0.0
        self._busy_s = 0.0
        self._busy = False
        self._last: float | None = None
        self._pending = 0.0  # tokens observed since the last fold, while busy

    @property
    def busy(self) -> bool:
        return self._busy

    def _elapsed_busy(self, now: float) -> float:
        if not self._busy or self._last is None:
            return 0.0
        return max(0.0, now - self._last)

    def _advance(self, now: float) -> None:
        if self._pending:
            self._fold(0.0, now)
            return
        dt = self._elapsed_busy(now)
        if dt > 0:
            self._decayed_tokens *= math.exp(-dt / self.tau_s)
            self._busy_s += dt
        if self._last is None or now > self._last:
            self._last = now

    def _spread(self, tokens: float, dt: float) -> float:
        """What ``tokens`` made evenly over the last ``dt`` busy seconds count for now."""
        return tokens * -math.expm1(-dt / self.tau_s) * self.tau_s / dt if dt > 0 else tokens

    def set_in_flight(self, count: int, now: float) -> None:
        """Start or stop the busy clock: the instance is busy while ``count > 0``. A count that leaves
        it busy (or idle) changes nothing: the clock is read from the last fold whenever needed."""
        busy = count > 0
        if busy != self._busy:
            self._advance(now)
            self._busy = busy

    def observe(self, tokens: float, now: float) -> None:
        """Record ``tokens`` generated (over all its sequences) since the previous call.

        They were made across the busy interval since then, not at ``now``, so they get that
        interval's mean decay; counting them as fresh would bias the rate up by ~dt/(2*tau).
        """
        # Runs for every relayed chunk: mostly a sum (see FOLD_S), else one transcendental call.
        last = self._last
        if self._busy and last is not None and now > last:
            if now - last < self.FOLD_S:
                self._pending += max(0, tokens)
                return
            self._fold(tokens, now)
            return
        if last is None or now > last:
            self._last = now
        self._decayed_tokens += max(0, tokens)

    def _fold(self, tokens: float, now: float) -> None:
        """Fold the pending tokens and ``tokens`` in, spread over the busy time since the last fold."""
        tokens = max(0, tokens) + self._pending
        self._pending = 0.0
        dt = self._elapsed_busy(now)
        if dt > 0:
            self._decayed_tokens = self._decayed_tokens * math.exp(-dt / self.tau_s) + self._spread(tokens, dt)
            self._busy_s += dt
        else:
            self._decayed_tokens += tokens
        if self._last is None or now > self._last:
            self._last = now

    def rate(self, now: float) -> float | None:
        """Tokens/s while busy, or None before ``min_busy_s`` of busy time. Does not mutate."""
        dt = self._elapsed_busy(now)
        busy_s = self._busy_s + dt
        if busy_s <= 0 or busy_s < self.min_busy_s - 1e-9:  # tolerate float clock sums
            return None
        tokens = self._decayed_tokens * math.exp(-dt / self.tau_s) + self._spread(self._pending, dt)
        return tokens / (self.tau_s * -math.expm1(-busy_s / self.tau_s))


@runtime_checkable
class PlacementPolicy(Protocol):
    """Pick an instance id from ``candidates`` or None to hold the request in the manager.

    Contract: never return an id that is not in ``candidates``; with no candidates return None;
    return None with candidates present only if the policy limits queues and all are full.
    ``request_tokens`` is the request's remaining token budget.
    """

    name: str

    def pick(
        self, candidates: Sequence[InstanceLoad], request_tokens: int, now: float
    ) -> str | None: ...


def _least_loaded_key(c: InstanceLoad) -> tuple[int, int, str]:
    return (c.in_flight_requests, c.in_flight_tokens, c.instance_id)


class RoundRobin:
    """Cycle through instance ids in sorted order; robust to instances joining and leaving."""

    name = "round_robin"

    def __init__(self) -> None:
        self._last: str | None = None

    def pick(
        self, candidates: Sequence[InstanceLoad], request_tokens: int, now: float
    ) -> str | None:
        if not candidates:
            return None
        ids = sorted(c.instance_id for c in candidates)
        last = self._last
        chosen = next((i for i in ids if last is None or i > last), ids[0])
        self._last = chosen
        return chosen


class LeastInFlight:
    """Fewest in-flight requests, ties by fewest in-flight tokens, then id.

    Never holds unless ``max_in_flight`` is given (then an instance at that count is full).
    """

    name = "least_in_flight"

    def __init__(self, max_in_flight: int | None = None) -> None:
        if max_in_flight is not None and max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        self.max_in_flight = max_in_flight

    def pick(
        self, candidates: Sequence[InstanceLoad], request_tokens: int, now: float
    ) -> str | None:
        cap = self.max_in_flight
        open_ = [c for c in candidates if cap is None or c.in_flight_requests < cap]
        if not open_:
            return None
        return min(open_, key=_least_loaded_key).instance_id


class ThroughputAware:
    """Short per-instance queues sized by measured rate; earliest expected completion wins.

    An instance is *full* when adding the request would push the expected drain time of its
    in-flight tokens, ``(in_flight_tokens + request_tokens) / token_rate``, past
    ``target_drain_s``; below ``min_concurrency`` requests it accepts work anyway, because decode
    throughput grows with batch size and an underfilled batch wastes the GPU. So no instance holds
    much more than ``target_drain_s`` of work, which bounds what a preemption has to move, and the
    rest waits in the manager, where it stays free to go to whichever instance frees up first.

    Among instances that are not full the request goes where it is expected to finish first, by
    the same formula (the new request has the largest budget, so under continuous batching it is
    the last of that instance's work to finish); faster instances receive work in proportion. The rate
    is the box's step model's at the count it would run with the request (``InstanceLoad.step``) where
    there is one: ranking by the aggregate rate measured at whatever count a box ran sent four
    1,900-token sequences to one of two idle boxes, the one that had been given more before.

    Tokens are budgets (``max_new_tokens`` left), so the drain time is a worst case: every
    sequence running to its limit. ``target_drain_s`` is therefore in those units; it also means an
    instance too slow to finish even a few full-budget requests within it keeps only
    ``min_concurrency`` of them, which is what protects the batch's tail from slow instances.

    An instance with no measured rate yet gets a probe share of ``probe_in_flight`` requests
    (default ``min_concurrency``), served before measured ones so that it gets measured; beyond
    that it waits for its measurement. ``max_in_flight`` is an optional hard cap. The defaults come
    from ``benchmarks/bench_scheduling.py`` (4 instances, speeds 1:2:3:4, budget 8x the median). Under
    its saturating batch model, 80 s / 64 is about 5% better with tail migration on (1.71 / 1.65 / 1.74
    against 1.82 / 1.73 / 1.82 times the tighter bound) but much worse with it off (2.2-4.0x against
    2.1-2.6x), and moves 2-3x the tokens; 200 s / 8 is kept, robust either way.
    """

    name = "throughput_aware"

    def __init__(
        self,
        target_drain_s: float = 200.0,
        min_concurrency: int = 8,
        probe_in_flight: int | None = None,
        max_in_flight: int | None = None,
    ) -> None:
        if target_drain_s <= 0:
            raise ValueError("target_drain_s must be > 0")
        if min_concurrency < 1:
            raise ValueError("min_concurrency must be >= 1")
        if max_in_flight is not None and max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        self.target_drain_s = target_drain_s
        self.min_concurrency = min_concurrency
        self.probe_in_flight = min_concurrency if probe_in_flight is None else probe_in_flight
        self.max_in_flight = max_in_flight

    @staticmethod
    def _rate(c: InstanceLoad) -> float | None:
        """Tokens/s ``c`` makes in all once it takes one more: from its step model where there is one."""
        step = c.step
        return step.rate(c.in_flight_requests + 1) if step is not None else c.token_rate

    def _expected_finish_s(self, c: InstanceLoad, request_tokens: int) -> float:
        rate = self._rate(c) or 0.0
        work = c.in_flight_tokens + request_tokens
        return work / rate if rate > 0 else math.inf

    def is_full(self, c: InstanceLoad, request_tokens: int) -> bool:
        """True if ``c`` should not take a request of ``request_tokens`` right now."""
        if self.max_in_flight is not None and c.in_flight_requests >= self.max_in_flight:
            return True
        if self._rate(c) is None:
            return c.in_flight_requests >= self.probe_in_flight
        if c.in_flight_requests < self.min_concurrency:
            return False
        return self._expected_finish_s(c, request_tokens) > self.target_drain_s

    def pick(
        self, candidates: Sequence[InstanceLoad], request_tokens: int, now: float
    ) -> str | None:
        # One pass, is_full and the keys inline: this runs for every sequence over every candidate (a
        # thousand), where calls and comprehensions per candidate were most of a placement's time. The
        # least loaded open probe if any (an unmeasured instance), else the earliest expected finish,
        # ties by in-flight requests, then id.
        cap, probe_cap, min_concurrency, target = (
            self.max_in_flight, self.probe_in_flight, self.min_concurrency, self.target_drain_s)
        probe: tuple[int, int, str] | None = None
        best: tuple[float, int, str] | None = None
        for c in candidates:
            n = c.in_flight_requests
            if cap is not None and n >= cap:
                continue
            step = c.step
            rate = step.rate(n + 1) if step is not None else c.token_rate
            if rate is None:
                if n < probe_cap:
                    key = (n, c.in_flight_tokens, c.instance_id)
                    if probe is None or key < probe:
                        probe = key
                continue
            if probe is not None:  # a probe wins over every measured instance
                continue
            finish = (c.in_flight_tokens + request_tokens) / rate if rate > 0 else math.inf
            if n >= min_concurrency and finish > target:
                continue
            if best is None or finish < best[0] or (finish == best[0] and (n, c.instance_id) < best[1:]):
                best = (finish, n, c.instance_id)
        if probe is not None:
            return probe[2]
        return best[2] if best is not None else None


_POLICIES: dict[str, Callable[..., PlacementPolicy]] = {
    RoundRobin.name: RoundRobin,
    LeastInFlight.name: LeastInFlight,
    ThroughputAware.name: ThroughputAware,
    Makespan.name: Makespan,
}
POLICY_NAMES: tuple[str, ...] = tuple(_POLICIES)
DEFAULT_POLICY = Makespan.name


def make_policy(name: str, **kw: object) -> PlacementPolicy:
    """Build a policy by name; keyword arguments go to its constructor."""
    try:
        factory = _POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}") from None
    return factory(**kw)


# ---------------------------------------------------------------------------- tail migration
#
# Batch model shared by the policy, the dispatcher's estimate and the simulator: an instance running
# ``n`` sequences makes ``lone * n / (1 + (n - 1) / batch_half)`` tokens/s in total, so each of them
# gets ``lone / (1 + (n - 1) / batch_half)``: a lone sequence runs at ``lone``, and at
# ``n = batch_half + 1`` each runs at half that. Aggregate throughput saturates at
# ``lone * batch_half`` (memory-bound decode on a GPU: ``batch_half`` of the order of 100; the CPU
# engine computes each sequence alone, so its aggregate is flat: ``batch_half = 1``).


def per_sequence_rate(lone_rate: float, n: int, batch_half: float) -> float:
    """Tokens/s each of ``n`` sequences gets on an instance whose lone sequence gets ``lone_rate``."""
    return lone_rate / (1.0 + (max(n, 1) - 1) / batch_half)


def lone_rate_weight(n: int, batch_half: float) -> float:
    """Turns tokens a batch of ``n`` made into what a lone sequence would have made in that time.

    Feeding ``tokens * lone_rate_weight(n)`` to a :class:`TokenRateMeter` measures the instance's
    lone-sequence rate whatever its batch was, which is what a migration needs to know about an
    instance that is nearly idle now but was full a moment ago.
    """
    n = max(n, 1)
    return (1.0 + (n - 1) / batch_half) / n


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
    (``InstanceLoad.step``; before one, the batch model above from its measured lone rate): a configured
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
        """``c``'s decode step by running count: its learned curve, else the batch model above from its measured
        lone rate; None while neither is known (it neither gives nor takes a sequence)."""
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
            if not self.swap_queue:
                return []
            return self._swaps(instances, running, now, draining, predict, waiting_left)
        n: dict[str, int] = {c.instance_id: c.in_flight_requests for c in instances}
        steps: dict[str, StepModel] = {}
        for c in instances:
            st = self._step_of(c)
            if st is not None:
                steps[c.instance_id] = st
        cap = self.max_target_in_flight
        # Min-heap of targets by the step one more sequence would get there (the fastest first).
        heap = [(st.step_s(n[i] + 1), i) for i, st in steps.items()
                if i not in draining and (cap is None or n[i] < cap)]
        if not heap:
            return []
        heapq.heapify(heap)
        best_step = heap[0][0]
        # The step's predicted end without each box: the latest drain of the others (a sequence on the box that
        # ends last is the tail whatever that box's estimate of it says).
        ends = self._ends(instances, steps) if predict is not None and self.tail_share else None

        cands: list[tuple[float, float, RunningSequence, bool]] = []
        for s in running:
            if s.moves >= self.max_moves or s.budget_left == 0:
                continue
            if s.last_moved_at is not None and now - s.last_moved_at < self.cooldown_s:
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

        moves: list[Move] = []
        for t_here, left, s, informed in cands:
            drain = s.instance_id in draining
            src = steps.get(s.instance_id)
            here = src.step_s(n.get(s.instance_id, 1)) if src is not None else math.inf
            t_here = left * here  # earlier moves off its instance sped it up
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
                st = steps[tid]
                if informed and not drain and self._crowded(st, n[tid]):
                    continue
                cost = self._move_cost(s.prompt_tokens + s.made, st)
                gain = t_here - (cost + left * key)
                if drain or gain >= self.min_gain_s:
                    skipped.pop()
                    chosen = (tid, gain)
                    break
            for item in skipped:
                heapq.heappush(heap, item)
            if chosen is None:
                continue
            tid, gain = chosen
            moves.append(Move(s.seq_id, s.instance_id, tid, gain))
            n[tid] += 1
            if s.instance_id in n:
                n[s.instance_id] = max(n[s.instance_id] - 1, 0)
            if cap is None or n[tid] < cap:
                heapq.heappush(heap, (steps[tid].step_s(n[tid] + 1), tid))
        return moves

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
        room: dict[str, int] = {}
        steps: dict[str, StepModel] = {}
        for c in instances:
            st = self._step_of(c)
            if st is None:
                continue
            iid = c.instance_id
            steps[iid] = st
            cap = c.max_in_flight
            room[iid] = (1 << 30) if cap is None else cap + self.swap_queue - n[iid]
        # Targets by the step they run at once full (a swap leaves every box's count as it is).
        full = {c.instance_id: (n[c.instance_id] if c.max_in_flight is None else max(c.max_in_flight, 1))
                for c in instances}
        heap = [(st.step_s(min(n[i] + 1, full[i])), i) for i, st in steps.items()
                if i not in draining and room[i] > 0]
        if not heap:
            return []
        heapq.heapify(heap)
        best_step = heap[0][0]
        other = float(self.min_tokens) if waiting_left is None else waiting_left
        cands: list[tuple[float, float, float, RunningSequence]] = []
        for s in running:
            if s.moves >= self.max_moves or s.budget_left == 0 or s.instance_id in draining:
                continue
            if s.last_moved_at is not None and now - s.last_moved_at < self.cooldown_s:
                continue
            src = steps.get(s.instance_id)
            if src is None:
                continue
            here = src.step_s(max(n.get(s.instance_id, 1), 1))
            if best_step * self.min_speedup > here:
                continue
            left = self._left(s, predict(s) if predict is not None else None)
            if left <= other:
                continue  # the waiting request is expected to run as long: the faster slot is as well its
            cands.append((left * here, left, here, s))
        cands.sort(key=lambda c: (-c[0], c[3].seq_id))
        moves: list[Move] = []
        for t_here, left, here, s in cands:
            if not heap:
                break
            skipped: list[tuple[float, str]] = []
            chosen: tuple[str, float] | None = None
            while heap and len(skipped) < self.MAX_TRIES:
                key, tid = heapq.heappop(heap)
                if key * self.min_speedup > here:
                    heapq.heappush(heap, (key, tid))
                    break
                skipped.append((key, tid))
                if tid in s.visited or tid == s.instance_id:
                    continue
                cost = self._move_cost(s.prompt_tokens + s.made, steps[tid])
                gain = t_here - max(cost + left * key, other * here)
                if gain >= self.min_gain_s:
                    skipped.pop()
                    chosen = (tid, gain)
                    break
            for item in skipped:
                heapq.heappush(heap, item)
            if chosen is None:
                continue
            tid, gain = chosen
            moves.append(Move(s.seq_id, s.instance_id, tid, gain, swap=True))
            room[tid] -= 1
            if room[tid] > 0:
                heapq.heappush(heap, (steps[tid].step_s(min(n[tid] + 1, full[tid])), tid))
        return moves

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
