"""What an instance's ``/generate`` answer means when it is not a good one: the caller's error
(:class:`EngineRejected`) or the instance's (:class:`EngineFailed`)."""

from __future__ import annotations

from typing import Any

from rollout_manager import jsonutil
from rollout_manager.sglang import wire


class EngineRejected(Exception):
    """The engine refused the request as malformed (400, 413 or 422, or an error frame in the stream).

    Most likely the caller's error, as SGLang says; generation asks one other instance to be sure.
    """

    def __init__(self, status: int, error: Any):
        self.status = status
        self.error = error
        super().__init__(f"HTTP {status}: {error}")


class EngineFailed(Exception):
    """The instance failed while serving (no answer, 5xx, reset, stall, stream cut short)."""


# The statuses with which SGLang refuses a request it finds malformed (FastAPI's 422 included); any other
# 4xx on /generate (404 or 405: not SGLang's /generate at that address; 401, 403: credentials the
# manager was never given; 429: a proxy's limit) says nothing about the caller's body.
REFUSAL_STATUSES = frozenset({400, 413, 422})


def refusal(status: int, error: Any, text: str | None = None) -> EngineRejected | EngineFailed:
    """What an error status (of the answer, or of an error frame) from ``/generate`` means; ``text``:
    the error as received, for the message."""
    if status in REFUSAL_STATUSES:
        return EngineRejected(status, error)
    if text is None:
        text = error if isinstance(error, str) else jsonutil.dumps(error).decode(errors="replace")
    if 400 <= status < 500:
        return EngineFailed(f"HTTP {status} on {wire.GENERATE}, which no valid request gets from SGLang "
                            f"(not the caller's error): {text[:200]}")
    return EngineFailed(f"HTTP {status}: {text[:200]}")
