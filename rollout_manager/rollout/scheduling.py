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

from rollout_manager.rollout.box_speed import StepModel
from rollout_manager.rollout.instance_load import InstanceLoad
from rollout_manager.rollout.makespan import Makespan

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


class TailMigration:
    """Which running sequences to move, at the end of a batch, to instances where they finish sooner.

    Only while nothing waits in the manager (otherwise an idle instance gets that waiting work, and
    moving would only reshuffle). The remaining length of a sequence is unknown; with long-tailed
    lengths the best cheap guess is its age (a sequence that has made ``m`` tokens tends to make
    about as many more), so the estimate is ``min(budget_left, max(made, min_tokens))``: never past
    the budget. Moving costs the re-prefill of prompt plus tokens made, at ``prefill_factor`` times
    the target's lone decode rate, plus ``move_overhead_s`` (abort, reconnect, scheduling).

    Candidates go longest expected time first; each takes the target where it would run fastest
    (counting the moves already planned there, under the batch model above) if that is at least
    ``min_speedup`` times its current per-sequence rate and saves at least ``min_gain_s``.
    Sequences on a ``draining`` instance move whenever a target exists. Where the length model
    predicts (``predict``: the tokens a sequence still makes), a sequence predicted to end before
    ``tail_share`` of the step's predicted end (the latest drain over the boxes, ``makespan``) stays: it
    is not the tail, and moving it would only load the boxes that run the tail (in the simulator,
    told every length, placement alone is 1.04x of clairvoyant and moves by age made it 1.09x).
    With ``tail_slowdown`` set, a sequence whose prediction evidence informed (``Rest.informed``) is the
    predicted tail: it moves only to a box where its step, with it added, is at most that many times a lone
    sequence's there, so the tail runs with few beside it rather than joining a full batch (in the
    simulator at 1.3, 16 seeds: 1.19x / 1.06x / 1.07x of clairvoyant by epoch -> 1.16x / 1.04x / 1.05x). It
    trusts each box's ``StepModel`` split between fixed and per-sequence cost; see docs/benchmarks.md.
    Hysteresis: never to an instance the sequence already ran on, at most ``max_moves`` per sequence,
    ``cooldown_s`` between two moves of one sequence; so no sequence ever moves back and forth.

    Cost: O(S log T) for S sequences and T instances (a heap of targets): ~0.14 s for 20k sequences
    on 1k instances when half the pool is idle and 9k moves come out, the worst case
    (``benchmarks/bench_scheduling.py --plan-cost``); sequences with no faster target cost a compare.
    """

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

    def _rate(self, lone: float, n: int) -> float:
        return per_sequence_rate(lone, n, self.batch_half)

    def _not_the_tail(self, s: RunningSequence, rest: Rest | None, steps: dict[str, StepModel | None],
                      n: dict[str, int], end: float) -> bool:
        """Whether ``s`` is predicted to end where it is before ``tail_share`` of the step's predicted end."""
        step = steps.get(s.instance_id)
        return rest is not None and step is not None and \
            rest.tokens * step.step_s(n.get(s.instance_id, 1)) < self.tail_share * end

    def _crowded(self, step: StepModel | None, n: int) -> bool:
        """Whether one more sequence on a box of ``step`` running ``n`` would run past ``tail_slowdown`` of
        its lone speed there."""
        limit = self.tail_slowdown
        return limit is not None and step is not None and step.step_s(n + 1) > limit * step.step_s(1)

    def plan(
        self,
        instances: Sequence[InstanceLoad],
        running: Sequence[RunningSequence],
        waiting: int,
        now: float,
        draining: Collection[str] = (),
        predict: Callable[[RunningSequence], Rest | None] | None = None,
    ) -> list[Move]:
        """The moves to make now (each sequence at most once). ``instances``: where work may go.

        ``running`` may include sequences on instances not in ``instances`` (draining ones, named in
        ``draining``); a sequence on an instance with no measured rate stays where it is. ``predict``:
        what the length model expects a sequence still makes (None, or answering None: no guard); asked
        only of the sequences a faster box could take.
        """
        if waiting > 0 or not running or self.max_moves == 0:
            return []
        n: dict[str, int] = {c.instance_id: c.in_flight_requests for c in instances}
        lone = {c.instance_id: c.lone_rate for c in instances if c.lone_rate}
        cap = self.max_target_in_flight
        # Max-heap of targets by the per-sequence rate one more sequence would get there.
        heap = [(-self._rate(r, n[i] + 1), i) for i, r in lone.items()
                if i not in draining and (cap is None or n[i] < cap)]
        if not heap:
            return []
        heapq.heapify(heap)
        best_rate = -heap[0][0]

        cands: list[tuple[float, float, RunningSequence, bool]] = []
        steps = {c.instance_id: c.step for c in instances} if predict is not None else {}
        end = max((st.drain_s(c.longest_tokens, c.predicted_tokens) for c in instances
                   if (st := steps.get(c.instance_id)) is not None), default=0.0) if self.tail_share else 0.0
        ask = predict is not None and (end > 0 or self.tail_slowdown is not None)
        for s in running:
            if s.moves >= self.max_moves or s.budget_left == 0:
                continue
            if s.last_moved_at is not None and now - s.last_moved_at < self.cooldown_s:
                continue
            src_lone = lone.get(s.instance_id)
            drain = s.instance_id in draining
            if src_lone is None and not drain:
                continue
            here = self._rate(src_lone, n.get(s.instance_id, 1)) if src_lone else 0.0
            if not drain and best_rate < self.min_speedup * here:
                continue  # no target is fast enough for it: the common case, kept cheap
            rest = predict(s) if ask and not drain and predict is not None and \
                steps.get(s.instance_id) is not None else None
            if end > 0 and self._not_the_tail(s, rest, steps, n, end):
                continue
            left = float(max(s.made, self.min_tokens))
            if s.budget_left is not None:
                left = min(left, s.budget_left)
            cands.append((left / here if here > 0 else math.inf, left, s, rest is not None and rest.informed))
        cands.sort(key=lambda c: (-c[0], c[2].seq_id))

        moves: list[Move] = []
        for _, left, s, informed in cands:
            drain = s.instance_id in draining
            skipped = []
            target = None
            while heap:
                key, tid = heapq.heappop(heap)
                if tid in s.visited or tid == s.instance_id:
                    skipped.append((key, tid))
                    continue
                target = (key, tid)
                break
            for item in skipped:
                heapq.heappush(heap, item)
            if target is None:
                continue
            key, tid = target
            there = -key
            src_lone = lone.get(s.instance_id)
            here = self._rate(src_lone, n.get(s.instance_id, 1)) if src_lone else 0.0
            t_here = left / here if here > 0 else math.inf  # earlier moves off its instance sped it up
            cost = (self.move_overhead_s
                    + (s.prompt_tokens + s.made) / (self.prefill_factor * lone[tid]))
            gain = t_here - (cost + left / there)
            crowded = informed and not drain and self._crowded(steps.get(tid), n[tid])
            if drain or (not crowded and there >= self.min_speedup * here and gain >= self.min_gain_s):
                moves.append(Move(s.seq_id, s.instance_id, tid, gain))
                n[tid] += 1
                if s.instance_id in n:
                    n[s.instance_id] = max(n[s.instance_id] - 1, 0)
                if cap is None or n[tid] < cap:
                    heapq.heappush(heap, (-self._rate(lone[tid], n[tid] + 1), tid))
            else:
                heapq.heappush(heap, target)
        return moves
