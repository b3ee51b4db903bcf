"""Divided rollouts (issue 40, item 2), in process: a Generator over a Dispatcher and fake SGLang servers.

A long sequence is generated in pieces, each placed again; the caller must see exactly the undivided
sequence (the fake model is greedy: ``fakes.reference``), its segments, and an undivided answer's meta_info.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
from fakes import FakeSGLang, reference, register_active, start_fakes
from fakes import HealthRecorder as Health
from support import as_json, async_wait_until
from test_routed_experts import PROMPT as R3_PROMPT
from test_routed_experts import _alone, rows
from test_routed_experts import body as r3_body
from test_routed_experts import rig as r3_rig  # noqa: F401  (the R3 tests' fixture: CPU engines in process)

from rollout_manager.instances.registry import Instance, Registry, State
from rollout_manager.placement.ask import Ask
from rollout_manager.placement.dispatch import Dispatcher
from rollout_manager.placement.least_in_flight import LeastInFlight
from rollout_manager.placement.lengths import LengthModel
from rollout_manager.placement.local_budget import LocalBudget
from rollout_manager.rollout.attempt_segments import AttemptSegments
from rollout_manager.rollout.generation import GenerationSettings, Generator
from rollout_manager.rollout.pieces import PieceSettings
from rollout_manager.rollout.request import decode
from rollout_manager.rollout.sequence import PIECE_END, SequenceState
from rollout_manager.sglang.client import SGLangClient
from rollout_manager.sglang.finish import FinalMeta, VersionSpan
from rollout_manager.sglang.generate_request import SequenceBody, continuation
from rollout_manager.sglang.piece_meta import PieceTally

PROMPT = [5, 17, 42]
PIECES = PieceSettings(tokens=8, min_budget=16, max_tokens=16)
SETTINGS = GenerationSettings(max_attempts=3, wait_timeout_s=0.5, connect_timeout_s=2.0, stall_timeout_s=0.3,
                              engine_stream_interval=1, pieces=PIECES)


def body(n: int, **params: Any) -> dict[str, Any]:
    return {"input_ids": list(PROMPT), "sampling_params": {"temperature": 0, "max_new_tokens": n, **params}}


# ------------------------------------------------------------------ sizes and bodies (pure)


def test_piece_sizes_start_at_the_predicted_median_and_grow_with_the_sequence() -> None:
    s = PieceSettings(tokens=256, min_budget=1024, max_tokens=2048)
    assert not s.applies(1023) and s.applies(1024) and not s.applies(None)
    assert not PieceSettings(tokens=0).applies(100_000)  # 0: off
    assert s.size(0, 4096) == 256  # no prediction: the smallest piece
    assert s.size(0, 4096, median=700.4) == 700  # the group's median
    assert s.size(0, 4096, median=90.0) == 256 and s.size(0, 4096, median=9000.0) == 2048
    assert s.size(256, 3840) == 256 and s.size(700, 3000) == 700 and s.size(3000, 1096) is None
    assert s.size(2048, 2048) is None  # the piece would hold all that is left: it runs to its end


def test_a_piece_caps_max_and_min_new_tokens() -> None:
    seq = SequenceBody.of(body(100, min_new_tokens=50))
    sent = continuation(seq, [1] * 10, rid="r~1", piece=16)
    assert (sent.sampling.max_new_tokens, sent.sampling.min_new_tokens) == (16, 16)
    last = continuation(seq, [1] * 90, rid="r~2", piece=16)
    assert (last.sampling.max_new_tokens, last.sampling.min_new_tokens) == (10, 0)
    assert continuation(seq, [1] * 10, rid="r~1").sampling.max_new_tokens == 90  # no piece: all that is left


@pytest.mark.parametrize("extra", [
    {"sampling_params": {"frequency_penalty": 0.5}}, {"sampling_params": {"repetition_penalty": 1.1}},
    {"sampling_params": {"stop": ["\n\n"]}}, {"sampling_params": {"regex": "[a-z]+"}},
    {"sampling_params": {"n": 2}}, {"sampling_params": {"max_new_tokens": None}},
    {"return_logprob": True, "logprob_start_len": 0}, {"custom_logit_processor": "x"},
    {"return_hidden_states": True}, {"session_params": {"id": "s"}}, {"max_thinking_tokens": 100},
])
def test_bodies_whose_continuation_is_not_exact_are_not_divided(extra: dict[str, Any]) -> None:
    raw = body(4096)
    raw = {**raw, **extra, "sampling_params": {**raw["sampling_params"], **extra.get("sampling_params", {})}}
    assert not SequenceBody.of(raw).divisible
    assert SequenceBody.of(body(4096, repetition_penalty=1.0, stop=[], top_p=0.9)).divisible
    assert SequenceBody.of({**body(4096), "return_logprob": True, "top_logprobs_num": 2}).divisible


def test_the_tally_says_the_counts_of_the_whole_sequence() -> None:
    tally = PieceTally()
    piece = FinalMeta("0", other={"cached_tokens": 90, "reasoning_tokens": 8,
                                  "cached_tokens_details": {"device": 90, "host": 0}})
    tally.add(piece, prompt=100, made_before=0)
    tally.add(FinalMeta("0", other={"cached_tokens": 107, "reasoning_tokens": 8}), 100, 8)  # stayed: 1 recomputed
    stayed = FinalMeta("0", other={"cached_tokens": 115, "reasoning_tokens": 4, "output_token_logprobs_length": 4,
                                   "cached_tokens_details": {"device": 115, "host": 0}})
    logprobs = [[0.0, 1, None]] * 20
    whole = replace(tally)
    whole.sums = dict(tally.sums)
    whole.add(stayed, 100, 16)
    # every piece stayed: what the cache served of the caller's prompt, as an undivided answer says it
    assert whole.merged(stayed, 20, {}, logprobs).other == {"cached_tokens": 90, "reasoning_tokens": 20,
                                                     "output_token_logprobs_length": 20,
                                                     "cached_tokens_details": {"device": 90, "host": 0}}
    moved = FinalMeta("0", other={"cached_tokens": 0, "reasoning_tokens": 4})
    tally.add(moved, 100, 16)  # moved: 116 prefilled again, one of them an undivided run computes too
    assert tally.merged(moved, 20, {}, logprobs).other == {"cached_tokens": max(90 - 115, 0), "reasoning_tokens": 20}


# ------------------------------------------------------------------ through the generator


@dataclass
class Rig:
    registry: Registry
    dispatcher: Dispatcher
    generator: Generator
    health: Health
    fakes: list[FakeSGLang]


@pytest.fixture
async def rig(request: pytest.FixtureRequest) -> AsyncIterator[Rig]:
    settings = getattr(request, "param", SETTINGS)
    fakes = await start_fakes(2)
    async with aiohttp.ClientSession() as session:
        registry = Registry()
        dispatcher = Dispatcher(registry, LeastInFlight())
        health = Health()
        generator = Generator(dispatcher, SGLangClient(session), settings, LocalBudget(0.0, 0.0, 1.0),
                              on_instance_failure=health.failure, on_instance_success=health.success)
        try:
            yield Rig(registry, dispatcher, generator, health, fakes)
        finally:
            for fake in fakes:
                await fake.close()


async def generate_one(generator: Generator, b: dict[str, Any]) -> dict[str, Any]:
    out = as_json(await generator.generate(decode(b)))
    assert isinstance(out, dict)
    return out


def spans(meta: dict[str, Any]) -> list[tuple[str, int, int, str]]:
    return [(s["instance"], s["start"], s["end"], s["outcome"]) for s in meta["segments"]]


def regenerated(meta: dict[str, Any]) -> int:
    """Tokens the segments hold beyond the sequence's: 0 when no token was made twice."""
    return sum(s["end"] - s["start"] for s in meta["segments"]) - meta["completion_tokens"]


async def test_a_divided_sequence_stays_on_its_instance_in_one_segment(rig: Rig) -> None:
    a, _ = register_active(rig.registry, rig.fakes)
    out = await generate_one(rig.generator, {**body(40), "rid": "long"})
    assert out["output_ids"] == reference(PROMPT, 40)
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 40}  # the budget's end, not a piece's
    assert (meta["completion_tokens"], meta["prompt_tokens"], meta["id"]) == (40, 3, "long")
    assert spans(meta) == [(a.id, 0, 40, "finished")] and regenerated(meta) == 0
    sent = rig.fakes[0].requests
    # pieces of 8, 8, 16 (as long as the sequence so far), then the last 8 as the rest of the budget
    assert [r["sampling_params"]["max_new_tokens"] for r in sent] == [8, 8, 16, 8]
    assert [r["input_ids"] for r in sent] == [PROMPT + reference(PROMPT, n) for n in (0, 8, 16, 32)]
    assert len({r["rid"] for r in sent}) == 4 and len({r["sampling_params"]["sampling_seed"] for r in sent}) == 1
    assert rig.fakes[1].requests == []
    stats = rig.generator.stats
    assert (stats["pieces"], stats["continuations"], stats["failed"], stats["migrated"]) == (3, 0, 0, 0)
    assert rig.health.failures == [] and (a.load.in_flight, a.load.in_flight_tokens) == (0, 0)
    assert out["text"] == "x" * 40  # each piece's text, joined


async def test_small_budgets_and_inexact_bodies_run_whole(rig: Rig) -> None:
    register_active(rig.registry, rig.fakes[:1])
    await generate_one(rig.generator, body(15))  # below piece_min_budget
    await generate_one(rig.generator, body(40, presence_penalty=0.3))
    assert [r["sampling_params"]["max_new_tokens"] for r in rig.fakes[0].requests] == [15, 40]
    assert rig.generator.stats["pieces"] == 0


async def test_a_piece_placed_elsewhere_starts_a_segment_and_the_last_one_says_where(rig: Rig) -> None:
    a, b = register_active(rig.registry, rig.fakes)

    def drain_a_at_the_first_boundary(chunk: dict[str, Any], k: int) -> dict[str, Any]:
        if chunk["meta_info"]["finish_reason"] is not None and a.state == State.ACTIVE:
            rig.registry.transition(a, State.DRAINING, "test: leaves")
        return chunk

    rig.fakes[0].rewrite = drain_a_at_the_first_boundary
    out = await generate_one(rig.generator, body(40))
    assert out["output_ids"] == reference(PROMPT, 40)
    meta = out["meta_info"]
    assert spans(meta) == [(a.id, 0, 8, f"piece ended; the next piece ran on {b.endpoint}"),
                           (b.id, 8, 40, "finished")]
    assert regenerated(meta) == 0
    assert rig.generator.stats["continuations"] == 0 and rig.health.failures == []


async def test_an_instance_dying_mid_piece_continues_elsewhere_exactly(rig: Rig) -> None:
    dying, _ = rig.fakes
    dying.die_after_tokens = 5  # in the first piece (of 8)
    a, b = register_active(rig.registry, rig.fakes)
    out = await generate_one(rig.generator, body(40))
    assert out["output_ids"] == reference(PROMPT, 40)
    meta = out["meta_info"]
    assert [(i, s, e) for i, s, e, _ in spans(meta)] == [(a.id, 0, 5), (b.id, 5, 40)] and regenerated(meta) == 0
    assert spans(meta)[0][3].startswith("failed")
    # after the failure: a piece as long as the sequence so far (at least 8), then 13, then the 14 left
    assert [r["sampling_params"]["max_new_tokens"] for r in rig.fakes[1].requests] == [8, 13, 14]
    assert (rig.generator.stats["continuations"], rig.generator.stats["pieces"]) == (1, 2)


async def test_the_answer_counts_over_every_piece(rig: Rig) -> None:
    (a,) = register_active(rig.registry, rig.fakes[:1])

    def engine_counts(chunk: dict[str, Any], k: int) -> dict[str, Any]:
        meta = chunk["meta_info"]
        if meta["finish_reason"] is not None:  # a prefix cache that holds everything but the last token
            meta.update(cached_tokens=meta["prompt_tokens"] - 1, reasoning_tokens=meta["completion_tokens"])
        return chunk

    rig.fakes[0].rewrite = engine_counts
    out = await generate_one(rig.generator, body(40))
    meta = out["meta_info"]
    assert (meta["cached_tokens"], meta["reasoning_tokens"]) == (2, 40)  # the prompt's 3 but one; 8+8+16+8
    assert spans(out["meta_info"]) == [(a.id, 0, 40, "finished")]


async def test_a_streaming_caller_sees_one_growing_sequence(rig: Rig) -> None:
    register_active(rig.registry, rig.fakes)
    seen: list[list[int]] = []
    final: dict[str, Any] = {}
    async for chunks in rig.generator.generate_stream(decode({**body(40), "stream": True})):
        for chunk in chunks:
            out = as_json(chunk)
            seen.append(out["output_ids"])
            if out["meta_info"]["finish_reason"] is not None:
                final = out
    ref = reference(PROMPT, 40)
    assert all(ids == ref[:len(ids)] for ids in seen)
    assert [len(ids) for ids in seen] == sorted(len(ids) for ids in seen)  # it never goes back
    assert final["output_ids"] == ref and final["meta_info"]["finish_reason"] == {"type": "length", "length": 40}
    assert rig.generator.stats["pieces"] == 3


async def test_each_sequence_of_a_batch_is_divided_on_its_own(rig: Rig) -> None:
    register_active(rig.registry, rig.fakes)
    prompts = [[1, 2], [3], [4, 5, 6]]
    outs = as_json(await rig.generator.generate(decode(
        {"input_ids": prompts, "sampling_params": {"temperature": 0, "max_new_tokens": 24}})))
    assert isinstance(outs, list)
    for p, o in zip(prompts, outs):
        assert o["output_ids"] == reference(p, 24) and regenerated(o["meta_info"]) == 0
        segments = o["meta_info"]["segments"]
        assert segments[0]["start"] == 0 and segments[-1]["end"] == 24
        assert all(x["end"] == y["start"] for x, y in zip(segments, segments[1:]))
    assert rig.generator.stats["pieces"] == 3 * 2  # 8 + 8 + the last 8


async def test_each_boundary_asks_for_the_instance_it_is_on_with_what_is_still_expected(rig: Rig) -> None:
    rig.generator.lengths = LengthModel()
    a, _ = register_active(rig.registry, rig.fakes)
    asked: list[Ask] = []
    acquire = rig.dispatcher.acquire

    async def recording(ask: Ask, timeout_s: float) -> Instance:
        asked.append(ask)
        return await acquire(ask, timeout_s)

    rig.dispatcher.acquire = recording  # type: ignore[method-assign]
    out = await generate_one(rig.generator, body(40))
    assert out["output_ids"] == reference(PROMPT, 40)
    assert [q.prefer for q in asked] == [None, a.id, a.id]
    # the first piece is the predicted median (the fleet's prior, within the budget: 40), so the largest piece
    assert [q.tokens for q in asked] == [16, 16, 8]  # what each placement may make
    predicted = [q.predicted for q in asked]
    assert all(isinstance(p, float) and 0 <= p <= 40 - made for p, made in zip(predicted, (0, 16, 32)))


ONCE = replace(SETTINGS, engine_stream_interval=16)


@pytest.mark.parametrize("rig", [ONCE], indirect=True)
async def test_pieces_that_fit_one_chunk_interval_are_one_answer_each(rig: Rig) -> None:
    (a,) = register_active(rig.registry, rig.fakes[:1])
    out = await generate_one(rig.generator, body(40))
    assert out["output_ids"] == reference(PROMPT, 40)
    assert spans(out["meta_info"]) == [(a.id, 0, 40, "finished")]
    sent = rig.fakes[0].requests
    assert [(r["stream"], r["sampling_params"]["max_new_tokens"]) for r in sent] == \
        [(False, 8), (False, 8), (False, 16), (False, 8)]


STALENESS = replace(SETTINGS, max_staleness=0, staleness_action="restart")


@pytest.mark.parametrize("rig", [STALENESS], indirect=True)
async def test_a_boundary_never_restarts_a_stale_sequence(rig: Rig) -> None:
    a, b = register_active(rig.registry, rig.fakes)
    assert rig.registry.transition(b, State.SYNCING, "test: takes v1")

    def new_version_at_the_first_boundary(chunk: dict[str, Any], k: int) -> dict[str, Any]:
        if chunk["meta_info"]["finish_reason"] is not None and b.state != State.ACTIVE:
            rig.registry.set_weight_version(b, 1)  # the fleet moves on: a continuation elsewhere would restart
            assert rig.registry.transition(b, State.ACTIVE, "test: at v1")
        return chunk

    rig.fakes[0].rewrite = new_version_at_the_first_boundary
    out = await generate_one(rig.generator, body(40))
    assert out["output_ids"] == reference(PROMPT, 40)
    assert [(i, s, e) for i, s, e, _ in spans(out["meta_info"])] == [(a.id, 0, 40)]  # stayed where it was
    assert rig.generator.stats["stale_restarts"] == 0 and "discarded_segments" not in out["meta_info"]


# ------------------------------------------------------------------ routed experts (R3), on CPU engines in process


async def test_a_divided_sequence_gets_the_experts_of_one_uninterrupted_engine(r3_rig: Any) -> None:  # noqa: F811
    """Each piece asks its engine only for the rows the sequence lacks; together they are one engine's."""
    r3_rig.generator.settings = replace(r3_rig.generator.settings, pieces=PIECES)
    r3_rig.register(0)
    out = await r3_rig.run(r3_body(40))
    reference = await _alone(r3_rig, 40)
    assert out["output_ids"] == reference["output_ids"]
    assert (rows(out["meta_info"]) == rows(reference["meta_info"])).all()
    sent = r3_rig.requests[0]
    assert [r["routed_experts_start_len"] for r in sent] == [0] + [len(R3_PROMPT) + n - 1 for n in (8, 16, 32)]
    assert r3_rig.generator.stats["pieces"] == 3


async def test_a_sequence_moved_off_its_instance_mid_piece_goes_on_in_pieces(rig: Rig) -> None:
    rig.fakes[0].stall_after_tokens = 4  # in the first piece: it sits there until moved
    a, b = register_active(rig.registry, rig.fakes)
    task = asyncio.ensure_future(generate_one(rig.generator, body(40)))
    await async_wait_until(lambda: len(rig.fakes[0].requests) == 1)
    assert rig.registry.transition(a, State.DRAINING, "test: drain") and rig.generator.evict(a, "test: drain") == 1
    out = await task
    assert out["output_ids"] == reference(PROMPT, 40)
    meta = out["meta_info"]
    assert spans(meta) == [(a.id, 0, 4, "migrated to another instance (test: drain)"), (b.id, 4, 40, "finished")]
    assert [r["sampling_params"]["max_new_tokens"] for r in rig.fakes[1].requests] == [8, 12, 16]
    stats = rig.generator.stats
    assert (stats["evicted"], stats["pieces"], stats["failed"]) == (1, 2, 0) and regenerated(meta) == 0


async def test_a_boundary_leaves_a_box_rolled_back_below_the_sequences_version(rig: Rig) -> None:
    a, b = register_active(rig.registry, rig.fakes)
    for inst, fake in zip((a, b), rig.fakes):
        rig.registry.set_weight_version(inst, 2)
        fake.weight_version = "2"

    acquire = rig.dispatcher.acquire

    async def roll_a_back_at_the_first_boundary(ask: Ask, timeout_s: float) -> Instance:
        if ask.prefer == a.id:
            rig.registry.set_weight_version(a, 1)
        return await acquire(ask, timeout_s)

    rig.dispatcher.acquire = roll_a_back_at_the_first_boundary  # type: ignore[method-assign]
    out = await generate_one(rig.generator, {**body(40), "min_weight_version": 2})
    assert out["output_ids"] == reference(PROMPT, 40)
    assert spans(out["meta_info"]) == [(a.id, 0, 8, f"piece ended; the next piece ran on {b.endpoint}"),
                                       (b.id, 8, 40, "finished")]
    assert rig.health.failures == []  # never sent back to a to be refused there


def test_a_piece_on_the_same_box_extends_its_segment_and_a_new_version_cuts_it_as_undivided() -> None:
    box = SimpleNamespace(id="a", endpoint="127.0.0.1:1")
    seq = SequenceState(body=SequenceBody.of(body(40)), rid="r")
    first = AttemptSegments(seq, box)  # type: ignore[arg-type]
    seq.output_ids.extend(range(8))
    first.advance("0", 8)
    first.current.outcome = PIECE_END
    second = AttemptSegments(seq, box)  # type: ignore[arg-type]
    assert second.current is first.current and second.start == 8
    seq.output_ids.extend(range(8))
    second.advance("0", 5)
    second.advance("1", 3)  # staged activation under the second piece, per chunk
    second.exact([VersionSpan("0", 0, 6), VersionSpan("1", 6, 8)])  # SGLang's exact spans of the second piece
    assert [(s.weight_version, s.start, s.end) for s in seq.segments] == [("0", 0, 14), ("1", 14, 16)]
    assert seq.segments[0].outcome == "weight version 1 from token 14" and 1 in seq.versions
    second.current.outcome = PIECE_END
    third = AttemptSegments(seq, SimpleNamespace(id="b", endpoint="127.0.0.1:2"))  # type: ignore[arg-type]
    assert [(s.instance, s.start, s.end) for s in seq.segments] == [("a", 0, 14), ("a", 14, 16), ("b", 16, 16)]
    assert seq.segments[1].outcome == "piece ended; the next piece ran on 127.0.0.1:2" and third.start == 16
