"""Divided rollouts (issue 40, item 2) through a real manager and real CPU engines: a divided sequence equals
the undivided one token for token (greedy and seeded; streamed, batched, with a box dying mid-piece), and a
real stop that falls on a piece's last token ends it there."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from support import async_wait_until

from rollout_manager.cpu_engine.model import build_model, reference_generate
from rollout_manager.sglang import wire
from rollout_manager.sglang.sse import iter_frames

pytestmark = pytest.mark.slow  # every test here starts real processes

# Pieces of 8, 8, 16, 16, ...: a 48-token sequence is made in 4 (8 + 8 + 16 + 16). No length prediction (it
# would make the first piece the predicted median), whatever policy is the default.
PIECES = {"piece_tokens": 8, "piece_min_budget": 16, "piece_max_tokens": 16, "engine_stream_interval": 1,
          "scheduler_policy": "throughput_aware", "length_prediction": "false"}
PROMPT = [3, 1, 4, 1, 5]
GREEDY = {"temperature": 0.0, "max_new_tokens": 48}
SEEDED = {"temperature": 1.0, "top_k": 50, "sampling_seed": 1234, "max_new_tokens": 48}


@pytest.fixture(scope="module")
def model():
    return build_model(0)


async def undivided(engine: Any, m: Any, body: dict[str, Any]) -> dict[str, Any]:
    """The engine's own answer to the whole request (no manager, no pieces)."""
    async with m.session.post(engine.url + wire.GENERATE, json={**body, "stream": False}) as resp:
        assert resp.status == 200
        return await resp.json()


async def counters(m: Any) -> dict[str, float]:
    async with m.session.get(m.url + "/metrics") as r:
        text = await r.text()
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines()
                                     if line.startswith("rollout_manager_") and "{" not in line)}


def assert_exact(out: dict[str, Any], ref: dict[str, Any]) -> None:
    assert out["output_ids"] == ref["output_ids"]
    meta, want = out["meta_info"], ref["meta_info"]
    assert meta["finish_reason"] == want["finish_reason"]
    assert (meta["completion_tokens"], meta["prompt_tokens"]) == (want["completion_tokens"], want["prompt_tokens"])
    if "output_token_logprobs" in want:
        assert [lp[1] for lp in meta["output_token_logprobs"]] == out["output_ids"]
        assert [lp[0] for lp in meta["output_token_logprobs"]] == \
            pytest.approx([lp[0] for lp in want["output_token_logprobs"]], abs=1e-5)
    segs = meta["segments"]
    assert segs[0]["start"] == 0 and segs[-1]["end"] == len(out["output_ids"])
    assert all(a["end"] == b["start"] for a, b in zip(segs, segs[1:]))  # none made twice


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
async def test_a_divided_sequence_equals_the_undivided_one(start_manager, start_engines, sampling):
    m = await start_manager(**PIECES)
    (engine,) = await start_engines([])
    await m.register(engine)
    body = {"input_ids": PROMPT, "sampling_params": sampling, "return_logprob": True}
    ref = await undivided(engine, m, body)
    status, out = await m.post("/generate", body)
    assert status == 200, out
    assert_exact(out, ref)
    assert [(s["endpoint"], s["outcome"]) for s in out["meta_info"]["segments"]] == [(engine.endpoint, "finished")]
    c = await counters(m)
    assert (c["rollout_manager_pieces_total"], c["rollout_manager_continuations_total"]) == (3, 0)
    assert c["rollout_manager_migrated_sequences_total"] == c["rollout_manager_failed_sequences_total"] == 0


async def test_streamed_and_batched_divided_sequences_equal_the_undivided_ones(start_manager, start_engines):
    m = await start_manager(**PIECES)
    (engine,) = await start_engines([])
    await m.register(engine)
    prompts = [[8, 9], [10], [2, 7, 1]]
    params = [{**SEEDED, "sampling_seed": 10 + i} for i in range(3)]
    refs = [await undivided(engine, m, {"input_ids": p, "sampling_params": s}) for p, s in zip(prompts, params)]
    status, outs = await m.post("/generate", {"input_ids": prompts, "sampling_params": params})
    assert status == 200, outs
    for out, ref in zip(outs, refs):
        assert_exact(out, ref)
    raw = []
    async with m.session.post(m.url + "/generate", json={"input_ids": prompts, "sampling_params": params,
                                                         "stream": True}) as resp:
        async for data in resp.content.iter_any():
            raw.append(data)
    chunks = iter_frames(raw)
    finals = {c["index"]: c for c in chunks if c["meta_info"]["finish_reason"] is not None}
    for i, ref in enumerate(refs):
        assert_exact(finals[i], ref)
        lengths = [len(c["output_ids"]) for c in chunks if c["index"] == i]
        assert lengths == sorted(lengths)  # one stream that only grows, across every piece boundary
        assert all(c["output_ids"] == ref["output_ids"][:len(c["output_ids"])] for c in chunks if c["index"] == i)
    assert (await counters(m))["rollout_manager_pieces_total"] == 2 * 3 * 3


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
async def test_a_box_dying_mid_piece_continues_exactly(start_manager, start_engines, sampling):
    m = await start_manager(**PIECES)
    # dies after 12 tokens: in the second piece (tokens 8..16)
    dying, healthy = await start_engines(["--die-after-tokens", "12", "--token-delay-s", "0.005"], [])
    await m.register(dying)
    body = {"input_ids": PROMPT, "sampling_params": sampling, "return_logprob": True}
    ref = await undivided(healthy, m, body)
    req = asyncio.ensure_future(m.post("/generate", body))
    await async_wait_until(lambda: dying.proc.popen.poll() is not None, message="the dying engine to die")
    await m.register(healthy)
    status, out = await req
    assert status == 200, out
    assert_exact(out, ref)
    segs = out["meta_info"]["segments"]
    assert [s["endpoint"] for s in segs] == [dying.endpoint, healthy.endpoint]
    assert 11 <= segs[0]["end"] <= 12 and segs[0]["outcome"].startswith("failed")  # one segment for both pieces
    c = await counters(m)
    assert c["rollout_manager_continuations_total"] == 1 and c["rollout_manager_pieces_total"] >= 2


async def test_a_stop_on_a_pieces_last_token_ends_the_sequence(start_manager, start_engines, model):
    prompt = [11, 12]
    ids, _ = reference_generate(model, prompt, 48)
    stop = ids[7]  # the first piece's last token, its first time
    assert stop not in ids[:7]
    m = await start_manager(**PIECES)
    (engine,) = await start_engines([])
    await m.register(engine)
    body = {"input_ids": prompt, "sampling_params": {**GREEDY, "stop_token_ids": [stop]}}
    ref = await undivided(engine, m, body)
    assert ref["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    status, out = await m.post("/generate", body)
    assert status == 200, out
    assert_exact(out, ref)
    assert out["output_ids"] == ids[:8] and (await counters(m))["rollout_manager_pieces_total"] == 0
