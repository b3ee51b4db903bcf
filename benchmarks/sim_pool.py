"""The simulated rollout pool of ``bench_scheduling.py``: instances with a continuous-batching model, a
batch of requests, and one run of a policy over them (``simulate``); its module docstring says what is
modelled. The manager side is the real code."""

from __future__ import annotations

import argparse
import math
import random
import time
from collections import deque
from dataclasses import dataclass, field

from rollout_manager.placement.box_speed import BoxSpeeds
from rollout_manager.placement.instance_load import InstanceLoad
from rollout_manager.placement.lengths import LengthModel, Track
from rollout_manager.placement.makespan import BoxWork, Makespan
from rollout_manager.placement.policy import PlacementPolicy
from rollout_manager.placement.rate_meter import TokenRateMeter, lone_rate_weight
from rollout_manager.placement.tail_migration import Rest, RunningSequence, TailMigration

EPS = 1e-9


@dataclass
class Req:
    rid: int
    length: int  # true output length, hidden from the manager
    budget: int  # max_new_tokens
    prompt: int  # prompt tokens
    done: float = 0.0  # tokens generated so far (kept across a continuation)
    finish: float | None = None
    ready_at: float = 0.0  # prefill ends (decoding starts) at this time on its current instance
    moves: int = 0
    last_moved_at: float | None = None
    visited: set[str] = field(default_factory=set)
    group: int = 0  # its GRPO group: samples of one prompt, lengths correlated (see make_lengths)
    track: Track | None = None  # the length model's (makespan rows)
    predicted: float | None = None  # tokens the length model predicts it still makes, at its last placement
    prefer: str | None = None  # at a piece boundary: the instance it was on (its prefix is cached there)
    piece_end: float | None = None  # divided rollouts: the token count its current piece ends at

    @property
    def remaining(self) -> float:
        return self.length - self.done

    @property
    def budget_left(self) -> int:
        """What the manager knows: budget minus tokens it has seen streamed."""
        return self.budget - int(self.done)


@dataclass
class Inst:
    iid: str
    speed: float  # tokens/s for a lone sequence
    batch_half: float
    max_running: int
    prefill_rate: float
    meter: TokenRateMeter  # aggregate tokens/s (what dispatch policies read)
    lone_meter: TokenRateMeter  # lone-sequence tokens/s (what TailMigration reads)
    running: list[Req] = field(default_factory=list)
    queue: deque[Req] = field(default_factory=deque)
    alive: bool = True
    carry: float = 0.0  # fractional tokens not yet reported to the meter
    speeds: BoxSpeeds | None = None  # the fleet's step models (what the dispatcher learns), shared
    work: BoxWork = field(default_factory=BoxWork)  # its predicted work, as the dispatcher counts it

    def throughput(self, n: int) -> float:
        n = min(n, self.max_running)
        return self.speed * n / (1 + (n - 1) / self.batch_half) if n > 0 else 0.0

    @property
    def peak(self) -> float:
        return self.throughput(self.max_running)

    def per_seq_rate(self) -> float:
        n = len(self.running)
        return self.throughput(n) / n if n else 0.0

    def in_flight(self) -> int:
        return len(self.running) + len(self.queue)

    def load(self, now: float) -> InstanceLoad:
        toks = sum(r.budget_left for r in self.running) + sum(r.budget_left for r in self.queue)
        return InstanceLoad(self.iid, "remote", self.in_flight(), toks, self.meter.rate(now),
                            self.lone_meter.rate(now), self.speeds.model(self.iid) if self.speeds else None,
                            self.work.tokens, self.work.longest, self.max_running)

    def start(self, req: Req, now: float, overhead: float = 0.0) -> None:
        cached = req.prefer == self.iid  # a piece continued where it ran: its prefix is in the cache
        req.ready_at = now if cached else now + overhead + (req.prompt + req.done) / self.prefill_rate
        req.visited.add(self.iid)
        self.running.append(req)

    def admit(self, req: Req, now: float, overhead: float = 0.0) -> None:
        if len(self.running) < self.max_running:
            self.start(req, now, overhead)
        else:
            self.queue.append(req)
        self.busy_changed(now)

    def promote(self, now: float) -> None:
        while self.queue and len(self.running) < self.max_running:
            self.start(self.queue.popleft(), now)

    def busy_changed(self, now: float) -> None:
        if self.speeds is not None and self.in_flight() and not self.meter.busy:
            self.speeds.busy(self.iid)
        self.meter.set_in_flight(self.in_flight(), now)
        self.lone_meter.set_in_flight(self.in_flight(), now)


@dataclass
class Result:
    label: str
    makespan: float
    moved_tokens: int  # remaining tokens of everything on the preempted instance
    moved_requests: int
    migrations: int
    reprefill_tokens: int  # prompt + made tokens prefilled again because of migrations
    generated: int
    p50: float
    p99: float
    plan_s: float  # CPU seconds spent in TailMigration.plan


def percentile(sorted_xs: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    k = max(0, min(len(sorted_xs) - 1, math.ceil(q / 100 * len(sorted_xs)) - 1))
    return sorted_xs[k]


def make_lengths(args: argparse.Namespace, epoch: int = 0) -> list[int]:
    """Seeded lengths; with ``--group-size G`` > 1, request ``i`` is in group ``i // G`` and (lognormal)
    ``--group-share`` of the log variance is between groups: the samples of one prompt are alike, and
    alike from one ``epoch`` to the next (the same group means, new draws within each group)."""
    rng = random.Random(args.seed)
    out: list[int] = []
    group_mu = 0.0
    share = args.group_share if args.group_size > 1 else 0.0
    within = random.Random(f"{args.seed}/{epoch}") if share else rng
    for i in range(args.requests):
        if share and i % args.group_size == 0:
            group_mu = rng.gauss(math.log(args.median_tokens), args.sigma * math.sqrt(share))
        if args.dist == "lognormal":
            x = within.lognormvariate(group_mu if share else math.log(args.median_tokens),
                                      args.sigma * math.sqrt(1.0 - share))
        else:  # pareto with the given median: x_m * 2**(1/alpha) = median
            xm = args.median_tokens / 2 ** (1 / args.pareto_alpha)
            x = xm * rng.paretovariate(args.pareto_alpha)
        out.append(max(1, min(args.max_new_tokens, round(x))))
    return out


def make_instances(args: argparse.Namespace) -> list[Inst]:
    return [
        Inst(
            iid=f"i{k}",
            speed=args.base_rate * s,
            batch_half=args.batch_half,
            max_running=args.max_running,
            prefill_rate=args.base_rate * s * args.prefill_factor,
            meter=TokenRateMeter(tau_s=args.meter_tau, min_busy_s=args.meter_min_busy),
            lone_meter=TokenRateMeter(tau_s=args.meter_tau, min_busy_s=args.meter_min_busy),
        )
        for k, s in enumerate(args.speeds)
    ]


def preempt_index(args: argparse.Namespace) -> int | None:
    if args.preempt == "none":
        return None
    if args.preempt == "fastest":
        return max(range(len(args.speeds)), key=lambda k: args.speeds[k])
    if args.preempt == "slowest":
        return min(range(len(args.speeds)), key=lambda k: args.speeds[k])
    return int(args.preempt)


def simulate(label: str, policy: PlacementPolicy, lengths: list[int], args: argparse.Namespace,
             t_preempt: float | None, victim: int | None,
             migration: TailMigration | None = None, model: LengthModel | None = None,
             epoch: int = 0, speeds: BoxSpeeds | None = None, affinity: dict[int, str] | None = None) -> Result:
    """One batch. ``model`` and ``speeds``: the length model the makespan policy predicts with and the
    boxes' step models (new ones if None; ones kept from earlier epochs, as the manager keeps them from
    one step to the next, know the prompts' lengths and the boxes); group ``k`` of ``epoch`` is
    ``e{epoch}g{k}``, its prompt the same every epoch. ``affinity``: group -> the box its prompt was first
    placed on, kept across epochs (the manager's affinity table); its samples prefer that box (None: off)."""
    insts = make_instances(args)
    reqs = [Req(i, n, args.max_new_tokens, args.prompt_tokens, group=i // max(args.group_size, 1))
            for i, n in enumerate(lengths)]
    held: deque[Req] = deque(reqs)
    by_id = {i.iid: i for i in insts}
    now, next_tick, next_migrate = 0.0, args.tick, args.migrate_interval
    moved_tokens, moved_requests, finished = 0.0, 0, 0
    migrations, reprefill, plan_s = 0, 0.0, 0.0
    # Every policy reads the boxes' step models learned from their streams, as in the dispatcher. The
    # makespan policy runs as the dispatcher runs it: the length model's predictions, each box's
    # predicted work, the queue longest predicted first, and (pieces > 0) divided rollouts that are
    # placed again at every piece boundary.
    ms = policy if isinstance(policy, Makespan) else None
    pieces = pieces_of(policy)
    model = (model or LengthModel()) if ms is not None else None
    speeds = speeds or BoxSpeeds()  # the dispatcher learns every box's step model, whatever the policy
    for inst in insts:
        inst.speeds = speeds
    if model is not None:
        for r in reqs:
            r.track = model.start(f"e{epoch}g{r.group}", [r.group], str(r.rid), lambda r=r: int(r.done),  # type: ignore[misc]
                                  r.budget)

    def hold(r: Req) -> None:
        """Back to the manager's queue at a piece boundary, predicted again, longest predicted first."""
        assert model is not None and r.track is not None
        r.predicted = model.left(r.track, int(r.done))
        at = len(held)
        while at > 0 and (held[at - 1].predicted or 0.0) < r.predicted:
            at -= 1
        held.insert(at, r)

    def offer() -> None:
        while held:
            alive = [i for i in insts if i.alive]
            r = held[0]
            high = None
            if ms is not None:
                if r.predicted is None and model is not None and r.track is not None:
                    r.predicted = model.left(r.track, int(r.done))
                if model is not None and r.track is not None:
                    high = model.high(r.track, int(r.done))
                prefer = r.prefer
                if prefer is None and affinity is not None and not r.done:  # the manager's affinity table: a
                    prefer = affinity.get(r.group)  # prompt's samples where the first one went (any epoch)
                choice = ms.place([i.load(now) for i in alive], r.budget_left, now, r.predicted, prefer,
                                  r.prompt + int(r.done), high)
            else:
                choice = policy.pick([i.load(now) for i in alive], r.budget_left, now)
            if choice is None:
                return
            inst = by_id.get(choice)
            if inst is None or not inst.alive:
                raise AssertionError(f"{label} picked {choice!r}, not a candidate")
            if r.prefer is not None and choice != r.prefer:
                nonlocal reprefill
                reprefill += r.prompt + int(r.done)
            inst.admit(held.popleft(), now)
            r.prefer = None
            if affinity is not None and not r.done:
                affinity[r.group] = choice
            if ms is not None:
                inst.work.placed(*ms.counted(r.budget_left, r.predicted, high))
            r.piece_end = r.done + pieces if pieces else None

    def predict_left(s: RunningSequence) -> Rest | None:
        """What the manager's migrator asks of a running sequence: the length model's rest (generation)."""
        r = reqs[int(s.seq_id)]
        if model is None or r.track is None:
            return None
        return Rest(model.left(r.track, int(r.done)), model.informed(r.track))

    def migrate() -> None:
        nonlocal migrations, reprefill, plan_s
        assert migration is not None
        alive = [i for i in insts if i.alive]
        where: dict[int, Inst] = {}
        running = []
        for inst in alive:
            for r in list(inst.running) + list(inst.queue):
                where[r.rid] = inst
                running.append(RunningSequence(str(r.rid), inst.iid, int(r.done), r.prompt, r.budget_left,
                                               r.moves, r.last_moved_at, frozenset(r.visited)))
        t0 = time.perf_counter()
        head = held[0].predicted if held else None  # what the head of the dispatcher's queue is predicted to make
        moves = migration.plan([i.load(now) for i in alive], running, len(held), now, (),
                               None if model is None else predict_left, head)
        plan_s += time.perf_counter() - t0
        for mv in moves:
            r = reqs[int(mv.seq_id)]
            src, dst = where[r.rid], by_id[mv.target]
            if mv.target in r.visited or not dst.alive or r.finish is not None:
                raise AssertionError(f"bad move {mv}")
            if ms is not None:
                src.work.ended(src.in_flight())
                dst.work.placed(ms.expected(r.budget_left, r.predicted))
            if r in src.running:
                src.running.remove(r)
                src.promote(now)
            else:
                src.queue.remove(r)
            src.busy_changed(now)
            migrations += 1
            reprefill += r.prompt + int(r.done)
            r.done = float(int(r.done))  # the manager continues from the tokens it has seen
            r.moves += 1
            r.last_moved_at = now
            dst.admit(r, now, args.move_overhead)

    if model is not None:  # the batch arrives at once, each with its prediction: placed longest predicted first
        for r in reqs:
            assert r.track is not None
            r.predicted = model.predict(r.track, 0).median
        queued = sorted(held, key=lambda r: -(r.predicted or 0.0))
        held.clear()
        held.extend(queued)
    offer()
    while finished < len(reqs):
        if held and not any(i.alive and i.in_flight() for i in insts):
            raise RuntimeError(f"{label} holds work while every instance is idle")
        # Next event: a sequence finishes or ends its prefill, a stream tick, a migration tick,
        # or the preemption.
        t_next = next_tick
        if migration is not None:
            t_next = min(t_next, next_migrate)
        if t_preempt is not None and now < t_preempt:
            t_next = min(t_next, t_preempt)
        for inst in insts:
            if inst.alive and inst.running:
                rate = inst.per_seq_rate()
                for r in inst.running:
                    if r.ready_at > now + EPS:
                        t_next = min(t_next, r.ready_at)
                    else:
                        end = r.remaining if r.piece_end is None else min(r.remaining, r.piece_end - r.done)
                        t_next = min(t_next, now + max(end, 0.0) / rate)
        dt = t_next - now
        # Advance: every decoding sequence gains its share; meters see the tokens as a stream would.
        for inst in insts:
            if not (inst.alive and inst.running):
                continue
            rate = inst.per_seq_rate()
            made = 0.0
            for r in inst.running:
                if r.ready_at <= now + EPS:
                    step = min(r.remaining, rate * dt)
                    r.done += step
                    made += step
            inst.carry += made
            whole = int(inst.carry)
            inst.carry -= whole
            inst.meter.observe(whole, t_next)
            inst.lone_meter.observe(whole * lone_rate_weight(inst.in_flight(), args.batch_half), t_next)
            if inst.speeds is not None and whole:
                inst.speeds.observe(inst.iid, whole, inst.in_flight(), t_next)
                inst.work.made(whole, len(inst.running))
        now = t_next
        # Completions and piece ends; the instance promotes from its own queue.
        for inst in insts:
            if not inst.alive:
                continue
            done = [r for r in inst.running if r.remaining <= EPS * max(1, r.length)]
            cut = [r for r in inst.running if r.piece_end is not None and r.piece_end - r.done <= EPS
                   and r not in done]
            if not done and not cut:
                continue
            for r in done:
                inst.work.ended(inst.in_flight())
                r.done, r.finish = float(r.length), now
                inst.running.remove(r)
                finished += 1
                if model is not None and r.track is not None:
                    model.finish(r.track, r.length)
            for r in cut:  # a piece ended: the sequence goes back to the manager to be placed again
                inst.work.ended(inst.in_flight())
                inst.running.remove(r)
                r.done, r.piece_end, r.prefer = float(round(r.done)), None, inst.iid
                hold(r)
            inst.promote(now)
            inst.busy_changed(now)
        if now >= next_tick - EPS:
            next_tick += args.tick
        if t_preempt is not None and victim is not None and abs(now - t_preempt) <= EPS:
            dead = insts[victim]
            dead.alive = False
            lost = dead.running + list(dead.queue)
            moved_tokens += sum(r.remaining for r in lost)
            moved_requests += len(lost)
            for r in lost:
                r.done, r.piece_end, r.prefer = float(int(r.done)), None, None
            dead.running, dead.queue = [], deque()
            held.extendleft(reversed(lost))
            t_preempt = None
            if not any(i.alive for i in insts):
                raise SystemExit("every instance is gone")
        offer()
        if migration is not None and now >= next_migrate - EPS:
            next_migrate += args.migrate_interval
            migrate()

    lat = sorted(r.finish for r in reqs if r.finish is not None)
    return Result(label, now, round(moved_tokens), moved_requests, migrations, round(reprefill),
                  sum(lengths), percentile(lat, 50), percentile(lat, 99), plan_s)


class PiecedMakespan(Makespan):
    """The makespan policy with divided rollouts: each sequence runs ``pieces`` tokens at a time and is
    placed again at every piece boundary (a simulator row; in the manager, divided rollouts are the
    generator's, and the policy the same)."""

    def __init__(self, pieces: int, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.pieces = pieces


def pieces_of(policy: PlacementPolicy) -> int:
    return policy.pieces if isinstance(policy, PiecedMakespan) else 0
