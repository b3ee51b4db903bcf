"""Affinity (trajectory key, prompt and prefix fallback) and bounded staleness, in process over fake engines."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from fakes import FakeSGLang, reference, register_active, start_fakes
from support import as_json

from rollout_manager.config import ConfigError, load_config
from rollout_manager.cpu_engine.model import build_model, reference_generate
from rollout_manager.errors import InvalidField
from rollout_manager.instances.registry import Instance, Registry, State
from rollout_manager.placement.affinity import AffinitySettings, AffinityTable, overloaded
from rollout_manager.placement.dispatch import Dispatcher
from rollout_manager.placement.instance_load import InstanceLoad
from rollout_manager.placement.least_in_flight import LeastInFlight
from rollout_manager.placement.local_budget import LocalBudget
from rollout_manager.placement.policy import PlacementPolicy
from rollout_manager.placement.round_robin import RoundRobin
from rollout_manager.placement.throughput_aware import ThroughputAware
from rollout_manager.rollout.batch import run_batch
from rollout_manager.rollout.generation import GenerationSettings, Generator
from rollout_manager.rollout.request import Request, decode
from rollout_manager.sglang.client import SGLangClient

PROMPT = [5, 17, 42]


# ---------------------------------------------------------------- the table (pure)
def test_table_finds_a_trajectory_a_prompt_and_a_context_the_input_extends() -> None:
    table = AffinityTable(AffinitySettings(block_tokens=4))
    prompt = list(range(10))
    keys = table.keys(prompt, "traj-1")
    assert table.lookup(keys) is None
    table.placed(keys, "a")
    assert table.lookup(table.keys([9, 9], "traj-1")) == "a"  # the key wins whatever the input
    assert table.lookup(table.keys(prompt, None)) == "a"  # a GRPO sibling: the same prompt, no key
    assert table.lookup(table.keys(prompt + [1], None)) is None  # not the same prompt, no context known
    table.finished(keys, [20, 21, 22], "b")  # 13 tokens in all: their 12-token prefix is remembered
    assert table.lookup(table.keys(prompt + [20, 21, 22, 30, 31], None)) == "b"  # the next turn, keyless
    assert table.lookup(table.keys([*prompt[:8], 7, 7, 7, 7], None)) is None  # the 12-token prefix differs
    # A match covering less than min_match of the input (a shared system prompt) says nothing.
    long_turn = prompt + [20, 21, 22] + list(range(100, 130))
    assert table.lookup(table.keys(long_turn, None)) is None


def test_a_finished_context_is_keyed_as_if_hashed_whole() -> None:
    """finished() hashes only what follows the input's blocks; the keys must be those of the whole."""
    for prompt, output in (([1, 2, 3], [4, 5]), (list(range(8)), [9]), (list(range(9)), [7] * 7), ([1], [])):
        table = AffinityTable(AffinitySettings(block_tokens=4))
        table.finished(table.keys(prompt, None), output, "x")
        whole = table.keys(prompt + output, None)
        remembered = {key[1] for key in table._map if key[0] == "b"}
        assert remembered == ({whole.blocks[-1][1]} if whole.blocks else set()), (prompt, output)


def test_table_is_bounded_and_forgets_a_dead_instance() -> None:
    table = AffinityTable(AffinitySettings(capacity=8))
    for i in range(20):
        table.placed(table.keys([i], f"t{i}"), "a" if i % 2 else "b")
    assert len(table) == 8  # least recently used dropped
    assert table.lookup(table.keys([19], "t19")) == "a" and table.lookup(table.keys([0], "t0")) is None
    dropped = table.forget_instance("a")
    assert dropped == 4 and len(table) == 4 and table.lookup(table.keys([19], "t19")) is None


def test_overloaded_follows_what_the_policy_measures() -> None:
    def load(iid: str, n: int, tokens: int, rate: float | None) -> InstanceLoad:
        return InstanceLoad(iid, "remote", n, tokens, rate)

    ta: PlacementPolicy = ThroughputAware(target_drain_s=10, min_concurrency=1)
    busy, idle = load("a", 4, 900, 100.0), load("b", 0, 0, 100.0)
    assert overloaded(busy, [busy, idle], 200, ta, 100.0)  # full under the policy's own rule
    rr: PlacementPolicy = RoundRobin()
    assert overloaded(busy, [busy, idle], 200, rr, 2.0)  # 11 s expected against 2 s
    assert not overloaded(busy, [busy, idle], 200, rr, 10.0)
    assert not overloaded(load("a", 1, 0, None), [load("a", 1, 0, None), load("b", 0, 0, None)], 8, rr, 2.0)
    assert overloaded(load("a", 2, 0, None), [load("a", 2, 0, None), load("b", 0, 0, None)], 8, rr, 2.0)


def test_the_key_is_taken_out_of_the_body_and_validated() -> None:
    body = {"input_ids": [[1], [2]], "trajectory_key": ["x", None]}
    request = decode(body)
    assert [s.trajectory_key for s in request.sequences] == ["x", None] and "trajectory_key" in body
    assert all("trajectory_key" not in s.body.to_json() and s.body.rest == {} for s in request.sequences)
    assert [s.trajectory_key for s in decode({"input_ids": [[1], [2]], "trajectory_key": "g"}).sequences] == ["g", "g"]
    assert decode({"input_ids": [1]}, "h").sequences[0].trajectory_key == "h"
    assert decode({"input_ids": [1], "trajectory_key": "b"}, "h").sequences[0].trajectory_key == "b"
    decode({"input_ids": [1], "trajectory_key": "t"})
    decode({"input_ids": [[1], [2]], "trajectory_key": ["a", "b"]})
    for bad in ({"input_ids": [1], "trajectory_key": 5}, {"input_ids": [1], "trajectory_key": ""},
                {"input_ids": [[1], [2]], "trajectory_key": ["a"]}, {"input_ids": [1], "trajectory_key": ["a"]}):
        with pytest.raises(InvalidField):
            decode(bad)


def test_config_keys() -> None:
    cfg = load_config(environ={}, overrides={"affinity": "false", "max_staleness": "1", "staleness_action": "restart"})
    assert not cfg.affinity and cfg.max_staleness == 1 and cfg.staleness_action == "restart"
    assert load_config(environ={}).max_staleness == -1  # no bound: the behaviour before the key existed
    for key, value in (("max_staleness", "-2"), ("staleness_action", "drop"), ("affinity_max_slowdown", "0.5")):
        with pytest.raises(ConfigError):
            load_config(environ={}, overrides={key: value})


# ---------------------------------------------------------------- in process
@dataclass
class Rig:
    registry: Registry
    dispatcher: Dispatcher
    generator: Generator
    fakes: list[FakeSGLang]
    insts: list[Instance]


def _failure(inst: Instance, reason: str) -> None:
    inst.health.consecutive_failures += 1


def _success(inst: Instance) -> None:
    inst.health.consecutive_failures = 0


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def make_rig(session: aiohttp.ClientSession, n: int, policy: PlacementPolicy, *, affinity: bool = True,
                   max_staleness: int | None = None, action: str = "finish_on_old",
                   slowdown: float = 100.0) -> Rig:
    fakes = await start_fakes(n)
    registry = Registry()
    dispatcher = Dispatcher(registry, policy)
    if affinity:
        dispatcher.enable_affinity(AffinitySettings(block_tokens=8, max_slowdown=slowdown))
    settings = GenerationSettings(max_attempts=4, wait_timeout_s=0.5, connect_timeout_s=2.0, stall_timeout_s=0.5,
                                  engine_stream_interval=1, max_staleness=max_staleness, staleness_action=action)
    generator = Generator(dispatcher, SGLangClient(session), settings, LocalBudget(0.0, 0.0, 1.0),
                          on_instance_failure=_failure, on_instance_success=_success)
    return Rig(registry, dispatcher, generator, fakes, register_active(registry, fakes))


async def close(rig: Rig) -> None:
    for fake in rig.fakes:
        await fake.close()


def body(prompt: list[int], n: int, **extra: Any) -> dict[str, Any]:
    return {"input_ids": list(prompt), "sampling_params": {"temperature": 0, "max_new_tokens": n}, **extra}


async def one(rig: Rig, b: dict[str, Any], key: str | None = None) -> dict[str, Any]:
    out = as_json(await rig.generator.generate(decode(b, key)))
    assert isinstance(out, dict)
    return out


def where(out: dict[str, Any]) -> list[str]:
    return [s["instance"] for s in out["meta_info"]["segments"]]


async def test_a_repeated_key_returns_to_its_instance_and_never_reaches_the_engine(session) -> None:
    rig = await make_rig(session, 3, RoundRobin())
    a, b, c = rig.insts
    try:
        assert where(await one(rig, body(PROMPT, 3, trajectory_key="x"))) == [a.id]
        assert where(await one(rig, body([9, 9], 3), key="y")) == [b.id]  # the header's key
        # Round robin alone would go on to c, a: the keys bring each trajectory's next turn home.
        assert where(await one(rig, body([1, 2, 3, 4], 3, trajectory_key="x"))) == [a.id]
        assert where(await one(rig, body([7], 3), key="y")) == [b.id]
        st = rig.generator.stats
        assert (st["affinity_hits"], st["affinity_misses"], st["affinity_fallbacks"]) == (2, 2, 0)
        sent = [r for f in rig.fakes for r in f.requests]
        assert len(sent) == 4 and not [r for r in sent if "trajectory_key" in r]
        assert a.load.in_flight == b.load.in_flight == c.load.in_flight == 0
    finally:
        await close(rig)


async def test_without_a_key_grpo_siblings_and_next_turns_follow_the_prefix(session) -> None:
    rig = await make_rig(session, 3, RoundRobin())
    a, _, _ = rig.insts
    prompt = list(range(1, 20))
    try:
        outs = await rig.generator.generate(decode({"input_ids": [prompt] * 4,  # one GRPO group of 4 samples
                                                    "sampling_params": {"temperature": 0, "max_new_tokens": 6}}))
        outs = as_json(outs)
        assert isinstance(outs, list) and [where(o) for o in outs] == [[a.id]] * 4
        # The next turn: the previous context (prompt + answer) and a tool's reply, sent without a key.
        turn2 = prompt + reference(prompt, 6) + [3, 3, 3]
        out = await one(rig, body(turn2, 4))
        assert where(out) == [a.id] and out["output_ids"] == reference(turn2, 4)
        assert rig.generator.stats["affinity_hits"] == 4 and rig.generator.stats["affinity_misses"] == 1
    finally:
        await close(rig)


async def test_affinity_off_is_the_plain_policy(session) -> None:
    rig = await make_rig(session, 2, RoundRobin(), affinity=False)
    a, b = rig.insts
    try:
        assert where(await one(rig, body(PROMPT, 2, trajectory_key="x"))) == [a.id]
        assert where(await one(rig, body(PROMPT, 2, trajectory_key="x"))) == [b.id]
        assert not [r for f in rig.fakes for r in f.requests if "trajectory_key" in r]
    finally:
        await close(rig)


@pytest.mark.parametrize("state", [State.DRAINING, State.SYNCING, State.DEAD])
async def test_affinity_falls_back_when_its_instance_leaves_service(session, state: State) -> None:
    rig = await make_rig(session, 2, LeastInFlight())
    a, b = rig.insts
    try:
        assert where(await one(rig, body(PROMPT, 3, trajectory_key="x"))) == [a.id]
        assert rig.registry.transition(a, state, "test")
        out = await one(rig, body(PROMPT + [1], 3, trajectory_key="x"))
        assert where(out) == [b.id] and out["output_ids"] == reference(PROMPT + [1], 3)
        st = rig.generator.stats
        if state == State.DEAD:  # its entries went with it: the key is new again
            assert st["affinity_misses"] == 2 and len(rig.dispatcher.affinity or []) == 2
        else:
            assert st["affinity_fallbacks"] == 1 and rig.generator.affinity_fallbacks[state.value] == 1
        # The key now lives on b.
        assert where(await one(rig, body(PROMPT + [2], 3, trajectory_key="x"))) == [b.id]
    finally:
        await close(rig)


async def test_affinity_falls_back_when_its_instance_is_failing_or_overloaded(session) -> None:
    rig = await make_rig(session, 2, LeastInFlight(), slowdown=2.0)
    a, b = rig.insts
    try:
        assert where(await one(rig, body(PROMPT, 3, trajectory_key="x"))) == [a.id]
        a.health.consecutive_failures = 1
        assert where(await one(rig, body(PROMPT, 3, trajectory_key="x"))) == [b.id]  # -> b
        b.load.in_flight = 3  # three sequences there already, none on a: 4 > 2 x 1
        a.health.consecutive_failures = 0
        assert where(await one(rig, body(PROMPT, 3, trajectory_key="x"))) == [a.id]
        b.load.in_flight = 0
        assert rig.generator.affinity_fallbacks["failing"] == 1
        assert rig.generator.affinity_fallbacks["overloaded"] == 1
    finally:
        await close(rig)


# ---------------------------------------------------------------- bounded staleness
def versions_of(rig: Rig, out: dict[str, Any]) -> list[int]:
    return [int(s["weight_version"]) for s in out["meta_info"]["segments"]]


def set_versions(rig: Rig, versions: list[int]) -> None:
    for inst, fake, v in zip(rig.insts, rig.fakes, versions):
        inst.weight_version = v
        fake.weight_version = str(v)


async def test_finish_on_old_continues_only_within_the_bound(session) -> None:
    rig = await make_rig(session, 3, LeastInFlight(), affinity=False, max_staleness=0)
    a, b, c = rig.insts
    set_versions(rig, [0, 1, 0])  # b already has the next version; c still serves the old one
    rig.fakes[0].die_after_tokens = 4
    try:
        out = await one(rig, body(PROMPT, 10))
        assert where(out) == [a.id, c.id] and versions_of(rig, out) == [0, 0]  # not b, which it would mix
        assert out["output_ids"] == reference(PROMPT, 10)
    finally:
        await close(rig)


@pytest.mark.parametrize("action", ["restart", "finish_on_old"])
async def test_a_continuation_past_the_bound_restarts_on_the_current_version(session, action: str) -> None:
    rig = await make_rig(session, 2, LeastInFlight(), affinity=False, max_staleness=0, action=action)
    a, b = rig.insts
    set_versions(rig, [0, 1])
    rig.fakes[0].die_after_tokens = 4
    try:
        out = await one(rig, body(PROMPT, 10))
        assert where(out) == [b.id] and versions_of(rig, out) == [1]
        assert out["output_ids"] == reference(PROMPT, 10)
        assert out["meta_info"]["completion_tokens"] == 10
        (dropped,) = out["meta_info"]["discarded_segments"]
        assert dropped["instance"] == a.id and dropped["end"] == 4
        assert rig.generator.stats["stale_restarts"] == 1
        assert b.load.in_flight == 0 and b.load.in_flight_tokens == 0
    finally:
        await close(rig)


async def test_restart_keeps_a_continuation_that_the_bound_allows(session) -> None:
    rig = await make_rig(session, 2, LeastInFlight(), affinity=False, max_staleness=1, action="restart")
    a, b = rig.insts
    set_versions(rig, [0, 1])
    rig.fakes[0].die_after_tokens = 4
    try:
        out = await one(rig, body(PROMPT, 10))
        assert where(out) == [a.id, b.id] and versions_of(rig, out) == [0, 1]
        assert "discarded_segments" not in out["meta_info"] and rig.generator.stats["stale_restarts"] == 0
    finally:
        await close(rig)


@pytest.mark.parametrize("action", ["restart", "finish_on_old"])
async def test_the_bound_holds_and_every_id_is_answered_once(session, action: str) -> None:
    rng = random.Random(7)
    rig = await make_rig(session, 4, LeastInFlight(), max_staleness=1, action=action)
    set_versions(rig, [0, 1, 2, 2])
    for fake in rig.fakes[:3]:
        fake.die_after_tokens = rng.randint(2, 6)
    try:
        items: list[tuple[Any, Request]] = [
            (i, decode(body([rng.randrange(256) for _ in range(rng.randint(1, 5))], 8, trajectory_key=f"t{i % 5}")))
            for i in range(40)]
        lines = [as_json(line) async for ready in run_batch(rig.generator, items) for line in ready]
        assert sorted(line["id"] for line in lines) == list(range(40))
        ok = [line for line in lines if line["success"]]
        assert len(ok) >= 30, [line for line in lines if not line["success"]]
        for line in ok:
            out = line["data"]
            vs = versions_of(rig, out)
            assert max(vs) - min(vs) <= 1, out["meta_info"]["segments"]
            prompt = dict(items)[line["id"]].input_ids
            assert out["output_ids"] == reference(prompt, 8)
        assert all(i.load.in_flight == 0 and i.load.in_flight_tokens == 0 for i in rig.insts)
    finally:
        await close(rig)


# ---------------------------------------------------------------- through a real manager and strict engines
@pytest.mark.slow
async def test_the_manager_strips_the_key_and_counts_affinity(start_manager, start_engines) -> None:
    model = build_model(0)
    m = await start_manager()
    engines = await start_engines([], [])
    await m.register(*engines)  # the CPU engine refuses unknown keys as SGLang does: a forwarded key is a 400
    greedy = {"temperature": 0.0, "max_new_tokens": 4}
    status, first = await m.post("/generate", {"input_ids": [3, 1, 4], "sampling_params": greedy,
                                               "trajectory_key": "t1"})
    assert status == 200, first
    status, second = await m.post("/generate", {"input_ids": [3, 1, 4, 1], "sampling_params": greedy},
                                  headers={**m.headers, "X-Trajectory-Key": "t1"})
    assert status == 200, second
    assert second["output_ids"] == reference_generate(model, [3, 1, 4, 1], 4)[0]
    assert second["meta_info"]["segments"][0]["instance"] == first["meta_info"]["segments"][0]["instance"]
    status, lines = await m.post("/batch_generate_requests", [["a", {"input_ids": [5], "sampling_params": greedy,
                                                                     "trajectory_key": "t1"}]])
    assert status == 200, lines
    status, bad = await m.post("/generate", {"input_ids": [1], "trajectory_key": 7})
    assert status == 400 and "trajectory_key" in str(bad), bad
    async with m.session.get(m.url + "/metrics", headers=m.headers) as r:
        text = await r.text()
    assert "rollout_manager_affinity_hits_total 2.0" in text, text
    assert 'rollout_manager_affinity_fallbacks_by_reason_total{reason="dead"} 0.0' in text
