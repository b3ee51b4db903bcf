"""verl 0.9.1's worker layout pushing into real SGLang 0.5.23 boxes: the two halves of a run joined.

One Ray node (``cluster_utils.Cluster``, 127.0.0.2, 2 fake GPUs): verl's ``RayWorkerGroup`` places two
training ranks (verl's ``Worker``, ``HFPushWorker`` in ``verl_topology_workers.py``) on it, ``LOCAL_RANK=0``
in both; a ``TaskRunner`` actor runs the plugin's replica launch, which starts the manager (bound with
``host: node_ip``), publishes its URL and starts the proxy actor. Two real SGLang boxes (CPU, the tiny
Llama of ``real_sglang_model.py``) come up through ``scripts/launch_sglang.sh --engine sglang`` against
the published address. The trainer-side model is a float32 ``transformers`` ``LlamaForCausalLM`` of the
checkpoint's config, each rank holding an FSDP-like shard of every tensor and handing the all-gathered
tensors to the plugin's adapter as ``engine_workers.py`` does. Nothing is emulated: the bytes go from the
node's sender agent over Mooncake (TCP, loopback) into each box's receiver agent and into SGLang.

After version 0 (a fresh run's check) and each of two pushes: every box reports the version, its greedy
tokens equal a float32 ``transformers`` forward of the pushed weights, and rollouts through verl's own
``LLMServerClient.generate`` (the call verl's agent loops make; verl's ``GlobalRequestLoadBalancer`` over
the replica's server, the plugin's proxy actor) equal SGLang's own greedy output and carry the version.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from conftest import FAST
from real_sglang import RealBox, start_boxes
from support import ROOT, free_port

MISSING = [m for m in ("verl", "ray", "transfer_queue") if importlib.util.find_spec(m) is None]
pytestmark = [
    pytest.mark.skipif(bool(MISSING), reason=f"needs {', '.join(MISSING)} (scripts/install.sh installs them)"),
    pytest.mark.real_sglang, pytest.mark.verl_topology, pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

NODE = "127.0.0.2"
RANKS = 2
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [300, 200, 100, 50, 25]]
NEW_TOKENS = 16  # the rollout's response_length: the plugin's budget for each rollout
# what verl's agent loop sends for a greedy rollout (agent_loop.py, apply_greedy_sampling_params), logprobs on
VERL_GREEDY = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}


@dataclass
class Run:
    manager_url: str
    boxes: list[RealBox]
    group: Any
    client: Any  # verl's LLMServerClient
    model_dir: Path


def _ray_env() -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]),
            "MC_LOG_LEVEL": "ERROR", "GLOG_minloglevel": "2", "RAY_DEDUP_LOGS": "0"}


@pytest.fixture(scope="module")
def run(real_sglang_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    """The whole layout, once for the module: Ray node, manager through the replica launch, two boxes
    through the launcher (their start overlaps the ranks' start), verl's client over the proxy."""
    import ray
    from omegaconf import OmegaConf
    from ray.cluster_utils import Cluster
    from verl.single_controller.ray.base import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.workers.rollout.llm_server import LLMServerClient
    from verl.workers.rollout.router import get_router_handle
    from verl_topology_workers import HFPushWorker, TaskRunner

    log_dir = tmp_path_factory.mktemp("verl_real_sglang")
    env = _ray_env()
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the raylet, hence the workers, inherit it
    port, sport = free_port(), free_port()
    overrides = [f"{k}={v}" for k, v in {**FAST, "weight_sender_base_port": sport,
                                         "allowed_sender_ips": "127.0.0.0/8"}.items()]
    rollout = {"name": "sglang-disaggregated", "prompt_length": 8, "response_length": NEW_TOKENS,
               "custom": {"rollout_manager": {"port": port, "host": "node_ip", "overrides": overrides,
                                              "weight_push_timeout_s": 120,
                                              # the test reads each box right after a push: wait for serving
                                              "weight_push_wait_until": "serving",
                                              "log_path": str(log_dir / "manager.log")}}}
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 4, "num_gpus": RANKS, "node_ip_address": NODE, "include_dashboard": False})
    runner = group = pool = None
    boxes: list[RealBox] = []
    try:
        ray.init(address=cluster.address, namespace=f"verl-sglang-{uuid.uuid4().hex[:8]}", log_to_driver=False)
        runner = TaskRunner.remote()
        launched = ray.get(runner.launch.remote(rollout), timeout=120)
        manager_url = f"http://{NODE}:{port}"
        assert launched["node_ip"] == NODE and launched["server_address"] == f"{NODE}:{port}", launched

        async def layout() -> list[RealBox]:
            starting = asyncio.create_task(asyncio.to_thread(
                start_boxes, real_sglang_model, manager_url, log_dir, ["a", "b"]))
            try:
                ranks = await asyncio.to_thread(group.init_model)
                assert [(r["local_rank"], r["node_ip"]) for r in ranks] == [("0", NODE)] * RANKS
            finally:
                started = await starting
            return started

        prefix = f"wg{uuid.uuid4().hex[:6]}"
        pool = RayResourcePool(process_on_nodes=[RANKS], use_gpu=True, max_colocate_count=1, name_prefix=prefix)
        group = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=RayClassWithInitArgs(
            cls=ray.remote(HFPushWorker), rollout=rollout, lora=None), name_prefix=prefix)
        boxes = asyncio.run(layout())
        # what LLMServerManager does with the launched replicas: verl's load balancer over their servers
        proxy = ray.get_actor("rollout_manager_proxy")
        balancer = get_router_handle(servers={launched["server_address"]: proxy})
        client = LLMServerClient(OmegaConf.create({"actor_rollout_ref": {"rollout": rollout}}),
                                 load_balancer_handle=balancer)
        yield Run(manager_url, boxes, group, client, real_sglang_model)
    finally:
        stopping = [threading.Thread(target=box.stop) for box in boxes]  # each waits for its launcher
        for t in stopping:
            t.start()
        for t in stopping:
            t.join()
        if group is not None:
            for w in group.workers:
                ray.kill(w)
        if runner is not None:
            try:
                ray.get(runner.stop.remote(), timeout=30)
            finally:
                ray.kill(runner)
        ray.shutdown()
        cluster.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


async def push(run: Run, steps: int) -> list[dict[str, Any]]:
    """verl's naive sync of the weights ``steps`` training steps left (``on_init_end`` for 0)."""
    import ray

    await asyncio.to_thread(run.group.load_hf, str(run.model_dir), steps)
    refs = await asyncio.to_thread(run.group.update_weights, global_steps=steps)
    return list(await asyncio.to_thread(ray.get, refs, timeout=240))


async def post(s: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Any:
    async with s.post(url, json=body) as r:
        text = await r.text()
        assert r.status == 200, f"{url}: HTTP {r.status} {text}"
        return json.loads(text)


async def test_verl_ranks_push_two_versions_into_real_sglang_and_rollouts_follow(run: Run) -> None:
    from test_real_sglang_pushes import model_info_version, transformers_greedy
    from verl_topology_workers import trained_state

    greedy = {"input_ids": PROMPTS, "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0,
                                                        "ignore_eos": True}}
    # what verl's sampling dict means to SGLang: the plugin's budget is response_length, no ignore_eos
    as_verl = {"input_ids": PROMPTS, "return_logprob": True, "sampling_params": {
        "max_new_tokens": NEW_TOKENS, "temperature": 0.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0}}
    previous: list[list[int]] | None = None
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
        for steps in (0, 1, 2):
            out = await push(run, steps)
            if steps == 0:  # a fresh run: nothing sent, the manager checked at version 0
                assert [r["pushed"] for r in out] == [False] * RANKS, out
            else:
                assert [(r["rank"], r["pushed"], r.get("staged")) for r in out] == [(0, True, None), (1, False, False)]
                assert out[0]["senders"] == 1 and out[0]["new_weight_version"] == steps, out[0]
                assert out[0]["instances_at_version"] == 2 and not out[0]["timed_out"], out[0]
            assert {r["manager_url"] for r in out} == {run.manager_url}  # published by the replica launch

            want = await asyncio.to_thread(transformers_greedy, run.model_dir,
                                           trained_state(str(run.model_dir), steps), PROMPTS, NEW_TOKENS)
            assert want != previous, f"step {steps} changes what a greedy rollout says"
            own: list[Any] = []  # each box's answer to what verl asks for
            for box in run.boxes:
                answer = await post(s, box.url + "/generate", greedy)
                assert [o["output_ids"] for o in answer] == want, f"{box.endpoint} at version {steps}"
                assert {o["meta_info"]["weight_version"] for o in answer} == {str(steps)}
                assert await model_info_version(s, box) == str(steps)
                own.append(await post(s, box.url + "/generate", as_verl))
            assert [o["output_ids"] for o in own[0]] == [o["output_ids"] for o in own[1]]
            async with s.get(run.manager_url + "/get_instances_status") as r:
                st = await r.json()
            assert {(i["state"], i["weight_version"]) for i in st["instances"]} == {("active", steps)}, st

            rollouts = await asyncio.gather(*(
                run.client.generate(uuid.uuid4().hex, prompt_ids=p, sampling_params=dict(VERL_GREEDY))
                for p in PROMPTS * 2))  # GRPO-like: two samples per prompt, each its own call, sent together
            assert [r.token_ids for r in rollouts] == [o["output_ids"] for o in own[0]] * 2, \
                f"rollouts through verl's client at version {steps}"
            for r, o in zip(rollouts, own[0] * 2, strict=True):  # SGLang's own log-probs, handed to verl as they are
                assert r.log_probs == pytest.approx([e[0] for e in o["meta_info"]["output_token_logprobs"]], abs=1e-4)
            assert {(r.extra_fields["global_steps"], r.extra_fields["weight_version"]) for r in rollouts} == \
                {(steps, str(steps))}
            assert {r.extra_fields["segments"][-1]["endpoint"] for r in rollouts} <= {b.endpoint for b in run.boxes}
            previous = want
