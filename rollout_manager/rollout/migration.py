"""Tail migration at run time: which sequences stream where, and moving them when the policy says.

The decisions are :class:`~rollout_manager.placement.tail_migration.TailMigration`'s (pure, shared with the
simulator). This module keeps the segments streaming now, asks the policy every
``migration_interval_s`` while there are any, and starts each move: the target is reserved at once,
the sequence is aborted where it runs, and generation continues it on the target from the tokens
made, exactly as after a failure but with no failure recorded.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from rollout_manager.instances.registry import Instance, Kind, State
from rollout_manager.placement.dispatch import Dispatcher
from rollout_manager.placement.tail_migration import Rest, RunningSequence, TailMigration
from rollout_manager.rollout.provisional import Provisional
from rollout_manager.rollout.sequence import Segment, SequenceState
from rollout_manager.sglang.client import SGLangClient

log = logging.getLogger("rollout_manager.rollout.migration")

# Moves pause while the event loop was blocked for more than this share of the interval.
MAX_LAG = 0.1

Bound = Callable[[Instance], bool]


class Migrator:
    """The live segments and the moves in flight; a no-op when ``policy`` is None (migration off).

    ``bound(seq)`` says which instances may take ``seq`` (the staleness bound; None: any).
    """

    def __init__(self, dispatcher: Dispatcher, client: SGLangClient, policy: TailMigration | None,
                 interval_s: float, bound: Callable[[SequenceState], Bound | None], stats: dict[str, int],
                 predict: Callable[[SequenceState], Rest | None] | None = None):
        """``predict(seq)``: what the length model expects ``seq`` still makes (None: no figure), which keeps a
        sequence that is not the step's tail where it is (``TailMigration.tail_share``) and the predicted tail
        off full batches (``TailMigration.tail_slowdown``)."""
        self.dispatcher = dispatcher
        self.predict = predict
        self.stats = stats  # generation's counters (rollout.counters): moves that took effect
        self.client = client
        self.policy = policy
        self.interval_s = interval_s
        self.bound = bound
        # The segments streaming now (sequence, instance, engine rid), by segment key.
        self._live: dict[int, tuple[SequenceState, Instance, str]] = {}
        # The live segments' keys by every instance their sequence has segments of (so a probe's mark costs
        # what that box made, not every live sequence), and the instances each key is listed under.
        self._by_instance: dict[str, dict[int, SequenceState]] = {}
        self._listed: dict[int, tuple[str, ...]] = {}
        # Finished sequences' segments no probe vouched for yet, and what a quarantine distrusted of them.
        self.provisional = Provisional()
        self._timer: asyncio.Task[None] | None = None  # runs the policy while anything streams
        self._aborts: set[asyncio.Task[None]] = set()
        # Told of each segment that ended in its instance's failure (rollout.evacuation counts what that cost).
        self.failed: Callable[[SequenceState, Segment], None] | None = None
        if policy is not None:
            dispatcher.fleet.use_batch_half(policy.batch_half)

    @property
    def running(self) -> bool:
        """Whether the periodic planning task is running (only while segments stream)."""
        return self._timer is not None

    def enter(self, key: int, seq: SequenceState, inst: Instance, rid: str) -> None:
        """A segment of ``seq`` starts streaming from ``inst`` as engine request ``rid``."""
        seq.migration.leaving, seq.migration.reason, seq.migration.cut = False, "", None
        self._live[key] = (seq, inst, rid)  # tracked even with migration off: evict() needs it
        boxes = tuple({inst.id, *(s.instance for s in seq.segments)})
        self._listed[key] = boxes
        for box in boxes:
            self._by_instance.setdefault(box, {})[key] = seq
        if self.policy is not None and (self._timer is None or self._timer.done()):
            self._timer = asyncio.ensure_future(self._plan_periodically())

    def leave(self, key: int, seq: SequenceState, segment: Segment) -> None:
        """The segment ended (finished, failed, moved or cancelled)."""
        self._live.pop(key, None)
        if self.failed is not None and segment.outcome.startswith("failed"):
            self.failed(seq, segment)
        for box in self._listed.pop(key, ()):
            keys = self._by_instance.get(box)
            if keys is not None:
                keys.pop(key, None)
                if not keys:
                    del self._by_instance[box]
        if seq.migration.cut is not None and seq.finish is not None:  # finished before its abort landed
            distrust(seq, seq.migration.cut, seq.migration.reason)
            seq.migration.cut = None
        if seq.finish is not None:  # its answer goes out: what no probe vouched for yet is kept by box
            self.provisional.finished(seq)
        if not segment.outcome.startswith("migrated") or seq.remaining == 0:
            self._drop_handoff(seq)  # it ended where it ran: the instance reserved for it is free again
        seq.migration.leaving = False
        if not self._live and self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def moved(self, seq: SequenceState, segment: Segment) -> None:
        """The segment ended because this module took the sequence off its instance: say where it goes."""
        move = seq.migration
        target = move.target.endpoint if move.target is not None else "another instance"
        why = f" ({move.reason})" if move.reason else ""
        segment.outcome = f"migrated to {target}{why}"
        if move.cut is not None:
            made = len(seq.output_ids)
            seq.cut_back(seq.cut_point(move.cut), move.reason)
            move.cut = None
            self.stats["cut_back_tokens"] += made - len(seq.output_ids)
        self.stats["evicted" if move.reason else "migrated"] += 1
        log.info("sequence %s moved from %s to %s after %d token(s)%s", seq.rid, segment.endpoint, target,
                 len(seq.output_ids), why)

    def evict(self, inst: Instance, reason: str, cut: bool = False) -> int:
        """Move every sequence streaming from ``inst`` elsewhere now, whatever the policy: the instance
        must be idle (a weight load whose cache flush SGLang refuses while requests run). Each is
        aborted there and continues from the tokens made on whichever instance the dispatcher picks.
        ``cut``: ``inst`` is quarantined: every running sequence with tokens it made that no passing probe
        vouched for (wherever it runs now) is moved too, cut back to before the first of them
        (``SequenceState.cut_point``). Returns how many were started moving."""
        moved = 0
        for seq, where, rid in list(self._live.values()):
            if seq.migration.leaving or seq.finish is not None:
                continue
            if where is not inst and not (cut and seq.cut_point(inst.id) < len(seq.output_ids)):
                continue
            seq.migration.leaving, seq.migration.reason = True, reason
            seq.migration.cut = inst.id if cut else None
            self._start_abort(seq, where, rid)
            moved += 1
        return moved

    def on(self, inst: Instance) -> list[SequenceState]:
        """The sequences streaming from ``inst`` now that are not finished or leaving already."""
        return [seq for seq, where, _ in self._live.values()
                if where is inst and not seq.migration.leaving and seq.finish is None]

    def move(self, seq: SequenceState, target: Instance | None, reason: str) -> bool:
        """Move ``seq`` off the instance it streams from now, whatever the policy (an evacuation): to ``target``,
        which the caller reserved for ``seq.reserve`` tokens (None: wherever the dispatcher places it). It is
        aborted there and continues from the tokens made. False, and nothing done (the caller releases
        ``target``), when it is not streaming or already leaving."""
        found = next(((where, rid) for s, where, rid in self._live.values() if s is seq), None)
        if found is None or seq.migration.leaving or seq.finish is not None:
            return False
        part = seq.migration
        part.leaving, part.reason, part.cut = True, reason, None
        if target is not None:
            part.target, part.reserved = target, seq.reserve
            part.moves += 1
            part.moved_at = self.dispatcher.clock()
        self._start_abort(seq, *found)
        return True

    def mark(self, inst: Instance, version: int) -> Callable[[], int]:
        """A probe of ``inst`` at ``version`` is being sent: what it may vouch for is what ``inst`` made so far at
        that version in every running sequence (on it now or moved on) and in every answer delivered unvouched
        (``provisional``). Costs what ``inst`` made, not every live sequence. Returns what vouches for exactly
        that, to call once the probe passed (how many segments it vouched for)."""
        named = str(version)
        live = self._by_instance.get(inst.id, {})
        segments = [seg for seq in live.values() for seg in seq.segments if seg.instance == inst.id]
        segments += self.provisional.pending(inst.id)
        marks = [(seg, seg.end) for seg in segments
                 if seg.weight_version in (None, named) and not self.provisional.stale(seg)]  # not pre-quarantine

        def vouch() -> int:
            for seg, end in marks:
                seg.trusted = end if seg.trusted is None else max(seg.trusted, end)
            self.provisional.settle(inst.id)
            return len(marks)

        return vouch

    def _start_abort(self, seq: SequenceState, src: Instance, rid: str) -> None:
        task = asyncio.ensure_future(self._abort_to_move(seq, src, rid))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    def take_handoff(self, seq: SequenceState, allow: Bound | None = None) -> Instance | None:
        """The instance a move reserved for this sequence, if it can still take it."""
        inst, seq.migration.target = seq.migration.target, None
        if inst is None:
            return None
        if inst.state != State.ACTIVE or (allow is not None and not allow(inst)):
            self.dispatcher.release(inst, seq.migration.reserved)
            return None
        # Tokens made between the decision and the abort shrink what the new segment reserves.
        self.dispatcher.capacity.unreserve(inst, max(seq.migration.reserved - seq.reserve, 0))
        return inst

    def _drop_handoff(self, seq: SequenceState) -> None:
        if seq.migration.target is not None:
            self.dispatcher.release(seq.migration.target, seq.migration.reserved)
            seq.migration.target = None

    async def _abort_to_move(self, seq: SequenceState, src: Instance, rid: str) -> None:
        if not await self.client.abort(src.url, rid) and seq.migration.leaving:
            seq.migration.leaving = False  # the instance did not take the abort: the sequence stays there
            self._drop_handoff(seq)

    async def _plan_periodically(self) -> None:
        while self._live:
            await asyncio.sleep(self.interval_s)
            self.migrate_now()

    def migrate_now(self) -> int:
        """Ask the policy which running sequences to move, and start moving them; the number started.

        A move reserves the target at once (so the next plan and the dispatcher see it loaded), then
        aborts the sequence on its instance; its stream ends, and generation continues it on the
        target (see ``Attempts.run`` in ``attempt.py``).
        """
        policy = self.policy
        if policy is None or not self._live:
            return 0
        # While the manager's own event loop lags, the rates it measures are its own, not the
        # instances': moving sequences then only adds aborts and reconnects to an overloaded manager.
        since = asyncio.get_running_loop().time() - self.interval_s
        if self.client.limits.loop.blocked_s(since) > MAX_LAG * self.interval_s:
            return 0
        now = self.dispatcher.clock()
        registry = self.dispatcher.registry
        # Remote instances only: the local window alone decides when sequences leave local instances
        # (Preempted), and a sequence moved onto one would be moved again when the window closes.
        targets = [i for i in registry.in_state(State.ACTIVE, kind=Kind.REMOTE) if i.health.consecutive_failures == 0]
        loads = []
        for i in targets:
            load = self.dispatcher.fleet.load_of(i, now)
            load.lone_rate = self.dispatcher.fleet.lone_rate(i, now)
            loads.append(load)
        draining = {i.id for i in registry.in_state(State.DRAINING)}
        running, by_key = [], {}
        for key, (seq, inst, _) in self._live.items():
            part = seq.migration
            if part.leaving or part.target is not None or seq.finish is not None or inst.kind == Kind.LOCAL:
                continue
            if inst.state == State.EVACUATING:  # its evacuation (rollout.evacuation) decides what stays and moves
                continue
            if seq.body.sampling.output_penalties:  # moved, it would sample differently: it stays unless its
                continue  # instance dies or leaves (then its answer says the continuation was not exact)
            by_key[str(key)] = key
            running.append(RunningSequence(
                str(key), inst.id, len(seq.output_ids), len(seq.body.input_ids), seq.remaining,
                part.moves, part.moved_at, frozenset(s.instance for s in seq.segments)))
        predict = self.predict
        live = self._live
        ask = None if predict is None else (lambda rs: predict(live[by_key[rs.seq_id]][0]))
        # With swaps on, requests a batch holds back wait for a slot as much as those parked in the dispatcher.
        dispatcher = self.dispatcher
        waiting = dispatcher.capacity.requests_waiting() if policy.swap_queue else dispatcher.capacity.waiting
        moves = policy.plan(loads, running, waiting, now, draining, ask, dispatcher.waiting_predicted())
        started = 0
        for planned in moves:
            seq, src, rid = self._live[by_key[planned.seq_id]]
            target = registry.get(planned.target)
            bound = self.bound(seq)
            over = policy.swap_queue if planned.swap else 0
            if target is None or (bound is not None and not bound(target)) or \
                    not dispatcher.claim(target, seq.reserve, over):
                continue
            part = seq.migration
            part.target, part.reserved, part.leaving = target, seq.reserve, True
            part.moves += 1
            part.moved_at = now
            started += 1
            self._start_abort(seq, src, rid)
        return started


def distrust(seq: SequenceState, instance: str, why: str) -> None:
    """``seq`` finished with tokens from the quarantined ``instance`` that no probe vouched for (it ended
    before it could be cut back): its answer says so on each such segment."""
    at = seq.cut_point(instance)
    for seg in seq.segments:
        if seg.instance == instance and seg.end > at:
            seg.outcome = f"{seg.outcome}; distrusted: {why}"
