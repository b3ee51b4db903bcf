#!/usr/bin/env python
"""The honest spread of the trust probe's log-probs on a GPU, by dtype and TP, against trust.py's tolerances.

Boxes at one weight version compute the probe (sglang/logprob_probe.py: 32 fixed prompt tokens, every
token's log-prob) with the same weights but beside different neighbours: SGLang packs the tokens of every
request in a batch into one matrix, so each linear layer's GEMM has another row count, and cuBLAS picks its
kernel (tiling, split-K) by shape. That is the noise a probe comparison must tolerate. This script measures
it with torch alone (no SGLang on the GPU machine): a Llama-shaped model of 8B dimensions by default, random
weights (seeded) with the output layer scaled so logits spread like a trained model's (standard deviation
``--logit-std``), the probe run alone and packed with other sequences of many lengths, in float32, bfloat16
and float16, at TP 1 and TP 2 (TP 2 simulated: the row-parallel layers, attention's output and the MLP's
down projection, computed as two half products summed in the serving dtype, as an all-reduce does).

Printed per row: the mean absolute difference of the probe's per-token log-probs against the probe alone
(the figure trust.judge compares with the tolerance), the worst and the median over the compositions, the
worst over every pair of compositions, the max single-token difference, the tolerance, and the margin
(tolerance / worst mean). Last, what faults move the mean by (see :func:`fault_move`). Attention runs per
sequence (PyTorch SDPA), so its share of the spread is not in these figures: SGLang's attention kernels plan
their splits by batch shape too.

    python benchmarks/measure_probe_spread_gpu.py [--layers 32] [--dtypes float32 bfloat16 float16]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rollout_manager.instances.trust import tolerance  # noqa: E402
from rollout_manager.sglang.logprob_probe import ID_RUNGS, probe_ids, probe_limit  # noqa: E402

# Lengths of the other sequences packed with the probe, one composition per tuple (the first: alone).
COMPOSITIONS: tuple[tuple[int, ...], ...] = (
    (), (1,), (7,), (64,), (255,), (31, 1, 1, 1), (512, 300), (1000,), (2048,), (4000, 1000, 37), (8191,),
)


@dataclass(frozen=True)
class Dims:
    vocab: int
    hidden: int
    heads: int
    kv_heads: int
    inter: int
    layers: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


class Model:
    """Weights of a Llama-shaped decoder in one dtype on one device, and a forward over packed sequences."""

    def __init__(self, dims: Dims, dtype: torch.dtype, device: str, logit_std: float, seed: int = 0) -> None:
        self.dims, self.dtype = dims, dtype
        gen = torch.Generator(device=device).manual_seed(seed)
        d = dims

        def w(rows: int, cols: int, std: float) -> torch.Tensor:
            return (torch.randn(rows, cols, generator=gen, device=device) * std).to(dtype)

        std = 0.02
        self.embed = w(d.vocab, d.hidden, 1.0)
        self.layers = []
        for _ in range(d.layers):
            self.layers.append({
                "q": w(d.heads * d.head_dim, d.hidden, std), "k": w(d.kv_heads * d.head_dim, d.hidden, std),
                "v": w(d.kv_heads * d.head_dim, d.hidden, std), "o": w(d.hidden, d.heads * d.head_dim, std),
                "gate": w(d.inter, d.hidden, std), "up": w(d.inter, d.hidden, std), "down": w(d.hidden, d.inter, std),
            })
        self.lm_head = w(d.vocab, d.hidden, logit_std / math.sqrt(d.hidden))
        inv = 1.0 / (10000.0 ** (torch.arange(0, d.head_dim, 2, device=device).float() / d.head_dim))
        pos = torch.arange(16384, device=device).float()
        freqs = torch.outer(pos, inv)
        self.cos, self.sin = freqs.cos(), freqs.sin()

    @staticmethod
    def _norm(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

    def _rope(self, x: torch.Tensor, n: int) -> torch.Tensor:  # x: [heads, n, head_dim]
        cos, sin = self.cos[:n].to(x.dtype), self.sin[:n].to(x.dtype)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)

    def _row_parallel(self, x: torch.Tensor, weight: torch.Tensor, tp: int) -> torch.Tensor:
        if tp == 1:
            return x @ weight.T
        parts = [xs @ ws.T for xs, ws in zip(x.chunk(tp, dim=-1), weight.chunk(tp, dim=-1))]
        out = parts[0]
        for p in parts[1:]:
            out = out + p  # summed in the serving dtype, as the all-reduce does
        return out

    @torch.inference_mode()
    def probe_logprobs(self, seqs: list[list[int]], tp: int) -> torch.Tensor:
        """Log-prob of each token of ``seqs[0]`` (the probe) after the first, the sequences packed together."""
        d = self.dims
        lens = [len(s) for s in seqs]
        ids = torch.tensor([t for s in seqs for t in s], device=self.embed.device)
        x = self.embed[ids]
        for layer in self.layers:
            h = self._norm(x)
            q, k, v = h @ layer["q"].T, h @ layer["k"].T, h @ layer["v"].T
            outs, at = [], 0
            for n in lens:
                qs = self._rope(q[at:at + n].view(n, d.heads, d.head_dim).transpose(0, 1), n)
                ks = self._rope(k[at:at + n].view(n, d.kv_heads, d.head_dim).transpose(0, 1), n)
                vs = v[at:at + n].view(n, d.kv_heads, d.head_dim).transpose(0, 1)
                rep = d.heads // d.kv_heads
                a = F.scaled_dot_product_attention(qs[None], ks.repeat_interleave(rep, 0)[None],
                                                   vs.repeat_interleave(rep, 0)[None], is_causal=True)
                outs.append(a[0].transpose(0, 1).reshape(n, d.hidden))
                at += n
            x = x + self._row_parallel(torch.cat(outs), layer["o"], tp)
            h = self._norm(x)
            x = x + self._row_parallel(F.silu(h @ layer["gate"].T) * (h @ layer["up"].T), layer["down"], tp)
        # SGLang computes logits for the rows that want log-probs (the probe's) and each other sequence's last.
        rows = list(range(lens[0]))
        at = lens[0]
        for n in lens[1:]:
            at += n
            rows.append(at - 1)
        logits = (self._norm(x[rows]) @ self.lm_head.T).float()[: lens[0]]
        probe = torch.tensor(seqs[0], device=logits.device)
        return torch.log_softmax(logits[:-1], dim=-1).gather(1, probe[1:, None])[:, 0]


FAULTS = ("noise 1%", "noise 10%", "swap", "step")


def fault_move(model: Model, probe: list[int], alone: torch.Tensor, tp: int, kind: str, device: str) -> float:
    """How far a fault moves the probe's mean: noise of 1% or 10% of the mean magnitude on the middle layer's
    MLP down projection, that tensor replaced by the next layer's (a misplaced write), or every tensor
    moved by 1e-3 of its mean magnitude (weights one small training step away)."""
    mid = model.dims.layers // 2
    gen = torch.Generator(device=device).manual_seed(7)
    targets = ([layer[n] for layer in model.layers for n in layer] if kind == "step"
               else [model.layers[mid]["down"]])
    saved = [t.clone() for t in targets]
    for t in targets:
        if kind == "swap":
            t.copy_(model.layers[(mid + 1) % model.dims.layers]["down"])
            continue
        scale = {"noise 1%": 0.01, "noise 10%": 0.1, "step": 1e-3}[kind]
        t += (torch.randn(t.shape, generator=gen, device=device) * scale * t.float().abs().mean()).to(t.dtype)
    moved = (model.probe_logprobs([probe], tp) - alone).abs().mean().item()
    for t, s in zip(targets, saved):
        t.copy_(s)
    return moved


def others(lengths: tuple[int, ...], vocab: int, salt: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1000 + salt)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--inter", type=int, default=14336)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--logit-std", type=float, default=3.0)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "float16"])
    ap.add_argument("--tp", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    dims = Dims(args.vocab, args.hidden, args.heads, args.kv_heads, args.inter, args.layers)
    probe = probe_ids(probe_limit(args.vocab) or ID_RUNGS[0])  # the prompt the manager sends such boxes
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"device {name}; torch {torch.__version__}; model {dims}; logit std {args.logit_std}; probe {len(probe)} "
          f"tokens; {len(COMPOSITIONS) - 1} compositions beside it (other lengths {COMPOSITIONS[1:]})")
    print(f"{'dtype':>9} {'tp':>2} {'worst mean':>11} {'median mean':>11} {'worst pair':>11} {'max token':>10} "
          f"{'tolerance':>9} {'margin':>7} {'s/pass':>7}  " + "  ".join(f"{k:>9}" for k in FAULTS))
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        model = Model(dims, dtype, args.device, args.logit_std)
        alone_tp1: torch.Tensor | None = None
        for tp in args.tp:
            t0 = time.perf_counter()
            alone = model.probe_logprobs([probe], tp)
            if tp == 1:
                alone_tp1 = alone
            runs = [alone] + [model.probe_logprobs([probe, *others(lengths, args.vocab, k)], tp)
                              for k, lengths in enumerate(COMPOSITIONS[1:])]
            means = [(got - alone).abs().mean().item() for got in runs[1:]]
            maxes = [(got - alone).abs().max().item() for got in runs[1:]]
            pairs = max((a - b).abs().mean().item() for i, a in enumerate(runs) for b in runs[i + 1:])
            if args.device == "cuda":
                torch.cuda.synchronize()
            per_pass = (time.perf_counter() - t0) / len(COMPOSITIONS)
            faults = [fault_move(model, probe, alone, tp, kind, args.device) for kind in FAULTS]
            tol = tolerance(dtype_name, None, tp)
            worst = max(means)
            med = sorted(means)[len(means) // 2]
            margin = f"{tol / worst:7.0f}" if worst > 0 else "    inf"
            print(f"{dtype_name:>9} {tp:>2} {worst:11.2e} {med:11.2e} {pairs:11.2e} {max(maxes):10.2e} {tol:9.0e} "
                  f"{margin} {per_pass:7.3f}  " + "  ".join(f"{f:9.2e}" for f in faults))
            if tp != 1 and alone_tp1 is not None:
                cross = (alone - alone_tp1).abs()
                print(f"{'':>9} {'':>2} TP {tp} against TP 1, probe alone: mean {cross.mean().item():.2e}, "
                      f"max {cross.max().item():.2e}")
        del model
        if args.device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
