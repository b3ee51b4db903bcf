"""Routed-expert replay (R3) through the manager: the generator in process over CPU engines running a MoE model.

What the manager promises: SGLang's ``meta_info.routed_experts`` for every sequence, in SGLang's format and
alignment (``[prompt + completion - 1 - start, layers, top_k]`` int32, base64), equal to what one engine gives
for the whole sequence uninterrupted, also when the sequence was continued on another engine; a continuation
asks the next engine only for the rows the sequence lacks; a request for experts goes only to engines that
return them, and is refused at once when none of the active ones does.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import aiohttp
import numpy as np
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from fakes import HealthRecorder
from support import as_json, async_wait_until

from rollout_manager.api.routes import admit
from rollout_manager.cpu_engine.engine import EngineConfig
from rollout_manager.cpu_engine.faults import Faults
from rollout_manager.cpu_engine.server import create_app
from rollout_manager.instances.instance import EngineFacts
from rollout_manager.instances.registry import Instance, Kind, Registry, State
from rollout_manager.placement.dispatch import Dispatcher
from rollout_manager.placement.least_in_flight import LeastInFlight
from rollout_manager.placement.local_budget import LocalBudget
from rollout_manager.rollout.generation import GenerationFailed, GenerationSettings, Generator
from rollout_manager.rollout.request import decode
from rollout_manager.sglang.client import SGLangClient
from rollout_manager.sglang.routed_experts import RoutedExperts

EXPERTS, TOP_K, LAYERS = 8, 2, 2
MOE = {"num_experts": EXPERTS, "num_experts_per_tok": TOP_K}
PROMPT = [11, 22, 33, 44, 55]
SETTINGS = GenerationSettings(max_attempts=3, wait_timeout_s=0.5, connect_timeout_s=2.0, stall_timeout_s=0.5,
                              engine_stream_interval=1)


def rows(meta: dict[str, Any]) -> np.ndarray:
    return np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype="<i4").reshape(-1, LAYERS, TOP_K)


def body(n: int, **extra: Any) -> dict[str, Any]:
    return {"input_ids": list(PROMPT), "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
            "return_routed_experts": True, **extra}


@dataclass
class Rig:
    registry: Registry
    generator: Generator
    engines: list[TestServer]
    requests: list[list[dict[str, Any]]]  # what each engine was sent
    faults: list[Faults]

    def register(self, *which: int, routed_experts: bool = True) -> list[Instance]:
        out = []
        for i in which:
            inst = self.registry.add("127.0.0.1", self.engines[i].port or 0, Kind.REMOTE)
            inst.engine = EngineFacts(routed_experts=routed_experts)
            assert self.registry.transition(inst, State.ACTIVE, "test: healthy")
            out.append(inst)
        return out

    async def run(self, b: dict[str, Any]) -> Any:
        return as_json(await self.generator.generate(decode(b)))


def _engine(requests: list[dict[str, Any]], faults: Faults | None = None, r3: bool = True) -> TestServer:
    app = create_app(EngineConfig(seed=0, model_overrides=MOE, enable_return_routed_experts=r3,
                                  faults=faults or Faults()))

    @web.middleware
    async def record(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path == "/generate":
            requests.append(await request.json())
        return await handler(request)  # type: ignore[no-any-return]

    app.middlewares.append(record)
    return TestServer(app)


@pytest.fixture
async def rig(request: pytest.FixtureRequest) -> AsyncIterator[Rig]:
    faults: list[Faults] = getattr(request, "param", None) or [Faults(), Faults()]
    requests: list[list[dict[str, Any]]] = [[] for _ in faults]
    engines = [_engine(requests[i], f) for i, f in enumerate(faults)]
    for e in engines:
        await e.start_server()
    async with aiohttp.ClientSession() as session:
        registry = Registry()
        health = HealthRecorder()
        generator = Generator(Dispatcher(registry, LeastInFlight()), SGLangClient(session), SETTINGS,
                              LocalBudget(0.0, 0.0, 1.0), on_instance_failure=health.failure,
                              on_instance_success=health.success)
        try:
            yield Rig(registry, generator, engines, requests, faults)
        finally:
            for e in engines:
                await e.close()


def test_rows_are_checked_against_what_an_engine_owes() -> None:
    experts = RoutedExperts(start=2)
    row = bytes(LAYERS * TOP_K * 4)
    assert experts.check(row * 3, seqlen=6) is None  # positions 2, 3, 4 (the last token has none)
    assert "rows of int32" in (experts.check(row[:-2] * 3, seqlen=6) or "")  # 14 bytes a row
    experts.add(row * 3, seqlen=6)
    assert experts.end == 5 and len(experts.rows) == 3 * len(row)
    assert "earlier engines" in (experts.check(row * 2 + row[:8], seqlen=8) or "")  # 40-byte rows, not 16
    assert experts.check(b"", seqlen=5) is None and "no position" in (experts.check(row, seqlen=5) or "")
    experts.reset()
    assert experts.end == 2 and not experts.rows


async def test_the_experts_of_a_sequence_are_one_engines_uninterrupted(rig: Rig) -> None:
    (a,) = rig.register(0)
    out = await rig.run(body(6))
    whole = rows(out["meta_info"])
    assert whole.shape == (len(PROMPT) + 6 - 1, LAYERS, TOP_K)
    sent = rig.requests[0][-1]
    assert sent["return_routed_experts"] is True and sent["routed_experts_start_len"] == 0
    later = await rig.run(body(6, routed_experts_start_len=3))
    assert (rows(later["meta_info"]) == whole[3:]).all() and later["output_ids"] == out["output_ids"]
    chunks = [as_json(c) async for batch in rig.generator.generate_stream(decode(body(6, stream=True))) for c in batch]
    assert len(chunks) > 1 and all("routed_experts" not in c["meta_info"] for c in chunks[:-1])  # as SGLang: the
    assert (rows(chunks[-1]["meta_info"]) == whole).all()  # final chunk alone carries them, all of them


@pytest.mark.parametrize("rig", [[Faults(stall_after_tokens=3), Faults()]], indirect=True)
async def test_a_sequence_continued_elsewhere_gets_the_same_experts(rig: Rig) -> None:
    """The first engine stalls after 3 tokens (no final output: none of its rows): the second is asked from
    the caller's start, and its prefill computes the rows of the tokens the first one made."""
    rig.register(0, 1)
    out = await rig.run(body(8))
    assert len(out["meta_info"]["segments"]) == 2
    reference = await _alone(rig, 8)
    assert out["output_ids"] == reference["output_ids"]
    assert (rows(out["meta_info"]) == rows(reference["meta_info"])).all()
    (cont,) = rig.requests[1][:1]
    assert cont["routed_experts_start_len"] == 0 and len(cont["input_ids"]) == len(PROMPT) + 3


@pytest.mark.parametrize("rig", [[Faults(token_delay_s=0.01), Faults()]], indirect=True)
async def test_a_moved_sequence_keeps_the_first_engines_rows_and_asks_only_for_the_rest(rig: Rig) -> None:
    """Evicted mid-stream: the first engine's abort carries its rows, the next engine is asked only from the
    first position without one."""
    a, b = rig.register(0, 1)
    rig.generator.dispatcher.registry.transition(b, State.DRAINING, "test: not yet")
    task = asyncio.ensure_future(rig.run(body(40)))
    await async_wait_until(lambda: rig.faults[0].emitted_tokens >= 3, 20)
    rig.generator.dispatcher.registry.transition(b, State.ACTIVE, "test: now")
    assert rig.generator.evict(a, "test") == 1
    out = await task
    reference = await _alone(rig, 40)
    assert out["output_ids"] == reference["output_ids"]
    assert (rows(out["meta_info"]) == rows(reference["meta_info"])).all()
    first = out["meta_info"]["segments"][0]
    assert first["end"] > 0 and len(out["meta_info"]["segments"]) == 2
    (cont,) = [r for sent in rig.requests for r in sent if r["rid"].endswith("~1")]
    assert cont["routed_experts_start_len"] == len(PROMPT) + first["end"] - 1  # only the rows it lacks


async def test_a_batch_gives_every_item_its_own_experts(rig: Rig) -> None:
    rig.register(0)
    items = [PROMPT, PROMPT[:3], [9] * 7]
    out = await rig.run({**body(4), "input_ids": items})
    for prompt, item in zip(items, out):
        assert rows(item["meta_info"]).shape == (len(prompt) + 4 - 1, LAYERS, TOP_K)
        alone = await rig.run({**body(4), "input_ids": prompt})
        assert (rows(item["meta_info"]) == rows(alone["meta_info"])).all()


async def test_experts_go_only_to_engines_that_return_them(rig: Rig) -> None:
    (plain,) = rig.register(0, routed_experts=False)
    with pytest.raises(GenerationFailed) as refused:
        await rig.run(body(2))
    assert refused.value.status == 400 and "--enable-return-routed-experts" in str(refused.value)
    assert not rig.requests[0]
    rig.register(1)
    out = await rig.run(body(2))
    assert rows(out["meta_info"]).shape[0] == len(PROMPT) + 1 and not rig.requests[0]
    plain_out = await rig.run({k: v for k, v in body(2).items() if k != "return_routed_experts"})
    assert "routed_experts" not in plain_out["meta_info"]


async def test_a_streamed_request_for_experts_is_refused_at_admission(rig: Rig) -> None:
    """Before its stream starts (a 400 status, not an error chunk in a 200 stream), when no active instance
    returns experts."""
    rig.register(0, routed_experts=False)
    manager: Any = SimpleNamespace(generator=rig.generator)
    with pytest.raises(GenerationFailed) as refused:
        admit(manager, body(2, stream=True), None)
    assert refused.value.status == 400 and "return_routed_experts" in str(refused.value)
    assert admit(manager, {k: v for k, v in body(2, stream=True).items() if k != "return_routed_experts"}, None)
    rig.register(1)
    assert admit(manager, body(2, stream=True), None).stream


async def _alone(rig: Rig, n: int) -> dict[str, Any]:
    """The same request on one engine, uninterrupted (a fresh engine of the same seed)."""
    requests: list[dict[str, Any]] = []
    engine = _engine(requests)
    await engine.start_server()
    try:
        async with aiohttp.ClientSession() as session, \
                session.post(f"http://127.0.0.1:{engine.port}/generate", json=body(n)) as r:
            assert r.status == 200
            out: dict[str, Any] = await r.json()
            return out
    finally:
        await engine.close()


async def test_the_experts_final_frame_is_not_held_against_the_frame_bound(rig: Rig) -> None:
    """The rows can outweigh the tokens a thousandfold (Qwen3-30B-A3B: 2 KiB of base64 a position): a request
    for them gets room for them in its final frame, on top of the bound that keeps a babbling engine out."""
    rig.register(0)
    bounded = dataclasses.replace(SETTINGS, max_frame_bytes=1200)
    rig.generator.settings = rig.generator.attempts.settings = bounded
    plain = await rig.run({k: v for k, v in body(40).items() if k != "return_routed_experts"})
    assert len(plain["output_ids"]) == 40  # the tokens' frames fit the bound
    out = await rig.run(body(40))
    assert rows(out["meta_info"]).shape == (len(PROMPT) + 39, LAYERS, TOP_K)
    assert len(out["meta_info"]["segments"]) == 1  # no attempt failed on the final frame's size


@pytest.mark.parametrize("rig", [[Faults(token_delay_s=0.01), Faults()]], indirect=True)
async def test_a_quarantine_cuts_a_sequence_with_experts_back_to_its_last_vouched_token(rig: Rig) -> None:
    """Issue 46, item 5: a sequence that asked for its routed experts is cut back like any other when its box is
    quarantined (it used to restart from its prompt): it keeps the tokens a passing probe vouched for and their
    rows, and the next engine is asked only from there, so the answer equals one engine's uninterrupted."""
    a, b = rig.register(0, 1)
    registry = rig.generator.dispatcher.registry
    assert registry.transition(b, State.SYNCING, "test: not yet")
    task = asyncio.ensure_future(rig.run(body(40)))
    await async_wait_until(lambda: rig.faults[0].emitted_tokens >= 5, 20)
    assert rig.generator.migrator.mark(a, 0)() == 1  # what a passing probe sent now vouches for
    vouched = rig.faults[0].emitted_tokens
    await async_wait_until(lambda: rig.faults[0].emitted_tokens >= vouched + 4, 20)
    assert registry.transition(b, State.ACTIVE, "test: now")
    assert registry.quarantine(a, "test: caught")  # what Quarantine.quarantine does, then the cut-back
    assert rig.generator.evict(a, "quarantined: test: caught", cut=True) == 1
    out = await task
    reference = await _alone(rig, 40)
    assert out["output_ids"] == reference["output_ids"]
    assert (rows(out["meta_info"]) == rows(reference["meta_info"])).all()
    first, rest = out["meta_info"]["segments"][0], out["meta_info"]["segments"][1:]
    kept = first["end"]
    assert first["instance"] == a.id and 0 < kept and f"cut back at token {kept}" in first["outcome"]
    assert {s["instance"] for s in rest} == {b.id}
    (cut,) = out["meta_info"]["discarded_segments"]
    assert cut["instance"] == a.id and cut["start"] == kept and cut["outcome"].startswith("distrusted")
    (cont,) = rig.requests[1]
    assert cont["input_ids"] == PROMPT + out["output_ids"][:kept]  # from the last vouched token, not the prompt
    assert cont["routed_experts_start_len"] == len(PROMPT) + kept - 1  # only the rows it lacks
