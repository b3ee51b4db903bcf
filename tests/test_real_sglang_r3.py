"""Routed-expert replay (R3) through the manager on real SGLang 0.5.23 (CPU), with the tiny Qwen3-MoE.

Two boxes with ``--enable-return-routed-experts`` behind one manager, and a box without it behind another,
all started through scripts/launch_sglang.sh at once. What the manager promises, shown against SGLang itself:

- a greedy request (single, batched, streamed, an NDJSON batch) gets through the manager the tokens and the
  ``meta_info.routed_experts`` SGLang gives it directly (compared as a set of experts per position and layer:
  SGLang's order within a row is its top-k kernel's);
- a sequence whose box is SIGKILLed mid-generation continues on the other box with the tokens of an
  uninterrupted run, and experts for every position: those of the tokens made before the kill from the second
  box's prefill (the first box died before its final output, which alone carries rows), the rest from its
  decode;
- behind a manager whose only box runs without the flag, a request for experts is refused with a 400 naming
  ``return_routed_experts`` (the manager read ``enable_return_routed_experts: false`` from ``/server_info``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from real_sglang import Daemon, RealBox, call, make_tiny_moe, start_boxes, start_manager
from support import async_wait_until
from test_real_sglang_moe import experts, greedy

pytestmark = [pytest.mark.real_sglang, pytest.mark.slow]

R3_FLAG = "--enable-return-routed-experts"
# Three boxes start at once. On CPU SGLang budgets its KV cache from the machine's free memory before and after
# its own load, so the other starts' loads count against it and 0.05 (CPU_FLAGS) can leave "no memory for the
# KV cache"; the pool stays capped by CPU_FLAGS' --max-total-tokens, so a larger fraction allocates no more.
MEMORY = ("--mem-fraction-static", "0.3")
# Fast failure detection, so the continuation starts within seconds of the kill.
FAST = {"health_check_interval_s": "0.5", "health_check_timeout_s": "5", "health_failure_threshold": "2"}
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], [20, 21, 22, 23, 24, 25, 26]]
LONG = 300  # tokens of the sequence whose box is killed (well past the kill at KILL_AT)
KILL_AT = 20


@dataclass
class Fleet:
    manager: Daemon  # boxes a and b, both with the flag
    boxes: list[RealBox]
    plain_manager: Daemon  # one box without it
    plain: RealBox


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    model = make_tiny_moe(tmp_path_factory.getbasetemp() / "real_sglang_moe")
    log_dir = tmp_path_factory.mktemp("real_sglang_r3")
    managers = [start_manager(log_dir, **FAST)]
    boxes: list[RealBox] = []
    try:
        managers.append(start_manager(log_dir))
        with ThreadPoolExecutor(2) as pool:  # the three SGLang starts overlap
            starts = [pool.submit(start_boxes, model, managers[0].url, log_dir, ["a", "b"], R3_FLAG, *MEMORY),
                      pool.submit(start_boxes, model, managers[1].url, log_dir, ["plain"], *MEMORY)]
        failed = [f.exception() for f in starts if f.exception() is not None]
        boxes = [b for f in starts if f.exception() is None for b in f.result()]
        if failed:
            raise failed[0]
        yield Fleet(managers[0], boxes[:2], managers[1], boxes[2])
    finally:
        for box in boxes:
            box.stop()
        for manager in managers:
            manager.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
        yield s


# ------------------------------------------------------------------ requests and comparisons


def r3_body(input_ids: Any, n: int, **extra: Any) -> dict[str, Any]:
    return {"input_ids": input_ids, "sampling_params": greedy(n), "return_routed_experts": True, **extra}


async def generate(s: aiohttp.ClientSession, url: str, body: Any) -> Any:
    status, out = await call(s, url, "/generate", body)
    assert status == 200, out
    return out


async def stream(s: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A streaming /generate's chunks (``[DONE]`` dropped)."""
    chunks = []
    async with s.post(url + "/generate", json={**body, "stream": True}) as r:
        assert r.status == 200, await r.text()
        async for raw in r.content:
            line = raw.decode().strip()
            if line.startswith("data: {"):
                chunks.append(json.loads(line[len("data: "):]))
    return chunks


async def instances(s: aiohttp.ClientSession, manager: Daemon) -> list[dict[str, Any]]:
    async with s.get(manager.url + "/get_instances_status") as r:
        listed: list[dict[str, Any]] = (await r.json())["instances"]
        return listed


def row_sets(meta: dict[str, Any]) -> list[list[frozenset[int]]]:
    """``meta_info.routed_experts`` as, per position, the set of experts of each layer."""
    return [[frozenset(layer) for layer in row] for row in experts(meta).tolist()]


def assert_same(via: Any, direct: Any) -> None:
    """One answer (or a batch's list of them) through the manager equal to SGLang's own: tokens and experts."""
    if isinstance(direct, list):
        assert isinstance(via, list) and len(via) == len(direct)
        for got, want in zip(via, direct):
            assert_same(got, want)
        return
    assert via["output_ids"] == direct["output_ids"]
    meta, own = via["meta_info"], direct["meta_info"]
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (own["prompt_tokens"], own["completion_tokens"])
    assert row_sets(meta) == row_sets(own)


# ------------------------------------------------------------------ 1. through the manager equals SGLang direct


async def test_single_and_batched_requests_get_sglangs_own_experts(fleet: Fleet, http: aiohttp.ClientSession) -> None:
    box = fleet.boxes[0]
    bodies = [r3_body(PROMPTS[0], 12), r3_body(PROMPTS[2], 12, routed_experts_start_len=4),
              r3_body(PROMPTS, 8, routed_experts_start_len=2)]
    for body in bodies:
        direct = await generate(http, box.url, body)
        assert_same(await generate(http, fleet.manager.url, body), direct)
    single = experts((await generate(http, box.url, bodies[0]))["meta_info"])
    assert single.shape[0] == len(PROMPTS[0]) + 12 - 1


async def test_a_stream_ends_with_sglangs_own_experts(fleet: Fleet, http: aiohttp.ClientSession) -> None:
    body = r3_body(PROMPTS[1], 16, routed_experts_start_len=1)
    direct = await generate(http, fleet.boxes[1].url, body)
    chunks = await stream(http, fleet.manager.url, body)
    assert len(chunks) > 1 and all("routed_experts" not in c["meta_info"] for c in chunks[:-1])
    assert_same(chunks[-1], direct)  # the manager's stream is cumulative: its last chunk is the whole answer
    batched = r3_body(PROMPTS, 6)
    direct_items = await generate(http, fleet.boxes[1].url, batched)
    chunks = await stream(http, fleet.manager.url, batched)
    finals = {c["index"]: c for c in chunks if c["meta_info"].get("finish_reason")}
    assert_same([finals[i] for i in range(len(PROMPTS))], direct_items)


async def test_an_ndjson_batch_gets_sglangs_own_experts(fleet: Fleet, http: aiohttp.ClientSession) -> None:
    items = [["one", r3_body(PROMPTS[0], 10, routed_experts_start_len=5)], ["many", r3_body(PROMPTS, 5)],
             ["none", {"input_ids": PROMPTS[1], "sampling_params": greedy(5)}]]
    async with http.post(fleet.manager.url + "/batch_generate_requests", json=items) as r:
        assert r.status == 200, await r.text()
        lines = {(line := json.loads(raw))["id"]: line async for raw in r.content if raw.strip()}
    assert set(lines) == {"one", "many", "none"} and all(line["success"] for line in lines.values()), lines
    for rid, body in items:
        direct = await generate(http, fleet.boxes[0].url, body)
        if rid == "none":
            assert "routed_experts" not in lines[rid]["data"]["meta_info"]
            assert lines[rid]["data"]["output_ids"] == direct["output_ids"]
        else:
            assert_same(lines[rid]["data"], direct)


# ------------------------------------------------------------------ 3. a box that does not capture experts


async def test_a_box_without_the_flag_refuses_a_request_for_experts(fleet: Fleet,
                                                                    http: aiohttp.ClientSession) -> None:
    assert [i["routed_experts"] for i in await instances(http, fleet.plain_manager)] == [False]
    assert [i["routed_experts"] for i in await instances(http, fleet.manager)] == [True, True]
    status, refused = await call(http, fleet.plain_manager.url, "/generate", r3_body(PROMPTS[0], 4))
    assert status == 400 and "return_routed_experts" in json.dumps(refused), refused
    async with http.post(fleet.plain_manager.url + "/generate", json={**r3_body(PROMPTS[0], 4), "stream": True}) as r:
        text = await r.text()
        assert r.status == 400 and "return_routed_experts" in text, text
    async with http.post(fleet.plain_manager.url + "/batch_generate_requests",
                         json=[["x", r3_body(PROMPTS[0], 4)]]) as r:
        line = json.loads(await r.text())
    assert (line["success"], line["status_code"]) == (False, 400) and "return_routed_experts" in line["error"]
    out = await generate(http, fleet.plain_manager.url, {"input_ids": PROMPTS[0], "sampling_params": greedy(4)})
    direct = await generate(http, fleet.plain.url, r3_body(PROMPTS[0], 4))  # SGLang: served as if not asked
    assert out["output_ids"] == direct["output_ids"] and "routed_experts" not in direct["meta_info"]


# ------------------------------------------------------------------ 2. across a SIGKILL (kills box a or b: last)

KILL_PROMPT = [9, 10, 11, 12]


async def test_sglangs_prefill_routes_each_token_as_its_decode_did(fleet: Fleet, http: aiohttp.ClientSession) -> None:
    """What makes a continuation's experts exact on this engine: a sequence sent again as prompt plus its first
    ``k`` tokens (cache flushed, so they are prefilled in one forward, not decoded one by one) gets, for every
    position, the experts the uninterrupted run chose, and then the same tokens and experts."""
    box = fleet.boxes[0]
    whole = await generate(http, box.url, r3_body(KILL_PROMPT, LONG))
    ids, want = whole["output_ids"], row_sets(whole["meta_info"])
    for k in (1, 37, 150, LONG - 2):
        assert (await call(http, box.url, "/flush_cache", {}))[0] == 200
        again = await generate(http, box.url, r3_body(KILL_PROMPT + ids[:k], LONG - k))
        assert again["output_ids"] == ids[k:]
        got = row_sets(again["meta_info"])
        differ = [p for p, (a, b) in enumerate(zip(got, want)) if a != b]
        assert len(got) == len(want) and not differ, f"prefilled {k} tokens: positions {differ} differ"


async def test_experts_across_a_sigkill_continuation(fleet: Fleet, http: aiohttp.ClientSession) -> None:
    prompt = KILL_PROMPT
    body = r3_body(prompt, LONG)
    refs = [await generate(http, box.url, body) for box in fleet.boxes]
    assert refs[0]["output_ids"] == refs[1]["output_ids"] and row_sets(refs[0]["meta_info"]) == row_sets(
        refs[1]["meta_info"])  # the boxes agree: either is the uninterrupted run
    reference, want = refs[0]["output_ids"], row_sets(refs[0]["meta_info"])
    for box in fleet.boxes:  # no prefix of this sequence cached: the survivor computes its prefill
        assert (await call(http, box.url, "/flush_cache", {}))[0] == 200

    received = asyncio.Event()
    final: dict[str, Any] = {}

    async def consume() -> None:
        async with http.post(fleet.manager.url + "/generate", json={**body, "stream": True}) as r:
            assert r.status == 200
            async for raw in r.content:
                line = raw.decode().strip()
                if line.startswith("data: {"):
                    chunk = json.loads(line[len("data: "):])
                    assert "error" not in chunk, chunk
                    final.clear()
                    final.update(chunk)
                    if len(chunk["output_ids"]) >= KILL_AT:
                        received.set()

    task = asyncio.ensure_future(consume())
    await asyncio.wait_for(received.wait(), 120)
    serving = [i["endpoint"] for i in await instances(http, fleet.manager) if i["in_flight"]]
    assert len(serving) == 1, serving
    victim = next(b for b in fleet.boxes if b.endpoint == serving[0])
    survivor = next(b for b in fleet.boxes if b is not victim)
    victim.kill_sglang()
    await asyncio.wait_for(task, 300)

    meta = final["meta_info"]
    segments = meta["segments"]
    assert len(segments) == 2 and segments[0]["endpoint"] == victim.endpoint, segments
    made = segments[0]["end"]  # tokens made on the victim before it died
    assert 0 < made < LONG
    got = row_sets(meta)
    assert final["output_ids"] == reference  # continued on the survivor, token for token
    assert len(got) == len(prompt) + LONG - 1

    # The rows of the prompt and of the victim's tokens come from the survivor's prefill of them: the same
    # prefill sent to it directly (cache flushed again, so it is computed anew) gives the same experts.
    assert (await call(http, survivor.url, "/flush_cache", {}))[0] == 200
    prefill = await generate(http, survivor.url, r3_body(prompt + reference[:made], 1))
    assert got[:len(prompt) + made] == row_sets(prefill["meta_info"])

    differ = [p for p, (a, b) in enumerate(zip(got, want)) if a != b]
    assert not differ, f"killed after {made} tokens: positions {differ} of {len(got)} differ from an uninterrupted run"

    async def victim_gone() -> bool:
        return all(i["endpoint"] != victim.endpoint or i["state"] != "active"
                   for i in await instances(http, fleet.manager))

    await async_wait_until(victim_gone, 60, message=f"{victim.endpoint} out of service")
