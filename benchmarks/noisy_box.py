"""A CPU-engine box made to differ from its peers as a bf16 GPU box does: a pass-through HTTP proxy in front of
one engine that adds batch-composition noise to the trust probe's log-probs and says it serves ``bfloat16``.

Why. On CPU the probe is bit-exact between boxes and whatever shares the probe's batch (docs/reliability.md,
"Trust probe"), so a clean CPU fleet cannot produce a false quarantine and a bench on it proves nothing about
one. On a GPU in bf16 the probe's log-probs move with the batch it was computed in (cuBLAS picks kernels by
row count): ``benchmarks/measure_probe_spread_gpu.py`` on an H100 measured the probe's mean |log-prob
difference| between compositions at up to 0.039, 0.117 and 0.388 for logits of standard deviation 1, 3 and 8.

The model here. The probe's composition is the number of the box's own ``/generate`` calls in flight when the
probe arrives (0: alone). Each composition has its own fixed offset per probe token, a Gaussian draw seeded by
the composition alone, the same on every box: two boxes probed in the same composition agree exactly, as GPUs
of one kind running the same kernels do; in different ones they differ by ``spread`` in the mean (the
Gaussian's scale is ``spread * sqrt(pi) / 2``, so the expected mean |difference| of two compositions is
``spread``). Only the probe's answer is touched: the tokens a box makes stay the engine's exact ones, so a token
made on corrupted weights can still be told from a clean one.

    .venv/bin/python benchmarks/noisy_box.py --port P --upstream 127.0.0.1:Q --spread 0.117 [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import math
import random
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from rollout_manager.sglang import wire
from rollout_manager.sglang.logprob_probe import is_probe

BF16 = "bfloat16"
# Hop-by-hop and framing headers: aiohttp sets its own on each side.
DROPPED_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "content-encoding", "keep-alive"}


@dataclass(frozen=True)
class CompositionNoise:
    """The probe's per-token log-prob offset in each batch composition: same composition, same offsets."""

    spread: float  # expected mean |difference| of the probe between two compositions
    seed: int = 0

    @property
    def sigma(self) -> float:
        """Per-token scale: E|x - y| = 2 sigma / sqrt(pi) for two independent N(0, sigma^2) draws."""
        return self.spread * math.sqrt(math.pi) / 2

    def offsets(self, composition: int, n: int) -> list[float]:
        if self.spread <= 0:
            return [0.0] * n
        rng = random.Random(f"{self.seed}:{composition}")
        return [rng.gauss(0.0, self.sigma) for _ in range(n)]


def add_noise(answer: Any, offsets_of: CompositionNoise, composition: int) -> Any:
    """The probe's answer (SGLang's ``meta_info.input_token_logprobs``: ``[logprob, id, text]`` each, the
    first one's log-prob null) with the composition's offsets added; anything else is returned as is."""
    meta = answer.get("meta_info") if isinstance(answer, dict) else None
    entries = meta.get("input_token_logprobs") if isinstance(meta, dict) else None
    if not isinstance(entries, list):
        return answer
    offsets = offsets_of.offsets(composition, len(entries))
    for entry, offset in zip(entries[1:], offsets):
        if isinstance(entry, list) and entry and isinstance(entry[0], (int, float)):
            entry[0] = float(entry[0]) + offset
    return answer


@dataclass
class NoisyBox:
    """The proxy's state: the engine behind it, the noise, and the box's calls in flight."""

    upstream: str  # "host:port" of the engine
    noise: CompositionNoise
    in_flight: int = 0
    compositions: dict[int, int] = field(default_factory=dict)  # composition -> probes seen in it
    session: aiohttp.ClientSession | None = None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        assert self.session is not None
        body = await request.read()
        probe = False
        if request.path == wire.GENERATE and body:
            try:
                probe = is_probe(json.loads(body))
            except ValueError:
                probe = False
        counted = request.path == wire.GENERATE and not probe
        composition = self.in_flight
        if counted:
            self.in_flight += 1
        headers = {k: v for k, v in request.headers.items() if k.lower() not in DROPPED_HEADERS}
        try:
            async with self.session.request(request.method, f"http://{self.upstream}{request.path_qs}", data=body,
                                            headers=headers) as up:
                if (probe or request.path in (wire.SERVER_INFO, wire.GET_SERVER_INFO)) and up.status == 200:
                    answer = await up.json(content_type=None)
                    if probe:
                        self.compositions[composition] = self.compositions.get(composition, 0) + 1
                        answer = add_noise(answer, self.noise, composition)
                    elif isinstance(answer, dict):
                        answer["dtype"] = BF16  # judged with bf16's tolerance, as a GPU box in bf16 is
                    return web.json_response(answer, status=up.status)
                out = web.StreamResponse(status=up.status, headers={
                    k: v for k, v in up.headers.items() if k.lower() not in DROPPED_HEADERS})
                await out.prepare(request)
                async for chunk in up.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                return out
        finally:
            if counted:
                self.in_flight -= 1

    async def stats(self, request: web.Request) -> web.Response:
        """The compositions the probes met (the bench reads it to say how often boxes differed)."""
        return web.json_response({"compositions": {str(k): v for k, v in sorted(self.compositions.items())}})


def app(box: NoisyBox) -> web.Application:
    async def open_session(_: web.Application) -> None:
        box.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                            timeout=aiohttp.ClientTimeout(total=None))

    async def close_session(_: web.Application) -> None:
        if box.session is not None:
            await box.session.close()

    a = web.Application(client_max_size=1 << 30)  # weight loads pass through too
    a.on_startup.append(open_session)
    a.on_cleanup.append(close_session)
    a.router.add_get("/_noisy_box", box.stats)
    a.router.add_route("*", "/{tail:.*}", box.handle)
    return a


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--upstream", required=True, help="host:port of the engine")
    ap.add_argument("--spread", type=float, required=True, help="mean |log-prob difference| between compositions")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    web.run_app(app(NoisyBox(args.upstream, CompositionNoise(args.spread, args.seed))), host="127.0.0.1",
                port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
