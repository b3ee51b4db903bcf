"""Staged activation end to end through the manager on real SGLang 0.5.23 (CPU), issue 31's "Done when".

Two real SGLang boxes (through scripts/launch_sglang.sh, receiver agent beside each) register with a manager in
the default ``weight_activation = "staged"``. Long greedy sequences run through the manager's ``/generate`` on
both boxes (streamed and not) while the trainer side (``WeightPusher``: sender agent in this process, Mooncake
TCP over loopback) publishes a new version. The boxes stay ``active`` throughout; no sequence is aborted, moved
or continued elsewhere; each sequence's answer has one segment per version on the same box, cut at the token
where SGLang's weights changed; the tokens before the cut equal a float32 ``transformers`` forward of the old
weights and the tokens after it of the new weights from the same prefix. A ``min_weight_version`` request sent
right after the publish runs only on the new version.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from real_sglang import PushFleet, push_fleet
from safetensors.torch import load_file
from test_real_sglang_pushes import perturbed, transformers_greedy

from trainer_plugin.client import ManagerClient
from trainer_plugin.weight_push import WeightPusher

pytestmark = [pytest.mark.real_sglang, pytest.mark.slow]

SENDER_IPS = ["127.0.0.1", "127.0.0.2"]
VERSION = 1
# (prompt, new tokens, streamed): two per box (the manager places by least in flight); the context is 1,024
CROSSING = [([5, 6, 7, 8], 1000, True), ([9, 10, 11], 1000, True), ([300, 200, 100, 50, 25], 1000, False),
            ([17, 18, 19], 1000, False)]
FLOOR_PROMPT, FLOOR_TOKENS = [40, 41, 42], 32


@pytest.fixture(scope="module")
def rig(real_sglang_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PushFleet]:
    # weight_activation is left at its default ("staged"); tail migration is off so that no sequence moves for
    # a reason other than the weight update (it never should for that reason either)
    with push_fleet(real_sglang_model, tmp_path_factory.mktemp("staged_manager"), ["a", "b"],
                    tail_migration="false") as fleet:
        yield fleet


def body(prompt: list[int], n: int, stream: bool, **extra: Any) -> dict[str, Any]:
    return {"input_ids": prompt, "stream": stream, **extra,
            "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}}


async def generate(s: aiohttp.ClientSession, url: str, req: dict[str, Any], progress: list[int]) -> dict[str, Any]:
    """The manager's answer: its JSON, or the last chunk of its cumulative stream (``progress``: tokens so far)."""
    async with s.post(url + "/generate", json=req) as r:
        if not req["stream"]:
            text = await r.text()
            assert r.status == 200, text
            return dict(json.loads(text))
        assert r.status == 200, await r.text()
        last: dict[str, Any] = {}
        async for raw in r.content:
            line = raw.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]":
                last = json.loads(line[5:])
                progress.append(len(last["output_ids"]))
        return last


@dataclass
class Watch:
    """What /get_instances_status said while the version travelled, polled without pause."""
    states: set[tuple[str, str]] = field(default_factory=set)
    seen: dict[str, set[str]] = field(default_factory=dict)  # endpoint -> {"staging", "staged", "activating"}


async def watch_status(s: aiohttp.ClientSession, url: str, watch: Watch, stop: asyncio.Event) -> None:
    while not stop.is_set():
        async with s.get(url + "/get_instances_status") as r:
            status = await r.json()
        for inst in status["instances"]:
            watch.states.add((inst["endpoint"], inst["state"]))
            wv = inst["weight_versions"]
            watch.seen.setdefault(inst["endpoint"], set()).update(k for k in ("staging", "staged", "activating")
                                                                   if wv[k] == VERSION)
        await asyncio.sleep(0.01)  # a poll interval, not synchronisation


def metric(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        m = re.match(rf"^{name}(?:\{{(.*)\}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            return float(m.group(2))
    return None


async def test_sequences_crossing_a_staged_version_keep_their_box_and_every_token(rig: PushFleet) -> None:
    checkpoint = load_file(str(rig.model_dir / "model.safetensors"))
    new = perturbed(checkpoint, seed=VERSION)
    endpoints = {b.endpoint for b in rig.boxes}
    pusher = WeightPusher(rig.manager.url, SENDER_IPS, rig.sender_port, protocol="tcp", wait_for=None,
                          timeout_s=180, groups_per_sender=2, engines_per_group=2)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s, \
            ManagerClient(rig.manager.url) as client:
        try:
            await pusher.start(client)
            await asyncio.to_thread(pusher.stage, new, VERSION)  # the trainer's step, before the rollouts start
            progress: list[list[int]] = [[] for _ in CROSSING]
            tasks = [asyncio.create_task(generate(s, rig.manager.url, body(p, n, st), progress[i]))
                     for i, (p, n, st) in enumerate(CROSSING)]
            deadline = time.monotonic() + 120
            while not all(progress[i] and progress[i][-1] >= 20 for i, c in enumerate(CROSSING) if c[2]):
                assert time.monotonic() < deadline and not any(t.done() for t in tasks), "the streams to start"
                await asyncio.sleep(0.05)
            watch, stop = Watch(), asyncio.Event()
            watcher = asyncio.create_task(watch_status(s, rig.manager.url, watch, stop))

            published = await pusher.publish(client, VERSION)  # returns at once (wait_for None)
            assert published["new_weight_version"] == VERSION, published
            floor = asyncio.create_task(generate(s, rig.manager.url, body(FLOOR_PROMPT, FLOOR_TOKENS, False,
                                                                          min_weight_version=VERSION), []))
            deadline = time.monotonic() + 120
            while not all(
                    i["weight_versions"]["active"] == VERSION and i["weight_versions"]["activating"] is None
                    for i in (await client.get_instances_status())["instances"]):
                assert time.monotonic() < deadline, "both boxes to serve the new version"
                await asyncio.sleep(0.05)
            assert not all(t.done() for t in tasks), "every sequence ended before the version was activated"
            outs = await asyncio.wait_for(asyncio.gather(*tasks), 300)
            floor_out = await asyncio.wait_for(floor, 120)
            stop.set()
            await watcher
            status = await client.get_instances_status()
            async with s.get(rig.manager.url + "/metrics") as r:
                metrics = await r.text()
        finally:
            pusher.stop()

    # the boxes never left service, and each one held the version before it loaded it
    assert {state for _, state in watch.states} == {"active"}, watch.states
    for ep in endpoints:
        assert watch.seen.get(ep, set()) & {"staging", "staged", "activating"}, (ep, watch.seen)

    # every crossing sequence: not aborted, not moved, two segments on one box cut where SGLang's weights changed
    crossed: dict[str, int] = {}
    for (prompt, n, streamed), out in zip(CROSSING, outs):
        meta = out["meta_info"]
        assert meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == n, meta["finish_reason"]
        ids = out["output_ids"]
        assert len(ids) == n
        segs = meta["segments"]
        assert [s_["weight_version"] for s_ in segs] == ["0", str(VERSION)], (streamed, segs)
        assert segs[0]["endpoint"] == segs[1]["endpoint"] and segs[0]["instance"] == segs[1]["instance"], segs
        k = segs[0]["end"]
        assert segs[0]["start"] == 0 and segs[1]["start"] == k and segs[1]["end"] == n and 0 < k < n, segs
        assert segs[0]["outcome"] == f"weight version {VERSION} from token {k}" and segs[1]["outcome"] == "finished"
        assert meta["weight_version"] == str(VERSION)
        assert meta["weight_versions"] == [{"version": "0", "start": 0, "end": k},
                                           {"version": str(VERSION), "start": k, "end": n}], meta["weight_versions"]
        assert ids[:k] == transformers_greedy(rig.model_dir, checkpoint, [prompt], k)[0], (streamed, k)
        assert ids[k:] == transformers_greedy(rig.model_dir, new, [prompt + ids[:k]], n - k)[0], (streamed, k)
        crossed[segs[0]["endpoint"]] = crossed.get(segs[0]["endpoint"], 0) + 1
    assert set(crossed) == endpoints, crossed  # sequences crossed the version on both boxes

    # the request with min_weight_version = the new version ran on it only
    fm = floor_out["meta_info"]
    assert [s_["weight_version"] for s_ in fm["segments"]] == [str(VERSION)], fm["segments"]
    assert fm.get("weight_versions", [{"version": str(VERSION)}])[0]["version"] == str(VERSION)
    assert floor_out["output_ids"] == transformers_greedy(rig.model_dir, new, [FLOOR_PROMPT], FLOOR_TOKENS)[0]

    # status and metrics: active at the version, nothing staged or activating, the pause per version
    for inst in status["instances"]:
        wv = inst["weight_versions"]
        assert (inst["state"], inst["weight_version"], wv["active"], wv["staged"], wv["activating"]) == (
            "active", VERSION, VERSION, None, None), inst
        paused = wv["paused_s"][str(VERSION)]
        assert 0 < paused < 30, wv
        assert metric(metrics, "rollout_manager_instance_weight_paused_seconds", endpoint=inst["endpoint"],
                      version=str(VERSION)) == pytest.approx(paused, abs=1e-5)
    for name in ("continuations", "migrated_sequences", "evicted_sequences", "failed_sequences"):
        assert metric(metrics, f"rollout_manager_{name}_total") == 0, name
    assert metric(metrics, "rollout_manager_instance_weight_version_staged") is None
    assert metric(metrics, "rollout_manager_instance_weight_version_activating") is None


async def test_a_min_weight_version_request_alone_runs_once_a_box_serves_the_version(rig: PushFleet) -> None:
    """Nothing else in flight: the request waits for the version, and only the activation can tell the
    manager's queue that a box now qualifies (a box stays ``active`` when staged, so there is no state change).
    Before the fix it was placed only when its wait timed out (``no_instance_wait_timeout_s``, 600 s)."""
    checkpoint = load_file(str(rig.model_dir / "model.safetensors"))
    new = perturbed(checkpoint, seed=11)
    pusher = WeightPusher(rig.manager.url, SENDER_IPS, rig.sender_port, protocol="tcp", wait_for=None,
                          timeout_s=180, groups_per_sender=2, engines_per_group=2)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s, \
            ManagerClient(rig.manager.url) as client:
        try:
            await pusher.start(client)
            version = int((await client.health())["weight_version"]) + 1
            await asyncio.to_thread(pusher.stage, new, version)
            await pusher.publish(client, version)
            floor = asyncio.create_task(generate(s, rig.manager.url, body(FLOOR_PROMPT, FLOOR_TOKENS, False,
                                                                          min_weight_version=version), []))
            deadline = time.monotonic() + 120
            while not any(i["weight_versions"]["active"] == version and i["weight_versions"]["activating"] is None
                          for i in (await client.get_instances_status())["instances"]):
                assert time.monotonic() < deadline and not floor.done(), "a box to serve the new version"
                await asyncio.sleep(0.05)
            served = time.monotonic()
            done, _ = await asyncio.wait([floor], timeout=60)
            assert done, "the request was not placed within 60 s of a box serving its min_weight_version"
            out = floor.result()
            waited = time.monotonic() - served
        finally:
            pusher.stop()
    assert waited < 30, waited
    assert [s_["weight_version"] for s_ in out["meta_info"]["segments"]] == [str(version)], out["meta_info"]
    assert out["output_ids"] == transformers_greedy(rig.model_dir, new, [FLOOR_PROMPT], FLOOR_TOKENS)[0]
