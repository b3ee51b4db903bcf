"""``min_weight_version``: a caller's floor on the weight version its sequences run on (docs/http-api.md).

In process over fake engines (placement among versions), and through a real manager with CPU engines
(validation, and a request no instance qualifies for waits and ends in 503, never 500).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from fakes import FakeSGLang, reference, register_active, start_fakes
from support import as_json, async_wait_until

from rollout_manager.errors import InvalidField, ManagerError
from rollout_manager.instances.registry import Instance, Registry, State
from rollout_manager.placement.dispatch import Dispatcher
from rollout_manager.placement.least_in_flight import LeastInFlight
from rollout_manager.placement.local_budget import LocalBudget
from rollout_manager.rollout.generation import GenerationSettings, Generator
from rollout_manager.rollout.request import decode
from rollout_manager.sglang.client import SGLangClient

PROMPT = [5, 17, 42]


def test_the_field_is_an_integer_of_at_least_zero() -> None:
    assert decode({"input_ids": [1], "min_weight_version": 3}).sequences[0].min_version == 3
    for bad in (-1, "3", True, 1.5):
        with pytest.raises(InvalidField, match="min_weight_version"):
            decode({"input_ids": [1], "min_weight_version": bad})


@pytest.fixture
async def fleet() -> AsyncIterator[tuple[Generator, Registry, list[FakeSGLang]]]:
    fakes = await start_fakes(4)
    try:
        async with aiohttp.ClientSession() as session:
            registry = Registry()
            dispatcher = Dispatcher(registry, LeastInFlight())
            settings = GenerationSettings(max_attempts=4, wait_timeout_s=2.0, connect_timeout_s=2.0,
                                          stall_timeout_s=0.5, engine_stream_interval=1)
            generator = Generator(dispatcher, SGLangClient(session), settings, LocalBudget(0.0, 0.0, 1.0),
                                  on_instance_failure=lambda i, r: None, on_instance_success=lambda i: None)
            yield generator, registry, fakes
    finally:
        for f in fakes:
            await f.close()


def activate(registry: Registry, fakes: list[FakeSGLang], versions: list[int]) -> list[Instance]:
    """Register ``fakes`` at ``versions`` and mark them active."""
    for fake, v in zip(fakes, versions):
        fake.weight_version = str(v)
    insts = register_active(registry, fakes)
    for inst, v in zip(insts, versions):
        inst.weight_version = v
    return insts


def body(n: int, **extra: Any) -> dict[str, Any]:
    return {"input_ids": list(PROMPT), "sampling_params": {"temperature": 0, "max_new_tokens": n}, **extra}


def versions(out: Any) -> list[int]:
    return [int(s["weight_version"]) for s in as_json(out)["meta_info"]["segments"]]


async def test_sequences_run_only_at_the_floor_or_newer_and_the_field_is_not_forwarded(fleet: Any) -> None:
    generator, registry, fakes = fleet
    activate(registry, fakes[:3], [1, 2, 3])
    outs = await asyncio.gather(*(generator.generate(decode(body(4, min_weight_version=2))) for _ in range(6)))
    assert all(versions(o)[0] >= 2 for o in outs), [versions(o) for o in outs]
    assert not fakes[0].requests  # version 1: never asked
    batch = await generator.generate(decode(body(4, min_weight_version=3) | {"input_ids": [PROMPT, PROMPT]}))
    assert isinstance(batch, list) and all(versions(o) == [3] for o in batch)
    sent = [r for f in fakes for r in f.requests]
    assert sent and all("min_weight_version" not in r for r in sent)


async def test_a_continued_sequence_never_goes_back_to_an_older_version(fleet: Any) -> None:
    generator, registry, fakes = fleet
    (first,) = activate(registry, fakes[:1], [3])  # the only instance yet: the sequence starts on version 3
    fakes[0].stall_after_tokens = 3  # then silent: cut after stall_timeout_s (0.5 s)
    task = asyncio.ensure_future(generator.generate(decode(body(10, min_weight_version=1))))
    await async_wait_until(lambda: fakes[0].requests, 10.0, interval_s=0.01, message="the first attempt")
    assert registry.transition(first, State.DRAINING, "test: it takes no more work")
    # Versions 1 and 1 would do for min_weight_version=1, but the sequence already has version-3 tokens.
    old_a, old_b, new = activate(registry, fakes[1:], [1, 1, 3])
    out = as_json(await task)
    assert [s["instance"] for s in out["meta_info"]["segments"]] == [first.id, new.id]
    assert versions(out) == [3, 3] and out["output_ids"] == reference(PROMPT, 10)
    assert not fakes[1].requests and not fakes[2].requests


async def test_when_no_instance_qualifies_the_sequence_waits_then_gets_503(fleet: Any) -> None:
    generator, registry, fakes = fleet
    activate(registry, fakes, [1, 2, 3, 3])
    with pytest.raises(ManagerError) as err:
        await generator.generate(decode(body(4, min_weight_version=9)))
    assert err.value.status == 503 and "min_weight_version=9" in str(err.value)
    assert not any(f.requests for f in fakes)


@pytest.mark.slow
async def test_through_the_manager(start_manager: Any, start_engines: Any) -> None:
    m = await start_manager(no_instance_wait_timeout_s=1)
    (engine,) = await start_engines([])
    await m.register(engine)  # at version 0
    params = {"max_new_tokens": 2, "temperature": 0.0}
    status, out = await m.post("/generate", {"input_ids": [1, 2], "sampling_params": params, "min_weight_version": -1})
    assert status == 400 and "min_weight_version" in out["error"], out
    status, out = await m.post("/generate", {"input_ids": [1, 2], "sampling_params": params, "min_weight_version": 0})
    assert status == 200, out
    status, out = await m.post("/generate", {"input_ids": [1, 2], "sampling_params": params, "min_weight_version": 1})
    assert status == 503 and "min_weight_version=1" in out["error"], out
