"""The product end to end on real SGLang 0.5.23 (CPU): two boxes started through scripts/launch_sglang.sh
register with a manager; rollouts through the manager equal SGLang's own greedy output; a box SIGKILLed in
the middle of a sequence has it continued on the other box, token for token equal to an uninterrupted run."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from real_sglang import Daemon, start_boxes, start_manager
from real_sglang_model import VOCAB
from support import async_wait_until

pytestmark = [pytest.mark.real_sglang, pytest.mark.slow]

# Fast failure detection, so the test sees the continuation within seconds of the kill.
FAST = {"health_check_interval_s": "0.5", "health_check_timeout_s": "5", "health_failure_threshold": "2"}


@pytest.fixture(scope="module")
def fleet(real_sglang_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    log_dir = tmp_path_factory.mktemp("e2e")
    manager = start_manager(log_dir, **FAST)
    try:
        boxes = start_boxes(real_sglang_model, manager.url, log_dir, ["a", "b"])
        try:
            yield manager, boxes
        finally:
            for box in boxes:
                box.stop()
    finally:
        manager.stop()


@pytest.fixture
async def http() -> Any:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
        yield s


def greedy(n: int) -> dict[str, Any]:
    return {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}


async def generate(s: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Any:
    async with s.post(url + "/generate", json=body) as r:
        text = await r.text()
        assert r.status == 200, text
        return json.loads(text)


async def instances(s: aiohttp.ClientSession, manager: Daemon) -> list[dict[str, Any]]:
    async with s.get(manager.url + "/get_instances_status") as r:
        return (await r.json())["instances"]


async def test_both_boxes_registered_through_the_launcher(fleet: Any, http: aiohttp.ClientSession) -> None:
    manager, boxes = fleet
    listed = await instances(http, manager)
    assert {i["endpoint"]: i["state"] for i in listed} == {b.endpoint: "active" for b in boxes}
    # SGLang reports no vocabulary size: the launcher read it from the model's config.json.
    assert [i["vocab_size"] for i in listed] == [VOCAB, VOCAB]
    assert [i["vocab_checked"] for i in listed] == [True, True]  # read from config.json: the probe may use it


async def test_rollouts_through_the_manager_equal_sglangs_own(fleet: Any, http: aiohttp.ClientSession) -> None:
    manager, boxes = fleet
    prompts = [[5, 6, 7 + i] for i in range(8)]
    via = await generate(http, manager.url, {"input_ids": prompts, "sampling_params": greedy(24)})
    for box in boxes:  # the same greedy tokens whichever box made them
        own = await generate(http, box.url, {"input_ids": prompts, "sampling_params": greedy(24)})
        assert [o["output_ids"] for o in via] == [o["output_ids"] for o in own]


async def test_a_sequence_continues_exactly_after_its_box_is_sigkilled(fleet: Any, http: aiohttp.ClientSession) -> None:
    manager, boxes = fleet
    prompt, n = [9, 10, 11, 12], 600
    reference = (await generate(http, boxes[1].url, {"input_ids": prompt, "sampling_params": greedy(n)}))["output_ids"]

    received = 0
    first_tokens = asyncio.Event()
    ids: list[int] = []
    final: dict[str, Any] = {}

    async def consume() -> None:
        nonlocal received
        async with http.post(manager.url + "/generate", json={"input_ids": prompt, "sampling_params": greedy(n),
                                                               "stream": True}) as r:
            assert r.status == 200
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[len("data: "):])
                assert "error" not in chunk, chunk
                ids[:] = chunk["output_ids"]  # the manager's stream is cumulative, as SGLang's default
                received = len(ids)
                final.update(chunk)
                if received >= 20:
                    first_tokens.set()

    task = asyncio.ensure_future(consume())
    await asyncio.wait_for(first_tokens.wait(), 120)
    serving = [i["endpoint"] for i in await instances(http, manager) if i["in_flight"]]
    assert len(serving) == 1, serving
    victim = next(b for b in boxes if b.endpoint == serving[0])
    victim.kill_sglang()
    killed_at = received
    await asyncio.wait_for(task, 300)

    assert killed_at < n, "the sequence finished before the kill"
    assert ids == reference  # continued on the other box, token for token
    segments = final["meta_info"]["segments"]
    assert len(segments) >= 2 and segments[0]["endpoint"] == victim.endpoint
    assert segments[-1]["end"] == n and final["meta_info"]["finish_reason"]["type"] == "length"

    async def victim_gone() -> bool:
        return all(i["endpoint"] != victim.endpoint or i["state"] != "active" for i in await instances(http, manager))

    await async_wait_until(victim_gone, 60, message=f"{victim.endpoint} out of service")
