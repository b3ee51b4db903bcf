"""A simulated SGLang fleet for the tail benchmark: boxes with SGLang's scheduling shape, no real compute.

One process serves every box (each on its own 127.0.0.1 port, picked by the OS), so that the fleet keeps
one account of which tokens were made where. Each box runs SGLang's loop in scaled time:

- **continuous batching**: a decode step costs ``(base_ms + per_seq_ms * running) / speed`` and gives
  every running sequence one token; at most ``max_running`` run, the rest wait in arrival order;
- **prefill**: admitting a request costs ``prefill_ms * uncached input tokens / speed`` in that step; the
  box's prefix cache holds every prompt it prefilled and every sequence's tokens as far as it made or
  read them, so a continuation on the same box prefills only its new tokens;
- **incremental streams** (``--incremental-streaming-output``), a chunk for the first token, then every
  ``stream_interval`` tokens and at the end; non-streaming calls and SGLang batches (lists of prompts).

Steps are timed against a deadline (each step's end is the previous step's end plus its cost), so the
process's own work does not stretch the simulated time unless it falls behind; ``/fleet/stats`` reports
how far behind it ran (``late_s``) and its CPU.

The model is a function, known to the benchmark (:func:`reference`): prompt ids are below
:data:`OUTPUT_BASE`, output ids at or above it, so a box finds the prompt in a continuation's input. The
token at output position ``k`` is a hash of (prompt, ``sampling_seed``, ``k``); the sequence ends with
:data:`EOS` at the length :func:`length_of` draws from a hash of the prompt (the group's median) and the
seed (the sample around it). The manager never sees the lengths.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import os
import random
import sys
import time
from array import array
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rollout_manager.sglang import wire
from rollout_manager.sglang.logprob_probe import is_probe
from rollout_manager.sglang.sse import sse_frame

OUTPUT_BASE = 50_000  # prompt ids are below, output ids at or above (EOS aside)
OUTPUT_SPAN = 50_000
VOCAB = OUTPUT_BASE + OUTPUT_SPAN
EOS = 2
_MASK = (1 << 64) - 1


# ------------------------------------------------------------------ the model (pure functions)


@dataclass(frozen=True)
class LengthModel:
    """Lengths of one step: a group's median is lognormal around ``median`` (``group_sigma``), its samples
    lognormal around that (``sample_sigma``), clipped to ``[floor, cap]``."""

    median: float = 400.0
    group_sigma: float = 0.9
    sample_sigma: float = 0.35
    cap: int = 4096
    floor: int = 8


def prompt_key(prompt: list[int]) -> int:
    """A 64-bit key of the prompt's ids."""
    return int.from_bytes(hashlib.blake2b(array("q", prompt).tobytes(), digest_size=8).digest(), "little")


def _mix(x: int) -> int:
    """splitmix64's finaliser."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def length_of(pkey: int, seed: int, model: LengthModel) -> int:
    """The sequence's length with its EOS: the group's median from the prompt, the sample's draw from the seed."""
    group = random.Random(pkey).gauss(0.0, 1.0)
    sample = random.Random(_mix(pkey ^ (seed * 0x2545F4914F6CDD1D & _MASK))).gauss(0.0, 1.0)
    n = math.exp(math.log(model.median) + model.group_sigma * group + model.sample_sigma * sample)
    return max(model.floor, min(model.cap, round(n)))


def tokens(pkey: int, seed: int, start: int, end: int, length: int) -> list[int]:
    """The output ids at positions ``[start, end)`` of the sequence of ``length`` (its last one is EOS)."""
    base = _mix(pkey ^ _mix(seed))
    out = [OUTPUT_BASE + _mix(base + k) % OUTPUT_SPAN for k in range(start, min(end, length - 1))]
    if end >= length > start:
        out.append(EOS)
    return out


def reference(prompt: list[int], seed: int, budget: int, model: LengthModel) -> list[int]:
    """What the engine answers for ``prompt`` with ``sampling_seed`` and ``max_new_tokens`` ``budget``."""
    pkey = prompt_key(prompt)
    length = length_of(pkey, seed, model)
    return tokens(pkey, seed, 0, min(length, budget), length)


def split_input(ids: list[int]) -> int:
    """Where the prompt ends in an input: at its first output id."""
    for i in range(len(ids) - 1, -1, -1):  # outputs come last: scan back to the first prompt id
        if ids[i] < OUTPUT_BASE:
            return i + 1
    return 0


# ------------------------------------------------------------------ boxes


@dataclass(frozen=True)
class BoxSpec:
    """One box's timing: a decode step costs ``(base_ms + per_seq_ms * running) / speed`` (scaled ms)."""

    speed: float
    max_running: int = 64
    base_ms: float = 6.0
    per_seq_ms: float = 0.08
    prefill_ms: float = 0.02  # per uncached input token

    def step_s(self, running: int) -> float:
        return (self.base_ms + self.per_seq_ms * running) / self.speed / 1000.0

    def prefill_s(self, tokens: int) -> float:
        return self.prefill_ms * tokens / self.speed / 1000.0


@dataclass(frozen=True)
class Shape:
    """One simulated fleet and its step: the boxes (:class:`BoxSpec`'s timing: a decode step of
    ``(base_ms + per_seq_ms x running) / speed``, at most ``max_running``, prefill ``prefill_ms`` a token /
    speed), the lengths (a group's median lognormal around ``median``, ``group_sigma``; its samples
    ``sample_sigma`` around it; at most ``cap``) and ``chunk_tokens``, how many tokens each streamed chunk
    carries (the manager's ``engine_stream_interval``)."""

    name: str
    speeds: tuple[float, ...] = (1, 1, .6, .6, .6, .35, .35, .35)
    max_running: int = 64
    base_ms: float = 6.0
    per_seq_ms: float = 0.08
    prefill_ms: float = 0.02
    median: float = 400.0
    group_sigma: float = 0.9
    sample_sigma: float = 0.35
    cap: int = 4096
    chunk_tokens: int = 64

    def specs(self, time_scale: float = 1.0) -> list[BoxSpec]:
        k = time_scale
        return [BoxSpec(s, self.max_running, self.base_ms * k, self.per_seq_ms * k, self.prefill_ms * k)
                for s in self.speeds]

    def lengths(self) -> LengthModel:
        return LengthModel(self.median, self.group_sigma, self.sample_sigma, self.cap)

    def describe(self) -> str:
        spread = max(self.speeds) / min(self.speeds)
        return (f"{self.name}: speeds {','.join(f'{s:g}' for s in self.speeds)} ({spread:.1f}x), step "
                f"({self.base_ms:g} + {self.per_seq_ms:g} n) ms, at most {self.max_running}, lengths median "
                f"{self.median:g} sigma {self.group_sigma:g}/{self.sample_sigma:g} cap {self.cap}, "
                f"chunks of {self.chunk_tokens} tokens")

    @property
    def tick(self) -> float:
        """Seconds between two chunks of a stream on the fleet's mean box at half its running cap (the
        simulator hears of every stream's tokens that often)."""
        speed = sum(self.speeds) / len(self.speeds)
        return self.chunk_tokens * (self.base_ms + self.per_seq_ms * self.max_running / 2) / speed / 1000.0


# bench_tail's fleet and step (its defaults).
BENCH = Shape("bench_tail")
# Fleets the policy was not tuned on, for --sweep: 2x to 4x speed spreads, running caps 16 to 128, step shapes
# from nearly flat to per-sequence heavy, length spreads mostly between groups or mostly within, sparse chunks.
SWEEP = (
    BENCH,
    Shape("issue-46", (2, 2, 1, 1, 1, 1, .5, .5), 32, 10.0, 0.3, median=300, group_sigma=0.7, sample_sigma=0.45),
    Shape("two-speeds", (2, 2, 2, 2, 1, 1, 1, 1), 128, 8.0, 0.05, median=600, group_sigma=0.5, sample_sigma=0.6,
          chunk_tokens=32),
    Shape("one-fast", (3, 1.5, 1.5, 1, 1, 1, 1, 1), 16, 12.0, 0.5, median=200, group_sigma=1.0, sample_sigma=0.5,
          cap=8192),
    Shape("four-boxes", (4, 2, 1, 1), 48, 6.0, 0.12, median=400, group_sigma=0.3, sample_sigma=0.8,
          chunk_tokens=128),
    Shape("sixteen", tuple(1 + 2 * k / 15 for k in range(16)), 64, 6.0, 0.08, median=300, group_sigma=0.8,
          sample_sigma=0.4, chunk_tokens=16),
    Shape("slow-chunks", (2, 2, 1, 1, 1, 1, .5, .5), 64, 6.0, 0.08, median=500, group_sigma=0.9, sample_sigma=0.3,
          chunk_tokens=256),
)


@dataclass
class Progress:
    """How far a sequence (prompt, seed) has been made anywhere in the fleet."""

    high: int = 0


@dataclass
class Stats:
    decoded: int = 0  # tokens made by decode steps
    regenerated: int = 0  # of which at a position of their sequence that some box had made before
    prefill_prompt: int = 0  # uncached prompt tokens prefilled
    prefill_output: int = 0  # uncached output tokens prefilled (a sequence continued on a box without them)
    cached: int = 0  # input tokens found in a box's prefix cache
    requests: int = 0
    aborted: int = 0
    mismatched_inputs: int = 0  # continuations whose output ids are not the model's
    late_s: float = 0.0  # the latest a step ended after its deadline
    steps: int = 0
    per_box_decoded: list[int] = field(default_factory=list)
    first_admit: float | None = None
    last_finish: float | None = None


class Seq:
    """One sequence of one request on one box."""

    __slots__ = ("rid", "pkey", "seed", "prompt_len", "start", "made", "budget", "length", "interval",
                 "finish", "event", "progress", "uncached", "sent", "input_len")

    def __init__(self, rid: str, pkey: int, seed: int, prompt_len: int, start: int, budget: int, length: int,
                 interval: int, progress: Progress, input_len: int) -> None:
        self.rid, self.pkey, self.seed = rid, pkey, seed
        self.prompt_len, self.start, self.budget, self.length = prompt_len, start, budget, length
        self.interval, self.progress, self.input_len = interval, progress, input_len
        self.made = 0
        self.sent = 0  # tokens the handler has written (streams)
        self.finish: dict[str, Any] | None = None
        self.event = asyncio.Event()
        self.uncached = 0

    def ids(self, since: int) -> list[int]:
        return tokens(self.pkey, self.seed, self.start + since, self.start + self.made, self.length)

    def limit(self) -> int:
        """Tokens this request makes at most: to the EOS or the budget."""
        return min(self.budget, self.length - self.start)


class Box:
    """One simulated SGLang server: a waiting queue, a running batch, a prefix cache, a decode loop."""

    def __init__(self, index: int, spec: BoxSpec, fleet: Fleet) -> None:
        self.index, self.spec, self.fleet = index, spec, fleet
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.prompts: set[int] = set()
        self.outputs: dict[tuple[int, int], int] = {}  # (prompt key, seed) -> output tokens cached
        self.work = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self.by_rid: dict[str, Seq] = {}

    def submit(self, seq: Seq) -> None:
        self.by_rid[seq.rid] = seq
        if seq.limit() <= 0:
            self._end(seq, wire.finish_reason(wire.LENGTH, length=seq.budget))
            return
        self.waiting.append(seq)
        self.work.set()

    def abort(self, rid: str | None, everything: bool = False) -> None:
        for seq in list(self.by_rid.values()) if everything else [self.by_rid[rid]] if rid in self.by_rid else []:
            self.fleet.stats.aborted += 1
            self._end(seq, wire.finish_reason(wire.ABORT, message="Abort in waiting queue" if seq in self.waiting
                                              else "aborted"))

    def drop(self, seq: Seq) -> None:
        """The caller went away: SGLang aborts the request."""
        if seq.finish is None:
            self.fleet.stats.aborted += 1
            self._end(seq, wire.finish_reason(wire.ABORT, message="client disconnected"))

    def _end(self, seq: Seq, finish: dict[str, Any] | None) -> None:
        seq.finish = finish
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.by_rid.pop(seq.rid, None)
        key = (seq.pkey, seq.seed)
        self.outputs[key] = max(self.outputs.get(key, 0), seq.start + seq.made)
        seq.event.set()

    def _admit(self) -> float:
        """Move waiting sequences into the batch; the prefill time of their uncached tokens."""
        tokens_in = 0
        stats = self.fleet.stats
        while self.waiting and len(self.running) < self.spec.max_running:
            seq = self.waiting.popleft()
            cached_prompt = seq.pkey in self.prompts
            cached_out = min(seq.start, self.outputs.get((seq.pkey, seq.seed), 0)) if cached_prompt else 0
            new_prompt = 0 if cached_prompt else seq.prompt_len
            new_out = seq.start - cached_out
            stats.prefill_prompt += new_prompt
            stats.prefill_output += new_out
            stats.cached += seq.input_len - new_prompt - new_out
            tokens_in += new_prompt + new_out
            self.prompts.add(seq.pkey)
            self.outputs[(seq.pkey, seq.seed)] = max(self.outputs.get((seq.pkey, seq.seed), 0), seq.start)
            self.running.append(seq)
            if stats.first_admit is None:
                stats.first_admit = time.monotonic()
        return self.spec.prefill_s(tokens_in)

    async def loop(self) -> None:
        loop = asyncio.get_running_loop()
        stats = self.fleet.stats
        deadline = loop.time()
        while True:
            if not self.running and not self.waiting:
                self.work.clear()
                await self.work.wait()
                deadline = loop.time()
            cost = self._admit()
            if not self.running:
                continue
            cost += self.spec.step_s(len(self.running))
            deadline = max(deadline + cost, loop.time() - 0.05)  # never bank more than 50 ms of lag
            await asyncio.sleep(max(0.0, deadline - loop.time()))
            stats.late_s = max(stats.late_s, loop.time() - deadline)
            stats.steps += 1
            done: list[Seq] = []
            for seq in self.running:
                pos = seq.start + seq.made
                prog = seq.progress
                if pos < prog.high:
                    stats.regenerated += 1
                else:
                    prog.high = pos + 1
                seq.made += 1
                if seq.made >= seq.limit():
                    done.append(seq)
                elif seq.made - seq.sent >= seq.interval or seq.sent == 0:
                    seq.event.set()
            made = len(self.running)
            stats.decoded += made
            stats.per_box_decoded[self.index] += made
            for seq in done:
                at_eos = seq.start + seq.made >= seq.length
                self._end(seq, wire.finish_reason(wire.STOP, matched=EOS) if at_eos
                          else wire.finish_reason(wire.LENGTH, length=seq.budget))
                stats.last_finish = time.monotonic()

    def counts(self) -> tuple[int, int]:
        return len(self.running), len(self.waiting)


class Fleet:
    """Every box, the shared account of tokens made, and the length model."""

    def __init__(self, specs: list[BoxSpec], model: LengthModel) -> None:
        self.model = model
        self.stats = Stats(per_box_decoded=[0] * len(specs))
        self.progress: dict[tuple[int, int], Progress] = {}
        self.boxes = [Box(i, s, self) for i, s in enumerate(specs)]
        self.next_rid = 0

    def reset(self) -> None:
        """Forget caches, progress and counts (between runs: the next path starts on a cold fleet)."""
        for box in self.boxes:
            box.prompts.clear()
            box.outputs.clear()
        self.progress.clear()
        self.stats = Stats(per_box_decoded=[0] * len(self.boxes))

    def sequence(self, box: Box, body: dict[str, Any], stream_interval: int) -> Seq:
        ids = body.get("input_ids") or []
        params = body.get("sampling_params") or {}
        seed = int(params.get("sampling_seed") or 0)
        cut = split_input(ids)
        prompt = ids[:cut]
        pkey = prompt_key(prompt)
        length = length_of(pkey, seed, self.model)
        start = len(ids) - cut
        if start and ids[cut:] != tokens(pkey, seed, 0, start, length):
            self.stats.mismatched_inputs += 1
        budget = params.get("max_new_tokens")
        budget = 1 << 30 if budget is None else int(budget)
        rid = body.get("rid")
        if not isinstance(rid, str):
            self.next_rid += 1
            rid = f"fleet-{self.next_rid}"
        progress = self.progress.setdefault((pkey, seed), Progress())
        interval = int(params.get("stream_interval") or stream_interval)
        return Seq(rid, pkey, seed, cut, start, budget, length, max(1, interval), progress, len(ids))


def chunk(seq: Seq, since: int, final: bool) -> dict[str, Any]:
    """One output object: the ids made since ``since`` (incremental) and SGLang's meta_info."""
    return {"text": None, "output_ids": seq.ids(since),
            "meta_info": {"id": seq.rid, "finish_reason": seq.finish if final else None,
                          "prompt_tokens": seq.input_len, "completion_tokens": seq.made,
                          "cached_tokens": 0, "weight_version": "0"}}


# ------------------------------------------------------------------ HTTP


def box_app(fleet: Fleet, box: Box, stream_interval: int) -> web.Application:
    spec = box.spec

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if is_probe(body):  # the manager's trust probe: equal log-probs on every box, no scheduling
            ids = body["input_ids"]
            lps = [[None if i == 0 else -1.0, t, None] for i, t in enumerate(ids)]
            return web.json_response({"text": None, "output_ids": [OUTPUT_BASE], "meta_info": {
                "id": body.get("rid"), "finish_reason": wire.finish_reason(wire.LENGTH, length=1),
                "prompt_tokens": len(ids), "completion_tokens": 1, "cached_tokens": 0, "weight_version": "0",
                "input_token_logprobs": lps}})
        subs = wire.split_batch(body) if wire.is_batched(body) else [body]
        seqs = [fleet.sequence(box, sub, stream_interval) for sub in subs]
        fleet.stats.requests += len(seqs)
        for seq in seqs:
            box.submit(seq)
        if body.get("stream"):
            if len(seqs) != 1:
                return web.json_response(wire.error_object("the fleet streams single sequences only"), status=400)
            return await stream(request, seqs[0])
        try:
            for seq in seqs:
                while seq.finish is None:
                    seq.event.clear()
                    await seq.event.wait()
        finally:
            for seq in seqs:
                box.drop(seq)
        outs = [chunk(s, 0, True) for s in seqs]
        return web.json_response(outs if wire.is_batched(body) else outs[0])

    async def stream(request: web.Request, seq: Seq) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        try:
            await resp.prepare(request)
            while True:
                seq.event.clear()
                final = seq.finish is not None
                if seq.made > seq.sent or final:
                    made = seq.made
                    await resp.write(sse_frame(chunk(seq, seq.sent, final)))
                    seq.sent = made
                if final:
                    break
                await seq.event.wait()
            await resp.write(wire.DONE_FRAME)
            await resp.write_eof()
        except ConnectionError:
            pass
        finally:
            box.drop(seq)
        return resp

    async def info(request: web.Request) -> web.Response:
        return web.json_response({
            "version": "0.5.23", "tp_size": 1, "dp_size": 1, "base_gpu_id": 0, "gpu_id_step": 1,
            "model_path": "tail-fleet", "served_model_name": "tail-fleet", "dtype": "float32",
            "quantization": None, "skip_tokenizer_init": True, "context_length": 1 << 20,
            "stream_interval": stream_interval, "incremental_streaming_output": True,
            "max_running_requests": spec.max_running, "weight_version": "0", "is_generation": True,
            "internal_states": [{"effective_max_running_requests_per_dp": spec.max_running}],
            "tail_fleet": {"box": box.index, **asdict(spec)}})

    async def model_info(request: web.Request) -> web.Response:
        return web.json_response({"model_path": "tail-fleet", "served_model_name": "tail-fleet",
                                  "is_generation": True, "weight_version": "0", "vocab_size": VOCAB})

    async def ok(request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def abort(request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else {}
        box.abort(body.get("rid"), bool(body.get("abort_all")))
        return web.Response(status=200)

    async def flush(request: web.Request) -> web.Response:
        box.prompts.clear()
        box.outputs.clear()
        return web.Response(status=200)

    async def metrics(request: web.Request) -> web.Response:
        running, queued = box.counts()
        return web.Response(text=f"{wire.METRIC_NUM_RUNNING_REQS} {running}\n{wire.METRIC_NUM_QUEUE_REQS} {queued}\n",
                            content_type="text/plain")

    async def stats(request: web.Request) -> web.Response:
        return web.json_response({**asdict(fleet.stats), "cpu_s": cpu_s(),
                                  "running": [b.counts() for b in fleet.boxes]})

    async def reset(request: web.Request) -> web.Response:
        fleet.reset()
        return web.json_response({"ok": True})

    app = web.Application(client_max_size=1 << 30)
    r = app.router
    r.add_post(wire.GENERATE, generate)
    for path in (wire.SERVER_INFO, wire.GET_SERVER_INFO):
        r.add_get(path, info)
    for path in (wire.MODEL_INFO, wire.GET_MODEL_INFO):
        r.add_get(path, model_info)
    for path in (wire.HEALTH, wire.HEALTH_GENERATE):
        r.add_get(path, ok)
    for path in (wire.PAUSE_GENERATION, wire.CONTINUE_GENERATION, wire.UPDATE_WEIGHT_VERSION):
        r.add_post(path, ok)
    r.add_post(wire.ABORT_REQUEST, abort)
    r.add_post(wire.FLUSH_CACHE, flush)
    r.add_get(wire.FLUSH_CACHE, flush)
    r.add_get(wire.METRICS, metrics)
    r.add_get("/fleet/stats", stats)
    r.add_post("/fleet/reset", reset)
    return app


def cpu_s() -> float:
    """This process's CPU seconds (user + system)."""
    t = os.times()
    return t.user + t.system


async def serve(specs: list[BoxSpec], model: LengthModel, stream_interval: int) -> None:
    """Serve every box on its own free port; print one line ``FLEET {"ports": [...]}``; run until killed."""
    fleet = Fleet(specs, model)
    runners, ports = [], []
    for box in fleet.boxes:
        runner = web.AppRunner(box_app(fleet, box, stream_interval), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        ports.append(runner.addresses[0][1])
        box.task = asyncio.create_task(box.loop())
    print("FLEET " + json.dumps({"ports": ports, "pid": os.getpid()}), flush=True)
    await asyncio.Event().wait()


def parse_specs(text: str) -> list[BoxSpec]:
    """``[{"speed": 1.0, ...}, ...]`` as box specs."""
    return [BoxSpec(**d) for d in json.loads(text)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--boxes", required=True, help='JSON list of box specs, e.g. [{"speed": 1.0}, {"speed": 0.5}]')
    p.add_argument("--lengths", default="{}", help="JSON of the LengthModel's fields")
    p.add_argument("--stream-interval", type=int, default=1, help="the servers' --stream-interval")
    args = p.parse_args()
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve(parse_specs(args.boxes), LengthModel(**json.loads(args.lengths)), args.stream_interval))


if __name__ == "__main__":
    main()
