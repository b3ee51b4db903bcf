"""Stream one rollout step as verl ``DataProto`` micro-batches, in completion order.

:class:`RolloutStream` takes the step's prompts (token id lists) and ``n`` (GRPO samples per
prompt), submits ONE ``/batch_generate_requests`` of ``len(prompts) * n`` requests (each carrying its
group's ``uid`` as ``group_key``, so the manager predicts a sample's length from its siblings'), and yields
micro-batches as results arrive:

- a group (the ``n`` samples of one prompt) is released only when all its ``n`` are done, so a
  group is never split across micro-batches;
- each micro-batch holds at least ``min_stream_batch_size`` samples, except the last one;
- groups appear in the order they completed; inside a group, samples keep their index ``0..n-1``.

Each micro-batch carries what verl's actor and reward code read, laid out as verl's agent loop
post-processing lays it out (``experimental/agent_loop/agent_loop.py`` in verl 0.9.1):

=================== ======================= =====================================================
key                 dtype, shape            content
=================== ======================= =====================================================
prompts             int64 [B, P]            prompt, LEFT-padded with ``pad_token_id``
responses           int64 [B, R]            response, RIGHT-padded with ``pad_token_id``
response_mask       int64 [B, R]            1 for generated tokens, 0 for padding
input_ids           int64 [B, P + R]        ``cat(prompts, responses)``
attention_mask      int64 [B, P + R]        1 on real tokens of prompt and response
position_ids        int64 [B, P + R]        ``clip(cumsum(attention_mask) - 1, 0)``
rollout_log_probs   float32 [B, R]          sampled-token log-probs, zero-padded (``return_logprob``)
=================== ======================= =====================================================

``P``/``R`` are ``prompt_length``/``response_length`` when given (verl pads to its config's
lengths, which keeps every micro-batch the same width), else the longest in the micro-batch.

Non-tensor keys (numpy arrays, one entry per sample): ``uid`` (the group id GRPO groups by),
``__num_turns__`` (int32, 2 = user + assistant, as verl's single-turn loop reports),
``weight_version`` (of the last segment), ``weight_versions`` (every segment's version, to see a
sample that mixes versions), ``min_global_steps``/``max_global_steps`` (ints when the versions are
step numbers, else None), ``request_id``, ``finish_reason``, ``prompt_index``, ``rollout_n``,
``prompt_len``/``response_len``, ``micro_batch_index``, and each caller-supplied per-prompt key (``raw_prompt``,
``data_source``, ``reward_model`` ...) repeated for the group's ``n`` samples.

A manager restart mid-step costs only the tokens in flight: the client
(:meth:`ManagerClient.batch_generate`) waits for the manager to come back, up to its
``restart_timeout_s``, and resubmits exactly the requests not answered yet; a frozen manager is
reported as a stall and waited for, not resubmitted to (see :mod:`trainer_plugin.client`). Every id
is yielded at most once: a second answer for an id is dropped here too. ``stream.stats`` counts the
interruptions, resubmitted requests, stalls and time spent waiting; if the manager does not come
back, the step fails with :class:`~trainer_plugin.client.ManagerLost` naming the unfinished ids.

A request that finally fails (``success: false``) is never dropped silently: by default the step
fails with :class:`RolloutFailed` naming the request and the manager's error (closing the stream,
which makes the manager abort the rest); with ``on_failure="drop_group"`` the whole group is left
out, logged, and listed in ``stream.dropped_groups`` / ``stream.failures``; if every group is
dropped the step fails all the same.

:func:`iterate_rollouts_sync` is the same for callers without an event loop.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np
import torch

from rollout_manager.sglang.answer import ReceivedAnswer

from .client import ManagerClient

log = logging.getLogger("trainer_plugin.streaming")

OnFailure = Literal["raise", "drop_group"]


class RolloutFailed(RuntimeError):
    """A request of the step failed for good; the step cannot be completed as asked."""

    def __init__(self, message: str, failures: list[dict[str, Any]]):
        super().__init__(message)
        self.failures = failures


@dataclass
class Sample:
    """One finished request, as the manager returned it."""

    group: int
    index: int  # 0..n-1 inside the group
    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str | None  # "stop", "length", "abort"
    weight_version: str | None
    weight_versions: list[str | None]


@dataclass
class MicroBatch:
    """A micro-batch before it becomes a ``DataProto`` (usable without verl installed)."""

    tensors: dict[str, torch.Tensor]
    non_tensors: dict[str, np.ndarray]
    meta_info: dict[str, Any]

    def __len__(self) -> int:
        return int(self.tensors["responses"].shape[0])

    def to_dataproto(self) -> Any:
        from verl import DataProto

        return DataProto.from_dict(tensors=dict(self.tensors), non_tensors=dict(self.non_tensors),
                                   meta_info=dict(self.meta_info))


@dataclass
class StreamStats:
    submitted: int = 0
    succeeded: int = 0
    failed: int = 0
    micro_batches: int = 0
    samples_yielded: int = 0
    first_result_s: float | None = None
    elapsed_s: float = 0.0
    segments_mixed_versions: int = 0
    # manager outages survived during this step (from the client's counters)
    interruptions: int = 0
    resubmitted: int = 0
    stalls: int = 0
    duplicates_dropped: int = 0
    outage_s: float = 0.0


def _as_int_version(v: Any) -> int | None:
    try:
        return int(str(v))
    except (TypeError, ValueError):
        return None


def build_micro_batch(
    samples: Sequence[Sample],
    *,
    uids: Sequence[str],
    prompt_length: int | None = None,
    response_length: int | None = None,
    pad_token_id: int = 0,
    with_logprobs: bool = False,
    per_prompt: Mapping[str, Sequence[Any]] | None = None,
    meta_info: dict[str, Any] | None = None,
) -> MicroBatch:
    """Pad and stack samples the way verl's agent loop does (see the module doc)."""
    if not samples:
        raise ValueError("a micro-batch needs at least one sample")
    P = prompt_length if prompt_length is not None else max(len(s.prompt_ids) for s in samples)
    R = response_length if response_length is not None else max(max(len(s.output_ids) for s in samples), 1)
    tensors = _padded_tensors(samples, P, R, pad_token_id, with_logprobs)
    return MicroBatch(tensors, _non_tensors(samples, uids, per_prompt), dict(meta_info or {}))


def _padded_tensors(samples: Sequence[Sample], P: int, R: int, pad_token_id: int,
                    with_logprobs: bool) -> dict[str, torch.Tensor]:
    """The batch's tensors: prompts left-padded to ``P``, responses right-padded to ``R``, their masks and
    positions (and the rollout's log-probs where asked for)."""
    B = len(samples)
    prompts = torch.full((B, P), pad_token_id, dtype=torch.int64)
    responses = torch.full((B, R), pad_token_id, dtype=torch.int64)
    prompt_attn = torch.zeros((B, P), dtype=torch.int64)
    resp_attn = torch.zeros((B, R), dtype=torch.int64)
    logprobs = torch.zeros((B, R), dtype=torch.float32) if with_logprobs else None
    for row, s in enumerate(samples):
        lp, lr = len(s.prompt_ids), len(s.output_ids)
        if lp > P:
            raise ValueError(f"prompt of {s.request_id} has {lp} tokens, more than prompt_length={P}")
        if lr > R:
            raise ValueError(f"response of {s.request_id} has {lr} tokens, more than response_length={R}")
        if lp:
            prompts[row, P - lp:] = torch.tensor(s.prompt_ids, dtype=torch.int64)
            prompt_attn[row, P - lp:] = 1
        if lr:
            responses[row, :lr] = torch.tensor(s.output_ids, dtype=torch.int64)
            resp_attn[row, :lr] = 1
        if logprobs is not None:
            if s.logprobs is None or len(s.logprobs) != lr:
                raise ValueError(f"{s.request_id}: expected {lr} log-probs, got "
                                 f"{None if s.logprobs is None else len(s.logprobs)}")
            if lr:
                logprobs[row, :lr] = torch.tensor(s.logprobs, dtype=torch.float32)
    attention_mask = torch.cat([prompt_attn, resp_attn], dim=1)
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "response_mask": resp_attn.clone(),  # single turn: every response token was generated
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": torch.clip(torch.cumsum(attention_mask, dim=-1) - 1, min=0),
    }
    if logprobs is not None:
        tensors["rollout_log_probs"] = logprobs
    return tensors


def _objects(values: Sequence[Any]) -> np.ndarray:
    arr = np.empty(len(values), dtype=object)
    arr[:] = list(values)
    return arr


def _non_tensors(samples: Sequence[Sample], uids: Sequence[str],
                 per_prompt: Mapping[str, Sequence[Any]] | None) -> dict[str, np.ndarray]:
    """What verl keeps beside the tensors, one entry per sample: ids, versions and step numbers, lengths, and
    the caller's per-prompt values."""
    # Step numbers per sample, None unless every segment's version is one.
    steps: list[list[int] | None] = []
    for s in samples:
        known = [v for v in map(_as_int_version, s.weight_versions) if v is not None]
        steps.append(known if known and len(known) == len(s.weight_versions) else None)
    non_tensors: dict[str, np.ndarray] = {
        "uid": _objects([uids[s.group] for s in samples]),
        "__num_turns__": np.full(len(samples), 2, dtype=np.int32),
        "weight_version": _objects([s.weight_version for s in samples]),
        "weight_versions": _objects([list(s.weight_versions) for s in samples]),
        "min_global_steps": _objects([min(x) if x else None for x in steps]),
        "max_global_steps": _objects([max(x) if x else None for x in steps]),
        "request_id": _objects([s.request_id for s in samples]),
        "finish_reason": _objects([s.finish_reason for s in samples]),
        "prompt_index": np.array([s.group for s in samples], dtype=np.int64),
        "rollout_n": np.array([s.index for s in samples], dtype=np.int64),
        "prompt_len": np.array([len(s.prompt_ids) for s in samples], dtype=np.int64),
        "response_len": np.array([len(s.output_ids) for s in samples], dtype=np.int64),
    }
    for key, values in (per_prompt or {}).items():
        if key in non_tensors:
            raise ValueError(f"per-prompt key {key!r} collides with a key the stream sets itself")
        non_tensors[key] = _objects([values[s.group] for s in samples])
    return non_tensors


def parse_result(line: dict[str, Any], group: int, index: int, prompt_ids: list[int],
                 with_logprobs: bool) -> Sample:
    """A ``success: true`` NDJSON line -> :class:`Sample`."""
    out = ReceivedAnswer.from_json(line["data"])
    logprobs = None
    if with_logprobs:
        logprobs = [0.0 if v is None else v for v in out.token_logprobs]
    return Sample(group=group, index=index, request_id=str(line["id"]), prompt_ids=prompt_ids,
                  output_ids=list(out.output_ids), logprobs=logprobs, finish_reason=out.finish_type,
                  weight_version=out.weight_version, weight_versions=out.weight_versions)


class RolloutStream:
    """``async for batch in RolloutStream(client, prompts, n=4, min_stream_batch_size=8): ...``

    Yields ``DataProto`` (``output="dataproto"``, needs verl) or :class:`MicroBatch`
    (``output="micro_batch"``). Iterate it once.
    """

    def __init__(
        self,
        client: ManagerClient,
        prompts: Sequence[Sequence[int]],
        *,
        n: int = 1,
        min_stream_batch_size: int = 1,
        sampling_params: Mapping[str, Any] | None = None,
        return_logprob: bool = False,
        prompt_length: int | None = None,
        response_length: int | None = None,
        pad_token_id: int = 0,
        uids: Sequence[str] | None = None,
        non_tensor_batch: Mapping[str, Sequence[Any]] | None = None,
        on_failure: OnFailure = "raise",
        request_id_prefix: str | None = None,
        extra_body: Mapping[str, Any] | None = None,
        output: Literal["dataproto", "micro_batch"] = "dataproto",
    ):
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if min_stream_batch_size < 1:
            raise ValueError(f"min_stream_batch_size must be >= 1, got {min_stream_batch_size}")
        if on_failure not in ("raise", "drop_group"):
            raise ValueError(f"on_failure must be 'raise' or 'drop_group', got {on_failure!r}")
        self.prompts = [[int(t) for t in p] for p in prompts]
        if not self.prompts:
            raise ValueError("no prompts")
        for i, p in enumerate(self.prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty")
            if prompt_length is not None and len(p) > prompt_length:
                raise ValueError(f"prompt {i} has {len(p)} tokens, more than prompt_length={prompt_length}")
        self.client = client
        self.n = n
        self.min_stream_batch_size = min_stream_batch_size
        params = dict(sampling_params or {})
        if response_length is not None:
            budget = params.setdefault("max_new_tokens", response_length)
            if budget is None or budget > response_length:
                raise ValueError(f"max_new_tokens={budget} exceeds response_length={response_length}")
        self.sampling_params = params
        self.return_logprob = return_logprob
        self.prompt_length = prompt_length
        self.response_length = response_length
        self.pad_token_id = pad_token_id
        self.uids = list(uids) if uids is not None else [str(uuid.uuid4()) for _ in self.prompts]
        if len(self.uids) != len(self.prompts):
            raise ValueError(f"{len(self.uids)} uids for {len(self.prompts)} prompts")
        self.per_prompt = {k: list(v) for k, v in (non_tensor_batch or {}).items()}
        for key, values in self.per_prompt.items():
            if len(values) != len(self.prompts):
                raise ValueError(f"non_tensor_batch[{key!r}] has {len(values)} entries for {len(self.prompts)} prompts")
        self.on_failure = on_failure
        self.prefix = request_id_prefix or f"rs-{uuid.uuid4().hex[:8]}"
        self.extra_body = dict(extra_body or {})
        self.output = output
        self.failures: list[dict[str, Any]] = []
        self.dropped_groups: list[int] = []
        self.stats = StreamStats()
        self._started = False

    # ------------------------------------------------------------ requests
    def request_id(self, group: int, index: int) -> str:
        return f"{self.prefix}-{group}-{index}"

    def _parse_id(self, rid: Any) -> tuple[int, int]:
        text = str(rid)
        if not text.startswith(self.prefix + "-"):
            raise RuntimeError(f"the manager answered an id this step never sent: {rid!r}")
        group, index = text[len(self.prefix) + 1:].split("-")
        return int(group), int(index)

    def requests(self) -> list[tuple[str, dict[str, Any]]]:
        items = []
        for g, prompt in enumerate(self.prompts):
            for j in range(self.n):
                body: dict[str, Any] = {**self.extra_body, "input_ids": prompt, "group_key": self.uids[g],
                                        "sampling_params": dict(self.sampling_params)}
                if self.return_logprob:
                    body["return_logprob"] = True
                items.append((self.request_id(g, j), body))
        return items

    # ------------------------------------------------------------ iteration
    def __aiter__(self) -> AsyncIterator[Any]:
        if self._started:
            raise RuntimeError("a RolloutStream can be iterated only once")
        self._started = True
        return self._run()

    async def _run(self) -> AsyncIterator[Any]:
        started = time.monotonic()
        items = self.requests()
        self.stats.submitted = len(items)
        done: dict[int, dict[int, Sample]] = {}
        failed_groups: set[int] = set()
        ready: list[int] = []  # complete groups in completion order, not yet yielded
        ready_samples = 0
        dropped_since_last: list[int] = []
        index = 0
        seen: set[str] = set()
        before = replace(self.client.stats)
        lines = self.client.batch_generate(items)
        try:
            async for line in lines:
                if self.stats.first_result_s is None:
                    self.stats.first_result_s = time.monotonic() - started
                g, j = self._parse_id(line.get("id"))
                if self.request_id(g, j) in seen:  # the client dedupes already; never yield one twice
                    self.stats.duplicates_dropped += 1
                    log.warning("ignoring a second answer for %s", line.get("id"))
                    continue
                seen.add(self.request_id(g, j))
                if not line.get("success"):
                    self.stats.failed += 1
                    failure = {"id": line.get("id"), "group": g, "index": j,
                               "status_code": line.get("status_code"), "error": line.get("error")}
                    self.failures.append(failure)
                    if self.on_failure == "raise":
                        raise RolloutFailed(
                            f"rollout request {line.get('id')} (prompt {g}, sample {j}) failed with status "
                            f"{line.get('status_code')}: {line.get('error')}; the step cannot be completed "
                            f"(set on_failure='drop_group' to leave such groups out)", list(self.failures))
                    if g not in failed_groups:
                        failed_groups.add(g)
                        done.pop(g, None)
                        self.dropped_groups.append(g)
                        dropped_since_last.append(g)
                        log.warning("dropping group %d (uid %s): request %s failed: %s", g, self.uids[g],
                                    line.get("id"), line.get("error"))
                    continue
                self.stats.succeeded += 1
                if g in failed_groups:
                    continue
                sample = parse_result(line, g, j, self.prompts[g], self.return_logprob)
                if len(set(sample.weight_versions)) > 1:
                    self.stats.segments_mixed_versions += 1
                group = done.setdefault(g, {})
                group[j] = sample
                if len(group) == self.n:
                    ready.append(g)
                    ready_samples += self.n
                while ready_samples >= self.min_stream_batch_size:
                    take: list[int] = []
                    count = 0
                    while count < self.min_stream_batch_size:
                        take.append(ready.pop(0))
                        count += self.n
                    ready_samples -= count
                    yield self._emit(take, done, index, dropped_since_last)
                    index += 1
                    dropped_since_last = []
        finally:
            await lines.aclose()
            self.stats.elapsed_s = time.monotonic() - started
            now = self.client.stats
            self.stats.interruptions = now.interruptions - before.interruptions
            self.stats.resubmitted = now.resubmitted - before.resubmitted
            self.stats.stalls = now.stalls - before.stalls
            self.stats.duplicates_dropped += now.duplicates_dropped - before.duplicates_dropped
            self.stats.outage_s = now.outage_s - before.outage_s
        if ready:
            yield self._emit(ready, done, index, dropped_since_last)
            index += 1
        if len(self.dropped_groups) == len(self.prompts):
            raise RolloutFailed(f"every one of the {len(self.prompts)} groups was dropped because a request "
                                f"failed; first failure: {self.failures[0]}", list(self.failures))

    def _emit(self, groups: list[int], done: dict[int, dict[int, Sample]], index: int,
              dropped: list[int]) -> Any:
        samples = [done[g][j] for g in groups for j in range(self.n)]
        for g in groups:
            del done[g]
        # meta_info must be equal across micro-batches (DataProto.concat asserts it), so what differs
        # per micro-batch is per sample: micro_batch_index; dropped groups are on the stream object.
        mb = build_micro_batch(samples, uids=self.uids, prompt_length=self.prompt_length,
                               response_length=self.response_length, pad_token_id=self.pad_token_id,
                               with_logprobs=self.return_logprob, per_prompt=self.per_prompt,
                               meta_info={"rollout_stream": self.prefix})
        mb.non_tensors["micro_batch_index"] = np.full(len(samples), index, dtype=np.int64)
        if dropped:
            log.warning("micro-batch %d: %d group(s) dropped so far in this step: %s", index,
                        len(self.dropped_groups), [self.uids[g] for g in self.dropped_groups])
        self.stats.micro_batches += 1
        self.stats.samples_yielded += len(samples)
        return mb.to_dataproto() if self.output == "dataproto" else mb


def stream_rollouts(client: ManagerClient, prompts: Sequence[Sequence[int]], **kwargs: Any) -> RolloutStream:
    """Shortcut for :class:`RolloutStream`."""
    return RolloutStream(client, prompts, **kwargs)


def iterate_rollouts_sync(manager_url: str, prompts: Sequence[Sequence[int]], *,
                          client_kwargs: Mapping[str, Any] | None = None, **kwargs: Any) -> Iterator[Any]:
    """The same micro-batches for synchronous code: an event loop runs in a helper thread.

    Works whether or not the calling thread already runs an event loop. Closing the generator
    early (``break``) cancels the stream, which aborts the outstanding requests.
    """
    results: queue.Queue[tuple[str, Any]] = queue.Queue()
    stop = threading.Event()
    loop = asyncio.new_event_loop()

    async def produce() -> None:
        async with ManagerClient(manager_url, **dict(client_kwargs or {})) as client:
            stream = RolloutStream(client, prompts, **kwargs)
            async for item in stream:
                results.put(("item", item))
                if stop.is_set():
                    return

    task_holder: dict[str, asyncio.Task[None]] = {}

    def run() -> None:
        asyncio.set_event_loop(loop)
        task = loop.create_task(produce())
        task_holder["task"] = task
        try:
            loop.run_until_complete(task)
            results.put(("done", None))
        except asyncio.CancelledError:
            results.put(("done", None))
        except BaseException as exc:
            results.put(("error", exc))
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    thread = threading.Thread(target=run, name="rollout-stream", daemon=True)
    thread.start()
    try:
        while True:
            kind, value = results.get()
            if kind == "item":
                yield value
            elif kind == "error":
                raise value
            else:
                return
    finally:
        stop.set()
        task = task_holder.get("task")
        if task is not None and not task.done():
            try:
                loop.call_soon_threadsafe(task.cancel)
            except RuntimeError:  # the loop already finished
                pass
        thread.join(30)
