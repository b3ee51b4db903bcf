"""Turning a pydantic ``ValidationError`` into one readable line that names the field.

Shared by the manager's HTTP API and the weight agents, so a bad body reads the same everywhere:
``field 'session_ids[0]': Input should be a valid string``. One message per real mistake, the field
written as the caller wrote it; a mistake about the body as a whole (its JSON type, or a check across
fields) is said as it is, without a made-up field name.
"""

from __future__ import annotations

from pydantic import ValidationError
from pydantic_core import ErrorDetails

# pydantic's error types for "this should have been an object"; their message names a Python class
NOT_AN_OBJECT = {"model_type", "dict_type", "model_attributes_type"}
MAX_MESSAGES = 3


def format_loc(loc: tuple[int | str, ...]) -> str:
    """``("weight_sender_ips", 0, 1)`` -> ``weight_sender_ips[0][1]``; the body itself is ``body``."""
    out = ""
    for part in loc:
        if part == "root" or (isinstance(part, str) and (not part.isidentifier() or part[:1].isupper())):
            continue  # pydantic's names for union branches (tags) and models, not fields
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "body"


def describe_error(err: ErrorDetails) -> str:
    """One problem: ``field 'x.y[0]': what is wrong``, or for the body itself just what is wrong."""
    field = format_loc(err["loc"])
    at_body = field == "body"
    if err["type"] in NOT_AN_OBJECT:
        return "the body must be a JSON object" if at_body else f"field '{field}': Input should be a JSON object"
    if at_body and err["type"] == "list_type" and err["msg"] == "Input should be a valid list":
        return "the body must be a JSON list"
    msg = err["msg"].removeprefix("Value error, ")
    return msg if at_body else f"field '{field}': {msg}"


def describe_validation_error(exc: ValidationError) -> str:
    """Name the field and what was wrong with it, for the first few problems."""
    parts = list(dict.fromkeys(describe_error(err) for err in exc.errors()))
    more = len(parts) - MAX_MESSAGES
    return "; ".join(parts[:MAX_MESSAGES]) + (f" (and {more} more)" if more > 0 else "")
