"""``engine_max_instance_buffer_mb`` is the manager's own memory limit, not a rule a box can break: answers
that take a box's calls past it together (routed experts' final frames, rows for every position) are read
one frame at a time past the bound, and every one arrives, with nothing counted against the box. A box that
never frames still fails, on its frame bound (``test_babbling_box.py``).
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from fakes import HealthRecorder
from support import as_json

from rollout_manager.cpu_engine.engine import EngineConfig
from rollout_manager.cpu_engine.server import create_app
from rollout_manager.instances.instance import EngineFacts
from rollout_manager.instances.registry import Kind, Registry, State
from rollout_manager.placement.dispatch import Dispatcher
from rollout_manager.placement.least_in_flight import LeastInFlight
from rollout_manager.placement.local_budget import LocalBudget
from rollout_manager.rollout.generation import GenerationSettings, Generator
from rollout_manager.rollout.request import decode
from rollout_manager.sglang.client import SGLangClient
from rollout_manager.sglang.deadline import BoxBytes, Deadline

EXPERTS, TOP_K, LAYERS = 8, 2, 2
PROMPT = 400  # rows for the prompt's positions too: about 8 KB in each final frame
SEQUENCES = 12
BOUND = 16_000  # the box's calls may hold 16 KB of unfinished frames together: about two final frames
SLICE = 2048  # the box's answers cross the network in slices this large, a moment apart


async def test_past_the_bound_one_call_reads_on_and_the_others_wait_their_turn() -> None:
    box = BoxBytes(100)
    a, b, c, d = (Deadline(10.0, 10.0, None, box) for _ in range(4))
    a.hold(60)
    b.hold(30)
    a.hold(80)  # 110 held: a is the one that reads on
    assert box.holder is a and not a.blocked
    b.hold(95)
    c.hold(5)
    assert b.blocked and c.blocked  # they wait; nothing failed
    b_room, c_room = box.room(b), box.room(c)
    a.hold(3)  # a's frame is done, still over the bound: the longest waiting reads on, alone
    assert box.holder is b and b_room.done() and not b.blocked
    assert c.blocked and not c_room.done()
    d.hold(1)
    assert d.blocked
    box.room(d)
    d.hold(0)  # d's call ended while it waited: it is not handed the turn
    b.hold(0)  # b's frame is done: 8 held, under the bound: everyone reads on
    assert box.holder is None and c_room.done() and not c.blocked and box.waiting == []
    c.hold(0)
    a.hold(0)
    assert box.held == 0


@dataclass
class Rig:
    generator: Generator
    health: HealthRecorder


def sliced(upstream: str) -> web.Application:
    """A healthy box behind a slow link: its answers, every byte as the engine sent them, arrive a slice at a
    time, so many calls' final frames are half-read at once."""
    async def generate(request: web.Request) -> web.StreamResponse:
        async with aiohttp.ClientSession() as s, s.post(upstream + "/generate", data=await request.read(),
                                                        headers={"Content-Type": "application/json"}) as r:
            raw = await r.read()
            out = web.StreamResponse(status=r.status, headers={"Content-Type": r.content_type})
        await out.prepare(request)
        for at in range(0, len(raw), SLICE):
            await out.write(raw[at:at + SLICE])
            await asyncio.sleep(0.002)
        await out.write_eof()
        return out

    app = web.Application()
    app.router.add_post("/generate", generate)
    return app


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    moe = {"num_experts": EXPERTS, "num_experts_per_tok": TOP_K}
    engine = TestServer(create_app(EngineConfig(seed=0, model_overrides=moe, enable_return_routed_experts=True)))
    await engine.start_server()
    link = TestServer(sliced(f"http://127.0.0.1:{engine.port}"))
    await link.start_server()
    settings = GenerationSettings(max_attempts=1, wait_timeout_s=0.5, connect_timeout_s=2.0, stall_timeout_s=30.0,
                                  engine_stream_interval=64, max_frame_bytes=16_000_000,
                                  max_instance_buffer_bytes=BOUND)
    async with aiohttp.ClientSession() as session:
        registry = Registry()
        inst = registry.add("127.0.0.1", link.port or 0, Kind.REMOTE)
        inst.engine = EngineFacts(routed_experts=True)
        assert registry.transition(inst, State.ACTIVE, "test: healthy")
        health = HealthRecorder()
        generator = Generator(Dispatcher(registry, LeastInFlight()), SGLangClient(session), settings,
                              LocalBudget(0.0, 0.0, 1.0), on_instance_failure=health.failure,
                              on_instance_success=health.success)
        try:
            yield Rig(generator, health)
        finally:
            await link.close()
            await engine.close()


def body(i: int, stream: bool) -> dict[str, Any]:
    return {"input_ids": [(i * 7 + k) % 250 + 1 for k in range(PROMPT)], "stream": stream,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
            "return_routed_experts": True}


@pytest.mark.parametrize("stream", [False, True])
async def test_routed_expert_answers_past_the_bound_all_arrive_and_the_box_is_not_blamed(
        rig: Rig, stream: bool) -> None:
    async def one(i: int) -> dict[str, Any]:
        b = decode(body(i, stream))
        if not stream:
            return dict(as_json(await rig.generator.generate(b)))
        last: Any = None
        async for batch in rig.generator.generate_stream(b):
            last = batch[-1]
        return dict(as_json(last))

    outs = await asyncio.gather(*(one(i) for i in range(SEQUENCES)))
    frames = 0
    for out in outs:
        rows = base64.b64decode(out["meta_info"]["routed_experts"])
        assert len(rows) == (PROMPT + 8 - 1) * LAYERS * TOP_K * 4  # every position's rows, whole
        frames += len(out["meta_info"]["routed_experts"])
    assert frames > 3 * BOUND  # more than the bound's worth came at once
    assert rig.health.failures == []  # the manager's limit was nobody's fault

