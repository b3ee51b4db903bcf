"""Exact sparse delta pushes against full pushes, on real optimizer steps. Prints markdown tables.

Run from the repository root (about 3-4 minutes on a 2-core box; ``--model small --steps-per-lr 2`` for a
quick look):

    .venv/bin/python benchmarks/bench_weight_delta.py

A ~98M-parameter model of the CPU engine's family (vocab 8192, hidden 768, 12 layers, MLP 2048) keeps
fp32 master weights and takes real AdamW steps on random token batches: ``--steps-per-lr`` at lr 1e-6,
then as many at 1e-5. After each step the weights are cast to bf16 and staged into the trainer-side
:class:`SenderAgent`, which pushes them to ``--receivers`` receiver agents (in this process, each on its
own 127.0.1.x address, SGLang's load left out) over plain TCP, plain TCP capped at ``--rate-gbit``
(a WAN link), and Mooncake TCP: first as a delta from the previous step (the receivers hold it), then
in full, each receiver verifying every shard's checksum of the full new bytes. Push time is
prepare -> write -> apply -> verify for all receivers one after the other, as one transfer group does,
and a delta's time includes encoding it once per version. At the end every receiver's buffer must equal
the trainer's bf16 bytes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

import numpy as np
import torch

from rollout_manager.cpu_engine.model import build_model
from rollout_manager.sglang.weight_loader import NamedTensors
from rollout_manager.weights.layout import WeightLayout, unpack
from rollout_manager.weights.mooncake_engine import mooncake_available
from rollout_manager.weights.protocol import CommitRequest, PushRequest, TransportName
from rollout_manager.weights.receiver import Receiver
from rollout_manager.weights.receiver_loader import Loader
from rollout_manager.weights.sender_agent import SenderAgent

MODELS: dict[str, dict[str, Any]] = {
    "100m": dict(vocab_size=8192, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=12, intermediate_size=2048),
    "small": dict(vocab_size=4096, hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=8, intermediate_size=1536),
}


class BenchLoader(Loader):
    """No SGLang behind it: a load counts the tensors it would send and stops there."""

    async def commit(self, layout: WeightLayout, named: NamedTensors, version: int) -> int:
        names = self.changed()
        self.reloaded = len(layout) if names is None else len(names)
        self.version, self.dirty = version, set()
        return 0


class BenchReceiver(Receiver):
    """A receiver agent without SGLang: a commit verifies and stops there."""

    def __init__(self, host: str, sglang_url: str) -> None:
        super().__init__(host, sglang_url)
        self.loader = BenchLoader(self.loader.sglang_url, self.loader.auth, self.loader.settings)


class Link:
    """One sender and its receivers over one transport."""

    def __init__(self, name: str, sender: SenderAgent, ip: str, transport: TransportName,
                 receivers: list[BenchReceiver]):
        self.name, self.sender, self.ip, self.transport, self.receivers = name, sender, ip, transport, receivers
        self.rows: dict[str, list[dict[str, float]]] = {"delta": [], "full": []}

    async def push(self, version: int, delta: bool, engines: int) -> dict[str, float]:
        sender = self.sender
        layout = sender.layout
        assert layout is not None
        offer = await asyncio.to_thread(sender.delta_offer, version - 1, version) if delta else None
        encode_s = sender.delta_encode_s if delta else 0.0  # once per version (links may share a sender)
        t0 = time.perf_counter()
        if delta and offer is None:
            raise RuntimeError(f"{self.name}: no delta offered for version {version}")
        wire = apply = verify = 0.0
        for rx in self.receivers:
            prep = rx.prepare(layout, self.transport, offer.base_version if offer else None,
                              offer.bytes if offer else None)
            if offer is not None and prep.delta_addr is None:
                raise RuntimeError(f"{self.name}: receiver does not hold version {version - 1}")
            req = PushRequest(version=version, ip=self.ip, num_engines=engines, transport=self.transport,
                              session_ids=prep.session_ids, buffer_addr=prep.buffer_addr,
                              delta_base=offer.base_version if offer else None,
                              delta_addr=prep.delta_addr if offer else None)
            pushed = await asyncio.to_thread(sender.push, req)
            wire += pushed.bytes
            commit = await rx.commit(CommitRequest(
                version=version, fingerprint=pushed.fingerprint, shards=pushed.shards, checksums=pushed.checksums,
                delta_base=pushed.delta_base, delta_bytes=pushed.bytes if offer else None))
            apply += commit.apply_s or 0.0
            verify += commit.verify_s
        row = {"s": time.perf_counter() - t0 + encode_s, "bytes": wire / len(self.receivers), "encode_s": encode_s,
               "apply_s": apply, "verify_s": verify}
        self.rows["delta" if delta else "full"].append(row)
        return row


def bf16_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}


def words(state: dict[str, torch.Tensor]) -> np.ndarray:
    return torch.cat([t.reshape(-1).view(torch.int16) for t in state.values()]).numpy()


async def run(args: argparse.Namespace) -> int:
    torch.manual_seed(0)
    model = build_model(0, **MODELS[args.model])
    model.train()
    model.requires_grad_(True)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    gen = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size

    rate = args.rate_gbit * 1e9 / 8
    plain = SenderAgent(["127.0.0.1"], 0)
    capped = SenderAgent(["127.0.0.2"], 0, tcp_rate_bytes_per_s=rate)
    receivers: list[BenchReceiver] = []

    async def pair(k: int) -> list[BenchReceiver]:
        out = []
        for r in range(args.receivers):
            rx = BenchReceiver(f"127.0.1.{k * args.receivers + r + 1}", "http://127.0.0.1:9")
            await rx.start()
            out.append(rx)
        receivers.extend(out)
        return out

    links = [Link("TCP", plain, "127.0.0.1", "tcp", await pair(0)),
             Link(f"TCP capped {args.rate_gbit:g} Gbit/s", capped, "127.0.0.2", "tcp", await pair(1))]
    if not args.no_mooncake and mooncake_available():
        links.append(Link("Mooncake TCP", plain, "127.0.0.1", "mooncake", await pair(2)))
    steps: list[dict[Any, Any]] = []
    try:
        state = bf16_state(model)
        for sender in (plain, capped):
            sender.stage(state, 0)
        for link in links:  # version 0 everywhere, in full
            await link.push(0, False, args.engines)
            link.rows["full"].clear()
        prev = words(state)
        lrs = [1e-6] * args.steps_per_lr + [1e-5] * args.steps_per_lr
        for version, lr in enumerate(lrs, start=1):
            for group in opt.param_groups:
                group["lr"] = lr
            t0 = time.perf_counter()
            ids = torch.randint(0, vocab, (args.tokens + 1,), generator=gen)
            loss = torch.nn.functional.cross_entropy(model(ids[:-1]), ids[1:])
            opt.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            train_s = time.perf_counter() - t0
            state = bf16_state(model)
            cur = words(state)
            changed = float(np.count_nonzero(prev != cur)) / len(cur)
            prev = cur
            for sender in (plain, capped):
                sender.stage(state, version)
            step: dict[Any, Any] = {"version": version, "lr": lr, "changed": changed, "train_s": train_s}
            for link in links:
                step[(link.name, "delta")] = await link.push(version, True, args.engines)
                step[(link.name, "full")] = await link.push(version, False, args.engines)
            steps.append(step)
            d = step[(links[0].name, "delta")]
            print(f"step {version} lr {lr:g}: {100 * changed:.2f}% of bf16 values changed, delta "
                  f"{d['bytes'] / 1e6:.2f} MB, train {train_s:.1f}s", flush=True)
        layout: WeightLayout | None = plain.layout
        assert layout is not None and plain.buffer is not None
        total = layout.total_bytes
        exact = all(rx.buffer is not None and all(torch.equal(t.view(torch.int16), state[n].view(torch.int16))
                                                  for n, t in unpack(rx.buffer, layout)) for rx in receivers)
        report(args, params, total, links, steps, exact)
        return 0 if exact else 1
    finally:
        for rx in receivers:
            await rx.close()
        plain.stop()
        capped.stop()


def report(args: argparse.Namespace, params: int, total: int, links: list[Link], steps: list[dict[Any, Any]],
           exact: bool) -> None:
    print(f"\n{params / 1e6:.1f}M parameters, {total / 1e6:.1f} MB in bf16; {args.receivers} receivers, "
          f"{args.engines} shards per push; medians over {args.steps_per_lr} steps per learning rate\n")
    print("| lr | bf16 values changed | link | bytes/receiver full | delta | fewer | push full (s) | delta (s) "
          "| faster | encode (s) | apply (s, all rx) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for lr in sorted({s["lr"] for s in steps}):
        mine = [s for s in steps if s["lr"] == lr]
        changed = statistics.median(s["changed"] for s in mine)
        for link in links:
            full = [s[(link.name, "full")] for s in mine]
            delta = [s[(link.name, "delta")] for s in mine]
            fb, db = statistics.median(r["bytes"] for r in full), statistics.median(r["bytes"] for r in delta)
            fs, ds = statistics.median(r["s"] for r in full), statistics.median(r["s"] for r in delta)
            print(f"| {lr:g} | {100 * changed:.2f}% | {link.name} | {fb / 1e6:.1f} MB | {db / 1e6:.2f} MB | "
                  f"{fb / db:.0f}x | {fs:.3f} | {ds:.3f} | {fs / ds:.1f}x | "
                  f"{statistics.median(r['encode_s'] for r in delta):.3f} | "
                  f"{statistics.median(r['apply_s'] for r in delta):.3f} |")
    print(f"\nafter {len(steps)} steps every receiver's bytes equal the trainer's: {exact}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="100m")
    p.add_argument("--steps-per-lr", type=int, default=5, help="steps at lr 1e-6, then as many at 1e-5")
    p.add_argument("--tokens", type=int, default=32, help="tokens per training batch")
    p.add_argument("--receivers", type=int, default=2)
    p.add_argument("--engines", type=int, default=4, help="shards per push (num_mooncake_engines_per_group)")
    p.add_argument("--rate-gbit", type=float, default=1.0, help="the capped TCP link, Gbit/s")
    p.add_argument("--no-mooncake", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
