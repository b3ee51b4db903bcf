"""The trust probe, quarantine and the trainer's check against silent corruption (issue 39, "Measured"), on
CPU-engine boxes behind a real manager.

A manager (``trust_probe_interval_s`` short, quarantine on) and ``--boxes`` CPU engines of the same weights,
greedy requests with log-probs going through the manager all along. Four parts:

1. clean: probes counted until at least ``--clean-probes`` were answered over the fleet; every "disagrees"
   and every quarantine then is a false one (goal 0);
2. corruption: one box, chosen at random, gets the CPU engine's ``perturb_tensor`` fault after a random
   number of its requests (noise of 5% of the tensor's mean magnitude, silently). Measured: the time from the
   corruption (polled on the box's own ``/debug/faults``) to the manager quarantining the box, also in probe
   intervals (the steps). Then traffic runs ``--after-s`` longer and stops; the bench reads
   ``GET /distrusted_samples`` and, as the trainer plugin does before an actor update
   (``trainer_plugin.distrust``), drops every answer listed there or flagged ``distrusted`` in its segments.
   The bad tokens are those the bad box made on its corrupted weights: each token of its segments whose
   log-prob differs from the clean model's (the engines' own weights, ``build_model(0)``) by more than
   ``BAD_LOGPROB`` (a clean token differs by at most about 1e-6 here, a corrupted one by 1e-3 at the median).
   Counted: bad tokens delivered, and of those the ones in answers the trainer keeps ("unflagged", goal 0);
   and the good tokens the drop costs;
3. cost: one probe straight to a box, timed, against a load of the whole model through the box's
   ``/update_weights_from_tensor`` (begin, load, end), timed;
4. the old read-back: ``benchmarks/bench_readback.py`` run on this machine's CPU on ``--readback-rows`` rows of
   an 8B model's embedding (all 128,256 would need about 22 GiB of host memory), its time and memory; and the
   full-size figure measured on an NVIDIA H200 box, printed as recorded (docs/sglang-contract.md).

Last line: ``trust: caught in X s, Y unflagged tokens, Z false quarantines in N probes``.

    .venv/bin/python benchmarks/bench_trust.py [--boxes 3] [--workers 12] [--interval-s 0.05] [--clean-probes 1000]
        [--readback-rows 16032] [--seed N]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_manager_overhead import spawn, spawn_manager, stop_all
from bench_reliability import register, status

from rollout_manager.cpu_engine.model import build_model
from rollout_manager.osutil import free_port
from rollout_manager.sglang import tensor_payload, wire
from rollout_manager.sglang.logprob_probe import ID_RUNGS, PROBE_RID_PREFIX, prefill_logprobs, probe_ids, probe_limit
from trainer_plugin.distrust import distrusted_rows, key_of

PY = sys.executable
TENSOR = "model.layers.0.self_attn.q_proj.weight"
BAD_LOGPROB = 1e-5  # a token's log-prob this far from the clean model's was made on corrupted weights
VOCAB = 256  # the CPU engine's tiny model
H200_READBACK = ("28.3 s and +21.6 GiB of host memory for 128,256 x 4,096 bf16 (recorded: "
                 "benchmarks/bench_readback.py on one NVIDIA H200 box, docs/sglang-contract.md; not rerun here)")


@dataclass
class Answer:
    rid: str
    received: float  # monotonic
    prompt: list[int]
    output: list[int]
    logprobs: list[float]
    segments: list[dict[str, Any]]


async def load(stop: asyncio.Event, url: str, s: aiohttp.ClientSession, worker: int, answers: list[Answer]) -> None:
    """Greedy requests with log-probs through the manager until ``stop``: the traffic the fleet serves while it
    is probed; every answer is kept (as the trainer would get it)."""
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


def by_endpoint(st: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    return {i["endpoint"]: i for i in (st or {}).get("instances", [])}


async def faults(s: aiohttp.ClientSession, ep: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    if body is None:
        async with s.get(f"http://{ep}/debug/faults") as r:
            return dict(await r.json())
    async with s.post(f"http://{ep}/debug/faults", json=body) as r:
        return dict(await r.json())


async def clean(url: str, eps: list[str], want: int) -> tuple[int, int, int, float]:
    """Probes answered, false "disagrees" and false quarantines among them, seconds taken."""
    started = time.monotonic()
    while True:
        st = await status(url)
        insts = by_endpoint(st)
        probes = sum(insts[ep]["trust"]["probes"] for ep in eps if ep in insts)
        if probes >= want:
            disagreements = sum(insts[ep]["trust"]["disagreements"] for ep in eps if ep in insts)
            return probes, disagreements, int((st or {})["quarantine"]["quarantined"]), time.monotonic() - started
        await asyncio.sleep(0.2)


@dataclass
class Caught:
    bad: str  # endpoint
    instance: str
    armed: float  # monotonic: the fault was armed (nothing it corrupts can be older)
    corrupted: float  # monotonic: the bench saw the corruption on /debug/faults (polled, so a little late)
    seconds: float


async def corrupt(url: str, eps: list[str], s: aiohttp.ClientSession, rng: random.Random,
                  deadline_s: float) -> Caught:
    """Corrupt one box after a random number of its requests; wait for its quarantine."""
    bad = rng.choice(eps)
    after = rng.randint(5, 50)
    armed = time.monotonic()
    await faults(s, bad, {"perturb_tensor": TENSOR, "perturb_after_requests": after})
    print(f"corrupting {bad} after {after} more of its requests ({TENSOR}, 5% noise)", flush=True)
    while not (await faults(s, bad))["perturbed"]:
        await asyncio.sleep(0.005)
    corrupted = time.monotonic()
    while time.monotonic() - corrupted < deadline_s:
        inst = by_endpoint(await status(url)).get(bad, {})
        if inst.get("quarantined"):
            return Caught(bad, inst["id"], armed, corrupted, time.monotonic() - corrupted)
        await asyncio.sleep(0.01)
    raise RuntimeError(f"{bad} not quarantined within {deadline_s:g} s of its corruption")


@dataclass
class Delivered:
    answers: int  # answers with tokens of the bad box delivered from the fault's arming on
    bad_tokens: int  # tokens it made on corrupted weights, delivered
    unflagged: int  # of those, in answers the trainer keeps
    dropped_answers: int
    dropped_good_tokens: int  # tokens of dropped answers that were fine (the drop's cost)


def judge_delivered(answers: list[Answer], caught: Caught, distrusted: list[dict[str, Any]]) -> Delivered:
    """What the trainer would train on: every answer received since the fault was armed, dropped as the
    plugin drops them; the bad box's tokens checked against the clean model's log-probs."""
    model = build_model(0)
    keys = {key_of(d["request_id"], d) for d in distrusted}
    late = [a for a in answers if a.received >= caught.armed]
    drops = distrusted_rows([{"request_id": a.rid, "segments": a.segments} for a in late], keys)
    out = Delivered(0, 0, 0, sum(drops), 0)
    for a, drop in zip(late, drops):
        mine = [seg for seg in a.segments if seg["instance"] == caught.instance and seg["end"] > seg["start"]]
        clean_lp = model.input_logprobs(a.prompt + a.output, len(a.prompt)) if mine or drop else []
        bad_here = 0
        for seg in mine:
            for k in range(int(seg["start"]), int(seg["end"])):
                ref = clean_lp[k]
                bad_here += ref is None or abs(a.logprobs[k] - ref) > BAD_LOGPROB
        if mine:
            out.answers += 1
        out.bad_tokens += bad_here
        if drop:
            out.dropped_good_tokens += len(a.output) - bad_here
        else:
            out.unflagged += bad_here
    return out


def readback(rows: int) -> list[str]:
    """``bench_readback.py`` on this machine's CPU, in a process of its own (its peak memory is its own)."""
    done = subprocess.run([PY, str(Path(__file__).parent / "bench_readback.py"), "--rows", str(rows),
                           "--device", "cpu"], capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        return [f"bench_readback.py failed: {done.stderr.strip()[-300:]}"]
    return done.stdout.strip().splitlines()


async def cost(s: aiohttp.ClientSession, ep: str, repeats: int = 20) -> tuple[float, float]:
    """Median seconds of one probe and of one whole-model load, straight to one box."""
    model = build_model(0)  # the engines' own weights (--seed 0): a load that changes nothing but costs the same
    ids = probe_ids(probe_limit(model.config.vocab_size) or ID_RUNGS[0])  # the prompt the manager sends such boxes
    probes = []
    for _ in range(repeats):
        t = time.perf_counter()
        await prefill_logprobs(s, f"http://{ep}", ids, PROBE_RID_PREFIX + uuid.uuid4().hex, {}, 30.0)
        probes.append(time.perf_counter() - t)
    named = list(model.state_dict().items())
    loads = []
    for _ in range(5):
        t = time.perf_counter()
        payload = [tensor_payload.serialize_named_tensors(named)]
        for path, body in (("/begin_weight_update", {}),
                           ("/update_weights_from_tensor",
                            wire.update_weights_from_tensor_body(payload, flush_cache=True, weight_version=None)),
                           ("/end_weight_update", {})):
            async with s.post(f"http://{ep}{path}", json=body) as r:
                if r.status != 200:
                    raise RuntimeError(f"{path}: HTTP {r.status} {(await r.text())[:200]}")
        loads.append(time.perf_counter() - t)
    return statistics.median(probes), statistics.median(loads)


async def main_async(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    procs = []
    answers: list[Answer] = []
    with tempfile.TemporaryDirectory(prefix="bench-trust-") as tmp:
        logs = Path(tmp)
        try:
            url = spawn_manager(logs / "manager.log", procs, f"trust_probe_interval_s={args.interval_s}",
                                "quarantine=true", "quarantine_recheck_s=0.5")
            eps = []
            for k in range(args.boxes):
                port = free_port()
                procs.append(spawn([PY, "-m", "rollout_manager.cpu_engine", "--port", str(port), "--seed", "0",
                                    "--log-level", "WARNING"], logs / f"engine{k}.log"))
                eps.append(f"127.0.0.1:{port}")
            await register(url, eps)
            stop = asyncio.Event()
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
                traffic = [asyncio.ensure_future(load(stop, url, s, w, answers)) for w in range(args.workers)]
                try:
                    probes, false_disagree, false_q, took = await clean(url, eps, args.clean_probes)
                    print(f"clean: {probes} probes over {len(eps)} boxes in {took:.1f} s (every "
                          f"{args.interval_s:g} s, requests flowing), {false_disagree} false 'disagrees', "
                          f"{false_q} false quarantines", flush=True)
                    caught = await corrupt(url, eps, s, rng, args.deadline_s)
                    print(f"corruption: {caught.bad} quarantined {caught.seconds:.3f} s after it was corrupted "
                          f"({caught.seconds / args.interval_s:.1f} probe intervals of {args.interval_s:g} s)",
                          flush=True)
                    await asyncio.sleep(args.after_s)
                finally:
                    stop.set()
                    await asyncio.gather(*traffic)
                async with s.get(url + "/distrusted_samples?after=0") as r:
                    page = await r.json()
                st = await status(url)
                delivered = judge_delivered(answers, caught, page["samples"])
                q = (st or {})["quarantine"]
                print(f"delivered: {len(answers)} answers in all; since the fault was armed, {delivered.answers} "
                      f"with tokens of {caught.bad}, holding {delivered.bad_tokens} tokens it made on corrupted "
                      f"weights; the manager listed {len(page['samples'])} distrusted answer segment(s) "
                      f"({q['delivered']['distrusted_tokens']} tokens); the trainer's check drops "
                      f"{delivered.dropped_answers} answers ({delivered.dropped_good_tokens} good tokens with "
                      f"them) and keeps {delivered.unflagged} bad tokens; running sequences cut back: "
                      f"{(st or {})['generation'].get('cut_back_tokens', 0)} tokens remade elsewhere", flush=True)
                good = next(ep for ep in eps if ep != caught.bad)
                probe_s, load_s = await cost(s, good)
            print(f"cost per box per check: one probe {probe_s * 1e3:.2f} ms against a whole-model load "
                  f"{load_s * 1e3:.1f} ms ({probe_s / load_s:.1%}; CPU engine, tiny model, median)")
        finally:
            stop_all(procs)
    if args.readback_rows > 0:
        for line in readback(args.readback_rows):
            print(f"old read-back (measured here, CPU): {line}")
    print(f"old read-back (8B embedding, full size): {H200_READBACK}")
    print(f"trust: caught in {caught.seconds:.2f} s, {delivered.unflagged} unflagged tokens, {false_q} false "
          f"quarantines in {probes} probes")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--boxes", type=int, default=3)
    ap.add_argument("--interval-s", type=float, default=0.05)
    ap.add_argument("--workers", type=int, default=12, help="clients sending requests through the manager")
    ap.add_argument("--clean-probes", type=int, default=1000)
    ap.add_argument("--deadline-s", type=float, default=60.0)
    ap.add_argument("--after-s", type=float, default=1.0, help="traffic kept up after the quarantine")
    ap.add_argument("--readback-rows", type=int, default=16_032,
                    help="rows of the 4,096-wide bf16 read-back measured on this CPU (0: skip; 128,256 is the "
                         "full 8B embedding, about 22 GiB of host memory)")
    ap.add_argument("--seed", type=int, default=None, help="of the corrupted box and when (default: random)")
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
