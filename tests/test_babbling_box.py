"""A box that answers ``/generate`` with 200 and then bytes that never make a frame, on every path a request
can take through the manager (streaming, the fast lane with a streamed or a one-shot call to the box, an
NDJSON batch): every request is answered by the good box, exactly, the babbling box fails on its own
bound, and the manager's memory stays within that bound and one frame, not one frame bound per sequence.

Real processes: the manager, a CPU engine (the good box) and ``benchmarks/misbehaving_sglang.py --mode
endless`` in front of it (its health checks and ``/server_info`` pass through, so it registers as healthy).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from support import PY, Proc, async_wait_until, free_port, rss_mb, wait_http_ok

pytestmark = pytest.mark.slow

SEQUENCES = 40  # about half go to the babbling box: unbounded, 20 frame bounds (16 MB) held at once
BOX_BUFFER_MB = 32  # engine_max_instance_buffer_mb for these runs
# The manager may grow by the box's bound, one frame past it (the call that reads on: 32 + 16 MB measured at
# the peak) and its own working set (about 100 MB of RSS here), not by 20 frame bounds (320 MB) on top of that.
GROWTH_BOUND_MB = 230


class Fleet:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[Proc] = []

    async def start(self) -> None:
        good, bad, mgr = free_port(), free_port(), free_port()
        self.good = f"http://127.0.0.1:{good}"
        self.bad_port = bad
        self.manager = f"http://127.0.0.1:{mgr}"
        self.procs.append(Proc([PY, "-m", "rollout_manager.cpu_engine", "--port", str(good), "--seed", "0"],
                               self.tmp / "good.log"))
        self.procs.append(Proc([PY, "benchmarks/misbehaving_sglang.py", "--port", str(bad), "--upstream", self.good,
                                "--mode", "endless", "--endless-kbps", "100000"], self.tmp / "bad.log"))
        self.mgr = Proc([PY, "-m", "rollout_manager", "serve", "--bind", f"127.0.0.1:{mgr}",
                         "--set", "pending_poll_interval_s=0.1", "--set", "health_check_interval_s=0.5",
                         "--set", f"engine_max_instance_buffer_mb={BOX_BUFFER_MB}",
                         "--set", "health_failure_threshold=1000"],  # the box stays: every sequence meets it
                        self.tmp / "manager.log")
        self.procs.append(self.mgr)
        await wait_http_ok(self.good + "/health", self.procs[0])
        await wait_http_ok(self.manager + "/health", self.mgr)
        async with aiohttp.ClientSession() as s:
            for port in (good, bad):
                async with s.post(self.manager + "/register_rollout_instance",
                                  json={"host": "127.0.0.1", "port": port}) as r:
                    assert r.status == 200, await r.text()

            async def active() -> bool:
                listed = await self.instances(s)
                return len(listed) == 2 and all(i["state"] == "active" for i in listed)

            await async_wait_until(active, 30, message="both boxes active")

    async def instances(self, s: aiohttp.ClientSession) -> list[dict[str, Any]]:
        async with s.get(self.manager + "/get_instances_status") as r:
            return list((await r.json())["instances"])

    def stop(self) -> None:
        for p in self.procs:
            p.stop()


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[Fleet]:
    f = Fleet(tmp_path)
    try:
        await f.start()
        yield f
    finally:
        f.stop()


def body(i: int, n: int, stream: bool) -> dict[str, Any]:
    return {"input_ids": [5, 6, 7 + i], "stream": stream,
            "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}


async def send(s: aiohttp.ClientSession, url: str, path: str, n: int) -> list[list[int]]:
    """Every sequence through the manager by ``path``; each one's output ids, in order."""
    if path == "batch":
        items = [[i, body(i, n, False)] for i in range(SEQUENCES)]
        out: dict[int, list[int]] = {}
        async with s.post(url + "/batch_generate_requests", json=items) as r:
            assert r.status == 200, await r.text()
            async for line in r.content:
                item = json.loads(line)
                assert item["success"], item
                out[item["id"]] = item["data"]["output_ids"]
        return [out[i] for i in range(SEQUENCES)]

    async def one(i: int) -> list[int]:
        stream = path == "stream"
        async with s.post(url + "/generate", json=body(i, n, stream)) as r:
            text = await r.text()
            assert r.status == 200, text
        if not stream:
            return list(json.loads(text)["output_ids"])
        frames = [json.loads(f[len("data: "):]) for f in text.split("\n\n") if f.startswith("data: {")]
        return list(frames[-1]["output_ids"])  # SGLang's cumulative stream: the last frame holds them all

    return list(await asyncio.gather(*(one(i) for i in range(SEQUENCES))))


@pytest.mark.parametrize(("path", "tokens"), [
    ("stream", 100),  # SSE to the caller, a stream from the box
    ("lane", 100),  # non-streaming: the fast lane, a stream from the box (past engine_stream_interval)
    ("lane", 16),  # the fast lane, one non-streaming (coalesced) call to the box
    ("batch", 100),  # one NDJSON batch
])
async def test_a_box_that_never_frames_fails_on_its_bound_and_the_manager_stays_flat(
        fleet: Fleet, path: str, tokens: int) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        expected = [(await (await s.post(fleet.good + "/generate", json=body(i, tokens, False))).json())["output_ids"]
                    for i in range(SEQUENCES)]
        before = rss_mb(fleet.mgr.pid)
        peak = before
        task = asyncio.ensure_future(send(s, fleet.manager, path, tokens))
        while not task.done():
            peak = max(peak, rss_mb(fleet.mgr.pid))
            await asyncio.wait([task], timeout=0.05)
        got = task.result()
        assert got == expected  # every request answered, exactly, by the good box
        listed = {i["endpoint"]: i for i in await fleet.instances(s)}
        assert listed[f"127.0.0.1:{fleet.bad_port}"]["failures_total"] > 0
    log = fleet.mgr.log()  # the bound it failed on: its own frame (or answer), never the manager's limit
    assert "(engine_max_frame_mb)" in log and "(engine_max_instance_buffer_mb)" not in log
    assert peak - before < GROWTH_BOUND_MB, f"the manager grew {peak - before:.0f} MB (from {before:.0f} MB)"
