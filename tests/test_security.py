"""Shared-token auth, registration source rules and per-endpoint body limits, against a real daemon."""

from __future__ import annotations

import aiohttp

TOKEN = "t0ken-for-tests"


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
