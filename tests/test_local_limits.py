"""The manager's own limits are never an instance's failure, and the daemon raises its open-file limit."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from support import PY, Proc, wait_http_ok

from rollout_manager.osutil import free_port
from rollout_manager.sglang import wire
from rollout_manager.sglang.client import CallBounds, Probe, stream_generate
from rollout_manager.sglang.generate_request import SequenceBody
from rollout_manager.sglang.local_limits import LocalLimits, LoopWatch, local_resource_error

FAST = {"pending_poll_interval_s": 0.05, "health_check_interval_s": 0.2, "health_failure_threshold": 2}
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="open-file limits as on Linux")


def test_descriptor_exhaustion_behind_aiohttp_is_recognised_as_the_managers_own() -> None:
    emfile = OSError(errno.EMFILE, "Too many open files")
    conn_key = aiohttp.client_reqrep.ConnectionKey("127.0.0.1", 1, False, True, None, None, None)
    wrapped = aiohttp.ClientConnectorError(conn_key, emfile)
    found = local_resource_error(wrapped)
    assert found is not None and found.errno == errno.EMFILE
    refused = aiohttp.ClientConnectorError(conn_key, ConnectionRefusedError(errno.ECONNREFUSED, "refused"))
    assert local_resource_error(refused) is None  # the instance's problem, not the manager's
    assert not Probe(None, "x", local=True).failed and not Probe(None, "x", local=True).ready
    assert Probe(None, "refused").failed


def _start_limited_manager(tmp_path: Path, soft: int, hard: int) -> tuple[Proc, str]:
    """The daemon as a child whose open-file limit is set before Python starts."""
    port = free_port()
    args = ["prlimit", f"--nofile={soft}:{hard}", PY, "-m", "rollout_manager", "serve",
            "--bind", f"127.0.0.1:{port}"]
    # Admission past what the limit allows (its default stays below it), so that the limit itself is hit.
    for key, value in {**FAST, "max_in_flight_total": "1000"}.items():
        args += ["--set", f"{key}={value}"]
    return Proc(args, tmp_path / "manager.log"), f"http://127.0.0.1:{port}"


async def _status(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(url + "/get_instances_status") as resp:
        data: dict[str, Any] = await resp.json()
        return data


@pytest.mark.slow
async def test_the_daemon_raises_its_soft_open_file_limit_to_the_hard_one(tmp_path: Path) -> None:
    proc, url = _start_limited_manager(tmp_path, 256, 4096)
    try:
        await wait_http_ok(url + "/health", proc)
        async with aiohttp.ClientSession() as session:
            limit = (await _status(session, url))["manager"]["open_file_limit"]
        assert limit == {"soft": 4096, "hard": 4096}
        assert "open-file limit: soft 256 -> 4096 (hard 4096)" in proc.log()
        # The collector is set up for serving too (osutil.tune_gc): start-up objects frozen.
        assert re.search(r"garbage collector: [1-9]\d* objects frozen at start, thresholds \(10000, ", proc.log())
    finally:
        proc.stop()


@pytest.mark.slow
def test_tune_gc_freezes_and_raises_the_young_threshold_and_0_leaves_python_alone() -> None:
    """In a child: the collector's settings are the process's, not this test's to change."""
    code = ("import gc; from rollout_manager.osutil import tune_gc; before = gc.get_threshold(); "
            "print(tune_gc(0)); assert gc.get_threshold() == before and gc.get_freeze_count() == 0; "
            "print(tune_gc(5000)); assert gc.get_threshold() == (5000, *before[1:]) and gc.get_freeze_count() > 1000; "
            "gc.collect(); assert gc.get_freeze_count() > 1000")
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "Python's defaults" in out.stdout and "objects frozen at start" in out.stdout


@pytest.mark.slow
async def test_out_of_descriptors_sequences_wait_in_the_manager_and_no_instance_is_blamed(
        tmp_path: Path, start_engines: Any) -> None:
    """Soft and hard limit 48 (an idle manager holds ~16): 120 sequences in flight cannot all have a
    connection. They wait in the manager, all finish with the engines' exact tokens, and both
    instances stay active with no failure counted."""
    engines = await start_engines(["--token-delay-s", "0.01"], ["--token-delay-s", "0.01"])
    proc, url = _start_limited_manager(tmp_path, 48, 48)
    try:
        await wait_http_ok(url + "/health", proc)
        async with aiohttp.ClientSession() as session:
            for e in engines:
                async with session.post(url + "/register_rollout_instance",
                                        json={"host": "127.0.0.1", "port": e.port}) as resp:
                    assert resp.status == 200, await resp.text()
            prompts = [[1 + i % 50, 2, 3 + i % 7] for i in range(120)]
            # Past the manager's chunk interval (64): each sequence streams on its own connection (shorter
            # ones that start together share one call per instance, and would need far fewer).
            params = {"max_new_tokens": 72, "temperature": 0.0}
            # What each prompt gives on an engine directly (greedy: the same on every instance).
            expected = {}
            for i in range(0, 120, 24):
                async with session.post(engines[0].url + "/generate",
                                        json={"input_ids": prompts[i], "sampling_params": params}) as resp:
                    expected[i] = (await resp.json())["output_ids"]
            body = [[i, {"input_ids": p, "sampling_params": params}] for i, p in enumerate(prompts)]
            lines: dict[int, Any] = {}
            async with session.post(url + "/batch_generate_requests", json=body,
                                    timeout=aiohttp.ClientTimeout(total=120)) as resp:
                assert resp.status == 200
                async for raw in resp.content:
                    if raw.strip():
                        line = json.loads(raw)
                        lines[line["id"]] = line
            status = await _status(session, url)
        assert len(lines) == 120 and all(line["success"] for line in lines.values()), \
            [line for line in lines.values() if not line["success"]][:3]
        for i, ids in expected.items():
            assert lines[i]["data"]["output_ids"] == ids
        assert status["manager"]["local_limit_events"] > 0  # the limit was really hit
        assert [(i["state"], i["consecutive_failures"]) for i in status["instances"]] == [("active", 0)] * 2
        assert "removed" not in proc.log() and "consecutive failures" not in proc.log()
    finally:
        proc.stop()


async def test_a_blocked_event_loop_is_measured_and_its_timeouts_are_the_managers_own() -> None:
    """A timeout that ran out while the manager's own loop was blocked (thousands of sequences placed
    at once) is not the instance's; one that ran out on a responsive loop still is."""
    limits = LocalLimits()
    limits.loop.ensure_started()
    loop = asyncio.get_running_loop()
    started = loop.time()
    time.sleep(0.6)  # the loop is blocked: no timer runs
    assert limits.loop.blocked_s(started) >= 0.6 - LoopWatch.TICK_S - 0.05  # lateness past the next tick
    assert limits.timed_out_locally(started, 0.5)
    started = loop.time()
    await asyncio.sleep(0.6)  # the measured interval itself, on a responsive loop
    assert limits.loop.blocked_s(started) < 0.1
    assert not limits.timed_out_locally(started, 0.5)
    # The block is kept for status and metrics once the watch ran again (one block so far).
    shown = limits.to_dict()
    assert 0.6 - LoopWatch.TICK_S - 0.05 <= shown["event_loop_longest_block_s"] <= shown["event_loop_blocked_s"] < 1.0


async def test_a_long_block_is_logged_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    """Operators see the manager's own stalls: a block of a second or more is logged, the next one
    within LOG_EVERY_S only counted."""
    watch = LoopWatch()
    watch.WARN_LAG_S = 0.2  # shorter than the default second, to keep the test short
    watch.ensure_started()
    await asyncio.sleep(0)  # the watch's first tick is due
    with caplog.at_level(logging.WARNING, logger="rollout_manager.local_limits"):
        for _ in range(2):
            time.sleep(watch.WARN_LAG_S + 2 * LoopWatch.TICK_S)  # late by at least WARN_LAG_S + TICK_S
            due = watch.total_s
            deadline = asyncio.get_running_loop().time() + 5
            while watch.total_s == due and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.01)
    warnings = [r.getMessage() for r in caplog.records if "event loop was blocked" in r.getMessage()]
    assert len(warnings) == 1 and watch.longest_s >= watch.WARN_LAG_S
    assert watch.total_s >= 2 * watch.WARN_LAG_S


async def test_a_connect_timed_out_by_a_blocked_loop_is_retried_and_not_blamed() -> None:
    """The kernel completes the connection at once, but the manager's loop is blocked past the connect
    timeout, so by the loop's clock the connect timed out: the request goes out again and succeeds."""
    async def generate(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"text":null,"output_ids":[7],"meta_info":{"id":"r","finish_reason":'
                         b'{"type":"length","length":1},"prompt_tokens":1,"completion_tokens":1}}\n\n')
        await resp.write(wire.DONE_FRAME)
        return resp

    app = web.Application()
    app.router.add_post(wire.GENERATE, generate)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    limits = LocalLimits()
    try:
        async with aiohttp.ClientSession() as session:
            loop = asyncio.get_running_loop()
            loop.call_soon(time.sleep, 1.0)  # blocks the loop once the connect has started
            chunks = [c async for c in stream_generate(
                session, f"http://127.0.0.1:{port}", SequenceBody.of({"input_ids": [1]}),
                CallBounds(connect_timeout_s=0.3, stall_timeout_s=5.0, limits=limits))]
    finally:
        await runner.cleanup()
    assert [c.ids for c in chunks] == [[7]]
    assert limits.events == 1 and "event loop was blocked" in (limits.last_error or "")
