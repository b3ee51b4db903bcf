"""The manager's ``/generate`` answer as SGLang's output object: its fields typed, encoded once at the edge,
and read back once by the trainer plugin.

A sequence may span several engines, so its answer is built from the sequence's own state
(``rollout.answers``), not relayed; this module is how that answer is spelled on the wire, beside the
chunk it is read from (:class:`.wire.GenerateChunk`). ``jsonutil.dumps`` encodes an answer through its
``to_json`` (a response body, an SSE chunk, an NDJSON line). :class:`ReceivedAnswer` is the same answer as
a caller decodes it (``ReceivedAnswer.from_json``), so the plugin reads the keys this module writes and no
others.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
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


# ---------------------------------------------------------------- the answer as a caller reads it


def _field(value: Any, where: str, kinds: tuple[type, ...], what: str) -> Any:
    """``value`` when it is None or of ``kinds`` (a bool is no number); else a ValueError naming ``where``."""
    if value is None or (isinstance(value, kinds) and not isinstance(value, bool)):
        return value
    raise ValueError(f"{where} is {type(value).__name__}, not {what}")


def _text(value: Any) -> str | None:
    """An id or a weight version as text, whatever JSON value carried it (None: not sent)."""
    return None if value is None else str(value)


@dataclass(frozen=True)
class ReceivedSegment:
    """One engine's share of a received answer: tokens ``start..end`` made by ``instance`` at ``weight_version``
    (what ``rollout.sequence.Segment.to_dict`` sends)."""

    instance: str | None
    endpoint: str | None
    weight_version: str | None
    start: int
    end: int
    outcome: str | None

    @classmethod
    def from_json(cls, obj: Any, where: str) -> ReceivedSegment:
        if not isinstance(obj, dict):
            raise ValueError(f"{where} is {type(obj).__name__}, not an object")
        start = _field(obj.get("start"), f"{where}.start", (int,), "a token index")
        end = _field(obj.get("end"), f"{where}.end", (int,), "a token index")
        if start is None or end is None:
            raise ValueError(f"{where} has no start or no end")
        return cls(instance=_field(obj.get("instance"), f"{where}.instance", (str,), "text"),
                   endpoint=_field(obj.get("endpoint"), f"{where}.endpoint", (str,), "text"),
                   weight_version=_text(obj.get("weight_version")), start=start, end=end,
                   outcome=_field(obj.get("outcome"), f"{where}.outcome", (str,), "text"))

    def to_json(self) -> dict[str, Any]:
        """The segment's JSON object again, as the manager sent it (verl's ``extra_fields`` carry these)."""
        return {"instance": self.instance, "endpoint": self.endpoint, "weight_version": self.weight_version,
                "start": self.start, "end": self.end, "outcome": self.outcome}


@dataclass(frozen=True)
class ReceivedAnswer:
    """One ``/generate`` answer of the manager as a caller reads it (a final answer, a batch answer's item, an
    NDJSON line's ``data``): decoded once by :meth:`from_json`, each field typed.

    A field the answer leaves out reads as None (a list as empty); one of the wrong type is refused, naming it.
    """

    rid: str | None
    output_ids: tuple[int, ...]
    text: str | None
    index: int | None
    finish: FinishReason | None  # None: the answer says no finish_reason
    weight_version: str | None  # the last segment's (the manager's), as text
    prompt_tokens: int | None
    completion_tokens: int | None
    e2e_latency: float | None
    # The log-prob of each output token (null where the engine gave none); empty when not asked for.
    token_logprobs: tuple[float | None, ...]
    segments: tuple[ReceivedSegment, ...]  # one per engine the sequence ran on
    routed_experts: str | None  # R3's rows as base64 text, when asked for (decoded by the caller)

    @property
    def finish_type(self) -> str | None:
        """``"stop"``, ``"length"``, ``"abort"``; None without a finish_reason."""
        return None if self.finish is None else self.finish.type

    @property
    def weight_versions(self) -> list[str | None]:
        """Every segment's weight version, in order; just ``[weight_version]`` without segments."""
        return [s.weight_version for s in self.segments] or [self.weight_version]

    @classmethod
    def from_json(cls, obj: Any) -> ReceivedAnswer:
        """The answer of a decoded JSON object; ValueError naming the field for one that is not an answer."""
        if not isinstance(obj, dict):
            raise ValueError(f"the answer is {type(obj).__name__}, not an object")
        meta = obj.get("meta_info")
        if meta is None:
            meta = {}
        if not isinstance(meta, dict):
            raise ValueError(f"meta_info is {type(meta).__name__}, not an object")
        ids = _field(obj.get("output_ids"), "output_ids", (list,), "a list") or []
        if not all(type(t) is int for t in ids):
            raise ValueError("output_ids holds something other than token ids")
        finish = meta.get("finish_reason")
        entries = _field(meta.get("output_token_logprobs"), "meta_info.output_token_logprobs", (list,), "a list")
        logprobs: list[float | None] = []
        for i, entry in enumerate(entries or ()):
            if not isinstance(entry, list) or not entry:
                raise ValueError(f"meta_info.output_token_logprobs[{i}] is not [logprob, token_id, text]")
            value = _field(entry[0], f"meta_info.output_token_logprobs[{i}][0]", (int, float), "a number")
            logprobs.append(None if value is None else float(value))
        segments = _field(meta.get("segments"), "meta_info.segments", (list,), "a list") or []
        latency = _field(meta.get("e2e_latency"), "meta_info.e2e_latency", (int, float), "a number")
        return cls(
            rid=_text(meta.get("id")), output_ids=tuple(ids),
            text=_field(obj.get("text"), "text", (str,), "text"),
            index=_field(obj.get("index"), "index", (int,), "an integer"),
            finish=None if finish is None else FinishReason.from_json(finish),
            weight_version=_text(meta.get("weight_version")),
            prompt_tokens=_field(meta.get("prompt_tokens"), "meta_info.prompt_tokens", (int,), "an integer"),
            completion_tokens=_field(meta.get("completion_tokens"), "meta_info.completion_tokens", (int,),
                                     "an integer"),
            e2e_latency=None if latency is None else float(latency),
            token_logprobs=tuple(logprobs),
            segments=tuple(ReceivedSegment.from_json(s, f"meta_info.segments[{i}]") for i, s in enumerate(segments)),
            routed_experts=_field(meta.get("routed_experts"), "meta_info.routed_experts", (str,), "base64 text"))
