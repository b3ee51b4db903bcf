"""Relay cost: manager CPU per relayed token, by how the engines stream and how long sequences are.

64 sequences of N tokens (N = 1,024 and 4,096) are asked of a real manager process as non-streaming
``/generate`` calls (what a trainer sends), all at once. Behind it two fake SGLang backends
(benchmarks/fake_sglang.py: instant, cheap to run) stream each sequence in one of these ways:

- ``cumulative/1``: SGLang's defaults (cumulative chunks, server stream interval 1) and a manager that
  sends no per-request interval (``engine_stream_interval=0``): the relay before issue 14.
- ``cumulative/req``: SGLang's defaults, the manager's per-request ``stream_interval`` (this version's
  default): an instance that was not started by launch_sglang.sh.
- ``incremental/1``: ``--incremental-streaming-output``, interval 1, no per-request interval.
- ``incremental/req``: ``--incremental-streaming-output`` and the manager's per-request interval: an
  instance started by launch_sglang.sh.
- ``incremental/server16``: ``--incremental-streaming-output --stream-interval 16``, no per-request interval.

The figure is the manager's CPU time (utime + stime from ``/proc/<pid>/stat``, all its threads) over the
load, divided by the tokens relayed. Every output is checked token for token. Everything runs in one
run, so the ratios are comparable.

    .venv/bin/python benchmarks/bench_relay.py                 # 64 x 1024 and 64 x 4096, every mode
    .venv/bin/python benchmarks/bench_relay.py --interval 32 --lengths 4096 --modes incremental/req
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_manager_overhead import cpu_s, register_backends, spawn, stop_all, wait_ok

from rollout_manager.osutil import free_port

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable

# name -> (fake backend flags, whether the manager sends its per-request interval)
MODES: dict[str, tuple[list[str], bool]] = {
    "cumulative/1": ([], False),
    "cumulative/req": ([], True),
    "incremental/1": (["--incremental-streaming-output"], False),
    "incremental/req": (["--incremental-streaming-output"], True),
    "incremental/server16": (["--incremental-streaming-output", "--stream-interval", "16"], False),
}


async def relay(manager: str, sequences: int, tokens: int) -> float:
    """Send ``sequences`` non-streaming requests at once; check each output; return the wall time."""
    body = {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": tokens, "temperature": 0}}
    expected = list(range(1, tokens + 1))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=1800)) as s:
        async def one() -> None:
            async with s.post(manager + "/generate", json=body) as r:
                out = await r.json()
                if r.status != 200 or out["output_ids"] != expected:
                    raise RuntimeError(f"HTTP {r.status}: wrong output ({str(out)[:200]})")

        t0 = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(sequences)))
        return time.perf_counter() - t0


async def run_mode(mode: str, lengths: list[int], sequences: int, interval: int,
                   logs: Path, repeat: int = 1) -> dict[int, tuple[float, float]]:
    flags, per_request = MODES[mode]
    procs: list[subprocess.Popen] = []
    try:
        backends = []
        name = mode.replace("/", "_")
        for k in range(2):
            port = free_port()
            procs.append(spawn([PY, str(ROOT / "benchmarks/fake_sglang.py"), "--port", str(port),
                                "--chunks", str(max(lengths)), *flags], logs / f"{name}-backend{k}.log"))
            backends.append(f"http://127.0.0.1:{port}")
        mport = free_port()
        sets = ["pending_poll_interval_s=0.1", f"engine_stream_interval={interval if per_request else 0}",
                "stream_stall_timeout_s=1800"]
        manager = spawn([PY, "-m", "rollout_manager", "serve", "--bind", f"127.0.0.1:{mport}", "--log-level",
                         "warning", *[a for kv in sets for a in ("--set", kv)]],
                        logs / f"{name}-manager.log")
        procs.append(manager)
        url = f"http://127.0.0.1:{mport}"
        await register_backends(url, backends)
        await wait_ok(url + "/health")
        await relay(url, 4, 64)  # warm up connections and code paths
        out = {}
        for n in lengths:
            runs = []
            for _ in range(repeat):  # the median run: one run is under a second, and as noisy
                before = cpu_s(manager.pid)
                wall = await relay(url, sequences, n)
                runs.append(((cpu_s(manager.pid) - before) / (sequences * n) * 1e6, wall))
            out[n] = sorted(runs)[len(runs) // 2]
        return out
    finally:
        stop_all(procs)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--interval", type=int, default=64, help="the manager's engine_stream_interval (default 64)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--repeat", type=int, default=3, help="runs per length; the median is printed")
    args = parser.parse_args()
    logs = Path(os.environ.get("BENCH_LOGS", "/tmp/bench-relay"))
    logs.mkdir(parents=True, exist_ok=True)
    results = {mode: await run_mode(mode, args.lengths, args.sequences, args.interval, logs, args.repeat)
               for mode in args.modes}
    print(f"manager CPU per relayed token, {args.sequences} non-streaming sequences at once, "
          f"per-request interval {args.interval} ('req'); µs/token (wall s), median of {args.repeat} runs")
    print(f"{'mode':<22}" + "".join(f"{f'{n} tokens':>20}" for n in args.lengths)
          + (f"{'growth':>9}" if len(args.lengths) > 1 else ""))
    for mode, row in results.items():
        cells = "".join(f"{f'{row[n][0]:.2f} ({row[n][1]:.1f}s)':>20}" for n in args.lengths)
        growth = f"{row[args.lengths[-1]][0] / row[args.lengths[0]][0]:>8.2f}x" if len(args.lengths) > 1 else ""
        print(f"{mode:<22}{cells}{growth}")
    base = args.modes[0]
    for n in args.lengths:
        ratios = ", ".join(f"{m} {results[base][n][0] / results[m][n][0]:.0f}x" for m in args.modes[1:])
        print(f"{n} tokens, cheaper than {base}: {ratios}")


if __name__ == "__main__":
    asyncio.run(main())
