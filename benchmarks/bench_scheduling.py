#!/usr/bin/env python
"""Scheduling policies on a simulated heterogeneous, preemptible rollout pool.

Discrete-event simulation, no GPU, no network. The manager side is the real code
(``rollout_manager.rollout.scheduling``: the policies and ``TokenRateMeter``); the instances are a model:

- continuous batching: an instance running ``n`` sequences produces ``speed * n**beta`` tokens/s in
  total (sublinear growth), shared equally; at most ``max_running`` run, the rest wait in the
  instance's own FIFO queue (as SGLang's waiting queue does);
- speeds differ (default 1:2:3:4 times ``--base-rate`` tokens/s for a lone sequence);
- a batch of requests arrives at t=0 with long-tailed output lengths (seeded lognormal or Pareto),
  each clipped to the request's ``max_new_tokens`` budget; the manager sees only budgets and the
  tokens streamed so far, never the true lengths;
- one instance is preempted mid-batch: its running sequences continue elsewhere from the tokens
  already made (only their remaining tokens move); its queued requests move whole. Moved requests go
  to the front of the manager's queue;
- the manager holds what the policy will not place and offers its queue again on every completion,
  every stream tick and the preemption.

Printed per policy: makespan, the fluid lower bound (total tokens / pool peak throughput, with the
lost instance's share gone after the preemption), their ratio, tokens that had to move, and p50/p99
request latency (all requests arrive at t=0). Deterministic for a given ``--seed``; ``--repeat N``
averages N seeds, since one seed's makespan depends on where its few longest requests land. Not
modelled: prefill, so the re-prefill a continued sequence costs on its new instance is free here.

    .venv/bin/python benchmarks/bench_scheduling.py --seed 0 [--repeat 10] [--preempt slowest]
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout_manager.rollout.scheduling import (
    POLICY_NAMES,
    InstanceLoad,
    Policy,
    TokenRateMeter,
    make_policy,
)

EPS = 1e-9


@dataclass
class Req:
    rid: int
    length: int  # true output length, hidden from the manager
    budget: int  # max_new_tokens
    done: float = 0.0  # tokens generated so far (kept across a continuation)
    finish: float | None = None

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
    beta: float
    max_running: int
    meter: TokenRateMeter
    running: list[Req] = field(default_factory=list)
    queue: deque[Req] = field(default_factory=deque)
    alive: bool = True
    carry: float = 0.0  # fractional tokens not yet reported to the meter

    def throughput(self, n: int) -> float:
        return self.speed * min(n, self.max_running) ** self.beta if n > 0 else 0.0

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
        return InstanceLoad(self.iid, "remote", self.in_flight(), toks, self.meter.rate(now))

    def admit(self, req: Req, now: float) -> None:
        (self.running if len(self.running) < self.max_running else self.queue).append(req)
        self.meter.set_in_flight(self.in_flight(), now)


@dataclass
class Result:
    label: str
    makespan: float
    moved_tokens: int  # remaining tokens of everything on the preempted instance
    moved_queued_tokens: int  # of which: requests it had not started (moved whole)
    moved_requests: int
    p50: float
    p99: float


def percentile(sorted_xs: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    k = max(0, min(len(sorted_xs) - 1, math.ceil(q / 100 * len(sorted_xs)) - 1))
    return sorted_xs[k]


def make_lengths(args: argparse.Namespace) -> list[int]:
    rng = random.Random(args.seed)
    out = []
    for _ in range(args.requests):
        if args.dist == "lognormal":
            x = rng.lognormvariate(math.log(args.median_tokens), args.sigma)
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
            beta=args.beta,
            max_running=args.max_running,
            meter=TokenRateMeter(tau_s=args.meter_tau, min_busy_s=args.meter_min_busy),
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


def fluid_bound(total_tokens: float, peak_all: float, peak_after: float, t_p: float | None) -> float:
    """Time to make all tokens at peak pool throughput, losing one instance's share at t_p."""
    if t_p is None or total_tokens <= peak_all * t_p:
        return total_tokens / peak_all
    return t_p + (total_tokens - peak_all * t_p) / peak_after


def simulate(label: str, policy: Policy, lengths: list[int], args: argparse.Namespace,
             t_preempt: float | None, victim: int | None) -> Result:
    insts = make_instances(args)
    reqs = [Req(i, n, args.max_new_tokens) for i, n in enumerate(lengths)]
    held: deque[Req] = deque(reqs)
    by_id = {i.iid: i for i in insts}
    now, next_tick = 0.0, args.tick
    moved_tokens, moved_queued, moved_requests, finished = 0.0, 0, 0, 0

    def offer() -> None:
        while held:
            alive = [i for i in insts if i.alive]
            choice = policy.pick([i.load(now) for i in alive], held[0].budget_left, now)
            if choice is None:
                return
            inst = by_id.get(choice)
            if inst is None or not inst.alive:
                raise AssertionError(f"{label} picked {choice!r}, not a candidate")
            inst.admit(held.popleft(), now)

    offer()
    while finished < len(reqs):
        if held and not any(i.alive and i.in_flight() for i in insts):
            raise RuntimeError(f"{label} holds work while every instance is idle")
        # Next event: the first sequence to finish, a stream tick, or the preemption.
        t_next = next_tick
        if t_preempt is not None and now < t_preempt:
            t_next = min(t_next, t_preempt)
        for inst in insts:
            if inst.alive and inst.running:
                rate = inst.per_seq_rate()
                t_next = min(t_next, now + min(r.remaining for r in inst.running) / rate)
        dt = t_next - now
        # Advance: every running sequence gains its share; meters see the tokens as a stream would.
        for inst in insts:
            if not (inst.alive and inst.running):
                continue
            rate = inst.per_seq_rate()
            for r in inst.running:
                r.done = min(float(r.length), r.done + rate * dt)
            inst.carry += rate * dt * len(inst.running)
            whole = int(inst.carry)
            inst.carry -= whole
            inst.meter.observe(whole, t_next)
        now = t_next
        # Completions; the instance promotes from its own queue.
        for inst in insts:
            if not inst.alive:
                continue
            done = [r for r in inst.running if r.remaining <= EPS * max(1, r.length)]
            if not done:
                continue
            for r in done:
                r.done, r.finish = float(r.length), now
                inst.running.remove(r)
                finished += 1
            while inst.queue and len(inst.running) < inst.max_running:
                inst.running.append(inst.queue.popleft())
            inst.meter.set_in_flight(inst.in_flight(), now)
        if now >= next_tick - EPS:
            next_tick += args.tick
        if t_preempt is not None and victim is not None and abs(now - t_preempt) <= EPS:
            dead = insts[victim]
            dead.alive = False
            lost = dead.running + list(dead.queue)
            moved_tokens += sum(r.remaining for r in lost)
            moved_queued += sum(r.length for r in dead.queue)
            moved_requests += len(lost)
            dead.running, dead.queue = [], deque()
            held.extendleft(reversed(lost))
            t_preempt = None
            if not any(i.alive for i in insts):
                raise SystemExit("every instance is gone")
        offer()

    lat = sorted(r.finish for r in reqs if r.finish is not None)
    return Result(label, now, round(moved_tokens), moved_queued, moved_requests,
                  percentile(lat, 50), percentile(lat, 99))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=int, default=1,
                   help="average over seeds seed..seed+repeat-1 (one seed's tail is luck)")
    p.add_argument("--requests", type=int, default=512)
    p.add_argument("--speeds", type=lambda s: [float(x) for x in s.split(",")], default=[1, 2, 3, 4],
                   help="relative instance speeds, comma separated (default 1,2,3,4)")
    p.add_argument("--base-rate", type=float, default=25.0, help="tokens/s of a lone sequence at speed 1")
    p.add_argument("--beta", type=float, default=0.85,
                   help="batch throughput exponent: speed * n**beta (0.85: in a batch of 64 a sequence "
                   "runs at 54%% of its lone speed)")
    p.add_argument("--max-running", type=int, default=64, help="sequences one instance runs at once")
    p.add_argument("--dist", choices=("lognormal", "pareto"), default="lognormal")
    p.add_argument("--median-tokens", type=float, default=512)
    p.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma")
    p.add_argument("--pareto-alpha", type=float, default=1.5)
    p.add_argument("--max-new-tokens", type=int, default=4096, help="every request's budget")
    p.add_argument("--preempt", default="fastest", help="fastest | slowest | none | instance index")
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
    return p.parse_args(argv)


def policy_runs(args: argparse.Namespace) -> list[tuple[str, str, dict[str, object]]]:
    """(label, policy name, constructor kwargs) for every row of the table."""
    runs = []
    for name in args.policies.split(","):
        kw: dict[str, object] = {}
        if name == "throughput_aware":
            if args.ta_target_drain is not None:
                kw["target_drain_s"] = args.ta_target_drain
            if args.ta_min_concurrency is not None:
                kw["min_concurrency"] = args.ta_min_concurrency
        runs.append((name + (f"({', '.join(f'{k}={v}' for k, v in kw.items())})" if kw else ""),
                     name, kw))
    if args.lif_cap:
        runs.append((f"least_in_flight(max_in_flight={args.lif_cap})", "least_in_flight",
                     {"max_in_flight": args.lif_cap}))
    return runs


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    insts = make_instances(args)
    victim = preempt_index(args)
    peak_all = sum(i.peak for i in insts)
    peak_after = peak_all - (insts[victim].peak if victim is not None else 0.0)
    seeds = range(args.seed, args.seed + args.repeat)
    # One workload per seed, shared by every policy; the preemption time scales with its size.
    workloads = []
    for seed in seeds:
        lengths = make_lengths(argparse.Namespace(**{**vars(args), "seed": seed}))
        total = float(sum(lengths))
        t_p = args.preempt_frac * total / peak_all if victim is not None else None
        workloads.append((lengths, t_p, fluid_bound(total, peak_all, peak_after, t_p)))

    lengths0, t_p0, _ = workloads[0]
    print(f"pool: speeds {args.speeds} x {args.base_rate:g} tok/s per lone sequence, batch throughput"
          f" speed*n^{args.beta:g} up to {args.max_running} running; peak {peak_all:.0f} tok/s")
    print(f"batch: {args.requests} requests, {args.dist} lengths (median {args.median_tokens:g},"
          f" budget {args.max_new_tokens}), seed {args.seed}: {sum(lengths0)} tokens")
    if victim is not None:
        print(f"preemption: instance i{victim} (speed {args.speeds[victim]:g}) at "
              f"{args.preempt_frac:g} x the fluid bound (t={t_p0:.1f}s for seed {args.seed})")
    print(f"longest request of seed {args.seed} alone on the fastest instance: "
          f"{max(lengths0) / (args.base_rate * max(args.speeds)):.1f}s")
    if args.repeat > 1:
        print(f"figures: means over seeds {seeds.start}..{seeds.stop - 1}")
    print()
    print("| policy | makespan s | fluid bound s | makespan/bound | moved tokens (of which queued) "
          "| moved reqs | p50 latency s | p99 latency s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for label, name, kw in policy_runs(args):
        rows = []
        for lengths, t_p, bound in workloads:
            r = simulate(label, make_policy(name, **kw), lengths, args, t_p, victim)
            rows.append((r.makespan, bound, r.makespan / bound, r.moved_tokens,
                         r.moved_queued_tokens, r.moved_requests, r.p50, r.p99))
        m = [sum(col) / len(rows) for col in zip(*rows)]
        print(f"| {label} | {m[0]:.1f} | {m[1]:.1f} | {m[2]:.2f} | {m[3]:.0f} ({m[4]:.0f}) "
              f"| {m[5]:.0f} | {m[6]:.1f} | {m[7]:.1f} |")


if __name__ == "__main__":
    main()
