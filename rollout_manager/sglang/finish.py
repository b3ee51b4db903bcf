"""How an SGLang request ends, typed: its ``finish_reason`` and the final chunk's ``meta_info``.

Part of SGLang's contract, beside :mod:`.wire`. SGLang 0.5.23 builds a finish_reason with its
``BaseFinishReason.to_json`` (``managers/schedule_batch.py``: ``{"type": "stop", "matched": ...}``,
``{"type": "length", "length": ...}``, ``{"type": "abort", "message", "status_code", "err_type"}``) or, for
a request aborted while it waits, in the tokenizer manager (``{"type": "abort", "message": ...}``): always an
object with a string ``type`` (``io_struct.FinishReasonDict``), null while the request runs. Each is decoded
once, from the final chunk, and said back key for key as the engine said it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

# finish_reason types.
STOP = "stop"
LENGTH = "length"
ABORT = "abort"


def _is_int(value: Any) -> bool:
    return type(value) is int


def _is_str(value: Any) -> bool:
    return type(value) is str


def _is_matched(value: Any) -> bool:
    return type(value) in (int, str) or (type(value) is list and all(type(t) is int for t in value))


# SGLang's fields and the JSON type each has there (null allowed for all): a value of another type stays
# in the pass-through as sent.
_SHAPES: dict[str, Callable[[Any], bool]] = {
    "matched": _is_matched, "length": _is_int, "message": _is_str, "status_code": _is_int, "err_type": _is_str}


class FinishReason(msgspec.Struct, frozen=True):
    """SGLang's finish_reason. A field UNSET was not sent; ``other`` holds, as sent, the fields that are not
    SGLang's or not of SGLang's type (the manager does not interpret them)."""

    type: str  # "stop", "length", "abort" (another string passes through)
    matched: int | str | list[int] | None | UnsetType = UNSET  # stop: the token id(s) or text that matched
    length: int | None | UnsetType = UNSET  # length: the tokens made (the sequence's, once rebased)
    message: str | None | UnsetType = UNSET  # abort: why
    status_code: int | None | UnsetType = UNSET  # abort: the HTTP status SGLang gives it (4xx: the caller's)
    err_type: str | None | UnsetType = UNSET
    other: dict[str, Any] | UnsetType = UNSET

    @classmethod
    def from_json(cls, obj: Any) -> FinishReason:
        """The finish_reason a chunk carries (not null). Raises ValueError for one that is not an object
        with a string ``type``: SGLang never sends one, and the manager could not tell how it ended."""
        if type(obj) is not dict:
            raise ValueError(f"finish_reason {str(obj)[:200]} is not an object")
        kind = obj.get("type")
        if type(kind) is not str:
            raise ValueError(f"finish_reason {str(obj)[:200]} has no string type")
        fields: dict[str, Any] = {}
        other: dict[str, Any] = {}
        for key, value in obj.items():
            if key != "type":
                shape = _SHAPES.get(key)
                (fields if shape is not None and (value is None or shape(value)) else other)[key] = value
        return cls(kind, **fields, other=other or UNSET)

    @classmethod
    def of(cls, kind: str, **fields: Any) -> FinishReason:
        """One the manager (or an engine double) makes: a length one says ``length`` (null unless given), an
        abort one its ``message`` ("Abort" unless given)."""
        obj: dict[str, Any] = {"type": kind}
        if kind == LENGTH:
            obj["length"] = fields.pop("length", None)
        if kind == ABORT:
            obj["message"] = fields.pop("message", "Abort")
        obj.update(fields)
        return cls.from_json(obj)

    def to_json(self) -> dict[str, Any]:
        """The JSON object callers get: key for key what the engine said (SGLang's order)."""
        out: dict[str, Any] = {"type": self.type}
        if self.matched is not UNSET:
            out["matched"] = self.matched
        if self.length is not UNSET:
            out["length"] = self.length
        if self.message is not UNSET:
            out["message"] = self.message
        if self.status_code is not UNSET:
            out["status_code"] = self.status_code
        if self.err_type is not UNSET:
            out["err_type"] = self.err_type
        if self.other is not UNSET:
            out.update(self.other)
        return out

    @property
    def is_abort(self) -> bool:
        """Whether the engine aborted the request (it did not end on its own)."""
        return self.type == ABORT

    @property
    def caller_status(self) -> int | None:
        """The 4xx status of an abort that refused the request itself, None for any other finish.

        SGLang's scheduler refuses some requests (an input longer than it can hold, a bad
        ``logprob_start_len``, ...) by finishing them at once with ``{"type": "abort", "status_code": 400,
        "err_type": "BadRequestError", "message": ...}`` instead of an HTTP error. That is the caller's
        error and every instance would say the same; an abort with no status or a 5xx is the instance's.
        """
        status = self.status_code
        return status if self.type == ABORT and isinstance(status, int) and 400 <= status < 500 else None

    @property
    def error_type(self) -> str | None:
        """SGLang's ``err_type`` of an abort (None: not given)."""
        return self.err_type if isinstance(self.err_type, str) else None

    @property
    def abort_message(self) -> str:
        """Why the engine aborted, for logs and errors (the whole finish_reason when it gives no message)."""
        return self.message or str(self.to_json())

    def rebased(self, start: int) -> FinishReason:
        """A continued request's finish_reason as seen from the whole sequence.

        The request that continues a sequence ``start`` tokens in counts ``length`` from its own first
        token; the caller counts from the sequence's first token, so ``length`` moves up by ``start``.
        """
        if self.type == LENGTH and isinstance(self.length, int) and start:
            return msgspec.structs.replace(self, length=self.length + start)
        return self


# The final meta_info fields the manager reads itself (per chunk, or to say them for a whole sequence):
# never kept in :attr:`FinalMeta.other`.
INTERPRETED_META = frozenset({"id", "finish_reason", "prompt_tokens", "completion_tokens", "weight_version",
                              "weight_versions", "e2e_latency", "segments", "output_token_logprobs",
                              "routed_experts"})


class VersionSpan(msgspec.Struct, frozen=True):
    """One of SGLang's ``weight_versions`` spans: tokens ``start..end`` were made on ``version``."""

    version: str | None
    start: int
    end: int


class FinalMeta(msgspec.Struct, frozen=True):
    """What a sequence keeps of the ``meta_info`` of the chunk that finished it: the fields its answer reads,
    and the engine's others (``other``, passed through to the caller)."""

    weight_version: Any = None  # the version the engine reported (any JSON value; None: not reported)
    weight_versions: Any = UNSET  # SGLang's spans of this request's tokens, as sent (UNSET: not sent)
    other: dict[str, Any] = {}

    @property
    def has_spans(self) -> bool:
        """Whether the engine sent ``weight_versions`` (SGLang >= 0.5.23; the answer then says them too)."""
        return self.weight_versions is not UNSET

    def spans(self) -> list[VersionSpan] | None:
        """SGLang's ``weight_versions`` spans over the request's tokens, in order from token 0 with no gap;
        None when not sent or not so (whether they cover every token made is the caller's to check)."""
        spans = self.weight_versions
        if type(spans) is not list or not spans:
            return None
        out: list[VersionSpan] = []
        at = 0
        for span in spans:
            if type(span) is not dict:
                return None
            version, a, b = span.get("version"), span.get("start"), span.get("end")
            if version is None or type(a) is not int or type(b) is not int or a != at or b < a:
                return None
            out.append(VersionSpan(str(version), a, b))
            at = b
        return out

    @classmethod
    def from_json(cls, meta: dict[str, Any]) -> FinalMeta:
        other = dict(meta)  # copied and trimmed in C (a comprehension costs more); the chunk's stays whole
        for key in INTERPRETED_META.intersection(other):
            del other[key]
        return cls(meta.get("weight_version"), meta.get("weight_versions", UNSET), other)


NO_META = FinalMeta()  # the meta_info of a sequence not finished yet (shared: one for all)
