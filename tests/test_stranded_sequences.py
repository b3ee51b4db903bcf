"""A sequence that fails on every instance it could use must end, not wait for ever (issue 28).

One instance, its ``/generate`` answering what the manager rightly refuses, its health probe passing
all along (as an engine whose forward pass works but whose server garbles answers would). The sequence
must end within the no-instance wait with a 503 naming the failures, in a single call and inside a
batch, and every failure must be counted against the instance.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from fakes import FakeProbe, FakeSGLang, register_active
from support import as_json, async_wait_until

from rollout_manager.errors import Unavailable
from rollout_manager.instances.health import HealthMonitor, HealthSettings
from rollout_manager.instances.registry import Instance, Kind, Registry, State
from rollout_manager.instances.version import WeightVersion
from rollout_manager.placement.ask import Ask
from rollout_manager.placement.dispatch import Dispatcher
from rollout_manager.placement.least_in_flight import LeastInFlight
from rollout_manager.placement.local_budget import LocalBudget
from rollout_manager.rollout.batch import run_batch
from rollout_manager.rollout.generation import GenerationFailed, GenerationSettings, Generator
from rollout_manager.rollout.request import decode
from rollout_manager.sglang import client as sgl

PROMPT = [5, 17, 42]
WAIT_S = 0.5
# Probes far more often than the wait: each one passes and clears the instance's failure count.
HEALTH = HealthSettings(startup_grace_period_s=5.0, pending_poll_interval_s=0.01, check_interval_s=0.02,
                        check_timeout_s=1.0, check_path="/health_generate", failure_threshold=1000)
SETTINGS = GenerationSettings(max_attempts=1000, wait_timeout_s=WAIT_S, connect_timeout_s=2.0, stall_timeout_s=5.0,
                              engine_stream_interval=1, first_byte_timeout_s=5.0, max_frame_bytes=64 * 1024)


@dataclass
class Rig:
    generator: Generator
    fake: FakeSGLang
    inst: Instance
    failures: list[str]


@pytest.fixture
async def rig(request: pytest.FixtureRequest) -> AsyncIterator[Rig]:
    """One fake instance (``NotJson`` when the test is parametrized with that name), probed as the
    manager probes: every probe passes."""
    callspec = getattr(request.node, "callspec", None)
    not_json = callspec is not None and callspec.params.get("name") == NOT_JSON
    fake = await (NotJson() if not_json else FakeSGLang()).start()
    session = aiohttp.ClientSession()
    registry = Registry()
    health = HealthMonitor(registry, WeightVersion(), FakeProbe(200), HEALTH)
    failures: list[str] = []

    def failed(inst: Instance, reason: str) -> None:
        failures.append(reason)
        health.report_failure(inst, reason)

    dispatcher = Dispatcher(registry, LeastInFlight())
    health.recovery_listeners.append(dispatcher.recovered)  # as the manager wires them
    generator = Generator(dispatcher, sgl.SGLangClient(session), SETTINGS,
                          LocalBudget(0.0, 0.0, 1.0), on_instance_failure=failed,
                          on_instance_success=health.report_success)
    (inst,) = register_active(registry, [fake])
    try:
        yield Rig(generator, fake, inst, failures)
    finally:
        await health.close()
        await fake.close()
        await session.close()


def backwards(c: dict[str, Any], k: int) -> dict[str, Any]:
    if k == 2:
        c["output_ids"], c["meta_info"]["completion_tokens"] = [1], 1
    return c


def outside_vocabulary(c: dict[str, Any], k: int) -> dict[str, Any]:
    c["output_ids"] = [c["output_ids"][0] + 10**6] + c["output_ids"][1:]
    return c


def too_many(c: dict[str, Any], k: int) -> dict[str, Any]:
    c["output_ids"] = c["output_ids"] + [1, 2, 3, 4, 5, 6, 7, 8]
    c["meta_info"]["completion_tokens"] = len(c["output_ids"])
    return c


def wrong_count(c: dict[str, Any], k: int) -> dict[str, Any]:
    c["meta_info"]["completion_tokens"] = 99
    return c


def not_json(c: dict[str, Any], k: int) -> dict[str, Any]:
    return {"not": "an SGLang answer"}


# Each refused from the first chunk on: no attempt makes progress.
BROKEN: dict[str, Callable[[dict[str, Any], int], dict[str, Any]]] = {
    "too many tokens": too_many, "wrong completion_tokens": wrong_count, "ids outside the vocabulary":
    outside_vocabulary, "an answer without output_ids": not_json,
}


def body(n: int = 6) -> dict[str, Any]:
    return {"input_ids": list(PROMPT), "sampling_params": {"temperature": 0, "max_new_tokens": n}}


NOT_JSON = "a frame that is not JSON"


class NotJson(FakeSGLang):
    """Every /generate answers 200 with an event stream whose frame is not JSON."""

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: <html>not JSON</html>\n\n")
        await resp.write_eof()
        return resp


@pytest.mark.parametrize("name", [*BROKEN, NOT_JSON])
async def test_a_sequence_failing_on_the_only_instance_ends_with_a_503_naming_the_failures(rig: Rig,
                                                                                         name: str) -> None:
    rig.inst.engine = replace(rig.inst.engine, vocab_size=1000)  # as health records it from /model_info
    if name in BROKEN:
        rig.fake.rewrite = BROKEN[name]
    t0 = time.monotonic()
    with pytest.raises(GenerationFailed) as info:
        await asyncio.wait_for(rig.generator.generate(decode(body())), 10 * WAIT_S)  # a hang fails here
    took = time.monotonic() - t0
    assert info.value.status == 503
    message = str(info.value)
    assert rig.inst.endpoint in message and "failed on" in message, message
    assert took < WAIT_S + 2, took  # the wait, and a little for the attempts
    assert rig.failures and all(f in message for f in rig.failures[-1:])
    assert rig.inst.health.failures_total == len(rig.failures)  # each counted, though every probe passed since
    assert rig.inst.load.in_flight == 0 and rig.generator.dispatcher.capacity.waiting == 0


async def test_a_sequence_failing_after_progress_each_time_ends_at_the_attempt_limit(rig: Rig) -> None:
    """Each attempt vouches for two tokens, then goes backwards: progress, so the wait starts afresh,
    and the attempt limit ends it."""
    rig.generator.settings = replace(SETTINGS, max_attempts=3)
    rig.fake.rewrite = backwards
    with pytest.raises(GenerationFailed) as info:
        await asyncio.wait_for(rig.generator.generate(decode(body(100))), 10 * WAIT_S)
    assert info.value.status == 502 and "failed on 3 attempt(s)" in str(info.value)
    assert "went back from 2 to 1" in str(info.value) and len(rig.failures) == 3


async def test_the_same_inside_a_batch(rig: Rig) -> None:
    rig.fake.rewrite = wrong_count
    items = [(f"r{k}", decode(body())) for k in range(4)]
    t0 = time.monotonic()

    async def collect() -> list[dict[str, Any]]:
        return [as_json(line) async for lines in run_batch(rig.generator, items) for line in lines]

    lines = await asyncio.wait_for(collect(), 10 * WAIT_S)
    assert time.monotonic() - t0 < WAIT_S + 3
    assert sorted(line["id"] for line in lines) == ["r0", "r1", "r2", "r3"]
    for line in lines:
        assert line["success"] is False and line["status_code"] == 503, line
        assert "bad chunk" in line["error"] and rig.inst.endpoint in line["error"]
    assert len(rig.failures) >= 4


@pytest.mark.slow
async def test_the_daemon_answers_503_on_generate_and_in_an_ndjson_batch(start_manager) -> None:
    """The issue's probe, end to end: one registered instance garbling every answer, probes passing."""
    fake = await FakeSGLang(model_info={"weight_version": "0", "vocab_size": 1000}).start()
    fake.rewrite = wrong_count
    try:
        m = await start_manager(no_instance_wait_timeout_s="1", health_failure_threshold="1000",
                                max_attempts_per_request="1000", health_check_interval_s="0.05",
                                tail_migration="false")
        status, answer = await m.post("/register_rollout_instance", {"host": "127.0.0.1", "port": fake.port})
        assert status == 200, answer
        endpoint = f"127.0.0.1:{fake.port}"
        await async_wait_until(lambda: _state(m, endpoint, "active"), message="instance active")
        t0 = time.monotonic()
        status, answer = await asyncio.wait_for(m.post("/generate", body()), 10)
        assert status == 503 and endpoint in answer["error"] and "a count of 99 token(s)" in answer["error"], answer
        assert time.monotonic() - t0 < 5  # 1 s of wait, the attempts, a loaded machine
        items = [[f"r{k}", body()] for k in range(3)]
        lines: list[dict[str, Any]] = []
        async with m.session.post(m.url + "/batch_generate_requests", json=items) as r:
            assert r.status == 200
            async for raw in r.content:
                lines.append(json.loads(raw))
        assert sorted(line["id"] for line in lines) == ["r0", "r1", "r2"]
        assert all(not line["success"] and line["status_code"] == 503 and endpoint in line["error"]
                   for line in lines), lines
        assert time.monotonic() - t0 < 12
        (inst,) = (await m.status())["instances"]
        assert inst["state"] == "active" and inst["failures_total"] >= 4 and inst["in_flight"] == 0
    finally:
        await fake.close()


async def _state(m: Any, endpoint: str, want: str) -> bool:
    return await m.state_of(endpoint) == want


async def test_the_dispatcher_places_on_a_recovered_instance_within_the_wait_and_fails_after_it() -> None:
    registry = Registry()
    d = Dispatcher(registry, LeastInFlight())
    a = registry.add("127.0.0.1", 30000, Kind.REMOTE)
    assert registry.transition(a, State.ACTIVE, "test: healthy")
    a.health.consecutive_failures = 1  # the sequence just failed there
    waiter = asyncio.ensure_future(d.acquire(Ask(1, avoid=frozenset({a.id}), since=d.clock()), timeout_s=5))
    await asyncio.sleep(0)
    assert not waiter.done() and d.capacity.waiting == 1
    a.health.consecutive_failures = 0
    d.recovered(a)  # a probe passed: it may try there again, at once
    assert await asyncio.wait_for(waiter, 1) is a
    d.release(a, 1)
    # Its wait is over and only the instance that failed it is left, recovered or not: no more tries.
    with pytest.raises(Unavailable, match="within 5s"):
        await d.acquire(Ask(1, avoid=frozenset({a.id}), since=d.clock() - 5), timeout_s=5)
    assert d.capacity.waiting == 0 and a.load.in_flight == 0
