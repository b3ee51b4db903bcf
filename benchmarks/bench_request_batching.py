"""What coalescing verl's per-sample generate calls buys: one step's samples, all asked for at once
(as verl's agent loops do), sent as single ``/generate`` requests vs. through the plugin's
``RequestBatcher`` (one ``/batch_generate_requests`` stream per 5 ms window).

Two instant fake SGLang backends (benchmarks/fake_sglang.py) stand behind a real manager, so what is
measured is the cost of getting a step's requests through the manager. One run, interleaved rounds,
median; everything on 127.0.0.1.

    .venv/bin/python benchmarks/bench_request_batching.py --samples 2048 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_manager_overhead import register_backends, spawn_fake_cluster, stop_all
from trainer_plugin.client import ManagerClient
from trainer_plugin.request_batcher import RequestBatcher


def body(i: int) -> dict:
    return {"input_ids": [1, 2, 3, i % 200 + 4], "sampling_params": {"max_new_tokens": 8, "temperature": 0}}


async def step(manager: str, samples: int, batched: bool) -> float:
    """Seconds until every sample of one step has its answer."""
    async with ManagerClient(manager, max_connections=256) as client:
        batcher = RequestBatcher(client, window_s=0.005) if batched else None
        t0 = time.perf_counter()
        calls = [(batcher.generate(body(i)) if batcher else client.generate(body(i))) for i in range(samples)]
        results = await asyncio.gather(*calls)
        elapsed = time.perf_counter() - t0
        assert all(len(r["output_ids"]) == 8 for r in results)
        if batcher is not None:
            await batcher.close()
        return elapsed


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=2048, help="samples per step (prompts x n)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    logs = Path(os.environ.get("BENCH_LOGS", "/tmp/bench-request-batching"))
    logs.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen] = []
    try:
        manager, backends = spawn_fake_cluster(logs, procs)
        await register_backends(manager, backends)
        for batched in (False, True):  # warm-up
            await step(manager, 256, batched)
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.rounds):
            for batched in (False, True):
                times[batched].append(await step(manager, args.samples, batched))
        single, batch = statistics.median(times[False]), statistics.median(times[True])
        print(f"\none step of {args.samples} samples asked for at once, 2 instant fake backends, "
              f"{os.cpu_count()} cores, median of {args.rounds} interleaved rounds\n")
        print("| path | step s | samples/s |")
        print("| --- | ---: | ---: |")
        print(f"| one /generate per sample | {single:.3f} | {args.samples / single:.0f} |")
        print(f"| RequestBatcher (5 ms window) | {batch:.3f} | {args.samples / batch:.0f} |")
        print(f"\nbatched / single throughput ratio: {single / batch:.2f}")
    finally:
        stop_all(procs)


if __name__ == "__main__":
    asyncio.run(main())
