"""Engines that stay up but misbehave (issue 18): wrong tokens, endless or trickled bytes, silence,
404s and refusals. Each is the instance's failure: counted against it, the sequence goes on elsewhere
from the last good token, and the caller never sees a token the manager could not vouch for."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from fakes import FakeClock, FakeProbe, FakeSGLang, reference, register_active, start_fakes, yield_until
from fakes import HealthRecorder as Health
from support import Proc, as_json, async_wait_until, wait_http_ok

from rollout_manager.cpu_engine.encode import output_chunk
from rollout_manager.instances.health import HealthMonitor, HealthSettings
from rollout_manager.instances.instance import EngineFacts
from rollout_manager.instances.registry import Instance, Kind, Registry, State
from rollout_manager.instances.version import WeightVersion
from rollout_manager.osutil import free_port
from rollout_manager.placement.dispatch import Dispatcher
from rollout_manager.placement.least_in_flight import LeastInFlight
from rollout_manager.placement.local_budget import LocalBudget
from rollout_manager.rollout import sequence
from rollout_manager.rollout.generation import GenerationFailed, GenerationSettings, Generator
from rollout_manager.rollout.progress import BadChunk, SequenceProgress
from rollout_manager.rollout.request import decode
from rollout_manager.sglang import client as sgl
from rollout_manager.sglang import wire
from rollout_manager.sglang.finish import FinishReason
from rollout_manager.sglang.generate_request import SequenceBody
from rollout_manager.sglang.sse import FrameTooLarge, SSEDecoder, sse_frame
from rollout_manager.sglang.wire import GenerateChunk

PROMPT = [5, 17, 42]
# A chunk per token, so a test knows where a stream breaks; bounds short enough to run in milliseconds.
SETTINGS = GenerationSettings(max_attempts=3, wait_timeout_s=0.5, connect_timeout_s=2.0, stall_timeout_s=5.0,
                              engine_stream_interval=1, first_byte_timeout_s=5.0, max_frame_bytes=64 * 1024)
ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- the rules, one chunk at a time


def chunk(ids: list[Any], total: Any = "auto", finish: dict[str, Any] | None = None,
          version: str = "0") -> dict[str, Any]:
    out = output_chunk(rid="r", output_ids=ids, prompt_tokens=3, completion_tokens=0, finish=finish,
                            weight_version=version)
    if total is None:
        del out["meta_info"]["completion_tokens"]
    else:
        out["meta_info"]["completion_tokens"] = len(ids) if total == "auto" else total
    return out


def progress(limit: int | None = 4, vocab: int = 256) -> SequenceProgress:
    """Two tokens of an earlier segment, then [1] and [1, 2] from this engine (cumulative)."""
    p = SequenceProgress([9, 9], [], limit=limit, vocab_size=vocab,
                              version_ok=lambda v: None if v == "0" else f"weight_version {v!r}")
    assert p.apply(GenerateChunk.of(chunk([1]))) == 1 and p.apply(GenerateChunk.of(chunk([1, 2]))) == 1
    return p


@pytest.mark.parametrize("bad, says", [
    (chunk([1]), "went back from 2 to 1"),  # ids going backwards: a shorter prefix again
    (chunk([1, 3]), "changed some of the 2 already sent"),  # a cumulative chunk rewriting what was sent
    (chunk([1, 2, 3], total=None), "completion_tokens is None"),  # missing
    (chunk([1, 2, 3], total="3"), "completion_tokens is '3'"),
    (chunk([1, 2, 3], total=6), "fits neither"),  # wrong: neither cumulative (3 ids) nor a delta (2 + 3)
    (chunk([1, 2, 3, 4, 5]), "5 tokens for a request of max_new_tokens=4"),  # over the budget
    (chunk([3, 4, 5], total=5), "5 tokens for a request of max_new_tokens=4"),  # the same as a delta
    (chunk([1, 2, -5]), "token id -5 is outside the vocabulary [0, 256)"),
    (chunk([1, 2, "x"]), "token id 'x' is not an integer"),
    (chunk([1, 2, 1.5]), "token id 1.5 is not an integer"),
    (chunk([1, 2, 10**12]), "token id 1000000000000 is outside"),
    (chunk([1, 2, True]), "token id True is not an integer"),
    (chunk([1, 2, 256]), "token id 256 is outside the vocabulary [0, 256)"),
    (chunk([1, 2, 3], version="999"), "weight_version '999'"),
    (chunk([1, 2, 3], total=3) | {"meta_info": {**chunk([1, 2, 3])["meta_info"], "output_token_logprobs": "x"}},
     "output_token_logprobs is str"),
    ({"output_ids": [1, 2, 3]}, "without the meta_info"),
])
def test_a_chunk_breaking_a_rule_is_refused_and_nothing_of_it_is_kept(bad: dict[str, Any], says: str) -> None:
    p = progress()
    with pytest.raises(BadChunk, match=re.escape(says)):
        p.apply(GenerateChunk.of(bad))
    assert p.output_ids.tolist() == [9, 9, 1, 2] and p.made == 2 and p.finish is None and p.chunks == 2


def test_no_tokens_after_the_final_chunk() -> None:
    p = progress()
    p.apply(GenerateChunk.of(chunk([1, 2, 3], finish=wire.finish_reason(wire.STOP))))
    with pytest.raises(BadChunk, match="1 token.s. after the final chunk"):
        p.apply(GenerateChunk.of(chunk([1, 2, 3, 4])))
    assert p.output_ids.tolist() == [9, 9, 1, 2, 3]


def test_chunks_that_keep_the_rules_pass_in_either_mode() -> None:
    p = progress(limit=None)
    assert p.apply(GenerateChunk.of(chunk([3, 4], total=4))) == 2  # a delta after cumulative chunks
    assert p.apply(GenerateChunk.of(chunk([1, 2, 3, 4, 5, 6]))) == 2  # and cumulative again
    assert p.apply(GenerateChunk.of(chunk([1, 2, 3, 4, 5, 6], finish=wire.finish_reason(wire.LENGTH, length=6)))) == 0
    assert p.output_ids.tolist() == [9, 9, 1, 2, 3, 4, 5, 6] and p.finish == FinishReason("length", length=6)
    last = GenerateChunk.of(chunk([1, 2, 3, 4, 5, 6], finish=wire.finish_reason(wire.LENGTH, length=6)))
    assert p.apply(last) == 0  # a repeat


def test_the_decoder_bounds_one_frame() -> None:
    dec = SSEDecoder(max_frame=200)
    assert dec.feed(sse_frame(chunk([1]))) and dec.pending == 0
    with pytest.raises(FrameTooLarge, match="without a frame boundary"):
        for _ in range(40):  # endless bytes, never a boundary
            dec.feed(b"data: " + b"x" * 10)
    assert dec.pending <= 200 + 16
    whole = SSEDecoder(max_frame=200)
    with pytest.raises(FrameTooLarge, match="a stream frame of"):  # a complete frame, too large
        whole.feed(b"data: " + b"1" * 300 + b"\n\n")


# ---------------------------------------------------------------- the weight version a chunk may report


def remote(version: int = 0, joined: str | None = "0", state: State = State.ACTIVE,
           kind: Kind = Kind.REMOTE) -> Instance:
    return Instance("inst-1", "127.0.0.1", 1, kind, 1, weight_version=version,
                    engine=EngineFacts(joined_version=joined), state=state)


def test_a_chunk_reports_the_version_the_manager_gave_the_instance() -> None:
    never_pushed = sequence.version_check(remote(joined="default"), 0)
    assert never_pushed is not None
    assert never_pushed("default") is None
    assert "reported 'default' when it joined" in str(never_pushed("999"))
    assert never_pushed("0") is not None and never_pushed("1") is not None
    pushed = sequence.version_check(inst := remote(version=3), 3)
    assert pushed is not None and pushed("3") is None and pushed(3) is None
    for wrong in ("2", "4", "0", "999", "v3", "", " 3"):
        assert "was pushed version 3" in str(pushed(wrong)), wrong
    inst.state = State.SYNCING  # a push under way: the new version may show before the registry has it
    assert pushed("4") is None and pushed("2") is not None
    inst.weight_version, inst.state = 4, State.ACTIVE  # the push is recorded; a chunk read late says 3
    assert pushed("3") is None and pushed("4") is None and pushed("5") is not None
    # Not checked: a local instance (the trainer names its versions), and an unknown start.
    assert sequence.version_check(remote(kind=Kind.LOCAL), 0) is None
    assert sequence.version_check(remote(joined=None), 0) is None


# ---------------------------------------------------------------- through the Generator, in process


@dataclass
class Rig:
    registry: Registry
    generator: Generator
    health: Health
    fakes: list[FakeSGLang]
    insts: list[Instance]


@pytest.fixture
async def make_rig() -> AsyncIterator[Callable[..., Any]]:
    fakes: list[FakeSGLang] = []
    sessions: list[aiohttp.ClientSession] = []

    async def make(settings: GenerationSettings = SETTINGS, n: int = 2) -> Rig:
        fakes.extend(await start_fakes(n))
        session = aiohttp.ClientSession()
        sessions.append(session)
        registry = Registry()
        health = Health()
        generator = Generator(Dispatcher(registry, LeastInFlight()), sgl.SGLangClient(session), settings,
                              LocalBudget(0.0, 0.0, 1.0), on_instance_failure=health.failure,
                              on_instance_success=health.success)
        insts = register_active(registry, fakes)  # least in flight, ties by id: the first fake goes first
        return Rig(registry, generator, health, fakes, insts)

    try:
        yield make
    finally:
        for fake in fakes:
            await fake.close()
        for session in sessions:
            await session.close()


def body(max_new_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"input_ids": list(PROMPT), "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens},
            **extra}


async def generate(rig: Rig, b: dict[str, Any], within_s: float = 20.0) -> dict[str, Any]:
    out = as_json(await asyncio.wait_for(rig.generator.generate(decode(b)), within_s))  # fails, never hangs
    assert isinstance(out, dict)
    return out


def garble(at: int, how: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any], int], dict[str, Any]]:
    """A FakeSGLang rewrite that breaks the ``at``-th chunk."""
    def rewrite(c: dict[str, Any], k: int) -> dict[str, Any]:
        if k == at:
            how(c)
        return c
    return rewrite


def _set(ids: list[Any] | None = None, **meta: Any) -> Callable[[dict[str, Any]], None]:
    def how(c: dict[str, Any]) -> None:
        if ids is not None:
            c["output_ids"] = ids
        for key, value in meta.items():
            if value is None:
                c["meta_info"].pop(key, None)
            else:
                c["meta_info"][key] = value
    return how


def _extend(c: dict[str, Any]) -> None:  # 2 tokens past max_new_tokens, in a consistent chunk
    c["output_ids"] = c["output_ids"] + [1, 2]
    c["meta_info"]["completion_tokens"] += 2
    c["meta_info"]["finish_reason"] = None


BROKEN = {  # the findings, each at the third chunk (two good tokens before it)
    "backwards": _set([1], completion_tokens=1),
    "rewritten": _set([1, 2, 3]),
    "no completion_tokens": _set(completion_tokens=None),
    "wrong completion_tokens": _set(completion_tokens=7),
    "negative id": _set([0, 7, -5], completion_tokens=3),
    "string id": _set([0, 7, "x"], completion_tokens=3),
    "float id": _set([0, 7, 1.5], completion_tokens=3),
    "huge id": _set([0, 7, 10**12], completion_tokens=3),
    "id past the vocabulary": _set([0, 7, 251], completion_tokens=3),
    "weight version": _set(weight_version="999"),
}


@pytest.mark.parametrize("name", list(BROKEN))
async def test_wrong_tokens_never_reach_the_caller_and_count_against_the_instance(make_rig, name: str) -> None:
    rig = await make_rig()
    bad, good = rig.fakes
    a, b = rig.insts
    for inst in rig.insts:  # as health records them from /model_info at registration
        inst.engine = EngineFacts(vocab_size=251, joined_version="0")
    bad.rewrite = garble(2, BROKEN[name])
    out = await generate(rig, body(6))
    assert out["output_ids"] == reference(PROMPT, 6)  # only vouched tokens, nothing lost, nothing twice
    first, second = out["meta_info"]["segments"]
    assert (first["instance"], first["start"], first["end"]) == (a.id, 0, 2) and "bad chunk" in first["outcome"]
    assert (second["instance"], second["start"], second["end"]) == (b.id, 2, 6)
    assert good.requests[0]["input_ids"] == PROMPT + reference(PROMPT, 2)  # continued from the last good token
    assert [i for i, _ in rig.health.failures] == [a.id] and a.health.consecutive_failures == 1


async def test_too_many_tokens_are_the_instances_failure(make_rig) -> None:
    rig = await make_rig()
    rig.fakes[0].rewrite = garble(3, _extend)  # the last chunk of 4 brings 2 more than asked
    out = await generate(rig, body(4))
    assert out["output_ids"] == reference(PROMPT, 4) and len(out["output_ids"]) == 4
    assert "6 tokens for a request of max_new_tokens=4" in rig.health.failures[0][1]


async def test_a_streaming_caller_sees_only_vouched_tokens(make_rig) -> None:
    rig = await make_rig()
    rig.fakes[0].rewrite = garble(3, _set([0, 7, 231, -1], completion_tokens=4))  # a wrong 4th token
    want = reference(PROMPT, 8)
    seen: list[list[int]] = []
    async for ready in rig.generator.generate_stream(decode(body(8, stream=True))):
        seen.extend(c["output_ids"] for c in as_json(ready))
    assert seen[-1] == want and all(ids == want[:len(ids)] for ids in seen)


async def test_a_wrong_non_streaming_answer_is_checked_too(make_rig) -> None:
    rig = await make_rig(replace(SETTINGS, engine_stream_interval=32))  # 8 tokens: one answer, no stream
    rig.fakes[0].rewrite = garble(0, _set([3, 2, 1]))
    out = await generate(rig, body(8))
    assert rig.fakes[0].requests[0]["stream"] is False
    assert out["output_ids"] == reference(PROMPT, 8)
    assert "bad chunk after 0 good token(s)" in rig.health.failures[0][1]


@pytest.mark.parametrize("status", [404, 405])
async def test_a_404_or_405_on_generate_is_the_instances_failure(make_rig, status: int) -> None:
    rig = await make_rig()
    rig.fakes[0].reject_status = status
    out = await generate(rig, body(4))
    assert out["output_ids"] == reference(PROMPT, 4)
    (failed, reason), = rig.health.failures
    assert failed == rig.insts[0].id and f"HTTP {status} on /generate" in reason and "not the caller's" in reason


@pytest.mark.parametrize("how", ["status", "frame"])
async def test_a_refusal_another_instance_overrules_counts_against_the_refuser(make_rig, how: str) -> None:
    rig = await make_rig()
    if how == "status":
        rig.fakes[0].reject_status = 400
    else:
        rig.fakes[0].error_frame = wire.error_object("broken engine says no")["error"]
    out = await generate(rig, body(4))
    assert out["output_ids"] == reference(PROMPT, 4)
    (failed, reason), = rig.health.failures
    assert failed == rig.insts[0].id and "refused a request" in reason and rig.fakes[1].url[7:] in reason
    assert out["meta_info"]["segments"][0]["outcome"].endswith("asking another instance")


async def test_a_refusal_with_no_other_instance_goes_to_the_caller_at_once(make_rig) -> None:
    rig = await make_rig(n=1)
    rig.fakes[0].error_frame = wire.error_object("input too long")["error"]
    t0 = time.monotonic()
    with pytest.raises(GenerationFailed) as err:
        await generate(rig, body(4))
    assert err.value.status == 400 and "input too long" in str(err.value)
    assert time.monotonic() - t0 < SETTINGS.wait_timeout_s and rig.health.failures == []


async def test_an_error_frame_with_a_5xx_code_is_the_instances_failure(make_rig) -> None:
    rig = await make_rig()
    rig.fakes[0].error_frame = wire.error_object("scheduler crashed", 500)["error"]
    out = await generate(rig, body(4))
    assert out["output_ids"] == reference(PROMPT, 4) and len(rig.fakes[1].requests) == 1
    assert [i for i, _ in rig.health.failures] == [rig.insts[0].id]


@pytest.mark.parametrize("stream", [True, False])
async def test_endless_bytes_without_a_frame_boundary_are_cut_off(make_rig, stream: bool) -> None:
    rig = await make_rig(replace(SETTINGS, engine_stream_interval=1 if stream else 32))
    rig.fakes[0].babble = (b"x" * 8192, 0.0)  # as fast as the loop lets it
    out = await generate(rig, body(4))
    assert out["output_ids"] == reference(PROMPT, 4)
    reason = rig.health.failures[0][1]
    assert "over the bound of 65536" in reason or "over 65536 bytes" in reason, reason


async def test_an_engine_trickling_bytes_is_cut_off_by_time(make_rig) -> None:
    rig = await make_rig(replace(SETTINGS, stall_timeout_s=1.0, first_byte_timeout_s=0.3))
    rig.fakes[0].babble = (b"x", 0.02)  # bytes keep coming, so a read timeout would never fire
    out = await generate(rig, body(4))
    assert out["output_ids"] == reference(PROMPT, 4)
    reason = rig.health.failures[0][1]
    assert reason.startswith("no first chunk after 0.") and "engine_first_byte_timeout_s=0.3" in reason
    assert "unfinished frame came meanwhile" in reason


async def test_a_silent_engine_is_cut_off_at_the_first_byte_bound_and_the_log_says_how_long(make_rig) -> None:
    rig = await make_rig(replace(SETTINGS, stall_timeout_s=30.0, first_byte_timeout_s=0.4))
    rig.fakes[0].silent = True
    t0 = time.monotonic()
    out = await generate(rig, body(4))
    took = time.monotonic() - t0
    assert out["output_ids"] == reference(PROMPT, 4) and took < 5.0
    reason = rig.health.failures[0][1]
    m = re.match(r"no answer at all \(not even the HTTP status\) after ([\d.]+)s", reason)
    assert m and 0.4 <= float(m.group(1)) <= took, reason  # the time measured, not a configured one
    assert "(engine_first_byte_timeout_s=0.4)" in reason


async def test_trickled_bytes_after_good_chunks_are_no_progress() -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write(sse_frame(chunk([1])) + sse_frame(chunk([1, 2])))
        for _ in range(1000):
            await resp.write(b"x")
            await asyncio.sleep(0.01)
        return resp

    app = web.Application()
    app.router.add_post(wire.GENERATE, handler)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    got: list[list[int]] = []
    try:
        async with aiohttp.ClientSession() as session:
            with pytest.raises(sgl.EngineFailed) as err:
                async for c in sgl.stream_generate(session, str(server.make_url("")), SequenceBody.of(body(4)),
                                                   sgl.CallBounds(connect_timeout_s=2, stall_timeout_s=0.3)):
                    got.append(c.ids)
        assert got == [[1], [2]]  # the second, cumulative, parsed without the id already seen
        assert re.match(r"no complete chunk for 0\.[3-9]\d*s after 2 chunk\(s\) \(stream_stall_timeout_s=0.3\); "
                        r"\d+ byte\(s\) of an unfinished frame came meanwhile", str(err.value)), str(err.value)
    finally:
        await server.close()


async def test_the_first_chunk_may_wait_while_the_instance_serves_others() -> None:
    """Queueing inside SGLang is no failure: the first-byte bound runs from the instance's last chunk
    to anyone, up to the stall bound."""
    last = [-100.0]
    deadline = sgl.Deadline(first_s=10.0, stall_s=100.0, activity=lambda: last[0])
    start = deadline.started
    assert deadline.due() == start + 10.0  # the instance has been silent: 10s
    last[0] = start + 25.0  # it sent a chunk to another request
    assert deadline.due() == start + 35.0
    last[0] = start + 95.0
    assert deadline.due() == start + 100.0  # never past the stall bound
    deadline.chunk()
    assert deadline.due() == deadline.last + 100.0  # after a chunk: the stall bound from the last one


# ---------------------------------------------------------------- what the instance says at registration


async def test_the_cpu_engine_reports_vocabulary_and_live_weight_version_as_the_manager_reads_them() -> None:
    from rollout_manager.cpu_engine import EngineConfig, create_app

    server = TestServer(create_app(EngineConfig(weight_version="5")), host="127.0.0.1")
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as session:
            client = sgl.SGLangClient(session)
            info = await client.server_info(str(server.make_url("")).rstrip("/"), 5.0)
            assert info.vocab_size == 256 and info.weight_version == "5"
            # A server without /model_info (or without a vocabulary size in it) leaves them unknown.
            fake = await FakeSGLang(model_info={"weight_version": "default"}).start()
            try:
                info = await client.server_info(fake.url, 5.0)
                assert info.vocab_size is None and info.weight_version == "default"
            finally:
                await fake.close()
    finally:
        await server.close()


async def test_health_records_vocabulary_and_joined_version_at_the_first_ready_probe() -> None:
    clock = FakeClock()
    registry = Registry(clock=clock)

    async def server_info(url: str, timeout_s: float) -> wire.ServerInfo:
        return wire.ServerInfo.from_json({}).with_model_info({"weight_version": "7", "vocab_size": 1000})

    settings = HealthSettings(60.0, 2.0, 10.0, 5.0, wire.HEALTH_GENERATE, 3)
    health = HealthMonitor(registry, WeightVersion(), FakeProbe(), settings, sleep=clock.sleep,
                           server_info=server_info)
    try:
        inst = registry.add("127.0.0.1", 30000, Kind.REMOTE)
        await yield_until(lambda: inst.state == State.ACTIVE)
        assert inst.engine.vocab_size == 1000 and inst.engine.joined_version == "7"
    finally:
        await health.close()


# ---------------------------------------------------------------- black box: the daemon and its config keys


@pytest.mark.slow
async def test_the_daemon_cuts_off_a_silent_engine_and_a_wrong_one(tmp_path: Path) -> None:
    silent = await FakeSGLang(silent=True, model_info={"weight_version": "0", "vocab_size": 1000}).start()
    wrong = await FakeSGLang(model_info={"weight_version": "0", "vocab_size": 100}).start()  # ids go to 250
    good = await FakeSGLang(model_info={"weight_version": "0", "vocab_size": 1000}).start()
    port = free_port()
    manager = Proc([*_serve(port), "--set", "engine_first_byte_timeout_s=1", "--set", "health_check_interval_s=60",
                    "--set", "pending_poll_interval_s=0.1", "--set", "engine_stream_interval=1",
                    "--set", "tail_migration=false"],
                   tmp_path / "manager.log")
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_http_ok(url + "/health", manager)
        async with aiohttp.ClientSession() as s:
            for fake in (silent, wrong, good):
                async with s.post(url + "/register_rollout_instance",
                                  json={"host": "127.0.0.1", "port": fake.port}) as r:
                    assert r.status == 200, await r.text()

            async def active() -> bool:
                async with s.get(url + "/health") as r:
                    return (await r.json())["instances"].get("active") == 3

            await async_wait_until(active, 20, message="three active instances")
            bodies = [body(40) for _ in range(12)]
            t0 = time.monotonic()
            async with s.post(url + "/generate", json={"input_ids": [b["input_ids"] for b in bodies],
                                                       "sampling_params": bodies[0]["sampling_params"]}) as r:
                out = await r.json()
                assert r.status == 200, out
            assert all(o["output_ids"] == reference(PROMPT, 40) for o in out)
            assert time.monotonic() - t0 < 20
        log = manager.log()
        assert re.search(r"no answer at all \(not even the HTTP status\) after 1\.\d+s.*"
                         r"engine_first_byte_timeout_s=1\)", log), log[-3000:]
        assert "outside the vocabulary [0, 100)" in log, log[-3000:]
    finally:
        manager.stop()
        for fake in (silent, wrong, good):
            await fake.close()


def _serve(port: int) -> list[str]:
    import sys

    return [sys.executable, "-m", "rollout_manager", "serve", "--bind", f"127.0.0.1:{port}"]
