"""Evacuating a box its cloud will take back: a notice with a deadline turned into moves before the box is gone.

At the notice the box goes ``evacuating``: no tail-migration target and no weight push from then (both want
``active``), and new work only where the plan would keep it (``Evacuator.admitting``, asked by the dispatcher: a
sequence whose prediction, within its budget, ends well before the deadline beside what stays there already, by
``evacuation_plan.admits``; none within ``margin_s`` of the deadline, none to a box behind the weight version or
with a SIGTERM notice, whose process is stopping and is removed once empty). Whatever runs there at the margin
still moves, so a wrong prediction costs a move, never a sequence. Every ``tick_s`` until the deadline its
running sequences are split by ``placement.evacuation_plan``: those the length model and the box's learned
step curve say end well before the deadline stay; the others are aborted there and continue exactly from the
tokens made on another box now, longest first, each as soon as a box has room for it (the dispatcher places it
as any request; the target is reserved before the abort, as tail migration does). ``margin_s`` before the
deadline whatever is left moves, to wherever the dispatcher places it. At the deadline the box is removed
(``dead``, the reason naming the notice); a box whose notice is final (SIGTERM: its process is stopping) as soon
as nothing runs or moves on it.
A second notice only brings the deadline forward; a cancel returns the box to service, through ``syncing`` when
it missed a weight version.

What it saved and what a failure without notice cost are counted here for ``/metrics`` and the status: the
tokens an evacuating box made after its notice that were kept, and an estimate of the tokens made twice after a
box failed without notice (a sequence cut by a failure loses what its box made since its last chunk, unseen by
the manager: on average half a stream interval).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rollout_manager.errors import Conflict
from rollout_manager.instances.registry import Instance, Kind, Registry, State
from rollout_manager.instances.version import WeightVersion
from rollout_manager.placement.ask import Ask
from rollout_manager.placement.dispatch import Dispatcher
from rollout_manager.placement.evacuation_plan import (
    DoomedSequence,
    EvacuationAdmission,
    EvacuationPlan,
    admission,
    plan_evacuation,
)
from rollout_manager.placement.lengths import LengthModel
from rollout_manager.rollout.migration import Migrator
from rollout_manager.rollout.sequence import Segment, SequenceState

log = logging.getLogger("rollout_manager.rollout.evacuation")

SOURCES = ("aws", "gce", "azure", "sigterm", "manual")
# Notices that are never withdrawn: the box's own process is stopping. Such a box is removed as soon as nothing
# runs or moves on it (its launcher stops then instead of waiting out its grace); a box whose notice may still
# be withdrawn stays, idle, until its deadline, so a cancel can return it.
FINAL_SOURCES = frozenset({"sigterm"})


@dataclass(frozen=True, slots=True)
class EvacuationSettings:
    stay_share: float = 0.5  # stayers must be predicted done within this share of the time left
    margin_s: float = 3.0  # whatever is left moves this long before the deadline, so its abort lands in time
    tick_s: float = 0.5  # how often the plan is made again (predictions and room on other boxes change)
    stream_interval: int = 64  # the manager's engine_stream_interval: what a failure without notice loses

    @classmethod
    def from_config(cls, cfg: Any) -> EvacuationSettings:
        return cls(cfg.evacuation_stay_share, cfg.evacuation_margin_s, cfg.evacuation_tick_s,
                   cfg.engine_stream_interval)


@dataclass
class Evacuation:
    """One box's evacuation, from its first notice until the box is removed or the notice is cancelled."""

    inst: Instance
    source: str
    detail: str | None
    deadline: float  # the dispatcher's clock
    noticed_at: float
    staying: int = 0
    moved: int = 0
    made_at_notice: dict[int, tuple[SequenceState, int]] = field(default_factory=dict)  # by id(seq)
    admitted: int = 0  # new sequences placed on the box after its notice
    # What it may still take: from the last plan, with what was admitted since (``_plan`` makes it again).
    admission: EvacuationAdmission = field(default_factory=lambda: EvacuationAdmission(None))
    # Those admitted within the last tick_s (when, figure): placed, they may not stream there yet (not in
    # ``Migrator.on``), so the next plan's admission counts them too: twice for a moment at worst, never less.
    pending: list[tuple[float, DoomedSequence]] = field(default_factory=list)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None

    def status(self, now: float) -> dict[str, Any]:
        return {"source": self.source, "detail": self.detail, "deadline_in_s": round(max(self.deadline - now, 0.0), 3),
                "staying": self.staying, "moved": self.moved}


class Evacuator:
    """The boxes being evacuated and what evacuations counted."""

    def __init__(self, registry: Registry, version: WeightVersion, dispatcher: Dispatcher, migrator: Migrator,
                 lengths: LengthModel | None, settings: EvacuationSettings) -> None:
        self.registry = registry
        self.version = version
        self.dispatcher = dispatcher
        self.migrator = migrator
        self.lengths = lengths
        self.settings = settings
        self.clock: Callable[[], float] = dispatcher.clock
        self.active: dict[str, Evacuation] = {}  # by instance id
        self.by_source: dict[str, int] = dict.fromkeys(SOURCES, 0)  # evacuations started
        self.tokens_saved = 0  # made by evacuating boxes after their notice, and kept
        self.sequences_moved = 0
        self.preemption_tokens_lost = 0.0  # estimated: made twice after failures without notice
        self.failures_without_notice = 0  # sequences cut by a failure of a box that was not evacuating
        self._noticed: set[str] = set()  # instance ids that ever had a notice (ids are never reused in a run)
        # Whether other processes (the relays) still run sequences on an instance: set by the control process.
        self.elsewhere: Callable[[str], bool] = _nowhere
        self.generation = 0  # moves on whenever an admission is made again (dispatch.EvacuatingBoxes)
        migrator.failed = self._failed
        dispatcher.evacuating = self

    # ------------------------------------------------------------ notices
    def start(self, inst: Instance, deadline_s: float, source: str, detail: str | None) -> dict[str, Any]:
        """A notice for ``inst``: evacuate it, or bring its deadline forward (never back). The answer of
        ``POST /evacuate_instance``. Raises :class:`Conflict` for an instance that cannot be evacuated."""
        now = self.clock()
        ev = self.active.get(inst.id)
        if ev is not None:
            if now + deadline_s < ev.deadline:
                ev.deadline = now + deadline_s
                log.warning("instance %s %s: a second notice (%s) brings its deadline to %.1fs from now",
                            inst.id, inst.endpoint, source, deadline_s)
                ev.wake.set()
            return self._answer(ev, now)
        if inst.kind != Kind.REMOTE:
            raise Conflict(f"endpoint: {inst.endpoint} is a trainer-side instance; only rollout boxes are evacuated")
        if inst.state not in (State.ACTIVE, State.SYNCING):  # pending: never served, its health check decides
            raise Conflict(f"endpoint: {inst.endpoint} is {inst.state.value}, not serving: nothing to evacuate "
                           f"(remove it with /shutdown_instances)")
        why = f"evacuating: {source} notice, deadline in {deadline_s:g}s" + (f" ({detail})" if detail else "")
        if not self.registry.transition(inst, State.EVACUATING, why):
            raise Conflict(f"endpoint: {inst.endpoint} could not go from {inst.state.value} to evacuating")
        self.registry.wait_for(inst, f"its deadline in {deadline_s:g}s ({source} notice); its sequences move")
        ev = Evacuation(inst, source, detail, now + deadline_s, now)
        for seq in self.migrator.on(inst):
            ev.made_at_notice[id(seq)] = (seq, len(seq.output_ids))
        self.by_source[source] = self.by_source.get(source, 0) + 1
        self.active[inst.id] = ev
        self._noticed.add(inst.id)
        self._plan(ev)  # the first moves now, in this turn: the fleet gets the whole notice
        ev.task = asyncio.ensure_future(self._run(ev))
        return self._answer(ev, now)

    def cancel(self, inst: Instance) -> dict[str, Any]:
        """The notice was cancelled (or the box outlived it): ``inst`` serves again, through ``syncing`` when it
        missed a weight version (weight sync pushes it as any box behind). Raises :class:`Conflict` when it is
        not evacuating."""
        ev = self.active.get(inst.id)
        if ev is None or inst.state != State.EVACUATING:
            raise Conflict(f"endpoint: {inst.endpoint} is {inst.state.value}, not evacuating")
        self._end(ev)
        behind = self.version.behind(inst)
        # quarantined (it was syncing for a reload when the notice came): back to that, its probe decides the rest
        target = State.SYNCING if behind or inst.quarantined is not None else State.ACTIVE
        self.registry.transition(inst, target, f"evacuation cancelled ({ev.source} notice)" +
                                 (f"; needs weight version {self.version.current}" if behind else ""),
                                 notice_cancelled=True)
        return {"endpoint": inst.endpoint, "state": inst.state.value, "moved": ev.moved}

    def status_of(self, inst: Instance) -> dict[str, Any] | None:
        ev = self.active.get(inst.id)
        return None if ev is None else ev.status(self.clock())

    def evacuating(self, iid: str) -> bool:
        return iid in self.active

    async def close(self) -> None:
        tasks = [ev.task for ev in self.active.values() if ev.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------ new work
    def admitting(self, ask: Ask) -> list[Instance]:
        """The evacuating boxes that may take ``ask`` (``dispatch.EvacuatingBoxes``): it would stay there by the
        plan's own rule, beside every sequence that stays there now."""
        if not self.active:
            return []
        now = self.clock()
        return [ev.inst for ev in self.active.values() if self._admits(ev, ask, now)]

    def room(self) -> bool:
        """Whether an evacuating box may take work now at all (it has room, time and an admission)."""
        now = self.clock()
        return any(self._open(ev, now) for ev in self.active.values())

    def taken(self, inst: Instance, ask: Ask) -> None:
        """The dispatcher placed ``ask`` on evacuating ``inst``: it stays there, in what the box may still take."""
        ev = self.active.get(inst.id)
        if ev is not None:
            ev.admitted += 1
            new = self._asked(ask, f"admitted-{ev.admitted}")
            ev.admission = ev.admission.taking(new)
            ev.pending.append((self.clock(), new))

    def _open(self, ev: Evacuation, now: float) -> bool:
        """Whether ``ev``'s box takes new work at all now: its notice may still be withdrawn, it is in service
        as an evacuating box (registered, not quarantined, at the weight version), it has room, a step model
        and time before the margin."""
        inst = ev.inst
        return (ev.source not in FINAL_SOURCES and inst.state == State.EVACUATING
                and self.registry.get(inst.id) is inst and inst.quarantined is None
                and not self.version.behind(inst) and ev.admission.step is not None
                and ev.deadline - now > self.settings.margin_s
                and inst.load.in_flight < self.dispatcher.capacity.bound_of(inst))

    def _admits(self, ev: Evacuation, ask: Ask, now: float) -> bool:
        return self._open(ev, now) and ev.admission.admits(
            self._asked(ask, "asked"), ev.deadline - now - self.settings.margin_s, self.settings.stay_share)

    @staticmethod
    def _asked(ask: Ask, seq_id: str) -> DoomedSequence:
        """A sequence not yet placed, as the plan counts it: nothing made, its prediction, its budget left."""
        return DoomedSequence(seq_id, 0, ask.predicted, ask.high, ask.tokens)

    # ------------------------------------------------------------ the moves
    def _answer(self, ev: Evacuation, now: float) -> dict[str, Any]:
        left = len(self.migrator.on(ev.inst))
        return {"endpoint": ev.inst.endpoint, "state": State.EVACUATING.value,
                "deadline_s": round(max(ev.deadline - now, 0.0), 3), "staying": ev.staying,
                "moving": max(left - ev.staying, 0)}

    async def _run(self, ev: Evacuation) -> None:
        inst, settings = ev.inst, self.settings
        try:
            while self.registry.get(inst.id) is inst and inst.state == State.EVACUATING:
                left = ev.deadline - self.clock()
                if left <= 0:
                    break
                if self._emptied(ev):
                    self._end(ev)
                    self.registry.transition(inst, State.DEAD, f"evacuated: {ev.source} notice, nothing left on "
                                             f"it {left:.1f}s before its deadline" +
                                             (f" ({ev.detail})" if ev.detail else "") +
                                             f"; {ev.moved} sequence(s) moved")
                    return
                ev.wake.clear()
                until_last = left - settings.margin_s  # the last moves are due then
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(ev.wake.wait(), min(settings.tick_s, until_last if until_last > 0 else left))
                if self.registry.get(inst.id) is inst and inst.state == State.EVACUATING:
                    self._plan(ev)
            if self.registry.get(inst.id) is inst and inst.state == State.EVACUATING:
                self._end(ev)
                self.registry.transition(inst, State.DEAD, f"evacuated: {ev.source} notice, deadline reached" +
                                         (f" ({ev.detail})" if ev.detail else "") +
                                         f"; {ev.moved} sequence(s) moved")
        finally:
            if self.active.get(inst.id) is ev:  # removed by something else (health, a shutdown): count it too
                self._end(ev)

    def _emptied(self, ev: Evacuation) -> bool:
        """Whether ``ev``'s box may go now: its notice is final and nothing runs on it or is still being
        aborted there (every request placed on it was released)."""
        return ev.source in FINAL_SOURCES and not self.migrator.on(ev.inst) and ev.inst.load.in_flight == 0 \
            and not self.elsewhere(ev.inst.id)

    def _plan(self, ev: Evacuation) -> None:
        """Make the plan again and start the moves it asks for that a box has room for now; past
        ``deadline - margin_s`` every sequence left moves, wherever the dispatcher places it."""
        inst = ev.inst
        running = self.migrator.on(inst)
        time_left = ev.deadline - self.clock() - self.settings.margin_s
        by_id = {str(id(seq)): seq for seq in running}
        if time_left <= 0:
            plan = EvacuationPlan((), tuple(by_id), 0.0)
            ev.admission = EvacuationAdmission(None)
        else:
            step = self.dispatcher.fleet.speeds.model(inst.id)
            plan = plan_evacuation([self._doomed(seq) for seq in running], step, time_left, self.settings.stay_share)
            now = self.clock()
            ev.pending = [(at, d) for at, d in ev.pending if now - at < self.settings.tick_s]
            ev.admission = admission(plan, step)
            for _, d in ev.pending:
                ev.admission = ev.admission.taking(d)
        self.generation += 1
        self.dispatcher.offer_waiting()  # what waits may fit the admission made now
        ev.staying = len(plan.stay)
        reason = f"{ev.source} notice"
        for sid in plan.move:
            seq = by_id[sid]
            target = None if time_left <= 0 else self._room_for(seq, inst)
            if target is None and time_left > 0:
                break  # no box has room now: the longest waits for the next tick, and so do the shorter ones
            if self.migrator.move(seq, target, reason):
                ev.moved += 1
                self.sequences_moved += 1
                log.info("evacuating %s: sequence %s moves (%d token(s) made)%s", inst.endpoint, seq.rid,
                         len(seq.output_ids), "" if target is None else f" to {target.endpoint}")
            elif target is not None:
                self.dispatcher.release(target, seq.reserve)

    def _doomed(self, seq: SequenceState) -> DoomedSequence:
        made = len(seq.output_ids)
        track, lengths = seq.track, self.lengths
        left = high = None
        if lengths is not None and track is not None and track.open:
            left, high = lengths.left(track, made), lengths.high(track, made)
        return DoomedSequence(str(id(seq)), made, left, high, seq.remaining)

    def _room_for(self, seq: SequenceState, src: Instance) -> Instance | None:
        """The box where ``seq`` runs fastest now (its learned step with one more sequence), among the active
        remote boxes with room that may take it (its staleness bound; the longest off preemptible boxes where
        placement does that), reserved for it as tail migration reserves its targets (``Dispatcher.claim``)."""
        d, allow = self.dispatcher, self.migrator.bound(seq)
        boxes = [i for i in d.registry.active() if i.state == State.ACTIVE and i is not src and i.kind == Kind.REMOTE
                 and i.health.consecutive_failures == 0 and i.load.in_flight < d.capacity.bound_of(i)
                 and (allow is None or allow(i))]
        if d.narrow_remote is not None and len(boxes) > 1:
            boxes = d.narrow_remote(boxes, self._doomed(seq).expected())
        models, fleet = d.fleet.speeds.models()

        def step(i: Instance) -> float:
            model = models.get(i.id, fleet)
            return math.inf if model is None else model.step_s(i.load.in_flight + 1)

        for target in sorted(boxes, key=lambda i: (step(i), i.load.in_flight)):
            if d.claim(target, seq.reserve):
                return target
        return None

    def _end(self, ev: Evacuation) -> None:
        """The evacuation is over: count the tokens the box made after its notice that were kept."""
        if self.active.get(ev.inst.id) is not ev:
            return
        del self.active[ev.inst.id]
        if ev.task is not None and ev.task is not asyncio.current_task():
            ev.task.cancel()
        iid = ev.inst.id
        for seq, at_notice in ev.made_at_notice.values():
            self.tokens_saved += sum(max(s.end - max(s.start, at_notice), 0) for s in seq.segments if s.instance == iid)

    # ------------------------------------------------------------ failures without notice
    def _failed(self, seq: SequenceState, segment: Segment) -> None:
        """A segment ended in its box's failure: unless the box was evacuating, the tokens it made since the
        sequence's last chunk are made again elsewhere. The manager never saw them: counted at the expected
        half of a stream interval (chunks come every ``stream_interval`` tokens, a failure at any point)."""
        if segment.instance in self._noticed:
            return
        self.failures_without_notice += 1
        self.preemption_tokens_lost += max(self.settings.stream_interval - 1, 0) / 2

    def totals(self) -> dict[str, Any]:
        return {"evacuations": dict(self.by_source), "evacuating": len(self.active),
                "sequences_moved": self.sequences_moved, "tokens_saved": self.tokens_saved,
                "failures_without_notice": self.failures_without_notice,
                "preemption_tokens_lost_estimate": round(self.preemption_tokens_lost, 1)}


def _nowhere(iid: str) -> bool:
    return False
