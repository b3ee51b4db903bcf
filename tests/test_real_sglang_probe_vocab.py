"""The trust probe never sends real SGLang 0.5.23 an id it has not been shown to take (issue 46, item 1).

SGLang reports no vocabulary size and its scheduler dies on an input id past the embedding table. Two boxes
of a model with 1,024 ids, registered by hand through the HTTP endpoint without ``vocab_size``: the probe
waits (and the status says why) until each box has served ids, then probes below what they served; both
boxes stay alive, are probed and agree, and keep serving.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from real_sglang import SGLangServer, start_manager, start_sglang
from support import async_wait_until

pytestmark = [pytest.mark.real_sglang, pytest.mark.slow]


async def status(s: aiohttp.ClientSession, url: str) -> list[dict[str, Any]]:
    async with s.get(url + "/get_instances_status") as r:
        return list((await r.json())["instances"])


async def test_boxes_registered_without_a_vocabulary_are_probed_only_with_ids_they_served(
        real_sglang_model: Path, tmp_path: Path) -> None:
    manager = start_manager(tmp_path, trust_probe_interval_s="1", health_check_interval_s="0.5")
    with ThreadPoolExecutor(2) as pool:
        boxes: list[SGLangServer] = list(pool.map(lambda n: start_sglang(real_sglang_model, tmp_path, name=n),
                                                  ["a", "b"]))
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
            for box in boxes:  # as a user would, by hand: no vocab_size
                async with s.post(manager.url + "/register_rollout_instance",
                                  json={"host": "127.0.0.1", "port": box.port}) as r:
                    assert r.status == 200, await r.text()

            async def waiting() -> bool:  # active, and the probe says why it sends nothing yet
                listed = await status(s, manager.url)
                return len(listed) == 2 and all(i["state"] == "active" and i["trust"]["waiting"] for i in listed)

            await async_wait_until(waiting, 120, interval_s=0.2, message="both boxes active, their probe waiting")
            assert all(i["trust"]["probes"] == 0 and i["vocab_size"] is None for i in await status(s, manager.url))

            async def served() -> bool:  # rollouts whose prompts reach past the probe's rung of 512
                prompts = [[5, 600 + i, 700 + i] for i in range(8)]
                async with s.post(manager.url + "/generate", json={
                        "input_ids": prompts, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}) as r:
                    assert r.status == 200, await r.text()
                return all(i["ids_served"] >= 512 for i in await status(s, manager.url))

            await async_wait_until(served, 120, interval_s=0.2, message="both boxes serving ids past 512")

            async def probed() -> list[dict[str, Any]] | None:
                listed = await status(s, manager.url)
                ok = all(i["trust"]["probes"] >= 1 and i["trust"]["state"] == "checked" for i in listed)
                return listed if ok else None

            listed = await async_wait_until(probed, 60, interval_s=0.2, message="both boxes probed and checked")
            assert all(i["trust"]["waiting"] is None and i["trust"]["last_probe_error"] is None for i in listed)
            assert [b.proc.popen.poll() for b in boxes] == [None, None]  # both SGLang servers still alive
            async with s.post(manager.url + "/generate", json={
                    "input_ids": [[5, 6, 7], [8, 9, 10]], "sampling_params": {"max_new_tokens": 8}}) as r:
                assert r.status == 200, await r.text()
            assert {i["state"] for i in await status(s, manager.url)} == {"active"}
    finally:
        for box in boxes:
            box.stop()
        manager.stop()
