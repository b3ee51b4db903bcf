"""A step on a simulated mixed fleet whose boxes are taken back mid-step: with notices and evacuation, the same
preemptions as crashes, and none; and the scaling signal asked how many boxes the step needs.

The pool is ``sim_pool``'s (continuous batching, ``a + b * n`` a decode step, prefill at ``prefill_factor`` times a
lone decode) on ``tail_fleet``'s fleets, run by the manager's own code: ``makespan`` placement with the length model
and the boxes' learned step curves, tail migration, the evacuation plan (``placement.evacuation_plan``) and the
scaling signal's arithmetic (``placement.fleet_demand``). Each seed runs one step of the same prompts first (the
manager's speeds and the prompts' lengths learned, as from a step before), then the measured step four ways on the
same draws:

- **notice**: ``--notice`` seconds before a box is taken back it is evacuated as the manager does it
  (``rollout/evacuation.py``): at once it is no tail-migration target, and it takes new work only where the
  box's ``evacuation_plan.EvacuationAdmission`` says the sequence would stay (its prediction, within its budget,
  drained on the box's curve beside what stays there within half the time left to the margin; the dispatcher
  offers it the queue's head with the other boxes, then, when the head fits nowhere, once a tick each queued
  sequence in order); every
  ``--tick-evac`` seconds its sequences are split by
  ``plan_evacuation`` (those predicted to end within half the time left stay) and the others move, longest first,
  to a box with room now; ``--margin`` seconds before the deadline whatever is left goes back to the manager's
  queue. A moved sequence is aborted where it runs, and the abort's answer carries the tokens made since its last
  chunk (SGLang's final chunk does), so at most the one decode step the abort raced is made again; its prompt and
  tokens are prefilled again on the new box;
- **lost**: the same moves, each losing what its box made since the sequence's last chunk, as a crash does (an
  engine whose abort answer carried nothing): the bound on what a notice can cost;
- **crash**: the same boxes die at the same moments without notice: every sequence on them loses the tokens since
  its last chunk and is prefilled again elsewhere (after ``--detect`` seconds);
- **none**: no box is taken back.

Preemptions are a Poisson process per box at ``--rate`` per box-hour, drawn over the no-preemption step's length
(a box is taken at most once, and one box always survives). Published rates are far lower: AWS's Spot Instance
Advisor gives each instance type's frequency of interruption as the share of its Spot capacity reclaimed in the
trailing month, in bands from under 5% to over 20%; even 20% a month is 0.0003 a box-hour, so a step of a few
minutes on eight boxes is hit about once in ten thousand steps. The rate here (default 3 a box-hour, 10,000 times
that) puts one or two preemptions in most steps, and a seed whose draw is empty is drawn again: the figures are
what a step that is hit costs, not what preemption costs an average step.

``--scale``: the scaling signal on the same fleet. The step starts on one box of each speed; every ``--poll`` seconds
the simulator asks ``fleet_demand`` (the boxes' learned curves, their predicted work, the queue's predictions) how
many boxes of each speed the rest of the step needs to end within the target and starts the ones it asks for (at
once; each speed a kind priced at its speed, so every kind's token costs about the same and the fastest is opened
first); the target is ``--targets`` times the full fleet's step. It prints the step against the target, the boxes
started and their cost (box-seconds times price) against the full fleet's, and asserts that the signal asks for
none once the step is over.

    .venv/bin/python benchmarks/sim_preemption.py                # 8 seeds, 3 preemptions per box-hour, 30 s notices
    .venv/bin/python benchmarks/sim_preemption.py --notice 120   # AWS's two minutes
    .venv/bin/python benchmarks/sim_preemption.py --scale

The last line: ``sim preemption: re-made tokens median X% (worst W%) with notices, ...``; with ``--scale``:
``sim scale: ...``.
"""

from __future__ import annotations

import argparse
import copy
import math
import random
import statistics
import sys
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from sim_pool import Inst, Req, make_lengths
from sim_tail import GROUP, mover_of, sim_args
from tail_fleet import BENCH, SWEEP, Shape

from rollout_manager.placement.box_speed import BoxSpeeds, StepModel
from rollout_manager.placement.evacuation_plan import DoomedSequence, EvacuationAdmission, admission, plan_evacuation
from rollout_manager.placement.fleet_demand import BoxKind, BoxNow, FleetDemand, fleet_demand
from rollout_manager.placement.fleet_signal import MIN_LEFT
from rollout_manager.placement.lengths import LengthModel
from rollout_manager.placement.makespan import Makespan
from rollout_manager.placement.rate_meter import TokenRateMeter, lone_rate_weight
from rollout_manager.placement.tail_migration import Rest, RunningSequence, TailMigration

EPS = 1e-9
# Steps of reasoning models: a group's median around 1,500 tokens, at most 16,384, on bench_tail's fleet.
LONG = replace(BENCH, name="long-steps", median=1500.0, group_sigma=0.7, sample_sigma=0.5, cap=16384)
SHAPES = {s.name: s for s in (LONG, *SWEEP)}


@dataclass(frozen=True)
class Preemption:
    box: int
    at: float  # the box is gone at this time


@dataclass
class Outcome:
    makespan: float
    tokens: int  # the step's tokens (its sequences' lengths)
    remade: float  # decoded twice: made after a sequence's last chunk on a box it left by a cut
    reprefill: float  # prompt and tokens prefilled again after a cut (evacuation, crash)
    migration_prefill: float  # the same after tail migration's moves
    moved: int  # sequences cut off a box taken back
    stayed: int  # sequences that finished on a box with a notice after it
    admitted: int = 0  # sequences placed on a box after its notice
    boxes: int = 0  # boxes started (scale runs)
    box_s: float = 0.0  # box-seconds the step held, each weighted by its box's price (its speed; scale runs)
    wanted_after: int = -1  # boxes the signal asked for once the step was over (scale runs)
    first_end: float = 0.0  # the end the signal predicted at the start, with the boxes it asked for (scale runs)


@dataclass
class Run:
    """What one run does to the fleet: preemptions (with a notice or as crashes), or scaling."""

    preemptions: list[Preemption] = field(default_factory=list)
    notice_s: float | None = None  # None: crashes
    margin_s: float = 3.0
    tick_s: float = 0.5
    detect_s: float = 0.0
    carried: bool = True  # an evacuation's abort answer carries what the box made since the last chunk (SGLang's)
    scale_target_s: float | None = None
    poll_s: float = 15.0
    start_boxes: list[int] | None = None  # boxes there at the start (None: all)


class Sim:
    """One step: the pool, the manager's placement, length model, tail migration and, per ``Run``, evacuations
    (notice), failures (crash) or the scaling signal."""

    def __init__(self, shape: Shape, args: argparse.Namespace, lengths: list[int], model: LengthModel,
                 speeds: BoxSpeeds, run: Run, epoch: int, chunk: int) -> None:
        self.args, self.run, self.chunk = args, run, chunk
        self.speeds_of = list(shape.speeds)
        self.policy = Makespan(max_in_flight=shape.max_running)
        self.migration: TailMigration = mover_of(argparse.Namespace(swap_queue=1), args)
        self.model, self.speeds = model, speeds
        self.insts: list[Inst] = []
        self.by_id: dict[str, Inst] = {}
        start = range(len(shape.speeds)) if run.start_boxes is None else run.start_boxes
        self.started_at: dict[str, float] = {}
        self.speed: dict[str, float] = {}  # box -> its speed
        for k in start:
            self.add_box(f"i{k}", shape.speeds[k], 0.0)
        self.reqs = [Req(i, n, args.max_new_tokens, args.prompt_tokens, group=i // GROUP)
                     for i, n in enumerate(lengths)]
        for r in self.reqs:
            r.track = model.start(f"e{epoch}g{r.group}", [r.group], str(r.rid), lambda r=r: int(r.done),  # type: ignore[misc]
                                  r.budget)
            r.predicted = model.predict(r.track, 0).median
        self.seen: dict[int, float] = {r.rid: 0.0 for r in self.reqs}  # tokens the manager saw (last chunk)
        self.base: dict[int, float] = {r.rid: 0.0 for r in self.reqs}  # tokens made when its attempt began
        self.held: deque[Req] = deque(sorted(self.reqs, key=lambda r: -(r.predicted or 0.0)))
        self.evacuating: dict[str, float] = {}  # box -> deadline
        self.admission: dict[str, EvacuationAdmission] = {}  # box -> what it may still take (as the manager's)
        self.generation = 0  # moves on at every evacuation tick (the Evacuator's)
        self.offered = -1  # the generation the queue was last offered to the evacuating boxes at (the dispatcher's)
        self.gone_at: dict[str, float] = {}  # box -> the moment it is taken back
        for p in run.preemptions:
            self.gone_at[f"i{p.box}"] = p.at
        self.delayed: list[tuple[float, Req]] = []  # crash victims, back in the queue after detect_s
        self.now = 0.0
        self.remade = self.reprefill = self.migration_prefill = 0.0
        self.moved = self.stayed = self.finished = self.admitted = 0
        self.noticed: set[int] = set()  # sequences on a box when its notice came
        self.next_evac = 0.0  # the evacuations' next tick
        self.first_end = 0.0  # the signal's first predicted end (scale runs)

    # ------------------------------------------------------------ the fleet
    def add_box(self, iid: str, s: float, now: float) -> Inst:
        a = self.args
        inst = Inst(iid, a.base_rate * s, a.batch_half, a.max_running, a.base_rate * s * a.prefill_factor,
                    TokenRateMeter(tau_s=a.meter_tau, min_busy_s=a.meter_min_busy),
                    TokenRateMeter(tau_s=a.meter_tau, min_busy_s=a.meter_min_busy))
        inst.speeds = self.speeds
        self.insts.append(inst)
        self.by_id[iid] = inst
        self.started_at[iid] = now
        self.speed[iid] = s
        return inst

    def serving(self) -> list[Inst]:
        return [i for i in self.insts if i.alive and i.iid not in self.evacuating]

    # ------------------------------------------------------------ the manager's queue
    def hold(self, r: Req) -> None:
        """Back to the manager's queue, predicted again, longest predicted first."""
        assert r.track is not None
        r.predicted = self.model.left(r.track, int(r.done))
        at = len(self.held)
        while at > 0 and (self.held[at - 1].predicted or 0.0) < r.predicted:
            at -= 1
        self.held.insert(at, r)

    def place(self, r: Req, among: list[Inst]) -> Inst | None:
        assert r.track is not None
        if r.predicted is None:
            r.predicted = self.model.left(r.track, int(r.done))
        high = self.model.high(r.track, int(r.done))
        choice = self.policy.place([i.load(self.now) for i in among], r.budget_left, self.now, r.predicted, None,
                                   r.prompt + int(r.done), high)
        if choice is None:
            return None
        inst = self.by_id[choice]
        inst.admit(r, self.now)
        if inst.iid in self.evacuating:  # the Evacuator's ``taken``
            self.admitted += 1
            self.admission[inst.iid] = self.admission[inst.iid].taking(self.asked(r))
        inst.work.placed(*self.policy.counted(r.budget_left, r.predicted, high))
        self.base[r.rid] = self.seen[r.rid] = r.done
        return inst

    def offer(self) -> None:
        """The dispatcher's queue: the head to the serving boxes and the evacuating ones that admit it, until one
        fits nowhere; then, once per evacuation tick while one of them has room, each queued sequence in order to
        those that admit it alone (``Dispatcher._place_on_evacuating``)."""
        serving = self.serving()
        while self.held:
            r = self.held[0]
            among = serving + self.admitting(r)
            if not among or self.place(r, among) is None:
                break
            self.held.popleft()
        if not self.evacuating or not self.held or self.generation == self.offered or not any(
                (i := self.by_id[iid]).alive and i.in_flight() < i.max_running and self.admission[iid].step is not None
                and deadline - self.now > self.run.margin_s for iid, deadline in self.evacuating.items()):
            return
        self.offered = self.generation
        for r in list(self.held):
            boxes = self.admitting(r)
            if boxes and self.place(r, boxes) is not None:
                self.held.remove(r)

    def admitting(self, r: Req) -> list[Inst]:
        """The evacuating boxes with room that would keep ``r`` (``Evacuator.admitting``)."""
        if not self.evacuating:
            return []
        asked = self.asked(r)
        return [inst for iid, deadline in self.evacuating.items() if (inst := self.by_id[iid]).alive
                and inst.in_flight() < inst.max_running
                and self.admission[iid].admits(asked, deadline - self.now - self.run.margin_s)]

    def asked(self, r: Req) -> DoomedSequence:
        """``r`` not yet placed, as the plan counts it (``Evacuator._asked``: the ask's prediction and budget)."""
        assert r.track is not None
        made = int(r.done)
        predicted = self.model.left(r.track, made) if r.predicted is None else r.predicted
        return DoomedSequence("asked", 0, predicted, self.model.high(r.track, made), r.budget_left)

    def doomed(self, inst: Inst) -> list[DoomedSequence]:
        """``inst``'s sequences as the evacuation plan counts them (``Evacuator._doomed``)."""
        out = []
        for r in inst.running + list(inst.queue):
            assert r.track is not None
            made = int(self.seen[r.rid])
            out.append(DoomedSequence(str(r.rid), made, self.model.left(r.track, made),
                                      self.model.high(r.track, made), r.budget - made))
        return out

    # ------------------------------------------------------------ cuts
    def cut(self, r: Req, inst: Inst, carried: bool = False) -> None:
        """``r`` leaves ``inst`` at its last chunk: what was made since is made again, its context prefilled again
        (``carried``: the abort's answer brought what was made since, so only the decode step it raced is made
        again)."""
        inst.work.ended(inst.in_flight())
        if r in inst.running:
            inst.running.remove(r)
        else:
            inst.queue.remove(r)
        seen = self.seen[r.rid]
        if carried:
            seen = self.seen[r.rid] = max(seen, r.done - 1.0)
        self.remade += r.done - seen
        self.reprefill += r.prompt + seen
        r.done = seen
        self.moved += 1

    def notice(self, inst: Inst, deadline: float) -> None:
        if not self.evacuating:
            self.next_evac = self.now + self.run.tick_s
        self.evacuating[inst.iid] = deadline
        self.noticed.update(r.rid for r in inst.running + list(inst.queue))

    def evacuate(self, inst: Inst) -> None:
        """One tick of the evacuation (``rollout/evacuation.py``'s ``_plan``)."""
        deadline = self.evacuating[inst.iid]
        left_s = deadline - self.now - self.run.margin_s
        seqs = {str(r.rid): r for r in inst.running + list(inst.queue)}
        if left_s <= 0:
            move = list(seqs)
            self.admission[inst.iid] = EvacuationAdmission(None)
        else:
            step = self.speeds.model(inst.iid)
            plan = plan_evacuation(self.doomed(inst), step, left_s)
            move = list(plan.move)
            self.admission[inst.iid] = admission(plan, step)
        self.generation += 1
        for sid in move:
            r = seqs[sid]
            if left_s > 0:  # only to a box with room now, as the dispatcher's try_acquire
                room = [i for i in self.serving() if i.in_flight() < i.max_running]
                if not room:
                    break
                self.cut(r, inst, self.run.carried)
                if self.place(r, room) is None:
                    self.hold(r)
            else:
                self.cut(r, inst, self.run.carried)
                self.hold(r)
        inst.promote(self.now)
        inst.busy_changed(self.now)

    def take_back(self, inst: Inst) -> None:
        """The box is gone: whatever is on it is cut (a crash; an evacuated box has nothing left)."""
        for r in list(inst.running) + list(inst.queue):
            self.cut(r, inst)
            if self.run.detect_s > 0:
                self.delayed.append((self.now + self.run.detect_s, r))
            else:
                self.hold(r)
        inst.alive = False
        inst.running, inst.queue = [], deque()
        self.evacuating.pop(inst.iid, None)

    # ------------------------------------------------------------ tail migration
    def migrate(self) -> None:
        alive = self.serving()
        where: dict[int, Inst] = {}
        running = []
        for inst in alive:
            for r in list(inst.running) + list(inst.queue):
                where[r.rid] = inst
                running.append(RunningSequence(str(r.rid), inst.iid, int(r.done), r.prompt, r.budget_left,
                                               r.moves, r.last_moved_at, frozenset(r.visited)))

        def predict(s: RunningSequence) -> Rest | None:
            r = self.reqs[int(s.seq_id)]
            assert r.track is not None
            return Rest(self.model.left(r.track, int(r.done)), self.model.informed(r.track))

        head = self.held[0].predicted if self.held else None
        for mv in self.migration.plan([i.load(self.now) for i in alive], running, len(self.held), self.now, (),
                                      predict, head):
            r = self.reqs[int(mv.seq_id)]
            src, dst = where[r.rid], self.by_id[mv.target]
            src.work.ended(src.in_flight())
            dst.work.placed(self.policy.expected(r.budget_left, r.predicted))
            if r in src.running:
                src.running.remove(r)
                src.promote(self.now)
            else:
                src.queue.remove(r)
            src.busy_changed(self.now)
            self.migration_prefill += r.prompt + int(r.done)
            r.done = float(int(r.done))
            r.moves += 1
            r.last_moved_at = self.now
            dst.admit(r, self.now, self.args.move_overhead)
            self.base[r.rid] = self.seen[r.rid] = r.done

    # ------------------------------------------------------------ the scaling signal
    def kinds(self) -> list[BoxKind]:
        """One kind per speed: the median learned curve of its boxes (every speed was seen in the step before)."""
        models, fleet = self.speeds.models()
        out = []
        for s in sorted(set(self.speeds_of), reverse=True):
            own = [models[i.iid] for i in self.insts if i.iid in models and self.speed[i.iid] == s]
            if not own:
                own = [models[f"i{k}"] for k, v in enumerate(self.speeds_of) if v == s and f"i{k}" in models]
            step = StepModel(statistics.median(m.a for m in own), statistics.median(m.b for m in own)) if own else fleet
            assert step is not None
            out.append(BoxKind(f"speed-{s:g}", step, self.args.max_running, price_per_hour=s))
        return out

    def demand(self, target_s: float) -> FleetDemand:
        models, _ = self.speeds.models()
        boxes = []
        for i in self.serving():
            n = i.in_flight()
            tokens = max(i.work.tokens, n * MIN_LEFT) if n else 0.0
            longest = max(i.work.longest, MIN_LEFT) if n else 0.0
            boxes.append(BoxNow(f"speed-{self.speed[i.iid]:g}", models.get(i.iid), i.max_running, n, tokens,
                                longest))
        queued = list(self.held) + [r for _, r in self.delayed]
        waiting = [r.predicted or 1.0 for r in queued]
        high = [self.model.high(r.track, int(r.done)) if r.track is not None else None for r in queued]
        return fleet_demand(target_s, self.kinds(), boxes, waiting, high)

    def scale(self, target_s: float) -> None:
        """Start the boxes the signal asks for (``more`` of each kind)."""
        demand = self.demand(target_s)
        if not self.first_end:
            self.first_end = demand.predicted_end_s
        for kind in demand.kinds:
            for _ in range(kind.more):
                self.add_box(f"n{len(self.insts)}", float(kind.kind.removeprefix("speed-")), self.now)

    # ------------------------------------------------------------ the loop
    def step(self) -> Outcome:
        args, run = self.args, self.run
        tick, next_tick = args.tick, args.tick
        next_migrate = args.migrate_interval
        self.next_evac = run.tick_s
        next_poll = run.poll_s
        notices = sorted((at - run.notice_s, self.by_id[iid]) for iid, at in self.gone_at.items()
                         if iid in self.by_id) if run.notice_s is not None else []
        deaths = sorted((at, self.by_id[iid]) for iid, at in self.gone_at.items() if iid in self.by_id)
        for at, inst in notices:
            if at <= 0:
                self.notice(inst, at + (run.notice_s or 0.0))
                self.evacuate(inst)  # the manager plans at the notice: what the box may take from the start
        notices = [(at, i) for at, i in notices if at > 0]
        if run.scale_target_s is not None:
            self.scale(run.scale_target_s)
        self.offer()
        total = len(self.reqs)
        while self.finished < total:
            t_next = min(next_tick, next_migrate)
            if self.evacuating:
                t_next = min(t_next, self.next_evac)
            if notices:
                t_next = min(t_next, notices[0][0])
            if deaths:
                t_next = min(t_next, deaths[0][0])
            if self.delayed:
                t_next = min(t_next, min(at for at, _ in self.delayed))
            if run.scale_target_s is not None:
                t_next = min(t_next, next_poll)
            for inst in self.insts:
                if inst.alive and inst.running:
                    rate = inst.per_seq_rate()
                    for r in inst.running:
                        if r.ready_at > self.now + EPS:
                            t_next = min(t_next, r.ready_at)
                        else:
                            t_next = min(t_next, self.now + max(r.remaining, 0.0) / rate)
            dt = t_next - self.now
            for inst in self.insts:
                if not (inst.alive and inst.running):
                    continue
                rate = inst.per_seq_rate()
                made = 0.0
                for r in inst.running:
                    if r.ready_at <= self.now + EPS:
                        step = min(r.remaining, rate * dt)
                        r.done += step
                        made += step
                        base = self.base[r.rid]  # a chunk every ``chunk`` tokens of this attempt, and its last
                        self.seen[r.rid] = base + math.floor((r.done - base) / self.chunk + EPS) * self.chunk
                inst.carry += made
                whole = int(inst.carry)
                inst.carry -= whole
                inst.meter.observe(whole, t_next)
                inst.lone_meter.observe(whole * lone_rate_weight(inst.in_flight(), args.batch_half), t_next)
                if whole:
                    self.speeds.observe(inst.iid, whole, inst.in_flight(), t_next)
                    inst.work.made(whole, len(inst.running))
            self.now = t_next
            for inst in self.insts:
                if not inst.alive:
                    continue
                done = [r for r in inst.running if r.remaining <= EPS * max(1, r.length)]
                for r in done:
                    inst.work.ended(inst.in_flight())
                    r.done, r.finish = float(r.length), self.now
                    self.seen[r.rid] = r.done
                    inst.running.remove(r)
                    self.finished += 1
                    if inst.iid in self.evacuating and r.rid in self.noticed:
                        self.stayed += 1
                    assert r.track is not None
                    self.model.finish(r.track, r.length)
                if done:
                    inst.promote(self.now)
                    inst.busy_changed(self.now)
            while notices and notices[0][0] <= self.now + EPS:
                _, inst = notices.pop(0)
                if inst.alive:
                    self.notice(inst, self.now + (run.notice_s or 0.0))
                    self.evacuate(inst)
            while deaths and deaths[0][0] <= self.now + EPS:
                _, inst = deaths.pop(0)
                if inst.alive:
                    self.take_back(inst)
            for at, r in [d for d in self.delayed if d[0] <= self.now + EPS]:
                self.delayed.remove((at, r))
                self.hold(r)
            if self.now >= next_tick - EPS:
                next_tick += tick
            if self.evacuating and self.now >= self.next_evac - EPS:
                self.next_evac = self.now + run.tick_s
                for iid in list(self.evacuating):
                    self.evacuate(self.by_id[iid])
            if run.scale_target_s is not None and self.now >= next_poll - EPS:
                next_poll += run.poll_s
                self.scale(run.scale_target_s)
            self.offer()
            if self.now >= next_migrate - EPS:
                next_migrate += args.migrate_interval
                self.migrate()
                self.offer()
            if self.held and not any(i.alive and i.in_flight() for i in self.insts) and not self.delayed \
                    and not self.serving():
                raise RuntimeError("work is held while no box is left")
        box_s = sum((self.now - t) * self.speed[iid] for iid, t in self.started_at.items())
        wanted_after = self.demand(run.scale_target_s).wanted if run.scale_target_s is not None else -1
        return Outcome(self.now, sum(r.length for r in self.reqs), self.remade, self.reprefill,
                       self.migration_prefill, self.moved,
                       self.stayed, self.admitted, len(self.insts), box_s, wanted_after, self.first_end)


# ------------------------------------------------------------------ runs


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=8)
    p.add_argument("--groups", type=int, default=128, help="groups of 8 samples in the step")
    p.add_argument("--fleet", choices=sorted(SHAPES), default=LONG.name)
    p.add_argument("--rate", type=float, default=3.0, help="preemptions per box-hour (see the module docstring)")
    p.add_argument("--notice", type=float, default=30.0, help="seconds of warning (GCE: 30, AWS: 120)")
    p.add_argument("--margin", type=float, default=3.0, help="evacuation_margin_s")
    p.add_argument("--tick-evac", type=float, default=0.5, help="evacuation_tick_s")
    p.add_argument("--detect", type=float, default=0.0,
                   help="seconds before the manager learns of a crash (0: its streams break at once)")
    p.add_argument("--scale", action="store_true", help="the scaling signal instead of preemptions")
    p.add_argument("--targets", default="0.8,1.0,1.5", help="--scale: targets as multiples of the full fleet's step")
    p.add_argument("--poll", type=float, default=15.0, help="--scale: seconds between two looks at the signal")
    return p.parse_args(argv)


def learned(shape: Shape, args: argparse.Namespace, chunk: int) -> tuple[LengthModel, BoxSpeeds]:
    """The manager after one step of the same prompts on the whole fleet: their lengths and the boxes' speeds."""
    model, speeds = LengthModel(), BoxSpeeds()
    Sim(shape, args, make_lengths(args, 0), model, speeds, Run(), 0, chunk).step()
    return model, speeds


def draw(seed: int, boxes: int, horizon: float, rate_per_hour: float) -> list[Preemption]:
    """Poisson preemptions per box over ``horizon`` seconds, at least one (drawn again until there is one),
    never every box."""
    rng = random.Random(f"preempt/{seed}")
    lam = rate_per_hour / 3600.0
    for _ in range(10_000):
        out = []
        for k in range(boxes):
            at = rng.expovariate(lam) if lam > 0 else math.inf
            if at < horizon:
                out.append(Preemption(k, at))
        if out and len(out) < boxes:
            return sorted(out, key=lambda p: p.at)
    raise SystemExit("no draw with a preemption: raise --rate")


def pct(x: float) -> str:
    return f"{100 * x:.3f}%"


ROWS = {"notice": "notices, evacuated as the manager does",
        "lost": "the same moves, each losing what its box made since its last chunk",
        "crash": "the same preemptions as crashes"}


def capacity_lost(shape: Shape, draws: list[Preemption], step_s: float) -> float:
    """The share of the no-preemption step's box capacity (speed x seconds) the preemptions take away: what no
    evacuation can give back, and why a step hit early on its fastest box ends late whatever is moved."""
    lost = sum(shape.speeds[p.box] * max(step_s - p.at, 0.0) for p in draws)
    return lost / (sum(shape.speeds) * step_s)


def preemptions(own: argparse.Namespace, shape: Shape) -> int:
    ratios: dict[str, list[float]] = {k: [] for k in ROWS}
    remade: dict[str, list[float]] = {k: [] for k in ROWS}
    prefill: dict[str, list[float]] = {k: [] for k in ROWS}
    hits: list[int] = []
    lost: list[float] = []
    print(f"sim preemption: fleet {shape.describe()}; {own.groups} groups x {GROUP}; {own.seeds} seeds; "
          f"{own.rate:g} preemptions per box-hour; notices {own.notice:g} s; crash detected after {own.detect:g} s")
    for seed in range(own.seeds):
        args = argparse.Namespace(**{**vars(sim_args(argparse.Namespace(
            groups=own.groups, migrate_interval=1.0, tick=None, tail_share=1.0, tail_slowdown=1.3), shape)),
            "seed": seed})
        model, speeds = learned(shape, args, shape.chunk_tokens)
        lengths = make_lengths(args, 1)

        def go(run: Run, args: argparse.Namespace = args, lengths: list[int] = lengths,
               model: LengthModel = model, speeds: BoxSpeeds = speeds) -> Outcome:
            return Sim(shape, args, lengths, copy.deepcopy(model), copy.deepcopy(speeds), run, 1,
                       shape.chunk_tokens).step()

        base = go(Run())
        draws = draw(seed, len(shape.speeds), base.makespan, own.rate)
        hits.append(len(draws))
        lost.append(capacity_lost(shape, draws, base.makespan))
        runs = {"notice": go(Run(draws, own.notice, own.margin, own.tick_evac)),
                "lost": go(Run(draws, own.notice, own.margin, own.tick_evac, carried=False)),
                "crash": go(Run(draws, None, detect_s=own.detect))}
        for name, r in runs.items():
            ratios[name].append(r.makespan / base.makespan)
            remade[name].append(r.remade / base.tokens)
            prefill[name].append(r.reprefill / base.tokens)
        print(f"- seed {seed}: {len(draws)} preemption(s) at "
              + ", ".join(f"box {p.box} (speed {shape.speeds[p.box]:g}) {p.at:.0f}s" for p in draws)
              + f" of a {base.makespan:.0f}s step ({base.tokens} tokens; {pct(lost[-1])} of its box capacity lost); "
              + "; ".join(f"{name}: makespan x{r.makespan / base.makespan:.3f}, {r.moved} cut ({r.stayed} stayed, "
                          f"{r.admitted} admitted), re-made {r.remade:.0f}, prefilled again {r.reprefill:.0f}"
                          for name, r in runs.items()))
    for name, label in ROWS.items():
        print(f"{name:>6} ({label}): makespan / no preemption median {statistics.median(ratios[name]):.3f} (worst "
              f"{max(ratios[name]):.3f}); re-made tokens median {pct(statistics.median(remade[name]))} (worst "
              f"{pct(max(remade[name]))}) of the step's; prefilled again median "
              f"{pct(statistics.median(prefill[name]))} (worst {pct(max(prefill[name]))})")
    print(f"sim preemption: re-made tokens median {pct(statistics.median(remade['notice']))} (worst "
          f"{pct(max(remade['notice']))}) with {own.notice:g} s notices against "
          f"{pct(statistics.median(remade['crash']))} (worst {pct(max(remade['crash']))}) as crashes; makespan "
          f"x{statistics.median(ratios['notice']):.3f} (worst x{max(ratios['notice']):.3f}) of no preemption with "
          f"notices, x{statistics.median(ratios['crash']):.3f} (worst x{max(ratios['crash']):.3f}) as crashes; "
          f"{statistics.median(hits):g} preemption(s) a step median, taking {pct(statistics.median(lost))} (most "
          f"{pct(max(lost))}) of the step's box capacity")
    return 0


def scaling(own: argparse.Namespace, shape: Shape) -> int:
    targets = [float(x) for x in own.targets.split(",")]
    print(f"sim scale: fleet {shape.describe()}; {own.groups} groups x {GROUP}; {own.seeds} seeds; the step starts "
          f"on one box of each speed, the signal looked at every {own.poll:g} s; targets {own.targets} x the full "
          f"fleet's step")
    start = sorted({shape.speeds.index(s) for s in shape.speeds})
    rows: dict[float, list[tuple[float, int, float, int]]] = {t: [] for t in targets}
    step_s = (shape.base_ms + shape.per_seq_ms) / max(shape.speeds) / 1000.0  # a lone decode step, fastest box
    for seed in range(own.seeds):
        args = argparse.Namespace(**{**vars(sim_args(argparse.Namespace(
            groups=own.groups, migrate_interval=1.0, tick=None, tail_share=1.0, tail_slowdown=1.3), shape)),
            "seed": seed})
        model, speeds = learned(shape, args, shape.chunk_tokens)
        lengths = make_lengths(args, 1)
        full = Sim(shape, args, lengths, copy.deepcopy(model), copy.deepcopy(speeds), Run(), 1,
                   shape.chunk_tokens).step()
        lone = max(lengths) * step_s
        for t in targets:
            target = t * full.makespan
            out = Sim(shape, args, lengths, copy.deepcopy(model), copy.deepcopy(speeds),
                      Run(scale_target_s=target, poll_s=own.poll, start_boxes=start), 1, shape.chunk_tokens).step()
            rows[t].append((out.makespan / target, out.boxes, out.box_s / full.box_s, out.wanted_after))
            print(f"- seed {seed}, target {t:g} x {full.makespan:.0f}s: step {out.makespan:.0f}s "
                  f"({out.makespan / target:.3f} of the target; the signal predicted {out.first_end:.0f}s at the "
                  f"start; the longest sequence alone on the fastest box {lone:.0f}s) on {out.boxes} boxes (the full "
                  f"fleet: {len(shape.speeds)}), cost x{out.box_s / full.box_s:.2f}; wanted after the step: "
                  f"{out.wanted_after}")
    worst = 0.0
    for t, rs in rows.items():
        ends = [r[0] for r in rs]
        worst = max(worst, max(ends))
        print(f"target {t:g} x the full fleet's step: step / target median {statistics.median(ends):.3f} (worst "
              f"{max(ends):.3f}); boxes started median {statistics.median(r[1] for r in rs):g} (most "
              f"{max(r[1] for r in rs)}); cost x{statistics.median(r[2] for r in rs):.2f} of the full fleet's (worst "
              f"x{max(r[2] for r in rs):.2f})")
    after = max(r[3] for rs in rows.values() for r in rs)
    assert after == 0, f"the signal asked for {after} box(es) once the step was over"
    print(f"sim scale: the step ended within {worst:.3f} of the target at worst over {own.seeds} seeds x "
          f"{len(targets)} targets; boxes wanted once it was over: {after}")
    return 0


def main(argv: list[str] | None = None) -> int:
    own = parse(argv)
    shape = SHAPES[own.fleet]
    return scaling(own, shape) if own.scale else preemptions(own, shape)


if __name__ == "__main__":
    raise SystemExit(main())
