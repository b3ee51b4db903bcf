"""Shared-token auth, registration source rules and per-endpoint body limits, against a real daemon."""

from __future__ import annotations

import asyncio
import json
import signal
from typing import Any

import aiohttp
import pytest
from support import PY, ROOT, Proc, async_wait_until, free_port

TOKEN = "t0ken-for-tests"
QUIET = {"MC_LOG_LEVEL": "ERROR", "GLOG_minloglevel": "2"}


@pytest.mark.slow
async def test_bearer_token_is_required_everywhere_but_health_and_changes_nothing_without_it(start_manager,
                                                                                             stub_engine):
    m = await start_manager(auth_token=TOKEN)
    engine = await stub_engine()
    async with aiohttp.ClientSession() as s:
        async with s.get(m.url + "/health") as r:
            assert r.status == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}):
            async with s.post(m.url + "/register_rollout_instance", headers=headers,
                              json={"host": "127.0.0.1", "port": engine.port}) as r:
                assert r.status == 401 and "bearer token" in (await r.json())["error"]
                assert r.headers["WWW-Authenticate"].startswith("Bearer")
            async with s.get(m.url + "/get_instances_status", headers=headers) as r:
                assert r.status == 401
            async with s.post(m.url + "/update_weight_version", headers=headers, json={}) as r:
                assert r.status == 401
    status, st = await m.get("/get_instances_status")  # with the token
    assert status == 200 and st["instances"] == [] and st["weight_version"] == 0
    status, _ = await m.post("/register_rollout_instance", {"host": "127.0.0.1", "port": engine.port})
    assert status == 200
    assert TOKEN not in m.proc.log()  # never logged


@pytest.mark.slow
async def test_registration_only_from_allowed_networks_and_only_for_itself(start_manager, stub_engine):
    engine = await stub_engine()
    closed = await start_manager(registration_allowed_networks="10.0.0.0/8")
    status, err = await closed.post("/register_rollout_instance", {"host": "127.0.0.1", "port": engine.port})
    assert status == 403 and "registration_allowed_networks" in err["error"]
    status, err = await closed.post("/register_local_rollout_instances", [["127.0.0.1", engine.port]])
    assert status == 403
    assert (await closed.status())["instances"] == []

    m = await start_manager(registration_allowed_networks="127.0.0.0/8")
    status, err = await m.post("/register_rollout_instance", {"host": "127.0.0.2", "port": engine.port})
    assert status == 403 and "came from 127.0.0.1" in err["error"]  # a rogue registering someone else
    assert (await m.status())["instances"] == []
    status, _ = await m.post("/register_rollout_instance", {"host": "localhost", "port": engine.port})
    assert status == 200  # a name that resolves to the caller is the caller
    lenient = await start_manager(allow_registration_host_mismatch="true")
    status, _ = await lenient.post("/register_rollout_instance", {"host": "127.0.0.2", "port": engine.port})
    assert status == 200
    assert [i["host"] for i in (await lenient.status())["instances"]] == ["127.0.0.2"]


@pytest.mark.slow
async def test_admin_bodies_are_small_generation_bodies_may_be_large(start_manager):
    m = await start_manager(max_admin_body_kb="1", max_request_body_mb="1")
    big = b'{"host": "127.0.0.1", "port": 1, "x": "' + b"a" * 4000 + b'"}'
    status, err = await m.post("/register_rollout_instance", data=big)
    assert status == 413 and "too large" in err["error"]
    # A 200 kB generate body is fine (it then fails validation on its token ids, not on size).
    body = b'{"input_ids": [' + b"1," * 100000 + b'"x"]}'
    status, err = await m.post("/generate", data=body)
    assert status == 400 and "input_ids" in err["error"]
    status, err = await m.post("/generate", data=b'{"input_ids": [' + b"1," * 600000 + b'1]}')
    assert status == 413


# ---------------------------------------------------------------- issue 18: local registration, box tokens, /metrics


@pytest.mark.slow
async def test_local_registration_applies_the_ownership_rule_of_remote_registration(start_manager, stub_engine):
    engine = await stub_engine()
    m = await start_manager()
    for rogue in ([["10.1.2.3", 30000]], [["192.0.2.7", 8080]], [["127.0.0.1", engine.port], ["10.1.2.3", 30000]]):
        status, err = await m.post("/register_local_rollout_instances", rogue)
        assert status == 403 and "came from 127.0.0.1" in err["error"], err
        assert "allow_registration_host_mismatch" in err["error"]
    status, err = await m.post("/register_local_rollout_instances", [["no-such-host.invalid", 1]])
    assert status == 400 and "does not resolve" in err["error"]
    assert (await m.status())["instances"] == []  # all or none: nothing of a refused list was filed
    status, _ = await m.post("/register_local_rollout_instances", [["localhost", engine.port]])
    assert status == 200  # the caller's own instance, by a name that resolves to it
    lenient = await start_manager(allow_registration_host_mismatch="true")
    status, _ = await lenient.post("/register_local_rollout_instances", [["10.1.2.3", 30000]])
    assert status == 200  # the documented override (a trainer driver registering several nodes)


@pytest.mark.slow
async def test_a_box_token_removes_its_own_instance_and_nothing_else(start_manager, stub_engine):
    m = await start_manager(auth_token=TOKEN)
    a, b = await stub_engine(), await stub_engine()
    tokens = {}
    for e in (a, b):
        status, answer = await m.post("/register_rollout_instance", {"host": "127.0.0.1", "port": e.port})
        assert status == 200 and len(answer["box_token"]) >= 32
        tokens[e.endpoint] = answer["box_token"]
    assert tokens[a.endpoint] != tokens[b.endpoint]
    as_a = {"Authorization": f"Bearer {tokens[a.endpoint]}"}

    async def shutdown(endpoints: list[str], headers: dict[str, str]) -> tuple[int, Any]:
        return await m.post("/shutdown_instances", {"endpoints": endpoints}, headers=headers)

    for endpoints in ([b.endpoint], [a.endpoint, b.endpoint], ["127.0.0.1:1"]):
        status, err = await shutdown(endpoints, as_a)
        assert status == 403 and "box token" in err["error"], err
    assert {i["endpoint"] for i in (await m.status())["instances"]} == {a.endpoint, b.endpoint}  # nothing drained
    status, _ = await _get(m, "/get_instances_status", as_a)
    assert status == 401  # a box token opens nothing but its own removal
    for path in ("/update_weight_version", "/register_rollout_instance", "/abort_local_requests"):
        status, _ = await m.post(path, {}, headers=as_a)
        assert status == 401, path
    status, _ = await shutdown([a.endpoint], {"Authorization": "Bearer not-a-box-token"})
    assert status == 401
    status, answer = await shutdown([a.endpoint], as_a)
    assert status == 200 and answer["removed"] == [a.endpoint]
    status, _ = await shutdown([a.endpoint], as_a)  # spent: its instance is gone
    assert status == 401
    status, answer = await m.post("/shutdown_instances", {"endpoints": [b.endpoint]})  # the shared token: any
    assert status == 200 and answer["removed"] == [b.endpoint]
    st = await m.status()
    reasons = {e["endpoint"]: e["reason"] for e in st["recent_events"] if e["to"] == "dead"}
    assert reasons == {a.endpoint: "removed by request of its box (box token)", b.endpoint: "removed by request"}
    assert not any(t in json.dumps(st) or t in m.proc.log() for t in tokens.values())  # never shown again


async def _get(m: Any, path: str, headers: dict[str, str]) -> tuple[int, Any]:
    async with m.session.get(m.url + path, headers=headers) as r:
        return r.status, await r.json()


@pytest.mark.slow
async def test_metrics_are_open_by_default_and_closed_by_metrics_require_token(start_manager):
    m = await start_manager(auth_token=TOKEN)
    async with aiohttp.ClientSession() as s:
        async with s.get(m.url + "/metrics") as r:
            assert r.status == 200  # a documented choice: scrapers need no token
    closed = await start_manager(auth_token=TOKEN, metrics_require_token="true")
    async with aiohttp.ClientSession() as s:
        async with s.get(closed.url + "/metrics") as r:
            assert r.status == 401
        async with s.get(closed.url + "/health") as r:
            assert r.status == 200  # liveness stays open
    async with closed.session.get(closed.url + "/metrics", headers=closed.headers) as r:
        assert r.status == 200 and "rollout_manager_" in await r.text()


@pytest.mark.slow
async def test_the_launcher_deregisters_with_its_box_token_also_after_a_manager_restart(start_manager, tmp_path):
    """scripts/launch_sglang.sh keeps the box token of its registration (renewed when it registers again
    with a restarted manager) and removes its instance with it, not with the shared token."""
    mport = free_port()
    m = await start_manager(port=mport, auth_token=TOKEN)
    port, agent_port = free_port(), free_port()
    endpoint = f"127.0.0.1:{port}"
    args = launch_args(m.url, port, agent_port, "--reregister-check-s", "0.3")
    box = Proc(args, tmp_path / "box.log", env={**QUIET, "ROLLOUT_MANAGER_AUTH_TOKEN": TOKEN})
    try:
        await async_wait_until(lambda: _state_is(m, endpoint, "active"), 60, interval_s=0.2,
                               message=lambda: f"{endpoint} active:\n{box.log()}")
        m.proc.signal(signal.SIGKILL)
        await asyncio.to_thread(m.proc.wait, 10)
        m2 = await start_manager(port=mport, auth_token=TOKEN)
        await async_wait_until(lambda: _state_is(m2, endpoint, "active"), 30, interval_s=0.2,
                               message=lambda: f"{endpoint} registered again:\n{box.log()}")
        box.signal(signal.SIGTERM)
        assert await asyncio.to_thread(box.wait, 30) == 0, box.log()
        events = [e for e in (await m2.status())["recent_events"] if e["endpoint"] == endpoint and e["to"] == "dead"]
        assert [e["reason"] for e in events] == ["removed by request of its box (box token)"], box.log()
        assert "box_token" not in box.log()
    finally:
        box.stop()


async def _state_is(m: Any, endpoint: str, state: str) -> bool:
    return any(i["endpoint"] == endpoint and i["state"] == state for i in (await m.status())["instances"])


def launch_args(manager: str, port: int, agent_port: int, *extra: str) -> list[str]:
    model = json.dumps({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1})
    return ["bash", str(ROOT / "scripts" / "launch_sglang.sh"), "--engine", "cpu", "--manager-addr", manager,
            "--host", "127.0.0.1", "--port", str(port), "--transfer-agent-handshake-port", str(agent_port),
            "--python", PY, "--ready-timeout-s", "60", "--drain-timeout-s", "10", "--stop-timeout-s", "5", *extra,
            "--", "--seed", "0", "--model-config", model]


def test_box_deregister_sends_the_box_token_and_falls_back_to_the_shared_one_on_401(tmp_path, monkeypatch):
    """``box deregister --state-file``: the token ``register`` (or ``watch``) wrote, the shared one only
    when the manager does not know it."""
    from rollout_manager import manager_client
    from rollout_manager.launch import box
    from rollout_manager.launch.box_registration import save_state

    calls: list[str | None] = []
    answers = iter([manager_client.HTTPAnswer(401, {"error": "unknown"}),
                    manager_client.HTTPAnswer(200, {"removed": ["h:1"]})])

    def fake_call(method: str, url: str, body: Any = None, *, timeout_s: float | None = 10.0,
                  token: str | None = None) -> manager_client.HTTPAnswer:
        calls.append(token)
        return next(answers)

    monkeypatch.delenv("ROLLOUT_MANAGER_AUTH_TOKEN", raising=False)
    monkeypatch.setattr(manager_client, "http_call", fake_call)
    state = tmp_path / "state.json"
    state.write_text(json.dumps({"body": {}, "endpoint": "h:1", "run_id": "r", "box_token": "old-token-xxxxxxxx"}))
    save_state(str(state), {"body": {}, "endpoint": "h:1", "run_id": "r2", "box_token": "new"})
    assert json.loads(state.read_text())["box_token"] == "new"  # shorter, padded: still one JSON document
    assert box.main(["deregister", "--manager", "http://h:5", "--endpoint", "h:1", "--state-file", str(state)]) == 0
    assert calls == ["new", ""]  # the box token, then (401) the shared one from the environment (unset here)


async def test_a_caller_on_the_managers_machine_may_name_its_lan_address_but_not_the_wildcard():
    """A trainer beside the manager calls through 127.0.0.1 and registers its SGLang by the node's IP;
    0.0.0.0 (bindable, but nobody's address) and other machines stay refused. In process: no traffic."""
    import ipaddress

    from rollout_manager.errors import Forbidden
    from rollout_manager.instances.admission import Admission
    from rollout_manager.osutil import route_source

    admission = Admission([ipaddress.ip_network("0.0.0.0/0")], "0.0.0.0/0", False)
    for host in ("0.0.0.0", "10.1.2.3", "127.0.0.2"):
        with pytest.raises(Forbidden):
            await admission.check("127.0.0.1", [host])
    try:
        own = route_source("192.0.2.1", 9)  # a UDP connect: nothing is sent
    except OSError:
        pytest.skip("no non-loopback route on this machine")
    if own.startswith("127.") or ":" in own:
        pytest.skip("no IPv4 LAN address")
    await admission.check("127.0.0.1", [own, "127.0.0.1"])
