"""The admin and registration API against a real daemon process."""

from __future__ import annotations

import signal

import pytest
from support import PY, Proc, async_wait_until

pytestmark = pytest.mark.slow  # every test here starts real processes


async def test_health(start_manager):
    m = await start_manager()
    status, body = await m.get("/health")
    assert status == 200 and body["status"] == "healthy"


async def test_register_pending_then_active_and_status_shape(start_manager, stub_engine):
    m = await start_manager()
    engine = await stub_engine(health_status=503)  # still loading
    status, body = await m.post("/register_rollout_instance",
                                {"host": "127.0.0.1", "port": engine.port, "mooncake_handshake_port": 19001})
    assert status == 200
    assert body["state"] == "pending" and body["id"]
    assert body["weight_transfer"]["num_mooncake_engines_per_group"] == 4
    assert body["weight_transfer"]["mooncake_transfer_protocol"] == "tcp"
    await async_wait_until(lambda: engine.probes >= 2, message="pending probes")
    st = await m.status()
    assert st["pending_instances"] == 1 and st["pending_instance_endpoints"] == [engine.endpoint]
    engine.health_status = 200  # finished loading
    await async_wait_until(lambda: m.state_of(engine.endpoint), message="instance known")
    await async_wait_until(lambda: _is(m, engine.endpoint, "active"), message="instance active")
    st = await m.status()
    assert st["ready_instances"] == 1 and st["ready_instance_endpoints"] == [engine.endpoint]
    inst = st["instances"][0]
    for key in ("endpoint", "id", "state", "kind", "weight_version", "sender", "group", "in_flight"):
        assert key in inst
    assert inst["kind"] == "remote" and inst["mooncake_handshake_port"] == 19001
    assert "/health_generate" in engine.seen
    assert [e["to"] for e in st["recent_events"]] == ["pending", "active"]


async def _is(m, endpoint, state):
    return await m.state_of(endpoint) == state


async def test_declared_vocab_size_is_kept_and_bad_ones_refused(start_manager, stub_engine):
    """SGLang reports no vocabulary size, so the launcher declares it; garbage registers nothing."""
    m = await start_manager()
    engine = await stub_engine()
    for bad in (0, -3, "1024", True, 2**40, 1.5):
        status, err = await m.post("/register_rollout_instance",
                                   {"host": "127.0.0.1", "port": engine.port, "vocab_size": bad})
        assert status == 400 and "vocab_size" in err["error"], (bad, err)
    assert (await m.status())["instances"] == []
    status, _ = await m.post("/register_rollout_instance",
                             {"host": "127.0.0.1", "port": engine.port, "vocab_size": 1000})
    assert status == 200
    await async_wait_until(lambda: _is(m, engine.endpoint, "active"), message="instance active")
    assert (await m.status())["instances"][0]["vocab_size"] == 1000


async def test_duplicate_registration_is_409_whether_pending_or_active(start_manager, stub_engine):
    m = await start_manager()
    engine = await stub_engine(health_status=503)
    body = {"host": "127.0.0.1", "port": engine.port}
    assert (await m.post("/register_rollout_instance", body))[0] == 200
    status, err = await m.post("/register_rollout_instance", body)
    assert status == 409 and "already registered" in err["error"] and "pending" in err["error"]
    engine.health_status = 200
    await async_wait_until(lambda: _is(m, engine.endpoint, "active"))
    status, err = await m.post("/register_rollout_instance", body)
    assert status == 409 and "active" in err["error"]
    assert len((await m.status())["instances"]) == 1


async def test_local_instances_register_all_or_none(start_manager, stub_engine):
    m = await start_manager()
    a, b = await stub_engine(), await stub_engine()
    status, body = await m.post("/register_local_rollout_instances", [["127.0.0.1", a.port]])
    assert status == 200 and body["registered"][0]["endpoint"] == a.endpoint
    status, err = await m.post("/register_local_rollout_instances",
                               [["127.0.0.1", b.port], ["127.0.0.1", a.port]])
    assert status == 409 and a.endpoint in err["error"]
    st = await m.status()
    assert [i["endpoint"] for i in st["instances"]] == [a.endpoint]  # b was not half-registered
    await async_wait_until(lambda: _is(m, a.endpoint, "active"))
    assert (await m.status())["instances"][0]["kind"] == "local"


async def test_pending_instance_that_never_gets_healthy_is_dropped_after_grace(start_manager, stub_engine):
    m = await start_manager(startup_grace_period_s="0.6")
    engine = await stub_engine(health_status=503)
    await m.post("/register_rollout_instance", {"host": "127.0.0.1", "port": engine.port})
    await async_wait_until(lambda: _gone(m, engine.endpoint), message="eviction after grace period")
    events = (await m.status())["recent_events"]
    assert "start-up grace period" in events[-1]["reason"]


async def _gone(m, endpoint):
    return await m.state_of(endpoint) is None


async def test_active_instance_evicted_after_consecutive_failures_but_not_for_4xx(start_manager, stub_engine):
    m = await start_manager()
    engine = await stub_engine()
    await m.post("/register_rollout_instance", {"host": "127.0.0.1", "port": engine.port})
    await async_wait_until(lambda: _is(m, engine.endpoint, "active"))
    engine.health_status = 404  # the caller's problem, not the box's
    seen = engine.probes
    await async_wait_until(lambda: engine.probes >= seen + 4, message="several 4xx probes")
    assert await m.state_of(engine.endpoint) == "active"
    engine.health_status = 503
    await async_wait_until(lambda: _gone(m, engine.endpoint), message="eviction after 5xx")
    reason = (await m.status())["recent_events"][-1]["reason"]
    assert "2 consecutive failures" in reason and "health check: HTTP 503" in reason


async def test_shutdown_instances_drains_and_removes(start_manager, stub_engine):
    m = await start_manager()
    a, b = await stub_engine(), await stub_engine()
    for e in (a, b):
        await m.post("/register_rollout_instance", {"host": "127.0.0.1", "port": e.port})
    await async_wait_until(lambda: _is(m, b.endpoint, "active"))
    status, body = await m.post("/shutdown_instances",
                                {"endpoints": [a.endpoint, "127.0.0.1:1"], "check_weight_update": True})
    assert status == 200
    assert body == {"removed": [a.endpoint], "not_found": ["127.0.0.1:1"], "skipped": []}
    st = await m.status()
    assert [i["endpoint"] for i in st["instances"]] == [b.endpoint]
    assert [e["to"] for e in st["recent_events"] if e["endpoint"] == a.endpoint][-2:] == ["draining", "dead"]


async def test_weight_senders_filtered_grouped_and_instances_dealt_round_robin(start_manager, stub_engine):
    m = await start_manager(allowed_sender_ips="127.0.0.0/30,127.0.1.9")
    engines = [await stub_engine(health_status=503) for _ in range(5)]
    for e in engines[:3]:
        await m.post("/register_rollout_instance", {"host": "127.0.0.1", "port": e.port})
    status, body = await m.put_senders([["127.0.0.1", "127.0.0.9", "127.0.0.2"], ["127.0.5.5", "127.0.1.9"]], 2)
    assert status == 200
    s0, s1 = body["senders"]
    assert [g["ip"] for g in s0["groups"]] == ["127.0.0.1", "127.0.0.2"]  # 127.0.0.9 is outside /30
    assert [g["ip"] for g in s1["groups"]] == ["127.0.1.9", "127.0.1.9"]  # exact-IP rule
    # Dealt in registration order, senders interleaved: (0,0), (1,0), (0,1).
    slots = [(i["sender"], i["group"]) for i in (await m.status())["instances"]]
    assert slots == [(0, 0), (1, 0), (0, 1)]
    # A later registration gets the next slot in its answer.
    _, reg = await m.post("/register_rollout_instance", {"host": "127.0.0.1", "port": engines[3].port})
    assert (reg["weight_transfer"]["sender"], reg["weight_transfer"]["group"]) == (1, 1)
    assert reg["weight_transfer"]["sender_ip"] == "127.0.1.9"
    # Instances leaving: the rest is re-dealt so the groups stay even.
    await m.post("/shutdown_instances", {"endpoints": [engines[0].endpoint, engines[2].endpoint]})
    slots = [(i["sender"], i["group"]) for i in (await m.status())["instances"]]
    assert slots == [(0, 0), (1, 0)]
    # Senders change: everything is re-dealt evenly over the new groups.
    status, body = await m.put_senders([["127.0.0.2"]], 1, engines=8)
    assert status == 200 and body["num_mooncake_engines_per_group"] == 8
    st = await m.status()
    assert {(i["sender"], i["group"]) for i in st["instances"]} == {(0, 0)}


async def test_weight_senders_with_no_allowed_ip_is_400_and_changes_nothing(start_manager):
    m = await start_manager(allowed_sender_ips="10.0.0.0/8")
    before = (await m.status())["weight_senders"]
    status, err = await m.put_senders([["127.0.0.1"]], None)
    assert status == 400 and "none of its IPs" in err["error"] and "10.0.0.0/8" in err["error"]
    assert (await m.status())["weight_senders"] == before


GOOD_REMOTE = {"host": "127.0.0.1", "port": 1}
MALFORMED = [
    ("POST", "/register_rollout_instance", b"", 400, "empty"),
    ("POST", "/register_rollout_instance", b"{not json", 400, "not valid JSON"),
    ("POST", "/register_rollout_instance", b"\xff\xfe", 400, "not valid JSON"),
    ("POST", "/register_rollout_instance", b"[]", 400, "body"),
    ("POST", "/register_rollout_instance", b'{"port": 30000}', 400, "'host'"),
    ("POST", "/register_rollout_instance", b'{"host": "127.0.0.1"}', 400, "'port'"),
    ("POST", "/register_rollout_instance", b'{"host": "127.0.0.1", "port": "30000"}', 400, "'port'"),
    ("POST", "/register_rollout_instance", b'{"host": "127.0.0.1", "port": 30000.5}', 400, "'port'"),
    ("POST", "/register_rollout_instance", b'{"host": "127.0.0.1", "port": true}', 400, "'port'"),
    ("POST", "/register_rollout_instance", b'{"host": "127.0.0.1", "port": 70000}', 400, "'port'"),
    ("POST", "/register_rollout_instance", b'{"host": "127.0.0.1", "port": 0}', 400, "'port'"),
    ("POST", "/register_rollout_instance", b'{"host": "", "port": 1}', 400, "'host'"),
    ("POST", "/register_rollout_instance", b'{"host": "http://a:1", "port": 1}', 400, "'host'"),
    ("POST", "/register_rollout_instance", b'{"host": 12, "port": 1}', 400, "'host'"),
    ("POST", "/register_rollout_instance",
     b'{"host": "127.0.0.1", "port": 1, "mooncake_handshake_port": -3}', 400, "'mooncake_handshake_port'"),
    ("POST", "/register_rollout_instance", b'{"host": "127.0.0.1", "port": 1, "extra": 1}', 400, "'extra'"),
    ("POST", "/register_local_rollout_instances", b"{}", 400, "body"),
    ("POST", "/register_local_rollout_instances", b"[]", 400, "at least 1"),
    ("POST", "/register_local_rollout_instances", b'[["127.0.0.1"]]', 400, "[0]"),
    ("POST", "/register_local_rollout_instances", b'[["127.0.0.1", "1"]]', 400, "[0][1]"),
    ("POST", "/register_local_rollout_instances", b'[["127.0.0.1", 1, 2]]', 400, "[0]"),
    ("POST", "/register_local_rollout_instances", b'[{"host": "127.0.0.1", "port": 1}]', 400, "[0]"),
    ("POST", "/shutdown_instances", b'{}', 400, "'endpoints'"),
    ("POST", "/shutdown_instances", b'{"endpoints": []}', 400, "'endpoints'"),
    ("POST", "/shutdown_instances", b'{"endpoints": ["nohost"]}', 400, "endpoints[0]"),
    ("POST", "/shutdown_instances", b'{"endpoints": ["127.0.0.1:1"], "check_weight_update": "yes"}', 400,
     "'check_weight_update'"),
    ("PUT", "/update_weight_senders", b'{}', 400, "'weight_sender_ips'"),
    ("PUT", "/update_weight_senders", b'{"weight_sender_ips": []}', 400, "'weight_sender_ips'"),
    ("PUT", "/update_weight_senders", b'{"weight_sender_ips": [[]]}', 400, "weight_sender_ips[0]"),
    ("PUT", "/update_weight_senders", b'{"weight_sender_ips": ["127.0.0.1"]}', 400, "weight_sender_ips[0]"),
    ("PUT", "/update_weight_senders", b'{"weight_sender_ips": [["300.1.1.1"]]}', 400, "weight_sender_ips[0][0]"),
    ("PUT", "/update_weight_senders", b'{"weight_sender_ips": [["127.0.0.1"]], '
                                      b'"num_mooncake_groups_per_sender": 0}', 400,
     "'num_mooncake_groups_per_sender'"),
    ("PUT", "/update_weight_senders", b'{"weight_sender_ips": [["127.0.0.1"]], '
                                      b'"num_mooncake_engines_per_group": "4"}', 400,
     "'num_mooncake_engines_per_group'"),
    ("POST", "/update_weight_senders", b'{"weight_sender_ips": [["127.0.0.1"]]}', 405, "not allowed"),
    ("POST", "/generate", b'{}', 400, "'input_ids'"),
    ("POST", "/generate", b'{"text": "hello"}', 400, "send 'input_ids'"),
    ("POST", "/generate", b'{"input_ids": []}', 400, "input_ids"),
    ("POST", "/generate", b'{"input_ids": [1, -2]}', 400, "input_ids[1]"),
    ("POST", "/generate", b'{"input_ids": [1, "2"]}', 400, "input_ids[1]"),
    # Long prompts are checked by a faster path first (schemas._fast_token_ids): the same verdicts, the
    # same item named.
    ("POST", "/generate", b'{"input_ids": [' + b"7," * 300 + b'true]}', 400, "input_ids[300]"),
    ("POST", "/generate", b'{"input_ids": [' + b"7," * 300 + b'1.0]}', 400, "input_ids[300]"),
    ("POST", "/generate", b'{"input_ids": [[1], [' + b"7," * 300 + b'-1]]}', 400, "input_ids[1][300]"),
    ("POST", "/generate", b'{"input_ids": [1], "sampling_params": {"max_new_tokens": "8"}}', 400,
     "sampling_params.max_new_tokens"),
    ("POST", "/generate", b'{"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}', 400,
     "sampling_params.max_new_tokens"),
    ("POST", "/generate", b'{"input_ids": [[1], [2]], "rid": ["a"]}', 400, "'rid' has 1 items for 2"),
    ("POST", "/generate", b'{"input_ids": [1], "return_logprob": "yes"}', 400, "return_logprob"),
    ("POST", "/generate", b'{"input_ids": [1], "stream": 1}', 400, "stream"),
    ("POST", "/batch_generate_requests", b'{}', 400, "body"),
    ("POST", "/batch_generate_requests", b'[]', 400, "at least 1"),
    ("POST", "/batch_generate_requests", b'[["a"]]', 400, "[0]"),
    ("POST", "/batch_generate_requests", b'[["a", {"input_ids": [1]}], ["a", {"input_ids": [2]}]]', 400,
     "'a' appears more than once"),
    ("POST", "/batch_generate_requests", b'[["a", {"input_ids": [1]}], ["b", {"input_ids": "x"}]]', 400,
     "[1][1].input_ids"),
    ("POST", "/batch_generate_requests", b'[[1.5, {"input_ids": [1]}]]', 400, "[0][0]"),
    ("POST", "/update_metrics", b'{}', 400, "'step_time_s'"),
    ("POST", "/update_metrics", b'{"step_time_s": -1, "trainer_bubble_time_s": 0, "step_throughput": 0}', 400,
     "'step_time_s'"),
    ("POST", "/update_metrics", b'{"step_time_s": 1, "trainer_bubble_time_s": "2", "step_throughput": 0}', 400,
     "'trainer_bubble_time_s'"),
    ("POST", "/update_metrics", b'{"step_time_s": 1, "trainer_bubble_time_s": 2, "step_throughput": 0, "x": 1}',
     400, "'x'"),
    ("POST", "/abort_local_requests", b'{"all": true}', 400, "'all'"),
    ("POST", "/abort_local_requests", b'[1]', 400, "body"),
    ("GET", "/no_such_endpoint", b"", 404, "no such endpoint"),
]


@pytest.mark.parametrize("method, path, data, code, fragment", MALFORMED,
                         ids=[f"{m} {p} {d[:40]!r}" for m, p, d, _, _ in MALFORMED])
async def test_malformed_bodies_get_4xx_json_and_change_nothing(start_manager_shared, method, path, data,
                                                                 code, fragment):
    m = start_manager_shared
    before = await m.status()
    status, body = await m.post(path, data=data, method=method)
    assert status == code
    assert isinstance(body, dict) and set(body) == {"error"} and fragment in body["error"], body
    after = await m.status()
    assert after["instances"] == before["instances"]
    assert after["weight_senders"] == before["weight_senders"]
    assert after["local"] == before["local"] and after["weight_version"] == before["weight_version"]
    assert (await m.get("/health"))[0] == 200


async def test_oversized_body_is_413(start_manager):
    m = await start_manager(max_request_body_mb="0.01")
    status, body = await m.post("/register_rollout_instance", data=b'{"host": "' + b"a" * 20000 + b'"}')
    assert status == 413 and "too large" in body["error"]


async def test_sigterm_shuts_down_cleanly_and_port_in_use_is_one_line(start_manager, tmp_path):
    m = await start_manager()
    port = int(m.url.rsplit(":", 1)[1])
    clash = Proc([PY, "-m", "rollout_manager", "serve", "--bind", f"127.0.0.1:{port}"], tmp_path / "clash.log")
    try:
        assert clash.wait(60) == 1
        lines = clash.log().strip().splitlines()
        assert lines[-1] == f"rollout-manager: cannot listen on 127.0.0.1:{port}: address already in use"
        assert not any("Traceback" in line for line in lines)
    finally:
        clash.stop()
    m.proc.signal(signal.SIGTERM)
    assert m.proc.wait(20) == 0
    assert "stopped" in m.proc.log()
    # The port is free again: nothing left listening.
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


async def test_a_version_bump_no_sender_can_deliver_is_409_and_changes_nothing(start_manager, stub_engine):
    m = await start_manager()
    engine = await stub_engine()
    await m.register(engine)
    status, err = await m.post("/update_weight_version", {})
    assert status == 409 and set(err) == {"error"}
    assert "no weight sender" in err["error"] and "PUT /update_weight_senders" in err["error"]
    st = await m.status()
    assert st["weight_version"] == 0
    (inst,) = st["instances"]
    assert inst["state"] == "active" and inst["waiting_for"] is None and inst["last_error_at"] is None


async def test_sighup_shuts_down_cleanly_like_sigterm(start_manager):
    """A closed terminal (SIGHUP) drains and stops the daemon instead of killing it mid-request."""
    m = await start_manager()
    m.proc.signal(signal.SIGHUP)
    assert m.proc.wait(20) == 0
    log = m.proc.log()
    assert "shutting down" in log and "stopped" in log
