"""Instructions per short /generate request, counted by valgrind: a figure that does not move with the machine.

Wall and CPU time on a shared 2-core box vary by 20-50% from run to run, more than most changes to the
request path; instruction counts repeat to 0.1%. This runs the daemon's real app (``api.server.serve``:
the connection guard, middlewares, validation, generation, coalescing) in one process, with the engine
calls answered in process (no engine, no client library), driven by a minimal HTTP/1.1 client over
64 keep-alive connections on 127.0.0.1. The same load against a bare aiohttp handler that decodes the
body and answers (``--bare``) is the floor; the manager's own cost is the difference. The manager runs
twice, with the fast lane on and off (``http_fast_generate``; ``--no-lane-off`` skips the second).

    .venv/bin/python benchmarks/instructions_per_request.py                    # manager and bare, 4-token prompts
    .venv/bin/python benchmarks/instructions_per_request.py --prompt-tokens 4096
    .venv/bin/python benchmarks/instructions_per_request.py --root /path/to/other/checkout   # A/B two trees

(``--root``: a tree from commit 76170e3 on, where the engine calls it answers are coroutines.)

Needs valgrind (``apt-get install valgrind``); without it, CPU µs per request only (noisy). Each count
is the whole process (server and client) over the measured requests only (callgrind's collection is
switched on after the warm-up).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rollout_manager.cpu_engine.encode import output_chunk

HERE = Path(__file__).resolve()
CONNECTIONS = 64
LANE_OFF = "rollout-manager, fast lane off"
POLICY = os.environ.get("RM_BENCH_POLICY")  # the child's scheduler_policy (set from --policy)


def body(prompt_tokens: int) -> bytes:
    ids = [1000 + (t * 104729) % 150_000 for t in range(prompt_tokens)]
    return json.dumps({"input_ids": ids, "sampling_params": {"max_new_tokens": 8, "temperature": 0},
                       "stream": False}, separators=(",", ":")).encode()


def answer(wire: Any, b: Any) -> dict[str, Any]:
    if not isinstance(b, dict):  # a typed body (sglang.generate_request), as the manager sends it
        b = b.to_json()
    n = b["sampling_params"]["max_new_tokens"]
    return output_chunk(rid=b.get("rid", "r"), output_ids=list(range(5, 5 + n)), prompt_tokens=len(b["input_ids"]),
                             completion_tokens=n, finish=wire.finish_reason(wire.LENGTH, length=n),
                             weight_version="default", text="x" * n)


async def client(port: int, request: bytes, n: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    for _ in range(n):
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"{head!r} {await reader.read(300)!r}")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        await reader.readexactly(length)
    writer.close()


async def start_manager(port: int, lane: bool, lengths: bool = False) -> None:
    """The daemon's app, two instances marked active, engine calls answered in process."""
    from rollout_manager.api import server
    from rollout_manager.config import Config
    from rollout_manager.instances.registry import Kind, State
    from rollout_manager.manager import Manager
    from rollout_manager.sglang import coalesce, wire

    async def batch(session: Any, base_url: str, bodies: list[Any], bounds: Any) -> list[Any]:
        await asyncio.sleep(0)
        return [wire.GenerateChunk.of(answer(wire, b)) for b in bodies]

    async def once(session: Any, base_url: str, b: Any, bounds: Any) -> Any:
        return (await batch(session, base_url, [b], bounds))[0]

    coalesce.generate_batch_once = batch  # type: ignore[assignment]
    coalesce.generate_once = once  # type: ignore[assignment]
    built: list[Manager] = []
    init = Manager.__init__

    def keep(self: Manager, config: Config) -> None:
        init(self, config)
        built.append(self)

    Manager.__init__ = keep  # type: ignore[method-assign]
    policy = {"scheduler_policy": POLICY} if POLICY else {}  # else the default a user runs
    config = Config(bind=f"127.0.0.1:{port}", log_level="warning", health_check_interval_s=3600,
                    pending_poll_interval_s=3600, http_fast_generate=lane, length_prediction=lengths, **policy)
    ready = asyncio.Event()
    asyncio.ensure_future(server.serve(config, ready=ready))
    await ready.wait()
    for p in (1, 2):  # never contacted: the engine calls are answered above
        inst = built[0].registry.add("127.0.0.1", 1 + p, Kind.REMOTE)
        built[0].registry.transition(inst, State.ACTIVE, "benchmark")


async def start_bare(port: int) -> None:
    from aiohttp import web

    from rollout_manager import jsonutil
    from rollout_manager.sglang import wire

    async def generate(request: web.Request) -> web.Response:
        b = jsonutil.loads(await request.read())
        return web.Response(body=jsonutil.dumps(answer(wire, b)), content_type="application/json")

    app = web.Application()
    app.router.add_post("/generate", generate)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()


def callgrind(on: bool) -> None:
    if os.environ.get("UNDER_CALLGRIND"):
        subprocess.run(["callgrind_control", "-i", "on" if on else "off", str(os.getpid())], check=True,
                       capture_output=True)


async def child(bare: bool, prompt_tokens: int, requests: int, lane: bool, lengths: bool = False) -> None:
    from rollout_manager.osutil import free_port, tune_gc

    tune_gc(10_000)  # as the daemon's CLI does
    port = free_port()
    await (start_bare(port) if bare else start_manager(port, lane, lengths))
    b = body(prompt_tokens)
    request = (b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Content-Length: " + str(len(b)).encode() + b"\r\n\r\n" + b)
    per = max(1, requests // CONNECTIONS)
    await asyncio.gather(*(client(port, request, 10) for _ in range(CONNECTIONS)))  # warm-up
    callgrind(True)
    profile = os.environ.get("RM_BENCH_PROFILE")  # a cProfile of the measured requests (without valgrind)
    if profile:
        import cProfile
        profiler = cProfile.Profile()
        profiler.enable()
    t0 = time.process_time()
    await asyncio.gather(*(client(port, request, per) for _ in range(CONNECTIONS)))
    cpu = time.process_time() - t0
    if profile:
        profiler.disable()
        profiler.dump_stats(profile)
    callgrind(False)
    print(json.dumps({"requests": per * CONNECTIONS, "cpu_us": 1e6 * cpu / (per * CONNECTIONS)}), flush=True)
    os._exit(0)  # the daemon's tasks are not shut down: the figure is taken


def measure(root: Path, bare: bool, prompt_tokens: int, requests: int, lane: bool = True,
            lengths: bool = False) -> dict[str, float]:
    args = [sys.executable, str(HERE), "--child", "--root", str(root), "--prompt-tokens", str(prompt_tokens),
            "--requests", str(requests)] + (["--bare"] if bare else []) + ([] if lane else ["--lane-off"]) \
        + (["--length-prediction"] if lengths else [])
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as tmp:
        if shutil.which("valgrind") and shutil.which("callgrind_control"):
            env["UNDER_CALLGRIND"] = "1"
            args = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                    f"--callgrind-out-file={tmp}/cg.%p", *args]
        out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=1800)
        lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
        if not lines:
            raise RuntimeError(f"no figure:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
        result = lines[-1]
        collected = [line for line in out.stderr.splitlines() if "Collected :" in line]
        if collected:
            result["instructions"] = int(collected[-1].split(":")[-1]) / result["requests"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=HERE.parents[1], help="the checkout to measure")
    parser.add_argument("--prompt-tokens", type=int, default=4)
    parser.add_argument("--requests", type=int, default=1280, help="measured requests (after 640 of warm-up)")
    parser.add_argument("--bare", action="store_true", help="only the bare aiohttp handler")
    parser.add_argument("--no-lane-off", action="store_true", help="skip the manager with the fast lane off")
    parser.add_argument("--length-prediction", action="store_true",
                        help="the manager with length_prediction on (every request joins one prompt's group)")
    parser.add_argument("--policy", help="the manager's scheduler_policy (default: the default a user runs)")
    parser.add_argument("--lane-off", action="store_true", help=argparse.SUPPRESS)  # a child's setting
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.policy:
        os.environ["RM_BENCH_POLICY"] = args.policy  # the children's
    if args.child:
        sys.path.insert(0, str(args.root))
        import uvloop

        uvloop.run(child(args.bare, args.prompt_tokens, args.requests, lane=not args.lane_off,
                         lengths=args.length_prediction))
        return
    rows = [("bare aiohttp handler (decode, answer)", True, True)]
    if not args.bare:
        rows.append(("rollout-manager", False, True))
        if not args.no_lane_off:
            rows.append((LANE_OFF, False, False))
    print(f"{args.requests} non-streaming requests, {args.prompt_tokens}-token prompts, {CONNECTIONS} connections, "
          f"one process ({args.root}), scheduler_policy {args.policy or 'default'}\n")
    print("| server | instructions per request | CPU µs per request (without valgrind only; noisy) |")
    print("| --- | ---: | ---: |")
    figures = {}
    for name, bare, lane in rows:
        r = figures[name] = measure(args.root, bare, args.prompt_tokens, args.requests, lane,
                                    args.length_prediction and not bare)
        if "instructions" in r:
            print(f"| {name} | {r['instructions'] / 1000:,.0f}k | - |", flush=True)
        else:
            print(f"| {name} | - | {r['cpu_us']:.0f} |", flush=True)
    counts = {name: r["instructions"] for name, r in figures.items() if "instructions" in r}
    if len(counts) >= 2 and len(counts) == len(figures):
        bare_i, mgr_i = counts[rows[0][0]], counts["rollout-manager"]
        print(f"\nmanager / bare: {mgr_i / bare_i:.2f}x; the manager's own work: {(mgr_i - bare_i) / 1000:,.0f}k "
              f"instructions per request")
        if LANE_OFF in counts:
            off = counts[LANE_OFF]
            print(f"fast lane off / on: {off / mgr_i:.2f}x ({(off - mgr_i) / 1000:,.0f}k instructions per request "
                  f"more with the lane off); off / bare: {off / bare_i:.2f}x")


if __name__ == "__main__":
    main()
