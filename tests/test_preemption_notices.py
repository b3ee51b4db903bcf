"""Preemption notices on the box side (rollout_manager/launch/notices.py, notice_watch.py and
scripts/launch_sglang.sh): loopback fakes of the AWS, GCE and Azure metadata services that start with
no notice and then post one, a fake manager that records what the box reports, and real SIGTERM to the
launcher running the CPU engine. Nothing here talks to a link-local address: every metadata URL is a
127.0.0.1 fake (or a closed loopback port)."""

from __future__ import annotations

import asyncio
import email.utils
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from support import PY, ROOT, Proc, alive, async_wait_until, descendants, free_port

from rollout_manager.cpu_engine.model import build_model, reference_generate
from rollout_manager.launch.notice_watch import ManagerReporter, watch
from rollout_manager.launch.notices import AwsSpot, AzureScheduledEvents, GceMetadata, Provider

BOX_TOKEN = "box-secret"
ENDPOINT = "127.0.0.1:30000"


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


# ---------------------------------------------------------------- fakes of the metadata services


@dataclass
class FakeAws:
    """IMDSv2: a token from PUT /latest/api/token is required on every GET (401 without it)."""

    action: dict[str, str] | None = None
    polls: int = 0
    token: str = "imds-token"

    def app(self) -> web.Application:
        async def token(request: web.Request) -> web.Response:
            if not request.headers.get("X-aws-ec2-metadata-token-ttl-seconds", "").isdigit():
                return web.Response(status=400)
            return web.Response(text=self.token)

        def authorised(request: web.Request) -> bool:
            return request.headers.get("X-aws-ec2-metadata-token") == self.token

        async def instance_action(request: web.Request) -> web.Response:
            if not authorised(request):
                return web.Response(status=401)
            self.polls += 1
            if self.action is None:
                return web.Response(status=404, text="Not Found")
            return web.Response(text=json.dumps(self.action))

        async def life_cycle(request: web.Request) -> web.Response:
            return web.Response(text="spot") if authorised(request) else web.Response(status=401)

        app = web.Application()
        app.router.add_put("/latest/api/token", token)
        app.router.add_get("/latest/meta-data/spot/instance-action", instance_action)
        app.router.add_get("/latest/meta-data/instance-life-cycle", life_cycle)
        return app


@dataclass
class FakeGce:
    """``instance/preempted`` with ``wait_for_change`` and ``last_etag``: a hanging GET returns when the
    value changes (or at ``timeout_sec``)."""

    value: str = "FALSE"
    etag: int = 1
    polls: int = 0
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    preemptible: str = "TRUE"  # instance/scheduling/preemptible
    provisioning: str | None = None  # instance/scheduling/provisioning-model (None: 404, an older server)

    def set(self, value: str) -> None:
        self.value, self.etag = value, self.etag + 1
        self.changed.set()
        self.changed = asyncio.Event()

    def app(self) -> web.Application:
        def answer(text: str) -> web.Response:
            return web.Response(text=text, headers={"Metadata-Flavor": "Google", "ETag": str(self.etag)})

        async def preempted(request: web.Request) -> web.Response:
            if request.headers.get("Metadata-Flavor") != "Google":
                return web.Response(status=403)
            self.polls += 1
            q = request.query
            if q.get("wait_for_change") == "true" and q.get("last_etag") == str(self.etag):
                try:
                    await asyncio.wait_for(self.changed.wait(), float(q.get("timeout_sec", "60")))
                except asyncio.TimeoutError:
                    pass
            return answer(self.value)

        def plain(text: str) -> Callable[[web.Request], Awaitable[web.Response]]:
            async def handler(request: web.Request) -> web.Response:
                return answer(text) if request.headers.get("Metadata-Flavor") == "Google" else web.Response(status=403)
            return handler

        app = web.Application()
        app.router.add_get("/computeMetadata/v1/instance/preempted", preempted)
        app.router.add_get("/computeMetadata/v1/instance/id", plain("4520031799277581759"))
        app.router.add_get("/computeMetadata/v1/instance/scheduling/preemptible", plain(self.preemptible))
        if self.provisioning is not None:
            app.router.add_get("/computeMetadata/v1/instance/scheduling/provisioning-model", plain(self.provisioning))
        return app


@dataclass
class FakeAzure:
    """Scheduled Events (``Metadata: true`` required, else 400) and the instance's compute metadata."""

    events: list[dict[str, Any]] = field(default_factory=list)
    incarnation: int = 1
    polls: int = 0
    vm_name: str = "rollout-box-7"

    def post(self, events: list[dict[str, Any]]) -> None:
        self.events, self.incarnation = events, self.incarnation + 1

    def app(self) -> web.Application:
        async def scheduled(request: web.Request) -> web.Response:
            if request.headers.get("Metadata") != "true" or request.query.get("api-version") != "2020-07-01":
                return web.json_response({"error": "Bad request"}, status=400)
            self.polls += 1
            return web.json_response({"DocumentIncarnation": self.incarnation, "Events": self.events})

        async def compute(request: web.Request) -> web.Response:
            if request.headers.get("Metadata") != "true" or "api-version" not in request.query:
                return web.json_response({"error": "Bad request"}, status=400)
            return web.json_response({"name": self.vm_name, "priority": "Spot", "evictionPolicy": "Delete",
                                      "azEnvironment": "AzurePublicCloud"})

        app = web.Application()
        app.router.add_get("/metadata/scheduledevents", scheduled)
        app.router.add_get("/metadata/instance/compute", compute)
        return app


def azure_event(kind: str, not_before: float | None, resources: list[str], event_id: str = "E-1") -> dict[str, Any]:
    return {"EventId": event_id, "EventType": kind, "ResourceType": "VirtualMachine", "Resources": resources,
            "EventStatus": "Scheduled" if not_before else "Started",
            "NotBefore": email.utils.formatdate(not_before, usegmt=True) if not_before else "",
            "Description": "", "EventSource": "Platform", "DurationInSeconds": -1}


# ---------------------------------------------------------------- a fake manager


@dataclass
class FakeManager:
    """Records what a box reports; lists registered boxes until the test removes them."""

    evacuations: list[dict[str, Any]] = field(default_factory=list)
    cancels: list[dict[str, Any]] = field(default_factory=list)
    registrations: list[dict[str, Any]] = field(default_factory=list)
    auth: list[str | None] = field(default_factory=list)
    states: dict[str, str] = field(default_factory=dict)
    fail_next: int = 0  # answer this many /evacuate_instance calls with 503 first
    refuse: bool = False  # answer /evacuate_instance with 400

    def app(self) -> web.Application:
        async def health(request: web.Request) -> web.Response:
            return web.json_response({"status": "healthy", "version": "x", "weight_version": 0, "run_id": "run-1"})

        async def register(request: web.Request) -> web.Response:
            body = await request.json()
            self.registrations.append(body)
            endpoint = f"{body['host']}:{body['port']}"
            self.states[endpoint] = "active"
            return web.json_response({"endpoint": endpoint, "id": "i-1", "state": "pending", "box_token": BOX_TOKEN})

        async def evacuate(request: web.Request) -> web.Response:
            self.auth.append(request.headers.get("Authorization"))
            if self.fail_next > 0:
                self.fail_next -= 1
                return web.json_response({"error": "busy"}, status=503)
            if self.refuse:
                self.evacuations.append({"refused": True})
                return web.json_response({"error": "deadline_s: must be above 0"}, status=400)
            body = await request.json()
            body["received_at"] = time.time()
            self.evacuations.append(body)
            self.states[body["endpoint"]] = "evacuating"
            return web.json_response({"endpoint": body["endpoint"], "state": "evacuating",
                                      "deadline_s": body["deadline_s"], "staying": 0, "moving": 0})

        async def cancel(request: web.Request) -> web.Response:
            body = await request.json()
            self.cancels.append(body)
            if self.states.get(body["endpoint"]) != "evacuating":
                return web.json_response({"error": "not evacuating"}, status=409)
            self.states[body["endpoint"]] = "active"
            return web.json_response({"endpoint": body["endpoint"], "state": "active"})

        async def status(request: web.Request) -> web.Response:
            return web.json_response({"instances": [{"endpoint": e, "state": s} for e, s in self.states.items()]})

        async def shutdown(request: web.Request) -> web.Response:
            body = await request.json()
            for e in body["endpoints"]:
                self.states.pop(e, None)
            return web.json_response({"removed": body["endpoints"], "not_found": [], "skipped": []})

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_post("/register_rollout_instance", register)
        app.router.add_post("/evacuate_instance", evacuate)
        app.router.add_post("/cancel_evacuation", cancel)
        app.router.add_get("/get_instances_status", status)
        app.router.add_post("/shutdown_instances", shutdown)
        return app


@pytest.fixture
async def manager() -> AsyncIterator[tuple[FakeManager, str]]:
    fake = FakeManager()
    runner, url = await serve(fake.app())
    yield fake, url
    await runner.cleanup()


def state_file(tmp_path: Path) -> str:
    path = tmp_path / "state.json"
    path.write_text(json.dumps({"body": {}, "endpoint": ENDPOINT, "run_id": "run-1", "box_token": BOX_TOKEN}))
    return str(path)


class Watching:
    """``watch`` in a thread against ``provider`` and the fake manager, stopped at the end."""

    def __init__(self, provider: Provider, manager_url: str, tmp_path: Path,
                 release: Callable[[], None] | None = None, **kw: Any) -> None:
        self.stop = threading.Event()
        self.release = release  # ends a request the watcher may be waiting in
        self.lines: list[str] = []
        reporter = ManagerReporter(manager_url, ENDPOINT, state_file(tmp_path))
        self.thread = threading.Thread(target=watch, args=(provider, reporter, self.stop),
                                       kwargs={"log": self.lines.append, **kw}, daemon=True)

    async def __aenter__(self) -> Watching:
        self.thread.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.stop.set()
        if self.release:
            self.release()
        await asyncio.to_thread(self.thread.join, 10)
        assert not self.thread.is_alive()


async def until(predicate: Callable[[], Any], what: str, timeout: float = 10) -> None:
    await async_wait_until(predicate, timeout, interval_s=0.02, message=what)


# ---------------------------------------------------------------- each provider


async def test_aws_spot_notice_is_reported_with_the_seconds_left_and_withdrawn_as_a_cancel(manager, tmp_path):
    fake_manager, manager_url = manager
    aws = FakeAws()
    runner, url = await serve(aws.app())
    try:
        async with Watching(AwsSpot(url, poll_interval_s=0.05), manager_url, tmp_path):
            await until(lambda: aws.polls >= 3, "three polls of instance-action")
            assert fake_manager.evacuations == []  # 404: no notice, nothing reported
            goes_at = time.time() + 120
            aws.action = {"action": "terminate", "time": iso(goes_at)}
            await until(lambda: fake_manager.evacuations, "the notice reported")
            got = fake_manager.evacuations[0]
            assert got["endpoint"] == ENDPOINT and got["source"] == "aws"
            assert abs(got["deadline_s"] - (goes_at - got["received_at"])) < 2.0, got  # AWS's time is to the second
            assert "terminate" in got["detail"]
            assert fake_manager.auth[0] == f"Bearer {BOX_TOKEN}"  # the box's own token
            polls = aws.polls
            await until(lambda: aws.polls >= polls + 3, "three more polls")
            assert len(fake_manager.evacuations) == 1  # the same notice is not reported again

            # The deadline moved earlier: reported again; then the item is gone: cancelled.
            aws.action = {"action": "stop", "time": iso(goes_at - 60)}
            await until(lambda: len(fake_manager.evacuations) == 2, "the earlier deadline reported")
            assert abs(fake_manager.evacuations[1]["deadline_s"] - 60) < 3.0
            aws.action = None
            await until(lambda: fake_manager.cancels == [{"endpoint": ENDPOINT}], "the cancel")
            assert fake_manager.states[ENDPOINT] == "active"
    finally:
        await runner.cleanup()


async def test_gce_preempted_is_waited_on_and_reported_at_once_with_30s(manager, tmp_path):
    fake_manager, manager_url = manager
    gce = FakeGce()
    runner, url = await serve(gce.app())
    try:
        # One hanging request lasts up to 30 s: a notice reported within 5 s came through wait_for_change.
        async with Watching(GceMetadata(url, wait_s=30), manager_url, tmp_path, release=lambda: gce.set("FALSE")):
            await until(lambda: gce.polls >= 2, "the watcher waiting on instance/preempted")
            assert fake_manager.evacuations == []
            flipped = time.time()
            gce.set("TRUE")
            await until(lambda: fake_manager.evacuations, "the notice reported", timeout=5)
            got = fake_manager.evacuations[0]
            assert got["source"] == "gce" and got["received_at"] - flipped < 5
            assert abs(got["deadline_s"] - 30) < 2.0, got
            gce.set("FALSE")
            await until(lambda: fake_manager.cancels, "the cancel", timeout=5)
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("preemptible, provisioning, spot", [
    ("TRUE", None, True), ("FALSE", "SPOT", True), ("FALSE", "STANDARD", False), ("FALSE", None, False)])
async def test_gce_spot_is_read_from_preemptible_or_the_provisioning_model(preemptible, provisioning, spot) -> None:
    """A preemptible VM says so in scheduling/preemptible, a Spot VM in scheduling/provisioning-model."""
    runner, url = await serve(FakeGce(preemptible=preemptible, provisioning=provisioning).app())
    try:
        assert await asyncio.to_thread(GceMetadata(url).preemptible) is spot
    finally:
        await runner.cleanup()


async def test_azure_preempt_event_for_this_vm_is_reported_others_are_not(manager, tmp_path):
    fake_manager, manager_url = manager
    azure = FakeAzure()
    runner, url = await serve(azure.app())
    try:
        async with Watching(AzureScheduledEvents(url, poll_interval_s=0.05), manager_url, tmp_path):
            await until(lambda: azure.polls >= 2, "polls of scheduledevents")
            goes_at = time.time() + 45
            # A freeze of this VM and a preemption of another one: nothing to report.
            azure.post([azure_event("Freeze", goes_at, [azure.vm_name], "E-0"),
                        azure_event("Preempt", goes_at, ["other-vm"], "E-9")])
            polls = azure.polls
            await until(lambda: azure.polls >= polls + 3, "three polls of the new document")
            assert fake_manager.evacuations == []
            azure.post([azure_event("Preempt", goes_at, [azure.vm_name], "E-1")])
            await until(lambda: fake_manager.evacuations, "the notice reported")
            got = fake_manager.evacuations[0]
            assert got["source"] == "azure" and "Preempt" in got["detail"]
            assert abs(got["deadline_s"] - (goes_at - got["received_at"])) < 2.0, got  # NotBefore is to the second
            azure.post([])  # Azure withdrew it
            await until(lambda: fake_manager.cancels, "the cancel")
    finally:
        await runner.cleanup()


async def test_outlived_notice_is_cancelled_once_and_a_busy_manager_is_asked_again(manager, tmp_path):
    fake_manager, manager_url = manager
    fake_manager.fail_next = 2  # 503 twice: the report is retried at the next polls
    aws = FakeAws(action={"action": "terminate", "time": iso(time.time() + 2)})
    runner, url = await serve(aws.app())
    try:
        async with Watching(AwsSpot(url, poll_interval_s=0.05), manager_url, tmp_path, outlive_s=0.5) as w:
            await until(lambda: fake_manager.evacuations, "the notice reported after two 503s")
            assert len(fake_manager.auth) == 3
            # Alive 0.5 s past the deadline with the notice still there: taken back, and not reported again.
            await until(lambda: fake_manager.cancels, "the cancel", timeout=10)
            polls = aws.polls
            await until(lambda: aws.polls >= polls + 5, "more polls")
            assert len(fake_manager.evacuations) == 1 and len(fake_manager.cancels) == 1
            assert any("outlived" in line for line in w.lines), w.lines
    finally:
        await runner.cleanup()


async def test_a_refused_notice_is_said_once_not_sent_again_and_not_cancelled(manager, tmp_path):
    fake_manager, manager_url = manager
    fake_manager.refuse = True
    aws = FakeAws(action={"action": "terminate", "time": iso(time.time() + 120)})
    runner, url = await serve(aws.app())
    try:
        async with Watching(AwsSpot(url, poll_interval_s=0.05), manager_url, tmp_path) as w:
            await until(lambda: fake_manager.evacuations, "the notice sent")
            polls = aws.polls
            await until(lambda: aws.polls >= polls + 3, "three more polls")
            aws.action = None
            polls = aws.polls
            await until(lambda: aws.polls >= polls + 3, "three polls without the notice")
            assert fake_manager.evacuations == [{"refused": True}] and fake_manager.cancels == []
            assert [line for line in w.lines if "refused" in line and "deadline_s" in line], w.lines
    finally:
        await runner.cleanup()


# ---------------------------------------------------------------- auto detection (the CLI)


def notice_detect(*args: str) -> dict[str, Any]:
    out = subprocess.run([PY, "-m", "rollout_manager.launch.box", "notice-detect", *args], capture_output=True,
                         text=True, timeout=30, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize("cloud", ["aws", "gce", "azure"])
async def test_auto_picks_the_metadata_service_that_answers(cloud):
    fakes = {"aws": FakeAws(), "gce": FakeGce(), "azure": FakeAzure()}
    runner, url = await serve(fakes[cloud].app())
    try:
        closed = f"http://127.0.0.1:{free_port()}"  # nothing listens: refused at once
        urls = {name: (url if name == cloud else closed) for name in fakes}
        args = ["--mode", "auto", "--aws-url", urls["aws"], "--gce-url", urls["gce"], "--azure-url", urls["azure"]]
        got = await asyncio.to_thread(notice_detect, *args)
        assert got == {"provider": cloud, "answered": True, "preemptible": True}
    finally:
        await runner.cleanup()


def test_auto_finds_nothing_where_nothing_answers():
    closed = f"http://127.0.0.1:{free_port()}"
    got = notice_detect("--mode", "auto", "--aws-url", closed, "--gce-url", closed, "--azure-url", closed)
    assert got == {"provider": None, "answered": False, "preemptible": None}
    # Named by hand, a quiet service is still the one to watch.
    got = notice_detect("--mode", "gce", "--gce-url", closed)
    assert got == {"provider": "gce", "answered": False, "preemptible": None}


# ---------------------------------------------------------------- the launcher, with the CPU engine

SCRIPT = str(ROOT / "scripts" / "launch_sglang.sh")
MODEL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1}
QUIET = {"MC_LOG_LEVEL": "ERROR", "GLOG_minloglevel": "2"}


@pytest.mark.slow
async def test_launcher_reports_aws_notice_then_sigterm_with_its_grace_and_serves_until_removed(manager, tmp_path):
    fake_manager, manager_url = manager
    aws = FakeAws()
    runner, aws_url = await serve(aws.app())
    closed = f"http://127.0.0.1:{free_port()}"
    port, agent_port = free_port(), free_port()
    endpoint = f"127.0.0.1:{port}"
    args = ["bash", SCRIPT, "--engine", "cpu", "--manager-addr", manager_url, "--host", "127.0.0.1",
            "--port", str(port), "--transfer-agent-handshake-port", str(agent_port), "--python", PY,
            "--ready-timeout-s", "60", "--stop-timeout-s", "5", "--reregister-check-s", "0.5",
            "--preemption-notice", "auto", "--sigterm-grace-s", "20", "--price-per-hour", "1.25",
            "--aws-metadata-url", aws_url, "--gce-metadata-url", closed, "--azure-metadata-url", closed,
            "--", "--seed", "0", "--model-config", json.dumps(MODEL), "--token-delay-s", "0.01"]
    box = Proc(args, tmp_path / "box.log", env=QUIET)
    try:
        await async_wait_until(lambda: fake_manager.registrations or box.popen.poll() is not None, 60,
                               interval_s=0.1, message="the box to register")
        assert box.popen.poll() is None, box.log()
        reg = fake_manager.registrations[0]
        assert reg["preemptible"] is True and reg["price_per_hour"] == 1.25, reg  # auto: AWS says spot
        assert "preemption notices: aws metadata service" in box.log()

        # The cloud's notice, through the watcher the launcher started beside the engine.
        await async_wait_until(lambda: aws.polls >= 1, 20, message="the notice watcher polling")
        goes_at = time.time() + 120
        aws.action = {"action": "terminate", "time": iso(goes_at)}
        await async_wait_until(lambda: fake_manager.evacuations, 20, message="the AWS notice reported")
        assert fake_manager.evacuations[0]["source"] == "aws"
        assert fake_manager.auth[0] == f"Bearer {BOX_TOKEN}"

        # SIGTERM: reported with the grace period, and the engine keeps serving until the box is removed.
        below = descendants(box.pid)
        signalled = time.time()
        box.signal(signal.SIGTERM)
        await async_wait_until(lambda: len(fake_manager.evacuations) == 2, 20, message="the SIGTERM notice")
        got = fake_manager.evacuations[1]
        assert got["source"] == "sigterm" and got["endpoint"] == endpoint
        assert 17 <= got["deadline_s"] <= 20 and abs(got["deadline_s"] - (20 - (got["received_at"] - signalled))) < 2
        body = {"input_ids": [1, 2, 3], "sampling_params": {"temperature": 0, "max_new_tokens": 8}}
        async with aiohttp.ClientSession() as s, s.post(f"http://{endpoint}/generate", json=body) as r:
            assert r.status == 200 and len((await r.json())["output_ids"]) == 8
        assert box.popen.poll() is None, box.log()  # the launcher waits for the manager

        fake_manager.states[endpoint] = "dead"  # the manager removed it
        removed_at = time.monotonic()
        assert await asyncio.to_thread(box.wait, 15) == 0, box.log()
        assert time.monotonic() - removed_at < 10  # well before the grace ran out
        assert not [p for p in below if alive(p)], box.log()
        assert "the manager has removed" in box.log()
        assert len(fake_manager.registrations) == 1  # nothing registered it again
    finally:
        box.stop()
        await runner.cleanup()



@pytest.mark.slow
async def test_sigterm_evacuates_the_box_through_the_real_manager_and_its_sequences_finish_elsewhere(
        start_manager, tmp_path):
    """Launcher + CPU engine + the real manager, with auth on, and a second box: SIGTERM reaches the manager
    as a notice (the box's own token authorises it); the manager shows the box evacuating, its sequences
    continue on the other box and every one equals the uninterrupted greedy run; the box is removed once they
    have left (at the latest at the deadline) and the launcher then stops everything and exits 0."""
    token = "s3cret"
    m = await start_manager(auth_token=token)
    grace = 8
    env = {**QUIET, "ROLLOUT_MANAGER_AUTH_TOKEN": token}

    def launcher(port: int, *flags: str) -> Proc:
        args = ["bash", SCRIPT, "--engine", "cpu", "--manager-addr", m.url, "--host", "127.0.0.1",
                "--port", str(port), "--transfer-agent-handshake-port", str(free_port()), "--python", PY,
                "--ready-timeout-s", "60", "--stop-timeout-s", "5", *flags,
                "--", "--seed", "0", "--model-config", json.dumps(MODEL), "--token-delay-s", "0.02"]
        return Proc(args, tmp_path / f"box-{port}.log", env=env)

    port, other_port = free_port(), free_port()
    endpoint = f"127.0.0.1:{port}"
    box = launcher(port, "--preemption-notice", "sigterm", "--sigterm-grace-s", str(grace),
                   "--preemptible", "true", "--price-per-hour", "0.9")
    other = launcher(other_port, "--preemption-notice", "off")

    async def instance(ep: str = endpoint) -> dict[str, Any] | None:
        return next((i for i in (await m.status())["instances"] if i["endpoint"] == ep), None)

    try:
        async def both_active() -> bool:
            assert box.popen.poll() is None and other.popen.poll() is None, box.log() + other.log()
            a, b = await instance(), await instance(f"127.0.0.1:{other_port}")
            return bool(a and b and a["state"] == b["state"] == "active")

        await async_wait_until(both_active, 90, interval_s=0.2, message="both boxes active")
        inst = await instance()
        assert inst and inst["preemptible"] is True and inst["price_per_hour"] == 0.9, inst
        below = descendants(box.pid)

        # Long greedy sequences (300 tokens, about 6 s each) on both boxes; SIGTERM while some run on this one.
        prompts = [[1 + i, 2, 3] for i in range(6)]
        bodies = [{"input_ids": p, "sampling_params": {"temperature": 0, "max_new_tokens": 300}} for p in prompts]
        runs = [asyncio.create_task(m.post("/generate", b)) for b in bodies]

        async def busy() -> bool:
            inst = await instance()
            return bool(inst and inst["in_flight"])

        await async_wait_until(busy, 20, interval_s=0.02, message="sequences running on the box")
        box.signal(signal.SIGTERM)
        seen: list[dict[str, Any]] = []

        async def evacuating() -> bool:
            inst = await instance()
            if inst and inst["state"] == "evacuating":
                seen.append(inst)
            return bool(seen)

        await async_wait_until(evacuating, 10, interval_s=0.05, message=f"{endpoint} evacuating")
        evacuation = seen[0]["evacuation"]
        assert evacuation["source"] == "sigterm" and 0 < evacuation["deadline_in_s"] <= grace, evacuation
        assert box.popen.poll() is None  # still serving while the manager moves its work

        model = build_model(0, **MODEL)
        moved = 0
        for prompt, run in zip(prompts, runs):
            status, out = await run
            assert status == 200, out
            assert out["output_ids"] == reference_generate(model, prompt, 300)[0]  # exact, across the move
            where = [seg["instance"] for seg in out["meta_info"]["segments"]]
            moved += len(where) > 1
        assert moved, "no sequence moved off the box"

        async def removed() -> bool:
            inst = await instance()
            return inst is None or inst["state"] == "dead"

        await async_wait_until(removed, grace + 10, interval_s=0.1, message=f"{endpoint} removed")
        assert await asyncio.to_thread(box.wait, 15) == 0, box.log()
        assert not [p for p in below if alive(p)], box.log()
        # Removed once nothing is left on it, at the latest at the deadline, which is when the grace ends: either
        # line may come first.
        assert "the manager has removed" in box.log() or f"grace period of {grace}s spent" in box.log()
    finally:
        box.stop()
        other.stop()


@pytest.mark.slow
async def test_an_idle_box_sigtermed_goes_at_once_not_after_its_grace(start_manager, tmp_path):
    """Launcher + CPU engine + the real manager: SIGTERM to a box with nothing running. A SIGTERM notice is never
    withdrawn, so the manager removes the emptied box at once and its launcher stops everything and exits 0
    well before its 120 s grace (it used to serve, idle, until the grace was spent)."""
    m = await start_manager()
    grace = 120
    port = free_port()
    endpoint = f"127.0.0.1:{port}"
    box = Proc(["bash", SCRIPT, "--engine", "cpu", "--manager-addr", m.url, "--host", "127.0.0.1",
                "--port", str(port), "--transfer-agent-handshake-port", str(free_port()), "--python", PY,
                "--ready-timeout-s", "60", "--stop-timeout-s", "5", "--preemption-notice", "sigterm",
                "--sigterm-grace-s", str(grace), "--", "--seed", "0", "--model-config", json.dumps(MODEL)],
               tmp_path / "box.log", env=QUIET)
    try:
        async def active() -> bool:
            assert box.popen.poll() is None, box.log()
            return await m.state_of(endpoint) == "active"

        await async_wait_until(active, 90, interval_s=0.2, message="the box active")
        below = descendants(box.pid)
        signalled = time.monotonic()
        box.signal(signal.SIGTERM)
        assert await asyncio.to_thread(box.wait, 30) == 0, box.log()  # not after its grace
        print(f"\nidle box: launcher exited {time.monotonic() - signalled:.1f}s after SIGTERM (grace {grace}s)")
        assert not [p for p in below if alive(p)], box.log()
        assert "the manager has removed" in box.log() and "grace period" not in box.log(), box.log()
        assert await m.state_of(endpoint) is None
        gone = [e for e in (await m.status())["recent_events"] if e["endpoint"] == endpoint and e["to"] == "dead"]
        assert gone and gone[-1]["reason"].startswith("evacuated: sigterm notice, nothing left on it"), gone
    finally:
        box.stop()
