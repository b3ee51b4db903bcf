"""A sequence whose instance changes weights under it keeps every token, and a new segment starts at the
token where the version changed, on the same instance (issue 31, item 2). In process over a fake engine
whose chunks report the version it runs now; SGLang's exact ``weight_versions`` spans win when sent."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from fakes import FakeSGLang, reference, register_active, start_fakes
from support import as_json, async_wait_until

from rollout_manager.instances.registry import Instance, Registry
from rollout_manager.placement.dispatch import Dispatcher
from rollout_manager.placement.least_in_flight import LeastInFlight
from rollout_manager.placement.local_budget import LocalBudget
from rollout_manager.rollout.generation import GenerationSettings, Generator
from rollout_manager.rollout.request import decode
from rollout_manager.sglang.client import SGLangClient

PROMPT = [5, 17, 42]


@pytest.fixture
async def one() -> AsyncIterator[tuple[Generator, Instance, FakeSGLang]]:
    (fake,) = await start_fakes(1)
    try:
        async with aiohttp.ClientSession() as session:
            registry = Registry()
            settings = GenerationSettings(max_attempts=2, wait_timeout_s=1.0, connect_timeout_s=2.0,
                                          stall_timeout_s=10.0, engine_stream_interval=1)
            generator = Generator(Dispatcher(registry, LeastInFlight()), SGLangClient(session), settings,
                                  LocalBudget(0.0, 0.0, 1.0), on_instance_failure=lambda i, r: None,
                                  on_instance_success=lambda i: None)
            (inst,) = register_active(registry, [fake])
            yield generator, inst, fake
    finally:
        await fake.close()


async def _cross(generator: Generator, inst: Instance, fake: FakeSGLang, at: int,
                 final: dict[str, Any] | None = None) -> dict[str, Any]:
    """Generate 10 tokens; the engine moves from version 0 to 1 after ``at`` of them. ``final``: more
    meta_info for the final chunk."""
    sent: list[int] = []

    def watch(chunk: dict[str, Any], k: int) -> dict[str, Any]:
        sent.append(k)
        if final is not None and chunk["meta_info"]["finish_reason"] is not None:
            chunk["meta_info"].update(final)
        return chunk

    fake.rewrite, fake.stall_after_tokens = watch, at
    body = {"input_ids": list(PROMPT), "sampling_params": {"temperature": 0, "max_new_tokens": 10}}
    task = asyncio.ensure_future(generator.generate(decode(body)))
    await async_wait_until(lambda: len(sent) == at, 10.0, interval_s=0.01, message=f"{at} chunks sent")
    inst.weight_version, fake.weight_version = 1, "1"  # activated under the running sequence
    fake.unstall()
    out = as_json(await task)
    assert isinstance(out, dict)
    assert out["output_ids"] == reference(PROMPT, 10) and out["meta_info"]["completion_tokens"] == 10
    return out


def _segments(out: dict[str, Any]) -> list[tuple[str, str, int, int, str]]:
    return [(s["instance"], s["weight_version"], s["start"], s["end"], s["outcome"])
            for s in out["meta_info"]["segments"]]


async def test_a_version_change_starts_a_segment_at_the_first_token_of_the_new_version(one: Any) -> None:
    generator, inst, fake = one
    out = await _cross(generator, inst, fake, at=4)
    assert _segments(out) == [(inst.id, "0", 0, 4, "weight version 1 from token 4"),
                              (inst.id, "1", 4, 10, "finished")]
    assert out["meta_info"]["weight_version"] == "1" and len(fake.requests) == 1  # one request, no retry


async def test_sglangs_exact_spans_win_over_the_chunks(one: Any) -> None:
    generator, inst, fake = one
    spans = [{"version": "0", "start": 0, "end": 3}, {"version": "1", "start": 3, "end": 10}]
    out = await _cross(generator, inst, fake, at=4, final={"weight_versions": spans})
    assert _segments(out) == [(inst.id, "0", 0, 3, "weight version 1 from token 3"),
                              (inst.id, "1", 3, 10, "finished")]
    assert out["meta_info"]["weight_versions"] == spans


async def test_spans_that_do_not_cover_the_tokens_are_ignored(one: Any) -> None:
    generator, inst, fake = one
    bad = [{"version": "0", "start": 0, "end": 3}, {"version": "1", "start": 3, "end": 9}]  # 9 of 10 tokens
    out = await _cross(generator, inst, fake, at=4, final={"weight_versions": bad})
    assert _segments(out) == [(inst.id, "0", 0, 4, "weight version 1 from token 4"),
                              (inst.id, "1", 4, 10, "finished")]
    assert out["meta_info"]["weight_versions"] == [{"version": "0", "start": 0, "end": 4},
                                                   {"version": "1", "start": 4, "end": 10}]
