"""Staged weight activation with CPU-engine boxes: a box keeps serving while a version is pushed and verified
into its receiver agent, then pauses only to load it; sequences in flight keep every token and continue under
the new weights, their chunks saying so; a load that fails after the pause never serves."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import aiohttp
import numpy as np
import pytest
import torch
from support import async_wait_until
from weight_fleet import engine_checksums, expected_checksums, weight_fleet
from weight_fleet import publish as publish_weights

from rollout_manager.cpu_engine.model import build_model, fixed_threads, reference_generate
from rollout_manager.weights.agent_client import AgentClient
from rollout_manager.weights.protocol import CommitRequest, PrepareRequest, PushRequest

MODEL = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2}
PROMPT = [5, 17, 3, 99]

pytestmark = pytest.mark.slow


def weights(step: int) -> dict[str, torch.Tensor]:
    """Step 1: another random model (changes every greedy token); each later step nudges 2% of lm_head."""
    out = {n: t.contiguous() for n, t in build_model(7, **MODEL).state_dict().items()}
    for s in range(2, step + 1):
        bits = out["lm_head.weight"].view(torch.int32).reshape(-1).numpy().copy()
        idx = np.random.default_rng(s).choice(len(bits), len(bits) // 50, replace=False)
        bits[idx] += 1 << 12
        out["lm_head.weight"] = torch.from_numpy(bits).view(torch.float32).reshape(out["lm_head.weight"].shape)
    return out


publish = partial(publish_weights, make=weights)


async def set_faults(url: str, **faults: Any) -> None:
    async with aiohttp.ClientSession() as s, s.post(url + "/debug/faults", json=faults) as r:
        assert r.status == 200, await r.text()


async def server_info(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.get(url + "/server_info") as r:
        return dict(await r.json())


async def stream(url: str, n: int, seen: list[dict[str, Any]]) -> None:
    """A greedy streamed /generate; every chunk goes into ``seen`` as it arrives."""
    body = {"input_ids": PROMPT, "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}}
    async with aiohttp.ClientSession() as s, s.post(url + "/generate", json=body) as r:
        assert r.status == 200
        async for raw in r.content:
            line = raw.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]":
                seen.append(json.loads(line[5:]))


def reference(state: dict[str, torch.Tensor] | None, prefix: list[int], n: int) -> list[int]:
    model = build_model(0, **MODEL)  # what the engine starts with (--seed 0)
    if state is not None:
        model.load_named_tensors(state.items())
    with fixed_threads():
        return reference_generate(model, prefix, n)[0]


@pytest.fixture
async def fleet(start_manager, tmp_path) -> AsyncIterator[Any]:
    async with weight_fleet(start_manager, tmp_path, MODEL, "tcp", weight_activation="staged") as f:
        yield f


async def test_a_stream_crossing_a_staged_activation_keeps_every_token_under_the_new_weights(fleet) -> None:
    m, sender, add_box = fleet
    box = await add_box()
    await set_faults(box.url, token_delay_s=0.02)  # a long sequence: several seconds
    n = 300
    seen: list[dict[str, Any]] = []
    task = asyncio.create_task(stream(box.url, n, seen))
    via = asyncio.ensure_future(m.post("/generate", {"input_ids": [9, 9, 9], "sampling_params": {
        "temperature": 0, "max_new_tokens": n, "ignore_eos": True}}))  # the same, through the manager
    await async_wait_until(lambda: len(seen) >= 10, timeout_s=30, message="the stream to start")
    ws = await publish(m, sender, 1)  # returns once the box serves version 1
    await asyncio.wait_for(task, 60)
    status, through = await asyncio.wait_for(via, 60)
    assert status == 200 and len(through["output_ids"]) == n, through
    segments = through["meta_info"]["segments"]  # neither aborted nor moved: one box, continuing
    assert {s["endpoint"] for s in segments} == {box.endpoint} and segments[-1]["weight_version"] == "1"
    assert not [s for s in segments if s["outcome"] != "finished" and "version" not in s["outcome"]], segments

    final = seen[-1]["meta_info"]
    assert final["finish_reason"]["type"] == "length" and final["completion_tokens"] == n  # never aborted
    versions = [c["meta_info"]["weight_version"] for c in seen]
    assert versions[0] == "0" and versions[-1] == "1"
    assert versions == sorted(versions)  # once a chunk says 1, every later one does
    spans = final["weight_versions"]
    assert [s["version"] for s in spans] == ["0", "1"]
    k = spans[0]["end"]
    assert 0 < k < n and spans[1] == {"version": "1", "start": k, "end": n}
    out = seen[-1]["output_ids"] if len(seen[-1]["output_ids"]) == n else [t for c in seen for t in c["output_ids"]]
    assert len(out) == n
    assert out[:k] == reference(None, PROMPT, k)  # the old weights up to the swap
    assert out[k:] == reference(ws, PROMPT + out[:k], n - k)  # the new weights from the same prefix on

    st = await m.status()
    inst = next(i for i in st["instances"] if i["endpoint"] == box.endpoint)
    assert inst["state"] == "active" and inst["weight_version"] == 1
    wv = inst["weight_versions"]
    assert wv["active"] == 1 and wv["staged"] is None and wv["activating"] is None
    assert 0 < wv["paused_s"]["1"] < 5
    assert not [e for e in st["recent_events"] if e["endpoint"] == box.endpoint and e["to"] == "syncing"]
    assert st["generation"]["failed"] == 0 and st["generation"].get("evicted", 0) == 0
    assert (await server_info(box.url))["cpu_engine"]["paused"] is False
    async with aiohttp.ClientSession() as s, s.get(m.url + "/metrics", headers=m.headers) as r:
        text = await r.text()
    assert f'instance_weight_paused_seconds{{endpoint="{box.endpoint}",version="1"}}' in text


async def test_a_load_that_fails_after_the_pause_never_serves_and_a_full_push_recovers(start_manager, tmp_path) -> None:
    # The full pushes that follow the failed activation fail too until the test disarms the fault: enough
    # attempts that a busy machine cannot use them all up (and remove the box) before it does.
    async with weight_fleet(start_manager, tmp_path, MODEL, "tcp", weight_activation="staged",
                            weight_push_max_attempts="100") as (m, sender, add_box):
        await _fails_after_the_pause(m, sender, add_box)


async def _fails_after_the_pause(m: Any, sender: Any, add_box: Any) -> None:
    box = await add_box()
    await publish(m, sender, 1)
    await set_faults(box.url, load_fail=True)
    await asyncio.to_thread(sender.stage, weights(2), 2)
    status, res = await m.post("/update_weight_version", {})
    assert status == 200, res

    async def out_of_service() -> bool:  # the event stays; last_error moves on to the full pushes' failures
        st = await m.status()
        inst = next((i for i in st["instances"] if i["endpoint"] == box.endpoint), None)
        assert inst is not None, f"the box was removed: {st['recent_events']}"
        return inst["state"] == "syncing" and any(
            e["endpoint"] == box.endpoint and e["to"] == "syncing" and "activation of version 2 failed" in e["reason"]
            for e in st["recent_events"])

    await async_wait_until(out_of_service, timeout_s=30, message="the box out of service after the failed load")
    assert (await server_info(box.url))["cpu_engine"]["paused"] is True  # no token from a half-loaded model
    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{box.rport}/info") as r:
        assert "activation of version 2" in (await r.json())["activation_failed"]
    await set_faults(box.url, load_fail=False)

    async def serving_v2() -> bool:
        inst = next(i for i in (await m.status())["instances"] if i["endpoint"] == box.endpoint)
        return inst["state"] == "active" and inst["weight_version"] == 2

    await async_wait_until(serving_v2, timeout_s=30, message="the box back at version 2 after a full push")
    assert (await server_info(box.url))["cpu_engine"]["paused"] is False
    assert await engine_checksums(box.url) == expected_checksums(weights(2))


async def test_the_receiver_holds_one_staged_version_and_activates_only_that(fleet) -> None:
    """Driven by hand: v2 staged, then v3 staged over it (v2 dropped); activating v2 is refused, v3 loads."""
    m, sender, add_box = fleet
    box = await add_box()
    await publish(m, sender, 1)
    receiver = f"http://127.0.0.1:{box.rport}"
    sender_url = f"http://127.0.0.1:{sender.port}"
    async with aiohttp.ClientSession() as session:
        agents = AgentClient(session, None, 60)
        for version in (2, 3):
            await asyncio.to_thread(sender.stage, weights(version), version)
            layout = await agents.layout(sender_url, 0)
            prep = await agents.prepare(receiver, PrepareRequest(version=version, layout=layout.layout,
                                                                 transport="tcp"))
            push = await agents.push(sender_url, 0, PushRequest(version=version, ip="127.0.0.1", num_engines=1,
                                                                session_ids=prep.session_ids,
                                                                buffer_addr=prep.buffer_addr, transport="tcp"))
            answer = await agents.commit(receiver, CommitRequest(version=version, fingerprint=push.fingerprint,
                                                                 shards=push.shards, checksums=push.checksums,
                                                                 stage=True))
            assert answer.staged and answer.reloaded == 0
            assert await engine_checksums(box.url) == expected_checksums(weights(1))  # SGLang untouched
        async with session.get(receiver + "/info") as r:
            info = await r.json()
        assert info["staged_version"] == 3 and info["weight_version"] == 1
        async with session.post(receiver + "/activate", json={"version": 2}) as r:
            assert r.status == 409 and "not staged" in (await r.json())["error"]
        async with session.post(receiver + "/activate", json={"version": 3, "mode": "bogus"}) as r:
            assert r.status == 400 and "mode" in (await r.json())["error"]
        async with session.post(receiver + "/activate", json={"version": 3, "mode": "in_place"}) as r:
            done = await r.json()
            assert r.status == 200, done
        assert done["version"] == 3 and done["mode"] == "in_place" and done["paused_s"] >= done["load_s"] > 0
        assert await engine_checksums(box.url) == expected_checksums(weights(3))
        async with session.get(box.url + "/model_info") as r:
            assert (await r.json())["weight_version"] == "3"


async def test_the_trainers_publish_returns_once_every_box_has_staged_not_once_they_have_loaded(fleet) -> None:
    """WeightPusher(wait_until="staged") (the verl plugin's default): the trainer goes on while the boxes load."""
    from trainer_plugin.client import ManagerClient
    from trainer_plugin.weight_push import WeightPusher

    m, sender, add_box = fleet
    boxes = [await add_box(), await add_box()]
    for box in boxes:
        await set_faults(box.url, load_delay_s=3.0)  # each load takes 3 s
    pusher = WeightPusher(m.url, [], 0, wait_for="all", wait_until="staged", timeout_s=60)
    pusher.sender = sender  # this fleet's sender, already reported
    async with ManagerClient(m.url) as client:
        pusher.run_id = (await client.health()).get("run_id")
        answer = await pusher.push(client, weights(1), 1)
        pusher.sender = None  # the fleet stops it
    assert answer["new_weight_version"] == 1 and not answer["timed_out"] and answer["instances_at_version"] == 2
    assert answer["waited_s"] < 3.0  # no box had finished loading
    st = await m.status()
    assert all(i["state"] == "active" for i in st["instances"])  # and none left service meanwhile

    async def serving() -> bool:
        return {i["weight_version"] for i in (await m.status())["instances"]} == {1}

    await async_wait_until(serving, timeout_s=30, message="both boxes serving version 1")


async def test_a_box_that_dies_while_activating_is_removed_and_the_others_serve_the_version(fleet) -> None:
    m, sender, add_box = fleet
    doomed, other = await add_box(), await add_box()
    await set_faults(doomed.url, load_delay_s=5.0)
    await asyncio.to_thread(sender.stage, weights(1), 1)
    status, res = await m.post("/update_weight_version", {})
    assert status == 200, res

    async def activating() -> bool:
        inst = next(i for i in (await m.status())["instances"] if i["endpoint"] == doomed.endpoint)
        return inst["weight_versions"]["activating"] == 1

    await async_wait_until(activating, timeout_s=30, message="the doomed box activating version 1")
    doomed.engine.stop()  # SGLang dies mid-load

    async def settled() -> bool:
        st = await m.status()
        return [(i["endpoint"], i["state"], i["weight_version"]) for i in st["instances"]] == [
            (other.endpoint, "active", 1)]

    await async_wait_until(settled, timeout_s=60, message="the dead box removed, the other serving version 1")


async def test_a_request_waiting_for_a_min_weight_version_runs_once_a_box_activates_it(fleet) -> None:
    """A staged box stays active, so no state change tells the dispatcher's queue that it now qualifies for a
    request waiting with ``min_weight_version``; the activation must. Before, such a request with nothing
    else in flight was placed only when its wait expired (``no_instance_wait_timeout_s``, 600 s by default)."""
    m, sender, add_box = fleet
    box = await add_box()
    await set_faults(box.url, load_delay_s=1.0)  # the request is queued well before the box serves version 1
    await asyncio.to_thread(sender.stage, weights(1), 1)
    status, res = await m.post("/update_weight_version", {})
    assert status == 200, res
    body = {"input_ids": PROMPT, "min_weight_version": 1,
            "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}}
    status, out = await asyncio.wait_for(m.post("/generate", body), 30)
    assert status == 200, out
    assert [s["weight_version"] for s in out["meta_info"]["segments"]] == ["1"]
