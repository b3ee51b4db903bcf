"""A batched ``/generate`` starts its sequences only as the pool can run them (docs/bounds.md): one body
of many one-token prompts costs the manager its body and a window of sequences, not a task per prompt."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from fakes import reference, register_active, start_fakes
from support import as_json

from rollout_manager.instances.registry import Registry
from rollout_manager.placement.dispatch import Dispatcher
from rollout_manager.placement.least_in_flight import LeastInFlight
from rollout_manager.placement.local_budget import LocalBudget
from rollout_manager.rollout.batch import run_batch
from rollout_manager.rollout.generation import GenerationSettings, Generator
from rollout_manager.rollout.request import decode
from rollout_manager.rollout.window import LOOKAHEAD
from rollout_manager.sglang import client as sgl

SETTINGS = GenerationSettings(max_attempts=3, wait_timeout_s=30, connect_timeout_s=2.0, stall_timeout_s=5.0,
                              engine_stream_interval=1)


def generator(dispatcher: Dispatcher, session: aiohttp.ClientSession | None = None) -> Generator:
    return Generator(dispatcher, sgl.SGLangClient(session), SETTINGS,  # type: ignore[arg-type]
                     LocalBudget(0.0, 0.0, 1.0), on_instance_failure=lambda i, r: None,
                     on_instance_success=lambda i: None)


def batch(n: int, tokens: int = 2) -> dict[str, Any]:
    return {"input_ids": [[1 + k % 50, 2] for k in range(n)], "sampling_params": {"max_new_tokens": tokens}}


async def settle(turns: int = 50) -> None:
    for _ in range(turns):
        await asyncio.sleep(0)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_huge_batch_waits_as_a_body_not_as_a_task_per_prompt(stream: bool) -> None:
    """No instance at all: only the lookahead waits as sequences; the rest is counted as held."""
    d = Dispatcher(Registry(), LeastInFlight())
    g = generator(d)
    n = 20_000
    if stream:
        async def consume() -> None:
            async for _ in g.generate_stream(decode({**batch(n), "stream": True})):
                pass
        task = asyncio.ensure_future(consume())
    else:
        task = asyncio.ensure_future(g.generate(decode(batch(n))))
    await settle()
    assert d.capacity.waiting == LOOKAHEAD and d.capacity.held_by_batches == n - LOOKAHEAD
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    c = d.capacity
    assert c.waiting == 0 and c.held_by_batches == 0 and c.windowed == 0  # the caller went away: nothing is left


@pytest.fixture
async def pool() -> AsyncIterator[tuple[Dispatcher, Generator]]:
    fakes = await start_fakes(2)
    session = aiohttp.ClientSession()
    registry = Registry()
    d = Dispatcher(registry, LeastInFlight(), max_in_flight_per_instance=4)
    register_active(registry, fakes)
    try:
        yield d, generator(d, session)
    finally:
        await session.close()
        for fake in fakes:
            await fake.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_a_batch_beyond_the_pool_runs_within_the_window_and_answers_every_prompt_in_order(
        pool: tuple[Dispatcher, Generator], stream: bool) -> None:
    d, g = pool
    n = 300
    body = batch(n, tokens=3)
    peak = 0

    def watch(*_: Any) -> None:
        nonlocal peak
        peak = max(peak, d.capacity.in_flight + d.capacity.waiting)

    d.changed.notify = watch  # type: ignore[method-assign]  # called on every placement and release
    if stream:
        finals: dict[int, dict[str, Any]] = {}
        async for ready in g.generate_stream(decode({**body, "stream": True})):
            for chunk in as_json(ready):
                if chunk["meta_info"].get("finish_reason") is not None:
                    finals[chunk["index"]] = chunk
        outs = [finals[i] for i in range(n)]
    else:
        result = await asyncio.wait_for(g.generate(decode(body)), 60)
        assert isinstance(result, list)
        outs = as_json(result)
    assert [o["output_ids"] for o in outs] == [reference(p, 3) for p in body["input_ids"]]
    assert 0 < peak <= d.capacity.pool_bound() + LOOKAHEAD, peak
    c = d.capacity
    assert c.held_by_batches == 0 and c.in_flight == 0 and c.waiting == 0 and c.windowed == 0


async def test_batched_requests_inside_a_batch_share_one_window() -> None:
    """/batch_generate_requests of 200 requests, each a batch of 100 prompts, and no instance: the
    requests' windows together keep about one window waiting, not 64 requests times 64 prompts."""
    d = Dispatcher(Registry(), LeastInFlight())
    g = generator(d)
    items = [(f"r{k}", decode(batch(100))) for k in range(200)]

    async def consume() -> None:
        async for _ in run_batch(g, items):
            pass

    task = asyncio.ensure_future(consume())
    await settle(200)
    waiting = d.capacity.waiting
    assert 0 < waiting <= 2 * LOOKAHEAD, waiting  # one window, plus one each for the requests started
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert d.capacity.waiting == 0 and d.capacity.held_by_batches == 0 and d.capacity.windowed == 0
