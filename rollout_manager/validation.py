"""Turning a refused body into one readable line that names the field.

Shared by the manager's HTTP API and the weight agents, so a bad body reads the same everywhere:
``field 'session_ids[0]': Input should be a valid string``. One message per real mistake, the field
written as the caller wrote it; a mistake about the body as a whole (its JSON type, or a check across
fields) is said as it is, without a made-up field name. A pydantic ``ValidationError`` is described as
it stands; a body that a msgspec type refused (msgspec stops at the first mistake and words it its own
way) is described by :func:`explain`, which walks it against the same type and words every mistake
as pydantic does, so the API reads the same whichever library holds a body's schema.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from msgspec import inspect
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
    if err["type"] in NOT_AN_OBJECT:
        return describe(err["loc"], OBJECT)
    return describe(err["loc"], err["msg"].removeprefix("Value error, "))


OBJECT = "Input should be a JSON object"
Loc = tuple[int | str, ...]
Problem = tuple[Loc, str]


def describe(loc: Loc, msg: str) -> str:
    """One problem at ``loc``: ``field 'x.y[0]': msg``, or for the body itself just what is wrong."""
    field = format_loc(loc)
    if field != "body":
        return f"field '{field}': {msg}"
    if msg == OBJECT:
        return "the body must be a JSON object"
    return "the body must be a JSON list" if msg == "Input should be a valid list" else msg


def join(parts: Iterator[str] | list[str]) -> str:
    """The first few distinct problems, as one line."""
    distinct = list(dict.fromkeys(parts))
    more = len(distinct) - MAX_MESSAGES
    return "; ".join(distinct[:MAX_MESSAGES]) + (f" (and {more} more)" if more > 0 else "")


def describe_validation_error(exc: ValidationError) -> str:
    """Name the field and what was wrong with it, for the first few problems."""
    return join(describe_error(err) for err in exc.errors())


# ------------------------------------------------------------------ msgspec types, worded as pydantic words them

_NAMES = {inspect.StrType: "a string", inspect.IntType: "an integer", inspect.BoolType: "a boolean",
          inspect.FloatType: "a number"}
_JSON_TYPE = {inspect.StrType: str, inspect.IntType: int, inspect.BoolType: bool, inspect.FloatType: float}
_VALID = {inspect.StrType: "Input should be a valid string", inspect.IntType: "Input should be a valid integer",
          inspect.BoolType: "Input should be a valid boolean", inspect.FloatType: "Input should be a valid number",
          inspect.ListType: "Input should be a valid list", inspect.StructType: OBJECT}


def explain(data: Any, typ: Any, loc: Loc = ()) -> list[Problem]:
    """Every mistake in ``data`` (decoded JSON) against the msgspec type ``typ``, where it is and what is
    wrong, worded as pydantic words it: called only for a body msgspec refused, so no hot path pays for it.

    A union is read as the old schemas' tags read it: null is its null branch, a list its list branch,
    anything else its one other branch (or, of several scalar branches, the one of its own type)."""
    return list(_problems(data, inspect.type_info(typ), loc))


def _problems(value: Any, t: inspect.Type, loc: Loc) -> Iterator[Problem]:
    while isinstance(t, inspect.Metadata):
        t = t.type
    if isinstance(t, inspect.AnyType):
        return
    if isinstance(t, inspect.UnionType):
        yield from _union(value, t, loc)
        return
    kind = type(value)
    if isinstance(t, inspect.NoneType):
        if value is not None:
            yield loc, "Input should be None"
    elif isinstance(t, inspect.BoolType):
        if kind is not bool:
            yield loc, _VALID[inspect.BoolType]
    elif isinstance(t, (inspect.IntType, inspect.FloatType)):
        if kind is not int and (kind is not float or isinstance(t, inspect.IntType)):
            yield loc, _VALID[type(t)]
        else:
            yield from _bounds(value, t, loc)
    elif isinstance(t, inspect.StrType):
        if kind is not str:
            yield loc, _VALID[inspect.StrType]
        else:
            yield from _lengths(len(value), t, "String", "character", loc, "")
    elif isinstance(t, inspect.ListType):
        if kind is not list:
            yield loc, _VALID[inspect.ListType]
            return
        for i, item in enumerate(value):
            yield from _problems(item, t.item_type, (*loc, i))
        yield from _lengths(len(value), t, "List", "item", loc, f" after validation, not {len(value)}")
    elif isinstance(t, inspect.StructType):
        if kind is not dict:
            yield loc, OBJECT
            return
        for field in t.fields:
            if field.encode_name in value:
                yield from _problems(value[field.encode_name], field.type, (*loc, field.encode_name))
            elif field.required:
                yield (*loc, field.encode_name), "Field required"
    elif not isinstance(t, (inspect.AnyType, inspect.RawType)):  # a type no API body uses yet
        yield loc, f"Input should be of JSON type {type(t).__name__.removesuffix('Type').lower()}"


def _union(value: Any, t: inspect.UnionType, loc: Loc) -> Iterator[Problem]:
    branches = [b.type if isinstance(b, inspect.Metadata) else b for b in t.types]
    if value is None and any(isinstance(b, inspect.NoneType) for b in branches):
        return
    lists = [b for b in branches if isinstance(b, inspect.ListType)]
    others = [b for b in branches if not isinstance(b, (inspect.ListType, inspect.NoneType))]
    if type(value) is list and lists:
        yield from _problems(value, lists[0], loc)
        return
    if len(others) == 1 or (not others and lists):
        yield from _problems(value, (others or lists)[0], loc)
        return
    own = [b for b in others if _JSON_TYPE.get(type(b)) is type(value)]
    if own:
        yield from _problems(value, own[0], loc)
    else:
        yield loc, "Input should be " + " or ".join(_NAMES.get(type(b), type(b).__name__) for b in others)


def _bounds(value: float, t: inspect.IntType | inspect.FloatType, loc: Loc) -> Iterator[Problem]:
    if t.ge is not None and value < t.ge:
        yield loc, f"Input should be greater than or equal to {t.ge}"
    if t.gt is not None and value <= t.gt:
        yield loc, f"Input should be greater than {t.gt}"
    if t.le is not None and value > t.le:
        yield loc, f"Input should be less than or equal to {t.le}"
    if t.lt is not None and value >= t.lt:
        yield loc, f"Input should be less than {t.lt}"


def _lengths(n: int, t: inspect.StrType | inspect.ListType, what: str, unit: str, loc: Loc,
             tail: str) -> Iterator[Problem]:
    if t.min_length is not None and n < t.min_length:
        yield loc, f"{what} should have at least {t.min_length} {unit}{'' if t.min_length == 1 else 's'}{tail}"
    if t.max_length is not None and n > t.max_length:
        yield loc, f"{what} should have at most {t.max_length} {unit}{'' if t.max_length == 1 else 's'}{tail}"
