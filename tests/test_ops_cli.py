"""The operator's CLI (``status``, ``drain``, ``push-status``, ``watch``) run as a subprocess against a real manager."""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass

import pytest
from support import PY, ROOT, async_wait_until, free_port

from rollout_manager import ops

pytestmark = pytest.mark.slow  # every test here starts real processes


@dataclass
class Result:
    rc: int
    out: str
    err: str


async def cli(*args: str, env: dict[str, str] | None = None, timeout_s: float = 30.0) -> Result:
    """Run ``rollout-manager ARGS`` with no token or address inherited from the test's environment."""
    base = {k: v for k, v in os.environ.items() if k not in ("ROLLOUT_MANAGER_AUTH_TOKEN", "ROLLOUT_MANAGER_ADDR")}
    proc = await asyncio.create_subprocess_exec(
        PY, "-m", "rollout_manager", *args, cwd=ROOT, env={**base, "COLUMNS": "200", **(env or {})},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    assert proc.returncode is not None
    return Result(proc.returncode, out.decode(), err.decode())


async def test_status_table_and_json(start_manager, start_engines):
    mgr = await start_manager()
    engine, = await start_engines([])
    await mgr.register(engine)

    table = await cli("status", "--manager", mgr.url)
    assert table.rc == ops.OK, table
    header, row = table.out.splitlines()[1:3]
    assert header.split()[:4] == ["ENDPOINT", "ID", "KIND", "STATE"] and "WAITING FOR" in header
    assert row.split()[:5] == [engine.endpoint, row.split()[1], "remote", "active", "v0"]
    assert "weight version 0" in table.out and "1 active" in table.out and "requests waiting 0" in table.out

    # The address may also come from the environment, without a scheme.
    as_json = await cli("status", "--json", env={"ROLLOUT_MANAGER_ADDR": mgr.url.removeprefix("http://")})
    assert as_json.rc == ops.OK, as_json
    doc = json.loads(as_json.out)
    inst, = doc["instances"]
    assert (inst["endpoint"], inst["state"], inst["waiting_for"]) == (engine.endpoint, "active", None)
    assert doc["counts"]["active"] == 1 and doc["requests_waiting_for_instance"] == 0


async def test_status_shows_what_a_syncing_instance_waits_for(start_manager, start_engines):
    mgr = await start_manager(weight_activation="drain")  # out of service while it waits
    engine, = await start_engines([])
    await mgr.register(engine)
    status, answer = await mgr.put_senders([["127.0.0.1"]], groups=1)
    assert status == 200, answer
    status, answer = await mgr.post("/update_weight_version", {})  # the engine has no weight receiver
    assert status == 200, answer

    async def consistent_row() -> str | None:
        """The table row of a syncing instance that shows what the JSON says it waits for."""
        inst, = json.loads((await cli("status", "--json", "--manager", mgr.url)).out)["instances"]
        table = await cli("status", "--manager", mgr.url)
        rows = [line for line in table.out.splitlines() if line.startswith(engine.endpoint)]
        ok = inst["state"] == "syncing" and inst["waiting_for"] and rows and inst["waiting_for"] in rows[0]
        return table.out if ok else None

    out = await async_wait_until(consistent_row, message="a syncing instance with what it waits for")
    assert "weight version 1" in out and "1 syncing" in out


async def test_drain_registered_and_unknown(start_manager, start_engines):
    mgr = await start_manager()
    engine, = await start_engines([])
    await mgr.register(engine)

    drained = await cli("drain", "--manager", mgr.url, engine.endpoint)
    assert drained.rc == ops.OK, drained
    assert drained.out.split() == ["removed", engine.endpoint]
    assert await mgr.state_of(engine.endpoint) in (None, "dead")

    unknown = "127.0.0.1:1"
    missing = await cli("drain", "--manager", mgr.url, unknown)
    assert missing.rc == ops.UNKNOWN_ENDPOINT, missing
    assert missing.out.split() == ["not", "found", unknown]

    as_json = await cli("drain", "--json", "--manager", mgr.url, unknown)
    assert as_json.rc == ops.UNKNOWN_ENDPOINT
    assert json.loads(as_json.out) == {"removed": [], "not_found": [unknown], "skipped": []}


async def test_push_status_with_no_pushes(start_manager, start_engines):
    mgr = await start_manager()
    engine, = await start_engines([])
    await mgr.register(engine)

    text = await cli("push-status", "--manager", mgr.url)
    assert text.rc == ops.OK, text
    assert text.out.splitlines() == ["no weight pushes yet", "no weight push failures"]

    as_json = await cli("push-status", "--json", "--manager", mgr.url)
    assert json.loads(as_json.out) == {"weight_version": 0, "pushes": [], "failures": []}


async def test_watch_once_prints_one_frame(start_manager, start_engines):
    mgr = await start_manager()
    engine, = await start_engines([])
    await mgr.register(engine)

    frame = await cli("watch", "--once", "--manager", mgr.url)
    assert frame.rc == ops.OK, frame
    for text in ("rollout-manager", mgr.url, "instances", engine.endpoint, "active", "recent weight pushes",
                 "recent events", "requests waiting"):
        assert text in frame.out, (text, frame.out)


async def test_unreachable_manager():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    for args in (["status"], ["push-status"], ["watch", "--once"], ["drain", "127.0.0.1:2"]):
        result = await cli(*args, "--manager", url)
        assert result.rc == ops.UNREACHABLE, (args, result)
        assert f"cannot reach the manager at {url}" in result.err
        assert result.out == ""


async def test_token_from_environment_or_config(start_manager, start_engines, tmp_path):
    mgr = await start_manager(auth_token="s3cret")

    missing = await cli("status", "--manager", mgr.url)
    assert missing.rc == ops.UNAUTHORIZED, missing
    assert "refused the token" in missing.err

    wrong = await cli("drain", "--manager", mgr.url, "127.0.0.1:2", env={"ROLLOUT_MANAGER_AUTH_TOKEN": "nope"})
    assert wrong.rc == ops.UNAUTHORIZED, wrong

    right = await cli("status", "--manager", mgr.url, env={"ROLLOUT_MANAGER_AUTH_TOKEN": "s3cret"})
    assert right.rc == ops.OK, right

    config = tmp_path / "ops.toml"
    config.write_text('auth_token = "s3cret"\n')
    from_file = await cli("push-status", "--manager", mgr.url, "--config", str(config))
    assert from_file.rc == ops.OK, from_file

    unreadable = await cli("status", "--manager", mgr.url, "--config", str(tmp_path / "missing.toml"))
    assert unreadable.rc == ops.USAGE and "cannot read --config" in unreadable.err
