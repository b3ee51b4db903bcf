"""The plugin's weight push: a torch module's weights through the sender agent to CPU engines, and one
full training loop (rollouts -> toy reward -> policy-gradient update -> push -> rollouts of the new version)."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from support import PY, Box, Proc, async_wait_until, free_port

from rollout_manager.cpu_engine.model import build_model, reference_generate
from trainer_plugin.client import ManagerClient
from trainer_plugin.streaming import RolloutStream
from trainer_plugin.weight_push import WeightPusher

IPS = ["127.0.0.1", "127.0.0.2"]


@pytest.fixture
async def pool(start_manager, tmp_path):
    """A manager, two boxes (CPU engine + receiver), and the plugin's pusher on two loopback 'NICs'."""
    port = free_port()
    m = await start_manager(weight_sender_base_port=str(port), allowed_sender_ips="127.0.0.0/8")
    boxes = [Box(tmp_path), Box(tmp_path)]
    client = ManagerClient(m.url)
    pusher = WeightPusher(m.url, IPS, port, groups_per_sender=2, engines_per_group=2, timeout_s=60)
    try:
        for box in boxes:
            await box.ready()
        await m.register(*boxes)
        await pusher.start(client)
        yield m, client, pusher
    finally:
        pusher.stop()
        await client.close()
        for box in boxes:
            box.stop()


async def greedy(m, prompt, n=10):
    status, out = await m.post("/generate", {"input_ids": prompt, "sampling_params": {"temperature": 0,
                                                                                     "max_new_tokens": n}})
    assert status == 200, out
    return out


@pytest.mark.slow
async def test_push_from_a_torch_module_changes_what_the_engines_generate(pool):
    m, client, pusher = pool
    policy = build_model(0)
    prompt = [9, 8, 7]
    before = await greedy(m, prompt)
    assert before["output_ids"] == reference_generate(policy, prompt, 10)[0]
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    answer = await pusher.push(client, policy.state_dict())
    assert answer == {"new_weight_version": 1, "timed_out": False, "waited_s": answer["waited_s"],
                      "instances_at_version": 2}
    after = await greedy(m, prompt)
    assert after["output_ids"] == reference_generate(policy, prompt, 10)[0] != before["output_ids"]
    assert after["meta_info"]["weight_version"] == "1"


@pytest.mark.slow
async def test_one_full_training_loop_on_cpu(pool):
    m, client, pusher = pool
    policy = build_model(0)
    policy.requires_grad_(True)
    optimizer = torch.optim.Adam(policy.parameters(), lr=0.03)
    prompts = [[1, 2], [3, 4, 5], [6], [7, 8]]
    vocab = policy.config.vocab_size
    for step in (1, 2):
        samples, sizes, groups_seen = [], [], []
        stream = RolloutStream(client, prompts, n=4, min_stream_batch_size=8, output="micro_batch",
                               sampling_params={"temperature": 1.0, "max_new_tokens": 12}, return_logprob=True)
        async for mb in stream:
            sizes.append(len(mb))
            groups_seen.append(sorted(set(mb.non_tensors["prompt_index"].tolist())))
            versions = set(mb.non_tensors["weight_version"].tolist())
            assert versions == {str(step - 1)}, versions  # every sample from the version pushed last step
            for i in range(len(mb)):
                mask = mb.tensors["response_mask"][i].bool()
                width = mb.tensors["prompts"].shape[1]
                prompt = mb.tensors["prompts"][i][mb.tensors["attention_mask"][i][:width].bool()]
                samples.append((prompt.tolist(), mb.tensors["responses"][i][mask].tolist(),
                                int(mb.non_tensors["prompt_index"][i])))
        assert len(samples) == 16 and all(size >= 8 for size in sizes[:-1])
        flat = [g for gs in groups_seen for g in gs]
        assert sorted(flat) == [0, 1, 2, 3]  # a prompt's 4 samples always arrive in one micro-batch
        rewards = [sum(t < vocab // 8 for t in r) / len(r) for _, r, _ in samples]
        optimizer.zero_grad()
        loss = torch.zeros(())
        for (prompt, response, group), reward in zip(samples, rewards):
            mates = [rw for (_, _, g), rw in zip(samples, rewards) if g == group]
            ids = torch.tensor(prompt + response)
            logp = torch.log_softmax(policy(ids[:-1])[len(prompt) - 1:], -1).gather(1, ids[len(prompt):, None])
            loss = loss - (reward - sum(mates) / len(mates)) * logp.sum() / len(samples)
        loss.backward()
        optimizer.step()
        answer = await pusher.push(client, {k: v.detach() for k, v in policy.state_dict().items()}, version=step)
        assert answer["new_weight_version"] == step and answer["instances_at_version"] == 2
    st = await m.status()
    assert {i["weight_version"] for i in st["instances"]} == {2}


@pytest.mark.slow
async def test_verl_adapter_pushes_through_the_default_hook(pool):
    pytest.importorskip("verl", reason="verl 0.9.1 is not installed")
    from verl.workers.config import RolloutConfig

    from trainer_plugin import weight_push
    from trainer_plugin.verl_rollout import ManagerServerAdapter

    m, client, pusher = pool
    pusher.stop()  # the hook brings its own sender on the same node ports
    port = int(m.url.rsplit(":", 1)[1])
    config = RolloutConfig(name="sglang-disaggregated", custom={"rollout_manager": {
        "host": "127.0.0.1", "port": port, "sender_ips": IPS, "weight_push_timeout_s": 60}})
    adapter = ManagerServerAdapter(config, None, None)
    policy = build_model(3)  # different weights from the engines' seed-0 model
    try:
        result = await adapter.update_weights(iter(policy.state_dict().items()), global_steps=1)
        assert result["pushed"] and result["new_weight_version"] == 1 and result["instances_at_version"] == 2, \
            (result, [(i["endpoint"], i["state"], i.get("last_error")) for i in (await m.status())["instances"]])

        async def serving() -> bool:  # the hook returns once both boxes have it staged; they then activate it
            # weight_versions' "active": what a box serves (its weight_version names the new one from the pause)
            return {i["weight_versions"]["active"] for i in (await m.status())["instances"]} == {1}

        await async_wait_until(serving, timeout_s=30, message="both boxes serving version 1")
        out = await greedy(m, [5, 5, 5])
        assert out["output_ids"] == reference_generate(policy, [5, 5, 5], 10)[0]
        assert (await adapter.update_weights(iter(()), global_steps=None)) == {"pushed": False}
    finally:
        if weight_push._PUSHER is not None:
            weight_push._PUSHER[0].stop()
            await weight_push._PUSHER[1].close()
            weight_push._PUSHER = None


@pytest.mark.slow
async def test_pusher_reports_its_senders_again_after_a_manager_restart(start_manager, tmp_path):
    mport, sport = free_port(), free_port()
    settings = dict(weight_sender_base_port=str(sport), allowed_sender_ips="127.0.0.0/8")
    m = await start_manager(port=mport, **settings)
    box = Box(tmp_path)
    client = ManagerClient(m.url)
    pusher = WeightPusher(m.url, IPS, sport, timeout_s=60)
    try:
        await box.ready()
        await m.register(box)
        await pusher.start(client)
        assert (await pusher.push(client, build_model(1).state_dict(), version=1))["instances_at_version"] == 1
        m.proc.signal(9)  # the manager dies; a new one starts empty on the same port
        m.proc.wait(10)
        m2 = await start_manager(port=mport, **settings)
        await m2.register(box)  # (launch_sglang.sh does this by itself)
        policy = build_model(2)
        answer = await pusher.push(client, policy.state_dict(), version=2)
        assert answer["instances_at_version"] == 1 and not answer["timed_out"]
        assert (await greedy(m2, [4, 4]))["output_ids"] == reference_generate(policy, [4, 4], 10)[0]
    finally:
        pusher.stop()
        await client.close()
        box.stop()


@pytest.mark.slow
async def test_every_trainer_node_runs_a_sender_and_rank_zero_publishes(start_manager, tmp_path):
    """Two 'nodes' (processes in one gloo group, on 127.0.0.1 and 127.0.0.2) push through the
    default hook: each stages into its own sender, the manager deals the boxes over both, and a
    version is published only once both have it."""
    sport = free_port()
    m = await start_manager(weight_sender_base_port=str(sport), allowed_sender_ips="127.0.0.0/8")
    boxes = [Box(tmp_path), Box(tmp_path)]
    ranks: list[Proc] = []
    try:
        for box in boxes:
            await box.ready()
        await m.register(*boxes)
        master = free_port()
        for rank, ip in enumerate(IPS):
            ranks.append(Proc([PY, "tests/node_push.py", "--rank", str(rank), "--world", "2", "--master-port",
                               str(master), "--manager", m.url, "--sender-ip", ip, "--seeds", "4", "5"],
                              tmp_path / f"rank{rank}.log"))
        for proc in ranks:
            assert await asyncio.to_thread(proc.wait, 90) == 0, proc.log()
        lines = [json.loads(x) for x in ranks[0].log().splitlines() if x.startswith("{")]
        assert [(r["version"], r["pushed"], r["senders"], r["instances_at_version"]) for r in lines] == \
            [(1, True, 2, 2), (2, True, 2, 2)]
        other = [json.loads(x) for x in ranks[1].log().splitlines() if x.startswith("{")]
        assert [(r["pushed"], r["staged"]) for r in other] == [(False, True), (False, True)]
        st = await m.status()
        assert sorted(i["sender"] for i in st["instances"]) == [0, 1]  # one box per node's sender
        assert {i["weight_version"] for i in st["instances"]} == {2}
        policy = build_model(5)
        for _ in boxes:  # both boxes (fed by different nodes) serve version 2's weights
            out = await greedy(m, [3, 1, 4])
            assert out["output_ids"] == reference_generate(policy, [3, 1, 4], 10)[0]
    finally:
        for proc in ranks:
            proc.stop()
        for box in boxes:
            box.stop()


def test_sender_ips_take_plain_addresses_or_pick_this_nodes_addresses_by_cidr():
    import ipaddress

    from trainer_plugin.weight_push import _local_addresses, resolve_sender_ips

    assert resolve_sender_ips(["127.0.0.2"], "http://127.0.0.1:5000") == ["127.0.0.2"]
    assert resolve_sender_ips(["127.0.0.0/8"], "http://127.0.0.1:5000") == ["127.0.0.1"]  # lo's address
    assert resolve_sender_ips([], "http://127.0.0.1:5000") == ["127.0.0.1"]  # the route to the manager
    local = [ipaddress.ip_address(a) for a in _local_addresses()]
    absent = next(n for n in ("198.51.100.0/24", "203.0.113.0/24", "192.0.2.0/24")
                  if not any(a in ipaddress.ip_network(n) for a in local))  # documentation nets on no NIC here
    with pytest.raises(ValueError, match="no address of this node"):
        resolve_sender_ips([absent], "http://127.0.0.1:5000")
