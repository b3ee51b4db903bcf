#!/usr/bin/env python
"""Scheduling and tail migration on a simulated heterogeneous, preemptible rollout pool.

Discrete-event simulation, no GPU, no network. The manager side is the real code
(``rollout_manager.placement``: the dispatch policies, ``TokenRateMeter`` and
``TailMigration``); the instances are a model:

- continuous batching with saturating throughput: an instance running ``n`` sequences makes
  ``speed * n / (1 + (n - 1) / batch_half)`` tokens/s in total, shared equally (a lone sequence
  gets ``speed``, each of ``batch_half + 1`` gets half of it, the total saturates at
  ``speed * batch_half``); at most ``max_running`` run, the rest wait in the instance's own FIFO
  queue (as SGLang's waiting queue does);
- prefill: a sequence admitted to an instance first prefills its prompt plus the tokens it already
  made at ``prefill_factor * speed`` tokens/s, holding a running slot but making no token; a moved
  sequence also pays ``move_overhead`` seconds (abort, reconnect). So a continuation is not free;
- speeds differ (default 1:2:3:4 times ``--base-rate`` tokens/s for a lone sequence: a 4x spread);
- a batch of requests arrives at t=0 with long-tailed output lengths (seeded lognormal or Pareto),
  each clipped to the request's ``max_new_tokens`` budget; the manager sees only budgets and the
  tokens streamed so far, never the true lengths;
- one instance may be preempted mid-batch: its running sequences continue elsewhere from the tokens
  already made; its queued requests move whole. Moved requests go to the front of the manager's queue;
- the manager holds what the policy will not place and offers its queue again on every completion,
  every stream tick and the preemption; with tail migration on, every ``--migrate-interval`` it
  asks ``TailMigration.plan`` which running sequences to move, from the instances' measured
  lone-sequence rates (a ``TokenRateMeter`` fed ``tokens * lone_rate_weight(in_flight)``, as the
  dispatcher does) and in-flight counts, and moves them as the generator does (abort, continue).

Bounds: *fluid* = total tokens / pool peak throughput (the lost instance's share gone after the
preemption); *tight* = max(fluid, the longest sequence alone on the fastest instance, prompt
prefill included, moving to the next fastest if that one is preempted first). Printed per policy,
over seeds ``seed..seed+repeat-1``: makespan, both bounds, makespan / tight bound (mean and worst
seed), tokens re-prefilled because of migrations as a fraction of tokens generated, and moves.
Neither bound is reachable on this batch model (a sequence alone runs twice as fast as in a full
batch, and a full pool is what the fluid bound needs). So each scenario also gets:

- *OPT bound*: a lower bound on the makespan of every schedule of the batch, even one that knows
  the lengths (:func:`opt_lower_bound`: the value of a linear relaxation of this batch model, with
  scipy; ``--no-opt-bound`` skips it); makespan / OPT bound is the last column;
- :class:`Clairvoyant`, an *achievable* reference that knows the lengths (longest first, the fastest
  instance at half a batch, real tail migration); a column divides by its makespan. It is one good
  clairvoyant schedule, not the optimum (``--no-clairvoyant`` skips it);
- optionally (``--express-tokens N``) :class:`ExpressLane`, the clairvoyant's placement without its
  knowledge: the fastest instance kept at half a batch, sequences promoted to it once they have made
  N tokens; and ``--order longest-first`` hands every policy the batch in the clairvoyant's order,
  which shows what knowing the order is worth.

The makespan policy (``rollout_manager.placement.makespan``) runs as the dispatcher runs it: every
policy reads the boxes' step models (``box_speed.BoxSpeeds``, fed from the stream ticks); the makespan
rows also use the real length model (``lengths.LengthModel``: each request's group, its siblings'
ends, and with ``--epochs N`` the same prompts' lengths of earlier epochs, the manager's state kept from
one epoch to the next), place the batch longest predicted first, and with ``--pieces`` run divided
rollouts: every ``N`` tokens a sequence goes back to the manager and is placed again (staying is free,
its prefix being cached; a move pays a prefill). ``--group-size 8`` draws GRPO-like lengths, alike
within a group (``--group-share`` of the log variance between groups) and from one epoch to the next.

    .venv/bin/python benchmarks/bench_scheduling.py --scenarios --repeat 5 --group-size 8 --lif-cap 0 \
        --no-opt-bound --pieces 1024 [--epochs 3]                            # the makespan policy
    .venv/bin/python benchmarks/bench_scheduling.py --seed 0 --repeat 10 [--preempt slowest]
    .venv/bin/python benchmarks/bench_scheduling.py --scenarios --repeat 10   # fastest, slowest, none
    .venv/bin/python benchmarks/bench_scheduling.py --plan-cost               # plan() CPU time, 1k instances
    .venv/bin/python benchmarks/bench_scheduling.py --scenarios --express-tokens 800 [--order longest-first]
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from schedule_bounds import fluid_bound, longest_alone_bound, opt_lower_bound
from sim_pool import PiecedMakespan, make_instances, make_lengths, preempt_index, simulate

from rollout_manager.placement.box_speed import BoxSpeeds
from rollout_manager.placement.instance_load import InstanceLoad
from rollout_manager.placement.lengths import LengthModel
from rollout_manager.placement.makespan import Makespan
from rollout_manager.placement.policy import PlacementPolicy
from rollout_manager.placement.policy_registry import POLICY_NAMES, make_policy
from rollout_manager.placement.tail_migration import Move, RunningSequence, TailMigration


class Clairvoyant:
    """A reference schedule, not a policy the manager can run: it knows the true lengths.

    The simulator hands it the batch longest first; it fills every instance up to ``max_running``
    except the fastest, which it keeps at half that, so the longest sequences run there at well
    over the full-batch speed (at ``batch_half`` = ``max_running`` = 64, 32 sequences each get 2/3
    of the lone speed instead of 1/2). Run with the real ``TailMigration``. One good clairvoyant
    schedule, not the optimum: it shows what knowing the lengths is worth on this batch model.
    """

    name = "clairvoyant"

    def __init__(self, speeds: list[float], max_running: int) -> None:
        fastest = max(range(len(speeds)), key=lambda k: speeds[k])
        self.caps = {f"i{k}": max(1, max_running // 2) if k == fastest else max_running
                     for k in range(len(speeds))}
        self.speed = {f"i{k}": s for k, s in enumerate(speeds)}

    def pick(self, candidates: Sequence[InstanceLoad], request_tokens: int, now: float) -> str | None:
        open_ = [c for c in candidates if c.in_flight_requests < self.caps[c.instance_id]]
        if not open_:
            return None
        return max(open_, key=lambda c: (self.speed[c.instance_id], -c.in_flight_requests)).instance_id


class ExpressLane(Clairvoyant):
    """The clairvoyant's placement without its knowledge (a reference, not a manager policy).

    New work is placed as :class:`Clairvoyant` places it (the fastest instance kept at half a
    batch), but in the order it arrives; :class:`ExpressPromotion` then moves sequences to the
    fastest instance once they have run long (up to 5/8 of ``max_running`` there). Under long-tailed
    lengths a sequence that has made many tokens is likely to make many more, so this is the online
    stand-in for "longest first".
    """

    name = "express_lane"


class ExpressPromotion(TailMigration):
    """While requests wait: move sequences that have made ``promote_tokens`` (oldest first) to the
    fastest instance, up to ``cap`` sequences there; once nothing waits, plain tail migration."""

    def __init__(self, express: str, cap: int, promote_tokens: int, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.express, self.cap, self.promote_tokens = express, cap, promote_tokens

    def plan(self, instances: Sequence[InstanceLoad], running: Sequence[RunningSequence], waiting: int,
             now: float, draining: Collection[str] = ()) -> list[Move]:
        if waiting == 0:
            return super().plan(instances, running, waiting, now, draining)
        there = next((c.in_flight_requests for c in instances if c.instance_id == self.express), None)
        if there is None:
            return []
        moves = []
        for s in sorted(running, key=lambda s: -s.made):
            if there >= self.cap or s.made < self.promote_tokens:
                break
            if s.instance_id != self.express and self.express not in s.visited and s.moves < self.max_moves:
                moves.append(Move(s.seq_id, s.instance_id, self.express, 0.0))
                there += 1
        return moves


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=int, default=1,
                   help="seeds seed..seed+repeat-1: mean and worst seed (one seed's tail is luck)")
    p.add_argument("--requests", type=int, default=512)
    p.add_argument("--speeds", type=lambda s: [float(x) for x in s.split(",")], default=[1, 2, 3, 4],
                   help="relative instance speeds, comma separated (default 1,2,3,4)")
    p.add_argument("--base-rate", type=float, default=25.0, help="tokens/s of a lone sequence at speed 1")
    p.add_argument("--batch-half", type=float, default=64.0,
                   help="batch size past which a sequence runs at under half its lone speed: "
                   "throughput speed*n/(1+(n-1)/batch_half)")
    p.add_argument("--max-running", type=int, default=64, help="sequences one instance runs at once")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--prefill-factor", type=float, default=200.0,
                   help="prefill tokens/s as a multiple of the instance's lone decode tokens/s")
    p.add_argument("--move-overhead", type=float, default=0.3, help="seconds a migration costs besides prefill")
    p.add_argument("--dist", choices=("lognormal", "pareto"), default="lognormal")
    p.add_argument("--median-tokens", type=float, default=512)
    p.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma")
    p.add_argument("--pareto-alpha", type=float, default=1.5)
    p.add_argument("--max-new-tokens", type=int, default=4096, help="every request's budget")
    p.add_argument("--epochs", type=int, default=1,
                   help="makespan rows: run this many epochs of the same prompts and report the last (the "
                   "length model keeps what earlier epochs showed; --group-size > 1 for lengths alike by prompt)")
    p.add_argument("--group-size", type=int, default=1,
                   help="samples per GRPO group (one prompt); lengths correlate within a group (1: none)")
    p.add_argument("--group-share", type=float, default=0.7,
                   help="with --group-size > 1: the share of the log-length variance that is between groups")
    p.add_argument("--pieces", type=lambda s: [int(x) for x in s.split(",") if x], default=[512],
                   help="makespan rows with divided rollouts of N tokens per piece, comma separated "
                   "(empty: none); a row without pieces is always run")
    p.add_argument("--preempt", default="fastest", help="fastest | slowest | none | instance index")
    p.add_argument("--scenarios", action="store_true",
                   help="run preempt fastest, slowest and none; one summary table")
    p.add_argument("--preempt-frac", type=float, default=0.5,
                   help="preemption time as a fraction of the no-preemption fluid bound")
    p.add_argument("--tick", type=float, default=0.25, help="stream observation interval, s")
    p.add_argument("--meter-tau", type=float, default=5.0)
    p.add_argument("--meter-min-busy", type=float, default=1.0)
    p.add_argument("--policies", default=",".join(POLICY_NAMES))
    p.add_argument("--lif-cap", type=int, default=64,
                   help="also run least_in_flight(max_in_flight=N): holding without rates; 0: skip")
    p.add_argument("--ta-target-drain", type=float, default=None)
    p.add_argument("--ta-min-concurrency", type=int, default=None)
    p.add_argument("--migration", choices=("both", "on", "off"), default="both",
                   help="run each policy without and/or with TailMigration")
    p.add_argument("--migrate-interval", type=float, default=1.0, help="seconds between two plans")
    p.add_argument("--tm-batch-half", type=float, default=None,
                   help="the policy's batch_half (default: the simulated one; set it to test a wrong guess)")
    p.add_argument("--tm-min-speedup", type=float, default=None)
    p.add_argument("--tm-min-gain", type=float, default=None)
    p.add_argument("--tm-prefill-factor", type=float, default=None)
    p.add_argument("--tm-max-moves", type=int, default=None)
    p.add_argument("--tm-cooldown", type=float, default=None)
    p.add_argument("--tm-tail-share", type=float, default=1.0,
                   help="where lengths are predicted, a sequence predicted to end before this share of the "
                   "step's predicted end stays (the manager's tail_migration_tail_share; 0: by age alone)")
    p.add_argument("--tm-tail-slowdown", type=float, default=1.3,
                   help="a sequence predicted from evidence moves only where it runs within this factor of a lone "
                   "sequence's speed (the manager's tail_migration_tail_slowdown; 0: no such bound)")
    p.add_argument("--no-clairvoyant", dest="clairvoyant", action="store_false",
                   help="skip the clairvoyant reference row (knows lengths; see Clairvoyant)")
    p.add_argument("--no-opt-bound", dest="opt_bound", action="store_false",
                   help="skip the lower bound on any schedule's makespan (see opt_lower_bound)")
    p.add_argument("--express-tokens", type=int, default=0,
                   help="also run the express-lane reference, promoting after N tokens (see ExpressLane); 0: skip")
    p.add_argument("--order", choices=("arrival", "longest-first"), default="arrival",
                   help="the order the batch is handed to every policy (longest-first: the clairvoyant's)")
    p.add_argument("--plan-cost", action="store_true",
                   help="only time TailMigration.plan on 1,000 instances and 20,000 sequences")
    return p.parse_args(argv)


def migration_kwargs(args: argparse.Namespace) -> dict[str, object]:
    kw: dict[str, object] = {"batch_half": args.tm_batch_half or args.batch_half}
    for key, name in (("tm_min_speedup", "min_speedup"), ("tm_min_gain", "min_gain_s"),
                      ("tm_prefill_factor", "prefill_factor"), ("tm_max_moves", "max_moves"),
                      ("tm_cooldown", "cooldown_s"), ("tm_tail_share", "tail_share")):
        if getattr(args, key) is not None:
            kw[name] = getattr(args, key)
    if getattr(args, "tm_tail_slowdown", 0):
        kw["tail_slowdown"] = args.tm_tail_slowdown
    return kw


def policy_runs(args: argparse.Namespace) -> list[tuple[str, str, dict[str, object], bool]]:
    """(label, policy name, constructor kwargs, tail migration) for every row of the table."""
    base = []
    for name in args.policies.split(","):
        kw: dict[str, object] = {}
        if name == "throughput_aware":
            if args.ta_target_drain is not None:
                kw["target_drain_s"] = args.ta_target_drain
            if args.ta_min_concurrency is not None:
                kw["min_concurrency"] = args.ta_min_concurrency
        base.append((name + (f"({', '.join(f'{k}={v}' for k, v in kw.items())})" if kw else ""), name, kw))
    if args.lif_cap:
        base.append((f"least_in_flight(max_in_flight={args.lif_cap})", "least_in_flight",
                     {"max_in_flight": args.lif_cap}))
    if "makespan" in args.policies.split(","):
        base = [(label, name, {"max_in_flight": args.max_running} if name == "makespan" else kw)
                for label, name, kw in base]  # the dispatcher's bound: an instance's max_running_requests
        base += [(f"makespan, pieces of {n} tokens", "makespan_pieces",
                  {"max_in_flight": args.max_running, "pieces": n}) for n in args.pieces]
    modes = {"both": (False, True), "on": (True,), "off": (False,)}[args.migration]
    return [(label + (" + tail migration" if m else ""), name, kw, m) for label, name, kw in base for m in modes]


@dataclass
class Row:
    label: str
    makespan: float
    fluid: float
    tight: float
    ratio_mean: float
    ratio_worst: float
    reprefill_frac: float
    migrations: float
    moved_tokens: float
    p50: float
    p99: float
    plan_ms: float
    vs_clairvoyant: float | None  # mean over seeds of makespan / the clairvoyant reference's
    vs_opt: float | None  # mean over seeds of makespan / the lower bound on any schedule's


def run_scenario(args: argparse.Namespace) -> tuple[list[Row], dict[str, float]]:
    insts = make_instances(args)
    victim = preempt_index(args)
    peak_all = sum(i.peak for i in insts)
    peak_after = peak_all - (insts[victim].peak if victim is not None else 0.0)
    seeds = range(args.seed, args.seed + args.repeat)
    # One workload per seed, shared by every policy; the preemption time scales with its size.
    workloads = []
    for seed in seeds:
        lengths = make_lengths(argparse.Namespace(**{**vars(args), "seed": seed}), args.epochs - 1)
        total = float(sum(lengths))
        t_p = args.preempt_frac * total / peak_all if victim is not None else None
        fluid = fluid_bound(total, peak_all, peak_after, t_p)
        tight = max(fluid, longest_alone_bound(max(lengths), args, victim, t_p))
        workloads.append((lengths, t_p, fluid, tight))
    # Both bounds hold for every schedule, so their maximum does too.
    opt = [max(tight, lp) if args.opt_bound and (lp := opt_lower_bound(lengths, args, victim, t_p)) else None
           for lengths, t_p, _, tight in workloads]
    info = {"peak": peak_all, "tokens": float(sum(workloads[0][0])),
            "t_p": workloads[0][1] or 0.0, "longest": float(max(workloads[0][0]))}
    if all(o is not None for o in opt):
        over = [o / w[3] for o, w in zip(opt, workloads) if o is not None]
        info |= {"opt": sum(o for o in opt if o is not None) / len(over),
                 "opt_vs_tight": sum(over) / len(over), "opt_vs_tight_max": max(over)}
    runs: list[tuple[str, str | None, dict[str, object], bool]] = list(policy_runs(args))
    if args.express_tokens:
        runs.insert(0, (f"express lane (fastest at half a batch; promoted after {args.express_tokens} tokens)"
                        " + tail migration", "express", {}, True))
    if args.clairvoyant:  # first, so every other row can be divided by it
        runs.insert(0, ("clairvoyant reference (knows lengths; not a real policy) + tail migration",
                        None, {}, True))
    fastest = f"i{max(range(len(args.speeds)), key=lambda k: args.speeds[k])}"
    rows: list[Row] = []
    clair: list[float] | None = None
    for label, name, kw, migrate in runs:
        res = []
        for seed, (lengths, t_p, fluid, tight) in zip(seeds, workloads):
            mig = TailMigration(**migration_kwargs(args)) if migrate else None  # type: ignore[arg-type]
            if args.order == "longest-first" or name is None:
                lengths = sorted(lengths, reverse=True)
            if name is None:
                pol: PlacementPolicy = Clairvoyant(args.speeds, args.max_running)
            elif name == "express":
                pol = ExpressLane(args.speeds, args.max_running)
                mig = ExpressPromotion(fastest, args.max_running // 2 + args.max_running // 8, args.express_tokens,
                                       **migration_kwargs(args))
            elif name == "makespan_pieces":
                pol = PiecedMakespan(**kw)  # type: ignore[arg-type]
            else:
                pol = make_policy(name, **kw)
            model, speeds = None, None
            if isinstance(pol, Makespan) and args.epochs > 1:  # earlier epochs of the same prompts, then this one
                model, speeds = LengthModel(), BoxSpeeds()
                sargs = argparse.Namespace(**{**vars(args), "seed": seed})
                for e in range(args.epochs - 1):
                    simulate(label, pol, make_lengths(sargs, e), args, t_p, victim,
                             TailMigration(**migration_kwargs(args)) if migrate else None,  # type: ignore[arg-type]
                             model, e, speeds)
            r = simulate(label, pol, lengths, args, t_p, victim, mig, model, args.epochs - 1,
                         speeds if model is not None else None)
            res.append((r, fluid, tight))
        k = len(res)
        if name is None:
            clair = [r.makespan for r, _, _ in res]
        ratios = [r.makespan / tight for r, _, tight in res]
        rows.append(Row(
            label, sum(r.makespan for r, _, _ in res) / k, sum(f for _, f, _ in res) / k,
            sum(t for _, _, t in res) / k, sum(ratios) / k, max(ratios),
            sum(r.reprefill_tokens for r, _, _ in res) / sum(r.generated for r, _, _ in res),
            sum(r.migrations for r, _, _ in res) / k, sum(r.moved_tokens for r, _, _ in res) / k,
            sum(r.p50 for r, _, _ in res) / k, sum(r.p99 for r, _, _ in res) / k,
            1000 * max(r.plan_s / max(1, math.ceil(r.makespan / args.migrate_interval)) for r, _, _ in res),
            sum(r.makespan / c for (r, _, _), c in zip(res, clair)) / k if clair else None,
            sum(r.makespan / o for (r, _, _), o in zip(res, opt) if o) / k if "opt" in info else None,
        ))
    return rows, info


def print_rows(rows: list[Row], scenario: str | None = None) -> None:
    head = "| preempted " if scenario is not None else ""
    print(head + "| policy | makespan s | fluid bound s | tight bound s | makespan/tight mean | worst seed "
          "| re-prefilled / generated | migrations | p50 s | p99 s | makespan/clairvoyant | makespan/OPT bound |")
    print(("| --- " if scenario is not None else "") + "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
          "| ---: | ---: | ---: | ---: |")
    for r in rows:
        print((f"| {scenario} " if scenario is not None else "") +
              f"| {r.label} | {r.makespan:.1f} | {r.fluid:.1f} | {r.tight:.1f} | {r.ratio_mean:.2f} "
              f"| {r.ratio_worst:.2f} | {100 * r.reprefill_frac:.2f}% | {r.migrations:.0f} | {r.p50:.1f} "
              f"| {r.p99:.1f} | {'-' if r.vs_clairvoyant is None else f'{r.vs_clairvoyant:.2f}'} "
              f"| {'-' if r.vs_opt is None else f'{r.vs_opt:.2f}'} |")


def plan_cost(args: argparse.Namespace) -> None:
    """CPU time of one plan at the scale of a large pool, in the worst case (every sequence a candidate)."""
    rng = random.Random(args.seed)
    n_inst, n_seq = 1000, 20000
    loads = [InstanceLoad(f"i{k}", "remote", 0, 0, 1000.0, rng.uniform(20, 100)) for k in range(n_inst)]
    running = []
    for k in range(n_seq):
        inst = loads[rng.randrange(n_inst // 2)]  # half the pool busy, half idle: many candidates
        inst.in_flight_requests += 1
        running.append(RunningSequence(f"s{k}", inst.instance_id, rng.randrange(1, 4000), 512, 4096))
    tm = TailMigration(batch_half=args.batch_half)
    times, moves = [], 0
    for _ in range(5):
        t0 = time.perf_counter()
        moves = len(tm.plan(loads, running, 0, 100.0))
        times.append(time.perf_counter() - t0)
    print(f"TailMigration.plan on {n_inst} instances, {n_seq} running sequences: "
          f"{1000 * min(times):.1f} ms (best of 5), {moves} moves planned")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.plan_cost:
        plan_cost(args)
        return
    scenarios = ["fastest", "slowest", "none"] if args.scenarios else [args.preempt]
    insts = make_instances(args)
    peak = sum(i.peak for i in insts)
    print(f"pool: speeds {args.speeds} x {args.base_rate:g} tok/s per lone sequence, batch throughput"
          f" speed*n/(1+(n-1)/{args.batch_half:g}) up to {args.max_running} running; peak {peak:.0f} tok/s;"
          f" prefill {args.prefill_factor:g}x the lone decode rate, {args.prompt_tokens}-token prompts,"
          f" {args.move_overhead:g}s per move")
    print(f"batch: {args.requests} requests, {args.dist} lengths (median {args.median_tokens:g},"
          f" budget {args.max_new_tokens}); seeds {args.seed}..{args.seed + args.repeat - 1}"
          f" (figures: mean over seeds; worst seed of makespan/tight)"
          + ("; handed to the policies longest first" if args.order == "longest-first" else ""))
    if args.migration != "off":
        print(f"tail migration: every {args.migrate_interval:g}s, TailMigration({migration_kwargs(args)})")
    for scenario in scenarios:
        sargs = argparse.Namespace(**{**vars(args), "preempt": scenario})
        rows, info = run_scenario(sargs)
        print()
        where = (f"preempted: {scenario} at {args.preempt_frac:g} x the fluid bound (t={info['t_p']:.1f}s "
                 f"for seed {args.seed})" if scenario != "none" else "no preemption")
        print(f"{where}; seed {args.seed}: {info['tokens']:.0f} tokens, longest {info['longest']:.0f}")
        if "opt" in info:
            print(f"lower bound on any schedule's makespan (OPT bound, lengths known): {info['opt']:.1f} s, "
                  f"{info['opt_vs_tight']:.3f}x the tight bound (largest over seeds {info['opt_vs_tight_max']:.3f}x)")
        print()
        print_rows(rows)


if __name__ == "__main__":
    main()
