"""sglang.coalesce in process, against a small SGLang-shaped server that answers batches when told."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from support import async_wait_until

from rollout_manager.cpu_engine.encode import output_chunk
from rollout_manager.osutil import free_port
from rollout_manager.sglang import wire
from rollout_manager.sglang.client import CallBounds, EngineFailed, EngineRejected
from rollout_manager.sglang.coalesce import Coalescer
from rollout_manager.sglang.generate_request import SequenceBody

BOUNDS = CallBounds(connect_timeout_s=2.0, stall_timeout_s=5.0)


@dataclass
class Engine:
    url: str
    bodies: list[dict[str, Any]] = field(default_factory=list)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    disconnected: int = 0
    status: int = 200


@pytest.fixture
async def engine() -> AsyncIterator[Engine]:
    port = free_port()
    eng = Engine(f"http://127.0.0.1:{port}")

    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        eng.bodies.append(body)
        try:
            await eng.release.wait()
        except asyncio.CancelledError:
            eng.disconnected += 1
            raise
        if eng.status != 200:
            return web.json_response({"error": "refused"}, status=eng.status)
        outs = [output_chunk(rid=sub["rid"], output_ids=[len(sub["input_ids"])], prompt_tokens=1,
                                  completion_tokens=1, finish=wire.finish_reason(wire.LENGTH, length=1),
                                  weight_version="0") for sub in wire.split_batch(body)]
        return web.json_response(outs if wire.is_batched(body) else outs[0])

    app = web.Application(handler_args={"handler_cancellation": True})
    app.router.add_post(wire.GENERATE, generate)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield eng
    finally:
        await runner.cleanup()


def body(n: int, **extra: Any) -> dict[str, Any]:
    return {"input_ids": [7] * n, "sampling_params": {"max_new_tokens": 1}, "stream": False, "rid": f"r{n}", **extra}


async def one(co: Coalescer, session: aiohttp.ClientSession, url: str, b: dict[str, Any]) -> dict[str, Any]:
    return await co.generate_once(session, url, SequenceBody.of(b), BOUNDS)


async def test_calls_that_start_together_share_one_request_and_each_gets_its_own_answer(engine: Engine) -> None:
    co = Coalescer(max_items=3)
    engine.release.set()
    async with aiohttp.ClientSession() as s:
        bodies = [body(n) for n in range(1, 8)] + [body(9, return_logprob=True)]
        answers = await asyncio.gather(*(one(co, s, engine.url, b) for b in bodies))
    assert [a.ids for a in answers] == [[len(b["input_ids"])] for b in bodies]
    assert [a.meta.rid for a in answers] == [b["rid"] for b in bodies]
    # At most 3 per request, and the one with another shape alone.
    assert [len(b["rid"]) if isinstance(b["rid"], list) else 1 for b in engine.bodies] == [3, 3, 1, 1]
    assert engine.bodies[-1]["return_logprob"] is True and "return_logprob" not in engine.bodies[0]
    assert (co.stats.engine_calls, co.stats.sequences) == (4, 8)


@pytest.mark.slow  # runs for seconds
async def test_a_caller_that_leaves_does_not_disturb_the_others_and_when_all_leave_the_request_is_cut(
        engine: Engine) -> None:
    co = Coalescer()
    async with aiohttp.ClientSession() as s:
        tasks = [asyncio.ensure_future(one(co, s, engine.url, body(n))) for n in (1, 2, 3)]
        await async_wait_until(lambda: len(engine.bodies) == 1, message="the shared request")
        tasks[0].cancel()
        engine.release.set()
        rest = await asyncio.gather(*tasks[1:])
        assert [a.ids for a in rest] == [[2], [3]]
        assert tasks[0].cancelled()

        engine.release.clear()
        tasks = [asyncio.ensure_future(one(co, s, engine.url, body(n))) for n in (4, 5)]
        await async_wait_until(lambda: len(engine.bodies) == 2, message="the second shared request")
        for t in tasks:
            t.cancel()
        await async_wait_until(lambda: engine.disconnected == 1, message="the request cut when nobody waits")
        await async_wait_until(lambda: not co._sending, message="no shared request left")


async def test_a_shared_request_that_fails_fails_every_caller_and_a_refusal_is_asked_again_one_by_one(
        engine: Engine) -> None:
    co = Coalescer()
    async with aiohttp.ClientSession() as s:
        engine.status = 503
        engine.release.set()
        results = await asyncio.gather(*(one(co, s, engine.url, body(n)) for n in (1, 2)), return_exceptions=True)
        assert all(isinstance(r, EngineFailed) and "HTTP 503" in str(r) for r in results), results
        assert results[0] is not results[1]  # each caller its own exception
        engine.status = 400
        results = await asyncio.gather(*(one(co, s, engine.url, body(n)) for n in (3, 4)), return_exceptions=True)
    assert [len(b["rid"]) if isinstance(b["rid"], list) else 1 for b in engine.bodies] == [2, 2, 1, 1]
    assert co.stats.split_after_refusal == 1
    assert all(isinstance(r, EngineRejected) and r.status == 400 for r in results), results


async def test_a_fault_of_the_managers_own_fails_the_callers_without_blaming_the_engine(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    async def broken(*args: Any, **kwargs: Any) -> list[dict[str, Any]]:
        raise KeyError("a bug")

    monkeypatch.setattr("rollout_manager.sglang.coalesce.generate_batch_once", broken)
    co = Coalescer()
    async with aiohttp.ClientSession() as s:
        results = await asyncio.gather(*(one(co, s, engine.url, body(n)) for n in (1, 2)), return_exceptions=True)
    assert all(type(r) is RuntimeError and "internal error" in str(r) for r in results), results
