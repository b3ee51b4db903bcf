"""Weight loads as real SGLang takes them (issue 13): sessions from 0.5.21 on, one payload per TP rank,
no data parallelism; the CPU engine refuses what SGLang refuses, the receiver, the launcher's helper
and the manager act on it. Engines run in process (aiohttp test servers), so each test takes seconds."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
import torch
from aiohttp import web
from aiohttp.test_utils import TestServer
from fakes import FakeClock, FakeProbe
from support import async_wait_until, free_port

from rollout_manager.cpu_engine.engine import EngineConfig
from rollout_manager.cpu_engine.model import build_model
from rollout_manager.cpu_engine.server import create_app
from rollout_manager.instances.health import HealthMonitor, HealthSettings
from rollout_manager.instances.registry import Kind, Registry, State
from rollout_manager.instances.version import WeightVersion
from rollout_manager.launch import box
from rollout_manager.launch.box_common import PREFIX
from rollout_manager.sglang import tensor_payload, wire
from rollout_manager.weights.layout import HostBuffer, build_layout, stage, unpack
from rollout_manager.weights.mooncake_engine import MooncakeEngine, TransferError
from rollout_manager.weights.receiver import Receiver
from rollout_manager.weights.refused import CommitRefused

WEIGHT_PATHS = (wire.BEGIN_WEIGHT_UPDATE, wire.END_WEIGHT_UPDATE, wire.UPDATE_WEIGHTS_FROM_TENSOR)


class Engine:
    """A CPU engine in this process, recording the weight calls it answered (path, status)."""

    def __init__(self, server: TestServer, calls: list[tuple[str, int]]):
        self.server = server
        self.calls = calls
        self.url = str(server.make_url("")).rstrip("/")

    async def post(self, path: str, body: Any) -> tuple[int, Any]:
        async with aiohttp.ClientSession() as s, s.post(self.url + path, json=body) as r:
            return r.status, await r.json(content_type=None)

    async def get(self, path: str) -> Any:
        async with aiohttp.ClientSession() as s, s.get(self.url + path) as r:
            assert r.status == 200
            return await r.json(content_type=None)


StartEngine = Callable[..., Awaitable[Engine]]


@pytest.fixture
async def start_engine() -> AsyncIterator[StartEngine]:
    servers: list[TestServer] = []

    async def start(port: int | None = None, **config: Any) -> Engine:
        calls: list[tuple[str, int]] = []

        @web.middleware
        async def record(request: web.Request, handler: Any) -> web.StreamResponse:
            resp: web.StreamResponse = await handler(request)
            if request.path in WEIGHT_PATHS:
                calls.append((request.path, resp.status))
            return resp

        app = create_app(EngineConfig(**config))
        app.middlewares.append(record)
        server = TestServer(app, host="127.0.0.1", port=port or free_port())
        await server.start_server()
        servers.append(server)
        return Engine(server, calls)

    yield start
    for server in servers:
        await server.close()


def named_weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    return list(build_model(seed).state_dict().items())


def body(named: list[tuple[str, torch.Tensor]], ranks: int = 1, **kw: Any) -> dict[str, Any]:
    payload = tensor_payload.serialize_named_tensors(named)
    return wire.update_weights_from_tensor_body([payload] * ranks, flush_cache=kw.get("flush", True),
                                                weight_version=kw.get("version"))


# ---------------------------------------------------------------- the engine refuses what SGLang refuses


async def test_engine_loads_only_inside_one_session_at_a_time(start_engine: StartEngine) -> None:
    e = await start_engine()
    info = await e.get(wire.SERVER_INFO)
    assert (info["version"], info["tp_size"], info["dp_size"]) == ("0.5.23", 1, 1)
    new = named_weights(1)
    assert await e.post(wire.UPDATE_WEIGHTS_FROM_TENSOR, body(new)) == (
        400, {"success": False, "message": wire.SESSION_REQUIRED_MESSAGE})
    assert (await e.post(wire.BEGIN_WEIGHT_UPDATE, {}))[0] == 200
    assert await e.post(wire.BEGIN_WEIGHT_UPDATE, {}) == (
        400, {"success": False, "message": wire.SESSION_ALREADY_OPEN_MESSAGE})
    status, out = await e.post(wire.UPDATE_WEIGHTS_FROM_TENSOR, body(new, version="3"))
    assert status == 200 and out["success"] is True, out
    assert (await e.post(wire.END_WEIGHT_UPDATE, {}))[0] == 200
    assert await e.post(wire.END_WEIGHT_UPDATE, {}) == (
        400, {"success": False, "message": wire.NO_SESSION_OPEN_MESSAGE})
    assert (await e.post(wire.UPDATE_WEIGHTS_FROM_TENSOR, body(new)))[0] == 400  # closed again
    assert (await e.get("/debug/state_dict_checksum"))["weight_version"] == "3"


async def test_an_engine_emulating_0_5_12_has_no_sessions(start_engine: StartEngine) -> None:
    e = await start_engine(sglang_version="0.5.12")
    assert (await e.get(wire.SERVER_INFO))["version"] == "0.5.12"
    assert await e.post(wire.BEGIN_WEIGHT_UPDATE, {}) == (404, {"detail": "Not Found"})
    status, out = await e.post(wire.UPDATE_WEIGHTS_FROM_TENSOR, body(named_weights(1)))
    assert status == 200 and out["success"] is True, out


async def test_a_tp_2_engine_wants_one_payload_per_rank(start_engine: StartEngine) -> None:
    e = await start_engine(tp_size=2)
    assert (await e.get(wire.SERVER_INFO))["tp_size"] == 2
    new = named_weights(1)
    assert (await e.post(wire.BEGIN_WEIGHT_UPDATE, {}))[0] == 200
    status, out = await e.post(wire.UPDATE_WEIGHTS_FROM_TENSOR, body(new, ranks=1))
    assert status == 400 and "tp_size=2" in out["message"] and "one per rank" in out["message"]
    other = [(n, t + 1) for n, t in new]  # rank 1 handed other values than rank 0
    mixed = wire.update_weights_from_tensor_body(
        [tensor_payload.serialize_named_tensors(new), tensor_payload.serialize_named_tensors(other)], flush_cache=True,
        weight_version=None)
    status, out = await e.post(wire.UPDATE_WEIGHTS_FROM_TENSOR, mixed)
    assert status == 400 and "TP rank 1's payload differs" in out["message"]
    status, out = await e.post(wire.UPDATE_WEIGHTS_FROM_TENSOR, body(new, ranks=2))
    assert status == 200 and out["success"] is True, out
    assert (await e.post(wire.END_WEIGHT_UPDATE, {}))[0] == 200


async def test_a_data_parallel_engine_refuses_weight_loads(start_engine: StartEngine) -> None:
    e = await start_engine(dp_size=2)
    assert (await e.get(wire.SERVER_INFO))["dp_size"] == 2
    assert (await e.post(wire.BEGIN_WEIGHT_UPDATE, {}))[0] == 200
    status, out = await e.post(wire.UPDATE_WEIGHTS_FROM_TENSOR, body(named_weights(1)))
    assert status == 500 and out["message"] == wire.DP_UNSUPPORTED_MESSAGE


# ---------------------------------------------------------------- the receiver agent


async def receiver_for(e: Engine, state: dict[str, torch.Tensor], bucket_bytes: int) -> Receiver:
    """A receiver with ``state`` already landed in its buffer (the transfer itself is tested elsewhere)."""
    agent = Receiver("127.0.0.1", e.url, bucket_bytes=bucket_bytes)
    agent.loader.session = aiohttp.ClientSession()
    agent.layout = build_layout(state)
    agent.buffer = HostBuffer.for_layout(agent.layout)
    stage(state, agent.layout, agent.buffer.array)
    return agent


async def load_buffer(agent: Receiver, version: int) -> int:
    """Every tensor of the agent's buffer into SGLang, as ``/commit`` loads them after verifying."""
    assert agent.buffer is not None and agent.layout is not None
    return await agent.loader.load(unpack(agent.buffer, agent.layout), version)


async def load(e: Engine, state: dict[str, torch.Tensor], version: int, bucket_bytes: int = 4096) -> int:
    agent = await receiver_for(e, state, bucket_bytes)
    try:
        return await load_buffer(agent, version)
    finally:
        assert agent.loader.session is not None
        await agent.loader.session.close()


async def test_the_receiver_loads_inside_a_session_on_0_5_23(start_engine: StartEngine) -> None:
    e = await start_engine()
    state = dict(named_weights(1))
    buckets = await load(e, state, 5)
    assert buckets > 1
    assert e.calls == [(wire.BEGIN_WEIGHT_UPDATE, 200)] + [(wire.UPDATE_WEIGHTS_FROM_TENSOR, 200)] * buckets + [
        (wire.END_WEIGHT_UPDATE, 200)]
    assert (await e.get("/debug/state_dict_checksum"))["weight_version"] == "5"


async def test_the_receiver_closes_the_session_when_a_bucket_fails(start_engine: StartEngine) -> None:
    e = await start_engine()
    state = dict(named_weights(1))
    state["model.layers.99.unknown.weight"] = torch.zeros(4)  # the engine refuses the bucket holding it
    with pytest.raises(CommitRefused, match="unknown parameter"):
        await load(e, state, 6)
    assert e.calls[0] == (wire.BEGIN_WEIGHT_UPDATE, 200)
    assert (wire.UPDATE_WEIGHTS_FROM_TENSOR, 400) in e.calls
    assert e.calls[-1] == (wire.END_WEIGHT_UPDATE, 200)
    # Nothing left open: the next load opens its own session.
    e.calls.clear()
    del state["model.layers.99.unknown.weight"]
    await load(e, state, 7)
    assert e.calls[0] == (wire.BEGIN_WEIGHT_UPDATE, 200) and e.calls[-1] == (wire.END_WEIGHT_UPDATE, 200)


async def test_the_receiver_closes_a_session_left_open_by_a_load_that_died(start_engine: StartEngine) -> None:
    e = await start_engine()
    assert (await e.post(wire.BEGIN_WEIGHT_UPDATE, {}))[0] == 200
    e.calls.clear()
    await load(e, dict(named_weights(1)), 8)
    assert e.calls[:3] == [(wire.BEGIN_WEIGHT_UPDATE, 400), (wire.END_WEIGHT_UPDATE, 200),
                           (wire.BEGIN_WEIGHT_UPDATE, 200)]
    assert e.calls[-1] == (wire.END_WEIGHT_UPDATE, 200)


async def test_the_receiver_uses_no_session_on_0_5_12(start_engine: StartEngine) -> None:
    e = await start_engine(sglang_version="0.5.12")
    buckets = await load(e, dict(named_weights(1)), 9)
    assert e.calls == [(wire.UPDATE_WEIGHTS_FROM_TENSOR, 200)] * buckets


async def test_the_receiver_sends_one_payload_per_tp_rank(start_engine: StartEngine) -> None:
    e = await start_engine(tp_size=2)
    buckets = await load(e, dict(named_weights(1)), 10)
    assert e.calls.count((wire.UPDATE_WEIGHTS_FROM_TENSOR, 200)) == buckets
    assert (await e.get("/debug/state_dict_checksum"))["weight_version"] == "10"


async def test_the_receiver_refuses_a_data_parallel_server(start_engine: StartEngine) -> None:
    e = await start_engine(dp_size=2)
    with pytest.raises(CommitRefused, match="dp_size=2") as caught:
        await load(e, dict(named_weights(1)), 11)
    assert caught.value.status == 409 and e.calls == []


# ---------------------------------------------------------------- dp_size > 1 at registration


async def test_the_box_helper_refuses_to_register_a_data_parallel_server(start_engine: StartEngine,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    e = await start_engine(dp_size=2)
    registrations: list[Any] = []

    async def agent_info(request: web.Request) -> web.Response:
        return web.json_response({"handshake_port": 1, "sglang_url": e.url})

    async def register(request: web.Request) -> web.Response:
        registrations.append(await request.json())
        return web.json_response({"endpoint": "x"})

    app = web.Application()
    app.router.add_get("/info", agent_info)
    app.router.add_post("/register_rollout_instance", register)
    fake = TestServer(app, host="127.0.0.1")
    await fake.start_server()
    url = str(fake.make_url("")).rstrip("/")
    try:
        with pytest.raises(SystemExit) as exited:
            await asyncio.to_thread(box.main, ["register", "--manager", url, "--host", "127.0.0.1", "--port",
                                               str(e.server.port), "--agent-url", url, "--agent-port", "1"])
    finally:
        await fake.close()
    assert exited.value.code == 1 and registrations == []
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(PREFIX), err
    assert "dp_size=2" in err[0] and "run one SGLang server per replica" in err[0]


SETTINGS = HealthSettings(startup_grace_period_s=60.0, pending_poll_interval_s=2.0, check_interval_s=10.0,
                          check_timeout_s=5.0, check_path=wire.HEALTH_GENERATE, failure_threshold=3)


@pytest.mark.parametrize(("answer", "expected"), [
    (wire.ServerInfo("0.5.23", tp_size=1, dp_size=2, base_gpu_id=0, gpu_id_step=1), State.DEAD),
    (wire.ServerInfo("0.5.23", tp_size=2, dp_size=1, base_gpu_id=0, gpu_id_step=1), State.ACTIVE),
    (ConnectionError("no answer"), State.ACTIVE),  # an unreadable /server_info removes nothing
])
async def test_health_reads_server_info_on_the_first_ready_probe(answer: Any, expected: State) -> None:
    clock = FakeClock()
    registry = Registry(clock=clock)
    asked: list[str] = []

    async def server_info(url: str, timeout_s: float) -> wire.ServerInfo:
        asked.append(url)
        if isinstance(answer, Exception):
            raise answer
        return answer  # type: ignore[no-any-return]

    health = HealthMonitor(registry, WeightVersion(), FakeProbe(), SETTINGS, sleep=clock.sleep,
                           server_info=server_info)
    try:
        inst = registry.add("127.0.0.1", 30000, Kind.REMOTE)
        await async_wait_until(lambda: inst.state != State.PENDING, 5)
        assert inst.state == expected and asked == [inst.url]
        if expected == State.DEAD:
            reason = list(registry.events)[-1].reason
            assert "dp_size=2" in reason and "run one SGLang server per replica" in reason
    finally:
        await health.close()


@pytest.mark.slow
async def test_the_manager_removes_a_data_parallel_instance_saying_why(start_manager: Any,
                                                                       start_engine: StartEngine) -> None:
    m = await start_manager()
    e = await start_engine(dp_size=2)
    status, answer = await m.post("/register_rollout_instance", {"host": "127.0.0.1", "port": e.server.port})
    assert status == 200, answer

    async def removed() -> str | None:
        events = (await m.status())["recent_events"]
        dead = [ev for ev in events if ev["to"] == "dead"]
        return dead[-1]["reason"] if dead else None

    reason = await async_wait_until(removed, 20)
    assert f"127.0.0.1:{e.server.port} runs SGLang with dp_size=2" in reason
    assert "run one SGLang server per replica" in reason


# ---------------------------------------------------------------- Mooncake


class TimedOutRaw:
    """Mooncake's binding, for a transfer that timed out: ``transfer_check_status`` answers -2 and, as
    Mooncake does, keeps the batch id; ``get_batch_transfer_status`` is what frees it."""

    def __init__(self) -> None:
        self.freed: list[list[int]] = []

    def transfer_check_status(self, handle: int) -> int:
        return -2

    def get_batch_transfer_status(self, handles: list[int]) -> int:
        self.freed.append(list(handles))
        return -1


def test_a_timed_out_mooncake_transfer_frees_its_batch_id() -> None:
    engine = MooncakeEngine("127.0.0.1")
    raw = TimedOutRaw()
    engine._engine = raw
    with pytest.raises(TransferError) as caught:
        engine.wait([1234])
    assert caught.value.code == -2
    assert raw.freed == [[1234]]
    engine._engine = None  # nothing real to close


def test_server_info_reads_both_generations() -> None:
    old = wire.ServerInfo.from_json(json.loads('{"version": "0.5.12", "tp_size": 2, "dp_size": 1}'))
    assert wire.weight_update_sessions(old.version) is False and old.tp_size == 2
    new = wire.ServerInfo.from_json({"version": "0.5.23", "tp_size": 1, "dp_size": 4, "base_gpu_id": 2,
                                     "gpu_id_step": 2})
    assert wire.weight_update_sessions(new.version) is True and new.dp_size == 4 and new.gpu_of_rank(1) == 4
    assert wire.weight_update_sessions("0.5.21.post1") is True and wire.weight_update_sessions("0.5.20") is False
    assert wire.weight_update_sessions(None) is None  # unknown: the receiver asks the server


# ---------------------------------------------------------------- the cache flush needs an idle engine


async def slow_generation(e: Engine, rid: str, tokens: int) -> asyncio.Task[tuple[int, Any]]:
    """A non-streaming request that decodes for a while (50 ms a token); returns once it is running."""
    async with aiohttp.ClientSession() as s, s.post(e.url + "/debug/faults", json={"token_delay_s": 0.05}) as r:
        assert r.status == 200
    task = asyncio.ensure_future(e.post(wire.GENERATE, {"input_ids": [1, 2, 3], "rid": rid,
                                                        "sampling_params": {"max_new_tokens": tokens}}))

    async def running() -> bool:
        counts = (await e.get(wire.SERVER_INFO))["cpu_engine"]
        return counts["running"] + counts["queued"] > 0 or task.done()

    deadline = asyncio.get_running_loop().time() + 10
    while not await running():
        assert asyncio.get_running_loop().time() < deadline, "the generation never started"
        await asyncio.sleep(0.01)
    return task


async def flush(e: Engine, timeout_s: float | None = None) -> int:
    path = wire.FLUSH_CACHE if timeout_s is None else wire.flush_cache_path(timeout_s)
    async with aiohttp.ClientSession() as s, s.post(e.url + path) as r:
        return r.status


async def test_a_load_while_a_pause_holds_requests_loads_but_refuses_to_flush(start_engine: StartEngine) -> None:
    """Paused in place, SGLang runs a weight update at once (not paused, it waits for every request in
    flight: tests/test_real_sglang_contract.py), and the flush it asks for is refused while requests are held."""
    e = await start_engine()
    gen = await slow_generation(e, "busy", 400)
    assert (await e.post(wire.PAUSE_GENERATION, {"mode": "in_place"}))[0] == 200
    assert (await e.post(wire.BEGIN_WEIGHT_UPDATE, {}))[0] == 200
    assert await e.post(wire.UPDATE_WEIGHTS_FROM_TENSOR, body(named_weights(1), version="4")) == (
        400, {"success": False, "message": wire.CACHE_NOT_FLUSHED_MESSAGE})
    assert (await e.get("/debug/state_dict_checksum"))["weight_version"] == "4"  # loaded all the same
    assert await flush(e) == 400  # still busy
    assert (await e.post(wire.ABORT_REQUEST, wire.abort_body("busy")))[0] == 200
    assert await flush(e, 5) == 200  # waits for the engine to go idle
    assert (await e.post(wire.END_WEIGHT_UPDATE, {}))[0] == 200
    assert (await e.post(wire.CONTINUE_GENERATION, {}))[0] == 200
    status, out = await gen
    assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "abort"


async def test_the_receiver_waits_for_the_engine_to_go_idle_before_it_flushes(start_engine: StartEngine) -> None:
    e = await start_engine()
    gen = await slow_generation(e, "short", 20)  # about a second
    await load(e, dict(named_weights(1)), 11)
    status, out = await gen
    assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "length"  # not aborted: waited
    # As SGLang 0.5.23: not paused, begin_weight_update itself waits for the request (model_update_lock);
    # the update calls never flush (that fails them while requests run): the flush comes after, once idle.
    assert (wire.UPDATE_WEIGHTS_FROM_TENSOR, 400) not in e.calls and (wire.UPDATE_WEIGHTS_FROM_TENSOR, 200) in e.calls
    assert e.calls[-1] == (wire.END_WEIGHT_UPDATE, 200)
    assert (await e.get("/debug/state_dict_checksum"))["weight_version"] == "11"


async def test_a_load_whose_cache_cannot_be_flushed_in_time_is_not_committed(start_engine: StartEngine) -> None:
    e = await start_engine()
    gen = await slow_generation(e, "long", 400)
    # Paused in place the load runs at once and the request stays held, so the flush cannot happen.
    assert (await e.post(wire.PAUSE_GENERATION, {"mode": "in_place"}))[0] == 200
    agent = await receiver_for(e, dict(named_weights(1)), 1 << 30)
    agent.loader.settings = dataclasses.replace(agent.loader.settings, flush_wait_s=0.3)
    try:
        with pytest.raises(CommitRefused, match="prefix cache could not be flushed"):
            await load_buffer(agent, 12)
    finally:
        assert agent.loader.session is not None
        await agent.loader.session.close()
        await e.post(wire.ABORT_REQUEST, wire.abort_body("long"))
        await e.post(wire.CONTINUE_GENERATION, {})
        await gen
    assert (wire.END_WEIGHT_UPDATE, 200) in e.calls  # the session is closed all the same
