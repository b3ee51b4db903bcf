"""The CPU engine's core: request validation, the fair decoding loop, abort/pause, weights.

No aiohttp in here. The decoding loop advances every running sequence by one token per round; the
torch work of a round runs on one worker thread (so the event loop stays free for /health and control
calls, and weight loads never interleave with a forward). Each sequence is computed alone with a full
forward (see model.py), so a sequence's tokens never depend on its neighbours or on how its prefix
arrived.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from rollout_manager.cpu_engine import routed_experts
from rollout_manager.cpu_engine.encode import logprob_entry, output_chunk
from rollout_manager.cpu_engine.faults import Faults
from rollout_manager.cpu_engine.model import (
    COMPUTE_THREADS,
    EngineSampling,
    TinyCausalLM,
    build_model,
    choose_token,
    state_dict_checksums,
    stop_reason,
)
from rollout_manager.cpu_engine.prefix_cache import Cursor, PrefixCache
from rollout_manager.cpu_engine.request import (
    _SCHEDULER_INPUT_MARGIN,
    EngineRequest,
    RequestRefused,
    SequenceSpec,
    parse_generate_body,
)
from rollout_manager.sglang import wire
from rollout_manager.sglang.finish import FinishReason

log = logging.getLogger("rollout_manager.cpu_engine")


@dataclass
class EngineConfig:
    seed: int = 0
    model_size: str = "tiny"
    model_overrides: dict[str, Any] = field(default_factory=dict)
    incremental_streaming_output: bool = False
    stream_interval: int = 1  # SGLang's --stream-interval: stream every N tokens (per request: sampling_params)
    context_length: int | None = None  # SGLang's --context-length; None: the model's max_position_embeddings
    weight_version: str = "0"
    max_running_requests: int | None = None  # None: admit everything at once
    health_generate_timeout_s: float = 20.0
    served_model_name: str | None = None
    faults: Faults = field(default_factory=Faults)
    # The SGLang this engine stands in for: its /server_info version (older than 0.5.21: no
    # weight-update sessions) and parallelism (tp_size: one weight payload per rank; dp_size > 1:
    # weight loads refused, as SGLang refuses them).
    sglang_version: str = "0.5.23"
    tp_size: int = 1
    dp_size: int = 1
    # SGLang's --enable-return-routed-experts (needs a MoE model): answer return_routed_experts (R3).
    enable_return_routed_experts: bool = False


# ------------------------------------------------------------------ running state

# One sequence's part of a decoding round: its tokens, sampling, generator, the position its routed experts are
# wanted from (None: not wanted) and the position its input log-probs are wanted from (None: not, or had).
# (tokens, sampling, generator, routes from, prompt log-probs from, the scripted id or None: see Faults, top
# log-probs wanted)
Work = tuple[list[int], EngineSampling, torch.Generator | None, int | None, int | None, int | None, int]
# (token, its log-prob, routed-expert rows, prompt log-probs, the most likely tokens as (log-prob, id))
Made = tuple[int, float, bytes | None, list[float | None] | None, list[tuple[float, int]] | None]


class CallGroup:
    """The sequences of one /generate call; ``changed`` wakes its HTTP handler."""

    def __init__(self, stream: bool):
        self.stream = stream
        self.sequences: list[Sequence] = []
        self.changed = asyncio.Event()

    @property
    def finished(self) -> bool:
        return all(s.finish is not None for s in self.sequences)


class Sequence:
    def __init__(self, spec: SequenceSpec, group: CallGroup, *, internal: bool = False):
        self.spec = spec
        self.rid = spec.rid
        self.group = group
        self.internal = internal
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[float, int]]] = []  # per output token, when spec.top_logprobs_num
        self.input_logprobs: list[float | None] | None = None  # from spec.logprob_start_len, at its first round
        self.versions: list[tuple[str, int]] = []  # (weight version, first output position it made)
        self.finish: FinishReason | None = None
        self.created = time.monotonic()
        self.finished_at: float | None = None
        # Routed experts (R3), when asked and captured: int32 rows [layers, top_k] for positions
        # [routed_experts_start_len, routes_next), appended as the decoding rounds compute them.
        self.routes: bytearray | None = None
        self.routes_next = spec.routed_experts_start_len
        self.cached: Cursor | None = None  # its tokens in the prefix cache, from its (last) prefill
        seed = spec.params.sampling_seed
        if seed is None and not spec.params.greedy:
            seed = random.getrandbits(63)
        self.seed = seed

    @property
    def generator(self) -> torch.Generator | None:
        """The generator of the draw at the next position, keyed on (seed, position) as SGLang's seeded sampler
        keys it: a continuation sent the same seed draws what the uninterrupted request would have."""
        seed = self.seed
        if seed is None:
            return None
        position = len(self.spec.input_ids) + len(self.output_ids)
        return torch.Generator().manual_seed(hash((seed, position)) & (2**63 - 1))

    @property
    def tokens(self) -> list[int]:
        return self.spec.input_ids + self.output_ids

    def forget_routes(self) -> None:
        """Drop the captured experts: a retracted request is prefilled again, and SGLang captures anew."""
        if self.routes is not None:
            self.routes, self.routes_next = bytearray(), self.spec.routed_experts_start_len

    def set_finish(self, kind: str, **extra: Any) -> None:
        if self.finish is None:
            self.finish = FinishReason.of(kind, **extra)
            self.finished_at = time.monotonic()


def decode_text(ids: list[int]) -> str:
    """Byte-level 'detokenizer': ids below 256 are bytes (UTF-8, errors replaced), others ``<id>``."""
    out: list[str] = []
    buf = bytearray()
    for t in ids:
        if t < 256:
            buf.append(t)
        else:
            if buf:
                out.append(buf.decode("utf-8", errors="replace"))
                buf.clear()
            out.append(f"<{t}>")
    if buf:
        out.append(buf.decode("utf-8", errors="replace"))
    return "".join(out)


class Engine:
    def __init__(self, config: EngineConfig, model: TinyCausalLM | None = None):
        self.config = config
        self.faults = config.faults
        self.model = model or build_model(config.seed, config.model_size, **config.model_overrides)
        positions = self.model.config.max_position_embeddings
        if config.context_length is not None and not 8 <= config.context_length <= positions:
            raise ValueError(f"context_length {config.context_length} is not in [8, {positions}] "
                             "(the model's max_position_embeddings)")
        if config.enable_return_routed_experts and not self.model.config.num_experts:
            raise ValueError("enable_return_routed_experts needs a MoE model (num_experts > 0)")
        # bytes of one routed_experts row: [layers, top_k] int32
        self.route_row_bytes = self.model.config.num_hidden_layers * self.model.config.num_experts_per_tok * 4
        self.weight_version = str(config.weight_version)
        self.paused = False
        self.pause_mode: str | None = None  # SGLang's PauseGenerationReqInput mode while paused
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.prefix_cache = PrefixCache()
        self.last_gen_throughput = 0.0
        self.total_generated = 0
        self._rounds: deque[tuple[float, float, int]] = deque()  # (end time, duration, tokens)
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()  # set while no decoding round is in flight
        self._idle.set()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cpu-engine-compute")
        self._executor.submit(torch.set_num_threads, COMPUTE_THREADS).result()
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    # ------------------------------------------------------------ lifecycle

    @property
    def context_len(self) -> int:
        return self.config.context_length or self.model.config.max_position_embeddings

    @property
    def max_req_input_len(self) -> int:
        """The longest input SGLang's scheduler admits, less one (it refuses ``len >= this``)."""
        return self.context_len - _SCHEDULER_INPUT_MARGIN

    def max_new_tokens(self, spec: SequenceSpec) -> int:
        """The effective limit: ``max_new_tokens`` (null: none) capped to what the context leaves, as
        SGLang's ``init_req_max_new_tokens`` does (``max_req_len - input_len - 1``)."""
        limit = spec.params.max_new_tokens
        room = max(self.context_len - 1 - len(spec.input_ids) - 1, 0)
        return room if limit is None else max(min(limit, room), 0)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="cpu-engine-loop")

    async def close(self) -> None:
        self._closed = True
        self.abort(abort_all=True, message="Server shutting down")
        self._wake.set()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------ requests

    def parse(self, body: Any) -> EngineRequest:
        return parse_generate_body(body, vocab_size=self.model.config.vocab_size, context_len=self.context_len)

    def submit(self, req: EngineRequest, *, internal: bool = False) -> CallGroup:
        active = {s.rid for s in self._all_live()}
        for spec in req.specs:
            if spec.rid in active:
                raise RequestRefused(f"rid {spec.rid!r} is already running")
        group = CallGroup(req.stream)
        if not internal:
            self.faults.note_request()
        for spec in req.specs:
            seq = Sequence(spec, group, internal=internal)
            if spec.return_routed_experts and self.config.enable_return_routed_experts:
                seq.routes = bytearray()
            group.sequences.append(seq)
            experts_refusal = (routed_experts.start_error(spec.routed_experts_start_len, len(spec.input_ids))
                               if spec.return_routed_experts else None)
            if len(spec.input_ids) >= self.max_req_input_len:
                # Refused by the scheduler, not the HTTP layer: the request ends at once with an
                # abort that carries the status (Req.set_finish_with_abort in SGLang).
                seq.set_finish(
                    wire.ABORT,
                    message=f"Input length ({len(spec.input_ids)} tokens) exceeds the maximum allowed length "
                            f"({self.max_req_input_len} tokens). Use a shorter input or enable --allow-auto-truncate.",
                    status_code=400, err_type="BadRequestError",
                )
            elif experts_refusal is not None:  # the scheduler's check, with or without capture
                seq.set_finish(wire.ABORT, message=experts_refusal, status_code=400, err_type="BadRequestError")
            elif self.max_new_tokens(spec) == 0 and seq.routes is None:  # else prefilled for the prompt's experts
                seq.set_finish(wire.LENGTH, length=0)
            else:
                self.waiting.append(seq)
        if group.finished:
            group.changed.set()
        self._wake.set()
        return group

    def _all_live(self) -> list[Sequence]:
        return [s for s in list(self.running) + list(self.waiting) if s.finish is None]

    def cancel_group(self, group: CallGroup) -> None:
        """The client went away: drop its unfinished sequences."""
        for s in group.sequences:
            s.set_finish(wire.ABORT, message="client disconnected")
        self._reap()

    def abort(self, rid: str | None = None, *, abort_all: bool = False, message: str = "Abort") -> int:
        """Finish matching live sequences with finish_reason abort; return how many."""
        n = 0
        for s in self._all_live():
            if s.internal and not abort_all:
                continue
            if abort_all or (rid and s.rid == rid):
                s.set_finish(wire.ABORT, message=message)
                s.group.changed.set()
                n += 1
        self._reap()
        return n

    async def pause(self, mode: str = "abort") -> int:
        """SGLang's pause_generation (scheduler.pause_generation): 'abort' aborts everything in flight
        first; 'in_place' keeps the running requests where they are (with their cache: a flush is then
        refused while any runs); 'retract' moves them back to the front of the waiting queue (their cache
        freed: a flush succeeds, and they re-prefill under whatever weights are loaded when generation
        continues). Either way nothing advances and new requests wait until continue. Returns once the
        decoding round in flight (if any) is done, so no token follows the answer."""
        if mode not in ("abort", "in_place", "retract"):
            raise RequestRefused("mode must be one of 'abort', 'retract', 'in_place'")
        aborted = self.abort(abort_all=True, message="Abort by pause_generation") if mode == "abort" else 0
        self.paused, self.pause_mode = True, mode
        await self._idle.wait()
        if mode == "retract":
            self._reap()
            for s in self.running:
                s.forget_routes()
            self.waiting.extendleft(reversed(self.running))
            self.running = []
        return aborted

    def resume(self) -> None:
        self.paused, self.pause_mode = False, None
        self._wake.set()

    def kick(self) -> None:
        """Re-check whether the loop can run (after a fault setting changed)."""
        self._wake.set()

    def busy(self) -> bool:
        """Whether anything is running or queued, health probes included: SGLang's ``is_fully_idle``,
        which decides whether the prefix cache may be flushed."""
        return bool(self._all_live())

    def flushable(self) -> bool:
        """Whether SGLang would flush its cache now: ``is_fully_idle(ignore_waiting=paused)``: nothing
        running (an ``in_place`` pause keeps its running requests), and, unless paused, nothing waiting."""
        running = any(s.finish is None for s in self.running)
        return not running if self.paused else not self.busy()

    def counts(self) -> tuple[int, int]:
        """(running, queued) client requests; health probes are not counted."""
        running = sum(1 for s in self.running if s.finish is None and not s.internal)
        queued = sum(1 for s in self.waiting if s.finish is None and not s.internal)
        if self.paused:
            return 0, running + queued
        return running, queued

    # ------------------------------------------------------------ weights

    async def load_weights(self, named: list[tuple[str, torch.Tensor]]) -> int:
        """Copy tensors in by name between two decoding rounds. Raises ValueError."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._executor, self.model.load_named_tensors, named)
        finally:  # even a load that failed half-way may have changed weights: the cached KV is not theirs
            self.prefix_cache.weights_loaded()

    def flush_cache(self) -> bool:
        """SGLang's ``Scheduler.flush_cache``: empty the prefix cache if :meth:`flushable`; whether it did."""
        if not self.flushable():
            return False
        self.prefix_cache.flush()
        return True

    async def checksums(self) -> dict[str, str]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, state_dict_checksums, self.model)

    def set_weight_version(self, version: str) -> None:
        self.weight_version = str(version)

    # ------------------------------------------------------------ the decoding loop

    def _reap(self) -> None:
        self.running = [s for s in self.running if s.finish is None]
        self.waiting = deque(s for s in self.waiting if s.finish is None)

    def _admit(self) -> None:
        cap = self.config.max_running_requests
        while self.waiting and (cap is None or len(self.running) < cap):
            seq = self.waiting.popleft()
            seq.cached = self.prefix_cache.prefill(seq.tokens, count=not seq.internal)
            self.running.append(seq)

    def _can_run(self) -> bool:
        return not self.paused and not self.faults.stalled and bool(self.running or self.waiting)

    def _compute_round(self, work: list[Work]) -> list[Made]:
        """Each sequence's next token and log-prob, (when ``routes_from`` is set) the little-endian int32
        experts of its positions from ``routes_from`` on, and (when ``prompt_from`` is set) its input
        tokens' log-probs from that position on."""
        out = []
        for tokens, params, gen, routes_from, prompt_from, scripted, top_n in work:
            self.faults.perturb_due(self.model.named_tensors())  # in the compute thread: between two forwards
            logits, routes = self.model.logits_and_routes(tokens)
            token, lp = choose_token(logits, params, gen)
            if scripted is not None and scripted < logits.numel():
                token, lp = scripted, float(torch.log_softmax(logits, dim=-1)[scripted].item())
            rows = None
            if routes_from is not None and routes is not None:
                rows = routes[routes_from:].numpy().astype("<i4", copy=False).tobytes()
            prompt = self.model.input_logprobs(tokens, prompt_from) if prompt_from is not None else None
            tops = None
            if top_n:
                values, ids = torch.topk(torch.log_softmax(logits, dim=-1), min(top_n, logits.numel()))
                tops = [(float(v), int(i)) for v, i in zip(values.tolist(), ids.tolist())]
            out.append((token, lp, rows, prompt, tops))
        return out

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._closed:
            self._reap()
            if not self._can_run():
                self._wake.clear()
                await self._wake.wait()
                continue
            self._admit()
            batch = list(self.running)
            budget = self.faults.generation_budget()
            if budget is not None:
                # Internal health probes do not count towards the stall budget.
                keep, spent = [], 0
                for s in batch:
                    if s.internal:
                        keep.append(s)
                    elif spent < budget:
                        keep.append(s)
                        spent += 1
                batch = keep
            if not batch:
                self._wake.clear()
                await self._wake.wait()
                continue
            work = [(s.tokens, s.spec.params, s.generator, None if s.routes is None else s.routes_next,
                     s.spec.logprob_start_len if s.input_logprobs is None else None,
                     None if s.internal else self.faults.scripted(len(s.output_ids)), s.spec.top_logprobs_num)
                    for s in batch]
            t0 = time.perf_counter()
            self._idle.clear()
            try:
                results = await loop.run_in_executor(self._executor, self._compute_round, work)
            except Exception as exc:
                log.exception("decoding round failed")
                for s in batch:
                    s.set_finish(wire.ABORT, message=f"engine error: {exc}")
                    s.group.changed.set()
                self._idle.set()
                continue
            except BaseException:
                self._idle.set()
                raise
            elapsed = time.perf_counter() - t0
            made = 0
            for s, (token, lp, rows, prompt, tops) in zip(batch, results):
                if s.finish is not None:  # aborted while the round ran
                    continue
                if prompt is not None:
                    s.input_logprobs = prompt
                if rows is not None and s.routes is not None:
                    s.routes += rows
                    s.routes_next = len(s.tokens)
                if self.max_new_tokens(s.spec) == 0:  # a prefill for the prompt's experts only
                    s.set_finish(wire.LENGTH, length=0)
                    s.group.changed.set()
                    continue
                if tops is not None:
                    s.top_logprobs.append(tops)
                self._append(s, token, lp)
                made += 1
                if not s.internal:
                    self.faults.note_generated(1)
                    if not s.group.stream:
                        self.faults.note_emitted(1)
                s.group.changed.set()
            self.total_generated += made
            self._note_round(elapsed, made)
            self._idle.set()
            delay = (self.faults.slowdown - 1.0) * elapsed + self.faults.token_delay_s
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                await asyncio.sleep(0)

    def _append(self, s: Sequence, token: int, lp: float) -> None:
        if not s.versions or s.versions[-1][0] != self.weight_version:
            s.versions.append((self.weight_version, len(s.output_ids)))
        s.output_ids.append(token)
        s.logprobs.append(lp)
        if s.cached is not None:
            self.prefix_cache.extend(s.cached, s.tokens)
        p = s.spec.params
        matched = stop_reason(token, len(s.output_ids), p, self.model.config.eos_token_id)
        limit = self.max_new_tokens(s.spec)
        if matched is not None:
            s.set_finish(wire.STOP, matched=matched)
        elif len(s.output_ids) >= limit:
            s.set_finish(wire.LENGTH, length=limit)

    def _note_round(self, elapsed: float, tokens: int) -> None:
        now = time.monotonic()
        self._rounds.append((now, elapsed, tokens))
        while self._rounds and now - self._rounds[0][0] > 2.0:
            self._rounds.popleft()
        busy = sum(r[1] for r in self._rounds)
        if busy > 0:
            self.last_gen_throughput = sum(r[2] for r in self._rounds) / busy

    # ------------------------------------------------------------ output objects

    @staticmethod
    def _text(s: Sequence, upto: int, *, final: bool) -> str:
        """The text of the first ``upto`` tokens; until the end an unfinished UTF-8 character at the
        tail is held back (as SGLang's detokenizer does), so the text only ever grows."""
        text = decode_text(s.output_ids[:upto])
        return text if final else text.rstrip("\ufffd")

    def chunk(self, s: Sequence, upto: int, *, since: int = 0, final: bool) -> dict[str, Any]:
        """The output object for ``s`` with its first ``upto`` tokens; ``since`` > 0 gives a delta.

        ``text`` is filled in every chunk, as SGLang does: the whole text so far, or with ``since``
        the text the delta adds.
        """
        ids = s.output_ids[since:upto]
        text = self._text(s, upto, final=final)
        if since:
            before = self._text(s, since, final=False)
            text = text[len(before):] if text.startswith(before) else decode_text(ids)
        lps = tops = None
        if s.spec.return_logprob:
            lps = [logprob_entry(lp, t) for lp, t in zip(s.logprobs[since:upto], ids)]
            if s.spec.top_logprobs_num:
                tops = [[logprob_entry(lp, t) for lp, t in row] for row in s.top_logprobs[since:upto]]
        prompt_lps = None
        if s.input_logprobs is not None and not since:  # with the first (or every cumulative) chunk
            start = s.spec.logprob_start_len or 0
            prompt_lps = [logprob_entry(lp, t) for lp, t in zip(s.input_logprobs, s.spec.input_ids[start:])]
        out = output_chunk(
            rid=s.rid,
            output_ids=ids,
            prompt_tokens=len(s.spec.input_ids),
            completion_tokens=upto,
            finish=s.finish.to_json() if final and s.finish is not None else None,
            weight_version=self.weight_version,
            logprobs=lps,
            input_logprobs=prompt_lps,
            text=text,
            index=s.spec.index if s.group.stream else None,  # streamed batch items carry index
            e2e_latency=(s.finished_at or time.monotonic()) - s.created if final else None,
            top_logprobs=tops,
        )
        if final:  # SGLang 0.5.23: which weight version made which output tokens, on the final output
            out["meta_info"]["weight_versions"] = self.version_spans(s)
            size = self.route_row_bytes * routed_experts.expected_rows(
                s.spec.routed_experts_start_len, len(s.spec.input_ids), upto)
            if s.routes is not None and len(s.routes) >= size:  # a prefill alone also captured its last token
                out["meta_info"][routed_experts.META_KEY] = routed_experts.encode(s.routes[:size])
        return out

    def version_spans(self, s: Sequence) -> list[dict[str, Any]]:
        if not s.versions:  # no token (max_new_tokens 0, or aborted before the first)
            return [{"version": self.weight_version, "start": 0, "end": 0}]
        ends = [start for _, start in s.versions[1:]] + [len(s.output_ids)]
        return [{"version": v, "start": start, "end": end} for (v, start), end in zip(s.versions, ends)]

