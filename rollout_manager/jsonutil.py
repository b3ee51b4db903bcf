"""JSON for the hot paths: orjson (a base dependency; several times faster than the standard library)."""

from __future__ import annotations

from typing import Any

import orjson

# Deepest nesting a body may have. orjson decodes up to 1024 levels but encodes only 254, and the
# manager encodes what callers pass through to engines again: a limit well below both, far above any
# real request (a JSON schema for constrained decoding nests a few dozen levels at most).
MAX_DEPTH = 128
_ORJSON_ENCODE_DEPTH = 254  # orjson.dumps raises "Recursion limit reached" past this many levels

JSONDecodeError: type[ValueError] = orjson.JSONDecodeError


def dumps(obj: Any) -> bytes:
    """``obj`` as JSON. A value orjson does not know is encoded as its ``to_json()`` (the rollout flow's
    typed answers: ``sglang.answer.GenerateAnswer``, ``rollout.batch.BatchLine``), at the edge where it is sent."""
    return orjson.dumps(obj, default=_to_json)


def fragment(encoded: bytes) -> Any:
    """JSON already encoded (by :func:`dumps`), put into a document as it is (orjson's ``Fragment``): a
    value sent twice is encoded once."""
    return orjson.Fragment(encoded)


def _to_json(obj: Any) -> Any:
    to_json = getattr(obj, "to_json", None)
    if to_json is None:
        raise TypeError(f"Type is not JSON serializable: {type(obj).__name__}")
    return to_json()


def loads(data: bytes | str) -> Any:
    return orjson.loads(data)


def _deeper_than(value: Any, levels: int) -> bool:
    """Whether ``value`` nests more than ``levels`` levels: encoded inside enough empty lists to
    reach orjson's own limit exactly when it does (C speed, however large the body)."""
    wrapped = value
    for _ in range(_ORJSON_ENCODE_DEPTH - levels):
        wrapped = [wrapped]
    try:
        orjson.dumps(wrapped)
    except orjson.JSONEncodeError:
        return True
    return False


_WALKED = 4096  # containers walked in Python before the rest is left to orjson
_NOT_OPENING = bytes(b for b in range(256) if b not in b"[{")  # deleted, what is left is raw's "[" and "{" (one pass)
_SHORT = 64  # a list of scalars this long or shorter is walked; a longer one (token ids) is left to orjson


def _nests_deeper(value: Any, levels: int, raw: bytes | None = None) -> bool:
    """:func:`_deeper_than`, without encoding the whole of a body whose depth shows from its containers (a
    chat request: its history's text is most of the body, its many ``{`` are side by side): objects, and
    lists of containers or of few scalars, are walked here. A long list of scalars (token ids), and what is
    left past the first :data:`_WALKED` containers, go to :func:`_deeper_than` (C speed, however large),
    unless ``raw`` (the bytes ``value`` was decoded from, ``levels`` the whole body's) has no more brackets
    than ``levels``, which no body deeper than that has."""
    if type(value) is not list and type(value) is not dict:
        return levels < 0
    stack: list[tuple[Any, int]] = [(value, levels)]  # a container, and the levels it may take
    walked = 0
    few_brackets: bool | None = None  # raw's count, made when first needed
    while stack:
        node, left = stack.pop()
        if left <= 0:
            return True
        walked += 1
        listed = type(node) is list
        if walked > _WALKED or (listed and len(node) > _SHORT and type(node[0]) is not list
                                and type(node[0]) is not dict):
            if few_brackets is None:
                few_brackets = raw is not None and len(raw.translate(None, _NOT_OPENING)) <= levels
            if few_brackets:
                return False
            if _deeper_than(node, left):
                return True
            continue
        children: Any = node if listed else node.values()
        stack.extend((c, left - 1) for c in children if type(c) is list or type(c) is dict)
    return False


def is_depth_error(exc: Exception) -> bool:
    """A decoding error that is about nesting (orjson stops at 1024 levels), not about syntax."""
    return "depth limit" in str(exc) or "recursion" in str(exc).lower()


def too_deep(data: Any, raw: bytes | None = None) -> str | None:
    """Where decoded ``data`` nests deeper than :data:`MAX_DEPTH`, or None when it does not.

    The answer names the first field on the way down (``extra``, ``[3][1].sampling_params``), or
    ``body`` when no field is on the way (nested lists all the way). ``raw``, the bytes it was decoded from, makes the
    common case cheap: a body with fewer brackets than the limit cannot nest that deep.
    """
    if not _nests_deeper(data, MAX_DEPTH, raw):
        return None
    path, node, depth, named = "", data, 0, False
    # Down through objects, and through lists until the first field (a batch is [[id, body], ...]);
    # past a field, lists nested deep are the problem itself, and their indices say nothing.
    while depth < 8 and (isinstance(node, dict) or (isinstance(node, list) and not named)):
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, child in items:
            if _deeper_than(child, MAX_DEPTH - depth - 1):
                path += f"[{key}]" if isinstance(key, int) else (f".{key}" if path else str(key))
                named = named or isinstance(key, str)
                node, depth = child, depth + 1
                break
        else:
            break
    return path if named else "body"
