#!/usr/bin/env python
"""Multi-turn affinity on a simulated pool with a prefix cache per instance.

Time-stepped simulation, no GPU, no network. The manager side is the real code: the dispatch
policies of ``rollout_manager.placement`` (with ``TokenRateMeter`` rates) and the affinity
table and overload rule of ``rollout_manager.placement.affinity`` (``AffinityTable.lookup/placed/
finished``, ``overloaded``), applied as ``Dispatcher.try_acquire`` applies them. The instances are a
model:

- 4 instances, lone-sequence decode speed 1:2:3:4 times ``--base-rate`` tokens/s; n running sequences
  share ``speed * n / (1 + (n - 1) / batch_half)`` tokens/s; at most ``max_running`` run, the rest
  wait in the instance's FIFO;
- prefill at ``prefill_factor * speed`` tokens/s takes the instance's time (decode pauses for it, as a
  prefill step does), so re-prefilling a long context costs every sequence there;
- a prefix cache per instance (LRU, ``--cache-tokens``): a turn whose trajectory's previous context is
  cached there prefills only its new tokens; a GRPO sample whose group's prompt is cached prefills
  only what follows the prompt (nothing, on its first turn);
- the workload: ``--groups`` prompts x ``--n`` samples, each a ``--turns``-turn trajectory: turn k+1's
  input is turn k's input + output + a tool reply, sent after a tool latency; output lengths are
  lognormal, clipped to the budget. Everything starts at t=0; the step ends when the last turn ends.

Runs, same workload: round robin, the default policy without affinity, and the default policy with
affinity keyed by trajectory (what the verl plugin sends) and keyless (prefix-hash fallback).
Printed: makespan, prefill tokens (and saved against round robin and against the default policy
without affinity), affinity hits / misses / fallbacks, mean and worst seed over ``--repeat`` seeds.

    .venv/bin/python benchmarks/bench_affinity.py --seed 0 --repeat 5
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout_manager.placement.affinity import AffinityKeys, AffinitySettings, AffinityTable, overloaded
from rollout_manager.placement.instance_load import InstanceLoad
from rollout_manager.placement.policy import PlacementPolicy
from rollout_manager.placement.policy_registry import make_policy
from rollout_manager.placement.rate_meter import TokenRateMeter


@dataclass
class Turn:
    traj: int
    group: int
    k: int
    input_ids: list[int]
    prompt_len: int
    length: int  # true output length (hidden from the manager)
    budget: int
    keys: AffinityKeys | None = None
    prefill_left: float = 0.0
    done: float = 0.0
    inst: Inst | None = None

    @property
    def budget_left(self) -> int:
        return self.budget - int(self.done)


@dataclass
class Inst:
    iid: str
    speed: float
    batch_half: float
    max_running: int
    prefill_rate: float
    cache_tokens: int
    meter: TokenRateMeter = field(default_factory=TokenRateMeter)
    running: list[Turn] = field(default_factory=list)
    queue: deque[Turn] = field(default_factory=deque)
    cache: OrderedDict[tuple[str, int], int] = field(default_factory=OrderedDict)  # key -> cached tokens

    def in_flight(self) -> int:
        return len(self.running) + len(self.queue)

    def load(self, now: float) -> InstanceLoad:
        toks = sum(t.budget_left for t in self.running) + sum(t.budget_left for t in self.queue)
        return InstanceLoad(self.iid, "remote", self.in_flight(), toks, self.meter.rate(now))

    def cached(self, turn: Turn) -> int:
        """Prefix tokens of ``turn`` already in this instance's cache."""
        hit = 0
        for key in (("t", turn.traj), ("g", turn.group)):
            if key in self.cache:
                self.cache.move_to_end(key)
                hit = max(hit, self.cache[key])
        return min(hit, len(turn.input_ids))

    def remember(self, key: tuple[str, int], tokens: int) -> None:
        self.cache[key] = tokens
        self.cache.move_to_end(key)
        while sum(self.cache.values()) > self.cache_tokens and len(self.cache) > 1:
            self.cache.popitem(last=False)

    def admit(self, turn: Turn, now: float) -> int:
        """Queue ``turn`` here; returns the tokens it will prefill."""
        turn.inst = self
        turn.prefill_left = len(turn.input_ids) - self.cached(turn)
        self.remember(("g", turn.group), turn.prompt_len)
        self.queue.append(turn)
        self.meter.set_in_flight(self.in_flight(), now)
        return int(turn.prefill_left)

    def step(self, now: float, dt: float) -> list[Turn]:
        """Advance ``dt`` seconds; returns the turns that finished."""
        while self.queue and len(self.running) < self.max_running:
            self.running.append(self.queue.popleft())
        budget = dt
        for t in self.running:  # prefills first, in arrival order: decode waits for them
            if t.prefill_left > 0 and budget > 0:
                used = min(budget, t.prefill_left / self.prefill_rate)
                t.prefill_left -= used * self.prefill_rate
                budget -= used
        decoding = [t for t in self.running if t.prefill_left <= 1e-9]
        finished: list[Turn] = []
        made = 0.0
        if decoding and budget > 0:
            n = len(decoding)
            each = self.speed / (1 + (n - 1) / self.batch_half) * budget
            for t in decoding:
                step = min(each, t.length - t.done)
                t.done += step
                made += step
                if t.done >= t.length - 1e-9:
                    finished.append(t)
        self.meter.observe(made, now + dt)
        for t in finished:
            self.running.remove(t)
            self.remember(("t", t.traj), len(t.input_ids) + t.length)
        if finished:
            self.meter.set_in_flight(self.in_flight(), now + dt)
        return finished


@dataclass
class Outcome:
    label: str
    makespan: float
    prefill: int
    hits: int = 0
    misses: int = 0
    fallbacks: int = 0


def workload(args: argparse.Namespace, seed: int) -> list[list[tuple[int, int, int]]]:
    """Per trajectory, per turn: (output length, tool reply tokens, tool latency in ms)."""
    rng = random.Random(seed)
    out = []
    for _ in range(args.groups * args.n):
        turns = []
        for _ in range(args.turns):
            length = max(1, min(args.max_new_tokens, round(rng.lognormvariate(math.log(args.median_tokens),
                                                                               args.sigma))))
            turns.append((length, rng.randint(50, 400), rng.randint(500, 3000)))
        out.append(turns)
    return out


def simulate(args: argparse.Namespace, seed: int, policy_name: str, affinity: str) -> Outcome:
    rng = random.Random(seed + 1)
    plan = workload(args, seed)
    prompts = [[rng.randrange(50_000) for _ in range(rng.randint(args.prompt_min, args.prompt_max))]
               for _ in range(args.groups)]
    policy: PlacementPolicy = make_policy(policy_name)
    insts = [Inst(f"i{k}", args.base_rate * s, args.batch_half, args.max_running,
                  args.base_rate * s * args.prefill_factor, args.cache_tokens) for k, s in enumerate(args.speeds)]
    by_id = {i.iid: i for i in insts}
    table = AffinityTable(AffinitySettings(max_slowdown=args.max_slowdown)) if affinity != "off" else None
    label = f"{policy_name}{'' if table is None else ' + affinity (' + affinity + ')'}"
    result = Outcome(label, 0.0, 0)
    contexts = {j: list(prompts[j // args.n]) for j in range(len(plan))}
    waiting: deque[Turn] = deque()
    arrivals: list[tuple[float, int, int]] = [(0.0, j, 0) for j in range(len(plan))]  # (time, traj, turn)
    out_rng = random.Random(seed + 2)
    now, dt, left = 0.0, args.dt, len(plan) * args.turns

    def make_turn(j: int, k: int) -> Turn:
        length = plan[j][k][0]
        turn = Turn(j, j // args.n, k, list(contexts[j]), len(prompts[j // args.n]), length, args.max_new_tokens)
        if table is not None:
            turn.keys = table.keys(turn.input_ids, f"traj-{j}" if affinity == "key" else None)
        return turn

    def place() -> None:
        for _ in range(len(waiting)):
            turn = waiting.popleft()
            loads = [i.load(now) for i in insts]
            tokens = turn.budget
            prefer = table.lookup(turn.keys) if table is not None and turn.keys is not None else None
            chosen: str | None = None
            if prefer is not None and prefer in by_id:
                mine = next(c for c in loads if c.instance_id == prefer)
                if not overloaded(mine, loads, tokens, policy, table.settings.max_slowdown if table else 2.0):
                    chosen = prefer
            if chosen is None:
                chosen = policy.pick(loads, tokens, now)
            if chosen is None:
                waiting.append(turn)
                continue
            if table is not None and turn.keys is not None:
                if prefer is None:
                    result.misses += 1
                elif prefer == chosen:
                    result.hits += 1
                else:
                    result.fallbacks += 1
                table.placed(turn.keys, chosen)
            result.prefill += by_id[chosen].admit(turn, now)

    while left:
        due = [a for a in arrivals if a[0] <= now + 1e-9]
        if due:
            arrivals = [a for a in arrivals if a[0] > now + 1e-9]
            waiting.extend(make_turn(j, k) for _, j, k in due)
        place()
        for inst in insts:
            for turn in inst.step(now, dt):
                left -= 1
                made = [out_rng.randrange(50_000) for _ in range(turn.length)]
                if table is not None and turn.keys is not None:
                    table.finished(turn.keys, made, inst.iid)
                length, tool, latency_ms = plan[turn.traj][turn.k]
                contexts[turn.traj] = turn.input_ids + made + [out_rng.randrange(50_000) for _ in range(tool)]
                if turn.k + 1 < args.turns:
                    arrivals.append((now + dt + latency_ms / 1000.0, turn.traj, turn.k + 1))
        now += dt
    result.makespan = now
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--n", type=int, default=4, help="GRPO samples per prompt")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--speeds", type=float, nargs="+", default=[1, 2, 3, 4])
    p.add_argument("--base-rate", type=float, default=20.0, help="lone-sequence tokens/s of the slowest")
    p.add_argument("--batch-half", type=float, default=64.0)
    p.add_argument("--max-running", type=int, default=64)
    p.add_argument("--prefill-factor", type=float, default=100.0, help="prefill tokens/s per decode token/s")
    p.add_argument("--cache-tokens", type=int, default=400_000, help="prefix cache per instance")
    p.add_argument("--prompt-min", type=int, default=1000)
    p.add_argument("--prompt-max", type=int, default=3000)
    p.add_argument("--median-tokens", type=float, default=200.0)
    p.add_argument("--sigma", type=float, default=0.8)
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument("--max-slowdown", type=float, default=2.0, help="affinity_max_slowdown")
    p.add_argument("--dt", type=float, default=0.05)
    args = p.parse_args()

    runs = [("round_robin", "off"), ("throughput_aware", "off"), ("throughput_aware", "key"),
            ("throughput_aware", "prefix"), ("round_robin", "key")]
    table: dict[str, list[Outcome]] = {}
    for s in range(args.seed, args.seed + args.repeat):
        for policy, aff in runs:
            o = simulate(args, s, policy, aff)
            table.setdefault(o.label, []).append(o)
    rr = [o.prefill for o in table["round_robin"]]
    ta = [o.prefill for o in table["throughput_aware"]]
    print(f"{args.groups} prompts x {args.n} samples x {args.turns} turns on {len(args.speeds)} instances "
          f"(speeds {args.speeds}), seeds {args.seed}..{args.seed + args.repeat - 1}")
    print(f"{'run':42} {'makespan s (mean/worst)':>24} {'prefill Mtok':>12} {'saved vs RR':>12} "
          f"{'saved vs TA':>12} {'hits/miss/fallb':>16}")
    for label, outs in table.items():
        span = [o.makespan for o in outs]
        pre = [o.prefill for o in outs]
        saved_rr = statistics.mean(1 - a / b for a, b in zip(pre, rr))
        saved_ta = statistics.mean(1 - a / b for a, b in zip(pre, ta))
        hits = f"{sum(o.hits for o in outs)}/{sum(o.misses for o in outs)}/{sum(o.fallbacks for o in outs)}"
        print(f"{label:42} {statistics.mean(span):11.1f} /{max(span):9.1f}   {statistics.mean(pre) / 1e6:10.2f} "
              f"{saved_rr:11.1%} {saved_ta:12.1%} {hits:>16}")


if __name__ == "__main__":
    main()
