"""Peer bootstrap and a relay tree against pushes from the trainer, on loopback. Prints markdown tables.

Run from the repository root (about a minute on a 2-core box):

    .venv/bin/python benchmarks/bench_peer_bootstrap.py

Receiver agents run in this process, each on its own 127.0.1.x address, SGLang's load left out (a
commit verifies every shard against the trainer's checksums and stops there). The trainer's
:class:`SenderAgent` sends over plain TCP capped at ``--rate-gbit`` (the slow link between the trainer's
cluster and the boxes), or uncapped, or over Mooncake TCP.

1. Bootstrap: two receivers hold the version (pushed by the trainer); a third joins and gets it
   (a) from the trainer's sender, (b) from a peer (``/layout``, ``/prepare``, ``/serve``, ``/commit``,
   as the manager drives them). Reported: the trainer sender's bytes for the joining box and the time.
2. Relay tree: ``--tree-receivers`` boxes get a version (a) as that many direct pushes over the capped
   link, (b) through a tree: the trainer sends to ``k`` boxes, each forwards to ``k`` more, and so on
   (a parent serves its children one after the other, parents run side by side). Peers' own uplinks are
   uncapped (boxes in one remote cluster) or capped at the same rate (boxes each behind a slow link).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

import torch
from bench_weight_delta import MODELS, BenchReceiver  # the same model sizes, the same SGLang-less receiver

from rollout_manager.cpu_engine.model import build_model
from rollout_manager.weights.layout import WeightLayout
from rollout_manager.weights.mooncake_engine import mooncake_available
from rollout_manager.weights.protocol import CommitRequest, PushAnswer, PushRequest, ServeRequest, TransportName
from rollout_manager.weights.sender_agent import SenderAgent
from rollout_manager.weights.tcp_transport import TcpEngine

VERSION = 1


_next_host = iter(range(1, 250))


async def receivers(n: int, transport: TransportName, uplink_rate: float | None = None) -> list[BenchReceiver]:
    out = []
    for _ in range(n):
        rx = BenchReceiver(f"127.0.1.{next(_next_host)}", "http://127.0.0.1:9")
        await rx.start()
        if transport == "tcp":  # its own uplink, capped where boxes each sit behind a slow link
            rx.tcp = TcpEngine(rx.host, rate_bytes_per_s=uplink_rate).start()
        out.append(rx)
    return out


async def from_sender(sender: SenderAgent, rx: BenchReceiver, transport: TransportName, engines: int) -> PushAnswer:
    """prepare -> push -> commit, as WeightSync._push does for a full push."""
    assert sender.layout is not None
    prep = rx.prepare(sender.layout, transport)
    pushed = await asyncio.to_thread(sender.push, PushRequest(
        version=VERSION, ip=sender.ips[0], num_engines=engines, transport=transport, session_ids=prep.session_ids,
        buffer_addr=prep.buffer_addr))
    await rx.commit(CommitRequest(version=VERSION, fingerprint=pushed.fingerprint, shards=pushed.shards,
                                  checksums=pushed.checksums))
    return pushed


async def from_peer(peer: BenchReceiver, rx: BenchReceiver, transport: TransportName, engines: int,
                    trainer: PushAnswer) -> PushAnswer:
    """layout -> prepare -> serve -> commit against the trainer's checksums, as WeightSync._pull_from_peer."""
    held = peer.held_layout()
    assert held is not None and held.version == VERSION
    prep = rx.prepare(WeightLayout.from_dict(held.layout.model_dump()), transport)
    served = await peer.serve_peer(ServeRequest(version=VERSION, fingerprint=held.fingerprint, num_engines=engines,
                                                session_ids=prep.session_ids, buffer_addr=prep.buffer_addr,
                                                transport=transport))
    await rx.commit(CommitRequest(version=VERSION, fingerprint=served.fingerprint, shards=trainer.shards,
                                  checksums=trainer.checksums))
    return served


async def bootstrap(name: str, sender: SenderAgent, transport: TransportName, engines: int) -> list[str]:
    serving = await receivers(2, transport)
    (joiner,) = await receivers(1, transport)
    try:
        trainer = None
        for rx in serving:
            trainer = await from_sender(sender, rx, transport, engines)
        assert trainer is not None
        rows = []
        for source in ("trainer", "peer"):
            sent0, t0 = sender.bytes_sent, time.perf_counter()
            if source == "trainer":
                await from_sender(sender, joiner, transport, engines)
            else:
                await from_peer(serving[0], joiner, transport, engines, trainer)
            seconds = time.perf_counter() - t0
            assert joiner.held == (VERSION, trainer.fingerprint)
            rows.append(f"| {name} | {source} | {(sender.bytes_sent - sent0) / 1e6:.1f} MB | {seconds:.3f} |")
        return rows
    finally:
        for rx in (*serving, joiner):
            await rx.close()


async def tree(sender: SenderAgent, n: int, k: int, uplink_rate: float | None, engines: int) -> float:
    """Every box gets the version through a k-ary relay tree (k == n: n direct pushes). Returns seconds."""
    boxes = await receivers(n, "tcp", uplink_rate)
    try:
        t0 = time.perf_counter()
        trainer: list[PushAnswer] = []

        async def feed(parent: int | None, children: list[int]) -> None:
            for c in children:  # one after the other: they share the parent's uplink
                if parent is None:
                    trainer.append(await from_sender(sender, boxes[c], "tcp", engines))
                else:
                    await from_peer(boxes[parent], boxes[c], "tcp", engines, trainer[0])
            await asyncio.gather(*(feed(c, kids(c)) for c in children))

        def kids(i: int) -> list[int]:  # breadth first: the trainer's are 0..k-1, box i's are k(i+1)..
            return [c for c in range(k * (i + 1), k * (i + 2)) if c < n]

        await feed(None, list(range(min(k, n))))
        seconds = time.perf_counter() - t0
        assert all(b.held is not None and b.held[0] == VERSION for b in boxes)
        return seconds
    finally:
        for b in boxes:
            await b.close()


async def run(args: argparse.Namespace) -> int:
    model = build_model(0, **MODELS[args.model])
    state = {n: p.detach().to(torch.bfloat16) for n, p in model.state_dict().items()}
    rate = args.rate_gbit * 1e9 / 8
    plain = SenderAgent(["127.0.0.1"], 0)
    capped = SenderAgent(["127.0.0.2"], 0, tcp_rate_bytes_per_s=rate)
    for sender in (plain, capped):
        sender.stage(state, VERSION)
    assert plain.layout is not None
    total = plain.layout.total_bytes
    try:
        print(f"{sum(t.numel() for t in state.values()) / 1e6:.1f}M parameters, {total / 1e6:.1f} MB in bf16; "
              f"{args.engines} shards per push\n")
        print("Bootstrap of a box joining while 2 serve (the peers' own links uncapped)\n")
        print("| trainer link | source | trainer sender's bytes for the box | time (s) |\n|---|---|---|---|")
        rows = await bootstrap(f"TCP capped {args.rate_gbit:g} Gbit/s", capped, "tcp", args.engines)
        rows += await bootstrap("TCP", plain, "tcp", args.engines)
        if not args.no_mooncake and mooncake_available():
            rows += await bootstrap("Mooncake TCP", plain, "mooncake", args.engines)
        print("\n".join(rows))
        n = args.tree_receivers
        print(f"\nRelay tree: {n} boxes, the trainer's link capped at {args.rate_gbit:g} Gbit/s\n")
        print("| peers' uplinks | direct (s) | " + " | ".join(f"tree k={k} (s)" for k in args.k) + " |")
        print("|---|---|" + "---|" * len(args.k))
        for label, uplink in (("uncapped", None), (f"capped {args.rate_gbit:g} Gbit/s", rate)):
            direct = await tree(capped, n, n, uplink, args.engines)
            trees = [await tree(capped, n, k, uplink, args.engines) for k in args.k]
            cells = " | ".join(f"{t:.2f} ({direct / t:.1f}x)" for t in trees)
            print(f"| {label} | {direct:.2f} | {cells} |", flush=True)
        return 0
    finally:
        plain.stop()
        capped.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="small")
    p.add_argument("--engines", type=int, default=4, help="shards per push (num_mooncake_engines_per_group)")
    p.add_argument("--rate-gbit", type=float, default=1.0, help="the capped links, Gbit/s")
    p.add_argument("--tree-receivers", type=int, default=8)
    p.add_argument("--k", type=int, nargs="+", default=[1, 2, 4], help="tree fan-outs to measure")
    p.add_argument("--no-mooncake", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
