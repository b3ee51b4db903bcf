"""The manager's ``/generate`` answers for its sequences, in SGLang's output format.

A sequence may span several engines, so these are built from the sequence's own state, not relayed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rollout_manager.rollout.progress import as_list
from rollout_manager.rollout.sequence import Segment, SequenceState
from rollout_manager.sglang.generate_request import SequenceBody


def partial_answer(seq: SequenceState, index: int | None) -> dict[str, Any]:
    """The stream chunk a streaming caller is sent for a running sequence (:func:`partial_output`)."""
    return partial_output(
        seq.body, rid=seq.rid, output_ids=seq.output_ids, logprobs=seq.logprobs,
        weight_version=str(seq.segments[-1].weight_version) if seq.segments else "", index=index,
        text=seq.known_text(seq.live_text),
    )


def final_answer(seq: SequenceState, index: int | None, latency: float) -> dict[str, Any]:
    """A finished sequence's answer (:func:`final_output`), ``latency`` seconds after it began."""
    # The text is known only if every segment's engine sent its part (a cut segment's is lost).
    texts = [t for t in seq.texts if t is not None]
    text = "".join(texts) if seq.texts and len(texts) == len(seq.texts) else None
    out = final_output(
        seq.body, rid=seq.rid, output_ids=seq.output_ids, logprobs=seq.logprobs, finish=seq.finish,
        engine_meta=seq.meta, segments=seq.segments, text=text,
        e2e_latency=latency, index=index, per_token=seq.per_token, seed=seq.seed,
    )
    if seq.discarded:  # a staleness restart: what was thrown away stays visible
        out["meta_info"]["discarded_segments"] = [s.to_dict() for s in seq.discarded]
    return out


def partial_output(
    body: SequenceBody,
    *,
    rid: str,
    output_ids: Sequence[int],
    logprobs: list[list[Any]],
    weight_version: str,
    index: int | None,
    text: str | None = None,
) -> dict[str, Any]:
    """A cumulative, unfinished stream chunk of a sequence run from the single-sequence ``body``.

    Log-probs appear only when ``body`` asked for them, as SGLang does; ``text`` is the text so far
    (SGLang fills it in every cumulative chunk), null when it is not known.
    """
    meta: dict[str, Any] = {"id": rid, "finish_reason": None, "prompt_tokens": len(body.input_ids),
                            "weight_version": weight_version, "completion_tokens": len(output_ids),
                            "cached_tokens": 0}
    if body.wants_logprobs:
        meta["output_token_logprobs"] = list(logprobs)
    out: dict[str, Any] = {"text": text, "output_ids": as_list(output_ids), "meta_info": meta}
    if index is not None:
        out["index"] = index
    return out


def final_output(
    body: SequenceBody,
    *,
    rid: str,
    output_ids: Sequence[int],
    logprobs: list[list[Any]],
    finish: dict[str, Any] | None,
    engine_meta: dict[str, Any],
    segments: Sequence[Segment],
    text: str | None,
    e2e_latency: float,
    index: int | None,
    per_token: dict[str, list[Any]] | None = None,
    seed: Any = None,
) -> dict[str, Any]:
    """The manager's final ``/generate`` answer for one sequence that may span several engines.

    Starts from the ``meta_info`` of the engine that finished the sequence, so fields the manager does
    not interpret pass through, then overwrites what is a property of the whole sequence rather than
    of its last request. ``meta_info.segments`` (``instance``, ``endpoint``, ``weight_version``,
    ``start``, ``end``, ``outcome`` per engine) is the manager's addition to SGLang's format; the
    top-level ``weight_version`` is the last segment's; ``meta_info.sampling_seed`` is ``seed`` (the
    one the sequence was sent with), else the body's.
    """
    meta = dict(engine_meta)
    spans = [s.to_dict() for s in segments]
    meta.update({
        "id": rid,
        "finish_reason": finish,
        "prompt_tokens": len(body.input_ids),
        "completion_tokens": len(output_ids),
        "weight_version": segments[-1].weight_version if segments else meta.get("weight_version"),
        "e2e_latency": round(e2e_latency, 6),
        "segments": spans,
    })
    if "weight_versions" in meta:  # SGLang's spans are its last request's: say them for the whole sequence
        meta["weight_versions"] = version_spans(spans)
    if body.wants_logprobs:
        meta["output_token_logprobs"] = logprobs
    else:
        meta.pop("output_token_logprobs", None)
    meta.update(per_token or {})  # gathered over every chunk and segment, not the last chunk's
    if seed is None:
        seed = body.sampling.sampling_seed
    if seed is not None:
        meta["sampling_seed"] = seed  # what the sequence was sampled with (the manager's when the caller gave none)
    out: dict[str, Any] = {"text": text, "output_ids": as_list(output_ids), "meta_info": meta}
    if index is not None:
        out["index"] = index
    return out


def version_spans(segments: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """SGLang's ``weight_versions`` spans (``{"version", "start", "end"}``, adjacent equal versions joined)
    over a whole sequence, from its segments."""
    spans: list[dict[str, Any]] = []
    for s in segments:
        if spans and spans[-1]["version"] == s["weight_version"] and spans[-1]["end"] == s["start"]:
            spans[-1]["end"] = s["end"]
        else:
            spans.append({"version": s["weight_version"], "start": s["start"], "end": s["end"]})
    return spans
