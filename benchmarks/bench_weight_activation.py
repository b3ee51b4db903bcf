"""Weight updates while a fleet generates: ``weight_activation = "drain"`` against ``"staged"``, same seed.

A fleet of ``--boxes`` CPU-engine boxes (engine + receiver agent each, real processes, real HTTP, weights over
plain TCP) generates RL-shaped sequences through a real manager: a closed loop keeps ``--concurrency``
sequences per box in flight, greedy, output lengths drawn from a seeded lognormal (long tail, capped at
``--max-tokens``). Every ``--publish-every-s`` the trainer (a SenderAgent in this process) stages a new
version and publishes it (``/update_weight_version``, not waiting). Each decoding round takes
``--token-delay-s`` (the GPU's step time) and each weight load ``--load-s`` (the engine's load_delay_s fault;
the tiny model's own load is instant). After ``--duration-s`` no new sequence starts and the run ends when
the last one finishes. Runs: ``none`` (no updates: the throughput baseline), ``drain``, ``staged``; the same
boxes, a fresh manager per run, the same request stream (seeded).

Printed per run: per box per version, seconds out of service (not generating: drain, transfer, verify and
load in drain; the activation pause in staged), from the manager's ``weight_versions.paused_s``; tokens
aborted or regenerated (what the engines generated minus what callers received) and sequences moved; per
version the time from publish until every box serves it; rollout tokens/s over the run window; the share of
tokens made by an older version than the newest published when they arrived. Last line:
``staged/drain out-of-service ratio: X`` (mean seconds out of service per box per version).

    .venv/bin/python benchmarks/bench_weight_activation.py            # about 5 minutes on 2 cores

On a machine of few cores the CPU engines are compute-bound (every decoding round is a full forward of each
sequence, and the boxes share the cores): a box out of service hands its CPU to the others, so tokens/s
hides the drain's cost there; the seconds out of service do not.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
from bench_manager_overhead import PY, free_port, spawn, stop_all, wait_ok

from rollout_manager.cpu_engine.model import build_model

MODEL = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
         "num_key_value_heads": 1, "max_position_embeddings": 4096}


@dataclass
class Run:
    mode: str
    window_tokens: int = 0  # received inside [t0, t0 + duration]
    old_tokens: int = 0  # of those, made by a version older than the newest published when they arrived
    delivered: int = 0  # every token callers received
    generated: int = 0  # every token the engines made
    moved: int = 0  # sequences with more than one segment on different boxes
    reprefilled: int = 0  # prompt + output tokens re-prefilled where a sequence moved
    failed: int = 0
    published: dict[int, float] = field(default_factory=dict)  # version -> time published
    all_serving: dict[int, float] = field(default_factory=dict)  # version -> first time every box served it
    paused: dict[str, dict[int, float]] = field(default_factory=dict)  # box -> version -> seconds
    duration: float = 0.0


def lengths(n: int, median: float, sigma: float, cap: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [max(4, min(cap, round(rng.lognormvariate(math.log(median), sigma)))) for _ in range(n)]


async def generate(s: aiohttp.ClientSession, manager: str, body: dict[str, Any], run: Run, t0: float,
                   end: float, newest: list[int]) -> None:
    made = 0
    async with s.post(manager + "/generate", json={**body, "stream": True}) as r:
        if r.status != 200:
            run.failed += 1
            return
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            meta = chunk["meta_info"]
            new, made = meta["completion_tokens"] - made, meta["completion_tokens"]
            now = time.monotonic()
            if t0 <= now <= end:
                run.window_tokens += new
                version = meta.get("weight_version") or "0"
                if version.isdigit() and int(version) < newest[0]:
                    run.old_tokens += new
            if meta.get("finish_reason") is not None:
                if meta["finish_reason"].get("type") == "abort":
                    run.failed += 1
                segments = meta.get("segments") or []
                if len({sg["endpoint"] for sg in segments}) > 1:
                    run.moved += 1
                    run.reprefilled += sum(len(body["input_ids"]) + sg["end"] for sg in segments[1:])
    run.delivered += made


async def engine_generated(s: aiohttp.ClientSession, engines: list[str]) -> int:
    total = 0
    for url in engines:
        async with s.get(url + "/server_info") as r:
            total += int((await r.json())["cpu_engine"]["total_generated_tokens"])
    return total


async def one_run(mode: str, args: argparse.Namespace, engines: list[str], receivers: list[int], logs: Path,
                  procs: list[Any]) -> Run:
    from rollout_manager.weights.sender_agent import SenderAgent

    run = Run(mode)
    sender_port = free_port()
    mport = free_port()
    sets = ["pending_poll_interval_s=0.1", "health_check_path=/health", "health_check_interval_s=5",
            "weight_transport=tcp", f"weight_sender_base_port={sender_port}", "allowed_sender_ips=127.0.0.0/8",
            f"weight_activation={'drain' if mode == 'none' else mode}", "weight_push_retry_s=0.2",
            "peer_bootstrap=false", "tail_migration=false"]
    manager = spawn([PY, "-m", "rollout_manager", "serve", "--bind", f"127.0.0.1:{mport}", "--log-level", "warning",
                     *[a for kv in sets for a in ("--set", kv)]], logs / f"manager-{mode}.log")
    url = f"http://127.0.0.1:{mport}"
    sender = SenderAgent(["127.0.0.1"], sender_port).start()
    try:
        await wait_ok(url + "/health")
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as s:
            async with s.put(url + "/update_weight_senders", json={
                    "weight_sender_ips": [["127.0.0.1"]], "num_mooncake_groups_per_sender": 1,
                    "num_mooncake_engines_per_group": 1}) as r:
                assert r.status == 200, await r.text()
            for eng, rport in zip(engines, receivers):
                port = int(eng.rsplit(":", 1)[1])
                async with s.post(url + "/register_rollout_instance", json={
                        "host": "127.0.0.1", "port": port, "weight_receiver_port": rport}) as r:
                    assert r.status == 200, await r.text()
            while True:
                async with s.get(url + "/get_instances_status") as r:
                    if (await r.json())["ready_instances"] == len(engines):
                        break
                await asyncio.sleep(0.1)
            rng = random.Random(args.seed)
            budgets = iter(lengths(100000, args.median_tokens, args.sigma, args.max_tokens, args.seed))
            generated0 = await engine_generated(s, engines)
            newest = [0]
            t0 = time.monotonic()
            end = t0 + args.duration_s

            async def worker() -> None:
                while time.monotonic() < end:
                    body = {"input_ids": [rng.randrange(1, 250) for _ in range(args.prompt_tokens)],
                            "sampling_params": {"max_new_tokens": next(budgets), "temperature": 0,
                                                "ignore_eos": True}}
                    await generate(s, url, body, run, t0, end, newest)

            async def publisher() -> None:
                version = 0
                while mode != "none" and time.monotonic() + args.publish_every_s < end:
                    await asyncio.sleep(t0 + (version + 1) * args.publish_every_s - time.monotonic())
                    version += 1
                    state = {n: t.clone() for n, t in build_model(1000 + version, **MODEL).state_dict().items()}
                    await asyncio.to_thread(sender.stage, state, version)
                    async with s.post(url + "/update_weight_version", json={"new_version": version}) as r:
                        assert r.status == 200, await r.text()
                    run.published[version] = time.monotonic()
                    newest[0] = version

            async def monitor() -> None:
                while True:
                    async with s.get(url + "/get_instances_status") as r:
                        st = await r.json()
                    now = time.monotonic()
                    serving = min((i["weight_versions"]["active"] for i in st["instances"]), default=0)
                    for v in run.published:
                        if v <= serving and v not in run.all_serving:
                            run.all_serving[v] = now
                    await asyncio.sleep(0.05)

            mon = asyncio.ensure_future(monitor())
            await asyncio.gather(publisher(), *[worker() for _ in range(args.concurrency * len(engines))])
            run.duration = time.monotonic() - t0
            deadline = time.monotonic() + 120  # the last version reaches every box
            while len(run.all_serving) < len(run.published) and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            mon.cancel()
            run.generated = await engine_generated(s, engines) - generated0
            async with s.get(url + "/get_instances_status") as r:
                st = await r.json()
            for i, inst in enumerate(sorted(st["instances"], key=lambda x: x["port"])):
                run.paused[f"box{i}"] = {int(v): sec for v, sec in inst["weight_versions"]["paused_s"].items()}
    finally:
        sender.stop()
        stop_all([manager])
    return run


def report(run: Run, args: argparse.Namespace) -> float:
    """Print one run; returns mean seconds out of service per box per published version."""
    versions = sorted(run.published)
    boxes = sorted(run.paused)
    print(f"\n### {run.mode}\n")
    if versions:
        print("seconds out of service per box (columns) per version (rows); '-': the box skipped that version\n")
        print("| version | " + " | ".join(boxes) + " | publish -> all serving s |")
        print("| ---: |" + " ---: |" * (len(boxes) + 1))
        for v in versions:
            cells = [f"{run.paused[b][v]:.2f}" if v in run.paused[b] else "-" for b in boxes]
            reach = run.all_serving.get(v)
            print(f"| {v} | " + " | ".join(cells) + f" | {reach - run.published[v]:.2f} |" if reach is not None
                  else f"| {v} | " + " | ".join(cells) + " | never |")
    per_box = [sum(run.paused[b].values()) for b in boxes]
    mean = sum(per_box) / len(per_box) / len(versions) if versions and per_box else 0.0
    reached = [run.all_serving[v] - run.published[v] for v in versions if v in run.all_serving]
    print(f"\n- versions published: {len(versions)}; out of service per box per version: {mean:.3f} s "
          f"(per box over the run: {min(per_box, default=0):.2f}-{max(per_box, default=0):.2f} s)")
    if versions:
        print(f"- publish -> every box serving it: mean {sum(reached) / max(len(reached), 1):.2f} s, "
              f"max {max(reached, default=0):.2f} s ({len(reached)}/{len(versions)} versions reached every box)")
    print(f"- tokens aborted or regenerated: {max(run.generated - run.delivered, 0)} (engines made "
          f"{run.generated}, callers received {run.delivered}); sequences moved: {run.moved} "
          f"(re-prefilled {run.reprefilled} tokens); failed: {run.failed}")
    print(f"- rollout tokens/s over the {args.duration_s:g} s window: {run.window_tokens / args.duration_s:.0f}")
    print(f"- tokens made by an older version than the newest published: "
          f"{100 * run.old_tokens / max(run.window_tokens, 1):.1f}%")
    return mean


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--boxes", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=2, help="sequences in flight per box")
    p.add_argument("--duration-s", type=float, default=40.0)
    p.add_argument("--publish-every-s", type=float, default=5.0)
    p.add_argument("--median-tokens", type=float, default=100)
    p.add_argument("--sigma", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=2000, help="cap of the drawn lengths")
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--token-delay-s", type=float, default=0.05, help="each decoding round (the GPU's step)")
    p.add_argument("--load-s", type=float, default=0.25, help="each weight load (the engine's load_delay_s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", default="none,drain,staged")
    args = p.parse_args()
    logs = Path(os.environ.get("BENCH_LOGS", "/tmp/bench-weight-activation"))
    logs.mkdir(parents=True, exist_ok=True)
    procs: list[Any] = []
    runs: dict[str, Run] = {}
    try:
        engines, receivers = [], []
        for _ in range(args.boxes):
            port, rport = free_port(), free_port()
            procs.append(spawn([PY, "-m", "rollout_manager.cpu_engine", "--port", str(port), "--seed", "0",
                                "--model-config", json.dumps(MODEL), "--token-delay-s", str(args.token_delay_s),
                                "--load-delay-s", str(args.load_s), "--log-level", "WARNING"],
                               logs / f"engine-{port}.log"))
            procs.append(spawn([PY, "-m", "rollout_manager.weights.receiver_agent", "--host", "127.0.0.1",
                                "--port", str(rport), "--sglang-url", f"http://127.0.0.1:{port}",
                                "--log-level", "warning"], logs / f"receiver-{rport}.log"))
            engines.append(f"http://127.0.0.1:{port}")
            receivers.append(rport)
        for eng, rport in zip(engines, receivers):
            await wait_ok(eng + "/health", timeout=300)
            await wait_ok(f"http://127.0.0.1:{rport}/health", timeout=300)
        for mode in args.modes.split(","):
            runs[mode] = await one_run(mode, args, engines, receivers, logs, procs)
    finally:
        stop_all(procs)
    print(f"\n{args.boxes} CPU-engine boxes, {args.concurrency} sequences in flight each, lognormal lengths (median "
          f"{args.median_tokens:g}, sigma {args.sigma:g}, cap {args.max_tokens}), {args.token_delay_s * 1000:g} ms "
          f"a decoding round, {args.load_s:g} s a load, a version every {args.publish_every_s:g} s for "
          f"{args.duration_s:g} s, seed {args.seed}")
    means = {mode: report(run, args) for mode, run in runs.items()}
    if "none" in runs:
        base = runs["none"].window_tokens
        for mode in ("drain", "staged"):
            if mode in runs:
                print(f"\n{mode}: rollout tokens/s {100 * runs[mode].window_tokens / max(base, 1):.1f}% of the run "
                      f"without updates")
    if "drain" in means and "staged" in means:
        print(f"\nstaged/drain out-of-service ratio: {means['staged'] / max(means['drain'], 1e-9):.3f}")


if __name__ == "__main__":
    asyncio.run(main())
