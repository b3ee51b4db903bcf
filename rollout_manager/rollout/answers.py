"""The manager's ``/generate`` answers for its sequences, built from each sequence's own state.

A sequence may span several engines, so its answer is built, not relayed: a typed value
(:class:`.answer.GenerateAnswer`, SGLang's output object) from here to the HTTP edge.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from msgspec import UNSET

from rollout_manager.rollout.progress import as_list
from rollout_manager.rollout.sequence import Segment, SequenceState
from rollout_manager.sglang.answer import AnswerMeta, GenerateAnswer
from rollout_manager.sglang.finish import FinalMeta, FinishReason, VersionSpan
from rollout_manager.sglang.generate_request import SequenceBody
from rollout_manager.sglang.routed_experts import Base64Rows


def partial_answer(seq: SequenceState, index: int | None) -> GenerateAnswer:
    """The stream chunk a streaming caller is sent for a running sequence (:func:`partial_output`)."""
    return partial_output(
        seq.body, rid=seq.rid, output_ids=seq.output_ids, logprobs=seq.logprobs,
        weight_version=str(seq.segments[-1].weight_version) if seq.segments else "", index=index,
        text=seq.known_text(seq.live_text), per_token=seq.per_token,
    )


def final_answer(seq: SequenceState, index: int | None, latency: float) -> GenerateAnswer:
    """A finished sequence's answer (:func:`final_output`), ``latency`` seconds after it began."""
    # The text is known only if every segment's engine sent its part (a cut segment's is lost).
    texts = [t for t in seq.texts if t is not None]
    text = "".join(texts) if seq.texts and len(texts) == len(seq.texts) else None
    return final_output(
        seq.body, rid=seq.rid, output_ids=seq.output_ids, logprobs=seq.logprobs, finish=seq.finish,
        engine_meta=seq.meta, segments=seq.segments, text=text,
        e2e_latency=latency, index=index, per_token=seq.per_token, seed=seq.seed,
        discarded=seq.discarded,  # a staleness restart: what was thrown away stays visible
        experts=None if seq.experts is None else seq.experts.to_json(),
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
    per_token: dict[str, list[Any]] | None = None,
) -> GenerateAnswer:
    """A cumulative, unfinished stream chunk of a sequence run from the single-sequence ``body``.

    Log-probs appear only when ``body`` asked for them, as SGLang does, with the other per-token lists
    (``per_token``: top log-probs, ...) that SGLang's own chunks carry; ``text`` is the text so far (SGLang
    fills it in every cumulative chunk), null when it is not known. The token lists are copied: the sequence
    goes on after the chunk is built.
    """
    meta = AnswerMeta(id=rid, finish_reason=None, prompt_tokens=len(body.input_ids), weight_version=weight_version,
                      completion_tokens=len(output_ids), cached_tokens=0,
                      output_token_logprobs=list(logprobs) if body.wants_logprobs else UNSET,
                      per_token={k: list(v) for k, v in per_token.items()} if per_token else UNSET)
    return GenerateAnswer(text, as_list(output_ids), meta, UNSET if index is None else index)


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
    experts: Base64Rows | None = None,
) -> GenerateAnswer:
    """The manager's final ``/generate`` answer for one sequence that may span several engines.

    The fields of the finishing engine that the manager does not interpret pass through
    (:attr:`.answer.AnswerMeta.engine`); what is a property of the whole sequence rather than of its last
    request is the manager's: its segments (the manager's addition to SGLang's format, with those a
    staleness restart threw away), its weight version (the last segment's), SGLang's version spans said for
    the whole sequence when the engine sent them, and ``seed`` (the one the sequence was sent with, else
    the body's).
    """
    if seed is None:
        seed = body.sampling.sampling_seed
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
        per_token=per_token or UNSET, engine=engine_meta.other or UNSET,
        routed_experts=UNSET if experts is None else experts,
        inexact_continuation=True if body.sampling.output_penalties and continued(segments) else UNSET,
    )
    return GenerateAnswer(text, as_list(output_ids), meta, UNSET if index is None else index)


def continued(segments: Sequence[Segment]) -> bool:
    """Whether an engine continued the sequence from tokens another request made (a segment that made tokens
    after the first token)."""
    return any(s.start > 0 and s.end > s.start for s in segments)


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
