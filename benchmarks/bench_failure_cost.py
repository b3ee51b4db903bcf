"""Failure cost: what one preemption mid-batch costs with token-level continuation.

A real manager and 3 CPU engines (paced with --token-delay-s so generation, not CPU, sets the time)
serve the same NDJSON batch twice: once undisturbed, once with one engine SIGKILLed when a third of
the results are in. Prints wall times, tokens regenerated (sum of segment lengths minus final lengths:
0 means no token was made twice), and the tokens a restart-from-scratch retry would have regenerated.

    .venv/bin/python benchmarks/bench_failure_cost.py --requests 96 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_manager_overhead import PY, free_port, spawn, stop_all, wait_ok


async def run_once(n: int, max_new: int, delay: float, kill: bool, logs: Path) -> dict[str, float]:
    procs = []
    try:
        mport = free_port()
        procs.append(spawn([PY, "-m", "rollout_manager", "serve", "--bind", f"127.0.0.1:{mport}",
                            "--log-level", "warning", "--set", "pending_poll_interval_s=0.1",
                            "--set", "health_check_interval_s=0.5"], logs / f"manager-{kill}.log"))
        manager = f"http://127.0.0.1:{mport}"
        ports = [free_port() for _ in range(3)]
        engines = [spawn([PY, "-m", "rollout_manager.cpu_engine", "--port", str(p), "--seed", "0",
                          "--token-delay-s", str(delay)], logs / f"engine-{p}.log") for p in ports]
        procs += engines
        await wait_ok(manager + "/health")
        for p in ports:
            await wait_ok(f"http://127.0.0.1:{p}/health")
        async with aiohttp.ClientSession() as s:
            for p in ports:
                async with s.post(manager + "/register_rollout_instance", json={"host": "127.0.0.1", "port": p}):
                    pass
            while True:
                async with s.get(manager + "/get_instances_status") as r:
                    if (await r.json())["ready_instances"] == 3:
                        break
                await asyncio.sleep(0.05)
            items = [[i, {"input_ids": [i % 250 + 1, 7], "sampling_params": {"max_new_tokens": max_new,
                                                                             "temperature": 0}}]
                     for i in range(n)]
            lines = []
            t0 = time.perf_counter()
            async with s.post(manager + "/batch_generate_requests", json=items) as r:
                async for raw in r.content:
                    lines.append(json.loads(raw))
                    if kill and len(lines) == n // 3:
                        os.killpg(engines[0].pid, signal.SIGKILL)
            wall = time.perf_counter() - t0
        assert len(lines) == n and all(x["success"] for x in lines), "a request failed"
        outs = [x["data"] for x in lines]
        seg_tokens = sum(sg["end"] - sg["start"] for o in outs for sg in o["meta_info"]["segments"])
        final_tokens = sum(len(o["output_ids"]) for o in outs)
        continued = [o for o in outs if len(o["meta_info"]["segments"]) > 1]
        saved = sum(o["meta_info"]["segments"][0]["end"] for o in continued)
        return {"wall_s": wall, "regenerated": seg_tokens - final_tokens, "continued": len(continued),
                "restart_would_regenerate": saved, "tokens": final_tokens}
    finally:
        stop_all(procs)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--token-delay-s", type=float, default=0.01)
    args = parser.parse_args()
    logs = Path(os.environ.get("BENCH_LOGS", "/tmp/bench-failure-cost"))
    logs.mkdir(parents=True, exist_ok=True)
    base = await run_once(args.requests, args.max_new_tokens, args.token_delay_s, False, logs)
    hit = await run_once(args.requests, args.max_new_tokens, args.token_delay_s, True, logs)
    print(f"\n{args.requests} requests x {args.max_new_tokens} tokens, 3 CPU engines, greedy\n")
    print("| run | wall s | sequences continued | tokens regenerated | a restart would regenerate |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, r in (("no fault", base), ("1 of 3 engines SIGKILLed at 1/3", hit)):
        print(f"| {name} | {r['wall_s']:.2f} | {r['continued']} | {r['regenerated']} | "
              f"{r['restart_would_regenerate']} |")
    print(f"\nextra wall time from the preemption: {hit['wall_s'] - base['wall_s']:+.2f} s "
          f"({hit['wall_s'] / base['wall_s']:.2f}x)")


if __name__ == "__main__":
    asyncio.run(main())
