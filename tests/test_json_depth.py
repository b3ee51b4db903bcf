"""A body's nesting is checked by walking its containers (``jsonutil._nests_deeper``), leaving long lists of
scalars to orjson's encoder: the answer must be the depth's, for any shape, whichever way each part is
taken (walked, encoded, or cleared by the raw body's bracket count)."""

from __future__ import annotations

import random
from typing import Any

import orjson
import pytest

from rollout_manager import jsonutil


def depth(v: Any) -> int:
    if isinstance(v, dict):
        return 1 + max(map(depth, v.values()), default=0)
    if isinstance(v, list):
        return 1 + max(map(depth, v), default=0)
    return 0


def shape(rng: random.Random, levels: int) -> Any:
    """A JSON value at most ``levels`` deep: objects, lists led by containers or by scalars, long scalar
    lists (token ids) with a container at their end now and then."""
    if levels == 0:
        return rng.choice([1, "s", None, 2.5, True])
    kids = [shape(rng, rng.randint(0, levels - 1)) for _ in range(rng.randint(0, 3))]
    if kids and rng.random() < 0.6:
        kids[rng.randrange(len(kids))] = shape(rng, levels - 1)
    kind = rng.random()
    if kind < 0.3:
        return [*range(rng.randint(0, 100)), *kids]  # ids first: past _SHORT, encoded
    if kind < 0.6:
        return kids
    return {f"k{i}": c for i, c in enumerate(kids)}


@pytest.mark.parametrize("walked", [jsonutil._WALKED, 2, 0])
def test_the_walk_answers_as_the_depth(monkeypatch: pytest.MonkeyPatch, walked: int) -> None:
    monkeypatch.setattr(jsonutil, "_WALKED", walked)
    rng = random.Random(7)
    for _ in range(1500):
        value = shape(rng, rng.randint(0, 10))
        raw = orjson.dumps(value)
        levels = rng.randint(0, 12)
        expected = depth(value) > levels
        assert jsonutil._nests_deeper(value, levels) == expected == jsonutil._deeper_than(value, levels)
        if levels == jsonutil.MAX_DEPTH or rng.random() < 0.5:
            assert jsonutil._nests_deeper(value, levels, raw) == expected


@pytest.mark.parametrize("levels", [126, 127, 128, 129, 130, 200])
def test_a_chat_body_nested_around_the_limit(levels: int) -> None:
    value: Any = "text"
    for i in range(levels):
        value = [value] if i % 2 else {"content": value, "ids": list(range(100))}
    body = {"messages": [{"role": "user", "content": "x"}] * 200 + [value]}
    raw = orjson.dumps(body)
    assert (jsonutil.too_deep(body, raw) is None) == (depth(body) <= jsonutil.MAX_DEPTH)
