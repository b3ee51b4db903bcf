"""Evacuation after a preemption notice, against a real manager and real CPU engines: the long sequences move
before the box goes, the short ones finish there, every output equals an uninterrupted greedy run, almost nothing
is made twice; a kill without notice, for comparison; the API's refusals and the box-token rule."""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

import aiohttp
import pytest
from support import PY, ROOT, async_wait_until

from rollout_manager import ops
from rollout_manager.cpu_engine.model import build_model, reference_generate

pytestmark = pytest.mark.slow  # every test here starts real processes

# A chunk every 8 tokens; no tail migration (the evacuation alone moves sequences); health checks that make no
# token (so the engines' token counts are the sequences' alone).
SETTINGS = {"engine_stream_interval": "8", "tail_migration": "false", "health_check_path": "/health"}
SLOW = ["--token-delay-s", "0.15"]  # under 7 tokens/s per sequence: the long ones cannot end within the notice
FAST = ["--token-delay-s", "0.002"]
LONG, SHORT = 200, 40


@pytest.fixture(scope="module")
def model():
    return build_model(0)


def greedy(n: int) -> dict[str, Any]:
    return {"temperature": 0.0, "max_new_tokens": n}


async def register(m, *engines, **extra: Any) -> None:
    for e in engines:
        status, body = await m.post("/register_rollout_instance", {"host": "127.0.0.1", "port": e.port, **extra})
        assert status == 200, body
    for e in engines:
        await async_wait_until(lambda e=e: _state_is(m, e.endpoint, "active"), message=f"{e.endpoint} active")


async def _state_is(m, endpoint: str, state: str | None) -> bool:
    return await m.state_of(endpoint) == state


async def instance(m, endpoint: str) -> dict[str, Any] | None:
    return next((i for i in (await m.status())["instances"] if i["endpoint"] == endpoint), None)


async def decoded(engine) -> int:
    """Tokens the CPU engine decoded since it started (its own count, /server_info)."""
    async with aiohttp.ClientSession() as s, s.get(engine.url + "/server_info") as r:
        return int((await r.json())["cpu_engine"]["total_generated_tokens"])


async def metric(m, name: str) -> float:
    async with m.session.get(m.url + "/metrics") as r:
        text = await r.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{"))


def kept_from(outs: list[dict[str, Any]], endpoint: str) -> int:
    """Tokens of the answers made on ``endpoint`` (what the manager kept of that box's work)."""
    return sum(s["end"] - s["start"] for o in outs for s in o["meta_info"]["segments"] if s["endpoint"] == endpoint)


async def measured_and_busy(m, endpoint: str, n: int) -> bool:
    inst = await instance(m, endpoint)
    return inst is not None and inst["in_flight"] == n and bool((inst["decode_step"] or {}).get("measured"))


async def test_evacuation_moves_the_long_keeps_the_short_and_makes_almost_nothing_twice(
        start_manager, start_engines, model):
    m = await start_manager(**{**SETTINGS, "engine_stream_interval": "4"})  # the box's speed is measured sooner
    doomed, healthy = await start_engines(SLOW, FAST)
    await register(m, doomed, preemptible=True, price_per_hour=0.9)
    start = await decoded(doomed)
    longs = [[7, k, 3] for k in range(4)]
    shorts = [[9, k, 5, 1] for k in range(4)]
    bodies = [(p, LONG) for p in longs] + [(p, SHORT) for p in shorts]
    reqs = [asyncio.ensure_future(m.post("/generate", {"input_ids": p, "sampling_params": greedy(n)}))
            for p, n in bodies]
    # every sequence runs on the doomed box, whose speed the manager has measured
    await async_wait_until(lambda: measured_and_busy(m, doomed.endpoint, len(bodies)), timeout_s=30,
                           message="8 sequences on the doomed box, its speed measured")
    await register(m, healthy)
    status, out = await m.post("/evacuate_instance", {"endpoint": f"http://{doomed.endpoint}", "deadline_s": 30,
                                                      "source": "aws", "detail": "spot/instance-action: terminate"})
    assert status == 200, out
    assert out["state"] == "evacuating" and 29 < out["deadline_s"] <= 30
    assert (out["staying"], out["moving"]) == (len(shorts), 0), out  # the long ones were moved in that call
    inst = await instance(m, doomed.endpoint)
    assert inst is not None and inst["state"] == "evacuating" and inst["preemptible"] is True
    assert inst["price_per_hour"] == 0.9
    assert inst["evacuation"]["source"] == "aws" and inst["evacuation"]["moved"] == len(longs)
    # a later notice with a later deadline changes nothing; the box takes no new work it could not finish (200
    # tokens at 0.15 s are 30 s, past half the time left)
    status, again = await m.post("/evacuate_instance", {"endpoint": doomed.endpoint, "deadline_s": 600})
    assert status == 200 and again["deadline_s"] <= 30, again
    status, fresh = await m.post("/generate", {"input_ids": [4, 4], "sampling_params": greedy(LONG)})
    assert status == 200 and [s["endpoint"] for s in fresh["meta_info"]["segments"]] == [healthy.endpoint]

    results = await asyncio.gather(*reqs)
    outs = []
    for (prompt, n), (status, o) in zip(bodies, results):
        assert status == 200, o
        assert o["output_ids"] == reference_generate(model, prompt, n)[0]  # exact: an uninterrupted greedy run
        outs.append(o)
    for o in outs[len(longs):]:  # predicted short: finished where it ran
        assert [(s["endpoint"], s["outcome"]) for s in o["meta_info"]["segments"]] == [(doomed.endpoint, "finished")]
    for o in outs[:len(longs)]:  # predicted long: cut at its last token on the doomed box, continued elsewhere
        first, second = o["meta_info"]["segments"]
        assert first["endpoint"] == doomed.endpoint and first["outcome"].startswith(f"migrated to {healthy.endpoint}")
        assert "aws notice" in first["outcome"]
        assert second["endpoint"] == healthy.endpoint and first["end"] == second["start"] and second["end"] == LONG
    # made twice: what the doomed box decoded beyond what reached the manager (the abort's final chunk carries
    # the tokens made since the last one, so at most the step each abort raced)
    remade = await decoded(doomed) - start - kept_from(outs, doomed.endpoint)
    print(f"\nevacuation with a 30 s notice: {len(longs)} moved, {len(shorts)} stayed; tokens made twice: {remade} "
          f"of {sum(n for _, n in bodies)}")
    assert 0 <= remade <= len(longs)
    assert await metric(m, "rollout_manager_evacuations_total") == 1
    assert await metric(m, "rollout_manager_evacuation_sequences_moved_total") == len(longs)

    # a second notice with an earlier deadline brings the removal forward
    status, sooner = await m.post("/evacuate_instance", {"endpoint": doomed.endpoint, "deadline_s": 0.5,
                                                         "source": "aws"})
    assert status == 200 and sooner["deadline_s"] <= 0.5, sooner
    await async_wait_until(lambda: _state_is(m, doomed.endpoint, None), timeout_s=10, message="the box removed")
    events = (await m.status())["recent_events"]
    gone = [e for e in events if e["endpoint"] == doomed.endpoint and e["to"] == "dead"]
    assert gone and "evacuated: aws notice" in gone[-1]["reason"], events
    saved = await metric(m, "rollout_manager_evacuation_tokens_saved_total")
    assert 0 < saved <= kept_from(outs, doomed.endpoint)
    evac = (await m.status())["evacuations"]
    assert evac["evacuations"]["aws"] == 1 and evac["evacuating"] == 0 and evac["tokens_saved"] == saved


async def test_an_evacuating_box_takes_a_short_sequence_and_not_a_long_one(start_manager, start_engines, model):
    """A box with a notice far off keeps taking what the length model and its step curve say it finishes well
    before its deadline, and only that: a request predicted long waits for another box while a short one behind
    it runs on the evacuating box. Both equal an uninterrupted greedy run."""
    m = await start_manager(**{**SETTINGS, "engine_stream_interval": "4"})  # makespan: the length model is on
    doomed, healthy = await start_engines(["--token-delay-s", "0.02"], FAST)
    await register(m, doomed)
    long_prompt, short_prompt, long_n, short_n = [8, 1, 6], [8, 2, 6], 400, 16
    # a step before: the box's speed measured, each prompt's length learned
    for status, o in await asyncio.gather(*(m.post("/generate", {"input_ids": p, "sampling_params": greedy(n)})
                                            for p, n in ((long_prompt, long_n), (short_prompt, short_n)))):
        assert status == 200, o
    await async_wait_until(lambda: _measured(m, doomed.endpoint), message="the box's speed measured")
    # 15 s: 12 s to the last moves, half of it to finish in; 16 tokens at about 20 ms fit, 400 (8 s) do not
    status, out = await m.post("/evacuate_instance", {"endpoint": doomed.endpoint, "deadline_s": 15,
                                                      "source": "aws"})
    assert status == 200 and out["state"] == "evacuating", out
    long_req = asyncio.ensure_future(m.post("/generate", {"input_ids": long_prompt,
                                                          "sampling_params": greedy(long_n)}))
    await async_wait_until(lambda: _waiting(m, 1), message="the long request waiting for a box")
    status, short = await m.post("/generate", {"input_ids": short_prompt, "sampling_params": greedy(short_n)})
    assert status == 200 and short["output_ids"] == reference_generate(model, short_prompt, short_n)[0], short
    assert [(s["endpoint"], s["outcome"]) for s in short["meta_info"]["segments"]] == [(doomed.endpoint, "finished")]
    assert not long_req.done() and await _waiting(m, 1)  # it never went to the evacuating box
    await register(m, healthy)
    status, long_out = await long_req
    assert status == 200 and long_out["output_ids"] == reference_generate(model, long_prompt, long_n)[0]
    assert [s["endpoint"] for s in long_out["meta_info"]["segments"]] == [healthy.endpoint]


async def _measured(m, endpoint: str) -> bool:
    inst = await instance(m, endpoint)
    return inst is not None and bool((inst["decode_step"] or {}).get("measured"))


async def _waiting(m, n: int) -> bool:
    return (await m.status())["admission"]["waiting_for_instance"] == n


async def test_a_sigterm_notice_removes_the_box_once_nothing_is_left_on_it(start_manager, start_engines, model):
    """A SIGTERM notice is never withdrawn: the box goes when its last sequence has left, long before its
    deadline (its launcher stops then), and an idle one at once; a cloud notice keeps an idle box (the cancel
    test below)."""
    m = await start_manager(**{**SETTINGS, "engine_stream_interval": "4"})
    doomed, healthy = await start_engines(SLOW, FAST)
    await register(m, doomed)
    prompts = [[6, k, 2] for k in range(2)]
    reqs = [asyncio.ensure_future(m.post("/generate", {"input_ids": p, "sampling_params": greedy(LONG)}))
            for p in prompts]
    await async_wait_until(lambda: measured_and_busy(m, doomed.endpoint, len(prompts)), timeout_s=30,
                           message="2 sequences on the doomed box, its speed measured")
    await register(m, healthy)
    # 40 s: about 30 s of decoding left is more than half the time left, so both move at once
    status, out = await m.post("/evacuate_instance", {"endpoint": doomed.endpoint, "deadline_s": 40,
                                                      "source": "sigterm"})
    assert status == 200 and (out["staying"], out["moving"]) == (0, 0), out  # both moved in that call
    await async_wait_until(lambda: _state_is(m, doomed.endpoint, None), timeout_s=15,
                           message="the emptied box removed (its deadline is 40 s away)")
    gone = [e for e in (await m.status())["recent_events"] if e["endpoint"] == doomed.endpoint and e["to"] == "dead"]
    assert gone and gone[-1]["reason"].startswith("evacuated: sigterm notice, nothing left on it"), gone
    assert "2 sequence(s) moved" in gone[-1]["reason"]
    for prompt, (status, o) in zip(prompts, await asyncio.gather(*reqs)):
        assert status == 200 and o["output_ids"] == reference_generate(model, prompt, LONG)[0], o
        assert [s["endpoint"] for s in o["meta_info"]["segments"]] == [doomed.endpoint, healthy.endpoint]

    status, out = await m.post("/evacuate_instance", {"endpoint": healthy.endpoint, "deadline_s": 120,
                                                      "source": "sigterm"})
    assert status == 200, out
    await async_wait_until(lambda: _state_is(m, healthy.endpoint, None), timeout_s=10, message="the idle box removed")


async def test_a_kill_without_notice_makes_again_what_the_box_made_since_its_last_chunk(
        start_manager, start_engines, model):
    """For comparison: a box killed without a notice, at the default chunk interval (64 tokens). Its sequences
    continue from the last chunk the manager saw; what it decoded after that is made again (counted from the
    engines' own token counts)."""
    m = await start_manager(**{k: v for k, v in SETTINGS.items() if k != "engine_stream_interval"})
    doomed, healthy = await start_engines(["--token-delay-s", "0.05"], FAST)
    await register(m, doomed)
    start = await decoded(doomed)
    prompts = [[7, k, 3] for k in range(4)] + [[9, k, 5, 1] for k in range(4)]
    reqs = [asyncio.ensure_future(m.post("/generate", {"input_ids": p, "sampling_params": greedy(200)}))
            for p in prompts]
    await async_wait_until(lambda: _decoded_past(doomed, start + 8 * 30), timeout_s=30,
                           message="about 30 tokens of each sequence made on the doomed box")
    # freeze it (no more tokens, connections open) to read what it decoded, then kill it
    async with aiohttp.ClientSession() as s, s.post(doomed.url + "/debug/faults", json={"stall_after_tokens": 0}) as r:
        assert r.status == 200
    made = await async_wait_until(lambda: _settled(doomed), message="the frozen engine's count settled") - start
    await register(m, healthy)
    doomed.proc.signal(signal.SIGKILL)
    results = await asyncio.gather(*reqs)
    outs = []
    for p, (status, o) in zip(prompts, results):
        assert status == 200, o
        assert o["output_ids"] == reference_generate(model, p, 200)[0]
        outs.append(o)
    remade = made - kept_from(outs, doomed.endpoint)
    estimate = await metric(m, "rollout_manager_preemption_tokens_lost_total")
    print(f"\nkill without notice (chunks of 64): tokens made twice: {remade} of {200 * len(prompts)} (the manager's "
          f"estimate: {estimate:g}, half a chunk per sequence cut)")
    assert 0 < remade <= len(prompts) * 63  # less than a chunk per sequence
    assert estimate == len(prompts) * 31.5


async def _decoded_past(engine, n: int) -> bool:
    return await decoded(engine) >= n


async def _settled(engine) -> int | None:
    """The engine's token count once two reads 0.2 s apart agree (its decoding round in flight has ended)."""
    first = await decoded(engine)
    await asyncio.sleep(0.2)
    return first if await decoded(engine) == first else None


async def test_a_cancelled_notice_returns_the_box_to_service(start_manager, start_engines):
    m = await start_manager(**SETTINGS)
    (box,) = await start_engines(FAST)
    await register(m, box)
    status, out = await m.post("/evacuate_instance", {"endpoint": box.endpoint, "deadline_s": 120,
                                                      "source": "gce"})
    assert status == 200 and out == {"endpoint": box.endpoint, "state": "evacuating", "deadline_s": out["deadline_s"],
                                     "staying": 0, "moving": 0}
    status, out = await m.post("/cancel_evacuation", {"endpoint": f"http://{box.endpoint}/"})
    assert status == 200 and out["state"] == "active", out
    assert (await instance(m, box.endpoint))["evacuation"] is None  # type: ignore[index]
    status, again = await m.post("/cancel_evacuation", {"endpoint": box.endpoint})
    assert status == 409 and "endpoint" in again["error"] and "not evacuating" in again["error"]
    status, o = await m.post("/generate", {"input_ids": [1, 2], "sampling_params": greedy(8)})
    assert status == 200 and o["meta_info"]["segments"][0]["endpoint"] == box.endpoint


async def test_bad_notices_are_refused_naming_the_field(start_manager, stub_engine):
    m = await start_manager(health_check_path="/health")
    stub = await stub_engine()
    status, body = await m.post("/register_rollout_instance", {"host": "127.0.0.1", "port": stub.port,
                                                               "price_per_hour": -1})
    assert status == 400 and "price_per_hour" in body["error"], body
    status, body = await m.post("/register_rollout_instance", {"host": "127.0.0.1", "port": stub.port,
                                                               "preemptible": "yes"})
    assert status == 400 and "preemptible" in body["error"], body
    await register(m, stub, preemptible=True, price_per_hour=2)
    ok = {"endpoint": stub.endpoint, "deadline_s": 30}
    for field, value in [("deadline_s", 0), ("deadline_s", -5), ("deadline_s", "30"), ("deadline_s", 1e9),
                         ("source", "ec2"), ("detail", "x" * 513), ("endpoint", "no-port"), ("endpoint", 5)]:
        status, body = await m.post("/evacuate_instance", {**ok, field: value})
        assert status == 400 and field in body["error"], (field, value, body)
    status, body = await m.post("/evacuate_instance", {"endpoint": stub.endpoint})
    assert status == 400 and "deadline_s" in body["error"], body
    status, body = await m.post("/evacuate_instance", {**ok, "when": 3})
    assert status == 400 and "when" in body["error"], body
    status, body = await m.post("/evacuate_instance", {**ok, "endpoint": "127.0.0.1:1"})
    assert status == 404 and "endpoint" in body["error"] and "127.0.0.1:1" in body["error"], body
    status, body = await m.post("/cancel_evacuation", {"endpoint": "127.0.0.1:1"})
    assert status == 404, body
    status, body = await m.post("/cancel_evacuation", {"endpoint": stub.endpoint})
    assert status == 409 and "not evacuating" in body["error"], body
    status, body = await m.post("/evacuate_instance", {**ok, "deadline_s": 45})  # an int is seconds too
    assert status == 200 and body["state"] == "evacuating", body
    inst = await instance(m, stub.endpoint)
    assert inst is not None and inst["preemptible"] is True and inst["price_per_hour"] == 2
    assert inst["evacuation"]["source"] == "manual" and 0 < inst["evacuation"]["deadline_in_s"] <= 45


async def test_a_box_token_evacuates_only_its_own_box(start_manager, stub_engine):
    m = await start_manager(auth_token="secret", health_check_path="/health")
    a, b = await stub_engine(), await stub_engine()
    tokens = {}
    for stub in (a, b):
        status, body = await m.post("/register_rollout_instance", {"host": "127.0.0.1", "port": stub.port})
        assert status == 200, body
        tokens[stub.port] = body["box_token"]
    for stub in (a, b):
        await async_wait_until(lambda stub=stub: _state_is(m, stub.endpoint, "active"), message="active")
    as_a = {"Authorization": f"Bearer {tokens[a.port]}"}
    status, body = await m.post("/evacuate_instance", {"endpoint": b.endpoint, "deadline_s": 30}, headers=as_a)
    assert status == 403 and b.endpoint in body["error"], body
    status, body = await m.post("/evacuate_instance", {"endpoint": a.endpoint, "deadline_s": 30,
                                                       "source": "aws"}, headers=as_a)  # sigterm: idle, gone at once
    assert status == 200 and body["state"] == "evacuating", body
    status, body = await m.post("/cancel_evacuation", {"endpoint": a.endpoint}, headers={})
    assert status == 401, body
    status, body = await m.post("/cancel_evacuation", {"endpoint": b.endpoint}, headers=as_a)
    assert status == 403, body
    status, body = await m.post("/cancel_evacuation", {"endpoint": a.endpoint}, headers=as_a)
    assert status == 200 and body["state"] == "active", body


async def test_the_cli_evacuates_and_cancels(start_manager, stub_engine):
    m = await start_manager(health_check_path="/health")
    stub = await stub_engine()
    await register(m, stub)

    async def cli(*args: str) -> tuple[int, str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("ROLLOUT_MANAGER_AUTH_TOKEN", "ROLLOUT_MANAGER_ADDR")}
        proc = await asyncio.create_subprocess_exec(PY, "-m", "rollout_manager", *args, "--manager", m.url, cwd=ROOT,
                                                    env=env, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode is not None
        return proc.returncode, out.decode(), err.decode()

    rc, out, err = await cli("evacuate", stub.endpoint, "--deadline-s", "90", "--source", "gce")
    assert rc == ops.OK and f"evacuating {stub.endpoint}: removed in" in out, (rc, out, err)
    rc, out, err = await cli("status")
    assert rc == ops.OK and f"evacuating {stub.endpoint} (gce notice): removed in" in out, out
    rc, out, err = await cli("evacuate", "--cancel", stub.endpoint)
    assert rc == ops.OK and out.startswith("active") and stub.endpoint in out, (rc, out, err)
    rc, out, err = await cli("evacuate", "127.0.0.1:1", "--deadline-s", "5")
    assert rc == ops.UNKNOWN_ENDPOINT and "127.0.0.1:1" in err, (rc, out, err)
    rc, out, err = await cli("evacuate", stub.endpoint)
    assert rc == ops.USAGE and "--deadline-s" in err, (rc, out, err)
