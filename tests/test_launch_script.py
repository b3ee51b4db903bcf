"""scripts/launch_sglang.sh end to end, with ``--engine cpu`` standing in for SGLang: real manager, real
receiver agent, real weight push, real signals. Also the one-line refusals that come before anything heavy."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import aiohttp
import pytest
import torch
from aiohttp import web
from support import PY, ROOT, Proc, alive, async_wait_until, descendants, free_port

from rollout_manager.cpu_engine.model import build_model, reference_generate, tensor_checksum
from rollout_manager.weights.sender_agent import SenderAgent

pytestmark = pytest.mark.slow  # every test here starts real processes

SCRIPT = str(ROOT / "scripts" / "launch_sglang.sh")
MODEL = {"hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 2}
QUIET = {"MC_LOG_LEVEL": "ERROR", "GLOG_minloglevel": "2"}


# Runs argv[1:] in place of itself (the same pid) with SIGHUP at its default.
HUP_DEFAULT = ("import os, signal, sys; signal.signal(signal.SIGHUP, signal.SIG_DFL); "
               "os.execvp(sys.argv[1], sys.argv[1:])")


def script_args(manager: str, port: int, agent_port: int, *engine_flags: str) -> list[str]:
    return ["bash", SCRIPT, "--engine", "cpu", "--manager-addr", manager, "--host", "127.0.0.1",
            "--port", str(port), "--transfer-agent-handshake-port", str(agent_port), "--python", PY,
            "--ready-timeout-s", "60", "--drain-timeout-s", "10", "--stop-timeout-s", "5",
            "--", "--seed", "0", "--model-config", json.dumps(MODEL), *engine_flags]


def run_quick(args: list[str], env: dict[str, str] | None = None, timeout: float = 15) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, **QUIET, **(env or {})})


def group_empty(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


async def instance(m, endpoint: str) -> dict | None:
    for inst in (await m.status())["instances"]:
        if inst["endpoint"] == endpoint:
            return inst
    return None


async def state_is(m, endpoint: str, state: str | None) -> bool:
    inst = await instance(m, endpoint)
    return (inst["state"] if inst else None) == state


async def until_active(m, endpoint: str, box: Proc, timeout: float = 40) -> None:
    async def ready() -> bool:
        if box.popen.poll() is not None:
            raise AssertionError(f"the script exited with {box.popen.returncode}:\n{box.log()}")
        return await state_is(m, endpoint, "active")

    try:
        await async_wait_until(ready, timeout, interval_s=0.2, message=f"{endpoint} to be active")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{box.log()}") from None


async def _in_flight(m, endpoint: str) -> bool:
    inst = await instance(m, endpoint)
    return bool(inst and inst["in_flight"])


def trainer_weights(step: int) -> dict[str, torch.Tensor]:
    return {n: t.to(torch.bfloat16 if i % 2 else torch.float32)
            for i, (n, t) in enumerate(build_model(100 + step, **MODEL).state_dict().items())}


async def test_box_registers_serves_takes_weights_and_leaves_nothing_on_sigterm(start_manager, tmp_path):
    sender_port = free_port()
    m = await start_manager(weight_sender_base_port=str(sender_port), allowed_sender_ips="127.0.0.0/8")
    sender = SenderAgent(["127.0.0.1"], sender_port).start()
    box = None
    try:
        assert (await m.put_senders([["127.0.0.1"]], 1, engines=1))[0] == 200
        port, agent_port = free_port(), free_port()
        endpoint = f"127.0.0.1:{port}"
        box = Proc(script_args(m.url, port, agent_port, "--token-delay-s", "0.02"), tmp_path / "box.log", env=QUIET)
        await until_active(m, endpoint, box)
        inst = await instance(m, endpoint)
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{agent_port}/info") as r:
            info = await r.json()
        assert inst["kind"] == "remote" and inst["weight_receiver_port"] == agent_port
        assert inst["mooncake_handshake_port"] == info["handshake_port"]  # Mooncake's own pick, reported

        # Generation through the manager reaches the box's engine.
        body = {"input_ids": [1, 2, 3], "sampling_params": {"temperature": 0, "max_new_tokens": 6}}
        status, out = await m.post("/generate", body)
        assert status == 200, out
        assert out["output_ids"] == reference_generate(build_model(0, **MODEL), [1, 2, 3], 6)[0]

        # A weight push lands in the engine through the agent the script started.
        weights = trainer_weights(1)
        await asyncio.to_thread(sender.stage, weights, 1)
        status, res = await m.post("/update_weight_version", {"wait_for_instances": "all", "timeout_s": 30})
        assert status == 200 and not res["timed_out"] and res["instances_at_version"] == 1, res
        async with aiohttp.ClientSession() as s, s.get(f"http://{endpoint}/debug/state_dict_checksum") as r:
            got = (await r.json())["tensors"]
        assert got == {n: tensor_checksum(t.to(torch.float32)) for n, t in weights.items()}

        # SIGTERM while a request is in flight: the manager drains the box first (the request finishes
        # there), then both children stop; deregistered, nothing left, exit 0.
        below = descendants(box.pid)
        assert len(below) >= 2
        groups = {os.getpgid(p) for p in below if alive(p)}
        long = {"input_ids": [1, 2, 3], "sampling_params": {"temperature": 0, "max_new_tokens": 40}}
        in_flight = asyncio.create_task(m.post("/generate", long))  # >= 40 x 20 ms on the box
        await async_wait_until(lambda: _in_flight(m, endpoint), timeout_s=5, interval_s=0.02,
                               message="request in flight")
        t0 = time.monotonic()
        box.signal(signal.SIGTERM)
        assert await asyncio.to_thread(box.wait, 20) == 0, box.log()
        assert time.monotonic() - t0 < 15
        status, out = await in_flight
        assert status == 200 and len(out["output_ids"]) == 40, out
        assert await instance(m, endpoint) is None
        assert not [p for p in below if alive(p)], box.log()
        assert all(group_empty(g) for g in groups | {box.pid})
        assert "deregistered 127.0.0.1:" in box.log()
    finally:
        sender.stop()
        if box:
            box.stop()


async def test_a_dying_child_deregisters_and_exits_3_and_a_stale_registration_is_replaced(start_manager, tmp_path):
    m = await start_manager()
    port, agent_port = free_port(), free_port()
    endpoint = f"127.0.0.1:{port}"
    # An earlier run of this box on the same address, never deregistered (the box was preempted).
    status, _ = await m.post("/register_rollout_instance", {"host": "127.0.0.1", "port": port})
    assert status == 200
    box = Proc(script_args(m.url, port, agent_port), tmp_path / "box.log", env=QUIET)
    try:
        await async_wait_until(lambda: "registered 127.0.0.1:" in box.log() or box.popen.poll() is not None,
                               timeout_s=40, interval_s=0.2, message="registration")
        assert "still registered from an earlier run; replacing it" in box.log(), box.log()
        await until_active(m, endpoint, box)
        below = descendants(box.pid)
        agent = [p for p in below if b"receiver_agent" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(agent) == 1
        os.kill(agent[0], signal.SIGKILL)
        assert await asyncio.to_thread(box.wait, 20) == 3, box.log()
        assert "receiver agent exited (status 137) while serving; shutting down" in box.log()
        assert await instance(m, endpoint) is None
        assert not [p for p in below if alive(p)]
    finally:
        box.stop()


async def test_box_registers_again_when_the_manager_restarts(start_manager, tmp_path):
    mport = free_port()
    m = await start_manager(port=mport)
    port, agent_port = free_port(), free_port()
    endpoint = f"127.0.0.1:{port}"
    args = script_args(m.url, port, agent_port)
    args[args.index("--"):args.index("--")] = ["--reregister-check-s", "0.3"]
    box = Proc(args, tmp_path / "box.log", env=QUIET)
    try:
        await until_active(m, endpoint, box)
        old_run = (await m.get("/health"))[1]["run_id"]
        m.proc.signal(signal.SIGKILL)  # no goodbye: the new manager starts with an empty registry
        await asyncio.to_thread(m.proc.wait, 10)
        await async_wait_until(lambda: "went away" in box.log(), timeout_s=10, interval_s=0.1,
                               message="the box to notice")
        m2 = await start_manager(port=mport)
        new_run = (await m2.get("/health"))[1]["run_id"]
        assert new_run != old_run
        await until_active(m2, endpoint, box, timeout=15)
        log = box.log()
        assert f"manager restarted (run id {old_run} -> {new_run}): registered again as {endpoint}" in log, log
        assert log.count("went away") == 1 and log.count("is back") == 1, log
        body = {"input_ids": [1, 2, 3], "sampling_params": {"temperature": 0, "max_new_tokens": 6}}
        status, out = await m2.post("/generate", body)
        assert status == 200 and out["output_ids"] == reference_generate(build_model(0, **MODEL), [1, 2, 3], 6)[0]

        # An admin's removal (same run id) is respected: the box does not come back by itself.
        status, _ = await m2.post("/shutdown_instances", {"endpoints": [endpoint], "check_weight_update": False})
        assert status == 200
        await async_wait_until(lambda: "is no longer registered" in box.log(), timeout_s=5, interval_s=0.1,
                               message="the removal to be noted")
        await asyncio.sleep(1)
        assert await instance(m2, endpoint) is None and box.popen.poll() is None
        assert box.log().count("registered again") == 1
    finally:
        box.stop()


async def test_killed_launcher_leaves_nothing_behind(start_manager, tmp_path):
    m = await start_manager()
    port, agent_port = free_port(), free_port()
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    box = Proc(script_args(m.url, port, agent_port), tmp_path / "box.log", env={**QUIET, "TMPDIR": str(tmpdir)})
    try:
        await until_active(m, f"127.0.0.1:{port}", box)
        below = descendants(box.pid)
        groups = {os.getpgid(p) for p in below if alive(p)}
        assert len(groups) >= 2  # each child leads its own group: a terminal's Ctrl-C reaches the launcher only
        os.kill(box.pid, signal.SIGKILL)  # no chance to clean up: the kernel's parent-death signal does it
        await asyncio.to_thread(box.wait, 10)  # reap it: a zombie launcher would keep its own group "non-empty"
        # (the manager watcher starts in the launcher's group before it moves to its own)
        await async_wait_until(lambda: not [p for p in below if alive(p)], timeout_s=15,
                               message="orphans to exit")
        await async_wait_until(lambda: all(group_empty(g) for g in groups), timeout_s=5, message="groups empty")
        assert list(tmpdir.iterdir()) == []  # issue 16 bug 7: no /tmp/launch_sglang.* left by a kill -9
    finally:
        box.stop()


async def test_sighup_deregisters_and_leaves_nothing_behind(start_manager, tmp_path):
    """A closed terminal (SIGHUP) cleans up like Ctrl-C: deregistered, both children stopped, exit 0.

    The signal comes right after the instance is active, while the manager watcher may still be starting
    (not yet in its own process group): issue 16 bug 1, where the launcher waited for it forever."""
    m = await start_manager()
    port, agent_port = free_port(), free_port()
    endpoint = f"127.0.0.1:{port}"
    # As from a terminal: SIGHUP at its default. Under nohup (SIGHUP ignored, and inherited) bash cannot trap
    # it, and the launcher rightly ignores it, as nohup asks.
    box = Proc([PY, "-c", HUP_DEFAULT, *script_args(m.url, port, agent_port)], tmp_path / "box.log", env=QUIET)
    try:
        await until_active(m, endpoint, box)
        below = descendants(box.pid)
        groups = {os.getpgid(p) for p in below if alive(p)}
        box.signal(signal.SIGHUP)
        assert await asyncio.to_thread(box.wait, 20) == 0, box.log()
        assert await instance(m, endpoint) is None
        assert "SIGHUP received" in box.log() and "deregistered 127.0.0.1:" in box.log()
        assert not [p for p in below if alive(p)], box.log()
        assert all(group_empty(g) for g in groups | {box.pid})
    finally:
        box.stop()


def one_line(proc: subprocess.CompletedProcess) -> str:
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("which", ["sglang", "agent"])
def test_port_clash_is_one_line_and_quick(which, tmp_path):
    port, agent_port = free_port(), free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port if which == "sglang" else agent_port))
        s.listen()
        t0 = time.monotonic()
        proc = run_quick(script_args("http://127.0.0.1:9", port, agent_port))
    assert proc.returncode == 1
    assert time.monotonic() - t0 < 5
    line = one_line(proc)
    busy = port if which == "sglang" else agent_port
    assert line.startswith("launch_sglang: error: port ") and f"{busy}" in line and "already in use" in line


def test_same_port_for_both_is_refused():
    port = free_port()
    proc = run_quick(script_args("http://127.0.0.1:9", port, port))
    assert proc.returncode == 1 and "must differ" in one_line(proc)


def test_unreachable_manager_is_one_line():
    dead = free_port()
    t0 = time.monotonic()
    proc = run_quick(script_args(f"127.0.0.1:{dead}", free_port(), free_port()))
    assert proc.returncode == 1 and time.monotonic() - t0 < 5
    line = one_line(proc)
    assert f"rollout manager at http://127.0.0.1:{dead} is unreachable" in line and "ROLLOUT_MANAGER_ADDR" in line


def test_help_and_usage_errors():
    proc = run_quick(["bash", SCRIPT, "--help"])
    assert proc.returncode == 0
    for word in ("ROLLOUT_MANAGER_ADDR", "ROLLOUT_MANAGER_AUTH_TOKEN", "ROLLOUT_MANAGER_ENGINE", "PYTHON",
                 "--transfer-agent-handshake-port", "handshake", "--enable-deterministic-inference", "--engine",
                 "--wait-for-manager"):
        assert word in proc.stdout
    assert "seed project" not in proc.stdout  # a name from this project's history means nothing to a user
    proc = run_quick(["bash", SCRIPT, "--manager-addr", "http://127.0.0.1:9"])  # sglang needs a model
    assert proc.returncode == 2 and "--model-path is required" in one_line(proc)
    proc = run_quick(["bash", SCRIPT, "--manager-addr", "http://127.0.0.1:9", "--engine", "cpu", "--vocab-size", "0"])
    assert proc.returncode == 2 and "--vocab-size must be a positive integer, got '0'" in one_line(proc)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_MANAGER_ADDR")}
    proc = subprocess.run(["bash", SCRIPT, "--engine", "cpu", "--python", PY], capture_output=True, text=True,
                          env=env, timeout=15)
    assert proc.returncode == 2 and "ROLLOUT_MANAGER_ADDR" in one_line(proc)


def test_dry_run_builds_the_sglang_command_line():
    proc = run_quick(["bash", SCRIPT, "--model-path", "/models/q", "--port", "30007", "--deterministic",
                      "--python", PY, "--dry-run", "--", "--tp-size", "2"],
                     env={"ROLLOUT_MANAGER_ADDR": "127.0.0.1:5000", "ROLLOUT_MANAGER_ENGINE": "sglang"})
    assert proc.returncode == 0, proc.stderr
    lines = dict(line.split(": ", 1) for line in proc.stdout.splitlines())
    assert lines["manager"] == "http://127.0.0.1:5000" and lines["host"] == "127.0.0.1"  # the route to it
    engine = lines["engine"].split()
    assert engine[1:] == ["-m", "sglang.launch_server", "--model-path", "/models/q", "--host", "127.0.0.1",
                          "--port", "30007", "--weight-version", "0", "--enable-metrics",
                          "--enable-deterministic-inference", "--incremental-streaming-output", "--tp-size", "2"]
    agent = lines["agent"].split()
    assert agent[agent.index("--port") + 1] == "31118"  # default: SGLang's port + 1111
    assert agent[agent.index("--sglang-url") + 1] == "http://127.0.0.1:30007"


@pytest.mark.parametrize("engine", ["sglang", "cpu"])
def test_dry_run_streams_incrementally_unless_told_not_to(engine):
    """Incremental chunks by default (each token relayed once), for both engines; the opt-out drops the flag."""
    base = ["bash", SCRIPT, "--engine", engine, "--model-path", "/models/q", "--python", PY, "--dry-run"]
    env = {"ROLLOUT_MANAGER_ADDR": "127.0.0.1:5000"}
    on = run_quick(base, env=env)
    off = run_quick([*base, "--no-incremental-streaming"], env=env)
    assert on.returncode == 0 and off.returncode == 0, (on.stderr, off.stderr)
    on_cmd = dict(line.split(": ", 1) for line in on.stdout.splitlines())["engine"].split()
    off_cmd = dict(line.split(": ", 1) for line in off.stdout.splitlines())["engine"].split()
    assert on_cmd.count("--incremental-streaming-output") == 1
    assert "--incremental-streaming-output" not in off_cmd
    assert "--no-incremental-streaming" not in off_cmd  # the launcher's own flag is not passed on
    assert "--no-incremental-streaming" in run_quick(["bash", SCRIPT, "--help"]).stdout


async def test_auth_token_is_sent_on_every_manager_call_and_refusal_is_one_line():
    seen: list[str | None] = []
    token_ok = "s3cret"

    async def handler(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization"))
        if request.headers.get("Authorization") != f"Bearer {token_ok}":
            return web.json_response({"error": "unauthorized"}, status=401)
        if request.path == "/health":
            return web.json_response({"status": "healthy", "version": "x", "weight_version": 0})
        if request.path == "/register_rollout_instance":
            body = await request.json()
            return web.json_response({"endpoint": f"{body['host']}:{body['port']}", "id": "i", "state": "pending"})
        return web.json_response({"removed": [(await request.json())["endpoints"][0]]})

    async def info(request: web.Request) -> web.Response:
        return web.json_response({"handshake_port": 15555})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    agent_app = web.Application()
    agent_app.router.add_get("/info", info)
    runners = [web.AppRunner(app), web.AppRunner(agent_app)]
    mport, aport = free_port(), free_port()
    for runner, port in zip(runners, (mport, aport)):
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async def box(*args: str, token: str) -> subprocess.CompletedProcess:
            env = {**os.environ, "ROLLOUT_MANAGER_AUTH_TOKEN": token, "PYTHONPATH": str(ROOT)}
            proc = await asyncio.create_subprocess_exec(PY, "-m", "rollout_manager.launch.box", *args, env=env,
                                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            out, err = await proc.communicate()
            return subprocess.CompletedProcess(args, proc.returncode, out.decode(), err.decode())

        manager = f"http://127.0.0.1:{mport}"
        p1, p2 = free_port(), free_port()
        ok = await box("preflight", "--manager", manager, "--bind", "127.0.0.1", "--port", str(p1),
                       "--agent-port", str(p2), token=token_ok)
        assert ok.returncode == 0, ok.stderr
        reg = await box("register", "--manager", manager, "--host", "127.0.0.1", "--port", str(p1),
                        "--agent-url", f"http://127.0.0.1:{aport}", "--agent-port", str(aport), token=token_ok)
        assert reg.returncode == 0 and json.loads(reg.stdout)["mooncake_handshake_port"] == 15555, reg.stderr
        dereg = await box("deregister", "--manager", manager, "--endpoint", f"127.0.0.1:{p1}", token=token_ok)
        assert dereg.returncode == 0, dereg.stderr
        assert seen == [f"Bearer {token_ok}"] * 3
        bad = await box("preflight", "--manager", manager, "--bind", "127.0.0.1", "--port", str(p1),
                        "--agent-port", str(p2), token="wrong")
        assert bad.returncode == 1
        line = one_line(bad)
        assert "HTTP 401" in line and "ROLLOUT_MANAGER_AUTH_TOKEN does not match" in line
    finally:
        for runner in runners:
            await runner.cleanup()


def test_wait_for_manager_gives_up_at_its_deadline():
    dead = free_port()
    args = script_args(f"127.0.0.1:{dead}", free_port(), free_port())
    args[args.index("--"):args.index("--")] = ["--wait-for-manager", "1.5"]
    t0 = time.monotonic()
    proc = run_quick(args)
    assert proc.returncode == 1 and 1.5 <= time.monotonic() - t0 < 8, proc.stderr
    waiting, failed = proc.stderr.strip().splitlines()
    assert waiting == f"launch_sglang: waiting up to 1.5s for the rollout manager at http://127.0.0.1:{dead} " \
                      "(--wait-for-manager)"
    assert "is unreachable" in failed and "(waited 1.5s: --wait-for-manager)" in failed


async def test_wait_for_manager_proceeds_once_the_manager_is_up(tmp_path):
    """Boxes and trainer start together: the box's preflight waits for a manager that comes up later."""
    mport = free_port()
    err = tmp_path / "preflight.err"
    with open(err, "wb") as f:
        proc = await asyncio.create_subprocess_exec(
            PY, "-m", "rollout_manager.launch.box", "preflight", "--manager", f"127.0.0.1:{mport}",
            "--bind", "127.0.0.1", "--port", str(free_port()), "--agent-port", str(free_port()),
            "--wait-for-manager", "30", stdout=subprocess.PIPE, stderr=f, env={**os.environ, "PYTHONPATH": str(ROOT)})
    runner = None
    try:
        await async_wait_until(lambda: "waiting up to 30s" in err.read_text(), timeout_s=15, interval_s=0.05,
                               message="the preflight to wait")
        assert proc.returncode is None

        async def health(request: web.Request) -> web.Response:
            return web.json_response({"status": "healthy", "version": "x", "weight_version": 0})

        app = web.Application()
        app.router.add_get("/health", health)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", mport).start()
        out, _ = await asyncio.wait_for(proc.communicate(), 15)
        assert proc.returncode == 0, err.read_text()
        assert json.loads(out)["manager"] == f"http://127.0.0.1:{mport}"
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        if runner:
            await runner.cleanup()
