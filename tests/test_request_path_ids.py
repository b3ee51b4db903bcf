"""The per-id steps of the ``/generate`` path, made cheaper for long prompts, give the values they gave:
the affinity keys' prefix hashes (cut at C speed) are the block-by-block definition's, and the check of
ids against a bound (msgspec's, in C) answers as ``max`` does, and a chat turn's prompt encoded once is
the JSON the engine and the caller got before, never sent for other ids (a continuation's)."""

from __future__ import annotations

import random

import msgspec
import orjson

from rollout_manager import jsonutil
from rollout_manager.instances.served_ids import below
from rollout_manager.openai_front import responses
from rollout_manager.placement.affinity import AffinityKeys, _chain
from rollout_manager.sglang.generate_request import continuation, encode
from rollout_manager.sglang.openai_turn import TurnSampling, turn_body


def by_slices(ids: list[int], block: int, start: int = 0, h: int = 0) -> list[tuple[int, int]]:
    """The definition: each block-aligned prefix's hash, chained over the blocks' tuples."""
    out = []
    for end in range(block, len(ids) + 1, block):
        h = hash((h, tuple(ids[end - block:end])))
        out.append((start + end, h))
    return out


def test_prefix_hashes_are_the_definitions() -> None:
    rng = random.Random(3)
    for n in [0, 1, 63, 64, 65, 127, 128, 129, 1000, 4096 + 17]:
        ids = [rng.randrange(200_000) for _ in range(n)]
        for block in (1, 7, 64):
            assert _chain(ids, block) == by_slices(ids, block)
            assert _chain(ids, block, 128, 99) == by_slices(ids, block, 128, 99)  # a tail after a known prefix
    ids = [rng.randrange(200_000) for _ in range(1000)]
    keys = AffinityKeys.of(ids, None, 64)
    assert list(keys.blocks) == by_slices(ids, 64) and keys.tail == tuple(ids[960:])


def test_below_answers_as_max() -> None:
    rng = random.Random(5)
    for _ in range(300):
        ids = [rng.randrange(1000) for _ in range(rng.randrange(0, 200))]
        limit = rng.randrange(0, 1100)
        assert below(ids, limit) == (not ids or max(ids) < limit)
    assert below([True, 3], 4) and not below([True, 4], 4)  # what msgspec refuses, max decides


def test_a_prompt_encoded_once_is_the_same_json_and_only_for_its_own_ids() -> None:
    ids = list(range(1000, 1300))
    sampling = TurnSampling(16, temperature=0.0)
    plain = turn_body(ids, sampling, stream=False)
    once = turn_body(ids, sampling, stream=False, ids_json=jsonutil.dumps(ids))
    assert encode(once) == encode(plain)
    later = continuation(once, [7, 8], rid="rm-1")  # a continuation on another box: its own, longer list
    assert orjson.loads(encode(later))["input_ids"] == [*ids, 7, 8]
    other = msgspec.structs.replace(once, input_ids=ids[:10])
    assert orjson.loads(encode(other))["input_ids"] == ids[:10]
    reply = responses.Reply("chatcmpl-1", 0, "m", None)
    assert jsonutil.dumps(responses.whole(reply, "chat.completion", [], [ids], len(ids), 0, jsonutil.dumps(ids))) \
        == jsonutil.dumps(responses.whole(reply, "chat.completion", [], [ids], len(ids), 0))
