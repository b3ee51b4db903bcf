"""Generation with continuation, in process: a Generator over a Dispatcher and two fake SGLang servers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from fakes import FakeSGLang, reference, register_active, start_fakes
from fakes import HealthRecorder as Health
from support import as_json

from rollout_manager.instances.registry import Registry
from rollout_manager.placement.dispatch import Dispatcher
from rollout_manager.placement.least_in_flight import LeastInFlight
from rollout_manager.placement.local_budget import LocalBudget
from rollout_manager.rollout.generation import GenerationFailed, GenerationSettings, Generator
from rollout_manager.rollout.request import decode
from rollout_manager.sglang.client import SGLangClient

PROMPT = [5, 17, 42]
# A chunk per token: the tests below see exactly where a stream was cut. Short non-streaming sequences
# get one answer from the engine instead (see the tests at the end, which use an interval of 16).
SETTINGS = GenerationSettings(max_attempts=3, wait_timeout_s=0.2, connect_timeout_s=2.0, stall_timeout_s=0.3,
                              engine_stream_interval=1)


@dataclass
class Rig:
    registry: Registry
    dispatcher: Dispatcher
    generator: Generator
    health: Health
    fakes: list[FakeSGLang]
    finished: list[tuple[float, int, bool]]


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    fakes = await start_fakes(2)
    async with aiohttp.ClientSession() as session:
        registry = Registry()
        dispatcher = Dispatcher(registry, LeastInFlight())
        health = Health()
        generator = Generator(dispatcher, SGLangClient(session), SETTINGS, LocalBudget(0.0, 0.0, 1.0),
                              on_instance_failure=health.failure, on_instance_success=health.success)
        finished: list[tuple[float, int, bool]] = []
        generator.finished_listeners.append(lambda latency, tokens, ok: finished.append((latency, tokens, ok)))
        try:
            yield Rig(registry, dispatcher, generator, health, fakes, finished)
        finally:
            for fake in fakes:
                await fake.close()


def body(max_new_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"input_ids": list(PROMPT), "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens},
            **extra}


async def generate_one(generator: Generator, b: dict[str, Any]) -> dict[str, Any]:
    out = as_json(await generator.generate(decode(b)))
    assert isinstance(out, dict)
    return out


async def test_a_sequence_runs_on_one_instance(rig: Rig) -> None:
    a, _ = register_active(rig.registry, rig.fakes)
    out = await generate_one(rig.generator, body(6, rid="r1"))
    assert out["output_ids"] == reference(PROMPT, 6)
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert [(s["instance"], s["start"], s["end"], s["outcome"]) for s in meta["segments"]] == \
        [(a.id, 0, 6, "finished")]
    assert rig.health.successes == [a.id] and a.load.in_flight == 0 and a.load.in_flight_tokens == 0
    assert meta["id"] == "r1"  # the caller's id for the caller; the engine gets the manager's own
    assert rig.fakes[0].requests[0]["rid"].startswith("rm-") and rig.fakes[0].requests[0]["stream"] is True


async def test_a_sequence_that_dies_midway_continues_with_the_exact_tokens(rig: Rig) -> None:
    dying, healthy = rig.fakes
    dying.die_after_tokens = 4
    a, b = register_active(rig.registry, rig.fakes)  # least in flight, ties by id: a goes first
    out = await generate_one(rig.generator, body(10, rid="seq"))

    assert out["output_ids"] == reference(PROMPT, 10)  # nothing lost, nothing made twice
    made = reference(PROMPT, 4)
    (cont,) = healthy.requests
    assert cont["input_ids"] == PROMPT + made
    assert cont["sampling_params"]["max_new_tokens"] == 10 - 4
    assert cont["rid"] == dying.requests[0]["rid"] + "~1" and out["meta_info"]["id"] == "seq"
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 10}  # counted from 0, not from the restart
    assert meta["completion_tokens"] == 10 and meta["prompt_tokens"] == len(PROMPT)
    segments = [(s["instance"], s["start"], s["end"]) for s in meta["segments"]]
    assert segments == [(a.id, 0, 4), (b.id, 4, 10)]
    assert meta["segments"][0]["outcome"].startswith("failed: ")
    assert meta["segments"][1]["outcome"] == "finished"
    assert [iid for iid, _ in rig.health.failures] == [a.id] and rig.health.successes == [b.id]
    assert rig.generator.stats["continuations"] == 1
    assert (a.load.in_flight, a.load.in_flight_tokens, b.load.in_flight, b.load.in_flight_tokens) == (0, 0, 0, 0)
    assert out["text"] is None  # the dead segment's text is unknown


async def test_a_4xx_goes_back_to_the_caller_and_is_not_held_against_the_instance(rig: Rig) -> None:
    rig.fakes[0].reject_status = rig.fakes[1].reject_status = 400  # a second instance agrees: the caller's
    a, b = register_active(rig.registry, rig.fakes)
    with pytest.raises(GenerationFailed) as err:
        await rig.generator.generate(decode(body(5)))
    assert err.value.status == 400 and "fake engine refuses with 400" in str(err.value)
    assert [len(f.requests) for f in rig.fakes] == [1, 1]  # one other instance asked, no more
    assert rig.health.failures == [] and a.health.consecutive_failures == 0
    assert a.load.in_flight == 0 and a.load.in_flight_tokens == 0
    assert rig.fakes[0].aborted == []


async def test_a_streaming_caller_gets_the_failure_as_sglangs_error_chunk(rig: Rig) -> None:
    rig.fakes[0].reject_status = rig.fakes[1].reject_status = 400
    register_active(rig.registry, rig.fakes)
    chunks: list[Any] = []
    async for ready in rig.generator.generate_stream(decode(body(5, stream=True))):
        chunks.extend(as_json(ready))
    assert len(chunks) == 1 and set(chunks[0]) == {"error"}, chunks
    error = chunks[0]["error"]
    assert error["code"] == 400 and error["type"] == "BadRequest"
    assert "fake engine refuses with 400" in error["message"]


async def test_attempts_exhausted_is_a_502(rig: Rig) -> None:
    for fake in rig.fakes:
        fake.reject_status = 500
    register_active(rig.registry, rig.fakes)
    rig.health.marks = False  # the instances recover between attempts, so only the attempt limit stops it
    with pytest.raises(GenerationFailed) as err:
        await rig.generator.generate(decode(body(5, rid="doomed")))
    assert err.value.status == 502
    assert "sequence doomed failed on 3 attempt(s) (limit 3)" in str(err.value)
    assert sum(len(f.requests) for f in rig.fakes) == SETTINGS.max_attempts
    assert rig.finished and rig.finished[-1][1:] == (0, False)


async def test_a_sequence_failing_everywhere_waits_for_a_recovered_instance_then_503s(rig: Rig) -> None:
    for fake in rig.fakes:
        fake.reject_status = 503
    register_active(rig.registry, rig.fakes)
    with pytest.raises(GenerationFailed) as err:
        await rig.generator.generate(decode(body(5)))
    assert err.value.status == 503 and "within 0.2s" in str(err.value)
    assert sum(len(f.requests) for f in rig.fakes) == 2  # each once; neither recovered since


async def test_no_instance_is_a_503_within_the_wait_timeout(rig: Rig) -> None:
    with pytest.raises(GenerationFailed) as err:
        await rig.generator.generate(decode(body(5)))
    assert err.value.status == 503
    assert str(err.value) == "no rollout instance could take the request within 0.2s (0 active)"


async def test_a_stalled_stream_continues_elsewhere(rig: Rig) -> None:
    stalling, healthy = rig.fakes
    stalling.stall_after_tokens = 2
    a, b = register_active(rig.registry, rig.fakes)
    out = await generate_one(rig.generator, body(5))
    assert out["output_ids"] == reference(PROMPT, 5)
    assert "stream_stall_timeout_s" in out["meta_info"]["segments"][0]["outcome"]  # either stall message names it
    assert healthy.requests[0]["input_ids"] == PROMPT + reference(PROMPT, 2)


async def test_finished_listeners_are_told_once_per_sequence(rig: Rig) -> None:
    rig.fakes[0].die_after_tokens = 2  # a continuation is still one sequence
    register_active(rig.registry, rig.fakes)
    out = await rig.generator.generate(decode({"input_ids": [list(PROMPT), [1, 2]],
                                               "sampling_params": {"temperature": 0, "max_new_tokens": 4}}))
    out = as_json(out)
    assert isinstance(out, list) and [o["index"] for o in out] == [0, 1]
    assert sorted((tokens, ok) for _, tokens, ok in rig.finished) == [(4, True), (4, True)]
    rig.fakes[1].reject_status = rig.fakes[0].reject_status = 422
    with pytest.raises(GenerationFailed):
        await rig.generator.generate(decode(body(3)))
    assert len(rig.finished) == 3 and rig.finished[-1][1:] == (0, False)


SCHEDULER_REFUSAL = {"type": "abort", "message": "Input length (3 tokens) exceeds the maximum allowed length",
                     "status_code": 400, "err_type": "BadRequestError"}


async def test_an_abort_with_a_4xx_status_is_the_callers_error_not_the_instances(rig: Rig) -> None:
    rig.fakes[0].abort_finish = rig.fakes[1].abort_finish = SCHEDULER_REFUSAL
    a, b = register_active(rig.registry, rig.fakes)
    for _ in range(3):
        with pytest.raises(GenerationFailed) as err:
            await rig.generator.generate(decode(body(5)))
        assert err.value.status == 400 and "exceeds the maximum allowed length" in str(err.value)
    assert [len(f.requests) for f in rig.fakes] == [3, 3]  # each once asked a second instance, no more
    assert rig.health.failures == [] and a.health.consecutive_failures == 0
    assert a.load.in_flight == 0 and a.load.in_flight_tokens == 0


@pytest.mark.parametrize("status", [None, 503])
async def test_an_abort_with_no_status_or_a_5xx_is_an_instance_failure(rig: Rig, status: int | None) -> None:
    rig.fakes[0].abort_finish = {**SCHEDULER_REFUSAL, "status_code": status, "message": "engine trouble"}
    a, b = register_active(rig.registry, rig.fakes)
    out = await generate_one(rig.generator, body(5))
    assert out["output_ids"] == reference(PROMPT, 5)
    assert [iid for iid, _ in rig.health.failures] == [a.id] and rig.health.successes == [b.id]


async def test_max_new_tokens_zero_is_answered_without_an_instance(rig: Rig) -> None:
    out = await generate_one(rig.generator, body(0, return_logprob=True, rid="z"))
    meta = out["meta_info"]
    assert out["output_ids"] == [] and out["text"] == ""
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    assert meta["output_token_logprobs"] == [] and meta["completion_tokens"] == 0
    assert meta["prompt_tokens"] == len(PROMPT) and meta["id"] == "z"
    assert meta["weight_version"] == "0" and meta["segments"] == []
    assert not any(f.requests for f in rig.fakes)


async def test_no_token_limit_continues_to_the_context_end(rig: Rig) -> None:
    dying, healthy = rig.fakes
    dying.die_after_tokens = 130  # past SGLang's default budget of 128
    register_active(rig.registry, rig.fakes)
    out = await generate_one(rig.generator, body(None))  # type: ignore[arg-type]
    total = dying.context_len - len(PROMPT)
    assert out["output_ids"] == reference(PROMPT, total)
    assert healthy.requests[0]["sampling_params"]["max_new_tokens"] is None
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": total}


async def test_a_string_rid_names_batch_items_as_sglang_does(rig: Rig) -> None:
    register_active(rig.registry, rig.fakes)
    b = {"input_ids": [PROMPT, PROMPT[:2]], "sampling_params": {"temperature": 0, "max_new_tokens": 3}, "rid": "b"}
    out = as_json(await rig.generator.generate(decode(b)))
    assert isinstance(out, list) and [o["meta_info"]["id"] for o in out] == ["b_0", "b_1"]
    sent = [r["rid"] for f in rig.fakes for r in f.requests]
    assert len(set(sent)) == 2 and all(rid.startswith("rm-") for rid in sent)  # the engines get the manager's


async def test_callers_that_reuse_one_id_get_their_own_sequences(rig: Rig) -> None:
    """verl's agent loop with full_determinism names concurrent requests det-{n}: the engines must still
    see one id per attempt (SGLang refuses a running id again, and an abort by id must hit one sequence)."""
    register_active(rig.registry, rig.fakes)
    outs = await asyncio.gather(*(generate_one(rig.generator, body(4, rid="det-0")) for _ in range(4)))
    assert [o["meta_info"]["id"] for o in outs] == ["det-0"] * 4
    assert all(o["output_ids"] == reference(PROMPT, 4) for o in outs)
    sent = [r["rid"] for f in rig.fakes for r in f.requests]
    assert len(sent) == 4 and len(set(sent)) == 4


async def test_stream_chunks_carry_the_cumulative_text(rig: Rig) -> None:
    rig.fakes[0].stall_after_tokens = 2  # so that a partial chunk surely goes out before the end
    register_active(rig.registry, rig.fakes[:1])
    chunks: list[dict[str, Any]] = []
    async for batch in rig.generator.generate_stream(decode(body(4))):
        chunks.extend(as_json(batch))
        rig.fakes[0].unstall()
    assert len(chunks) >= 2 and chunks[0]["meta_info"]["finish_reason"] is None
    for c in chunks:  # the fake's text is one "x" per token, cumulative, as SGLang's
        assert c["text"] == "x" * len(c["output_ids"])


async def test_every_engine_request_carries_the_managers_stream_interval(rig: Rig) -> None:
    """The manager picks how often engines send chunks; a non-streaming caller's value cannot matter to it."""
    register_active(rig.registry, rig.fakes[:1])
    out = await generate_one(rig.generator, body(4))
    assert out["output_ids"] == reference(PROMPT, 4)
    own = body(4)
    own["sampling_params"]["stream_interval"] = 3
    await generate_one(rig.generator, own)
    sent = [r["sampling_params"]["stream_interval"] for r in rig.fakes[0].requests]
    assert sent == [SETTINGS.engine_stream_interval] * 2
    assert "stream_interval" not in own["sampling_params"] or own["sampling_params"]["stream_interval"] == 3


async def test_a_streaming_callers_own_stream_interval_is_respected(rig: Rig) -> None:
    register_active(rig.registry, rig.fakes[:1])
    own = body(4)
    own["sampling_params"]["stream_interval"] = 2
    async for _ in rig.generator.generate_stream(decode(own)):
        pass
    async for _ in rig.generator.generate_stream(decode(body(4))):
        pass
    sent = [r["sampling_params"]["stream_interval"] for r in rig.fakes[0].requests]
    assert sent == [2, SETTINGS.engine_stream_interval]


# ---------------------------------------------------------------- short sequences: one answer, no stream


def short_rig(rig: Rig) -> Generator:
    """The rig's generator with a chunk interval of 16: budgets up to 16 are asked in one answer."""
    settings = GenerationSettings(**{**SETTINGS.__dict__, "engine_stream_interval": 16})
    return Generator(rig.dispatcher, rig.generator.client, settings, rig.generator.budget,
                     on_instance_failure=rig.health.failure, on_instance_success=rig.health.success)


async def test_a_short_non_streaming_sequence_asks_the_engine_for_one_answer(rig: Rig) -> None:
    register_active(rig.registry, rig.fakes[:1])
    gen = short_rig(rig)
    out = await generate_one(gen, body(8, return_logprob=False))
    assert out["output_ids"] == reference(PROMPT, 8)
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    sent = rig.fakes[0].requests[0]
    assert sent["stream"] is False and "stream_interval" not in sent["sampling_params"]
    # Longer than one interval, or a caller that streams: the engine streams.
    await generate_one(gen, body(17))
    async for _ in gen.generate_stream(decode(body(8))):
        pass
    assert [r["stream"] for r in rig.fakes[0].requests[1:]] == [True, True]


async def test_a_short_sequence_whose_engine_dies_is_made_again_exactly_elsewhere(rig: Rig) -> None:
    dying, healthy = rig.fakes
    dying.die_after_tokens = 3
    a, b = register_active(rig.registry, rig.fakes)
    out = await generate_one(short_rig(rig), body(8, rid="s"))
    assert out["output_ids"] == reference(PROMPT, 8)  # the lost tokens (<= one interval) are made again
    (cont,) = healthy.requests
    assert cont["input_ids"] == PROMPT and cont["sampling_params"]["max_new_tokens"] == 8
    assert [(s["instance"], s["start"], s["end"]) for s in out["meta_info"]["segments"]] == \
        [(a.id, 0, 0), (b.id, 0, 8)]
    assert [i for i, _ in rig.health.failures] == [a.id]


async def test_a_short_sequence_the_scheduler_refuses_is_the_callers_error(rig: Rig) -> None:
    (fake,) = rig.fakes[:1]
    fake.abort_finish = {"type": "abort", "message": "Input length (3 tokens) exceeds the maximum allowed length",
                         "status_code": 400, "err_type": "BadRequestError"}
    (a,) = register_active(rig.registry, rig.fakes[:1])
    with pytest.raises(GenerationFailed) as info:
        await generate_one(short_rig(rig), body(8))
    assert info.value.status == 400 and "exceeds the maximum allowed length" in str(info.value)
    assert rig.health.failures == [] and a.health.consecutive_failures == 0 and len(fake.requests) == 1


async def test_a_sequence_under_an_output_penalty_continued_elsewhere_says_it_is_not_exact(rig: Rig) -> None:
    """SGLang counts frequency, presence and repetition penalties over output tokens only: on the next engine
    the earlier output is prompt, so the samples differ from one engine's. The answer says so."""
    dying, healthy = rig.fakes
    dying.die_after_tokens = 3
    rig.health.marks = False  # a failure does not count against the instance: every sequence starts on it
    register_active(rig.registry, rig.fakes)
    penalised = body(8)
    penalised["sampling_params"]["frequency_penalty"] = 0.5
    out = await generate_one(rig.generator, penalised)
    assert len(out["meta_info"]["segments"]) > 1 and out["meta_info"]["inexact_continuation"] is True
    dying.die_after_tokens = None
    assert "inexact_continuation" not in (await generate_one(rig.generator, penalised))["meta_info"]  # one engine
    dying.die_after_tokens = 3
    plain = await generate_one(rig.generator, body(8))
    assert len(plain["meta_info"]["segments"]) > 1 and "inexact_continuation" not in plain["meta_info"]
