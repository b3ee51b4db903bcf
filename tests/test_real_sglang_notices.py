"""SIGTERM to scripts/launch_sglang.sh running real SGLang 0.5.23 (CPU): the launcher reports it to the manager as
a preemption notice with its grace period, SGLang keeps serving while the manager moves the box's sequences to the
other box, where they continue token for token equal to an uninterrupted run; the manager removes the box once
nothing runs there (at the latest at its deadline) and the launcher then stops SGLang and the agent and exits 0,
leaving nothing running."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from real_sglang import call, start_boxes, start_manager
from support import alive, async_wait_until, descendants

pytestmark = [pytest.mark.real_sglang, pytest.mark.slow]

GRACE_S = 20
# Nothing stays (a real CPU box would finish the tiny model's sequences within the notice): the move is the test.
SETTINGS = {"evacuation_stay_share": "0", "engine_stream_interval": "8"}
LAUNCHER_FLAGS = ("--preemption-notice", "sigterm", "--sigterm-grace-s", str(GRACE_S))


async def test_sigterm_to_the_launcher_moves_its_sequences_exactly_and_removes_the_box(real_sglang_model: Path,
                                                                                       tmp_path: Path):
    manager = await asyncio.to_thread(start_manager, tmp_path, **SETTINGS)
    boxes: list[Any] = []
    try:
        boxes = await asyncio.to_thread(start_boxes, real_sglang_model, manager.url, tmp_path, ["a", "b"],
                                        launcher_flags=LAUNCHER_FLAGS)
        doomed, other = boxes
        async with aiohttp.ClientSession() as s:
            async def instance(endpoint: str) -> dict[str, Any] | None:
                async with s.get(manager.url + "/get_instances_status") as r:
                    return next((i for i in (await r.json())["instances"] if i["endpoint"] == endpoint), None)

            prompts = [[1 + i, 17, 42, 7] for i in range(4)]
            bodies = [{"input_ids": p, "sampling_params": {"temperature": 0, "max_new_tokens": 160,
                                                           "ignore_eos": True}} for p in prompts]
            reference = await asyncio.gather(*(call(s, manager.url, "/generate", b) for b in bodies))
            assert all(status == 200 for status, _ in reference), reference

            runs = [asyncio.create_task(call(s, manager.url, "/generate", b)) for b in bodies]

            async def running_on_doomed() -> bool:
                inst = await instance(doomed.endpoint)
                return bool(inst and inst["in_flight"])

            await async_wait_until(running_on_doomed, 60, interval_s=0.02, message="sequences on the doomed box")
            below = descendants(doomed.launcher.pid)
            doomed.launcher.signal(signal.SIGTERM)
            seen: list[dict[str, Any]] = []

            async def evacuating() -> bool:
                inst = await instance(doomed.endpoint)
                if inst and inst["state"] == "evacuating":
                    seen.append(inst)
                return bool(seen)

            await async_wait_until(evacuating, 30, interval_s=0.05, message="the box evacuating")
            assert seen[0]["evacuation"]["source"] == "sigterm", seen[0]
            assert 0 < seen[0]["evacuation"]["deadline_in_s"] <= GRACE_S
            # SGLang keeps serving until the manager has moved its work (the moved sequences' aborts answer with
            # the tokens made since their last chunk, below); once the box is empty the manager removes it and the
            # launcher stops SGLang, which can be before this point, so the box itself is not asked here.

            moved = 0
            for (_, want), run in zip(reference, runs):
                status, got = await run
                assert status == 200, got
                assert got["output_ids"] == want["output_ids"]  # exact, across the move
                moved += len({seg["instance"] for seg in got["meta_info"]["segments"]}) > 1
            assert moved, "no sequence moved off the doomed box"

            async def removed() -> bool:
                inst = await instance(doomed.endpoint)
                return inst is None or inst["state"] == "dead"

            await async_wait_until(removed, GRACE_S + 30, interval_s=0.2, message="the box removed")
            assert await asyncio.to_thread(doomed.launcher.wait, 60) == 0, doomed.log()[-4000:]
            assert not [p for p in below if alive(p)], doomed.log()[-4000:]
            assert (await instance(other.endpoint) or {}).get("state") == "active"
    finally:
        manager.stop()  # first: the other box's SIGTERM then finds no manager to wait for and stops at once
        for box in boxes:
            await asyncio.to_thread(box.stop)
