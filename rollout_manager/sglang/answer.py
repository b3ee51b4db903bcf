"""The manager's ``/generate`` answer as SGLang's output object: its fields typed, encoded once at the edge.

A sequence may span several engines, so its answer is built from the sequence's own state
(``rollout.answers``), not relayed; this module is how that answer is spelled on the wire, beside the
chunk it is read from (:class:`.wire.GenerateChunk`). ``jsonutil.dumps`` encodes an answer through its
``to_json`` (a response body, an SSE chunk, an NDJSON line).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import msgspec
from msgspec import UNSET, UnsetType

from rollout_manager.sglang import wire
from rollout_manager.sglang.finish import FinishReason, VersionSpan
from rollout_manager.sglang.routed_experts import Base64Rows


class SegmentLike(Protocol):
    """One engine's share of a sequence, as the manager reports it (``rollout.sequence.Segment``)."""

    def to_dict(self) -> dict[str, Any]: ...


class AnswerMeta(msgspec.Struct):
    """An answer's ``meta_info``: the fields the manager sets, typed, and the engine's others passed through.

    An UNSET field is left out of the JSON. ``per_token`` (:data:`.wire.PER_TOKEN_META_KEYS`' lists, gathered
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
    segments: Sequence[SegmentLike] | UnsetType = UNSET
    weight_versions: list[VersionSpan] | UnsetType = UNSET  # only when the engine reported spans
    discarded_segments: Sequence[SegmentLike] | UnsetType = UNSET  # what a staleness restart threw away
    output_token_logprobs: list[list[Any]] | UnsetType = UNSET  # only when the request asked for them
    sampling_seed: Any = UNSET
    per_token: dict[str, list[Any]] | UnsetType = UNSET
    engine: dict[str, Any] | UnsetType = UNSET
    # R3: the whole sequence's rows, base64 (only when asked for), spliced into the JSON as the engines sent them
    routed_experts: Base64Rows | UnsetType = UNSET
    # True when the sequence was continued on another engine under a penalty SGLang counts over output tokens
    # only (the manager's addition; docs/sglang-contract.md): its samples are not one engine's.
    inexact_continuation: bool | UnsetType = UNSET

    def _engine_fields(self, engine: dict[str, Any]) -> dict[str, Any]:
        """The engine's fields (copied: the sequence's stay as they are), less those this answer says itself."""
        meta = dict(engine)
        for key in self.per_token or ():
            meta.pop(key, None)
        if self.sampling_seed is not UNSET:
            meta.pop("sampling_seed", None)
        if self.discarded_segments is not UNSET:
            meta.pop("discarded_segments", None)
        return meta

    def to_json(self) -> dict[str, Any]:
        """The ``meta_info`` object callers get."""
        meta = {} if self.engine is UNSET else self._engine_fields(self.engine)
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
        if self.routed_experts is not UNSET:
            meta["routed_experts"] = self.routed_experts.to_json()  # the engines' bytes, copied in as they are
        if self.inexact_continuation is not UNSET:
            meta["inexact_continuation"] = self.inexact_continuation
        return meta


class GenerateAnswer(msgspec.Struct):
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


class ErrorChunk(msgspec.Struct, frozen=True):
    """A sequence's failure inside a stream: one chunk of SGLang's error object (:func:`.wire.error_object`),
    the last a streaming caller is sent for that request."""

    message: str
    status: int

    def to_json(self) -> dict[str, Any]:
        return wire.error_object(self.message, self.status)
