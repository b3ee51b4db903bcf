"""The trainer-side client across manager restarts and freezes (issue 18, "the manager restarting
mid-step loses accepted work").

Real manager and CPU engine processes on 127.0.0.1: the manager is SIGKILLed (or SIGTERMed, or
SIGSTOPped) in the middle of a step and restarted on the same port, the engines re-registered as
their boxes would. Every request id must come back exactly once, with the tokens a greedy reference
gives, and a freeze must be reported as a stall without resubmitting anything. A small in-process
fake covers the id bookkeeping (exactly the unfinished ids resent, duplicates dropped).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from typing import Any

import pytest
from aiohttp import web
from support import async_wait_until, free_port

from rollout_manager.cpu_engine.model import build_model, reference_generate
from trainer_plugin.client import ManagerClient, ManagerLost, ManagerUnavailable
from trainer_plugin.request_batcher import RequestBatcher
from trainer_plugin.settings import SettingsError, from_rollout_config
from trainer_plugin.streaming import RolloutStream

MAX_NEW = 6
GREEDY = {"temperature": 0.0, "max_new_tokens": MAX_NEW}
N_PROMPTS, N = 50, 4  # 200 requests, one step
# slow enough that a step takes a couple of seconds, so the fault lands mid-step
ENGINE_FLAGS = ["--token-delay-s", "0.01", "--max-running-requests", "4"]
# short bounds so the tests stay fast
FAST_CLIENT = {"stall_timeout_s": 0.3, "probe_timeout_s": 0.3, "restart_timeout_s": 30.0}


@pytest.fixture(scope="module")
def model():
    return build_model(0)


def step_prompts() -> list[list[int]]:
    return [[(11 * i + j) % 200 + 1 for j in range(1 + i % 4)] for i in range(N_PROMPTS)]


async def serving(start_manager, start_engines):
    m = await start_manager()
    engines = await start_engines(ENGINE_FLAGS, ENGINE_FLAGS)
    await m.register(*engines)
    return m, engines


async def restart_on_same_port(start_manager, m, engines, **settings: Any):
    """What a supervisor and the boxes do: a new manager on the same address, boxes registering again."""
    await asyncio.to_thread(m.proc.wait, 30)
    port = int(m.url.rsplit(":", 1)[1])
    m2 = await start_manager(port=port, **settings)
    await m2.register(*engines)
    return m2


async def run_step(client: ManagerClient, prompts, model, fault=None) -> tuple[RolloutStream, list[str]]:
    """One step through RolloutStream; ``fault(stream)`` is called after each micro-batch. Checks every
    token against the reference and returns the ids in the order they were yielded."""
    stream = RolloutStream(client, prompts, n=N, min_stream_batch_size=N, sampling_params=GREEDY,
                           output="micro_batch")
    ids: list[str] = []
    async for mb in stream:
        for row, rid in enumerate(mb.non_tensors["request_id"].tolist()):
            g = int(mb.non_tensors["prompt_index"][row])
            length = int(mb.non_tensors["response_len"][row])
            assert mb.tensors["responses"][row, :length].tolist() == \
                reference_generate(model, prompts[g], MAX_NEW)[0], rid
            ids.append(rid)
        if fault is not None:
            await fault(stream)
    return stream, ids


def every_id_once(stream: RolloutStream, ids: list[str]) -> None:
    expected = [stream.request_id(g, j) for g in range(N_PROMPTS) for j in range(N)]
    assert len(ids) == len(set(ids)), "an id was delivered twice"
    assert sorted(ids) == sorted(expected), "an id was lost"


# ------------------------------------------------------------------------------------------ restarts
@pytest.mark.slow
async def test_sigkilled_manager_restarted_mid_step_costs_only_the_requests_in_flight(
        start_manager, start_engines, model, caplog):
    m, engines = await serving(start_manager, start_engines)
    prompts = step_prompts()
    async with ManagerClient(m.url, **FAST_CLIENT) as client:
        baseline, ids = await run_step(client, prompts, model)
        every_id_once(baseline, ids)
        assert baseline.stats.interruptions == 0 and baseline.stats.resubmitted == 0

        killed_after: list[int] = []
        restart: list[asyncio.Task[Any]] = []

        async def kill_at_half(stream: RolloutStream) -> None:
            if not killed_after and stream.stats.samples_yielded >= N_PROMPTS * N // 2:
                m.proc.signal(signal.SIGKILL)
                killed_after.append(stream.stats.succeeded)
                restart.append(asyncio.create_task(restart_on_same_port(start_manager, m, engines)))

        caplog.set_level(logging.WARNING, logger="trainer_plugin.client")
        stream, ids = await run_step(client, prompts, model, kill_at_half)
        await restart[0]
    every_id_once(stream, ids)
    s = stream.stats
    assert killed_after and s.interruptions == 1 and s.duplicates_dropped == 0
    assert 0 < s.resubmitted <= N_PROMPTS * N - killed_after[0], s  # only what was unanswered, once
    assert "resubmitting" in caplog.text
    print(f"\nFIGURES sigkill: {N_PROMPTS * N} requests, killed after {killed_after[0]} results: lost 0, "
          f"duplicated 0, resubmitted {s.resubmitted}, outage {s.outage_s:.2f}s, step {s.elapsed_s:.2f}s "
          f"vs {baseline.stats.elapsed_s:.2f}s uninterrupted (+{s.elapsed_s - baseline.stats.elapsed_s:.2f}s)")


@pytest.mark.slow
async def test_manager_shut_down_gracefully_mid_step_resubmits_to_the_next_run(
        start_manager, start_engines, model):
    m = await start_manager(shutdown_grace_s=0)
    engines = await start_engines(ENGINE_FLAGS, ENGINE_FLAGS)
    await m.register(*engines)
    prompts = step_prompts()
    restart: list[asyncio.Task[Any]] = []

    async def stop_at_half(stream: RolloutStream) -> None:
        if not restart and stream.stats.samples_yielded >= N_PROMPTS * N // 2:
            m.proc.signal(signal.SIGTERM)  # the manager fails what runs with 503 "shutting down"
            restart.append(asyncio.create_task(restart_on_same_port(start_manager, m, engines)))

    async with ManagerClient(m.url, **FAST_CLIENT) as client:
        stream, ids = await run_step(client, prompts, model, stop_at_half)
        await restart[0]
    every_id_once(stream, ids)
    assert stream.failures == [] and stream.stats.interruptions >= 1 and stream.stats.resubmitted > 0


@pytest.mark.slow
async def test_frozen_manager_is_reported_as_a_stall_and_the_step_completes_without_resubmitting(
        start_manager, start_engines, model, caplog):
    m, _ = await serving(start_manager, start_engines)
    prompts = step_prompts()
    thaw: list[asyncio.Task[Any]] = []
    frozen: dict[str, float] = {}

    async with ManagerClient(m.url, **FAST_CLIENT) as client:
        async def stop_then_cont() -> None:
            frozen["at"] = time.monotonic()
            m.proc.signal(signal.SIGSTOP)
            try:  # frozen for longer than the stall bound: until the client has reported it
                await async_wait_until(lambda: client.stats.stalls >= 1, 20, message="a stall reported")
            finally:
                m.proc.signal(signal.SIGCONT)
                frozen["for"] = time.monotonic() - frozen["at"]

        async def freeze_at_half(stream: RolloutStream) -> None:
            if not thaw and stream.stats.samples_yielded >= N_PROMPTS * N // 2:
                thaw.append(asyncio.create_task(stop_then_cont()))

        caplog.set_level(logging.WARNING, logger="trainer_plugin.client")
        stream, ids = await run_step(client, prompts, model, freeze_at_half)
        await thaw[0]
    every_id_once(stream, ids)
    s = stream.stats
    assert s.stalls == 1 and s.interruptions == 0 and s.resubmitted == 0, s  # the same run kept the batch
    assert frozen["for"] > FAST_CLIENT["stall_timeout_s"]
    assert "stalled" in caplog.text and "/health does not answer" in caplog.text
    assert "answers again (same run)" in caplog.text or "resumed after a stall" in caplog.text
    print(f"\nFIGURES sigstop: frozen {frozen['for']:.2f}s, stalls reported {s.stalls}, lost 0, duplicated 0, "
          f"resubmitted 0, step {s.elapsed_s:.2f}s")


@pytest.mark.slow
async def test_manager_that_does_not_come_back_fails_the_step_naming_the_unfinished_ids(
        start_manager, start_engines, model):
    m, _ = await serving(start_manager, start_engines)
    prompts = step_prompts()
    seen: list[str] = []
    killed: dict[str, float] = {}

    async def kill_for_good(stream: RolloutStream) -> None:
        if not killed and stream.stats.samples_yielded >= N * 5:
            m.proc.signal(signal.SIGKILL)
            killed["at"] = time.monotonic()

    stream: RolloutStream | None = None
    async with ManagerClient(m.url, **{**FAST_CLIENT, "restart_timeout_s": 1.0}) as client:
        stream = RolloutStream(client, prompts, n=N, min_stream_batch_size=N, sampling_params=GREEDY,
                               output="micro_batch")
        with pytest.raises(ManagerLost) as err:
            async for mb in stream:
                seen += mb.non_tensors["request_id"].tolist()
                await kill_for_good(stream)
    waited = time.monotonic() - killed["at"]
    assert 1.0 <= waited < 10, waited  # bounded by restart_timeout_s
    lost = [str(i) for i in err.value.unfinished]
    assert lost and not set(lost) & set(seen)
    assert set(lost) | {r for r in seen} <= {stream.request_id(g, j) for g in range(N_PROMPTS) for j in range(N)}
    assert f"{len(lost)} of {N_PROMPTS * N} request(s) unfinished and lost" in str(err.value)
    assert "did not come back within 1s" in str(err.value) and lost[0] in str(err.value)


@pytest.mark.slow
async def test_request_batcher_survives_a_restart(start_manager, start_engines, model):
    """verl's route (the proxy's batcher): each caller's answer arrives once, with the right tokens."""
    m, engines = await serving(start_manager, start_engines)
    prompts = step_prompts()
    async with ManagerClient(m.url, **FAST_CLIENT) as client:
        batcher = RequestBatcher(client, window_s=0.01)
        answered: list[int] = []
        restart: list[asyncio.Task[Any]] = []

        async def one(i: int) -> None:
            out = await batcher.generate({"input_ids": prompts[i], "sampling_params": GREEDY})
            assert out["output_ids"] == reference_generate(model, prompts[i], MAX_NEW)[0]
            answered.append(i)
            if len(answered) == N_PROMPTS // 2:
                m.proc.signal(signal.SIGKILL)
                restart.append(asyncio.create_task(restart_on_same_port(start_manager, m, engines)))

        await asyncio.gather(*(one(i) for i in range(N_PROMPTS)))
        await restart[0]
        await batcher.close()
        assert sorted(answered) == list(range(N_PROMPTS))
        assert client.stats.interruptions >= 1 and client.stats.resubmitted > 0


# ------------------------------------------------------------------------- id bookkeeping (a fake)
class FakeManager:
    """Scripted ``/batch_generate_requests`` answers: each POST gets the next script."""

    def __init__(self, scripts: list[list[Any]]):
        self.scripts = scripts
        self.bodies: list[list[Any]] = []
        self.runner: web.AppRunner | None = None
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    async def _batch(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        script = self.scripts.pop(0)
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson",
                                           "X-Rollout-Manager-Run-Id": f"run-{len(self.bodies)}"})
        await resp.prepare(request)
        for step in script:
            if step == "break":  # the connection dies mid-answer, as with a killed manager
                assert request.transport is not None
                request.transport.close()
                return resp
            await resp.write(b'{"id": %s, "success": true, "data": {"output_ids": [1]}}\n' % step.encode())
        await resp.write_eof()
        return resp

    async def _generate(self, request: web.Request) -> web.Response:
        self.bodies.append(await request.json())
        if self.scripts.pop(0) == ["break"]:
            assert request.transport is not None
            request.transport.close()
        return web.json_response({"output_ids": [1], "meta_info": {"id": "r"}})

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "healthy", "run_id": f"run-{len(self.bodies)}"})

    async def __aenter__(self) -> FakeManager:
        app = web.Application()
        app.router.add_post("/batch_generate_requests", self._batch)
        app.router.add_post("/generate", self._generate)
        app.router.add_get("/health", self._health)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


async def test_exactly_the_unfinished_ids_are_resent_and_duplicates_are_dropped():
    items = [("a", {}), (1, {}), ("1", {}), ("c", {})]  # ids compare as JSON values: 1 and "1" differ
    scripts = [['"a"', '"a"', "1", "break"], ['"1"', '"a"', "1", '"c"']]
    async with FakeManager(scripts) as fake, ManagerClient(fake.url, **FAST_CLIENT) as client:
        got = [line["id"] async for line in client.batch_generate(items)]
    assert got == ["a", 1, "1", "c"]
    assert [rid for rid, _ in fake.bodies[1]] == ["1", "c"]  # only what was unanswered, in order
    assert client.stats.duplicates_dropped == 3 and client.stats.resubmitted == 2
    assert client.stats.interruptions == 1


async def test_without_restart_timeout_a_broken_stream_fails_at_once():
    async with FakeManager([['"a"', "break"]]) as fake, \
            ManagerClient(fake.url, **{**FAST_CLIENT, "restart_timeout_s": 0}) as client:
        got = []
        with pytest.raises(ManagerUnavailable, match="connection broke after 1 of 2 results"):
            async for line in client.batch_generate([("a", {}), ("b", {})]):
                got.append(line["id"])
    assert got == ["a"] and len(fake.bodies) == 1


async def test_single_generate_is_sent_again_after_a_broken_connection():
    """The proxy's unbatched route (``batch_window_ms=0``): one POST /generate, resent once."""
    async with FakeManager([["break"], ["answer"]]) as fake, ManagerClient(fake.url, **FAST_CLIENT) as client:
        out = await client.generate({"input_ids": [1], "rid": "r"})
    assert out["output_ids"] == [1] and len(fake.bodies) == 2 and fake.bodies[0] == fake.bodies[1]
    assert client.stats.interruptions == 1 and client.stats.resubmitted == 1


def test_restart_settings_are_read_and_checked():
    s = from_rollout_config({"custom": {"rollout_manager": {"restart_timeout_s": "5", "stall_timeout_s": 2}}})
    assert s.manager.client_options() == {"timeout_s": 30.0, "stall_timeout_s": 2.0, "restart_timeout_s": 5.0}
    with pytest.raises(SettingsError, match="restart_timeout_s must be >= 0"):
        from_rollout_config({"custom": {"rollout_manager": {"restart_timeout_s": -1}}})
