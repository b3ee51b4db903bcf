"""Evacuation on real SGLang 0.5.23 (CPU): two boxes started through scripts/launch_sglang.sh; a preemption notice
for the box running a long greedy sequence moves it at once (aborted there at its last token, SGLang's abort answer
carrying what it made since its last chunk) to the other box, where it continues token for token equal to an
uninterrupted run, and the tokens made twice (what the doomed box decoded, by SGLang's own count, beyond what the
answer kept from it) are counted and printed; the box is removed at its deadline."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from real_sglang import Daemon, start_boxes, start_manager
from support import async_wait_until

pytestmark = [pytest.mark.real_sglang, pytest.mark.slow]

# Nothing stays (a real CPU box would finish the tiny model's sequence within the notice): the move is the test.
# Health checks and trust probes that decode nothing, so a box's generated-token count is the sequence's alone.
SETTINGS = {"evacuation_stay_share": "0", "engine_stream_interval": "8", "health_check_path": "/health",
            "trust_probe_interval_s": "0"}


@pytest.fixture(scope="module")
def fleet(real_sglang_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    log_dir = tmp_path_factory.mktemp("evacuation")
    manager = start_manager(log_dir, **SETTINGS)
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


async def post(s: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with s.post(url + path, json=body) as r:
        return r.status, json.loads(await r.text())


async def decoded(s: aiohttp.ClientSession, url: str) -> int:
    """Tokens SGLang generated for requests it finished or aborted (its sglang:generation_tokens_total)."""
    async with s.get(url + "/metrics") as r:
        text = await r.text()
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("sglang:generation_tokens_total")))


async def instances(s: aiohttp.ClientSession, manager: Daemon) -> list[dict[str, Any]]:
    async with s.get(manager.url + "/get_instances_status") as r:
        return (await r.json())["instances"]


async def test_a_notice_moves_the_sequence_exactly_and_the_box_goes_at_its_deadline(
        fleet: Any, http: aiohttp.ClientSession) -> None:
    manager, boxes = fleet
    prompt, n = [9, 10, 11, 12], 600
    status, own = await post(http, boxes[1].url, "/generate", {"input_ids": prompt, "sampling_params": greedy(n)})
    assert status == 200, own
    reference = own["output_ids"]
    before = {b.url: await decoded(http, b.url) for b in boxes}

    first_tokens = asyncio.Event()
    received = 0
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
                received = len(chunk["output_ids"])
                final.update(chunk)
                if received >= 20:
                    first_tokens.set()

    task = asyncio.ensure_future(consume())
    await asyncio.wait_for(first_tokens.wait(), 120)
    serving = [i["endpoint"] for i in await instances(http, manager) if i["in_flight"]]
    assert len(serving) == 1, serving
    victim = next(b for b in boxes if b.endpoint == serving[0])
    other = next(b for b in boxes if b is not victim)
    status, out = await post(http, manager.url, "/evacuate_instance",
                             {"endpoint": victim.url, "deadline_s": 30, "source": "gce"})
    noticed_at = received
    assert status == 200 and out["state"] == "evacuating" and out["staying"] == 0, out
    await asyncio.wait_for(task, 300)

    assert noticed_at < n, "the sequence finished before the notice"
    assert final["output_ids"] == reference  # continued on the other box, token for token
    first, second = final["meta_info"]["segments"]
    assert first["endpoint"] == victim.endpoint and first["outcome"].startswith(f"migrated to {other.endpoint}")
    assert "gce notice" in first["outcome"]
    assert second["endpoint"] == other.endpoint and first["end"] == second["start"] and second["end"] == n
    print(f"\nreal SGLang: notice after {noticed_at} streamed token(s); the doomed box's segment ends at "
          f"{first['end']} (its abort answer carried {first['end'] - noticed_at} more)")
    assert first["end"] >= noticed_at

    async def counted() -> bool:  # SGLang counts the aborted request once its abort is handled
        return await decoded(http, victim.url) - before[victim.url] >= first["end"]

    await async_wait_until(counted, 30, message="the doomed box's count of the aborted request")
    twice = await decoded(http, victim.url) - before[victim.url] - first["end"]
    print(f"real SGLang with a 30 s notice: tokens made twice {twice} of {n} (the doomed box decoded "
          f"{first['end'] + twice}, the answer kept {first['end']} of them)")
    assert 0 <= twice <= 8  # at most the decode steps the abort raced, never a chunk's worth more

    status, sooner = await post(http, manager.url, "/evacuate_instance", {"endpoint": victim.endpoint,
                                                                          "deadline_s": 0.5})
    assert status == 200 and sooner["deadline_s"] <= 0.5, sooner

    async def victim_gone() -> bool:
        return all(i["endpoint"] != victim.endpoint for i in await instances(http, manager))

    await async_wait_until(victim_gone, 30, message=f"{victim.endpoint} removed")
