"""Token ids outside the vocabulary are refused at the door (400 naming input_ids and the bound), before
anything is placed: real SGLang's scheduler crashes on them (docs/http-api.md)."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rollout_manager.errors import InvalidField
from rollout_manager.instances.registry import Kind, Registry, State
from rollout_manager.rollout.vocab import VocabBound


def test_the_bound_is_the_smallest_known_vocabulary_and_follows_the_registry() -> None:
    reg = Registry()
    vocab = VocabBound(reg)
    assert vocab.bound() is None
    vocab.check([10**9])  # nothing known: nothing refused here
    a, b = reg.add("127.0.0.1", 1, Kind.REMOTE), reg.add("127.0.0.1", 2, Kind.REMOTE)
    a.engine = replace(a.engine, vocab_size=1000)
    reg.transition(a, State.ACTIVE, "ready")
    assert vocab.bound() == 1000
    b.engine = replace(b.engine, vocab_size=500)
    reg.transition(b, State.ACTIVE, "ready")
    assert vocab.bound() == 500
    vocab.check([0, 499])
    with pytest.raises(InvalidField, match=r"field 'input_ids\[1\]': token id 500 .* below 500"):
        vocab.check([0, 500, 7])
    with pytest.raises(InvalidField, match=r"field 'input_ids\[1\]\[0\]': token id 900"):
        vocab.check([[1], [900]])
    with pytest.raises(InvalidField, match=r"field '\[3\]\[1\].input_ids\[0\]'"):
        vocab.check([900], "[3][1].input_ids")
    reg.transition(b, State.DEAD, "removed")
    assert vocab.bound() == 1000
    assert VocabBound(reg, configured=300).bound() == 300


async def _sequences(m: Any) -> float:
    async with m.session.get(m.url + "/metrics") as resp:
        text = await resp.text()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "rollout_manager_sequences_total")


async def _ndjson(m: Any, items: list[Any]) -> tuple[int, str]:
    async with m.session.post(m.url + "/batch_generate_requests", json=items) as resp:
        return resp.status, await resp.text()


@pytest.mark.slow
@pytest.mark.parametrize("fast_lane", [True, False])
async def test_ids_past_the_instances_vocabulary_are_refused_before_placing(
        start_manager: Any, start_engines: Any, fast_lane: bool) -> None:
    m = await start_manager(http_fast_generate=str(fast_lane).lower())
    (engine,) = await start_engines([])
    await m.register(engine)  # the CPU engine reports vocab_size 256 in /model_info
    params = {"max_new_tokens": 2, "temperature": 0.0}
    for body, field in (({"input_ids": [1, 256]}, "input_ids[1]"),
                        ({"input_ids": [1, 2, 3000], "stream": True}, "input_ids[2]"),
                        ({"input_ids": [[1], [2, 300]]}, "input_ids[1][1]")):
        status, out = await m.post("/generate", {**body, "sampling_params": params})
        assert status == 400, out
        assert f"field '{field}'" in out["error"] and "must be below 256" in out["error"], out
    assert await _sequences(m) == 0  # nothing was placed
    status, out = await m.post("/generate", {"input_ids": [1, 255], "sampling_params": params})
    assert status == 200 and len(out["output_ids"]) == 2, out
    # In an NDJSON batch the item fails its own line (its batch-mates are other callers' requests).
    status, text = await _ndjson(m, [["a", {"input_ids": [1], "sampling_params": params}],
                                     ["b", {"input_ids": [999], "sampling_params": params}]])
    lines = {line["id"]: line for line in map(json.loads, text.splitlines())}
    assert status == 200 and lines["a"]["success"] and not lines["b"]["success"], text
    assert lines["b"]["status_code"] == 400 and "field 'input_ids[0]'" in lines["b"]["error"], text
    assert "below 256" in lines["b"]["error"] and await _sequences(m) == 2  # b was never placed


@pytest.mark.slow
async def test_the_configured_vocabulary_bounds_ids_the_instance_would_take(
        start_manager: Any, start_engines: Any) -> None:
    m = await start_manager(engine_vocab_size=100)
    (engine,) = await start_engines([])
    await m.register(engine)
    params = {"max_new_tokens": 2, "temperature": 0.0}
    # The engine (vocabulary 256) would take 150.
    status, out = await m.post("/generate", {"input_ids": [150], "sampling_params": params})
    assert status == 400 and "field 'input_ids[0]'" in out["error"] and "below 100" in out["error"], out
    assert await _sequences(m) == 0
    status, out = await m.post("/generate", {"input_ids": [99], "sampling_params": params})
    assert status == 200, out
