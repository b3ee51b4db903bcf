"""What an instance's ``/generate`` answer means when it is not a good one: the caller's error
(:class:`EngineRejected`, carrying SGLang's error decoded: :class:`EngineError`) or the instance's
(:class:`EngineFailed`)."""

from __future__ import annotations

from typing import Any

import msgspec

from rollout_manager import jsonutil
from rollout_manager.sglang import wire


class EngineError(msgspec.Struct, frozen=True):
    """SGLang's error, decoded once where it arrives: an error answer's body, an error frame in a stream, or
    an abort that refuses the request. ``status``: the HTTP status it came with (or, in a frame or an
    abort, says); ``type``: SGLang's error type, where it gives one."""

    status: int
    message: str
    type: str | None = None

    @classmethod
    def of(cls, status: int, body: Any) -> EngineError:
        """The error of a body as SGLang sends it (``{"error": {"message", "type", "code"}}``, the inner
        object alone, or a string; anything else reads as its text)."""
        inner = body.get("error", body) if isinstance(body, dict) else body
        kind = inner.get("type") if isinstance(inner, dict) else None
        return cls(status, wire.error_message(body), kind if isinstance(kind, str) else None)


class EngineRejected(Exception):
    """The engine refused the request as malformed (400, 413 or 422, or an error frame in the stream).

    Most likely the caller's error, as SGLang says; generation asks one other instance to be sure.
    """

    def __init__(self, error: EngineError):
        self.error = error
        super().__init__(f"HTTP {error.status}: {error.message}")

    @property
    def status(self) -> int:
        return self.error.status


class EngineFailed(Exception):
    """The instance failed while serving (no answer, 5xx, reset, stall, stream cut short)."""


# The statuses with which SGLang refuses a request it finds malformed (FastAPI's 422 included); any other
# 4xx on /generate (404 or 405: not SGLang's /generate at that address; 401, 403: credentials the
# manager was never given; 429: a proxy's limit) says nothing about the caller's body.
REFUSAL_STATUSES = frozenset({400, 413, 422})


def refusal(status: int, error: Any, text: str | None = None) -> EngineRejected | EngineFailed:
    """What an error status (of the answer, or of an error frame) from ``/generate`` means; ``error``: the
    body as decoded, ``text``: as received, for the message."""
    if status in REFUSAL_STATUSES:
        return EngineRejected(EngineError.of(status, error))
    if text is None:
        text = error if isinstance(error, str) else jsonutil.dumps(error).decode(errors="replace")
    if 400 <= status < 500:
        return EngineFailed(f"HTTP {status} on {wire.GENERATE}, which no valid request gets from SGLang "
                            f"(not the caller's error): {text[:200]}")
    return EngineFailed(f"HTTP {status}: {text[:200]}")
