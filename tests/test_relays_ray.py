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
import signal
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from conftest import FAST
from support import ROOT, async_wait_until, local_ray_cluster

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
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), "RAY_DEDUP_LOGS": "0"}
    with local_ray_cluster(env, {"num_cpus": 2, "num_gpus": 1, "node_ip_address": TRAINER_NODE},
                           [{"num_cpus": 4, "num_gpus": 0, "node_ip_address": CPU_NODE}], "relays") as c:
        yield c


@pytest.fixture(scope="module")
def model():
    return build_model(0)


# relay_checkpoint_tokens: sequences of a lost relay continue from their saved tokens (docs/relays.md)
SETTINGS = {**FAST, "relay_report_s": "0.1", "shutdown_grace_s": "2", "relay_checkpoint_tokens": "4",
            "engine_stream_interval": "4"}
FAST_CLIENT = {"stall_timeout_s": 0.5, "probe_timeout_s": 0.5}


@pytest.fixture(scope="module")
def started(cluster) -> Iterator[list[str]]:
    """The manager's actors as the plugin starts them (``ray_relays = 2``): the relays' URLs."""
    from trainer_plugin import relay_actors
    from trainer_plugin.settings import ManagerSettings, PluginSettings

    settings = PluginSettings(ManagerSettings(ray_relays=2, overrides=tuple(f"{k}={v}" for k, v in SETTINGS.items())))
    try:
        yield relay_actors.ensure(settings)
    finally:
        relay_actors.stop_all()


def prompts(n: int) -> list[list[int]]:
    return [[(7 * i + j) % 200 + 1 for j in range(1 + i % 5)] for i in range(n)]


def grpo_batch(groups: int, n: int, max_new: int = MAX_NEW) -> list[tuple[int, dict[str, Any]]]:
    """``groups`` prompts, ``n`` samples each (greedy: the same tokens), with verl's group key."""
    params = {**GREEDY, "max_new_tokens": max_new}
    return [(g * n + k, {"input_ids": p, "sampling_params": params, "group_key": f"uid-{g}"})
            for g, p in enumerate(prompts(groups)) for k in range(n)]


def expected(model, batch: list[tuple[int, dict[str, Any]]]) -> dict[int, list[int]]:
    return {rid: reference_generate(model, body["input_ids"], body["sampling_params"]["max_new_tokens"])[0]
            for rid, body in batch}


async def _json(session: aiohttp.ClientSession, method: str, url: str, body: Any = None) -> tuple[int, Any]:
    async with session.request(method, url, json=body) as r:
        return r.status, await r.json(content_type=None)


async def _status(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s:
        status, answer = await _json(s, "GET", url + "/get_instances_status")
        assert status == 200, answer
        return answer


async def _fleet(urls: list[str], engines: list[Any], register: bool = True) -> None:
    """Register ``engines`` through a relay (handed on to the control actor with the secret) and wait until
    they are the whole fleet, active, with both relays connected."""
    async with aiohttp.ClientSession() as s:
        for engine in engines if register else ():
            status, answer = await _json(s, "POST", urls[0] + "/register_rollout_instance",
                                         {"host": "127.0.0.1", "port": engine.port})
            assert status == 200, answer
    ports = sorted(e.port for e in engines)

    async def ready() -> bool:
        status = await _status(urls[-1])
        relays = status.get("relays") or []
        return sorted(int(i["endpoint"].rsplit(":", 1)[1]) for i in status["instances"]) == ports \
            and all(i["state"] == "active" for i in status["instances"]) \
            and len(relays) == 2 and all(r["connected"] for r in relays)

    await async_wait_until(ready, 60, message="the boxes active, both relays connected")


def _control() -> Any:
    import ray

    from rollout_manager.launch import ray_relays

    return ray.get_actor(ray_relays.control_name(ray_relays.DEFAULT_NAME))


async def _urls(n: int = 2) -> list[str]:
    from trainer_plugin import relay_actors

    found: list[str] = []

    async def all_found() -> bool:
        found[:] = await asyncio.to_thread(relay_actors.find)
        return len(found) == n

    await async_wait_until(all_found, 60, message=f"{n} relays found through Ray")
    return found


async def _spread_step(batch, kill=None) -> tuple[dict[int, list[int]], Any]:
    """One step through the plugin's spread (relays found through Ray); ``kill(got)`` after each line."""
    from trainer_plugin import relay_actors
    from trainer_plugin.relay_spread import RelaySpread

    spread = RelaySpread(relay_actors.find, FAST_CLIENT)
    got: dict[int, list[int]] = {}
    try:
        async for line in spread.batch_generate(batch):
            assert line["success"], line
            assert line["id"] not in got  # every id answered once
            got[line["id"]] = line["data"]["output_ids"]
            if kill is not None:
                await kill(got)
    finally:
        await spread.close()
    return got, spread.stats


def test_a_group_goes_to_one_relay_and_the_groups_spread():
    from trainer_plugin.relay_spread import split

    urls = ["http://a", "http://b", "http://c"]
    batch = grpo_batch(12, 4) + [(100 + i, {"input_ids": [5, 6], "sampling_params": GREEDY}) for i in range(3)]
    parts = split(batch, urls)
    where = {rid: url for url, part in parts.items() for rid, _ in part}
    assert sorted(where) == sorted(rid for rid, _ in batch)
    for g in range(12):  # GRPO siblings (one group_key) on one relay
        assert len({where[g * 4 + k] for k in range(4)}) == 1
    assert len({where[100 + i] for i in range(3)}) == 1  # no group key: one prompt's samples together
    assert len(parts) == 3 and split(batch, urls) == parts  # every relay gets work; stable


async def test_a_batch_no_relay_answers_for_fails_naming_its_ids_after_restart_timeout():
    from trainer_plugin.client_errors import ManagerLost
    from trainer_plugin.relay_spread import RelaySpread

    looked: list[int] = []
    spread = RelaySpread(lambda: looked.append(1) or [], {"restart_timeout_s": 1.0})
    with pytest.raises(ManagerLost) as lost:
        [line async for line in spread.batch_generate(grpo_batch(2, 2))]
    assert lost.value.unfinished == [0, 1, 2, 3] and "answered within 1s" in str(lost.value)
    assert len(looked) >= 2  # looked up again while it waited


async def test_a_step_through_two_relay_actors_found_through_ray(started, start_engines, model):
    from trainer_plugin import manager_address
    from trainer_plugin.settings import ManagerSettings, PluginSettings

    urls = await _urls()
    assert all(u.startswith(f"http://{CPU_NODE}:") for u in urls), urls  # off the trainer's (GPU) node
    # a training rank's weight pushes go to a relay found through Ray
    assert await asyncio.to_thread(manager_address.resolve, PluginSettings(ManagerSettings(ray_relays=2))) in urls
    await _fleet(urls, await start_engines(ENGINE_FLAGS, ENGINE_FLAGS))
    batch = grpo_batch(8, 4)
    got, stats = await _spread_step(batch)
    assert got == expected(model, batch) and stats.relays_lost == 0

    async def finished_by_each() -> bool:
        relays = (await _status(urls[0]))["relays"]
        return sum(r["finished"] for r in relays) >= 32
    await async_wait_until(finished_by_each, message="the relays' reports count what they finished")
    assert all(r["finished"] > 0 for r in (await _status(urls[0]))["relays"])  # spread over both

    # the control process listens on its node's address: only its relays (the secret) may say hello or follow
    import ray
    control = "http://" + await asyncio.to_thread(ray.get, _control().where.remote())
    async with aiohttp.ClientSession() as s:
        status, answer = await _json(s, "POST", control + "/relay/hello",
                                     {"relay": 0, "pid": 1, "weight_version": 0, "instances": []})
        assert status == 403 and "relay" in answer["error"], answer
        status, answer = await _json(s, "GET", control + "/relay/fleet?relay=0")
        assert status == 403, answer


async def test_a_relay_actor_sigkilled_mid_step_answers_every_id_once_through_the_other(
        started, start_engines, model):
    urls = await _urls()
    engines = await start_engines(ENGINE_FLAGS, ENGINE_FLAGS)
    await _fleet(urls, engines)
    # sequences long against the relays' report interval (0.96 s at 0.01 s a token, reports every 0.1 s): a relay
    # that reported running sequences with saved tokens still runs them when it is killed
    batch = grpo_batch(10, 4, max_new=96)
    killed: list[int] = []

    async def kill(got: dict[int, list[int]]) -> None:
        if len(got) < 4 or killed:
            return
        # a relay whose running sequences saved tokens, as it last reported
        busy = [r["pid"] for r in (await _status(urls[0]))["relays"] if r["saving"]]
        if busy:
            os.kill(busy[0], signal.SIGKILL)  # Ray starts it again, on another port
            killed.append(busy[0])

    got, stats = await _spread_step(batch, kill)
    assert got == expected(model, batch)
    assert killed and stats.relays_lost >= 1 and 0 < stats.resubmitted <= 36, stats
    again = await _urls()  # Ray started the relay again; the plugin finds it at its new address
    await _fleet(again, engines, register=False)
    # sent again marked so: the relay that took them on continued from what the lost relay had saved
    assert (await _status(again[0]))["relay_checkpoints"]["claimed"] > 0
    # rank zero's next weight push goes through a relay that answers now, not the lost one's old address
    from trainer_plugin import weight_push
    from trainer_plugin.client import ManagerClient
    from trainer_plugin.settings import ManagerSettings, PluginSettings

    [gone] = set(urls) - set(again)
    pusher = weight_push.WeightPusher(gone, [], 0)
    settings = PluginSettings(ManagerSettings(ray_relays=2))
    client = await weight_push._current_relay(pusher, ManagerClient(gone), settings)
    try:
        assert client.base_url in again and pusher.manager_url == client.base_url
        assert (await client.health())["status"] == "healthy"
    finally:
        await client.close()
    # the rollout proxy's calls that are not batches find a relay that answers too
    from trainer_plugin.proxy import ManagerProxyServer

    proxy = ManagerProxyServer(gone, prompt_length=8, response_length=MAX_NEW, batch_window_s=0, ray_relays=True)
    try:
        assert (await proxy.health())["status"] == "healthy" and proxy.batcher is not None
    finally:
        await proxy.close()


async def test_the_control_actor_sigkilled_mid_step_is_started_again_with_the_same_run(
        started, start_engines, model):
    import ray

    urls = await _urls()
    engines = await start_engines(ENGINE_FLAGS, ENGINE_FLAGS)
    await _fleet(urls, engines)
    before = (await _status(urls[0]))["instances"]
    async with aiohttp.ClientSession() as s:
        run_id = (await _json(s, "GET", urls[0] + "/health"))[1]["run_id"]
    pid = await asyncio.to_thread(ray.get, _control().pid.remote())
    batch = grpo_batch(10, 4)

    async def kill(got: dict[int, list[int]]) -> None:
        if len(got) == 4:
            os.kill(pid, signal.SIGKILL)  # the relays keep serving on the fleet they last saw

    got, stats = await _spread_step(batch, kill)
    assert got == expected(model, batch) and stats.relays_lost == 0
    assert await asyncio.to_thread(ray.get, _control().pid.remote()) != pid  # Ray started it again
    await _fleet(urls, engines, register=False)  # both relays found the new control process (through Ray) and follow it
    after = (await _status(urls[0]))["instances"]
    assert [(i["id"], i["endpoint"], i["state"]) for i in after] == \
        [(i["id"], i["endpoint"], "active") for i in before]
    async with aiohttp.ClientSession() as s:
        assert (await _json(s, "GET", urls[1] + "/health"))[1]["run_id"] == run_id
