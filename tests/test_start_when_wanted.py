"""``launch_sglang.sh --start-when-wanted`` (rollout_manager/launch/wanted.py): a launcher that waits, before it
loads anything, until the manager's scaling signal wants more boxes of its kind."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from support import PY, ROOT, Proc, async_wait_until, free_port

from rollout_manager.launch.wanted import verdict


def demand(*kinds: tuple[bool, float | None, int], waiting: int = 0) -> dict[str, Any]:
    return {"fleet_demand": {"waiting_sequences": waiting, "kinds": [
        {"kind": f"k{i}", "preemptible": p, "price_per_hour": price, "boxes": 1, "wanted": 1 + more, "more": more}
        for i, (p, price, more) in enumerate(kinds)]}}


def test_a_box_starts_when_more_of_its_kind_are_wanted():
    spot, on_demand = (True, 1.1), (False, 3.0)
    assert verdict(demand((*spot, 2), (*on_demand, 0)), *spot).start
    assert not verdict(demand((*spot, 0), (*on_demand, 2)), *spot).start  # others are wanted, not this kind
    assert verdict(demand((True, 1.2, 2)), *spot).start  # a price it has not seen: the fleet wants boxes
    assert verdict(demand((True, None, 0), (False, None, 1)), True, 1.1).start  # unseen kind, fleet wants one
    assert not verdict(demand((True, 1.1, 0)), True, 1.1).start
    assert verdict({"fleet_demand": {"kinds": [], "waiting_sequences": 5}}, False, None).start  # no box at all
    assert not verdict({"fleet_demand": {"kinds": [], "waiting_sequences": 0}}, False, None).start
    assert verdict({"instances": []}, False, None).start  # a manager without the signal: start as before


@dataclass
class FakeManager:
    wanted: int = 0
    status_reads: int = 0
    registrations: list[dict[str, Any]] = field(default_factory=list)

    def app(self) -> web.Application:
        async def health(request: web.Request) -> web.Response:
            return web.json_response({"status": "healthy", "version": "x", "weight_version": 0, "run_id": "r"})

        async def status(request: web.Request) -> web.Response:
            self.status_reads += 1
            doc = demand((True, 0.7, self.wanted))
            doc["instances"] = []
            return web.json_response(doc)

        async def register(request: web.Request) -> web.Response:
            body = await request.json()
            self.registrations.append(body)
            return web.json_response({"endpoint": f"{body['host']}:{body['port']}", "id": "i", "state": "pending"})

        async def shutdown(request: web.Request) -> web.Response:
            body = await request.json()
            return web.json_response({"removed": body["endpoints"], "not_found": [], "skipped": []})

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_get("/get_instances_status", status)
        app.router.add_post("/register_rollout_instance", register)
        app.router.add_post("/shutdown_instances", shutdown)
        return app


@pytest.mark.slow
async def test_launcher_waits_until_a_box_of_its_kind_is_wanted(tmp_path):
    fake = FakeManager()
    runner = web.AppRunner(fake.app())
    await runner.setup()
    mport = free_port()
    await web.TCPSite(runner, "127.0.0.1", mport).start()
    port, agent_port = free_port(), free_port()
    args = ["bash", str(ROOT / "scripts" / "launch_sglang.sh"), "--engine", "cpu", "--manager-addr",
            f"http://127.0.0.1:{mport}", "--host", "127.0.0.1", "--port", str(port),
            "--transfer-agent-handshake-port", str(agent_port), "--python", PY, "--ready-timeout-s", "60",
            "--stop-timeout-s", "5", "--reregister-check-s", "0.1", "--preemption-notice", "off",
            "--preemptible", "true", "--price-per-hour", "0.7", "--start-when-wanted",
            "--", "--seed", "0", "--model-config", json.dumps({"hidden_size": 64, "intermediate_size": 128,
                                                                "num_hidden_layers": 1})]
    box = Proc(args, tmp_path / "box.log", env={"MC_LOG_LEVEL": "ERROR", "GLOG_minloglevel": "2"})
    try:
        await async_wait_until(lambda: fake.status_reads >= 5, 30, message="the launcher reading the signal")
        assert box.popen.poll() is None, box.log()
        assert "not starting yet: the manager wants 0 more box(es)" in box.log()
        assert "started CPU engine" not in box.log()  # nothing loaded while it is not wanted
        fake.wanted = 1
        await async_wait_until(lambda: fake.registrations or box.popen.poll() is not None, 60, interval_s=0.1,
                               message="the box to start and register")
        assert fake.registrations and fake.registrations[0]["price_per_hour"] == 0.7, box.log()
        assert "the manager wants 1 more box(es) of kind k0: starting" in box.log()
    finally:
        box.stop()
        await runner.cleanup()
