"""Relay processes under Ray (docs/relays.md, "Under Ray"): the control process and two relays as Ray actors
on a local two-node Ray cluster (a "trainer" node with a GPU, and a CPU-only node where the actors go), CPU
engines on 127.0.0.1, and the trainer plugin finding the relays through Ray and spreading batches over them.

A step through both relays gives the greedy reference's tokens; a relay actor SIGKILLed mid-step loses nothing
(its ids are answered once, through the other relay); the control actor SIGKILLed is started again by Ray with
the same run id, the relays find it again at its new address, and the fleet is the same.
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
from conftest import FAST
from support import ROOT, async_wait_until

from rollout_manager.config import Config
from rollout_manager.cpu_engine.model import build_model, reference_generate

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs ray (scripts/install.sh installs it)"),
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

TRAINER_NODE, CPU_NODE = "127.0.0.2", "127.0.0.3"
MAX_NEW = 24
GREEDY = {"temperature": 0.0, "max_new_tokens": MAX_NEW}
ENGINE_FLAGS = ["--token-delay-s", "0.01", "--max-running-requests", "4"]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    import ray
    from ray.cluster_utils import Cluster

    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), "RAY_DEDUP_LOGS": "0"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the nodes' raylets, hence the actors, inherit it
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "num_gpus": 1, "node_ip_address": TRAINER_NODE, "include_dashboard": False})
    try:
        c.add_node(num_cpus=4, num_gpus=0, node_ip_address=CPU_NODE)
        c.wait_for_nodes()
        ray.init(address=c.address, namespace=f"relays-{uuid.uuid4().hex[:8]}", log_to_driver=False)
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def model():
    return build_model(0)


@pytest.fixture
def ray_relays(cluster):
    from rollout_manager.launch import ray_relays

    config = Config(**{**FAST, "relay_report_s": "0.1", "shutdown_grace_s": "2"})
    started = ray_relays.start(config, 2, name=f"rm{uuid.uuid4().hex[:6]}", relay_cpus=1)
    try:
        yield started
    finally:
        started.stop(timeout_s=10)


def prompts(n: int) -> list[list[int]]:
    return [[(7 * i + j) % 200 + 1 for j in range(1 + i % 5)] for i in range(n)]


async def _json(session: aiohttp.ClientSession, method: str, url: str, body: Any = None) -> tuple[int, Any]:
    async with session.request(method, url, json=body) as r:
        return r.status, await r.json(content_type=None)


async def _setup(relays, start_engines) -> tuple[list[str], Any]:
    urls = await asyncio.to_thread(relays.urls)
    assert len(urls) == 2 and all(u.startswith(f"http://{CPU_NODE}:") for u in urls), urls  # off the GPU node
    engines = await start_engines(ENGINE_FLAGS, ENGINE_FLAGS)
    async with aiohttp.ClientSession() as s:
        for engine in engines:  # through a relay, handed on to the control actor with the secret
            status, answer = await _json(s, "POST", urls[0] + "/register_rollout_instance",
                                         {"host": "127.0.0.1", "port": engine.port})
            assert status == 200, answer

        async def ready() -> bool:
            _, status = await _json(s, "GET", urls[1] + "/get_instances_status")
            relays_seen = status.get("relays") or []
            return [i["state"] for i in status["instances"]] == ["active", "active"] and len(relays_seen) == 2 \
                and all(r["connected"] for r in relays_seen)

        await async_wait_until(ready, 60, message="both boxes active, both relays connected")
    return urls, engines


async def test_a_step_through_two_relay_actors_gives_the_reference_tokens(ray_relays, start_engines, model):
    urls, _ = await _setup(ray_relays, start_engines)
    batch = prompts(16)
    async with aiohttp.ClientSession() as s:
        outs = await asyncio.gather(*(
            _json(s, "POST", urls[i % 2] + "/generate", {"input_ids": p, "sampling_params": GREEDY})
            for i, p in enumerate(batch)))
    assert [o[1]["output_ids"] for o in outs] == [reference_generate(model, p, MAX_NEW)[0] for p in batch]
