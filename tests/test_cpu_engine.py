"""The CPU engine (SGLang stand-in): its model in-process, and its HTTP contract as a real subprocess."""

from __future__ import annotations

import asyncio
import base64
import json
import pickle
import re
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from support import PY, Proc, async_wait_until, wait_http_ok_sync, wait_until

from rollout_manager.cpu_engine.model import build_model, reference_generate, state_dict_checksums, tensor_checksum
from rollout_manager.rollout.progress import SequenceProgress
from rollout_manager.sglang import tensor_payload, wire
from rollout_manager.sglang.generate_request import SequenceBody, continuation
from rollout_manager.sglang.sse import SSEDecoder, StreamError
from rollout_manager.sglang.wire import GenerateChunk

PROMPT = [11, 22, 33, 44, 55]
GREEDY = {"temperature": 0.0}
TIMEOUT = aiohttp.ClientTimeout(total=30)


# ------------------------------------------------------------------ processes


@dataclass
class EngineProc:
    proc: Proc
    url: str = ""


READY = re.compile(r"cpu-engine ready on (http://127\.0\.0\.1:\d+)")


def _engine_args(*extra: str) -> list[str]:
    # Port 0: the engine binds a free port itself and names it in its ready line, so no other
    # process can take the port between choosing and binding it.
    return [PY, "-m", "rollout_manager.cpu_engine", "--port", "0", "--seed", "0", *extra]


def _wait_ready(e: EngineProc, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout

    def ready_line() -> re.Match[str] | None:
        if e.proc.popen.poll() is not None:
            raise AssertionError(f"engine exited with {e.proc.popen.returncode}:\n{e.proc.log()}")
        return READY.search(e.proc.log())

    m = wait_until(ready_line, timeout, message=lambda: f"the engine to be ready:\n{e.proc.log()}")
    assert m is not None
    e.url = m.group(1)
    wait_http_ok_sync(e.url + wire.HEALTH, e.proc, timeout=max(deadline - time.monotonic(), 1.0))


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """Start every engine this module needs at once (start-up is mostly importing torch), wait lazily."""
    logs = tmp_path_factory.mktemp("cpu-engine")
    specs = {
        "main": ("--health-generate-timeout-s", "1"),
        "incremental": ("--incremental-streaming-output",),
        "weights": (),
        "die": ("--die-after-tokens", "7", "--token-delay-s", "0.01"),
        "short": ("--context-length", "32", "--stream-interval", "4"),
    }
    started: dict[str, EngineProc] = {}
    try:
        for name, extra in specs.items():
            started[name] = EngineProc(Proc(_engine_args(*extra), logs / f"{name}.log"))

        def get(name: str) -> EngineProc:
            e = started[name]
            if not e.url:
                _wait_ready(e)
            return e

        yield get
    finally:
        for e in started.values():
            e.proc.stop()


@pytest.fixture
async def session():
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        yield s


@pytest.fixture(scope="module")
def ref_model():
    return build_model(0)


# ------------------------------------------------------------------ HTTP helpers


async def post(session: aiohttp.ClientSession, url: str, body: Any = None, *,
               data: bytes | None = None) -> tuple[int, Any]:
    kwargs = {"data": data} if data is not None else {"json": body}
    async with session.post(url, **kwargs) as r:
        text = await r.text()
        try:
            return r.status, json.loads(text) if text else None
        except json.JSONDecodeError:
            return r.status, text


async def get(session: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with session.get(url) as r:
        text = await r.text()
        try:
            return r.status, json.loads(text) if text else None
        except json.JSONDecodeError:
            return r.status, text


class Stream:
    """A streamed /generate: iterate chunks; ``done`` tells whether ``data: [DONE]`` arrived."""

    def __init__(self, session: aiohttp.ClientSession, url: str, body: dict[str, Any]):
        self.session, self.url, self.body = session, url, {**body, "stream": True}
        self.decoder = SSEDecoder()
        self.chunks: list[dict[str, Any]] = []
        self.broken = False

    @property
    def done(self) -> bool:
        return self.decoder.done

    async def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        async with self.session.post(self.url + wire.GENERATE, json=self.body) as r:
            assert r.status == 200, await r.text()
            assert r.headers["Content-Type"].startswith("text/event-stream")
            try:
                async for data in r.content.iter_any():
                    for obj in self.decoder.feed(data):
                        self.chunks.append(obj)
                        yield obj
            except aiohttp.ClientPayloadError:
                self.broken = True

    async def collect(self) -> list[dict[str, Any]]:
        async for _ in self:
            pass
        return self.chunks


async def generate(session, url, input_ids, max_new_tokens, **extra) -> dict[str, Any]:
    body = {"input_ids": input_ids, "sampling_params": {**GREEDY, "max_new_tokens": max_new_tokens}, **extra}
    status, out = await post(session, url + wire.GENERATE, body)
    assert status == 200, out
    return out


def fold(chunks: list[dict[str, Any]]) -> SequenceProgress:
    p = SequenceProgress()
    for c in chunks:
        p.apply(GenerateChunk.of(c))
    return p


# ------------------------------------------------------------------ the model, in-process


def test_parameter_names_follow_hf_llama():
    m = build_model(0)
    names = list(m.state_dict())
    assert names[0] == "model.embed_tokens.weight" and names[-1] == "lm_head.weight"
    assert "model.norm.weight" in names
    for suffix in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                   "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm"):
        assert f"model.layers.1.{suffix}.weight" in names
    assert all(t.dtype == torch.float32 for t in m.state_dict().values())
    assert state_dict_checksums(build_model(0)) == state_dict_checksums(m)  # same seed, same bits
    assert state_dict_checksums(build_model(1)) != state_dict_checksums(m)


def test_load_named_tensors_checks_before_writing():
    m = build_model(0)
    before = state_dict_checksums(m)
    w = m.state_dict()["lm_head.weight"]
    with pytest.raises(ValueError, match="unknown parameter name"):
        m.load_named_tensors([("lm_head.weight", torch.zeros_like(w)), ("model.nope.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="shape"):
        m.load_named_tensors([("lm_head.weight", torch.zeros(3, 3))])
    with pytest.raises(ValueError, match="dtype"):
        m.load_named_tensors([("lm_head.weight", torch.zeros(w.shape, dtype=torch.int64))])
    assert state_dict_checksums(m) == before  # nothing half-loaded
    new = torch.randn(w.shape, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    assert m.load_named_tensors([("lm_head.weight", new)]) == 1
    assert m.state_dict()["lm_head.weight"].dtype == torch.float32
    assert torch.equal(m.state_dict()["lm_head.weight"], new.float())


def test_continuation_from_any_prefix_is_token_identical(ref_model):
    full, lps = reference_generate(ref_model, PROMPT, 40)
    assert len(full) == 40 and len(set(full)) > 5
    for k in (1, 2, 7, 20, 33, 39):
        rest, rest_lps = reference_generate(ref_model, PROMPT + full[:k], 40 - k)
        assert rest == full[k:], k
        assert rest_lps == lps[k:], k


# ------------------------------------------------------------------ HTTP: outputs


@pytest.mark.slow
async def test_weights_match_the_seed_and_server_info(engines, session, ref_model):
    e = engines("main")
    status, sums = await get(session, e.url + "/debug/state_dict_checksum")
    assert status == 200 and sums["tensors"] == state_dict_checksums(ref_model)
    for path in (wire.SERVER_INFO, wire.GET_SERVER_INFO):
        status, info = await get(session, e.url + path)
        assert status == 200
        assert isinstance(info["internal_states"][0]["last_gen_throughput"], float)
        # context_length: SGLang reports its --context-length flag there (None when not given)
        assert info["weight_version"] == "0" and info["context_length"] is None and info["stream_interval"] == 1
        assert info["model_config"]["vocab_size"] == 256
    assert (await get(session, e.url + wire.HEALTH_GENERATE))[0] == 200
    assert (await post(session, e.url + wire.FLUSH_CACHE))[0] == 200
    status, text = await get(session, e.url + wire.METRICS)
    assert status == 200 and wire.METRIC_NUM_RUNNING_REQS in {
        s.name for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.mark.slow
async def test_non_stream_matches_reference_with_logprobs(engines, session, ref_model):
    e = engines("main")
    ref, ref_lps = reference_generate(ref_model, PROMPT, 24)
    out = await generate(session, e.url, PROMPT, 24, return_logprob=True, rid="ns-1")
    meta = out["meta_info"]
    assert out["output_ids"] == ref
    assert meta["id"] == "ns-1" and meta["completion_tokens"] == 24 and meta["prompt_tokens"] == len(PROMPT)
    assert meta["finish_reason"] == {"type": "length", "length": 24}
    assert meta["weight_version"] == "0"
    assert isinstance(out["text"], str)
    lps = meta["output_token_logprobs"]
    assert [t for _, t, _ in lps] == out["output_ids"]
    assert [lp for lp, _, _ in lps] == pytest.approx(ref_lps, abs=1e-6)
    assert all(lp <= 0 for lp, _, _ in lps)
    plain = await generate(session, e.url, PROMPT, 5)
    assert "output_token_logprobs" not in plain["meta_info"]


@pytest.mark.slow
async def test_cumulative_stream_agrees_with_non_stream(engines, session):
    e = engines("main")
    body = {"input_ids": PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": 12}, "return_logprob": True}
    full = await generate(session, e.url, PROMPT, 12, return_logprob=True)
    s = Stream(session, e.url, body)
    chunks = await s.collect()
    assert s.done and not s.broken
    assert len(chunks) == 12  # one chunk per token
    for i, c in enumerate(chunks, 1):
        assert c["output_ids"] == full["output_ids"][:i]  # cumulative
        assert c["meta_info"]["completion_tokens"] == i
        assert len(c["meta_info"]["output_token_logprobs"]) == i
        assert (c["meta_info"]["finish_reason"] is None) == (i < 12)
        assert full["text"].startswith(c["text"])  # SGLang fills the text so far in every chunk
    assert chunks[-1]["meta_info"]["output_token_logprobs"] == full["meta_info"]["output_token_logprobs"]
    assert chunks[-1]["text"] == full["text"]


@pytest.mark.slow
async def test_incremental_stream_agrees_with_non_stream_then_shutdown(engines, session):
    e = engines("incremental")
    full = await generate(session, e.url, PROMPT, 12, return_logprob=True)
    body = {"input_ids": PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": 12}, "return_logprob": True}
    chunks = await Stream(session, e.url, body).collect()
    assert len(chunks) == 12
    for i, c in enumerate(chunks, 1):
        assert c["output_ids"] == [full["output_ids"][i - 1]]  # deltas
        assert c["meta_info"]["completion_tokens"] == i  # still cumulative
        assert c["meta_info"]["output_token_logprobs"] == [full["meta_info"]["output_token_logprobs"][i - 1]]
    p = fold(chunks)
    assert p.output_ids.tolist() == full["output_ids"] and p.logprobs == full["meta_info"]["output_token_logprobs"]
    assert p.finish is not None and p.finish.to_json() == {"type": "length", "length": 12}
    assert p.text == full["text"]
    status, info = await get(session, e.url + wire.SERVER_INFO)
    assert info["incremental_streaming_output"] is True
    # This engine serves only this test: it also checks that POST /shutdown exits cleanly.
    assert (await post(session, e.url + wire.SHUTDOWN))[0] == 200
    assert await asyncio.to_thread(e.proc.wait, 15) == 0


@pytest.mark.slow
async def test_batch_outputs_match_solo_outputs(engines, session):
    e = engines("main")
    prompts = [[1, 2, 3], [200, 100], [7] * 9]
    params = [{**GREEDY, "max_new_tokens": n} for n in (4, 9, 6)]
    solo = [await generate(session, e.url, p, sp["max_new_tokens"]) for p, sp in zip(prompts, params)]
    body = {"input_ids": prompts, "sampling_params": params, "rid": ["b0", "b1", "b2"],
            "return_logprob": [True, False, True]}
    status, outs = await post(session, e.url + wire.GENERATE, body)
    assert status == 200 and isinstance(outs, list) and len(outs) == 3
    for i, (o, s) in enumerate(zip(outs, solo)):
        assert o["output_ids"] == s["output_ids"]
        assert o["meta_info"]["id"] == f"b{i}"
        assert ("output_token_logprobs" in o["meta_info"]) == (i != 1)
    chunks = await Stream(session, e.url, body).collect()
    assert {c["index"] for c in chunks} == {0, 1, 2}
    assert len(chunks) == 4 + 9 + 6
    for i, s in enumerate(solo):
        mine = [c for c in chunks if c["index"] == i]
        assert fold(mine).output_ids.tolist() == s["output_ids"]
        assert all(c["meta_info"]["id"] == f"b{i}" for c in mine)


@pytest.mark.slow
async def test_http_continuation_gives_the_same_tokens(engines, session):
    e = engines("main")
    full = (await generate(session, e.url, PROMPT, 40, return_logprob=True))
    ids, lps = full["output_ids"], full["meta_info"]["output_token_logprobs"]
    base = {"input_ids": PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": 40}, "return_logprob": True}
    for k in (3, 19, 38):
        body = continuation(SequenceBody.of(base), ids[:k], rid=f"cont-{k}").to_json()
        assert body["sampling_params"]["max_new_tokens"] == 40 - k
        chunks = await Stream(session, e.url, body).collect()
        p = fold(chunks)
        assert p.output_ids.tolist() == ids[k:], k
        assert p.logprobs == lps[k:], k


@pytest.mark.slow
async def test_concurrent_requests_match_solo_and_interleave(engines, session):
    e = engines("main")
    prompts = [[i, i + 1, (3 * i) % 256] for i in range(10)]
    solo = [(await generate(session, e.url, p, 15))["output_ids"] for p in prompts]

    async def one(p):
        return (await generate(session, e.url, p, 15))["output_ids"]

    long_body = {"input_ids": [9, 9], "sampling_params": {**GREEDY, "max_new_tokens": 200}}
    long_task = asyncio.create_task(Stream(session, e.url, long_body).collect())
    together = await asyncio.gather(*(one(p) for p in prompts))
    assert together == solo
    assert not long_task.done()  # short requests were not stuck behind the long one
    t0 = time.monotonic()
    assert (await get(session, e.url + wire.HEALTH))[0] == 200
    assert time.monotonic() - t0 < 2.0  # the event loop stays responsive while decoding
    chunks = await long_task
    assert len(fold(chunks).output_ids) == 200


# ------------------------------------------------------------------ HTTP: control


async def _running(session, url) -> int:
    return (await get(session, url + wire.SERVER_INFO))[1]["cpu_engine"]["running"]


@pytest.mark.slow
async def test_abort_by_rid_and_all(engines, session):
    e = engines("main")
    long = {"input_ids": PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": 900}}
    s = Stream(session, e.url, {**long, "rid": "victim"})
    seen = 0
    async for _ in s:
        seen += 1
        if seen == 3:
            assert (await post(session, e.url + wire.ABORT_REQUEST, wire.abort_body("victim")))[0] == 200
    assert s.done
    last = s.chunks[-1]["meta_info"]
    assert last["finish_reason"]["type"] == "abort" and last["completion_tokens"] < 900

    # Non-streaming requests end with finish_reason abort too; abort_all takes every one.
    tasks = [asyncio.create_task(post(session, e.url + wire.GENERATE, {**long, "rid": f"ns-{i}"})) for i in range(2)]
    await async_wait_until(lambda: _running_is(session, e.url, 2), message="both running")
    assert (await post(session, e.url + wire.ABORT_REQUEST, wire.abort_body(abort_all=True)))[0] == 200
    for status, out in await asyncio.gather(*tasks):
        assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "abort"


async def _running_is(session, url, n) -> bool:
    return await _running(session, url) == n


async def _queued_is(session, url, n) -> bool:
    return (await get(session, url + wire.SERVER_INFO))[1]["cpu_engine"]["queued"] == n


@pytest.mark.slow
async def test_client_disconnect_drops_the_sequence(engines, session):
    e = engines("main")
    body = {"input_ids": PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": 900}, "stream": True}
    async with aiohttp.ClientSession(timeout=TIMEOUT) as other:
        async with other.post(e.url + wire.GENERATE, json=body) as r:
            await r.content.readline()  # the first frame has arrived: it is running
            assert await _running(session, e.url) == 1
    await async_wait_until(lambda: _running_is(session, e.url, 0),
                           message="the abandoned sequence to be dropped")


@pytest.mark.slow
async def test_pause_in_place_then_continue_keeps_outputs(engines, session, ref_model):
    e = engines("main")
    ref, _ = reference_generate(ref_model, PROMPT, 30)
    body = {"input_ids": PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": 30}}
    s = Stream(session, e.url, body)
    it = s.__aiter__()
    await it.__anext__()
    try:
        assert (await post(session, e.url + wire.PAUSE_GENERATION, {"mode": "in_place"}))[0] == 200
        queued = asyncio.create_task(generate(session, e.url, [5, 6], 8))
        assert (await get(session, e.url + wire.HEALTH_GENERATE))[0] == 503
        # Paused, the stream counts as queued too: wait for both.
        await async_wait_until(lambda: _queued_is(session, e.url, 2), message="the new request to queue")
        status, info = await get(session, e.url + wire.SERVER_INFO)
        assert info["cpu_engine"]["paused"] is True
        made = info["cpu_engine"]["total_generated_tokens"]
        await asyncio.sleep(0.3)  # a negative check: nothing may advance while paused
        assert not queued.done()
        status, info = await get(session, e.url + wire.SERVER_INFO)
        assert info["cpu_engine"]["total_generated_tokens"] == made
    finally:
        assert (await post(session, e.url + wire.CONTINUE_GENERATION))[0] == 200
    async for _ in it:
        pass
    assert s.done and fold(s.chunks).output_ids.tolist() == ref
    assert (await queued)["output_ids"] == reference_generate(ref_model, [5, 6], 8)[0]


async def test_pause_modes_and_the_flush_rules_sglang_has(engines, session, ref_model):
    """'in_place' keeps the running request and its cache, so a flush is refused; 'retract' moves it back to
    the queue, so a flush without a timeout succeeds (one with a timeout waits for the queue, and times
    out); after continue the request finishes with the tokens it would have made unpaused."""
    e = engines("main")
    ref, _ = reference_generate(ref_model, PROMPT, 200)
    s = Stream(session, e.url, {"input_ids": PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": 200}})
    it = s.__aiter__()
    await it.__anext__()
    statuses = []
    try:
        for mode in ("in_place", "retract"):
            statuses.append((await post(session, e.url + wire.PAUSE_GENERATION, {"mode": mode}))[0])
            statuses.append((await post(session, e.url + wire.FLUSH_CACHE + "?timeout=0.2"))[0])
            statuses.append((await post(session, e.url + wire.FLUSH_CACHE))[0])
            statuses.append((await post(session, e.url + wire.CONTINUE_GENERATION))[0])
    finally:
        await post(session, e.url + wire.CONTINUE_GENERATION)
    async for _ in it:
        pass
    assert statuses == [200, 400, 400, 200, 200, 400, 200, 200]
    assert s.done and fold(s.chunks).output_ids.tolist() == ref


@pytest.mark.slow
async def test_pause_default_mode_aborts_in_flight(engines, session):
    e = engines("main")
    body = {"input_ids": PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": 900}}
    s = Stream(session, e.url, body)
    try:
        async for _ in s:
            if len(s.chunks) == 2:
                assert (await post(session, e.url + wire.PAUSE_GENERATION, {}))[0] == 200
    finally:
        await post(session, e.url + wire.CONTINUE_GENERATION)
    assert s.done and s.chunks[-1]["meta_info"]["finish_reason"]["type"] == "abort"


@pytest.mark.slow
async def test_update_weight_version_aborts_by_default_like_sglang(engines, session):
    e = engines("main")
    body = {"input_ids": PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": 900}}
    try:
        kept = Stream(session, e.url, {**body, "sampling_params": {**GREEDY, "max_new_tokens": 60}})
        async for _ in kept:
            if len(kept.chunks) == 2:
                status, out = await post(session, e.url + wire.UPDATE_WEIGHT_VERSION,
                                         wire.update_weight_version_body("v2"))
                assert status == 200 and out["success"]
        assert kept.chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
        assert kept.chunks[0]["meta_info"]["weight_version"] == "0"
        assert kept.chunks[-1]["meta_info"]["weight_version"] == "v2"

        killed = Stream(session, e.url, body)
        async for _ in killed:
            if len(killed.chunks) == 2:
                assert (await post(session, e.url + wire.UPDATE_WEIGHT_VERSION, {"new_version": "v3"}))[0] == 200
        assert killed.chunks[-1]["meta_info"]["finish_reason"]["type"] == "abort"
        assert (await get(session, e.url + wire.SERVER_INFO))[1]["weight_version"] == "v3"
    finally:
        await post(session, e.url + wire.UPDATE_WEIGHT_VERSION, {"new_version": "0", "abort_all_requests": False})


@pytest.mark.slow
async def test_runtime_faults_fail_rate_health_and_stall(engines, session, ref_model):
    e = engines("main")
    faults = e.url + "/debug/faults"
    try:
        assert (await post(session, faults, {"fail_rate": 1.0, "fail_status": 503}))[0] == 200
        status, out = await post(session, e.url + wire.GENERATE, {"input_ids": PROMPT})
        assert status == 503 and out["error"]["code"] == 503
        assert (await post(session, faults, {"fail_rate": 0.0, "health_fail": True}))[0] == 200
        assert (await get(session, e.url + wire.HEALTH))[0] == 503
        assert (await get(session, e.url + wire.HEALTH_GENERATE))[0] == 503
        assert (await post(session, faults, {"health_fail": False, "stall_after_tokens": 4}))[0] == 200
        ref, _ = reference_generate(ref_model, PROMPT, 10)
        body = {"input_ids": PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": 10}}
        s = Stream(session, e.url, body)
        it = s.__aiter__()
        for _ in range(4):
            await it.__anext__()
        assert (await get(session, e.url + wire.HEALTH_GENERATE))[0] == 503  # times out (1 s here)
        assert len(s.chunks) == 4 and not s.done
        assert (await post(session, faults, {"stall_after_tokens": None}))[0] == 200
        async for _ in it:
            pass
        assert s.done and fold(s.chunks).output_ids.tolist() == ref
        assert (await post(session, faults, {"no_such_fault": 1}))[0] == 400
    finally:
        await post(session, faults, {"fail_rate": 0.0, "health_fail": False, "stall_after_tokens": None})


@pytest.mark.slow
@pytest.mark.parametrize(
    "body, needle",
    [
        ({"text": "hello"}, "no tokenizer"),
        ({"input_ids": []}, "input_ids"),
        ({"input_ids": [1, 256]}, "token id"),
        ({"input_ids": [1, -1]}, "token id"),
        ({"input_ids": [1, 2], "sampling_params": {"temperature": -1}}, "temperature"),
        ({"input_ids": [1, 2], "sampling_params": {"top_p": 0}}, "top_p"),
        ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1023}}, "context length"),
        ({"input_ids": [[1], [2]], "sampling_params": [{}, {}, {}]}, "batch of 2"),
        ({"input_ids": [[1], [2]], "rid": ["same", "same"]}, "duplicate rid"),
    ],
)
async def test_bad_generate_bodies_are_400(engines, session, body, needle):
    e = engines("main")
    status, out = await post(session, e.url + wire.GENERATE, body)
    assert status == 400, out
    assert needle in wire.error_message(out)


@pytest.mark.slow
@pytest.mark.parametrize("body, message", [
    # SGLang 0.5.23's own decoder (api_types.py) refuses these with 400 {"error": "<its message>"}.
    ({"input_ids": [1, 2], "sampling_params": {"seed": 3}}, "unknown field `seed`, expected one of"),
    ({"input_ids": [1, 2], "stream": "yes"}, 'invalid type: string "yes", expected a boolean'),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": "3"}}, 'invalid type: string "3"'),
    ([1, 2, 3], "invalid type: sequence, expected struct GenerateRequest"),
    ({"input_ids": "abc"}, 'invalid type: string "abc"'),
    ({"input_ids": [1, 2], "sampling_params": {"max_tokens": 3}}, "unknown field `max_tokens`"),
])
async def test_bodies_sglangs_contract_refuses_are_refused_as_sglang_does(engines, session, body, message):
    e = engines("main")
    status, out = await post(session, e.url + wire.GENERATE, body)
    assert status == 400 and isinstance(out["error"], str) and message in out["error"], out


@pytest.mark.slow
async def test_input_too_long_for_the_scheduler_is_an_abort_with_status_code(engines, session):
    e = engines("short")  # context 32: the tokenizer admits < 32 tokens, the scheduler < 32 - 6
    body = {"input_ids": list(range(1, 27)), "sampling_params": {**GREEDY, "max_new_tokens": None}}
    chunks = await Stream(session, e.url, body).collect()
    (last,) = chunks
    finish = last["meta_info"]["finish_reason"]
    assert finish["type"] == "abort" and finish["status_code"] == 400 and finish["err_type"] == "BadRequestError"
    assert "Input length (26 tokens) exceeds the maximum allowed length (26 tokens)" in finish["message"]
    status, out = await post(session, e.url + wire.GENERATE, body)
    assert status == 400 and "exceeds the maximum allowed length" in out["error"]["message"]
    # Past the context itself the tokenizer refuses first: an error frame inside a 200 stream.
    body["input_ids"] = list(range(1, 33))
    s = Stream(session, e.url, body)
    with pytest.raises(StreamError, match="longer than the model's context length"):
        await s.collect()


@pytest.mark.slow
async def test_null_max_new_tokens_runs_to_the_context_end(engines, session):
    e = engines("short")
    out = await generate(session, e.url, PROMPT, None)
    n = 32 - 2 - len(PROMPT)  # SGLang: max_req_len (context - 1) - input - 1
    assert len(out["output_ids"]) == n and out["meta_info"]["finish_reason"] == {"type": "length", "length": n}
    cont = await generate(session, e.url, PROMPT + out["output_ids"][:7], None)
    assert cont["output_ids"] == out["output_ids"][7:]  # continuation stays exact


@pytest.mark.slow
async def test_stream_interval_flag_and_per_request_value(engines, session):
    e = engines("short")  # --stream-interval 4
    body = {"input_ids": PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": 10}}
    chunks = await Stream(session, e.url, body).collect()
    assert [c["meta_info"]["completion_tokens"] for c in chunks] == [1, 5, 9, 10]
    body["sampling_params"]["stream_interval"] = 3
    chunks = await Stream(session, e.url, body).collect()
    assert [c["meta_info"]["completion_tokens"] for c in chunks] == [1, 4, 7, 10]
    assert fold(chunks).output_ids.tolist() == (await generate(session, e.url, PROMPT, 10))["output_ids"]


@pytest.mark.slow
async def test_text_is_filled_in_every_chunk(engines, session):
    body = {"input_ids": PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": 6}}
    final = await generate(session, engines("main").url, PROMPT, 6)
    assert isinstance(final["text"], str) and final["text"]
    texts = [c["text"] for c in await Stream(session, engines("main").url, body).collect()]
    assert all(isinstance(t, str) and final["text"].startswith(t) for t in texts) and texts[-1] == final["text"]
    # (deltas joined give the same text: test_incremental_stream_agrees_with_non_stream_then_shutdown)


@pytest.mark.slow
async def test_a_string_rid_names_batch_items(engines, session):
    e = engines("main")
    out = await generate(session, e.url, [PROMPT, PROMPT[:2]], 2, rid="b")
    assert [o["meta_info"]["id"] for o in out] == ["b_0", "b_1"]


@pytest.mark.slow
async def test_invalid_json_is_400(engines, session):
    e = engines("main")
    status, out = await post(session, e.url + wire.GENERATE, data=b"{not json")
    assert status == 400 and "JSON" in out["error"]["message"]


@pytest.mark.slow
async def test_max_new_tokens_zero_and_stop_tokens(engines, session, ref_model):
    e = engines("main")
    out = await generate(session, e.url, PROMPT, 0)
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"]["type"] == "length"
    body = {"input_ids": PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": 0}}
    chunks = await Stream(session, e.url, body).collect()
    assert len(chunks) == 1 and chunks[0]["meta_info"]["finish_reason"]["type"] == "length"
    ref, _ = reference_generate(ref_model, PROMPT, 20)
    stop = ref[5]
    body = {"input_ids": PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": 20, "stop_token_ids": [stop]}}
    status, out = await post(session, e.url + wire.GENERATE, body)
    cut = ref.index(stop) + 1
    assert out["output_ids"] == ref[:cut]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    body["sampling_params"]["ignore_eos"] = True
    status, out = await post(session, e.url + wire.GENERATE, body)
    assert out["output_ids"] == ref


@pytest.mark.slow
async def test_sampling_is_seeded(engines, session):
    e = engines("main")
    body = {"input_ids": PROMPT, "sampling_params": {"temperature": 1.0, "top_p": 0.9, "top_k": 50,
                                                       "sampling_seed": 123, "max_new_tokens": 20}}
    a = (await post(session, e.url + wire.GENERATE, body))[1]["output_ids"]
    b = (await post(session, e.url + wire.GENERATE, body))[1]["output_ids"]
    body["sampling_params"]["sampling_seed"] = 124
    c = (await post(session, e.url + wire.GENERATE, body))[1]["output_ids"]
    assert a == b and a != c


# ------------------------------------------------------------------ HTTP: weights


@pytest.mark.slow
async def test_update_weights_from_tensor_then_sigterm(engines, session):
    e = engines("weights")
    new_model = build_model(1)
    named = list(new_model.state_dict().items())
    new_ref, _ = reference_generate(new_model, PROMPT, 16)
    before = await generate(session, e.url, PROMPT, 16)
    assert before["output_ids"] != new_ref
    status, old_sums = await get(session, e.url + "/debug/state_dict_checksum")

    # SGLang 0.5.23 loads only inside a weight-update session (tests/test_sglang_weight_fidelity.py).
    status, out = await post(session, e.url + wire.BEGIN_WEIGHT_UPDATE, wire.begin_weight_update_body())
    assert status == 200 and out["success"] is True, out

    # Rejected pushes change nothing: unknown name, wrong shape, garbage payload.
    bad_name = wire.update_weights_from_tensor_body(
        [tensor_payload.serialize_named_tensors(named[:3] + [("model.layers.9.mlp.up_proj.weight", torch.zeros(2))])],
        flush_cache=True, weight_version="bad")
    status, out = await post(session, e.url + wire.UPDATE_WEIGHTS_FROM_TENSOR, bad_name)
    assert status == 400 and out["success"] is False and "unknown parameter" in out["message"]
    bad_shape = wire.update_weights_from_tensor_body(
        [tensor_payload.serialize_named_tensors([("lm_head.weight", torch.zeros(4, 4))])], flush_cache=True,
        weight_version=None)
    status, out = await post(session, e.url + wire.UPDATE_WEIGHTS_FROM_TENSOR, bad_shape)
    assert status == 400 and "shape" in out["message"]
    for payload in ("%%%not base64", base64.b64encode(pickle.dumps([("x", print)])).decode()):
        status, out = await post(session, e.url + wire.UPDATE_WEIGHTS_FROM_TENSOR,
                                 {"serialized_named_tensors": [payload], "load_format": None, "flush_cache": True})
        assert status == 400 and out["success"] is False
    assert (await get(session, e.url + "/debug/state_dict_checksum"))[1] == old_sums

    # A push in two buckets (flush on the last), the second through shared memory like SGLang's serializer.
    half = len(named) // 2
    body1 = wire.update_weights_from_tensor_body([tensor_payload.serialize_named_tensors(named[:half])],
                                                 flush_cache=False, weight_version=None)
    status, out = await post(session, e.url + wire.UPDATE_WEIGHTS_FROM_TENSOR, body1)
    assert status == 200 and out["success"] is True, out
    strategy = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        payload = tensor_payload.serialize_named_tensors(named[half:], share_memory=True)
        body2 = wire.update_weights_from_tensor_body([payload, payload], flush_cache=True, weight_version="7")
        status, out = await post(session, e.url + wire.UPDATE_WEIGHTS_FROM_TENSOR, body2)
    finally:
        torch.multiprocessing.set_sharing_strategy(strategy)
    assert status == 200 and out["success"] is True, out
    status, out = await post(session, e.url + wire.END_WEIGHT_UPDATE, wire.end_weight_update_body())
    assert status == 200 and out["success"] is True, out

    status, sums = await get(session, e.url + "/debug/state_dict_checksum")
    assert sums["tensors"] == {name: tensor_checksum(t) for name, t in named}
    assert sums["weight_version"] == "7"
    after = await generate(session, e.url, PROMPT, 16)
    assert after["output_ids"] == new_ref and after["meta_info"]["weight_version"] == "7"

    # This engine serves only this test: SIGTERM ends open streams (abort, [DONE]) and exits 0.
    body = {"input_ids": PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": 900}}
    s = Stream(session, e.url, body)
    async for _ in s:
        if len(s.chunks) == 2:
            e.proc.signal(signal.SIGTERM)
    assert s.done and s.chunks[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert await asyncio.to_thread(e.proc.wait, 15) == 0
    assert "cpu-engine ready on http://127.0.0.1:" in e.proc.log()


# ------------------------------------------------------------------ HTTP: dying


@pytest.mark.slow
async def test_die_after_tokens_kills_the_process_mid_stream(engines, session):
    e = engines("die")
    body = {"input_ids": PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": 50}}
    s = Stream(session, e.url, body)
    try:
        await s.collect()
    except aiohttp.ClientError:
        s.broken = True
    assert not s.done  # no [DONE]: the stream just stops
    assert len(fold(s.chunks).output_ids) == 7
    assert await asyncio.to_thread(e.proc.wait, 15) == 1

