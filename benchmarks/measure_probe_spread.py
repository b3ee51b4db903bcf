"""The honest spread of the trust probe's log-probs on real SGLang 0.5.23 (CPU), which trust.py's tolerances
must stay above, and what a rogue write moves them by, which they must stay below.

For each tiny model (tests/real_sglang_model.py: a Llama and a Qwen2) and each dtype (float32, bfloat16), two
SGLang servers of the same weights are started alone; the probe (sglang/logprob_probe.py: the manager's own
prompt and body) goes to each, several times alone and several times while other requests run beside it on
the same box (prefills and decodes of other lengths: another batch composition). Printed per row: the max
and the mean absolute difference of the probe's per-token log-probs, and the mean one (what trust.judge
compares with the tolerance). Last, one tensor of the second server is rewritten through SGLang's own
``/update_weights_from_tensor`` (noise of 1% and 5% of its mean magnitude, or another tensor of its size):
the move a fault makes. The tiny models are random, so their logits are near zero and their log-probs near
-ln(vocabulary): every difference here is small next to a trained model's.

    .venv/bin/python benchmarks/measure_probe_spread.py [--repeats 5] [--beside 8] [--arch llama qwen2]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import uuid
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from real_sglang import SGLangServer, make_tiny_model, start_sglang  # noqa: E402

from rollout_manager.instances.trust import tolerance  # noqa: E402
from rollout_manager.sglang import tensor_payload, wire  # noqa: E402
from rollout_manager.sglang.logprob_probe import PROBE_RID_PREFIX, parse_input_logprobs, probe_body, probe_ids  # noqa: E402

VOCAB = 1024  # tests/real_sglang_model.py
# (tensor, noise scale): each written on top of the checkpoint's values (the earlier one is overwritten or
# left; the probe is compared with box A's). A scale of 1 or more: the tensor replaced by another of its size.
ROGUE_WRITES = (("model.layers.1.mlp.down_proj.weight", 0.01), ("model.layers.1.mlp.down_proj.weight", 0.05),
                ("model.layers.1.mlp.down_proj.weight", 1.0), ("lm_head.weight", 0.05), ("lm_head.weight", 1.0))


async def probe(s: aiohttp.ClientSession, url: str) -> list[float]:
    ids = probe_ids(VOCAB)
    async with s.post(url + wire.GENERATE, json=probe_body(ids, PROBE_RID_PREFIX + uuid.uuid4().hex)) as r:
        r.raise_for_status()
        return parse_input_logprobs(await r.json(content_type=None), ids)


async def beside(s: aiohttp.ClientSession, url: str, i: int) -> None:
    """Another client's request: its own prompt length and a few decode steps, so the probe's prefill shares
    the box with prefills and decodes of other shapes."""
    body = {"input_ids": [(11 + 17 * i + 3 * j) % VOCAB for j in range(8 + 13 * i)],
            "sampling_params": {"max_new_tokens": 300 + 20 * i, "temperature": 0.0, "ignore_eos": True}}
    async with s.post(url + wire.GENERATE, json=body) as r:
        r.raise_for_status()
        await r.read()


async def probe_beside(s: aiohttp.ClientSession, url: str, n: int, lead_s: float) -> list[float]:
    """The probe sent ``lead_s`` after ``n`` other requests (0: together, so their prefills share its batch;
    later: while they decode)."""
    others = [asyncio.ensure_future(beside(s, url, i)) for i in range(n)]
    await asyncio.sleep(lead_s)
    values = await probe(s, url)
    assert not all(o.done() for o in others), "the other requests finished before the probe: no overlap"
    await asyncio.gather(*others)
    return values


def diffs(a: list[float], b: list[float]) -> tuple[float, float]:
    d = [abs(x - y) for x, y in zip(a, b, strict=True)]
    return max(d), sum(d) / len(d)


async def rogue_write(s: aiohttp.ClientSession, url: str, model_dir: Path, name: str, scale: float,
                      seed: int) -> None:
    """Noise of ``scale`` times the tensor's mean magnitude added to one tensor, written through SGLang's own
    weight-update session, no version given: the box still says it serves the version it did."""
    import torch
    from safetensors.torch import load_file

    t = load_file(str(model_dir / "model.safetensors"))[name]
    noise = t.abs().mean() * torch.randn(t.shape, generator=torch.Generator().manual_seed(seed))
    changed = noise if scale >= 1 else t + scale * noise
    payload = [tensor_payload.serialize_named_tensors([(name, changed.contiguous())])]
    for path, body in (("/begin_weight_update", {}),
                       ("/update_weights_from_tensor",
                        wire.update_weights_from_tensor_body(payload, flush_cache=True, weight_version=None)),
                       ("/end_weight_update", {})):
        async with s.post(url + path, json=body) as r:
            text = await r.text()
            if r.status != 200:
                raise RuntimeError(f"{path}: HTTP {r.status} {text[:300]}")


def row(what: str, pairs: list[tuple[list[float], list[float]]]) -> dict[str, Any]:
    d = [diffs(a, b) for a, b in pairs]
    out = {"what": what, "max_abs": max(x[0] for x in d), "mean_abs": max(x[1] for x in d)}
    print(f"  {what:<44} max |d| {out['max_abs']:.3g}   mean |d| (worst of {len(d)}) {out['mean_abs']:.3g}",
          flush=True)
    return out


async def measure(servers: list[SGLangServer], model_dir: Path, repeats: int, n_beside: int) -> None:
    a, b = servers
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        ref = await probe(s, a.url)
        alone_a = [await probe(s, a.url) for _ in range(repeats)]
        alone_b = [await probe(s, b.url) for _ in range(repeats)]
        together = [await probe_beside(s, a.url, n_beside, 0.0) for _ in range(repeats)]
        decoding = [await probe_beside(s, a.url, n_beside, 0.2) for _ in range(repeats)]
        busy_a = together + decoding
        row("same box, alone, repeated", [(ref, x) for x in alone_a])
        row("two boxes, alone", [(x, y) for x in alone_a for y in alone_b])
        row(f"same box, sent with {n_beside} other prefills", [(ref, x) for x in together])
        row(f"same box, sent while {n_beside} others decode", [(ref, x) for x in decoding])
        row("box B alone vs box A busy", [(x, y) for x in alone_b for y in busy_a])
        spread = [ref, *alone_a, *alone_b, *busy_a]
        print(f"  mean log-prob of the probe: {sum(ref) / len(ref):.3f} (per token, {len(ref)} tokens)")
        for tensor, scale in ROGUE_WRITES:
            await rogue_write(s, b.url, model_dir, tensor, scale, seed=1)
            moved = await probe(s, b.url)
            what = f"{scale:.0%} noise" if scale < 1 else "replaced by a fresh draw"
            row(f"rogue: {tensor.removeprefix('model.')} {what}", [(x, moved) for x in spread])


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--beside", type=int, default=8)
    ap.add_argument("--arch", nargs="+", default=["llama", "qwen2"])
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="probe-spread-") as tmp:
        for arch in args.arch:
            model_dir = make_tiny_model(Path(tmp) / arch, arch)
            for dtype in args.dtype:
                print(f"{arch}, --dtype {dtype} (tolerance now {tolerance(dtype, None, 1):g}):", flush=True)
                with ThreadPoolExecutor(2) as pool:  # the two starts overlap
                    starts = [pool.submit(start_sglang, model_dir, Path(tmp), "--dtype", dtype,
                                          name=f"{arch}-{dtype}-{name}") for name in ("A", "B")]
                    wait(starts)
                servers = [f.result() for f in starts if f.exception() is None]
                try:
                    if len(servers) < 2:
                        raise RuntimeError(f"a server did not start: {[f.exception() for f in starts]}")
                    await measure(servers, model_dir, args.repeats, args.beside)
                finally:
                    for server in servers:
                        server.stop()


if __name__ == "__main__":
    asyncio.run(main())
