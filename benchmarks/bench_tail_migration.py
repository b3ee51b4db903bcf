"""Tail migration end to end: a long-tailed batch on 3 CPU engines of different speeds.

Three CPU engines (same seed, so the same weights) run at 1x, 1/2x and 1/4x speed through their
slow-down faults (``--slowdown F --token-delay-s base*F``: every decoding round takes F times as
long). Two real managers are registered with all three, one with ``tail_migration=false`` and one
with it on; the same NDJSON batch (greedy; output lengths long-tailed, drawn from a seeded lognormal
and set as each request's ``max_new_tokens``) goes through each in turn, ``--rounds`` times
alternating. Printed: wall time per run, sequences migrated, tokens re-prefilled by the moves. Every
output of the migrating run is checked token for token against the same request's output from the
run without migration (which continues nothing), and within its budget.

    .venv/bin/python benchmarks/bench_tail_migration.py [--requests 36 --rounds 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_manager_overhead import PY, free_port, spawn, stop_all, wait_ok

SPEEDS = (1.0, 2.0, 4.0)  # slow-down factors


def lengths(n: int, median: float, sigma: float, cap: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [max(4, min(cap, round(rng.lognormvariate(math.log(median), sigma)))) for _ in range(n)]


async def run_batch(session: aiohttp.ClientSession, manager: str, items: list[Any]) -> tuple[float, dict[Any, Any]]:
    t0 = time.perf_counter()
    out: dict[Any, Any] = {}
    async with session.post(manager + "/batch_generate_requests", json=items) as r:
        async for raw in r.content:
            line = json.loads(raw)
            assert line["success"], line
            out[line["id"]] = line["data"]
    return time.perf_counter() - t0, out


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=36)
    p.add_argument("--median-tokens", type=float, default=40)
    p.add_argument("--sigma", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=400, help="cap of the drawn lengths")
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--token-delay-s", type=float, default=0.01, help="per decoding round on the fastest engine")
    p.add_argument("--rounds", type=int, default=1, help="off/on pairs, alternating")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-half", type=float, default=4.0,
                   help="tail_migration_batch_half of the migrating manager (the CPU engine's rounds grow "
                   "with the batch: each sequence is a full forward on shared cores)")
    args = p.parse_args()
    logs = Path(os.environ.get("BENCH_LOGS", "/tmp/bench-tail-migration"))
    logs.mkdir(parents=True, exist_ok=True)
    procs = []
    try:
        ports = [free_port() for _ in SPEEDS]
        for port, f in zip(ports, SPEEDS):
            procs.append(spawn([PY, "-m", "rollout_manager.cpu_engine", "--port", str(port), "--seed", "0",
                                "--slowdown", str(f), "--token-delay-s", str(args.token_delay_s * f)],
                               logs / f"engine-{port}.log"))
        managers = {}
        for mode in ("false", "true"):
            mport = free_port()
            procs.append(spawn([PY, "-m", "rollout_manager", "serve", "--bind", f"127.0.0.1:{mport}",
                                "--log-level", "warning", "--set", "pending_poll_interval_s=0.1",
                                "--set", "health_check_path=/health", "--set", "health_check_interval_s=5",
                                "--set", f"tail_migration={mode}", "--set", "tail_migration_interval_s=0.5",
                                "--set", f"tail_migration_batch_half={args.batch_half}"], logs / f"manager-{mode}.log"))
            managers[mode] = f"http://127.0.0.1:{mport}"
        for url in managers.values():
            await wait_ok(url + "/health")
        for port in ports:
            await wait_ok(f"http://127.0.0.1:{port}/health")
        budgets = lengths(args.requests, args.median_tokens, args.sigma, args.max_new_tokens, args.seed)
        rng = random.Random(args.seed + 1)
        items = [[k, {"input_ids": [rng.randrange(1, 250) for _ in range(args.prompt_tokens)],
                      "sampling_params": {"max_new_tokens": b, "temperature": 0, "ignore_eos": True}}]
                 for k, b in enumerate(budgets)]
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as s:
            for url in managers.values():
                for port in ports:
                    async with s.post(url + "/register_rollout_instance", json={"host": "127.0.0.1", "port": port}):
                        pass
                while True:
                    async with s.get(url + "/get_instances_status") as r:
                        if (await r.json())["ready_instances"] == len(ports):
                            break
                    await asyncio.sleep(0.05)
            rows = []
            reference: dict[Any, Any] | None = None
            for rnd in range(args.rounds):
                for mode in ("false", "true"):
                    wall, out = await run_batch(s, managers[mode], items)
                    if reference is None:
                        reference = out
                    moved = [o for o in out.values() if len(o["meta_info"]["segments"]) > 1]
                    migrated = sum(1 for o in out.values() for sg in o["meta_info"]["segments"]
                                   if sg["outcome"].startswith("migrated"))
                    reprefill = sum(args.prompt_tokens + sg["end"] for o in out.values()
                                    for sg in o["meta_info"]["segments"] if sg["outcome"].startswith("migrated"))
                    for k, o in out.items():  # exact and within budget
                        assert o["output_ids"] == reference[k]["output_ids"], f"request {k} differs"
                        assert len(o["output_ids"]) == budgets[k]
                    rows.append((rnd, mode, wall, len(moved), migrated, reprefill,
                                 sum(len(o["output_ids"]) for o in out.values())))
    finally:
        stop_all(procs)
    print(f"\n{args.requests} requests, lognormal lengths (median {args.median_tokens:g}, sigma {args.sigma:g}, "
          f"cap {args.max_new_tokens}: {sum(budgets)} tokens, longest {max(budgets)}), {args.prompt_tokens}-token "
          f"prompts, greedy; 3 CPU engines at speeds 1, 1/2, 1/4 ({args.token_delay_s:g}s per round on the fastest)\n")
    print("| round | tail_migration | wall s | sequences continued | migrations | re-prefilled / generated "
          "| outputs exact |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | --- |")
    for rnd, mode, wall, moved, migrated, reprefill, tokens in rows:
        print(f"| {rnd} | {mode} | {wall:.2f} | {moved} | {migrated} | {100 * reprefill / tokens:.1f}% | yes |")
    off = [r[2] for r in rows if r[1] == "false"]
    on = [r[2] for r in rows if r[1] == "true"]
    print(f"\nmean wall: off {sum(off) / len(off):.2f} s, on {sum(on) / len(on):.2f} s "
          f"({sum(on) / sum(off):.2f}x)")


if __name__ == "__main__":
    asyncio.run(main())
