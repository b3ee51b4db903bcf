"""Routed-expert replay (R3) as SGLang 0.5.23 answers it, for the CPU engine.

What real SGLang does (measured on it; docs/real-sglang.md, "MoE and routed experts"):

- ``return_routed_experts`` (one bool for the whole body, batch or not) and ``routed_experts_start_len``
  (one int) are checked by FastAPI's model of the body before anything else: a value it cannot coerce
  (a list, null, 2, "maybe") is a ``400 {"object": "error", "message": "1 validation error: ..."}``.
- With ``return_routed_experts`` true the scheduler refuses a start outside ``[0, prompt tokens]`` (an abort
  finish with ``status_code`` 400), whether or not the server captures experts.
- A server started without ``--enable-return-routed-experts`` answers as if the flag were not asked.
- Otherwise the final output (only the final one, streaming or not, incremental or cumulative) carries
  ``meta_info.routed_experts``: base64 of little-endian int32 ``[rows, layers, top_k]``, row ``j`` the experts of
  the token at position ``start + j`` for positions ``[start, prompt + completion - 1)`` with ``start =
  min(routed_experts_start_len, prompt + completion - 1)`` (the last token never went through the model).
"""

from __future__ import annotations

import base64
from typing import Any

RETURN_KEY = "return_routed_experts"
START_KEY = "routed_experts_start_len"
META_KEY = "routed_experts"

# The strings (case-insensitive) and numbers pydantic's lax mode reads as booleans.
_TRUE = {"1", "on", "t", "true", "y", "yes"}
_FALSE = {"0", "off", "f", "false", "n", "no"}


def _as_bool(value: Any) -> tuple[bool | None, str | None]:
    """(value, None), or (None, pydantic's error type and message)."""
    if isinstance(value, bool):
        return value, None
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value), None
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE, None
    if isinstance(value, (int, float, str)):
        return None, "'bool_parsing', 'msg': 'Input should be a valid boolean, unable to interpret input'"
    return None, "'bool_type', 'msg': 'Input should be a valid boolean'"


def _int_error(value: Any) -> str | None:
    """Pydantic's lax int: ints, bools, integral floats and integer strings pass (the contract then
    refuses what is not a JSON integer)."""
    if isinstance(value, (bool, int)):
        return None
    if isinstance(value, float):
        return None if value.is_integer() else \
            "'int_from_float', 'msg': 'Input should be a valid integer, got a number with a fractional part'"
    if isinstance(value, str):
        try:
            int(value.strip())
        except ValueError:
            return "'int_parsing', 'msg': 'Input should be a valid integer, unable to parse string as an integer'"
        return None
    return "'int_type', 'msg': 'Input should be a valid integer'"


def field_error(body: Any) -> dict[str, Any] | None:
    """FastAPI's refusal of a body whose R3 fields it cannot coerce (the answer's JSON), else None."""
    if not isinstance(body, dict):
        return None
    errors = []
    if RETURN_KEY in body and _as_bool(body[RETURN_KEY])[1] is not None:
        errors.append((RETURN_KEY, _as_bool(body[RETURN_KEY])[1], body[RETURN_KEY]))
    if START_KEY in body and (problem := _int_error(body[START_KEY])) is not None:
        errors.append((START_KEY, problem, body[START_KEY]))
    if not errors:
        return None
    lines = "\n".join(f"  {{'type': {problem}, 'loc': ('body', '{key}'), 'input': {value!r}}}"
                      for key, problem, value in errors)
    message = f"{len(errors)} validation error{'s' if len(errors) > 1 else ''}:\n{lines}"
    return {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}


def requested(body: dict[str, Any]) -> tuple[bool, int]:
    """``(return_routed_experts, routed_experts_start_len)`` of a body :func:`field_error` passed."""
    wanted = _as_bool(body.get(RETURN_KEY, False))[0] or False
    start = body.get(START_KEY, 0)
    return wanted, int(start) if start is not None else 0


def start_error(start: int, prompt_tokens: int) -> str | None:
    """The scheduler's refusal of a start outside ``[0, prompt_tokens]`` (SGLang's own words), else None."""
    if start > prompt_tokens:
        return (f"recv_req.routed_experts_start_len={start} is higher than the number of input tokens "
                f"len(req.origin_input_ids)={prompt_tokens}. Please use a smaller routed_experts_start_len.")
    if start < 0:
        return (f"recv_req.routed_experts_start_len={start} is lower than 0. "
                "Please use a non-negative routed_experts_start_len.")
    return None


def expected_rows(start: int, prompt_tokens: int, completion_tokens: int) -> int:
    """Rows SGLang returns: positions ``[min(start, seqlen - 1), seqlen - 1)``."""
    last = prompt_tokens + completion_tokens - 1
    return max(0, last - min(start, last))


def encode(rows: bytes | bytearray) -> str:
    """``meta_info.routed_experts``: base64 of the little-endian int32 rows."""
    return base64.b64encode(bytes(rows)).decode("ascii")
