"""The rollout path against a real manager and real CPU engines: scheduling, continuation, batches."""

from __future__ import annotations

import asyncio
import json
import random
import signal

import aiohttp
import pytest
from support import async_wait_until

from rollout_manager.cpu_engine.model import build_model, reference_generate
from rollout_manager.sglang.sse import iter_frames

pytestmark = pytest.mark.slow  # every test here starts real processes

GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def model():
    return build_model(0)


def greedy(n: int) -> dict:
    return {**GREEDY, "max_new_tokens": n}


async def register(m, *engines, kind="remote"):
    for e in engines:
        if kind == "remote":
            status, body = await m.post("/register_rollout_instance", {"host": "127.0.0.1", "port": e.port})
        else:
            status, body = await m.post("/register_local_rollout_instances", [["127.0.0.1", e.port]])
        assert status == 200, body
    for e in engines:
        await async_wait_until(lambda e=e: _active(m, e.endpoint), message=f"{e.endpoint} active")


async def _active(m, endpoint):
    return await m.state_of(endpoint) == "active"


async def test_single_and_batched_generate_equal_the_reference(start_manager, start_engines, model):
    m = await start_manager()
    engines = await start_engines([], [])
    await register(m, *engines)
    prompt = [3, 1, 4, 1, 5]
    status, out = await m.post("/generate", {"input_ids": prompt, "sampling_params": greedy(24),
                                             "return_logprob": True})
    assert status == 200, out
    ref_ids, ref_lps = reference_generate(model, prompt, 24)
    assert out["output_ids"] == ref_ids
    assert [lp[1] for lp in out["meta_info"]["output_token_logprobs"]] == ref_ids
    assert out["meta_info"]["output_token_logprobs"][0][0] == pytest.approx(ref_lps[0], abs=1e-5)
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 24}
    assert out["meta_info"]["completion_tokens"] == 24 and out["meta_info"]["prompt_tokens"] == 5
    prompts = [[7, 7], [9], [2, 4, 6, 8]]
    status, outs = await m.post("/generate", {"input_ids": prompts, "sampling_params": greedy(12)})
    assert status == 200 and isinstance(outs, list) and len(outs) == 3
    for p, o in zip(prompts, outs):
        assert o["output_ids"] == reference_generate(model, p, 12)[0]
        assert "output_token_logprobs" not in o["meta_info"]


@pytest.mark.parametrize("die_after", [1, 9, 23])
async def test_continuation_after_instance_dies_equals_uninterrupted_single(
        start_manager, start_engines, model, die_after):
    m = await start_manager(engine_stream_interval=1)  # a chunk per token: the cut is exactly where it died
    dying, healthy = await start_engines(["--die-after-tokens", str(die_after), "--token-delay-s", "0.005"], [])
    await register(m, dying)  # the dying one is the only choice for the first attempt
    prompt = [10, 20, 30]
    req = asyncio.ensure_future(m.post("/generate", {"input_ids": prompt, "sampling_params": greedy(32),
                                                     "return_logprob": True}))
    await async_wait_until(lambda: dying.proc.popen.poll() is not None, message="the dying engine to die")
    await register(m, healthy)
    status, out = await req
    assert status == 200, out
    ref_ids, _ = reference_generate(model, prompt, 32)
    assert out["output_ids"] == ref_ids
    assert len(out["meta_info"]["output_token_logprobs"]) == 32
    segs = out["meta_info"]["segments"]
    assert [s["endpoint"] for s in segs] == [dying.endpoint, healthy.endpoint]
    # The engine exits right after writing token `die_after`; that last frame may die with it.
    assert segs[0]["start"] == 0 and die_after - 1 <= segs[0]["end"] <= die_after
    assert segs[0]["end"] == segs[1]["start"] and segs[1]["end"] == 32  # contiguous: nothing made twice
    assert segs[0]["outcome"].startswith("failed") and segs[1]["outcome"] == "finished"
    assert out["meta_info"]["finish_reason"]["type"] == "length"


async def test_continuation_for_batched_input_tracks_each_sequence(start_manager, start_engines, model):
    m = await start_manager(engine_stream_interval=1)  # a chunk per token, so the count below is exact
    dying, healthy = await start_engines(["--die-after-tokens", "20", "--token-delay-s", "0.005"], [])
    await register(m, dying)
    prompts = [[1, 2], [3], [4, 5, 6]]
    req = asyncio.ensure_future(m.post("/generate", {"input_ids": prompts, "sampling_params": greedy(16)}))
    await async_wait_until(lambda: dying.proc.popen.poll() is not None, message="the dying engine to die")
    await register(m, healthy)
    status, outs = await req
    assert status == 200, outs
    for p, o in zip(prompts, outs):
        assert o["output_ids"] == reference_generate(model, p, 16)[0]
    made_on_dying = sum(o["meta_info"]["segments"][0]["end"] for o in outs)
    assert 17 <= made_on_dying <= 20  # what reached the manager before the death was kept
    for o in outs:
        first, second = o["meta_info"]["segments"]
        assert first["end"] == second["start"] and second["end"] == 16  # none regenerated


async def _once_counters(m) -> tuple[float, float]:
    """(engine calls, sequences they carried) of short non-streaming sequences, from /metrics."""
    async with m.session.get(m.url + "/metrics") as r:
        text = await r.text()
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("rollout_manager_engine_once"))
    return (float(values["rollout_manager_engine_once_calls_total"]),
            float(values["rollout_manager_engine_once_sequences_total"]))


async def _ndjson(m, items: list) -> dict:
    """POST /batch_generate_requests (its sequences start in one turn of the manager's loop) -> lines by id."""
    async with m.session.post(m.url + "/batch_generate_requests", json=items) as resp:
        assert resp.status == 200
        return {line["id"]: line for line in map(json.loads, [raw async for raw in resp.content])}


async def test_short_requests_that_start_together_share_engine_calls_and_each_get_their_own_answer(
        start_manager, start_engines, model):
    m = await start_manager(scheduler_policy="least_in_flight")  # places all at once (no holding back)
    (engine,) = await start_engines(["--token-delay-s", "0.002"])
    await register(m, engine)
    rng = random.Random(3)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(1, 6))] for _ in range(24)]
    # Half ask for log-probs: a different body shape, so they share calls only among themselves.
    bodies = [{"input_ids": p, "sampling_params": greedy(4 + i % 5), "return_logprob": i % 2 == 0}
              for i, p in enumerate(prompts)]
    lines = await _ndjson(m, [[i, b] for i, b in enumerate(bodies)])
    for i, b in enumerate(bodies):
        assert lines[i]["success"], lines[i]
        out, n = lines[i]["data"], b["sampling_params"]["max_new_tokens"]
        assert out["output_ids"] == reference_generate(model, b["input_ids"], n)[0]
        assert ("output_token_logprobs" in out["meta_info"]) is b["return_logprob"]
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": n}
        assert out["meta_info"]["prompt_tokens"] == len(b["input_ids"])
    assert await _once_counters(m) == (2, 24)  # one call per body shape
    # Requests that arrive together over separate connections share calls too (how many: timing).
    answers = await asyncio.gather(*(m.post("/generate", b) for b in bodies))
    for b, (status, out) in zip(bodies, answers):
        assert status == 200 and out["output_ids"] == \
            reference_generate(model, b["input_ids"], b["sampling_params"]["max_new_tokens"])[0]


async def test_a_shared_call_refused_whole_gives_each_sequence_its_own_verdict(start_manager, start_engines, model):
    m = await start_manager(scheduler_policy="least_in_flight")
    (engine,) = await start_engines([])
    await register(m, engine)
    too_long = [i % 200 for i in range(1020)]  # past what the scheduler admits: SGLang refuses the whole batch
    bodies = [{"input_ids": too_long if i == 3 else [i + 1, 2], "sampling_params": greedy(4 if i == 3 else 6)}
              for i in range(8)]
    lines = await _ndjson(m, [[i, b] for i, b in enumerate(bodies)])
    for i, b in enumerate(bodies):
        if i == 3:
            assert not lines[i]["success"] and lines[i]["status_code"] == 400, lines[i]
            assert "exceeds the maximum allowed length" in lines[i]["error"]
        else:
            assert lines[i]["success"], lines[i]
            assert lines[i]["data"]["output_ids"] == reference_generate(model, b["input_ids"], 6)[0]
    inst = (await m.status())["instances"][0]
    assert inst["state"] == "active" and inst["consecutive_failures"] == 0 and inst["in_flight"] == 0
    assert await _once_counters(m) == (1 + 8, 8 + 8)  # the refused call, then one per sequence


async def test_short_sequences_whose_shared_call_dies_are_made_exactly_elsewhere(start_manager, start_engines, model):
    m = await start_manager()
    dying, healthy = await start_engines(["--token-delay-s", "0.05"], [])
    await register(m, dying)
    prompts = [[i, i + 1] for i in range(1, 9)]
    reqs = [asyncio.ensure_future(m.post("/generate", {"input_ids": p, "sampling_params": greedy(16)}))
            for p in prompts]
    await async_wait_until(lambda: _in_flight(m, 8), message="all eight on the dying engine")
    dying.proc.signal(signal.SIGKILL)
    await register(m, healthy)
    for p, (status, out) in zip(prompts, await asyncio.gather(*reqs)):
        assert status == 200, out
        assert out["output_ids"] == reference_generate(model, p, 16)[0]
        first, second = out["meta_info"]["segments"]
        assert first["endpoint"] == dying.endpoint and first["outcome"].startswith("failed")
        assert (first["start"], first["end"], second["start"], second["end"]) == (0, 0, 0, 16)


async def _in_flight(m, n: int) -> bool:
    return (await m.status())["admission"]["in_flight"] == n


async def test_ndjson_batch_of_200_survives_sigkill_of_one_of_three_engines(start_manager, start_engines, model):
    m = await start_manager()
    # 16 running per engine (the manager places within it): the 200 run in waves, so when the kill comes the
    # victim is mid-wave whatever the machine's load (admitting all at once, all could be done by then)
    engines = await start_engines(*[["--token-delay-s", "0.002", "--max-running-requests", "16"]] * 3)
    await register(m, *engines)
    rng = random.Random(7)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(1, 6))] for _ in range(200)]
    items = [[f"r{i}", {"input_ids": p, "sampling_params": greedy(12)}] for i, p in enumerate(prompts)]
    lines: list[dict] = []
    victim = engines[1]
    async with m.session.post(m.url + "/batch_generate_requests", json=items) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("application/x-ndjson")
        async for raw in resp.content:
            lines.append(json.loads(raw))
            if len(lines) == 20:
                victim.proc.signal(signal.SIGKILL)
    assert sorted(line["id"] for line in lines) == sorted(f"r{i}" for i in range(200))
    assert all(line["success"] for line in lines), [x for x in lines if not x["success"]][:3]
    by_id = {line["id"]: line["data"] for line in lines}
    for i, p in enumerate(prompts):
        assert by_id[f"r{i}"]["output_ids"] == reference_generate(model, p, 12)[0], f"r{i}"
    continued = [d for d in by_id.values() if len(d["meta_info"]["segments"]) > 1]
    assert continued, "the kill should have interrupted some sequences"
    # A continued sequence started on the victim, or tail migration moved it (an idle engine at the end).
    assert all(d["meta_info"]["segments"][0]["endpoint"] == victim.endpoint
               or d["meta_info"]["segments"][0]["outcome"].startswith("migrated to ") for d in continued)
    assert any(d["meta_info"]["segments"][0]["endpoint"] == victim.endpoint for d in continued)
    await async_wait_until(lambda: _gone(m, victim.endpoint),
                           message="victim removed")


async def _gone(m, endpoint):
    return await m.state_of(endpoint) is None


async def test_engine_4xx_is_returned_as_is_and_not_held_against_the_instance(start_manager, start_engines):
    m = await start_manager()
    (engine,) = await start_engines([])
    await register(m, engine)
    too_long = list(range(200)) * 6  # 1200 tokens > the engine's 1024-token context
    for _ in range(3):
        status, body = await m.post("/generate", {"input_ids": too_long, "sampling_params": greedy(4)})
        assert status == 400 and "context length" in body["error"]
    # Within the context but past what SGLang's scheduler admits (context - 6): the engine ends the
    # request with an abort that carries status_code 400; still the caller's error, not the instance's.
    for _ in range(3):
        status, body = await m.post("/generate", {"input_ids": [i % 200 for i in range(1020)],
                                                  "sampling_params": greedy(4)})
        assert status == 400 and "exceeds the maximum allowed length" in body["error"], body
    inst = (await m.status())["instances"][0]
    assert inst["state"] == "active" and inst["consecutive_failures"] == 0 and inst["in_flight"] == 0


async def test_requests_wait_for_a_first_instance_then_fail_clearly_past_the_bound(start_manager, start_engines,
                                                                                     model):
    m = await start_manager(no_instance_wait_timeout_s="30")
    req = asyncio.ensure_future(m.post("/generate", {"input_ids": [5], "sampling_params": greedy(6)}))
    (engine,) = await start_engines([])
    assert not req.done()
    await register(m, engine)
    status, out = await req
    assert status == 200 and out["output_ids"] == reference_generate(model, [5], 6)[0]

    m2 = await start_manager(no_instance_wait_timeout_s="0.3")
    status, err = await m2.post("/generate", {"input_ids": [5], "sampling_params": greedy(6)})
    assert status == 503 and "no rollout instance could take the request within 0.3s" in err["error"]


async def test_attempts_are_bounded_and_the_error_names_the_instances(start_manager, start_engines):
    m = await start_manager(max_attempts_per_request="2", health_failure_threshold="100")
    a, b = await start_engines(["--fail-rate", "1.0"], ["--fail-rate", "1.0"])
    await register(m, a, b)
    status, err = await m.post("/generate", {"input_ids": [1], "sampling_params": greedy(4)})
    assert status == 502
    assert "2 attempt(s)" in err["error"] and a.endpoint in err["error"] and b.endpoint in err["error"]


async def test_client_disconnect_aborts_outstanding_requests_on_the_instances(start_manager, start_engines):
    m = await start_manager()
    (engine,) = await start_engines(["--token-delay-s", "0.05"])
    await register(m, engine)
    items = [[i, {"input_ids": [i + 1], "sampling_params": greedy(500)}] for i in range(4)]
    async with aiohttp.ClientSession() as s:
        resp = await s.post(m.url + "/batch_generate_requests", json=items)
        assert resp.status == 200
        await async_wait_until(lambda: _running_on_engine(engine, 4), message="4 sequences running")
        resp.close()  # the trainer went away
    await async_wait_until(lambda: _running_on_engine(engine, 0, exact=True), message="engine aborted them")
    await async_wait_until(lambda: _manager_in_flight(m, 0), message="manager accounting back to zero")


async def _running_on_engine(engine, n, exact=False):
    async with aiohttp.ClientSession() as s, s.get(engine.url + "/server_info") as r:
        running = (await r.json())["cpu_engine"]["running"]
    return running == n if exact else running >= n


async def _manager_in_flight(m, n):
    inst = (await m.status())["instances"][0]
    return inst["in_flight"] == n and inst["in_flight_tokens"] == 0


async def _engine_running(engine):
    async with aiohttp.ClientSession() as s, s.get(engine.url + "/server_info") as r:
        return (await r.json())["cpu_engine"]["running"]


async def test_local_instances_go_first_and_their_sequences_move_to_remote_after_the_budget(
        start_manager, start_engines, model):
    m = await start_manager(local_budget_initial_s="0.5")
    local, remote = await start_engines(["--token-delay-s", "0.05"], [])
    await register(m, local, kind="local")
    await register(m, remote)
    prompts = [[i + 1, i + 2] for i in range(4)]
    items = [[i, {"input_ids": p, "sampling_params": greedy(30)}] for i, p in enumerate(prompts)]
    status, lines = await _batch(m, items)
    assert status == 200 and all(x["success"] for x in lines)
    for x in lines:
        out = x["data"]
        assert out["output_ids"] == reference_generate(model, prompts[x["id"]], 30)[0]
        first, second = out["meta_info"]["segments"]
        assert first["endpoint"] == local.endpoint and first["outcome"].startswith("preempted")
        assert second["endpoint"] == remote.endpoint and first["end"] == second["start"]
        assert 0 < first["end"] < 30  # the local instance did part of the work, none of it redone
    st = await m.status()
    assert st["generation"]["preempted"] == 4 and st["local"]["open"] is False
    assert "budget" in st["local"]["last_close_reason"]
    await async_wait_until(lambda: _zero(_engine_running(local)), message="local engine aborted the sequences")


async def _zero(coro):
    return await coro == 0


async def _batch(m, items):
    async with m.session.post(m.url + "/batch_generate_requests", json=items) as resp:
        return resp.status, [json.loads(line) async for line in resp.content]


async def test_abort_local_requests_moves_sequences_now_and_metrics_adapt_the_budget(
        start_manager, start_engines, model):
    m = await start_manager(local_budget_initial_s="60", local_budget_gain="0.5")
    local, remote = await start_engines(["--token-delay-s", "0.05"], [])
    await register(m, local, kind="local")
    await register(m, remote)
    items = [[i, {"input_ids": [i + 3], "sampling_params": greedy(40)}] for i in range(3)]
    batch = asyncio.ensure_future(_batch(m, items))
    await async_wait_until(lambda: _engine_running_at_least(local, 3), message="3 sequences on the local engine")
    status, body = await m.post("/abort_local_requests", {})
    assert status == 200 and body == {"local_window_was_open": True, "moved_sequences": 3}
    status, lines = await batch
    assert all(x["success"] for x in lines)
    for x in lines:
        assert x["data"]["output_ids"] == reference_generate(model, [x["id"] + 3], 40)[0]
        assert [s["endpoint"] for s in x["data"]["meta_info"]["segments"]] == [local.endpoint, remote.endpoint]
    # Step ends: the trainer waited 4 s for rollouts; the budget grows by gain * (bubble - remote idle).
    status, res = await m.post("/update_metrics", {"step_time_s": 10.0, "trainer_bubble_time_s": 4.0,
                                                   "step_throughput": 123.0})
    assert status == 200
    assert res["previous_local_budget_s"] == 60.0
    assert res["local_budget_s"] == pytest.approx(60.0 + 0.5 * (4.0 - res["remote_idle_s"]))
    assert 0 <= res["remote_idle_s"] < 60
    # The next request opens a new local window (the step boundary re-armed it).
    status, _ = await m.post("/generate", {"input_ids": [1], "sampling_params": greedy(2)})
    assert status == 200 and (await m.status())["local"]["armed"] is False


async def _engine_running_at_least(engine, n):
    return await _engine_running(engine) >= n


async def test_streaming_generate_looks_like_sglang_and_survives_a_death(start_manager, start_engines, model):
    from rollout_manager.sglang import wire

    m = await start_manager()
    dying, healthy = await start_engines(["--die-after-tokens", "5", "--token-delay-s", "0.005"], [])
    await register(m, dying)
    prompts = [[8, 9], [10]]
    body = {"input_ids": prompts, "sampling_params": greedy(12), "stream": True}
    raw = []

    async def read():
        async with m.session.post(m.url + "/generate", json=body) as resp:
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            async for data in resp.content.iter_any():
                raw.append(data)

    reader = asyncio.ensure_future(read())
    await async_wait_until(lambda: dying.proc.popen.poll() is not None, message="the dying engine to die")
    await register(m, healthy)
    await reader
    assert b"".join(raw).endswith(wire.DONE_FRAME)
    chunks = iter_frames(raw)
    finals = {c["index"]: c for c in chunks if c["meta_info"]["finish_reason"] is not None}
    for i, p in enumerate(prompts):
        assert finals[i]["output_ids"] == reference_generate(model, p, 12)[0]
        partial = [c for c in chunks if c["index"] == i and c["meta_info"]["finish_reason"] is None]
        lengths = [len(c["output_ids"]) for c in partial]
        assert lengths == sorted(lengths) and all(c["output_ids"] == finals[i]["output_ids"][:n]
                                                  for c, n in zip(partial, lengths))  # cumulative


async def test_incremental_engine_and_stalled_engine(start_manager, start_engines, model):
    m = await start_manager(stream_stall_timeout_s="1.5", engine_stream_interval=1)  # the stall is at token 6 exactly
    stalling, incremental = await start_engines(["--stall-after-tokens", "6"], ["--incremental-streaming-output"])
    await register(m, stalling)
    req = asyncio.ensure_future(m.post("/generate", {"input_ids": [4, 4], "sampling_params": greedy(20),
                                                     "return_logprob": True}))
    await async_wait_until(lambda: _engine_running_at_least(stalling, 1),
                           message="request on the stalling engine")
    await register(m, incremental)
    status, out = await req
    assert status == 200, out
    ref_ids, ref_lps = reference_generate(model, [4, 4], 20)
    assert out["output_ids"] == ref_ids
    assert [lp[0] for lp in out["meta_info"]["output_token_logprobs"]] == pytest.approx(ref_lps, abs=1e-5)
    first, second = out["meta_info"]["segments"]
    assert first["endpoint"] == stalling.endpoint and "stalled" in first["outcome"] and first["end"] == 6
    assert second["endpoint"] == incremental.endpoint and second["start"] == 6


async def test_sigterm_lets_in_flight_work_finish_within_the_grace_then_fails_the_rest_clearly(
        start_manager, start_engines):
    m = await start_manager(shutdown_grace_s="1")
    (engine,) = await start_engines(["--token-delay-s", "0.05"])
    await register(m, engine)
    items = [[0, {"input_ids": [1], "sampling_params": greedy(2)}],
             [1, {"input_ids": [2], "sampling_params": greedy(400)}]]  # ~20 s: outlives the grace
    lines = []
    async with m.session.post(m.url + "/batch_generate_requests", json=items) as resp:
        async for raw in resp.content:
            lines.append(json.loads(raw))
            if len(lines) == 1:
                m.proc.signal(signal.SIGTERM)
    assert [x["id"] for x in lines] == [0, 1]
    assert lines[0]["success"] and not lines[1]["success"]
    assert lines[1]["status_code"] == 503 and "shutting down" in lines[1]["error"]
    assert m.proc.wait(20) == 0
    await async_wait_until(lambda: _zero(_engine_running(engine)), message="the engine told to abort")
