"""The trust probe, quarantine and the trainer's drop of distrusted samples, measured where they can fail: boxes
that differ as bf16 GPU boxes do, faults as subtle as real ones, a probe interval in proportion to the default.

A manager (quarantine on) and 3 CPU engines of the same weights, each behind ``noisy_box.py``: the probe's
log-probs move with the box's batch composition at the probe by the spread measured on an H100 in bf16, and the
box says it serves bf16 (so the manager judges it with bf16's tolerance, 0.3, widened to 4 times the fleet's
spread). The engines' ``lm_head`` is scaled so their logits have a standard deviation of about 3, the point of
the GPU measurement (spread 0.117), so a fault moves the probe about as it moves an 8B model's there. Greedy
requests with log-probs go through the manager all along, from 12 clients. Parts, each printing its own line:

1. sensitivity (exact, no manager): how far each fault moves the probe's mean |log-prob difference| on this
   model at logit deviations 1, 3 and 8, against the tolerance the fleet applies there (0.3 when two boxes share
   a composition, up to 4 times the bf16 spread when they all differ): one weight matrix (any of a layer's
   seven, either layer) replaced by a wrong one of its own magnitude, 5% and 1% noise on one matrix;
2. clean fleets that differ: probes counted (every ``--clean-interval-s``: what can fail is each probe, so the
   count matters, not the interval) with compositional spreads of 0.117 and 0.388 (logit deviations 3 and 8);
   every "disagrees" and quarantine there is false;
3. a wrong tensor (``--runs``): at a random moment of the probe cycle, one matrix of one box's engine is
   replaced by a fresh draw of its own mean magnitude through ``/update_weights_from_tensor`` (no version: the
   box still says it serves the one it had). Measured: the time to the quarantine in probe intervals, the
   tokens the box made on the wrong weights that were delivered, of them those left in answers the trainer
   keeps after the catch (dropped as ``trainer_plugin.distrust`` drops them), and those an actor update would
   have trained before the catch: with an update every S seconds at a random phase, an answer received at t
   is trained before the catch c with probability min(1, (c - t) / S). The interval is ``--interval-s``, not the
   default 60 s: every figure is given in intervals or per interval's output, which is what carries over;
4. small noise (``--subtle-runs``): the CPU engine's silent ``perturb_tensor`` fault, 5% noise on one matrix,
   watched for ``--watch-intervals`` intervals: whether it is caught, its probe's distance, and its tokens kept;
5. cost: one probe straight to a box against a whole-model load, and what the default interval costs;
6. the old read-back (``benchmarks/bench_readback.py`` on this CPU, ``--readback-rows``; the H200 figure as
   recorded).

A token is "made on corrupted weights" when its log-prob differs from the clean model's by more than 1e-5
(clean tokens differ by about 1e-6 at most; the probe's noise is added to the probe's answers only).

Last line: ``trust: wrong tensor caught in N of N runs in X intervals (worst Y; seconds at the default), K bad
tokens kept after the catch (worst run), S% (worst W%) trained before it at a step of one interval; 5% noise
caught in A of B; F false quarantines in P probes (per clean fleet, and in the fault runs)``. About 5 minutes
on a 2-core machine; ``--quick`` about 70 s.

    .venv/bin/python benchmarks/bench_trust.py [--quick] [--runs 5] [--subtle-runs 2] [--interval-s 2]
        [--clean-probes 1000] [--readback-rows 16032] [--seed N]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_manager_overhead import spawn, spawn_manager, stop_all, wait_ok
from bench_reliability import register, status

from rollout_manager.config import Config
from rollout_manager.cpu_engine.model import TinyCausalLM, build_model
from rollout_manager.instances.trust import BF16_TOLERANCE, SPREAD_FACTOR
from rollout_manager.osutil import free_port
from rollout_manager.sglang import tensor_payload, wire
from rollout_manager.sglang.logprob_probe import PROBE_RID_PREFIX, prefill_logprobs, probe_ids, probe_limit
from trainer_plugin.distrust import distrusted_rows, key_of

PY = sys.executable
HERE = Path(__file__).resolve().parent
BAD_LOGPROB = 1e-5  # a token's log-prob this far from the clean model's was made on corrupted weights
VOCAB = 256  # the CPU engine's tiny model
DEFAULT_INTERVAL_S = float(Config.model_fields["trust_probe_interval_s"].default)
# Logit deviation -> the probe's spread between batch compositions measured on an H100 in bf16
# (benchmarks/measure_probe_spread_gpu.py; docs/reliability.md, "Trust probe").
GPU_BF16_SPREAD = {1.0: 0.039, 3.0: 0.117, 8.0: 0.388}
LOGIT_SCALE = 3.0  # the live fleet's lm_head multiplier: logits of deviation ~3 (the engine's own are ~1)
MATRICES = tuple(f"model.layers.{layer}.{part}.weight" for layer in (0, 1)
                 for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                              "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"))
STEPS = (1.0, 5.0)  # actor-update periods, in probe intervals, for "trained before the catch"
H200_READBACK = ("28.3 s and +21.6 GiB of host memory for 128,256 x 4,096 bf16 (recorded: "
                 "benchmarks/bench_readback.py on one NVIDIA H200 box, docs/sglang-contract.md; not rerun here)")


# ---------------------------------------------------------------- the model and its faults
def clean_model(scale: float = LOGIT_SCALE) -> TinyCausalLM:
    """The engines' weights (``--seed 0``) with ``lm_head`` times ``scale``."""
    model = build_model(0)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    return model


def wrong_tensor(t: torch.Tensor, seed: int) -> torch.Tensor:
    """Another tensor of ``t``'s shape and mean magnitude (a misplaced or stale write, not noise on ``t``)."""
    draw = torch.randn(t.shape, generator=torch.Generator().manual_seed(seed))
    return (draw * (t.abs().mean() / draw.abs().mean())).contiguous()


def noisy_tensor(t: torch.Tensor, fraction: float, seed: int) -> torch.Tensor:
    """``t`` plus noise of ``fraction`` of its mean magnitude (the CPU engine's ``perturb_tensor`` fault)."""
    draw = torch.randn(t.shape, generator=torch.Generator().manual_seed(seed))
    return (t + draw * (fraction * float(t.abs().mean()))).contiguous()


def mean_abs_diff(a: Sequence[float | None], b: Sequence[float | None]) -> float:
    pairs = [(x, y) for x, y in zip(a, b) if x is not None and y is not None]
    return sum(abs(x - y) for x, y in pairs) / len(pairs)


def probe_move(model: TinyCausalLM, name: str, changed: torch.Tensor) -> float:
    """How far ``changed`` in place of ``name`` moves the probe's mean |log-prob difference| (exact, fp32)."""
    ids = probe_ids(probe_limit(VOCAB) or VOCAB)
    before = model.input_logprobs(ids, 1)
    target = model.named_tensors()[name]
    kept = target.detach().clone()
    with torch.no_grad():
        target.copy_(changed)
        after = model.input_logprobs(ids, 1)
        target.copy_(kept)
    return mean_abs_diff(before, after)


def tolerance_range(spread: float) -> tuple[float, float]:
    """The tolerance a 3-box bf16 fleet applies: the floor when two boxes share a composition (the fleet's
    spread is then 0), the spread-widened one when every box's composition differs."""
    return BF16_TOLERANCE, max(BF16_TOLERANCE, SPREAD_FACTOR * spread)


def sensitivity() -> list[str]:
    lines = []
    for scale, spread in GPU_BF16_SPREAD.items():
        model = clean_model(scale)
        named = model.named_tensors()
        low, high = tolerance_range(spread)
        faults = {"one matrix replaced by a wrong one of its magnitude":
                  [probe_move(model, n, wrong_tensor(named[n], s)) for n in MATRICES for s in (1, 2)],
                  "5% noise on one matrix": [probe_move(model, n, noisy_tensor(named[n], 0.05, s))
                                             for n in MATRICES for s in (1, 2)],
                  "1% noise on one matrix": [probe_move(model, n, noisy_tensor(named[n], 0.01, s))
                                             for n in MATRICES for s in (1, 2)]}
        parts = [f"{what} {min(m):.3g}-{max(m):.3g} (seen in any compositions, beyond {high + spread:.3g}: "
                 f"{sum(x > high + spread for x in m)} of {len(m)}; never, below {max(low - spread, 0):.3g}: "
                 f"{sum(x + spread <= low for x in m)})" for what, m in faults.items()]
        lines.append(f"sensitivity, logits of deviation {scale:g} (bf16 spread {spread:g}, tolerance {low:g} to "
                     f"{high:.3g}): " + "; ".join(parts))
    return lines


# ---------------------------------------------------------------- the fleet
@dataclass
class Answer:
    rid: str
    received: float  # monotonic
    prompt: list[int]
    output: list[int]
    logprobs: list[float]
    segments: list[dict[str, Any]]


@dataclass
class Managed:
    """A manager and the noisy boxes it knows (proxy endpoint -> the engine behind it)."""

    url: str
    engine_of: dict[str, str]
    procs: list[subprocess.Popen[bytes]]

    @property
    def eps(self) -> list[str]:
        return list(self.engine_of)


async def post_json(s: aiohttp.ClientSession, url: str, body: Any) -> Any:
    async with s.post(url, json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status} {(await r.text())[:200]}")
        return await r.json(content_type=None)


async def get_json(s: aiohttp.ClientSession, url: str) -> Any:
    async with s.get(url) as r:
        return await r.json(content_type=None)


async def write_tensors(s: aiohttp.ClientSession, engine: str, named: list[tuple[str, torch.Tensor]]) -> None:
    """Load tensors into an engine through its own weight-update session, no version given."""
    payload = [tensor_payload.serialize_named_tensors(named)]
    for path, body in ((wire.BEGIN_WEIGHT_UPDATE, {}),
                       (wire.UPDATE_WEIGHTS_FROM_TENSOR,
                        wire.update_weights_from_tensor_body(payload, flush_cache=False, weight_version=None)),
                       (wire.END_WEIGHT_UPDATE, {})):
        await post_json(s, f"http://{engine}{path}", body)


async def start_managed(logs: Path, engines: list[str], interval_s: float, spread: float, tag: str) -> Managed:
    procs: list[subprocess.Popen[bytes]] = []
    engine_of = {}
    for k, engine in enumerate(engines):
        port = free_port()
        procs.append(spawn([PY, str(HERE / "noisy_box.py"), "--port", str(port), "--upstream", engine,
                            "--spread", str(spread)], logs / f"{tag}-proxy{k}.log"))
        engine_of[f"127.0.0.1:{port}"] = engine
    url = spawn_manager(logs / f"{tag}-manager.log", procs, f"trust_probe_interval_s={interval_s}",
                        "quarantine=true", "quarantine_recheck_s=0.5")
    managed = Managed(url, engine_of, procs)
    try:
        await wait_ok(url + wire.HEALTH)
        await register(url, managed.eps)
    except BaseException:
        stop_all(procs)
        raise
    return managed


async def load(stop: asyncio.Event, url: str, s: aiohttp.ClientSession, worker: int, answers: list[Answer]) -> None:
    """Greedy requests with log-probs through the manager until ``stop``; every answer is kept (as the trainer
    would get it)."""
    i = 0
    while not stop.is_set():
        i += 1
        prompt = [(worker * 97 + i * 13 + j) % (VOCAB - 1) + 1 for j in range(8 + i % 24)]
        rid = f"w{worker}-{i}-{uuid.uuid4().hex[:8]}"
        body = {"rid": rid, "input_ids": prompt, "return_logprob": True,
                "sampling_params": {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}}
        try:
            async with s.post(url + "/generate", json=body) as r:
                if r.status != 200:
                    await r.read()
                    await asyncio.sleep(0.05)
                    continue
                got = await r.json()
        except aiohttp.ClientError:
            await asyncio.sleep(0.05)
            continue
        meta = got["meta_info"]
        answers.append(Answer(str(meta["id"]), time.monotonic(), prompt, list(got["output_ids"]),
                              [float(e[0]) for e in meta["output_token_logprobs"]], list(meta["segments"])))


class Traffic:
    """The clients, started on entry and stopped on exit."""

    def __init__(self, url: str, s: aiohttp.ClientSession, workers: int) -> None:
        self.url, self.s, self.workers = url, s, workers
        self.answers: list[Answer] = []
        self.stop = asyncio.Event()
        self.tasks: list[asyncio.Future[None]] = []
        self.started = 0.0

    async def __aenter__(self) -> Traffic:
        self.started = time.monotonic()
        self.tasks = [asyncio.ensure_future(load(self.stop, self.url, self.s, w, self.answers))
                      for w in range(self.workers)]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.stop.set()
        await asyncio.gather(*self.tasks)


def by_endpoint(st: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    return {i["endpoint"]: i for i in (st or {}).get("instances", [])}


async def all_checked(url: str, eps: list[str], deadline_s: float) -> dict[str, dict[str, Any]]:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        insts = by_endpoint(await status(url))
        if all(insts.get(ep, {}).get("trust", {}).get("state") == "checked" for ep in eps):
            return insts
        await asyncio.sleep(0.05)
    raise RuntimeError(f"the boxes were not all checked within {deadline_s:g} s: {by_endpoint(await status(url))}")


# ---------------------------------------------------------------- clean fleets that differ
@dataclass
class Clean:
    spread: float
    probes: int
    disagreements: int
    quarantined: int
    largest_diff: float  # the largest verdict distance seen on any box (polled)
    compositions: int  # distinct compositions the probes met, over the boxes
    seconds: float


async def clean_fleet(logs: Path, engines: list[str], spread: float, args: argparse.Namespace) -> Clean:
    m = await start_managed(logs, engines, args.clean_interval_s, spread, f"clean-{spread:g}")
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s, \
                Traffic(m.url, s, args.workers):
            started = time.monotonic()
            largest = 0.0
            while True:
                st = await status(m.url)
                insts = by_endpoint(st)
                largest = max([largest, *(float(insts[ep]["trust"]["diff"] or 0.0) for ep in m.eps if ep in insts)])
                probes = sum(insts[ep]["trust"]["probes"] for ep in m.eps if ep in insts)
                if probes >= args.clean_probes:
                    break
                await asyncio.sleep(0.1)
            took = time.monotonic() - started
            seen: set[str] = set()
            for ep in m.eps:
                async with s.get(f"http://{ep}/_noisy_box") as r:
                    seen.update((await r.json())["compositions"])
            return Clean(spread, probes, sum(insts[ep]["trust"]["disagreements"] for ep in m.eps if ep in insts),
                         int((st or {})["quarantine"]["quarantined"]), largest, len(seen), took)
    finally:
        stop_all(m.procs)


# ---------------------------------------------------------------- a fault, its catch and what was delivered
@dataclass
class Delivered:
    bad_tokens: int = 0  # tokens the bad box made on corrupted weights, delivered
    kept: int = 0  # of those, in answers the trainer's check keeps after the catch
    dropped_answers: int = 0
    dropped_good_tokens: int = 0  # tokens of dropped answers that were fine (the drop's cost)
    trained_before: dict[float, float] = field(default_factory=dict)  # step (intervals) -> expected bad tokens


def judge_delivered(answers: list[Answer], model: TinyCausalLM, bad_instance: str, armed: float,
                    caught_at: float | None, interval_s: float, distrusted: list[dict[str, Any]]) -> Delivered:
    """What the trainer would train on: every answer received since the fault was armed, dropped as the plugin
    drops them; the bad box's tokens checked against the clean model's log-probs; and, with an actor update
    every ``step`` intervals at a random phase, the bad tokens expected to be trained before the catch."""
    keys = {key_of(d["request_id"], d) for d in distrusted}
    late = [a for a in answers if a.received >= armed]
    drops = distrusted_rows([{"request_id": a.rid, "segments": a.segments} for a in late], keys)
    out = Delivered(dropped_answers=sum(drops), trained_before={step: 0.0 for step in STEPS})
    for a, drop in zip(late, drops):
        mine = [seg for seg in a.segments if seg["instance"] == bad_instance and seg["end"] > seg["start"]]
        clean_lp = model.input_logprobs(a.prompt + a.output, len(a.prompt)) if mine or drop else []
        bad_here = 0
        for seg in mine:
            for k in range(int(seg["start"]), int(seg["end"])):
                ref = clean_lp[k]
                bad_here += ref is None or abs(a.logprobs[k] - ref) > BAD_LOGPROB
        out.bad_tokens += bad_here
        if drop:
            out.dropped_good_tokens += len(a.output) - bad_here
        else:
            out.kept += bad_here
        for step in STEPS:
            window = (caught_at if caught_at is not None else math.inf) - a.received
            if window > 0:
                out.trained_before[step] += bad_here * min(1.0, window / (step * interval_s))
    return out


def box_rate(answers: list[Answer], instance: str, since: float, until: float) -> float:
    """Tokens a second the box made in the answers received in [since, until)."""
    tokens = sum(int(seg["end"]) - int(seg["start"]) for a in answers if since <= a.received < until
                 for seg in a.segments if seg["instance"] == instance)
    return tokens / max(until - since, 1e-9)


@dataclass
class Run:
    fault: str
    caught_s: float | None
    delivered: Delivered
    rate: float  # the bad box's tokens a second before the fault
    false_quarantines: int
    cut_back: int
    bad_diff: float  # the bad box's largest verdict distance seen while watched
    honest_diff: float  # the honest boxes' largest


async def fault_run(logs: Path, engines: list[str], model: TinyCausalLM, rng: random.Random, subtle: bool,
                    args: argparse.Namespace, n: int) -> Run:
    interval = args.interval_s
    m = await start_managed(logs, engines, interval, GPU_BF16_SPREAD[LOGIT_SCALE], f"run{n}")
    named = model.named_tensors()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
            async with Traffic(m.url, s, args.workers) as traffic:
                insts = await all_checked(m.url, m.eps, 30 + 5 * interval)
                warm = time.monotonic()
                await asyncio.sleep(rng.uniform(interval, 2 * interval))  # a random moment of the probe cycle
                bad = rng.choice(m.eps)
                tensor = rng.choice(MATRICES)
                bad_id = insts[bad]["id"]
                armed = time.monotonic()
                if subtle:
                    await post_json(s, f"http://{m.engine_of[bad]}/debug/faults",
                                    {"perturb_tensor": tensor, "perturb_scale": 0.05,
                                     "perturb_after_requests": rng.randint(0, 20)})
                    while not (await get_json(s, f"http://{m.engine_of[bad]}/debug/faults"))["perturbed"]:
                        await asyncio.sleep(0.005)
                    fault = f"5% noise on {tensor}"
                else:
                    wrong = wrong_tensor(named[tensor], rng.randrange(1 << 30))
                    await write_tensors(s, m.engine_of[bad], [(tensor, wrong)])
                    fault = f"{tensor} replaced by a wrong one of its magnitude"
                corrupted = time.monotonic()
                caught_at: float | None = None
                bad_diff = honest_diff = 0.0
                watch = (args.watch_intervals if subtle else args.catch_intervals) * interval
                while time.monotonic() - corrupted < watch:
                    now = by_endpoint(await status(m.url))
                    for ep, inst in now.items():
                        diff = float(inst["trust"]["diff"] or 0.0)
                        if ep == bad:
                            bad_diff = max(bad_diff, diff)
                        elif inst["trust"]["version"] is not None:
                            honest_diff = max(honest_diff, diff)
                    if now.get(bad, {}).get("quarantined"):
                        caught_at = time.monotonic()
                        break
                    await asyncio.sleep(0.01)
                if caught_at is not None:
                    await asyncio.sleep(interval)  # traffic goes on a while after the catch
            async with s.get(m.url + "/distrusted_samples?after=0") as r:
                page = await r.json()
            st = await status(m.url)
            if subtle:
                await post_json(s, f"http://{m.engine_of[bad]}/debug/faults", {"perturb_tensor": None})
            await write_tensors(s, m.engine_of[bad], [(tensor, named[tensor].detach().contiguous())])  # healed
        delivered = judge_delivered(traffic.answers, model, bad_id, armed, caught_at, interval, page["samples"])
        false_q = sum(1 for ep, inst in by_endpoint(st).items() if ep != bad and inst.get("quarantined"))
        return Run(fault, None if caught_at is None else caught_at - armed, delivered,
                   box_rate(traffic.answers, bad_id, warm, armed), false_q,
                   int((st or {})["generation"].get("cut_back_tokens", 0)), bad_diff, honest_diff)
    finally:
        stop_all(m.procs)


# ---------------------------------------------------------------- cost and the old read-back
async def cost(s: aiohttp.ClientSession, engine: str, model: TinyCausalLM, repeats: int = 20) -> tuple[float, float]:
    """Median seconds of one probe and of one whole-model load, straight to one engine."""
    ids = probe_ids(probe_limit(VOCAB) or VOCAB)  # the prompt the manager sends such boxes
    probes = []
    for _ in range(repeats):
        t = time.perf_counter()
        await prefill_logprobs(s, f"http://{engine}", ids, PROBE_RID_PREFIX + uuid.uuid4().hex, {}, 30.0)
        probes.append(time.perf_counter() - t)
    named = [(k, v.detach().contiguous()) for k, v in model.named_tensors().items()]
    loads = []
    for _ in range(5):
        t = time.perf_counter()
        await write_tensors(s, engine, named)
        loads.append(time.perf_counter() - t)
    return statistics.median(probes), statistics.median(loads)


def readback(rows: int) -> list[str]:
    """``bench_readback.py`` on this machine's CPU, in a process of its own (its peak memory is its own)."""
    done = subprocess.run([PY, str(HERE / "bench_readback.py"), "--rows", str(rows), "--device", "cpu"],
                          capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        return [f"bench_readback.py failed: {done.stderr.strip()[-300:]}"]
    return done.stdout.strip().splitlines()


# ---------------------------------------------------------------- report
def spread_of(values: Sequence[float], fmt: str = "{:.2f}") -> str:
    """Median and worst (largest) of ``values``."""
    return f"{fmt.format(statistics.median(values))} (worst {fmt.format(max(values))})"


def report_runs(runs: list[Run], interval: float) -> list[str]:
    caught = [r for r in runs if r.caught_s is not None]
    lines = []
    for r in runs:
        d = r.delivered
        when = (f"caught in {r.caught_s:.2f} s ({r.caught_s / interval:.2f} intervals)" if r.caught_s is not None
                else "NOT caught")
        lines.append(f"  {r.fault}: {when}; probe distance {r.bad_diff:.3g} (honest boxes' largest "
                     f"{r.honest_diff:.3g}); bad tokens delivered {d.bad_tokens} ({r.rate:.0f} tokens/s from that "
                     f"box before), kept after the catch {d.kept}, trained before it "
                     + ", ".join(f"{d.trained_before[st]:.1f} at a step of {st:g} interval(s)" for st in STEPS)
                     + f"; dropped {d.dropped_answers} answers ({d.dropped_good_tokens} good tokens with them), cut "
                     f"back {r.cut_back}; false quarantines {r.false_quarantines}")
    if caught:
        intervals = [r.caught_s / interval for r in caught if r.caught_s is not None]
        share = [r.delivered.trained_before[STEPS[0]] / r.delivered.bad_tokens
                 for r in caught if r.delivered.bad_tokens]
        per_interval = [r.delivered.bad_tokens / (r.rate * interval) for r in caught if r.rate > 0]
        lines.append(f"  caught in {len(caught)} of {len(runs)}: {spread_of(intervals)} intervals; bad tokens "
                     f"delivered {spread_of([float(r.delivered.bad_tokens) for r in caught], '{:.0f}')} = "
                     f"{spread_of(per_interval)} intervals' worth of the box's output; kept after the catch "
                     f"{spread_of([float(r.delivered.kept) for r in caught], '{:.0f}')}; trained before the catch at "
                     f"a step of one interval {spread_of([100 * x for x in share] or [0.0], '{:.0f}')}% of them")
        lines.append(f"  at the default {DEFAULT_INTERVAL_S:g} s interval the catch takes "
                     f"{statistics.median(intervals) * DEFAULT_INTERVAL_S:.0f} s (worst "
                     f"{max(intervals) * DEFAULT_INTERVAL_S:.0f} s): the bad box makes "
                     f"{statistics.median(intervals) * DEFAULT_INTERVAL_S * 1000:,.0f} tokens (worst "
                     f"{max(intervals) * DEFAULT_INTERVAL_S * 1000:,.0f}) on the wrong weights per 1,000 tokens/s "
                     f"it serves; what it delivers of them is listed and dropped, except what an actor update "
                     f"trained before the catch (the share above, at a {DEFAULT_INTERVAL_S:g} s step)")
    return lines


async def main_async(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    for line in sensitivity():
        print(line, flush=True)
    model = clean_model()
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="bench-trust-") as tmp:
        logs = Path(tmp)
        try:
            engines = []
            for k in range(args.boxes):
                port = free_port()
                procs.append(spawn([PY, "-m", "rollout_manager.cpu_engine", "--port", str(port), "--seed", "0",
                                    "--log-level", "WARNING"], logs / f"engine{k}.log"))
                engines.append(f"127.0.0.1:{port}")
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
                for engine in engines:
                    await wait_up(s, engine)
                    await write_tensors(s, engine, [("lm_head.weight", model.lm_head.weight.detach().contiguous())])
            cleans = []
            for spread in args.spreads:
                c = await clean_fleet(logs, engines, spread, args)
                cleans.append(c)
                print(f"clean fleet, bf16 spread {c.spread:g} between compositions: {c.probes} probes over "
                      f"{args.boxes} boxes in {c.seconds:.0f} s (every {args.clean_interval_s:g} s, requests "
                      f"flowing, {c.compositions} compositions met), largest verdict distance {c.largest_diff:.3g}, "
                      f"{c.disagreements} false 'disagrees', {c.quarantined} false quarantines", flush=True)
            runs = []
            for n in range(args.runs):
                runs.append(await fault_run(logs, engines, model, rng, False, args, n))
            print(f"wrong tensor, probe every {args.interval_s:g} s (default {DEFAULT_INTERVAL_S:g} s), "
                  f"spread {GPU_BF16_SPREAD[LOGIT_SCALE]:g}:", flush=True)
            for line in report_runs(runs, args.interval_s):
                print(line, flush=True)
            subtle = []
            for n in range(args.subtle_runs):
                subtle.append(await fault_run(logs, engines, model, rng, True, args, 100 + n))
            if subtle:
                print(f"small noise, watched {args.watch_intervals} intervals of {args.interval_s:g} s:", flush=True)
                for line in report_runs(subtle, args.interval_s):
                    print(line, flush=True)
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
                probe_s, load_s = await cost(s, engines[0], model)
            per_hour = 3600 / DEFAULT_INTERVAL_S
            print(f"cost: one probe {probe_s * 1e3:.2f} ms against a whole-model load {load_s * 1e3:.1f} ms "
                  f"({probe_s / load_s:.1%}; CPU engine, tiny model, median); at the default {DEFAULT_INTERVAL_S:g} s, "
                  f"{per_hour:.0f} probes per box per hour ({per_hour * probe_s:.2f} s of probing an hour here)",
                  flush=True)
        finally:
            stop_all(procs)
    if args.readback_rows > 0:
        for line in readback(args.readback_rows):
            print(f"old read-back (measured here, CPU): {line}")
        print(f"old read-back (8B embedding, full size): {H200_READBACK}")
    caught = [r.caught_s / args.interval_s for r in runs if r.caught_s is not None]
    share = [100 * r.delivered.trained_before[STEPS[0]] / r.delivered.bad_tokens for r in runs
             if r.caught_s is not None and r.delivered.bad_tokens]
    kept = [r.delivered.kept for r in runs if r.caught_s is not None]
    probes = sum(c.probes for c in cleans)
    false_q = [c.quarantined for c in cleans]
    false_runs = sum(r.false_quarantines for r in runs + subtle)
    print(f"trust: wrong tensor caught in {len(caught)} of {len(runs)} runs"
          + (f" in {statistics.median(caught):.2f} intervals (worst {max(caught):.2f}; "
             f"{statistics.median(caught) * DEFAULT_INTERVAL_S:.0f} s, worst {max(caught) * DEFAULT_INTERVAL_S:.0f} s "
             f"at the default {DEFAULT_INTERVAL_S:g} s), {max(kept)} bad tokens kept after the catch (worst run), "
             f"{statistics.median(share or [0.0]):.0f}% (worst {max(share or [0.0]):.0f}%) trained before it at a step "
             f"of one interval" if caught else "")
          + f"; 5% noise caught in {sum(r.caught_s is not None for r in subtle)} of {len(subtle)}; "
          f"{sum(false_q) + false_runs} false quarantines in {probes} probes ("
          + ", ".join(f"{q} at spread {c.spread:g}" for q, c in zip(false_q, cleans))
          + f", {false_runs} in the fault runs)")

async def wait_up(s: aiohttp.ClientSession, engine: str, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            async with s.get(f"http://{engine}{wire.HEALTH}", timeout=aiohttp.ClientTimeout(total=2)) as r:
                if r.status == 200:
                    return
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass
        await asyncio.sleep(0.1)
    raise RuntimeError(f"{engine} did not come up")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="3 wrong-tensor runs, 1 small-noise run, 1 s interval, 300 clean probes a fleet, no read-back")
    ap.add_argument("--boxes", type=int, default=3)
    ap.add_argument("--interval-s", type=float, default=2.0, help="the probe interval of the fault runs")
    ap.add_argument("--runs", type=int, default=5, help="wrong-tensor runs")
    ap.add_argument("--subtle-runs", type=int, default=2, help="5%%-noise runs")
    ap.add_argument("--catch-intervals", type=float, default=5.0,
                    help="a wrong tensor not caught by then is 'NOT caught'")
    ap.add_argument("--watch-intervals", type=float, default=5.0, help="how long a small-noise fault is watched")
    ap.add_argument("--workers", type=int, default=12, help="clients sending requests through the manager")
    ap.add_argument("--clean-probes", type=int, default=1000, help="probes per clean fleet")
    ap.add_argument("--clean-interval-s", type=float, default=0.05)
    ap.add_argument("--spreads", type=float, nargs="+", default=[GPU_BF16_SPREAD[3.0], GPU_BF16_SPREAD[8.0]],
                    help="the clean fleets' spreads between compositions")
    ap.add_argument("--readback-rows", type=int, default=16_032,
                    help="rows of the 4,096-wide bf16 read-back measured on this CPU (0: skip)")
    ap.add_argument("--seed", type=int, default=None, help="of the corrupted boxes, tensors and moments")
    args = ap.parse_args()
    if args.quick:
        args.runs, args.subtle_runs, args.interval_s, args.clean_probes, args.readback_rows = 3, 1, 1.0, 300, 0
        args.watch_intervals = 4.0
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
