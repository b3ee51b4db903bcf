"""verl 0.9.1's own process layout on one CPU machine: several ranks per node, several nodes.

One Ray cluster for the module (Ray's ``cluster_utils.Cluster``): node A at 127.0.0.2 with 4 fake GPUs,
node B at 127.0.0.3 with 2. verl's ``RayWorkerGroup`` places the training ranks (verl's ``Worker``
class, see ``verl_topology_workers.py``) on them as it does on GPU nodes, with ``LOCAL_RANK=0`` in
every rank; each rank runs verl's own ``update_weights`` (``engine_workers.py``) into the plugin's adapter.
Boxes are CPU engines with weight receivers (``Box``, as in the other weight tests; in the two-node
test started by ``scripts/launch_sglang.sh --engine cpu`` against the published manager address);
bit-exact means the engine's per-tensor checksums equal those of the weights the ranks sharded.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import uuid
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from conftest import FAST, ManagerHandle
from support import PY, ROOT, Box, OnLoopback, Proc, async_wait_until, free_port, local_ray_cluster
from weight_fleet import engine_checksums, expected_checksums

from rollout_manager.cpu_engine.model import build_model

MISSING = [m for m in ("verl", "ray", "transfer_queue") if importlib.util.find_spec(m) is None]
pytestmark = [
    pytest.mark.skipif(bool(MISSING), reason=f"needs {', '.join(MISSING)} (scripts/install.sh installs them)"),
    pytest.mark.slow, pytest.mark.verl_topology,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

NODE_A, NODE_B = "127.0.0.2", "127.0.0.3"


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]),
           "MC_LOG_LEVEL": "ERROR", "GLOG_minloglevel": "2", "RAY_DEDUP_LOGS": "0"}
    with local_ray_cluster(env, {"num_cpus": 8, "num_gpus": 4, "node_ip_address": NODE_A,
                                 "resources": {"node_a": 100}},
                           [{"num_cpus": 8, "num_gpus": 2, "node_ip_address": NODE_B, "resources": {"node_b": 100}}],
                           "topology") as c:
        yield c


class Group:
    """verl's worker group of ``PushWorker`` ranks, ``counts[i]`` on the i-th placement group."""

    def __init__(self, counts: list[int], rollout: dict[str, Any], lora: dict[str, Any] | None = None):
        import ray
        from verl.single_controller.ray.base import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
        from verl_topology_workers import PushWorker

        prefix = f"wg{uuid.uuid4().hex[:6]}"
        self.pool = RayResourcePool(process_on_nodes=counts, use_gpu=True, max_colocate_count=1, name_prefix=prefix)
        cls = RayClassWithInitArgs(cls=ray.remote(PushWorker), rollout=rollout, lora=lora)
        self.wg = RayWorkerGroup(resource_pool=self.pool, ray_cls_with_init=cls, name_prefix=prefix)

    async def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        import ray

        out = await asyncio.to_thread(getattr(self.wg, method), *args, **kwargs)
        if isinstance(out, list) and out and isinstance(out[0], ray.ObjectRef):
            out = await asyncio.to_thread(ray.get, out, timeout=180)
        return list(out) if out is not None else []

    async def push(self, steps: int, seed: int | None = None) -> list[dict[str, Any]]:
        """verl's sync of weight version ``steps`` (after a step that left ``build_model(seed)``)."""
        if seed is not None:
            await self.call("load", seed)
        return await self.call("update_weights", global_steps=steps)

    def stop(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for w in self.wg.workers:
            ray.kill(w)
        for pg in self.pool.pgs or []:
            remove_placement_group(pg)


def rollout(port: int, **manager: Any) -> dict[str, Any]:
    return {"name": "sglang-disaggregated", "custom": {"rollout_manager": {
        "port": port, "weight_push_timeout_s": 60, **manager}}}


class ScriptBox(OnLoopback):
    """A box started the way operators start one: ``scripts/launch_sglang.sh --engine cpu``, which
    registers it with the manager at ``manager`` by itself."""

    def __init__(self, manager: str, tmp_path: Any):
        self.port, agent_port = free_port(), free_port()
        self.proc = Proc(["bash", str(ROOT / "scripts" / "launch_sglang.sh"), "--engine", "cpu", "--manager-addr",
                          manager, "--host", "127.0.0.1", "--port", str(self.port), "--transfer-agent-handshake-port",
                          str(agent_port), "--python", PY, "--ready-timeout-s", "90", "--stop-timeout-s", "5", "--",
                          "--seed", "0"], tmp_path / f"box-{self.port}.log",
                         env={"MC_LOG_LEVEL": "ERROR", "GLOG_minloglevel": "2"})

    def stop(self) -> None:
        self.proc.stop()


async def senders(m: ManagerHandle) -> list[list[str]]:
    return sorted(s["ips"] for s in (await m.status())["weight_senders"]["senders"])


async def until_serving(m: ManagerHandle, version: int) -> None:
    """``update_weights`` returns once every box has the version staged (the plugin's default
    ``weight_push_wait_until``); each box then pauses only to load it. Wait until all serve it."""
    async def serving() -> bool:
        return all(i["weight_versions"]["active"] == version for i in (await m.status())["instances"])
    await async_wait_until(serving, timeout_s=30, message=f"every box serving version {version}")


async def serve_exactly(m: ManagerHandle, boxes: list[Any], seed: int, version: int) -> None:
    await until_serving(m, version)
    want = expected_checksums(build_model(seed).state_dict())
    for box in boxes:
        assert await engine_checksums(box.url) == want, f"box {box.endpoint} does not hold build_model({seed})"


async def test_one_sender_per_node_with_four_ranks_on_it(cluster, start_manager, tmp_path):
    """Four ranks on node A, all with LOCAL_RANK=0: one of them (rank 0) runs the node's sender, the
    others drain their gathers; two versions reach the box bit-exact."""
    sport = free_port()
    m = await start_manager(weight_sender_base_port=str(sport), allowed_sender_ips="127.0.0.0/8")
    box = Box(tmp_path)
    group = Group([4], rollout(int(m.url.rsplit(":", 1)[1]), address="127.0.0.1"))
    try:
        await box.ready()
        await m.register(box)
        ranks = await group.call("init_model")
        assert [(r["rank"], r["local_rank"], r["node_ip"]) for r in ranks] == [(i, "0", NODE_A) for i in range(4)]

        fresh = await group.push(0)  # on_init_end of a fresh run: nothing to send, version 0 checked
        assert [r["pushed"] for r in fresh] == [False] * 4 and await senders(m) == []
        for steps, seed in ((1, 4), (2, 5)):
            out = await group.push(steps, seed)
            assert [(r["rank"], r["pushed"], r.get("staged")) for r in out] == \
                [(0, True, None), (1, False, False), (2, False, False), (3, False, False)]
            assert out[0]["senders"] == 1 and out[0]["instances_at_version"] == 1
            assert [r["resumed"] for r in out] == [[["weights"], ["kv_cache"]]] * 4  # verl's naive branch
            assert await senders(m) == [[NODE_A]]
            await serve_exactly(m, [box], seed, steps)
    finally:
        group.stop()
        box.stop()


async def test_two_trainer_nodes_and_a_task_runner_elsewhere_find_the_published_manager(cluster, tmp_path):
    """Ranks 0-1 on node A, 2-3 on node B; verl's TaskRunner (the replica launch, hence the manager) on
    node B, no manager address configured: every rank reaches the manager at node B's address, which the
    replica published; version 0 checked, two pushes, one sender per node, both boxes bit-exact."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from verl_topology_workers import TaskRunner

    port, sport = free_port(), free_port()
    overrides = [f"{k}={v}" for k, v in {**FAST, "weight_sender_base_port": sport,
                                         "allowed_sender_ips": "127.0.0.0/8"}.items()]
    # bound where the ranks reach it, the TaskRunner node's Ray address (not 0.0.0.0): all traffic on 127.0.0.0/8
    config = rollout(port, host="node_ip", overrides=overrides, log_path=str(tmp_path / "manager.log"))
    blocker = placement_group([{"GPU": 2, "node_a": 1}])  # node A keeps 2 GPUs free: the group spans both nodes
    await asyncio.to_thread(ray.get, blocker.ready(), timeout=60)
    runner = TaskRunner.options(resources={"node_b": 1}).remote()
    boxes: list[ScriptBox] = []
    group = Group([2, 2], config)
    session = aiohttp.ClientSession()
    try:
        launched = await asyncio.to_thread(ray.get, runner.launch.remote(config), timeout=120)
        assert launched["node_ip"] == NODE_B
        m = ManagerHandle(None, f"http://{NODE_B}:{port}", session)  # type: ignore[arg-type]
        with pytest.raises(aiohttp.ClientConnectorError):  # listening on node B's address only
            await session.get(f"http://127.0.0.1:{port}/health")
        boxes = [ScriptBox(f"{NODE_B}:{port}", tmp_path) for _ in range(2)]

        async def both_active() -> bool:
            return [i["state"] for i in (await m.status())["instances"]] == ["active", "active"]

        await async_wait_until(both_active, timeout_s=120, message="both boxes registered and active")
        ranks = await group.call("init_model")
        assert [r["node_ip"] for r in ranks] == [NODE_A, NODE_A, NODE_B, NODE_B]  # rank 0 away from the TaskRunner

        fresh = await group.push(0)
        assert {r["manager_url"] for r in fresh} == {m.url}  # published by the replica, not each node's own IP
        for steps, seed in ((1, 4), (2, 5)):
            out = await group.push(steps, seed)
            assert [(r["rank"], r["pushed"], r.get("staged")) for r in out] == \
                [(0, True, None), (1, False, False), (2, False, True), (3, False, False)]
            assert out[0]["senders"] == 2 and out[0]["instances_at_version"] == 2
            assert await senders(m) == [[NODE_A], [NODE_B]]
            st = await m.status()
            assert sorted(i["sender"] for i in st["instances"]) == [0, 1]  # each node's sender feeds one box
            await serve_exactly(m, boxes, seed, steps)
    finally:
        await session.close()
        group.stop()
        for box in boxes:
            box.stop()
        try:
            await asyncio.to_thread(ray.get, runner.stop.remote(), timeout=30)
        finally:
            ray.kill(runner)
            remove_placement_group(blocker)


async def test_unmerged_lora_keeps_one_base_per_node_and_merges_each_step_bit_exact(cluster, start_manager,
                                                                                       tmp_path):
    """verl's default LoRA (``lora.merge`` False) on two nodes x 2 ranks: the base sync reaches every rank,
    but only each node's sender rank (0 on A, 2 on B) keeps a copy to merge onto; ranks 1 and 3 keep none.
    Two steps of adapters are merged onto that base (never onto the previous merge) and each node's box
    serves ``W + alpha / r * B @ A`` bit-exact."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from verl_topology_workers import merged_reference

    sport = free_port()
    m = await start_manager(weight_sender_base_port=str(sport), allowed_sender_ips="127.0.0.0/8")
    boxes = [Box(tmp_path), Box(tmp_path)]
    blocker = placement_group([{"GPU": 2, "node_a": 1}])  # node A keeps 2 GPUs free: the group spans both nodes
    await asyncio.to_thread(ray.get, blocker.ready(), timeout=60)
    group = Group([2, 2], rollout(int(m.url.rsplit(":", 1)[1]), address="127.0.0.1"), lora={"rank": 4})
    try:
        for box in boxes:
            await box.ready()
        await m.register(*boxes)
        ranks = await group.call("init_model")
        assert [r["node_ip"] for r in ranks] == [NODE_A, NODE_A, NODE_B, NODE_B]
        base_bytes = sum(t.nbytes for t in build_model(4).state_dict().values())

        await group.call("load_lora", 4, 10)  # a fresh run: the adapter as initialised
        # on_init_end: verl syncs the base (load_format dummy: base_sync_done starts False), then the adapter
        fresh = await group.call("update_weights", global_steps=0)
        assert [r["base"]["lora_base_tensors"] for r in fresh] == [len(build_model(4).state_dict())] * 4
        assert [r["lora_base_bytes"] for r in fresh] == [base_bytes, 0, base_bytes, 0]
        assert [r["pushed"] for r in fresh] == [False] * 4 and await senders(m) == []
        for steps, adapter_seed in ((1, 11), (2, 12)):
            await group.call("load_lora", 4, adapter_seed)  # the step trained the adapter; the base is frozen
            out = await group.call("update_weights", global_steps=steps)
            assert not any("base" in r for r in out)  # verl syncs the base once
            assert [(r["rank"], r["pushed"], r.get("staged")) for r in out] == \
                [(0, True, None), (1, False, False), (2, False, True), (3, False, False)]
            assert [r["lora_base_bytes"] for r in out] == [base_bytes, 0, base_bytes, 0]
            assert out[0]["senders"] == 2 and out[0]["instances_at_version"] == 2
            assert sorted(i["sender"] for i in (await m.status())["instances"]) == [0, 1]  # one box per node
            want = expected_checksums(merged_reference(4, adapter_seed))
            assert want != expected_checksums(build_model(4).state_dict())
            await until_serving(m, steps)
            for box in boxes:
                assert await engine_checksums(box.url) == want, f"box {box.endpoint} after step {steps}"
    finally:
        group.stop()
        remove_placement_group(blocker)
        for box in boxes:
            box.stop()


async def test_unmerged_lora_without_a_base_sync_is_refused_when_the_workers_start(cluster):
    """verl's default LoRA (``lora.merge`` False) is pushed merged onto the base weights verl syncs once,
    which it does only with a ``dummy`` load format: any other is refused by the adapter verl builds in
    ``init_model``, naming the setting."""
    import ray

    config = {**rollout(free_port(), address="127.0.0.1"), "load_format": "safetensors"}
    group = Group([1], config, lora={"rank": 8, "merge": False})
    try:
        with pytest.raises(ray.exceptions.RayTaskError, match=r"actor_rollout_ref\.rollout\.load_format=dummy"):
            await group.call("init_model")
    finally:
        group.stop()


async def test_a_resumed_run_publishes_its_checkpoint_step_from_every_rank(cluster, start_manager, tmp_path):
    """``on_init_end`` of a run resumed from step 3 hands the checkpoint's weights over as version 3
    (through the ranks' gathers), the next step as version 4."""
    sport = free_port()
    m = await start_manager(weight_sender_base_port=str(sport), allowed_sender_ips="127.0.0.0/8")
    box = Box(tmp_path)
    group = Group([2], rollout(int(m.url.rsplit(":", 1)[1]), address="127.0.0.1"))
    try:
        await box.ready()
        await m.register(box)
        await group.call("init_model")
        for steps, seed in ((3, 6), (4, 7)):
            out = await group.push(steps, seed)
            assert [r["pushed"] for r in out] == [True, False] and out[0]["instances_at_version"] == 1
            await async_wait_until(lambda s=steps: _at(m, s), timeout_s=30, message=f"version {steps}")
            await serve_exactly(m, [box], seed, steps)
    finally:
        group.stop()
        box.stop()


async def _at(m: ManagerHandle, version: int) -> bool:
    return bool((await m.status())["weight_version"] == version)
