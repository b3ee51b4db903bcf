"""Manager overhead and relay cost per token against real SGLang streams, beside the CPU engine's figures.

Real SGLang 0.5.23 on CPU (``.venv-sglang``, made by scripts/install.sh) serves a tiny random Llama
(tests/real_sglang_model.py, its context raised to fit the load); ``--servers`` SGLang servers are started
directly on free loopback ports with the flags of tests/real_sglang.py (``OMP_NUM_THREADS=1``,
``--sleep-on-idle``) plus ``--incremental-streaming-output``, as scripts/launch_sglang.sh starts them.
One workload, ``--sequences`` distinct prompts of ``--prompt-tokens`` tokens, each asking for ``--tokens``
tokens (greedy, ``ignore_eos``), all sent at once as non-streaming ``/generate`` calls (what a trainer
sends):

- **direct**: round robin over the servers, no manager;
- **manager**: to a rollout manager the servers are registered with, which streams each sequence from
  its engine as it always does (per-request ``stream_interval`` 64, incremental chunks).

The two alternate for ``--rounds`` rounds in one run, so their ratio sees the same machine. The
manager's CPU time (utime + stime from ``/proc/<pid>/stat``, all its threads) over each manager round,
per 1,000 relayed tokens and per sequence; the engines' CPU (every process of each server) the same
way; each output through the manager compared token for token with the direct one of the same prompt.
Then the same with the project's CPU engine (``python -m rollout_manager.cpu_engine``) in place of
SGLang, after the SGLang servers are stopped. Everything is stopped at the end.

    .venv/bin/python benchmarks/bench_real_sglang.py --sequences 64 --tokens 1024 --rounds 3 --cpu-rounds 1
    .venv/bin/python benchmarks/bench_real_sglang.py --sequences 32 --tokens 256 --rounds 1  # minutes, not tens

The CPU engine is the slow part on 2 cores: its 64 x 1,024 round takes well over 7 minutes there
(``--no-cpu-engine`` skips it). Each round's line is printed as it ends, so an interrupted run still
shows the rounds it finished.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from bench_manager_overhead import cpu_s, register_backends, spawn_manager, stop_all, wait_ok
from real_sglang import CPU_FLAGS, SGLANG_ENV, SGLANG_PY, descendants

from rollout_manager.osutil import free_port

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
VOCAB = 256  # the CPU engine's tiny model (tests/real_sglang_model.py's has 1,024)


@dataclass
class Round:
    """One load through one path: wall time, tokens, CPU seconds of the manager and of the engines."""

    wall_s: float
    tokens: int
    manager_cpu_s: float
    engines_cpu_s: float
    outputs: list[list[int]]


@dataclass
class Cluster:
    """Engines (their URLs and main pids) and a manager in front of them."""

    engines: list[str]
    engine_pids: list[int]
    manager: str
    manager_pid: int


def prompts(sequences: int, prompt_tokens: int) -> list[list[int]]:
    """Distinct prompts, ids spread over the vocabulary (never 0, the tiny model's EOS)."""
    return [[1 + (s * 7919 + t * 104729) % (VOCAB - 1) for t in range(prompt_tokens)] for s in range(sequences)]


def tree_cpu_s(pids: list[int]) -> float:
    """CPU seconds of ``pids`` and all their descendants (SGLang's scheduler and detokenizer are children)."""
    total = 0.0
    for pid in {p for root in pids for p in (root, *descendants(root))}:
        try:
            total += cpu_s(pid)
        except (OSError, IndexError, ValueError):
            pass
    return total


async def load(urls: list[str], inputs: list[list[int]], tokens: int, manager_pid: int,
               engine_pids: list[int]) -> Round:
    """Every prompt at once as a non-streaming /generate, round robin over ``urls``; checks each length."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=3600)) as s:
        async def one(i: int, ids: list[int]) -> list[int]:
            body = {"input_ids": ids,
                    "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}}
            async with s.post(urls[i % len(urls)] + "/generate", json=body) as r:
                out = await r.json()
                if r.status != 200 or len(out.get("output_ids", ())) != tokens:
                    raise RuntimeError(f"HTTP {r.status}: {str(out)[:300]}")
                return list(out["output_ids"])

        manager_before, engines_before = cpu_s(manager_pid), tree_cpu_s(engine_pids)
        t0 = time.perf_counter()
        outputs = await asyncio.gather(*(one(i, ids) for i, ids in enumerate(inputs)))
        wall = time.perf_counter() - t0
        return Round(wall, sum(map(len, outputs)), cpu_s(manager_pid) - manager_before,
                     tree_cpu_s(engine_pids) - engines_before, outputs)


async def peak_in_flight(manager: str, done: asyncio.Event) -> dict[str, tuple[int, int]]:
    """Until ``done``: the most sequences the manager had in flight on each instance, and its bound there
    (from /metrics, sampled every 0.25 s): how it spread the load."""
    peak: dict[str, tuple[int, int]] = {}
    async with aiohttp.ClientSession() as s:
        while not done.is_set():
            async with s.get(manager + "/metrics") as r:
                text = await r.text()
            gauges: dict[str, dict[str, int]] = {"in_flight_requests": {}, "max_in_flight": {}}
            for line in text.splitlines():
                for name, values in gauges.items():
                    if line.startswith(f"rollout_manager_instance_{name}{{"):
                        endpoint = line.split('endpoint="', 1)[1].split('"', 1)[0]
                        values[endpoint] = int(float(line.rsplit(" ", 1)[1]))
            for endpoint, n in gauges["in_flight_requests"].items():
                peak[endpoint] = (max(n, peak.get(endpoint, (0, 0))[0]), gauges["max_in_flight"].get(endpoint, 0))
            try:
                await asyncio.wait_for(done.wait(), 0.25)
            except asyncio.TimeoutError:
                pass
    return peak


def make_model(dest: Path, context: int) -> Path:
    """The tests' tiny Llama with ``context`` positions (the tests' 1,024 cannot hold 1,024+ new tokens)."""
    if not (dest / "model.safetensors").exists():
        code = ("import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); import real_sglang_model as m; "
                "m.CONTEXT = int(sys.argv[3]); m.make(Path(sys.argv[2]), 'llama')")
        subprocess.run([str(SGLANG_PY), "-c", code, str(ROOT / "tests"), str(dest), str(context)], check=True,
                       timeout=600, env={**os.environ, **SGLANG_ENV})
    return dest


def sglang_flags(kv_tokens: int) -> list[str]:
    """tests/real_sglang.py's CPU flags with a KV pool that holds the whole load at once."""
    flags = list(CPU_FLAGS)
    flags[flags.index("--max-total-tokens") + 1] = str(kv_tokens)
    return flags


def start_engines(kind: str, n: int, model_dir: Path, context: int, kv_tokens: int, logs: Path,
                  procs: list[subprocess.Popen[bytes]]) -> tuple[list[str], list[int]]:
    """Start ``n`` engines of ``kind`` (``sglang`` or ``cpu``) on free loopback ports; returns at once."""
    urls, pids = [], []
    env = {**os.environ, **SGLANG_ENV}
    for k in range(n):
        port = free_port()
        if kind == "sglang":
            args = [str(SGLANG_PY), "-m", "sglang.launch_server", "--model-path", str(model_dir), "--host",
                    "127.0.0.1", "--port", str(port), "--weight-version", "0", "--incremental-streaming-output",
                    *sglang_flags(kv_tokens)]
        else:
            args = [PY, "-m", "rollout_manager.cpu_engine", "--port", str(port), "--incremental-streaming-output",
                    "--model-config", json.dumps({"max_position_embeddings": context}), "--log-level", "WARNING"]
        procs.append(subprocess.Popen(args, stdout=open(logs / f"{kind}{k}.log", "wb"), stderr=subprocess.STDOUT,
                                      cwd=ROOT, env=env, start_new_session=True))
        urls.append(f"http://127.0.0.1:{port}")
        pids.append(procs[-1].pid)
    return urls, pids


async def start_cluster(kind: str, args: argparse.Namespace, model_dir: Path, logs: Path,
                        procs: list[subprocess.Popen[bytes]]) -> Cluster:
    context = args.prompt_tokens + args.tokens + 64
    per_server = -(-args.sequences // args.servers) * context  # every sequence of a server at once
    urls, pids = start_engines(kind, args.servers, model_dir, context, max(8192, per_server + 1024), logs, procs)
    manager = spawn_manager(logs / f"manager-{kind}.log", procs, "stream_stall_timeout_s=1800",
                            "health_check_timeout_s=120")
    manager_pid = procs[-1].pid
    for url in urls:
        await wait_ok(url + "/health", timeout=600)
    await register_backends(manager, urls)
    return Cluster(urls, pids, manager, manager_pid)


async def measure(kind: str, args: argparse.Namespace, model_dir: Path, logs: Path,
                  n_rounds: int) -> dict[str, list[Round]]:
    """Warm up, then alternate direct and manager rounds; returns the rounds of each path."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        c = await start_cluster(kind, args, model_dir, logs, procs)
        inputs = prompts(args.sequences, args.prompt_tokens)
        for urls in (c.engines, [c.manager]):  # warm-up: connections, code paths, the engines' first batches
            await load(urls, inputs[: 2 * args.servers], 64, c.manager_pid, c.engine_pids)
        rounds: dict[str, list[Round]] = {"direct": [], "manager": []}
        for k in range(n_rounds):
            for path, urls in (("direct", c.engines), ("manager", [c.manager])):
                done = asyncio.Event()
                sampler = asyncio.create_task(peak_in_flight(c.manager, done))
                try:
                    r = await load(urls, inputs, args.tokens, c.manager_pid, c.engine_pids)
                finally:
                    done.set()
                peak = await sampler
                rounds[path].append(r)
                spread = ", ".join(f"{n}/{bound}" for n, bound in peak.values()) if path == "manager" else "-"
                print(f"  {kind} round {k + 1} {path}: {r.tokens / r.wall_s:,.0f} tokens/s, {r.wall_s:.1f} s, "
                      f"manager {r.manager_cpu_s:.2f} CPU s; peak in flight per instance / bound: {spread}",
                      flush=True)
        return rounds
    finally:
        stop_all(procs)


def row(name: str, path: str, rounds: list[Round], sequences: int, reference: list[Round]) -> str:
    rate = statistics.median(r.tokens / r.wall_s for r in rounds)
    per_k = statistics.median(1e6 * r.manager_cpu_s / r.tokens for r in rounds)
    per_seq = statistics.median(1000 * r.manager_cpu_s / sequences for r in rounds)
    engines = statistics.median(1000 * r.engines_cpu_s / r.tokens for r in rounds)
    same = sum(a == b for r in rounds for a, b in zip(r.outputs, reference[0].outputs))
    return (f"| {name} | {path} | {rate:,.0f} | {statistics.median(r.wall_s for r in rounds):.1f} | "
            f"{per_k:.2f} | {per_seq:.2f} | {engines:.3f} | {same}/{len(rounds) * sequences} |")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=1024, help="new tokens per sequence (ignore_eos)")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="alternating direct/manager rounds; medians printed")
    parser.add_argument("--cpu-rounds", type=int, default=1,
                        help="rounds with the CPU engine (it makes ~700 tokens/s here, batch or not: slow rounds)")
    parser.add_argument("--no-cpu-engine", action="store_true", help="skip the CPU engine's comparison")
    args = parser.parse_args()
    if not SGLANG_PY.exists():
        sys.exit(f"{SGLANG_PY} is missing: run scripts/install.sh (or scripts/sglang_cpu/install.sh)")
    logs = Path(os.environ.get("BENCH_LOGS", "/tmp/bench-real-sglang"))
    logs.mkdir(parents=True, exist_ok=True)
    context = args.prompt_tokens + args.tokens + 64
    model_dir = make_model(logs / f"model-{context}", context)
    results = {"real SGLang 0.5.23": await measure("sglang", args, model_dir, logs, args.rounds)}
    if not args.no_cpu_engine:
        results["CPU engine"] = await measure("cpu", args, model_dir, logs, args.cpu_rounds)
    print(f"\n{args.sequences} non-streaming sequences at once, {args.prompt_tokens}-token prompts, "
          f"{args.tokens} new tokens each (greedy, ignore_eos), {args.servers} servers, {os.cpu_count()} cores, "
          f"median of {args.rounds} alternating rounds ({args.cpu_rounds} with the CPU engine)\n")
    print("| engines | path | tokens/s | wall s | manager CPU ms / 1k tokens (µs/token) | manager CPU ms / sequence "
          "| engines' CPU s / 1k tokens | outputs equal to direct |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, rounds in results.items():
        for path in ("direct", "manager"):
            print(row(name, path, rounds[path], args.sequences, rounds["direct"]))
    print()
    for name, rounds in results.items():
        ratios = [m.tokens / m.wall_s / (d.tokens / d.wall_s) for d, m in zip(rounds["direct"], rounds["manager"])]
        print(f"{name}: manager / direct tokens/s per round {', '.join(f'{x:.3f}' for x in ratios)}; "
              f"median {statistics.median(ratios):.3f}")
    if len(results) == 2:
        (a, ra), (b, rb) = results.items()
        per_k = [statistics.median(r.manager_cpu_s / r.tokens for r in rs["manager"]) for rs in (ra, rb)]
        if per_k[1] > 0:  # /proc counts 10 ms ticks: a tiny run may show none
            print(f"manager CPU per token, {a} / {b}: {per_k[0] / per_k[1]:.2f}")


if __name__ == "__main__":
    asyncio.run(main())
