#!/usr/bin/env python
"""What one placement costs the manager: ``Dispatcher.try_acquire`` over a pool of N active instances.

Every sequence the manager starts is placed by one call that reads the whole pool (the policy compares
every instance's measured rate and reserved tokens), so at a thousand instances this is a large part of
the manager's CPU per sequence, and thousands of sequences placed in one event-loop turn block the loop
for that long. The measurement is in-process, no network: a registry of N active instances, half of them
with a measured token rate (they streamed for a while), then ``--sequences`` placements of
``--tokens``-token sequences in a row, optionally each with an affinity preference.

``--baseline REV`` runs the same measurement on the package as it was at git revision REV (extracted
to a temporary directory) in the same run, alternating with this one, and prints the ratio.

    .venv/bin/python benchmarks/bench_placement.py                         # 100 and 1,000 instances
    .venv/bin/python benchmarks/bench_placement.py --baseline main~3
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def measure(instances: int, sequences: int, tokens: int, prefer: bool) -> float:
    """Microseconds per placement, with the package found first on sys.path."""
    from rollout_manager.instances.instance import Kind, State
    from rollout_manager.instances.registry import Registry
    from rollout_manager.placement.ask import Ask
    from rollout_manager.placement.dispatch import Dispatcher
    from rollout_manager.placement.policy_registry import DEFAULT_POLICY, make_policy

    clock = [0.0]  # the dispatcher's clock, moved by hand: the same rates and decay in every run
    registry = Registry(clock=lambda: clock[0])
    pool = registry.add_many([("127.0.0.1", 20000 + k, Kind.REMOTE, None) for k in range(instances)])
    for inst in pool:
        registry.transition(inst, State.ACTIVE, "benchmark")
    dispatcher = Dispatcher(registry, make_policy(DEFAULT_POLICY), clock=lambda: clock[0],
                            max_in_flight_total=10 * sequences)
    dispatcher.enable_affinity()
    for k, inst in enumerate(pool[::2]):  # half the pool measured (2 s busy), the rest still probes
        meter = dispatcher.fleet.meter(inst)
        meter.set_in_flight(1, 0.0)
        meter.observe(20_000.0 + k, 2.0)  # about 10,000 tokens/s: room for hundreds each
        meter.set_in_flight(0, 2.0)
    clock[0] = 2.0
    step = 1e-5  # the clock moves 10 us a placement, so rates are recomputed as they would be
    started = time.perf_counter()
    for k in range(sequences):
        clock[0] += step
        chosen = dispatcher.try_acquire(Ask(tokens, prefer=pool[k % instances].id if prefer else None))
        assert chosen is not None, "the pool ran out of room: lower --sequences"
    return 1e6 * (time.perf_counter() - started) / sequences


def run_all(args: argparse.Namespace) -> dict[str, float]:
    out = {}
    for n in args.instances:
        for prefer in (False, True):
            out[f"{n:,} instances{', affinity preference' if prefer else ''}"] = min(
                measure(n, args.sequences, args.tokens, prefer) for _ in range(args.repeat))
    return out


def baseline(rev: str, argv: list[str]) -> dict[str, float]:
    """The same measurement on the package at ``rev``, in a subprocess that imports it from a copy."""
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "archive", rev, "rollout_manager"], cwd=ROOT, check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        res = subprocess.run([sys.executable, __file__, "--json", *argv], cwd=tmp, check=True,
                             capture_output=True, text=True, env={"PYTHONPATH": tmp, "PATH": "/usr/bin:/bin"})
        return json.loads(res.stdout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--instances", type=lambda s: [int(x) for x in s.split(",")], default=[100, 1000])
    p.add_argument("--sequences", type=int, default=4000, help="placements timed per pool size")
    p.add_argument("--tokens", type=int, default=8192, help="each sequence's max_new_tokens")
    p.add_argument("--repeat", type=int, default=3, help="best of this many runs")
    p.add_argument("--baseline", metavar="REV", help="also run the package at this git revision")
    p.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.json:
        print(json.dumps(run_all(args)))
        return
    sys.path.insert(0, str(ROOT))
    argv = ["--instances", ",".join(map(str, args.instances)), "--sequences", str(args.sequences),
            "--tokens", str(args.tokens), "--repeat", "1"]
    repeat, args.repeat = args.repeat, 1
    now: dict[str, float] = {}
    before: dict[str, float] = {}
    for _ in range(repeat):  # alternately, so that a shared machine's drift falls on both alike
        for key, us in run_all(args).items():
            now[key] = min(now.get(key, us), us)
        for key, us in (baseline(args.baseline, argv) if args.baseline else {}).items():
            before[key] = min(before.get(key, us), us)
    args.repeat = repeat
    print(f"placement cost (Dispatcher.try_acquire), best of {args.repeat}, {args.sequences} placements each:")
    for key, us in now.items():
        line = f"  {key:<36} {us:7.1f} us"
        if key in before:
            line += f"   at {args.baseline}: {before[key]:7.1f} us   ({before[key] / us:.2f}x)"
        print(line)


if __name__ == "__main__":
    main()
