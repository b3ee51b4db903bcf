"""MoE weight pushes at a real MoE's tensor count, shapes scaled down. Prints what a push costs per tensor.

A Qwen3-30B-A3B-like model has 48 layers of 128 experts: 3 x 128 x 48 = 18,432 expert tensors under the
trainer's per-expert HF names (``model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight``) plus a router
per layer. This runs the product's push path at that count with tiny shapes (hidden 64, expert MLP 32 by
default), so every per-tensor cost shows and the bytes do not hide it:

- a CPU engine (a real process, ``--num-experts``) holds the model; a receiver agent in this process loads
  into it over HTTP, as beside SGLang; a sender agent in this process stages the trainer's state dict and
  writes it over TCP, ``--engines`` shards;
- push 1 is full, push 2 a delta that changes ``--changed-experts`` experts of one layer;
- for each push: layout, staging, transfers (shards written), ``/update_weights_from_tensor`` calls
  (buckets), and the seconds of each step; then the engine's weights must equal the trainer's;
- the two ``serialized_named_tensors`` forms for one full load: a pickled list of every tensor (what the
  agent sent before) against one flattened bucket (what it sends now), encoded here and decoded by this
  repository's decoder and, where .venv-sglang exists, by SGLang 0.5.23's own (``MultiprocessingSerializer``
  and ``FlattenedTensorBucket``), in a subprocess, which also times SGLang's Qwen3-MoE name mapping for those
  names (``load_weights`` scans ``expert_params_mapping``, 3 entries per expert, for every name).

    .venv/bin/python benchmarks/bench_moe_push.py            # about a minute on 2 cores
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

import aiohttp
import torch

from rollout_manager.cpu_engine.model import build_model, tensor_checksum
from rollout_manager.cpu_engine.server import DEBUG_CHECKSUM
from rollout_manager.sglang import tensor_payload
from rollout_manager.weights.layout import WeightLayout, build_layout
from rollout_manager.weights.protocol import CommitRequest, PushRequest
from rollout_manager.weights.receiver import Receiver
from rollout_manager.weights.sender_agent import SenderAgent

ROOT = Path(__file__).resolve().parents[1]
SGLANG_PY = ROOT / ".venv-sglang" / "bin" / "python"
SGLANG_DECODE = """
import sys, time
from sglang.srt.utils.common import MultiprocessingSerializer, normalize_serialized_named_tensor_payload
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
for path, form in zip(sys.argv[1::2], sys.argv[2::2]):
    text = open(path).read()
    t0 = time.perf_counter()
    obj = MultiprocessingSerializer.deserialize(normalize_serialized_named_tensor_payload(text))
    if form == "bucket":
        obj = FlattenedTensorBucket(flattened_tensor=obj["flattened_tensor"], metadata=obj["metadata"])
        obj = obj.reconstruct_tensors()
    print(form, len(obj), time.perf_counter() - t0, flush=True)
# qwen3_moe's load_weights maps every name by scanning its expert_params_mapping (3 entries per expert): the
# same loop over these names, without the copies
from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
names = [n for n, _ in obj]
experts = 1 + max(int(n.split(".experts.")[1].split(".")[0]) for n in names if ".experts." in n)
mapping = FusedMoE.make_expert_params_mapping("gate_proj", "down_proj", "up_proj", num_experts=experts)
t0 = time.perf_counter()
for name in names:
    for _, weight_name, _, _ in mapping:
        if weight_name in name:
            break
print("mapping", len(names), time.perf_counter() - t0, flush=True)
"""


def moe_config(args: argparse.Namespace) -> dict[str, int]:
    return {"num_hidden_layers": args.layers, "hidden_size": args.hidden,
            "moe_intermediate_size": args.moe_intermediate, "num_attention_heads": 4, "num_key_value_heads": 4,
            "intermediate_size": 2 * args.hidden,
            "num_experts": args.experts}


def start_engine(args: argparse.Namespace, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    sys.path.insert(0, str(ROOT / "tests"))
    from support import free_port, wait_http_ok_sync

    port = free_port()
    cfg = moe_config(args)
    experts = cfg.pop("num_experts")
    proc = subprocess.Popen([sys.executable, "-m", "rollout_manager.cpu_engine", "--port", str(port), "--seed", "0",
                             "--num-experts", str(experts), "--model-config", json.dumps(cfg)],
                            stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=ROOT)
    wait_http_ok_sync(f"http://127.0.0.1:{port}/health", timeout=300)
    return proc, f"http://127.0.0.1:{port}"


def trainer_state(args: argparse.Namespace, seed: int) -> dict[str, torch.Tensor]:
    """The engine's names and shapes (per-expert HF names), other values."""
    model = build_model(seed, **moe_config(args))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


async def push(sender: SenderAgent, rx: Receiver, version: int, delta: bool, engines: int) -> dict[str, float]:
    layout = sender.layout
    assert layout is not None
    t0 = time.perf_counter()
    offer = await asyncio.to_thread(sender.delta_offer, version - 1, version) if delta else None
    encode_s = time.perf_counter() - t0
    prep = rx.prepare(layout, "tcp", offer.base_version if offer else None, offer.bytes if offer else None)
    t1 = time.perf_counter()
    pushed = await asyncio.to_thread(sender.push, PushRequest(
        version=version, ip="127.0.0.1", num_engines=engines, transport="tcp", session_ids=prep.session_ids,
        buffer_addr=prep.buffer_addr, delta_base=offer.base_version if offer else None,
        delta_addr=prep.delta_addr if offer else None))
    t2 = time.perf_counter()
    answer = await rx.commit(CommitRequest(version=version, fingerprint=pushed.fingerprint, shards=pushed.shards,
                                           checksums=pushed.checksums, delta_base=pushed.delta_base,
                                           delta_bytes=pushed.bytes if offer else None))
    t3 = time.perf_counter()
    return {"encode_s": encode_s, "transfer_s": t2 - t1, "transfers": len(pushed.shards), "bytes": pushed.bytes,
            "verify_s": answer.verify_s, "load_s": answer.load_s, "calls": answer.buckets,
            "reloaded": answer.reloaded, "total_s": t3 - t0}


async def engine_equals(url: str, state: dict[str, torch.Tensor]) -> bool:
    """Every tensor the engine holds is bit for bit the trainer's (the engine's own per-tensor checksums)."""
    async with aiohttp.ClientSession() as s, s.get(url + DEBUG_CHECKSUM) as r:
        held = (await r.json())["tensors"]
    return bool(held == {n: tensor_checksum(t) for n, t in state.items()})


def payload_forms(state: dict[str, torch.Tensor]) -> list[tuple[str, str, float, float, int]]:
    """(form, payload, encode s, decode s here, tensors) for the whole state as one load."""
    named = list(state.items())
    out = []
    t0 = time.perf_counter()
    listed = tensor_payload.serialize_named_tensors([(n, t.clone()) for n, t in named])
    t1 = time.perf_counter()
    n_list = len(tensor_payload.deserialize_named_tensors(listed))
    out.append(("list", listed, t1 - t0, time.perf_counter() - t1, n_list))
    t0 = time.perf_counter()
    bucket = tensor_payload.serialize_bucket(tensor_payload.pack_bucket(named))
    t1 = time.perf_counter()
    n_bucket = len(tensor_payload.deserialize_bucket(bucket))
    out.append(("bucket", bucket, t1 - t0, time.perf_counter() - t1, n_bucket))
    return out


def sglang_decode(forms: list[tuple[str, str, float, float, int]]) -> dict[str, float]:
    if not SGLANG_PY.exists():
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        argv = []
        for form, payload, *_ in forms:
            path = Path(tmp) / f"{form}.b64"
            path.write_text(payload)
            argv += [str(path), form]
        env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "OMP_NUM_THREADS": "1"}
        proc = subprocess.run([str(SGLANG_PY), "-c", SGLANG_DECODE, *argv], capture_output=True, text=True, env=env,
                              timeout=600)
    if proc.returncode:
        print(f"SGLang's decoder failed: {proc.stderr[-2000:]}")
        return {}
    return {line.split()[0]: float(line.split()[2]) for line in proc.stdout.splitlines() if line.strip()}


async def run(args: argparse.Namespace) -> int:
    state0 = trainer_state(args, 1)
    t0 = time.perf_counter()
    layout: WeightLayout = build_layout(state0)
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    layout.fingerprint()
    fingerprint_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    WeightLayout.from_json(layout.to_json())
    json_s = time.perf_counter() - t0
    experts = sum(".mlp.experts." in n for n in state0)
    print(f"{len(state0)} tensors ({experts} expert tensors: 3 x {args.experts} experts x {args.layers} layers), "
          f"{layout.total_bytes / 2**20:.1f} MiB float32; layout: build {build_s:.3f}s, fingerprint "
          f"{fingerprint_s:.3f}s (then cached), JSON round trip {json_s:.3f}s", flush=True)

    log = Path(tempfile.mkdtemp(prefix="bench_moe_push_")) / "cpu-engine.log"
    proc, url = start_engine(args, log)
    sender = SenderAgent(["127.0.0.1"], 0)
    rx = Receiver("127.0.0.1", url, bucket_bytes=args.bucket_mb << 20, readback_tensors=4)
    await rx.start()
    rows: list[tuple[str, dict[str, float], float]] = []
    try:
        t0 = time.perf_counter()
        sender.stage(state0, 1)
        rows.append(("full", await push(sender, rx, 1, False, args.engines), time.perf_counter() - t0))
        state1 = dict(state0)
        gen = torch.Generator().manual_seed(2)
        changed = [f"model.layers.{args.layers // 2}.mlp.experts.{e}.{p}_proj.weight"
                   for e in range(0, args.experts, max(1, args.experts // args.changed_experts))[:args.changed_experts]
                   for p in ("gate", "up", "down")]
        for name in changed:
            state1[name] = state0[name] + 0.01 * torch.randn(state0[name].shape, generator=gen)
        t0 = time.perf_counter()
        sender.stage(state1, 2)
        rows.append(("delta", await push(sender, rx, 2, True, args.engines), time.perf_counter() - t0))
        exact = await engine_equals(url, state1)
    finally:
        await rx.close()
        sender.stop()
        proc.kill()
        proc.wait()

    print(f"\n{args.engines} shards per push, {args.bucket_mb} MiB buckets; engine holds the trainer's weights "
          f"after both pushes: {exact}\n")
    print("| push | tensors loaded | transfers | /update_weights_from_tensor calls | bytes sent | stage+push s "
          "| transfer s | verify s | load s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for mode, r, total in rows:
        print(f"| {mode} | {int(r['reloaded'])} | {int(r['transfers'])} | {int(r['calls'])} | "
              f"{r['bytes'] / 2**20:.2f} MiB | {total:.2f} | {r['transfer_s']:.3f} | {r['verify_s']:.3f} | "
              f"{r['load_s']:.2f} |")

    forms = payload_forms(state0)
    theirs = sglang_decode(forms)
    print(f"\nOne full load's serialized_named_tensors ({len(state0)} tensors), by form:\n")
    print("| form | payload MiB | encode s (agent) | decode s (this repo) | decode s (SGLang 0.5.23) |")
    print("|---|---:|---:|---:|---:|")
    for form, payload, enc, dec, _ in forms:
        sg = f"{theirs[form]:.2f}" if form in theirs else "-"
        print(f"| {'pickled list, a tensor each' if form == 'list' else 'one flattened bucket'} | "
              f"{len(payload) / 2**20:.1f} | {enc:.2f} | {dec:.2f} | {sg} |")
    if "mapping" in theirs:
        print(f"\nSGLang's Qwen3-MoE load_weights name mapping alone (its scan of expert_params_mapping, "
              f"{3 * args.experts} entries, for every name; the copies not counted): {theirs['mapping']:.2f}s")
    return 0 if exact else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--moe-intermediate", type=int, default=32)
    p.add_argument("--changed-experts", type=int, default=3, help="experts the delta push changes (one layer)")
    p.add_argument("--engines", type=int, default=4, help="shards per push (num_mooncake_engines_per_group)")
    p.add_argument("--bucket-mb", type=int, default=256, help="the receiver agent's --bucket-mb")
    return asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    raise SystemExit(main())
