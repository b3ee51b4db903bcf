"""Turning a pydantic ``ValidationError`` into one readable line that names the field.

Shared by the manager's HTTP API and the weight agents, so a bad body reads the same everywhere:
``field 'session_ids[0]': Input should be a valid string``.
"""

from __future__ import annotations

from pydantic import ValidationError


def format_loc(loc: tuple[int | str, ...]) -> str:
    """``("weight_sender_ips", 0, 1)`` -> ``weight_sender_ips[0][1]``; the body itself is ``body``."""
    out = ""
    for part in loc:
        if part == "root" or (isinstance(part, str) and (not part.isidentifier() or part[:1].isupper())):
            continue  # pydantic's names for union branches and models, not fields
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "body"


def describe_validation_error(exc: ValidationError) -> str:
    """Name the field and what was wrong with it, for the first few problems."""
    parts = []
    for err in exc.errors()[:3]:
        loc = format_loc(err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        parts.append(f"field '{loc}': {msg}")
    more = len(exc.errors()) - 3
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")
