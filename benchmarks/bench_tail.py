"""The tail of one GRPO step: the manager's makespan against a clairvoyant schedule, a lower bound,
sglang-router's round robin and the manager at an earlier revision, on one simulated fleet, in one run.

The fleet (``benchmarks/tail_fleet.py``, one process) serves boxes of three speeds over HTTP with SGLang's
scheduling shape (continuous batching, a running cap and a waiting queue, prefill priced with a prefix
cache, incremental streams); the step is ``--groups`` x ``--samples`` sequences whose lengths are lognormal,
correlated within a group, up to ``--cap``, decided by the fleet and unknown to the manager. Each path
runs the same step on the same fleet, its caches and counts reset before each:

- **clairvoyant**: the best longest-first plan ``tail_plan.clairvoyant`` finds knowing every length, sent
  straight to the boxes (each box's sequences in the plan's order, at most its running cap at once);
- **router**: sglang-router 0.3.2 round robin (installed on demand into a venv under ``--cache-dir``;
  without it, ``--no-router`` or a failed install, the benchmark sends round robin to the boxes itself
  and says so);
- **baseline**: the manager at ``--baseline-rev`` (a ``git worktree`` under ``--cache-dir``, run with this
  venv), settings ``--baseline-config``;
- **manager**: this checkout's manager, settings ``--manager-config`` (``key=value``, each passed as
  ``serve --set``; e.g. ``scheduler_policy=makespan``).

Requests go as the verl plugin sends them (``trainer_plugin.proxy.build_generate_body``: non-streaming
``/generate`` with ``rid``, ``trajectory_key``, ``group_key`` and a ``sampling_seed`` per sample, all at once).
Every output is checked against the model's reference (``tail_fleet.reference``); the fleet counts tokens
decoded at a position some box had made before (*regenerated*) apart from output tokens prefilled on a box
that lacked them (*re-prefilled*). Epochs after the first send the same prompts with new seeds to the same
managers (what history adds); with ``--restart`` each manager is stopped (SIGTERM) and started again before
each of those epochs, as a trainer resumed from a checkpoint restarts it, and with ``--state-file`` this
checkout's manager keeps what its scheduler learned in a file across the restart (``scheduler_state_file``,
one per seed under ``--cache-dir``). Seeds give independent runs (fresh managers, new prompts); the summary shows
each path's median and spread over seeds.

    .venv/bin/python benchmarks/bench_tail.py            # 3 seeds x 3 epochs, 64 x 8, ~15 min on 2 cores
    .venv/bin/python benchmarks/bench_tail.py --quick    # 2 seeds x 2 epochs at half the step time
    .venv/bin/python benchmarks/bench_tail.py --manager-config scheduler_policy=makespan
    .venv/bin/python benchmarks/bench_tail.py --no-router --epochs 2 --restart --state-file --baseline-rev HEAD
    .venv/bin/python benchmarks/bench_tail.py --fleet issue-46 --path batch --path single --no-baseline
    .venv/bin/python benchmarks/bench_tail.py --sweep issue-46,bench_tail --seeds 1 --epochs 1 --no-baseline

``--fleet`` (and the fleet options) runs another fleet of ``tail_fleet.SWEEP`` (shared with ``sim_tail.py``),
``--chunk-tokens`` the tokens per streamed chunk, ``--path`` the way the step reaches the manager (per-sample
``/generate`` as verl sends it, or without the manager's keys, or one NDJSON ``/batch_generate_requests`` with or
without ``group_key``), ``--sweep`` several fleets in turn.

The last line is ``tail: manager X.XXx of clairvoyant (worst W.WWx), router Y.YYx``: the first epoch, the median
and worst over seeds, fleets and manager paths, and round robin's median.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_manager_overhead import cpu_s, wait_ok
from tail_fleet import BENCH, OUTPUT_BASE, SWEEP, BoxSpec, LengthModel, Shape, length_of, prompt_key, reference
from tail_plan import Job, Plan, clairvoyant, lower_bound
from tail_procs import Procs, install_router, spawn_fleet, start_manager, start_router, worktree

from trainer_plugin.proxy import build_generate_body

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rollout-manager" / "bench-tail"
ROUTER = "sglang-router 0.3.2 round robin"
ROUND_ROBIN = "round robin (client-side; sglang-router unavailable)"
# How the step goes to a manager: per-sample non-streaming /generate as the verl plugin sends them (group_key,
# trajectory_key), the same without the manager's keys, or all of it in one NDJSON /batch_generate_requests with
# or without group_key.
PATHS = ("verl", "single", "batch", "batch-nokey")


@dataclass(frozen=True)
class Sample:
    """One sequence of the step: its group, prompt, sampling seed, and its length (the fleet's secret)."""

    index: int
    group: int
    prompt: list[int]
    seed: int
    length: int

    def rid(self, tag: str) -> str:
        return f"{tag}-g{self.group}-s{self.index}"


@dataclass
class Result:
    """One path's run of one step."""

    path: str
    seed: int
    epoch: int
    makespan: float
    exact: int
    total: int
    fleet: dict[str, Any]
    moved: int = 0  # sequences the manager ran on more than one box
    pieces: float = 0.0  # the manager's segments per sequence (engine calls it was made in)
    clairvoyant: float = 0.0
    bound: float = 0.0
    planned: float = 0.0
    shape: str = ""  # the fleet's name (tail_fleet.SWEEP)


@dataclass
class Step:
    samples: list[Sample]
    budget: int
    jobs: list[Job] = field(default_factory=list)


def make_step(seed: int, epoch: int, args: argparse.Namespace, model: LengthModel) -> Step:
    """``seed``'s prompts (the same every epoch) with this epoch's sampling seeds."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, OUTPUT_BASE) for _ in range(args.prompt_tokens)] for _ in range(args.groups)]
    seeds = random.Random(f"{seed}/{epoch}")
    samples: list[Sample] = []
    for g, prompt in enumerate(prompts):
        key = prompt_key(prompt)
        for _ in range(args.samples):
            s = seeds.getrandbits(31)
            samples.append(Sample(len(samples), g, prompt, s, length_of(key, s, model)))
    jobs = [Job(s.index, s.group, len(s.prompt), s.length) for s in samples]
    return Step(samples, args.cap, jobs)


def body_of(sample: Sample, step: Step, tag: str, manager: bool, keys: bool = True) -> dict[str, Any]:
    """The ``/generate`` body the verl plugin sends (the manager's fields only to a manager, and only with
    ``keys``)."""
    rid = sample.rid(tag)
    keyed = manager and keys
    body = build_generate_body(sample.prompt, {"temperature": 1.0, "max_new_tokens": step.budget,
                                               "sampling_seed": sample.seed}, rid,
                               prompt_length=len(sample.prompt), response_length=step.budget,
                               group_key=f"{tag}-uid{sample.group}" if keyed else None)
    if not keyed:
        body.pop("trajectory_key", None)
    return body


async def post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with session.post(url + "/generate", json=body) as r:
        if r.status == 400 and "group_key" in body and "group_key" in await r.text():
            return await post(session, url, {k: v for k, v in body.items() if k != "group_key"})  # an old manager
        if r.status != 200:
            raise RuntimeError(f"{url}/generate: HTTP {r.status}: {(await r.text())[:300]}")
        out: dict[str, Any] = await r.json()
        return out


async def post_batch(session: aiohttp.ClientSession, url: str, bodies: dict[int, dict[str, Any]]) -> Outputs:
    """Every body in one ``/batch_generate_requests`` (NDJSON back, one line per request as it finishes)."""
    outs: Outputs = {}
    async with session.post(url + "/batch_generate_requests", json=[[i, b] for i, b in bodies.items()]) as r:
        if r.status != 200:
            raise RuntimeError(f"{url}/batch_generate_requests: HTTP {r.status}: {(await r.text())[:300]}")
        async for raw in r.content:
            if not raw.strip():
                continue
            line = json.loads(raw)
            if not line.get("success"):
                raise RuntimeError(f"{url}/batch_generate_requests: request {line.get('id')} failed: {line}")
            outs[int(line["id"])] = line["data"]
    return outs


class Fleet:
    """The fleet process's boxes and its account."""

    def __init__(self, urls: list[str], pid: int) -> None:
        self.urls, self.pid = urls, pid

    async def reset(self, s: aiohttp.ClientSession) -> None:
        async with s.post(self.urls[0] + "/fleet/reset") as r:
            assert r.status == 200

    async def stats(self, s: aiohttp.ClientSession) -> dict[str, Any]:
        async with s.get(self.urls[0] + "/fleet/stats") as r:
            out: dict[str, Any] = await r.json()
            return out


async def run_path(control: aiohttp.ClientSession, fleet: Fleet, step: Step, path: str, tag: str, *,
                   urls: list[str] | None = None, plan: Plan | None = None, caps: list[int] | None = None,
                   manager: bool = False, seed: int = 0, epoch: int = 0, model: LengthModel,
                   how: str = "verl") -> Result:
    """One step through one path; its makespan (first send to last answer) and the fleet's counts. The
    requests go on connections of their own, each closed after its answer: a connection kept idle may be closed by
    the server meanwhile (the manager keeps at most 256 idle per client), and a request sent on it would fail."""
    await fleet.reset(control)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None),
                                     connector=aiohttp.TCPConnector(limit=0, force_close=True)) as s:
        makespan, outs = await send_step(s, fleet, step, tag, urls, plan, caps, manager, how)
    exact = sum(1 for x in step.samples
                if outs[x.index]["output_ids"] == reference(x.prompt, x.seed, step.budget, model))
    segments = [o["meta_info"].get("segments") or [] for o in outs.values()]
    moved = sum(1 for segs in segments if len({sg.get("endpoint") for sg in segs}) > 1)
    pieces = sum(len(segs) for segs in segments) / len(segments)
    return Result(path, seed, epoch, makespan, exact, len(step.samples), await fleet.stats(control), moved, pieces)


Outputs = dict[int, dict[str, Any]]


async def send_step(s: aiohttp.ClientSession, fleet: Fleet, step: Step, tag: str, urls: list[str] | None,
                    plan: Plan | None, caps: list[int] | None, manager: bool,
                    how: str = "verl") -> tuple[float, Outputs]:
    """Send the step: by ``plan`` straight to the boxes, else all at once round robin over ``urls``, each
    sample a ``/generate`` of its own or (``how`` batch, a manager) all in one NDJSON batch."""
    outs: Outputs = {}
    t0 = time.monotonic()
    if plan is not None:
        assert caps is not None

        async def box_worker(url: str, queue: list[Job]) -> None:
            while queue:
                job = queue.pop(0)
                outs[job.index] = await post(s, url, body_of(step.samples[job.index], step, tag, False))

        workers = [box_worker(fleet.urls[b], queue) for b, jobs in enumerate(plan.boxes)
                   for queue in [list(jobs)] for _ in range(min(len(jobs), caps[b]))]
        await asyncio.gather(*workers)
    elif manager and how.startswith("batch"):
        assert urls and len(urls) == 1
        outs = await post_batch(s, urls[0], {x.index: body_of(x, step, tag, True, how == "batch")
                                             for x in step.samples})
    else:
        assert urls
        keys = how == "verl"

        async def one(sample: Sample) -> None:
            outs[sample.index] = await post(s, urls[sample.index % len(urls)],
                                            body_of(sample, step, tag, manager, keys))
        await asyncio.gather(*(one(x) for x in step.samples))
    return time.monotonic() - t0, outs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2 seeds x 2 epochs at half the step time (a few minutes)")
    p.add_argument("--groups", type=int, default=64)
    p.add_argument("--samples", type=int, default=8, help="per group")
    p.add_argument("--prompt-tokens", type=int, default=256)
    fleet = p.add_argument_group("the fleet and its step (default: --fleet's, bench_tail's own unless named)")
    fleet.add_argument("--fleet", choices=[s.name for s in SWEEP], default=BENCH.name,
                       help="a named fleet (tail_fleet.SWEEP, shared with sim_tail); the options below change it")
    fleet.add_argument("--median", type=float, default=None, help="median length of a group's median")
    fleet.add_argument("--group-sigma", type=float, default=None, help="lognormal sigma of the groups' medians")
    fleet.add_argument("--sample-sigma", type=float, default=None,
                       help="lognormal sigma of samples around their group's")
    fleet.add_argument("--cap", type=int, default=None, help="max_new_tokens, and the longest length drawn")
    fleet.add_argument("--speeds", default=None, help="one box per speed, comma separated")
    fleet.add_argument("--max-running", type=int, default=None, help="per box")
    fleet.add_argument("--base-ms", type=float, default=None, help="decode step at speed 1: base ...")
    fleet.add_argument("--per-seq-ms", type=float, default=None, help="... plus this per running sequence")
    fleet.add_argument("--prefill-ms", type=float, default=None, help="per uncached input token at speed 1")
    fleet.add_argument("--chunk-tokens", type=int, default=None,
                       help="tokens per streamed chunk: the managers' engine_stream_interval and the boxes' own "
                       "--stream-interval")
    p.add_argument("--sweep", default=None, metavar="FLEET,...",
                   help="run each named fleet in turn (\"all\": every one), one fleet process each; the fleet "
                   "options above are ignored; a summary over fleets last")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiplies the three times above")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=3, help="the same prompts again, to the same managers")
    p.add_argument("--path", action="append", choices=PATHS, default=None,
                   help="how the step goes to this checkout's manager (repeat for several, a fresh manager each): "
                   "verl (default; per-sample /generate with group_key and trajectory_key, as the plugin sends), "
                   "single (per-sample /generate without them), batch (one NDJSON /batch_generate_requests with "
                   "group_key), batch-nokey (the same without)")
    p.add_argument("--manager-config", action="append", default=[], metavar="KEY=VALUE",
                   help="a setting of the manager under test (serve --set); repeat")
    p.add_argument("--baseline-config", action="append", default=[], metavar="KEY=VALUE",
                   help="a setting of the baseline manager; repeat")
    p.add_argument("--baseline-rev", default="f5012fc", help="the manager before this work")
    p.add_argument("--no-baseline", action="store_true")
    p.add_argument("--no-router", action="store_true", help="round robin from the client instead of sglang-router")
    p.add_argument("--restart", action="store_true",
                   help="stop (SIGTERM) and start each manager again before every epoch after the first")
    p.add_argument("--state-file", action="store_true",
                   help="this checkout's manager keeps what its scheduler learned in a file (scheduler_state_file), "
                   "one per seed under --cache-dir, read again when --restart starts it")
    p.add_argument("--cache-dir", type=Path, default=CACHE,
                   help="the router's venv, the baseline's worktree, logs")
    args = p.parse_args(argv)
    if args.quick:
        args.seeds, args.epochs, args.time_scale = min(args.seeds, 2), min(args.epochs, 2), 0.5
    args.path = args.path or ["verl"]
    return with_shape(args, next(s for s in SWEEP if s.name == args.fleet), keep=True)


_SHAPED = {"median": "median", "group_sigma": "group_sigma", "sample_sigma": "sample_sigma", "cap": "cap",
           "max_running": "max_running", "base_ms": "base_ms", "per_seq_ms": "per_seq_ms", "prefill_ms": "prefill_ms",
           "chunk_tokens": "chunk_tokens"}


def with_shape(args: argparse.Namespace, shape: Shape, keep: bool = False) -> argparse.Namespace:
    """``args`` on ``shape``'s fleet: its figures where ``args`` gives none (``keep``) or in every case."""
    out = argparse.Namespace(**vars(args))
    out.fleet = shape.name
    for opt, field_name in _SHAPED.items():
        if not keep or getattr(out, opt) is None:
            setattr(out, opt, getattr(shape, field_name))
    if not keep or out.speeds is None:
        out.speeds = ",".join(f"{v:g}" for v in shape.speeds)
    return out


def specs_of(args: argparse.Namespace) -> list[BoxSpec]:
    k = args.time_scale
    return [BoxSpec(float(v), args.max_running, args.base_ms * k, args.per_seq_ms * k, args.prefill_ms * k)
            for v in args.speeds.split(",")]


async def bench(args: argparse.Namespace) -> list[Result]:
    specs = specs_of(args)
    caps = [sp.max_running for sp in specs]
    model = LengthModel(args.median, args.group_sigma, args.sample_sigma, args.cap)
    logs = args.cache_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    procs = Procs()
    results: list[Result] = []
    try:
        urls, pid = spawn_fleet(procs, specs, model, logs, args.chunk_tokens)
        fleet = Fleet(urls, pid)
        router_py = None if args.no_router else install_router(args.cache_dir)
        base_root = None if args.no_baseline else worktree(args.baseline_rev, args.cache_dir)
        cpu0, wall0 = cpu_s(pid), time.monotonic()
        timeout = aiohttp.ClientTimeout(total=None)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(force_close=True)) as s:
            for url in urls:
                await wait_ok(url + "/health")
            router_url = None
            if router_py is not None:
                router_url = await start_router(procs, router_py, urls, logs)
            chunk = [f"engine_stream_interval={args.chunk_tokens}"]
            for seed in range(args.seeds):
                settings: dict[str, tuple[Path, list[str], str]] = {}
                if base_root is not None:
                    settings["baseline"] = (base_root, chunk + args.baseline_config, "verl")
                for how in args.path:
                    name = manager_name(how)
                    settings[name] = (ROOT, chunk + args.manager_config + state_setting(args, seed, how), how)
                managers = {name: await start_manager(procs, root, config, urls, logs / f"{tag_of(name)}{seed}e0.log")
                            for name, (root, config, _) in settings.items()}
                for epoch in range(args.epochs):
                    if epoch and args.restart:  # as a resumed trainer restarts its manager
                        for name, (root, config, _) in settings.items():
                            procs.terminate(managers[name])
                            managers[name] = await start_manager(procs, root, config, urls,
                                                                 logs / f"{tag_of(name)}{seed}e{epoch}.log")
                    step = make_step(seed, epoch, args, model)
                    plan = clairvoyant(specs, step.jobs)
                    bound = lower_bound(specs, step.jobs)
                    tag = f"{seed}e{epoch}"
                    rows = [await run_path(s, fleet, step, "clairvoyant", tag + "c", plan=plan, caps=caps,
                                           seed=seed, epoch=epoch, model=model)]
                    if epoch == 0:
                        rr = ROUTER if router_url else ROUND_ROBIN
                        rows.append(await run_path(s, fleet, step, rr, tag + "r",
                                                   urls=[router_url] if router_url else urls,
                                                   seed=seed, epoch=epoch, model=model))
                    for name, (_, _, how) in settings.items():
                        rows.append(await run_path(s, fleet, step, name, tag + tag_of(name), urls=[managers[name]],
                                                   manager=True, seed=seed, epoch=epoch, model=model, how=how))
                    for r in rows:
                        results.append(replace(r, clairvoyant=rows[0].makespan, bound=bound, planned=plan.makespan,
                                               shape=args.fleet))
                        print(line(results[-1]), flush=True)
                for url in managers.values():
                    procs.stop(url)
        fleet_cpu = (cpu_s(pid) - cpu0) / (time.monotonic() - wall0)
    finally:
        procs.stop_all()
    report(results, args, specs, fleet_cpu)
    return results


def manager_name(how: str) -> str:
    """The row name of this checkout's manager sent the step by ``how`` (``PATHS``)."""
    return "manager" if how == "verl" else f"manager ({how})"


def tag_of(name: str) -> str:
    """A path's short tag in rids and log names."""
    return "b" if name == "baseline" else "m" + (name[len("manager ("):-1] if name != "manager" else "")


def state_setting(args: argparse.Namespace, seed: int, how: str) -> list[str]:
    """``scheduler_state_file`` for this seed's manager under test (a fresh file: each seed has new prompts)."""
    if not args.state_file:
        return []
    path = args.cache_dir / "state" / f"scheduler-{seed}-{how}.msgpack"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    return [f"scheduler_state_file={path}"]


def line(r: Result) -> str:
    f = r.fleet
    return (f"| {r.seed} | {r.epoch} | {r.path} | {r.makespan:.2f} | {r.makespan / r.clairvoyant:.2f} | "
            f"{r.makespan / r.bound:.2f} | {f['regenerated']} | {f['prefill_output']} | {r.moved} | {r.pieces:.2f} | "
            f"{r.exact}/{r.total} | {f['late_s'] * 1000:.0f} |")


def machine() -> str:
    """The CPU model, its cores and the Python that ran the benchmark."""
    model = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                  if ln.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return f"{model}, {os.cpu_count()} cores, Python {platform.python_version()}"


def report(results: list[Result], args: argparse.Namespace, specs: list[BoxSpec], fleet_cpu: float) -> None:
    first = [r for r in results if r.epoch == 0]
    c0 = [r for r in first if r.path == "clairvoyant"]
    print(f"\nmachine: {machine()}")
    print(f"fleet: {len(specs)} boxes, speeds {args.speeds}, {args.max_running} running at most each, decode step "
          f"({specs[0].base_ms:g} + {specs[0].per_seq_ms:g} x running) ms / speed, prefill {specs[0].prefill_ms:g} "
          f"ms per token / speed; fleet process CPU {100 * fleet_cpu:.0f}% of one core over the run")
    print(f"step: {args.groups} groups x {args.samples} samples, lengths lognormal (groups' median {args.median:g}, "
          f"sigma {args.group_sigma:g}; samples sigma {args.sample_sigma:g}), cap {args.cap}; "
          f"clairvoyant plan simulated / lower bound: "
          + ", ".join(f"{r.planned / r.bound:.2f}" for r in c0))
    print("\n| seed | epoch | path | makespan s | / clairvoyant | / lower bound | tokens regenerated | output tokens "
          "re-prefilled | sequences moved | segments per sequence | outputs exact | fleet's worst step lag ms |")
    print("| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |")
    for r in results:
        print(line(r))
    paths = list(dict.fromkeys(r.path for r in results))
    print("\nfirst epoch, over seeds: median (worst, best) of makespan / clairvoyant, and / lower bound")
    for path in paths:
        rs = [r.makespan / r.clairvoyant for r in first if r.path == path]
        bs = [r.makespan / r.bound for r in first if r.path == path]
        print(f"- {path}: {statistics.median(rs):.2f}x (worst {max(rs):.2f}, best {min(rs):.2f}); "
              f"lower bound {statistics.median(bs):.2f}x ({min(bs):.2f}-{max(bs):.2f})")
    if args.epochs > 1:
        print("\nhistory: median over seeds of makespan / clairvoyant by epoch (worst)")
        for path in paths:
            per = [[r.makespan / r.clairvoyant for r in results if r.path == path and r.epoch == e]
                   for e in range(args.epochs)]
            if path != "clairvoyant" and all(per):
                print(f"- {path}: " + ", ".join(f"epoch {e} {statistics.median(v):.2f}x ({max(v):.2f})"
                                                for e, v in enumerate(per)))
    bad = [r for r in results if r.exact != r.total]
    regen = sum(r.fleet["regenerated"] for r in results)
    print(f"\noutputs equal to the reference: {'all' if not bad else 'NOT all'}; "
          f"tokens regenerated over the run: {regen}")


def conclude(results: list[Result]) -> None:
    """The last lines: per fleet, then over every fleet, path and seed, this checkout's manager's first epoch
    (median and worst) and round robin's; exits 1 where an output was not the reference."""
    first = [r for r in results if r.epoch == 0]
    fleets = list(dict.fromkeys(r.shape for r in results))
    mine = [r.makespan / r.clairvoyant for r in first if r.path.startswith("manager")]
    rr = [r.makespan / r.clairvoyant for r in first if r.path in (ROUTER, ROUND_ROBIN)]
    if len(fleets) > 1:
        print("\nover fleets, first epoch, this checkout's manager (every path): median (worst) of makespan / "
              "clairvoyant")
        for name in fleets:
            xs = [r.makespan / r.clairvoyant for r in first if r.shape == name and r.path.startswith("manager")]
            print(f"- {name}: {statistics.median(xs):.2f}x ({max(xs):.2f})")
    nan = float("nan")
    print(f"tail: manager {statistics.median(mine) if mine else nan:.2f}x of clairvoyant (worst "
          f"{max(mine) if mine else nan:.2f}x), router {statistics.median(rr) if rr else nan:.2f}x")
    if any(r.exact != r.total for r in results):
        sys.exit(1)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    names = None if args.sweep is None else \
        [s.name for s in SWEEP] if args.sweep == "all" else args.sweep.split(",")
    results: list[Result] = []
    if names is None:
        results += asyncio.run(bench(args))
    else:
        for name in names:
            shape = next((s for s in SWEEP if s.name == name), None)
            if shape is None:
                raise SystemExit(f"--sweep: no fleet {name!r}; fleets: {', '.join(s.name for s in SWEEP)}")
            print(f"\n## fleet {shape.describe()}", flush=True)
            results += asyncio.run(bench(with_shape(args, shape)))
    conclude(results)


if __name__ == "__main__":
    main()
