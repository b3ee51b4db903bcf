"""Manager overhead: the same short requests sent directly, through the manager, and through sglang-router.

Two fake backends answer at once (benchmarks/fake_sglang.py: 8 tokens per request), so what is
measured is the cost of the layer in front of them. ``benchmarks/floor_proxy.py``, a bare proxy, runs
twice: on aiohttp's server (the floor of any layer built on it) and ``--plain`` on an asyncio protocol
(the floor of the manager's fast lane); each proxy's CPU per request comes from /proc.
Callers ask non-streaming ``/generate`` (what a trainer sends; ``--stream`` for streaming callers).
Everything runs on this machine over 127.0.0.1, in one run, so the ratios are comparable. Prints
requests/s, p50/p99 latency and proxy CPU per request per path, and manager / router. A second
manager with the fast lane off (``http_fast_generate = false``: every request on aiohttp's web layer)
runs in the same rounds (``--no-lane-off`` skips it), so the lane's worth is a ratio of the same run.

    .venv/bin/python benchmarks/bench_manager_overhead.py --requests 4000 --concurrency 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rollout_manager.osutil import free_port

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """utime + stime of ``pid`` (every thread), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def spawn(args: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(args, stdout=open(log, "wb"), stderr=subprocess.STDOUT, cwd=ROOT,
                            start_new_session=True)


def stop_all(procs: list[subprocess.Popen]) -> None:
    """SIGKILL each process group started by :func:`spawn` and reap it."""
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


async def wait_ok(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            try:
                async with s.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


def spawn_fake_cluster(logs: Path, procs: list[subprocess.Popen], *manager_sets: str) -> tuple[str, list[str]]:
    """Start two instant fake SGLang backends and a manager (``--set`` each of ``manager_sets``);
    returns their URLs at once (see :func:`register_backends`)."""
    backends = []
    for k in range(2):
        port = free_port()
        procs.append(spawn([PY, str(ROOT / "benchmarks/fake_sglang.py"), "--port", str(port)],
                           logs / f"backend{k}.log"))
        backends.append(f"http://127.0.0.1:{port}")
    return spawn_manager(logs / "manager.log", procs, *manager_sets), backends


def spawn_manager(log: Path, procs: list[subprocess.Popen], *manager_sets: str) -> str:
    """Start a manager (``--set`` each of ``manager_sets``); returns its URL at once."""
    mport = free_port()
    sets = [arg for kv in ("pending_poll_interval_s=0.1", *manager_sets) for arg in ("--set", kv)]
    procs.append(spawn([PY, "-m", "rollout_manager", "serve", "--bind", f"127.0.0.1:{mport}",
                        "--log-level", "warning", *sets], log))
    return f"http://127.0.0.1:{mport}"


async def register_backends(manager: str, backends: list[str]) -> None:
    """Wait for everything to answer, register the backends, wait until the manager serves them."""
    for url in [*backends, manager]:
        await wait_ok(url + "/health")
    async with aiohttp.ClientSession() as s:
        for url in backends:
            host, port = url.removeprefix("http://").rsplit(":", 1)
            async with s.post(manager + "/register_rollout_instance", json={"host": host, "port": int(port)}) as r:
                assert r.status == 200, await r.text()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            async with s.get(manager + "/get_instances_status") as r:
                if (await r.json())["ready_instances"] == len(backends):
                    return
            await asyncio.sleep(0.1)
    raise RuntimeError("the manager did not take the backends into service")


LANE_OFF = "rollout-manager, fast lane off"
PROMPTS = 64  # distinct prompts, cycled: a GRPO-like mix, and affinity cannot pin everything to one instance


def bodies(prompt_tokens: int, stream: bool) -> list[bytes]:
    """The request bodies, encoded once (the load generator's own cost stays out of the comparison).
    Token ids are spread over a 150k vocabulary, as real prompts' are (small ints are cheaper to parse)."""
    return [json.dumps({"input_ids": [1000 + (p * 7919 + t * 104729) % 150_000 for t in range(prompt_tokens)],
                        "sampling_params": {"max_new_tokens": 8, "temperature": 0}, "stream": stream},
                       separators=(",", ":")).encode() for p in range(PROMPTS)]


async def load(urls: list[str], n: int, concurrency: int, stream: bool, prompt_tokens: int = 4) -> dict[str, float]:
    """n POST /generate over ``urls`` round-robin, ``concurrency`` at a time; reads every byte."""
    latencies: list[float] = []
    counter = iter(range(n))
    encoded = bodies(prompt_tokens, stream)
    headers = {"Content-Type": "application/json"}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as s:
        async def worker() -> None:
            for i in counter:
                t0 = time.perf_counter()
                async with s.post(urls[i % len(urls)] + "/generate", data=encoded[i % PROMPTS], headers=headers) as r:
                    answer = await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"HTTP {r.status} from {urls[i % len(urls)]}: {answer[:300]!r}")
                latencies.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    latencies.sort()
    return {"rps": n / wall, "p50_ms": 1000 * statistics.median(latencies),
            "p99_ms": 1000 * latencies[int(0.99 * (len(latencies) - 1))]}


def print_paired(runs: dict[str, list[dict[str, float]]], name: str, label: str, others: tuple[str, ...]) -> None:
    """``name``'s throughput against each of ``others`` and its CPU against the manager's, round by round."""
    for other in others:
        paired = [m["rps"] / r["rps"] for m, r in zip(runs[name], runs[other])]
        print(f"{label} / {other} throughput, per round: {', '.join(f'{x:.2f}' for x in paired)}; "
              f"median {statistics.median(paired):.2f}")
    cpu = [m["cpu_ms"] / r["cpu_ms"] for m, r in zip(runs[name], runs["rollout-manager"])]
    print(f"{label} / rollout-manager CPU per request, per round: {', '.join(f'{x:.2f}' for x in cpu)}; "
          f"median {statistics.median(cpu):.2f}")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the median is printed")
    parser.add_argument("--no-router", action="store_true", help="skip sglang-router (not installed)")
    parser.add_argument("--stream", action="store_true", help="streaming callers (default: non-streaming)")
    parser.add_argument("--no-lane-off", action="store_true",
                        help="skip the second manager with the fast lane off (http_fast_generate=false)")
    parser.add_argument("--prompt-tokens", type=int, default=4,
                        help="prompt length in tokens (RL prompts are hundreds to thousands)")
    parser.add_argument("--manager-set", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting of the manager under test (serve --set; default: none, the defaults a "
                             "user runs)")
    parser.add_argument("--compare-set", action="append", default=[], metavar="KEY=VALUE",
                        help="run a second manager with these settings in the same rounds (repeatable)")
    args = parser.parse_args()
    logs = Path(os.environ.get("BENCH_LOGS", "/tmp/bench-manager-overhead"))
    logs.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen] = []
    try:
        manager, backends = spawn_fake_cluster(logs, procs, *args.manager_set)
        manager_pid = procs[-1].pid
        lane_off, lane_off_pid = None, 0
        if not args.no_lane_off:
            lane_off = spawn_manager(logs / "manager_lane_off.log", procs, *args.manager_set,
                                     "http_fast_generate=false")
            lane_off_pid = procs[-1].pid
        compare, compare_pid = None, 0
        if args.compare_set:
            compare = spawn_manager(logs / "manager_compare.log", procs, *args.compare_set)
            compare_pid = procs[-1].pid
        router, router_pid = None, 0
        if not args.no_router:
            rport = free_port()
            procs.append(spawn([PY, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                                "--port", str(rport), "--prometheus-port", str(free_port()),  # not 29000
                                "--policy", "round_robin", "--log-level", "warn",
                                "--worker-urls", *backends], logs / "router.log"))
            router, router_pid = f"http://127.0.0.1:{rport}", procs[-1].pid
        fport = free_port()
        procs.append(spawn([PY, str(ROOT / "benchmarks/floor_proxy.py"), str(fport), *backends], logs / "floor.log"))
        floor, floor_pid = f"http://127.0.0.1:{fport}", procs[-1].pid
        pport = free_port()
        procs.append(spawn([PY, str(ROOT / "benchmarks/floor_proxy.py"), "--plain", str(pport), *backends],
                           logs / "plain_floor.log"))
        plain, plain_pid = f"http://127.0.0.1:{pport}", procs[-1].pid
        await register_backends(manager, backends)
        if lane_off:
            await register_backends(lane_off, backends)
        if compare:
            await register_backends(compare, backends)
        await wait_ok(floor + "/health")
        await wait_ok(plain + "/health")
        if router:
            await wait_ok(router + "/health", timeout=120)

        # (name, urls, the proxy's pid whose CPU is charged to each request; None: no proxy)
        paths: list[tuple[str, list[str], int | None]] = [("direct (client round-robin)", backends, None),
                                                          ("rollout-manager", [manager], manager_pid),
                                                          ("aiohttp floor (benchmarks/floor_proxy.py)", [floor],
                                                           floor_pid),
                                                          ("plain-protocol floor (floor_proxy.py --plain)", [plain],
                                                           plain_pid)]
        if lane_off:
            paths.insert(2, (LANE_OFF, [lane_off], lane_off_pid))
        compare_name = f"rollout-manager, {' '.join(args.compare_set)}"
        if compare:
            paths.insert(2, (compare_name, [compare], compare_pid))
        if router:
            paths.append(("sglang-router 0.3.2 round_robin", [router], router_pid))
        for _, urls, _pid in paths:  # warm-up: connections, caches, rate meters
            await load(urls, 400, args.concurrency, args.stream, args.prompt_tokens)
        runs: dict[str, list[dict[str, float]]] = {name: [] for name, _, _ in paths}
        for _ in range(args.rounds):  # interleaved, so background noise hits every path alike
            for name, urls, pid in paths:
                before = cpu_s(pid) if pid else 0.0
                r = await load(urls, args.requests, args.concurrency, args.stream, args.prompt_tokens)
                r["cpu_ms"] = 1000 * (cpu_s(pid) - before) / args.requests if pid else 0.0
                runs[name].append(r)
        results = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
        print(f"\n{args.requests} {'streaming' if args.stream else 'non-streaming'} requests of 8 tokens "
              f"after a {args.prompt_tokens}-token prompt, "
              f"{args.concurrency} concurrent, "
              f"2 instant fake backends, {os.cpu_count()} cores, median of {args.rounds} interleaved rounds\n")
        print("| path | req/s | p50 ms | p99 ms | proxy CPU ms/request |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for name, r in results.items():
            cpu = f"{r['cpu_ms']:.3f}" if r["cpu_ms"] else "-"
            print(f"| {name} | {r['rps']:.0f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {cpu} |")
        if router:
            ratio = results["rollout-manager"]["rps"] / results["sglang-router 0.3.2 round_robin"]["rps"]
            print(f"\nmanager / sglang-router throughput ratio: {ratio:.2f}")
            # Each round measures both back to back, so its ratio sees the same machine: steadier than the
            # ratio of medians when the machine's speed drifts during the run.
            paired = [m["rps"] / r["rps"] for m, r in zip(runs["rollout-manager"],
                                                          runs["sglang-router 0.3.2 round_robin"])]
            print(f"per round: {', '.join(f'{x:.2f}' for x in paired)}; median {statistics.median(paired):.2f}, "
                  f"worst {min(paired):.2f}")
        others = ("rollout-manager", *(["sglang-router 0.3.2 round_robin"] if router else []))
        if compare:
            print_paired(runs, compare_name, compare_name, others)
        if lane_off:
            print_paired(runs, LANE_OFF, "fast lane off", others)
    finally:
        stop_all(procs)


if __name__ == "__main__":
    asyncio.run(main())
