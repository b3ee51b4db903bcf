"""Divided rollouts (issue 40, item 2) on real SGLang 0.5.23 (CPU): a sequence the manager generates in
pieces, each a request of its own to the box, equals SGLang's own undivided answer token for token, with the
undivided answer's meta_info, and each piece after the first finds the sequence in SGLang's prefix cache."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from real_sglang import Daemon, RealBox, start_box, start_manager
from support import async_wait_until

from rollout_manager.sglang import wire

pytestmark = [pytest.mark.real_sglang, pytest.mark.slow]

# Pieces of 16, 16, 32, 64 and the rest (32) for a 160-token sequence: 4 boundaries.
PIECES = {"piece_tokens": "16", "piece_min_budget": "32", "piece_max_tokens": "64", "engine_stream_interval": "8",
          "scheduler_policy": "throughput_aware", "length_prediction": "false"}  # (no predicted first piece)
N = 160
# Fields of SGLang's final meta_info that say something about the whole request: each the same, divided or not.
WHOLE = ("finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "cached_tokens_details",
         "reasoning_tokens", "num_retractions", "output_token_logprobs_length")
PROMPT = list(range(100, 140))


@pytest.fixture(scope="module")
def fleet(real_sglang_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    log_dir = tmp_path_factory.mktemp("pieces")
    manager = start_manager(log_dir, **PIECES)
    try:
        box = start_box(real_sglang_model, manager.url, log_dir)
        try:
            yield manager, box
        finally:
            box.stop()
    finally:
        manager.stop()


@pytest.fixture
async def http() -> Any:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
        yield s


async def post(s: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Any:
    async with s.post(url + wire.GENERATE, json=body) as r:
        text = await r.text()
        assert r.status == 200, text
        return json.loads(text)


async def cached_prompt(s: aiohttp.ClientSession, box: RealBox) -> None:
    """A prefix cache that holds the prompt and nothing after it, so the divided and the undivided run start
    alike, each with the prompt cached (its cached_tokens then says whether later pieces found theirs). SGLang
    refuses a flush while a request runs, and the manager's trust probe may be running one: polled."""
    async def flushed() -> bool:
        async with s.post(box.url + wire.FLUSH_CACHE) as r:
            assert r.status in (200, 400), await r.text()
            return r.status == 200

    await async_wait_until(flushed, 60.0, interval_s=0.2, message="SGLang to flush its cache")
    await post(s, box.url, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1, "temperature": 0}})


async def stream(s: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    chunks = []
    async with s.post(url + wire.GENERATE, json={**body, "stream": True}) as r:
        assert r.status == 200
        async for raw in r.content:
            line = raw.decode().strip()
            if line.startswith("data: {"):
                chunks.append(json.loads(line[len("data: "):]))
    return chunks


async def pieces_total(s: aiohttp.ClientSession, manager: Daemon) -> float:
    async with s.get(manager.url + "/metrics") as r:
        text = await r.text()
    return float(next(line.rsplit(" ", 1)[1] for line in text.splitlines()
                      if line.startswith("rollout_manager_pieces_total ")))


def assert_same_answer(divided: dict[str, Any], undivided: dict[str, Any]) -> None:
    assert divided["output_ids"] == undivided["output_ids"]
    got, want = divided["meta_info"], undivided["meta_info"]
    assert {k: got.get(k) for k in WHOLE if k in want} == {k: want[k] for k in WHOLE if k in want}
    lps, ref = got["output_token_logprobs"], want["output_token_logprobs"]
    assert [lp[1] for lp in lps] == [lp[1] for lp in ref]
    assert [lp[0] for lp in lps] == pytest.approx([lp[0] for lp in ref], abs=1e-3)


async def test_a_divided_rollout_equals_sglangs_undivided_answer(fleet: Any, http: aiohttp.ClientSession) -> None:
    manager, box = fleet
    body = {"input_ids": PROMPT, "return_logprob": True,
            "sampling_params": {"max_new_tokens": N, "temperature": 0, "ignore_eos": True}}
    before = await pieces_total(http, manager)
    await cached_prompt(http, box)
    divided = await post(http, manager.url, body)
    await cached_prompt(http, box)
    undivided = await post(http, box.url, body)
    assert_same_answer(divided, undivided)
    meta = divided["meta_info"]
    # one box, one version: one segment, as undivided; 4 pieces after the first, each a request of its own
    assert [(s["endpoint"], s["start"], s["end"], s["outcome"]) for s in meta["segments"]] == \
        [(box.endpoint, 0, N, "finished")]
    assert await pieces_total(http, manager) - before == 4
    # every piece after the first found the sequence in the box's prefix cache: no prefill but the token a
    # piece ends on (which an undivided run computes too), so the divided cached_tokens is the undivided one
    assert meta["cached_tokens"] == undivided["meta_info"]["cached_tokens"] > 0

    await cached_prompt(http, box)
    chunks = await stream(http, manager.url, body)
    ids = chunks[-1]["output_ids"]
    assert ids == undivided["output_ids"] and chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(c["output_ids"] == ids[:len(c["output_ids"])] for c in chunks)  # one stream, only growing
    lengths = [len(c["output_ids"]) for c in chunks]
    assert lengths == sorted(lengths) and await pieces_total(http, manager) - before == 8


async def test_a_batch_is_divided_sequence_by_sequence(fleet: Any, http: aiohttp.ClientSession) -> None:
    manager, box = fleet
    prompts = [[5, 6, 7 + i] for i in range(4)]
    body = {"input_ids": prompts, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True}}
    via = await post(http, manager.url, body)
    own = await post(http, box.url, body)
    assert [o["output_ids"] for o in via] == [o["output_ids"] for o in own]
    for o in via:
        segs = o["meta_info"]["segments"]
        assert segs[0]["start"] == 0 and segs[-1]["end"] == 64
        assert all(a["end"] == b["start"] for a, b in zip(segs, segs[1:]))  # none made twice
