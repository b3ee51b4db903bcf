"""Peer bootstrap: a box that joins gets the current version from an instance already serving it,
verified against the trainer's checksums, and falls back to the trainer's sender when the peer fails."""

from __future__ import annotations

import re
import signal
import time
from functools import partial

import aiohttp
import numpy as np
import pytest
import torch
from weight_fleet import engine_checksums, expected_checksums, weight_fleet
from weight_fleet import publish as publish_weights

from rollout_manager.cpu_engine.model import build_model
from rollout_manager.instances.registry import Instance, Kind, State
from rollout_manager.weights.peers import choose_peer, holders
from rollout_manager.weights.protocol import ServeRequest
from rollout_manager.weights.receiver import Receiver
from rollout_manager.weights.refused import CommitRefused

MODEL = {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 2}


def weights(step: int) -> dict[str, torch.Tensor]:
    """Step 1: a bf16 model; each later step nudges 2% of lm_head's values, as a small optimizer step does."""
    out = {n: t.to(torch.bfloat16).contiguous() for n, t in build_model(7, **MODEL).state_dict().items()}
    for s in range(2, step + 1):
        bits = out["lm_head.weight"].view(torch.int16).reshape(-1).numpy().copy()
        idx = np.random.default_rng(s).choice(len(bits), len(bits) // 50, replace=False)
        bits[idx] += 1
        out["lm_head.weight"] = torch.from_numpy(bits).view(torch.bfloat16).reshape(out["lm_head.weight"].shape)
    return out


async def greedy(url: str) -> list[int]:
    body = {"input_ids": [5, 17, 3, 99], "sampling_params": {"temperature": 0, "max_new_tokens": 12}}
    async with aiohttp.ClientSession() as s, s.post(url + "/generate", json=body) as r:
        assert r.status == 200
        return list((await r.json())["output_ids"])


publish = partial(publish_weights, make=weights)


async def push_to(m, endpoint: str, version: int) -> dict:
    pushes = [p for p in (await m.status())["recent_weight_pushes"]
              if p["endpoint"] == endpoint and p["version"] == version]
    assert pushes, f"no push of version {version} to {endpoint}"
    return pushes[-1]


async def peer_bootstraps(m) -> dict[str, float]:
    async with aiohttp.ClientSession() as s, s.get(m.url + "/metrics", headers=m.headers) as r:
        text = await r.text()
    return {o: float(v) for o, v in re.findall(r'weight_peer_bootstraps_total\{outcome="(\w+)"\} (\S+)', text)}


@pytest.fixture
async def fleet(start_manager, tmp_path, request):
    transport, extra = request.param
    async with weight_fleet(start_manager, tmp_path, MODEL, transport,
                            weight_delta_below_gbps="1e6", **extra) as f:  # every loopback link counts as slow
        yield f


@pytest.mark.slow
@pytest.mark.parametrize("fleet", [("tcp", {}), ("mooncake", {})], indirect=True)
async def test_a_box_joining_while_two_serve_gets_the_version_from_a_peer_and_serves_it(fleet) -> None:
    m, sender, add_box = fleet
    serving = [await add_box(), await add_box()]
    await publish(m, sender, 1)
    ws = await publish(m, sender, 2)  # the peers hold version 2 through a delta, verified
    total = sender.layout.total_bytes
    before = sender.bytes_sent
    late = await add_box()
    assert sender.bytes_sent == before  # the trainer's sender sent nothing for the new box
    boot = await push_to(m, late.endpoint, 2)
    assert boot["source"] in {f"peer:{b.endpoint}" for b in serving} and boot["bytes"] == total
    assert boot["checksums_from"] == "manager"  # the trainer's, as the manager saw them pushed
    assert await engine_checksums(late.url) == expected_checksums(ws)
    assert await greedy(late.url) == await greedy(serving[0].url)
    assert (await peer_bootstraps(m)) == {"ok": 1.0, "fallback": 0.0}
    # The bootstrapped buffer is a verified base: the next step reaches it as a delta from the sender.
    ws = await publish(m, sender, 3)
    nxt = await push_to(m, late.endpoint, 3)
    assert nxt["source"] == "sender:0" and nxt["mode"] == "delta"
    assert await engine_checksums(late.url) == expected_checksums(ws)


@pytest.mark.slow
@pytest.mark.parametrize("fleet", [("tcp", {})], indirect=True)
async def test_a_peer_dying_mid_bootstrap_sends_the_box_back_to_the_trainers_sender(fleet) -> None:
    m, sender, add_box = fleet
    doomed = await add_box("--fault-die-mid-serve")
    ws = await publish(m, sender, 1)
    late = await add_box()
    assert await engine_checksums(late.url) == expected_checksums(ws)
    boot = await push_to(m, late.endpoint, 1)
    assert boot["source"] == "sender:0" and boot["bytes"] == sender.layout.total_bytes
    assert boot["peer_failed"].startswith(doomed.endpoint)
    assert doomed.receiver.wait(10) == 1  # it did die half-way
    assert (await peer_bootstraps(m)) == {"ok": 0.0, "fallback": 1.0}


@pytest.mark.slow
@pytest.mark.parametrize("fleet", [("tcp", {})], indirect=True)
async def test_the_puller_checks_the_trainers_checksums_so_a_peer_serving_wrong_bytes_is_caught(fleet) -> None:
    m, sender, add_box = fleet
    liar = await add_box("--fault-corrupt-serve")
    ws = await publish(m, sender, 1)
    late = await add_box()
    assert await engine_checksums(late.url) == expected_checksums(ws)  # never loaded the peer's wrong byte
    boot = await push_to(m, late.endpoint, 1)
    assert boot["source"] == "sender:0" and "checksum mismatch" in boot["peer_failed"]
    assert liar.endpoint in boot["peer_failed"]


@pytest.mark.slow
@pytest.mark.parametrize("fleet", [("tcp", {"peer_bootstrap_timeout_s": "2", "weight_push_timeout_s": "60"})],
                         indirect=True)
async def test_a_peer_that_hangs_costs_the_peer_bound_not_the_push_timeout(fleet) -> None:
    """The peer's agent stops answering without closing (SIGSTOP): the joining box falls back to the
    trainer's sender after peer_bootstrap_timeout_s (2 s), not weight_push_timeout_s (60 s)."""
    m, sender, add_box = fleet
    hung = await add_box()
    ws = await publish(m, sender, 1)
    hung.receiver.signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        late = await add_box()
        took = time.monotonic() - t0
        boot = await push_to(m, late.endpoint, 1)
        assert boot["source"] == "sender:0" and boot["peer_failed"].startswith(hung.endpoint), boot
        assert "did not answer within peer_bootstrap_timeout_s=2s" in boot["peer_failed"]
        assert took < 20, took  # the box's start-up, 2 s for the peer, then the sender's push
        assert await engine_checksums(late.url) == expected_checksums(ws)
    finally:
        hung.receiver.signal(signal.SIGCONT)


@pytest.mark.slow
@pytest.mark.parametrize("fleet", [("tcp", {"peer_bootstrap": "false"})], indirect=True)
async def test_peer_bootstrap_off_bootstraps_from_the_sender(fleet) -> None:
    m, sender, add_box = fleet
    await add_box()
    ws = await publish(m, sender, 1)
    late = await add_box()
    assert await engine_checksums(late.url) == expected_checksums(ws)
    boot = await push_to(m, late.endpoint, 1)
    assert boot["source"] == "sender:0" and "peer_failed" not in boot


# ---------------------------------------------------------------- in process


def _inst(n: int, host: str, group: tuple[int, int], version: int = 3, state: State = State.ACTIVE) -> Instance:
    inst = Instance(id=f"inst-{n}", host=host, port=30000 + n, kind=Kind.REMOTE, order=n, weight_receiver_port=18000)
    inst.sender, inst.group, inst.weight_version, inst.state = group[0], group[1], version, state
    return inst


def test_the_nearest_peer_is_the_same_group_then_the_same_subnet_then_the_least_busy() -> None:
    puller = _inst(0, "10.0.1.5", (0, 1), version=0, state=State.SYNCING)
    far = _inst(1, "10.9.0.1", (1, 0))
    subnet = _inst(2, "10.0.1.9", (1, 0))
    group = _inst(3, "10.7.0.1", (0, 1))
    behind = _inst(4, "10.0.1.7", (0, 1), version=2)
    syncing = _inst(5, "10.0.1.8", (0, 1), state=State.SYNCING)
    cands = holders([puller, far, subnet, group, behind, syncing], puller, 3)
    assert cands == [far, subnet, group]  # only active instances at exactly that version
    assert choose_peer(puller, cands, {}) is group
    assert choose_peer(puller, [far, subnet], {}) is subnet
    other = _inst(6, "10.0.1.10", (1, 0))
    assert choose_peer(puller, [subnet, other], {subnet.id: 1}) is other  # spread pulls among equals
    assert choose_peer(puller, [], {}) is None


async def test_a_receiver_refuses_to_serve_a_version_its_buffer_does_not_hold_verified() -> None:
    agent = Receiver("127.0.0.1", "http://127.0.0.1:9")
    req = ServeRequest(version=1, fingerprint="f" * 64, num_engines=1, session_ids=["127.0.0.1:1"], buffer_addr=0,
                       transport="tcp")
    with pytest.raises(CommitRefused) as caught:
        await agent.serve_peer(req)
    assert caught.value.status == 409 and agent.held_layout() is None
