"""Admission bounds (issue 18, "callers can exhaust the manager"): one valid batch must not flood the pool.

Each instance gets at most its own ``max_running_requests`` (from ``/server_info``) and the pool at most
``max_in_flight_total``; the rest waits in the manager, counted, and waiting for a full instance is not
the wait that fails a request as "no instance available". In process (dispatcher) and end to end
(a manager and CPU engines that run 4 requests at once).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace
from typing import Any

import aiohttp
import pytest
from conftest import FAST
from fakes import FakeClock, run_pending
from prometheus_client.parser import text_string_to_metric_families
from support import PY, Proc, async_wait_until, free_port, wait_http_ok

from rollout_manager.errors import Unavailable
from rollout_manager.instances.registry import Instance, Kind, Registry, State
from rollout_manager.placement.ask import Ask
from rollout_manager.placement.capacity import (
    DEFAULT_INSTANCE_MAX_IN_FLIGHT,
    MAX_IN_FLIGHT_TOTAL_CEILING,
    default_max_in_flight_total,
)
from rollout_manager.placement.dispatch import Dispatcher, accepted_at
from rollout_manager.placement.least_in_flight import LeastInFlight
from rollout_manager.sglang import wire


def pool(*max_running: int | None, per_instance: int = 0,
         total: int = 0) -> tuple[Registry, Dispatcher, list[Instance]]:
    registry = Registry()
    d = Dispatcher(registry, LeastInFlight(), max_in_flight_per_instance=per_instance, max_in_flight_total=total)
    insts = []
    for k, running in enumerate(max_running):
        inst = registry.add("127.0.0.1", 30000 + k, Kind.REMOTE)
        inst.engine = replace(inst.engine, max_running_requests=running)  # as the health monitor records it
        assert registry.transition(inst, State.ACTIVE, "test: healthy")
        insts.append(inst)
    return registry, d, insts


def count_expiries(d: Dispatcher) -> list[float]:
    """Record every deadline check of a waiter (the dispatcher's timer callback)."""
    seen: list[float] = []
    expire = d._expire

    def spy(*args: Any) -> None:
        seen.append(time.monotonic())
        expire(*args)

    d._expire = spy  # type: ignore[method-assign]
    return seen


# ------------------------------------------------------------------ what SGLang reports
def test_server_info_max_running_requests_prefers_the_schedulers_value() -> None:
    # SGLang 0.5.23: the launch flag at the top level (None unless given), the value the scheduler settled
    # on in internal_states (per DP rank; the manager refuses dp_size > 1).
    real = {"max_running_requests": None, "internal_states": [{"effective_max_running_requests_per_dp": 2048}]}
    assert wire.ServerInfo.from_json(real).max_running_requests == 2048
    assert wire.ServerInfo.from_json({"max_running_requests": 48, "internal_states": [{}]}).max_running_requests == 48
    for unknown in ({}, {"max_running_requests": None}, {"max_running_requests": 0}, {"max_running_requests": True},
                    {"internal_states": "x", "max_running_requests": "8"}):
        assert wire.ServerInfo.from_json(unknown).max_running_requests is None, unknown


# ------------------------------------------------------------------ the bounds
async def test_an_instance_gets_at_most_its_max_running_requests() -> None:
    _, d, (a, b) = pool(2, None)
    assert (a.load.max_in_flight, b.load.max_in_flight) == (2, DEFAULT_INSTANCE_MAX_IN_FLIGHT)
    placed = [d.try_acquire(Ask(1)) for _ in range(6)]
    assert placed.count(a) == 2 and placed.count(b) == 4  # least-in-flight would have given a three
    assert a.load.in_flight == 2 and d.capacity.in_flight == 6


async def test_a_configured_bound_caps_every_instance() -> None:
    _, d, (a, b) = pool(2, None, per_instance=3)
    assert (d.capacity.bound_of(a), d.capacity.bound_of(b)) == (2, 3)  # never more than the instance's own
    assert [d.try_acquire(Ask(1)) for _ in range(6)].count(None) == 1


async def test_the_whole_pool_is_bounded_too() -> None:
    _, d, (a, b) = pool(4, 4, total=5)
    assert d.capacity.pool_bound() == 5
    assert sum(d.try_acquire(Ask(1)) is not None for _ in range(8)) == 5
    assert not d.claim(a, 1) and not d.claim(b, 1)  # tail migration respects the bounds as well
    d.release(a, 0)
    assert d.capacity.in_flight == 4 and d.claim(a, 1) and d.capacity.in_flight == 5


def test_the_default_overall_bound_follows_the_open_file_limit() -> None:
    assert default_max_in_flight_total(1024) == 512 - 128  # callers' half, and a reserve
    assert default_max_in_flight_total(20000) == 10000 - 1024
    assert default_max_in_flight_total(1 << 20) == MAX_IN_FLIGHT_TOTAL_CEILING
    assert default_max_in_flight_total(-1) == MAX_IN_FLIGHT_TOTAL_CEILING


async def test_waiters_are_placed_in_order_as_the_bound_frees() -> None:
    _, d, (a,) = pool(1)
    assert d.try_acquire(Ask(1)) is a
    waiters = [asyncio.ensure_future(d.acquire(Ask(1), timeout_s=30)) for _ in range(3)]
    await run_pending()
    assert d.capacity.waiting == 3 and d.capacity.admission_status()["requests_waiting"] == 3
    for k in range(3):
        d.release(a, 0)
        await run_pending()
        assert [w.done() for w in waiters] == [j <= k for j in range(3)]
        assert a.load.in_flight == 1
    assert d.capacity.waiting == 0


# ------------------------------------------------------------------ what the wait timeout counts
async def test_waiting_for_a_full_instance_is_not_timed_out() -> None:
    _, d, (a,) = pool(1)
    seen = count_expiries(d)
    assert d.try_acquire(Ask(1)) is a
    waiter = asyncio.ensure_future(d.acquire(Ask(1), timeout_s=0.02))
    await async_wait_until(lambda: len(seen) >= 5, 10, message="five deadline checks")
    assert not waiter.done()  # five deadlines passed: it waits for the instance's capacity, not failed
    d.release(a, 0)
    assert await asyncio.wait_for(waiter, 2) is a


async def test_the_overall_bound_is_waited_for_too() -> None:
    _, d, (a, b) = pool(4, 4, total=1)
    seen = count_expiries(d)
    assert d.try_acquire(Ask(1)) is a
    waiter = asyncio.ensure_future(d.acquire(Ask(1), timeout_s=0.02))
    await async_wait_until(lambda: len(seen) >= 3, 10, message="three deadline checks")
    assert not waiter.done()
    d.release(a, 0)
    assert await asyncio.wait_for(waiter, 2) in (a, b)


async def test_once_the_pool_is_empty_the_wait_counts_from_then() -> None:
    registry, d, (a,) = pool(1)
    seen = count_expiries(d)
    assert d.try_acquire(Ask(1)) is a
    waiter = asyncio.ensure_future(d.acquire(Ask(1), timeout_s=0.3))
    await async_wait_until(lambda: len(seen) >= 1, 10, message="a deadline check")
    assert not waiter.done()
    emptied = time.monotonic()
    assert registry.transition(a, State.DEAD, "test: gone")
    with pytest.raises(Unavailable, match=r"within 0.3s \(0 active\)"):
        await asyncio.wait_for(waiter, 5)
    assert time.monotonic() - emptied >= 0.25  # a full timeout without any instance, not the rest of one


async def test_a_request_held_back_since_long_ago_fails_at_once_when_no_instance_came() -> None:
    """What a batch holds back starts late; its wait counts from when the batch arrived."""
    clock = FakeClock()
    d = Dispatcher(Registry(clock=clock), LeastInFlight(), clock=clock)  # no instance since it started
    clock.advance(10)
    accepted_at.set(clock() - 8)  # a batch accepted 8 s ago, whose request starts only now
    try:
        t0 = time.monotonic()
        with pytest.raises(Unavailable, match=r"within 5s \(0 active\)"):
            await d.acquire(Ask(1), timeout_s=5)
        assert time.monotonic() - t0 < 1
    finally:
        accepted_at.set(None)


# ------------------------------------------------------------------ end to end
BOUND = 4
BATCH = 400


async def _sample(m: Any, engines: list[Any], peaks: dict[str, Any], stop: asyncio.Event) -> None:
    """Watch the manager and the engines while the batch runs; keep the peaks."""
    async with aiohttp.ClientSession() as s:
        while not stop.is_set():
            st = await m.status()
            for inst in st["instances"]:
                peaks["in_flight"] = max(peaks["in_flight"], inst["in_flight"])
            peaks["waiting"] = max(peaks["waiting"], st["admission"]["requests_waiting"])
            peaks["dead"] += sum(e["to"] == "dead" for e in st["recent_events"])
            for e in engines:
                async with s.get(e.url + "/server_info") as r:
                    info = (await r.json())["cpu_engine"]
                peaks["engine_queued"] = max(peaks["engine_queued"], info["queued"])
            if not peaks["metric_waiting"]:
                async with s.get(m.url + "/metrics") as r:
                    text = await r.text()
                for family in text_string_to_metric_families(text):
                    if family.name == "rollout_manager_requests_waiting":
                        peaks["metric_waiting"] = max(sample.value for sample in family.samples)
            try:
                await asyncio.wait_for(stop.wait(), 0.02)
            except asyncio.TimeoutError:
                pass


@pytest.mark.slow
async def test_a_large_batch_waits_in_the_manager_within_each_instance_bound(start_manager, start_engines) -> None:
    """The finding, scaled down: a batch far beyond what the engines run at once. Each engine gets at most
    its max_running_requests (its own queue stays empty), the rest waits in the manager, visibly, for
    longer than the no-instance timeout without failing, and every id is answered once."""
    engines = await start_engines(*[["--max-running-requests", str(BOUND), "--token-delay-s", "0.005"]] * 2)
    m = await start_manager(no_instance_wait_timeout_s="0.3", tail_migration="false")
    await m.register(*engines)
    st = await m.status()
    assert {(i["max_running_requests"], i["max_in_flight"]) for i in st["instances"]} == {(BOUND, BOUND)}
    peaks: dict[str, Any] = {"in_flight": 0, "waiting": 0, "dead": 0, "engine_queued": 0, "metric_waiting": 0}
    stop = asyncio.Event()
    watcher = asyncio.ensure_future(_sample(m, engines, peaks, stop))
    body = [[f"r{k}", {"input_ids": [1 + k % 50, 2, 3], "sampling_params": {"max_new_tokens": 4}}]
            for k in range(BATCH)]
    seen: dict[str, int] = {}
    started = time.monotonic()
    try:
        async with m.session.post(m.url + "/batch_generate_requests", json=body) as r:
            assert r.status == 200
            async for raw in r.content:
                line = json.loads(raw)
                assert line["success"], line
                seen[line["id"]] = seen.get(line["id"], 0) + 1
    finally:
        stop.set()
        await watcher
    assert time.monotonic() - started > 0.3  # the batch outlasted the wait timeout, and nothing failed
    assert sorted(seen) == sorted(f"r{k}" for k in range(BATCH)) and set(seen.values()) == {1}
    assert peaks["in_flight"] <= BOUND, peaks
    assert peaks["engine_queued"] <= BOUND, peaks  # the manager's bound, not the engine's queue, held them
    assert peaks["waiting"] > 0 and peaks["metric_waiting"] > 0, peaks
    assert peaks["dead"] == 0 and (await m.status())["ready_instances"] == 2
    final = (await m.status())["admission"]
    assert (final["in_flight"], final["requests_waiting"], final["held_by_batches"]) == (0, 0, 0)


@pytest.mark.slow
async def test_the_default_overall_bound_keeps_the_manager_within_its_descriptors(tmp_path, start_engines) -> None:
    """Open-file limit 48 (an idle manager holds ~16): by default the pool gets at most 18 sequences at once,
    so a batch of 120 never makes the manager run out of descriptors (nothing to wait out, nobody blamed)."""
    port = free_port()
    proc = Proc(["prlimit", "--nofile=48:48", PY, "-m", "rollout_manager", "serve", "--bind", f"127.0.0.1:{port}",
                 *[a for key, value in FAST.items() for a in ("--set", f"{key}={value}")]], tmp_path / "manager.log")
    engines = await start_engines(["--token-delay-s", "0.01"], ["--token-delay-s", "0.01"])
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_http_ok(url + "/health", proc)
        async with aiohttp.ClientSession() as s:
            for e in engines:
                async with s.post(url + "/register_rollout_instance", json={"host": "127.0.0.1", "port": e.port}) as r:
                    assert r.status == 200, await r.text()
            await async_wait_until(lambda: _ready(s, url, 2), message="both instances active")
            body = [[k, {"input_ids": [1 + k % 50, 2, 3], "sampling_params": {"max_new_tokens": 12}}]
                    for k in range(120)]
            async with s.post(url + "/batch_generate_requests", json=body) as r:
                lines = [json.loads(raw) async for raw in r.content if raw.strip()]
            async with s.get(url + "/get_instances_status") as r:
                st = await r.json()
        assert len(lines) == 120 and all(line["success"] for line in lines)
        assert st["admission"]["max_in_flight_total"] == 18
        assert st["manager"]["local_limit_events"] == 0 and st["ready_instances"] == 2
    finally:
        proc.stop()


async def _ready(s: aiohttp.ClientSession, url: str, n: int) -> bool:
    async with s.get(url + "/get_instances_status") as r:
        return bool((await r.json())["ready_instances"] == n)
