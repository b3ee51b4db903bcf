"""The manager's ``/generate`` answers for its sequences, in SGLang's output format.

A sequence may span several engines, so these are built from the sequence's own state, not relayed.
An answer is a typed value (:class:`Answer`) from here to the HTTP edge, where ``jsonutil.dumps`` encodes
it once, through :meth:`Answer.to_json` (a response body, an SSE chunk, an NDJSON line).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

from rollout_manager.rollout.progress import as_list
from rollout_manager.rollout.sequence import Segment, SequenceState
from rollout_manager.sglang import wire
from rollout_manager.sglang.finish import FinalMeta, FinishReason
from rollout_manager.sglang.generate_request import SequenceBody


class VersionSpan(msgspec.Struct, frozen=True):
    """One of SGLang's ``weight_versions`` spans: tokens ``start..end`` were made on ``version``."""

    version: str | None
    start: int
    end: int


class AnswerMeta(msgspec.Struct):
    """An answer's ``meta_info``: the fields the manager sets, typed, and the engine's others passed through.

    An UNSET field is left out of the JSON. ``per_token`` (``wire.PER_TOKEN_META_KEYS``' lists, gathered
    over the whole sequence) and ``engine`` (the finishing engine's other meta_info fields) are flattened
    into it.
    """

    id: str
    finish_reason: FinishReason | None  # as the engine reported it (``length`` counted over the sequence)
    prompt_tokens: int
    completion_tokens: int
    weight_version: Any  # the last segment's; without segments what the engine reported (any JSON value)
    cached_tokens: int | UnsetType = UNSET  # a stream chunk's (a final answer passes the engine's through)
    e2e_latency: float | UnsetType = UNSET
    segments: Sequence[Segment] | UnsetType = UNSET
    weight_versions: list[VersionSpan] | UnsetType = UNSET  # only when the engine reported spans
    discarded_segments: Sequence[Segment] | UnsetType = UNSET  # what a staleness restart threw away
    output_token_logprobs: list[list[Any]] | UnsetType = UNSET  # only when the request asked for them
    sampling_seed: Any = UNSET
    per_token: dict[str, list[Any]] | UnsetType = UNSET
    engine: dict[str, Any] | UnsetType = UNSET

    def to_json(self) -> dict[str, Any]:
        """The ``meta_info`` object callers get."""
        meta = {} if self.engine is UNSET else dict(self.engine)
        meta["id"] = self.id
        meta["finish_reason"] = None if self.finish_reason is None else self.finish_reason.to_json()
        meta["prompt_tokens"] = self.prompt_tokens
        meta["completion_tokens"] = self.completion_tokens
        meta["weight_version"] = self.weight_version
        if self.cached_tokens is not UNSET:
            meta["cached_tokens"] = self.cached_tokens
        if self.e2e_latency is not UNSET:
            meta["e2e_latency"] = self.e2e_latency
        if self.segments is not UNSET:
            meta["segments"] = [s.to_dict() for s in self.segments]
        if self.weight_versions is not UNSET:
            meta["weight_versions"] = [{"version": v.version, "start": v.start, "end": v.end}
                                       for v in self.weight_versions]
        if self.discarded_segments is not UNSET:
            meta["discarded_segments"] = [s.to_dict() for s in self.discarded_segments]
        if self.output_token_logprobs is not UNSET:
            meta["output_token_logprobs"] = self.output_token_logprobs
        if self.sampling_seed is not UNSET:
            meta["sampling_seed"] = self.sampling_seed
        if self.per_token is not UNSET:
            meta.update(self.per_token)
        return meta


class Answer(msgspec.Struct):
    """One sequence's ``/generate`` answer (a final one, or a cumulative stream chunk) in SGLang's format;
    ``index`` is the sequence's place in a batched request (UNSET: not batched)."""

    text: str | None
    output_ids: list[int]
    meta_info: AnswerMeta
    index: int | UnsetType = UNSET

    def to_json(self) -> dict[str, Any]:
        """The JSON object callers get (``jsonutil.dumps`` encodes an answer through this)."""
        out: dict[str, Any] = {"text": self.text, "output_ids": self.output_ids, "meta_info": self.meta_info.to_json()}
        if self.index is not UNSET:
            out["index"] = self.index
        return out


class StreamError(msgspec.Struct, frozen=True):
    """A sequence's failure inside a stream: one chunk of SGLang's error object (``wire.error_object``),
    the last a streaming caller is sent for that request."""

    message: str
    status: int

    def to_json(self) -> dict[str, Any]:
        return wire.error_object(self.message, self.status)


def partial_answer(seq: SequenceState, index: int | None) -> Answer:
    """The stream chunk a streaming caller is sent for a running sequence (:func:`partial_output`)."""
    return partial_output(
        seq.body, rid=seq.rid, output_ids=seq.output_ids, logprobs=seq.logprobs,
        weight_version=str(seq.segments[-1].weight_version) if seq.segments else "", index=index,
        text=seq.known_text(seq.live_text),
    )


def final_answer(seq: SequenceState, index: int | None, latency: float) -> Answer:
    """A finished sequence's answer (:func:`final_output`), ``latency`` seconds after it began."""
    # The text is known only if every segment's engine sent its part (a cut segment's is lost).
    texts = [t for t in seq.texts if t is not None]
    text = "".join(texts) if seq.texts and len(texts) == len(seq.texts) else None
    return final_output(
        seq.body, rid=seq.rid, output_ids=seq.output_ids, logprobs=seq.logprobs, finish=seq.finish,
        engine_meta=seq.meta, segments=seq.segments, text=text,
        e2e_latency=latency, index=index, per_token=seq.per_token, seed=seq.seed,
        discarded=seq.discarded,  # a staleness restart: what was thrown away stays visible
    )


def partial_output(
    body: SequenceBody,
    *,
    rid: str,
    output_ids: Sequence[int],
    logprobs: list[list[Any]],
    weight_version: str,
    index: int | None,
    text: str | None = None,
) -> Answer:
    """A cumulative, unfinished stream chunk of a sequence run from the single-sequence ``body``.

    Log-probs appear only when ``body`` asked for them, as SGLang does; ``text`` is the text so far
    (SGLang fills it in every cumulative chunk), null when it is not known. The token lists are copied:
    the sequence goes on after the chunk is built.
    """
    meta = AnswerMeta(id=rid, finish_reason=None, prompt_tokens=len(body.input_ids), weight_version=weight_version,
                      completion_tokens=len(output_ids), cached_tokens=0,
                      output_token_logprobs=list(logprobs) if body.wants_logprobs else UNSET)
    return Answer(text, as_list(output_ids), meta, UNSET if index is None else index)


def final_output(
    body: SequenceBody,
    *,
    rid: str,
    output_ids: Sequence[int],
    logprobs: list[list[Any]],
    finish: FinishReason | None,
    engine_meta: FinalMeta,
    segments: Sequence[Segment],
    text: str | None,
    e2e_latency: float,
    index: int | None,
    per_token: dict[str, list[Any]] | None = None,
    seed: Any = None,
    discarded: Sequence[Segment] = (),
) -> Answer:
    """The manager's final ``/generate`` answer for one sequence that may span several engines.

    Fields of the ``meta_info`` of the engine that finished the sequence that the manager does not
    interpret pass through (``AnswerMeta.engine``); what is a property of the whole sequence rather than
    of its last request is the manager's. ``meta_info.segments`` (``instance``, ``endpoint``,
    ``weight_version``, ``start``, ``end``, ``outcome`` per engine) is the manager's addition to SGLang's
    format, and ``discarded_segments`` (when a staleness restart threw some away); the top-level
    ``weight_version`` is the last segment's; SGLang's ``weight_versions`` spans, when the engine sent
    them, are said for the whole sequence; ``meta_info.sampling_seed`` is ``seed`` (the one the sequence
    was sent with), else the body's.
    """
    if seed is None:
        seed = body.sampling.sampling_seed
    # The engine's fields the manager does not interpret (copied: the sequence's stays as it is), less
    # those this answer says itself.
    engine = dict(engine_meta.other)
    if engine:
        for key in per_token or ():
            engine.pop(key, None)
        if seed is not None:
            engine.pop("sampling_seed", None)
        if discarded:
            engine.pop("discarded_segments", None)
    meta = AnswerMeta(
        id=rid, finish_reason=finish, prompt_tokens=len(body.input_ids), completion_tokens=len(output_ids),
        weight_version=segments[-1].weight_version if segments else engine_meta.weight_version,
        e2e_latency=round(e2e_latency, 6), segments=tuple(segments),
        # SGLang's spans are its last request's: say them for the whole sequence
        weight_versions=version_spans(segments) if engine_meta.has_spans else UNSET,
        discarded_segments=tuple(discarded) if discarded else UNSET,
        output_token_logprobs=logprobs if body.wants_logprobs else UNSET,
        # what the sequence was sampled with (the manager's when the caller gave none)
        sampling_seed=UNSET if seed is None else seed,
        per_token=per_token or UNSET, engine=engine or UNSET,
    )
    return Answer(text, as_list(output_ids), meta, UNSET if index is None else index)


def version_spans(segments: Sequence[Segment]) -> list[VersionSpan]:
    """SGLang's ``weight_versions`` spans (adjacent equal versions joined) over a whole sequence, from its
    segments."""
    spans: list[VersionSpan] = []
    for s in segments:
        if spans and spans[-1].version == s.weight_version and spans[-1].end == s.start:
            spans[-1] = VersionSpan(s.weight_version, spans[-1].start, s.end)
        else:
            spans.append(VersionSpan(s.weight_version, s.start, s.end))
    return spans
