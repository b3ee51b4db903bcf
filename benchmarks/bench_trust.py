"""The trust probe against silent corruption (issue 39, "Measured"), on CPU-engine boxes behind a real manager.

A manager (``trust_probe_interval_s`` short) and ``--boxes`` CPU engines of the same weights, requests going
through the manager all along. Three parts:

1. clean: probes counted until at least ``--clean-probes`` were answered over the fleet; every "disagrees"
   then is a false one (the CPU engine is bit-exact, so the goal is 0);
2. corruption: one box, chosen at random, gets the CPU engine's ``perturb_tensor`` fault after a random
   number of client requests (noise of 5% of the tensor's mean magnitude, silently); the time from the
   corruption (polled on the box's own ``/debug/faults``) to the manager reporting that box "disagrees",
   and the tokens the box made meanwhile. Quarantine and token flagging are not built yet: every one of those
   tokens was delivered unflagged, and "caught" means flagged as "disagrees" in ``/get_instances_status``;
3. cost: one probe straight to a box, timed, against a load of the whole model through the box's
   ``/update_weights_from_tensor`` (begin, load, end), timed.

Last line: ``trust: caught in X s, Y unflagged tokens, Z false quarantines in N probes`` (Z: false
"disagrees" verdicts, as nothing is quarantined yet).

    .venv/bin/python benchmarks/bench_trust.py [--boxes 3] [--interval-s 0.05] [--clean-probes 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
import uuid
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
from rollout_manager.sglang.logprob_probe import PROBE_RID_PREFIX, prefill_logprobs, probe_ids

PY = sys.executable
TENSOR = "model.layers.0.self_attn.q_proj.weight"


async def load(stop: asyncio.Event, url: str, s: aiohttp.ClientSession, worker: int) -> None:
    """Requests through the manager until ``stop``: the traffic the fleet serves while it is probed."""
    i = 0
    while not stop.is_set():
        i += 1
        body = {"input_ids": [(worker * 97 + i * 13 + j) % 500 + 1 for j in range(8 + i % 24)],
                "sampling_params": {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}}
        try:
            async with s.post(url + "/generate", json=body) as r:
                await r.read()
        except aiohttp.ClientError:
            await asyncio.sleep(0.05)


def by_endpoint(st: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    return {i["endpoint"]: i["trust"] for i in (st or {}).get("instances", [])}


async def faults(s: aiohttp.ClientSession, ep: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    if body is None:
        async with s.get(f"http://{ep}/debug/faults") as r:
            return dict(await r.json())
    async with s.post(f"http://{ep}/debug/faults", json=body) as r:
        return dict(await r.json())


async def clean(url: str, eps: list[str], want: int) -> tuple[int, int, float]:
    """Probes answered, false "disagrees" among them, seconds taken."""
    started = time.monotonic()
    while True:
        trust = by_endpoint(await status(url))
        probes = sum(trust[ep]["probes"] for ep in eps if ep in trust)
        if probes >= want:
            return probes, sum(trust[ep]["disagreements"] for ep in eps if ep in trust), time.monotonic() - started
        await asyncio.sleep(0.2)


async def corrupt(url: str, eps: list[str], s: aiohttp.ClientSession, rng: random.Random,
                  deadline_s: float) -> tuple[str, float, int]:
    """Corrupt one box after a random number of its requests; (box, seconds to 'disagrees', tokens it made
    between the corruption and then)."""
    bad = rng.choice(eps)
    after = rng.randint(5, 50)
    await faults(s, bad, {"perturb_tensor": TENSOR, "perturb_after_requests": after})
    print(f"corrupting {bad} after {after} more of its requests ({TENSOR}, 5% noise)", flush=True)
    while not (f := await faults(s, bad))["perturbed"]:
        await asyncio.sleep(0.005)
    corrupted, tokens_then = time.monotonic(), f["emitted_tokens"]
    while time.monotonic() - corrupted < deadline_s:
        if by_endpoint(await status(url)).get(bad, {}).get("state") == "disagrees":
            caught = time.monotonic()
            return bad, caught - corrupted, (await faults(s, bad))["emitted_tokens"] - tokens_then
        await asyncio.sleep(0.01)
    raise RuntimeError(f"{bad} not flagged within {deadline_s:g} s of its corruption")


async def cost(s: aiohttp.ClientSession, ep: str, repeats: int = 20) -> tuple[float, float]:
    """Median seconds of one probe and of one whole-model load, straight to one box."""
    model = build_model(0)  # the engines' own weights (--seed 0): a load that changes nothing but costs the same
    ids = probe_ids(model.config.vocab_size)
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
    with tempfile.TemporaryDirectory(prefix="bench-trust-") as tmp:
        logs = Path(tmp)
        try:
            url = spawn_manager(logs / "manager.log", procs, f"trust_probe_interval_s={args.interval_s}")
            eps = []
            for k in range(args.boxes):
                port = free_port()
                procs.append(spawn([PY, "-m", "rollout_manager.cpu_engine", "--port", str(port), "--seed", "0",
                                    "--log-level", "WARNING"], logs / f"engine{k}.log"))
                eps.append(f"127.0.0.1:{port}")
            await register(url, eps)
            stop = asyncio.Event()
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
                traffic = [asyncio.ensure_future(load(stop, url, s, w)) for w in range(args.boxes)]
                try:
                    probes, false, took = await clean(url, eps, args.clean_probes)
                    print(f"clean: {probes} probes over {len(eps)} boxes in {took:.1f} s (every "
                          f"{args.interval_s:g} s, requests flowing), {false} false 'disagrees'", flush=True)
                    bad, caught_s, tokens = await corrupt(url, eps, s, rng, args.deadline_s)
                    print(f"corruption: {bad} flagged 'disagrees' {caught_s:.3f} s after it was corrupted "
                          f"(probe interval {args.interval_s:g} s); it made {tokens} tokens meanwhile, all "
                          "delivered unflagged (no quarantine or token flagging yet)", flush=True)
                finally:
                    stop.set()
                    await asyncio.gather(*traffic)
                good = next(ep for ep in eps if ep != bad)
                probe_s, load_s = await cost(s, good)
            print(f"cost per box per check: one probe {probe_s * 1e3:.2f} ms against a whole-model load "
                  f"{load_s * 1e3:.1f} ms ({probe_s / load_s:.1%}; CPU engine, tiny model, median)")
            print(f"trust: caught in {caught_s:.2f} s, {tokens} unflagged tokens, {false} false quarantines "
                  f"in {probes} probes")
        finally:
            stop_all(procs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--boxes", type=int, default=3)
    ap.add_argument("--interval-s", type=float, default=0.05)
    ap.add_argument("--clean-probes", type=int, default=1000)
    ap.add_argument("--deadline-s", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=None, help="of the corrupted box and when (default: random)")
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
