from __future__ import annotations

import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from real_sglang import real_sglang, real_sglang_model  # noqa: F401  (fixtures for the real_sglang tests)
from support import PY, STARTED, OnLoopback, Proc, async_wait_until, free_port, wait_http_ok, wait_http_ok_sync

from rollout_manager.api.routes import create_app
from rollout_manager.config import Config
from rollout_manager.manager import Manager

# The launcher's default (--preemption-notice auto) asks the clouds' link-local metadata services; tests
# never do (tests/test_preemption_notices.py points it at loopback fakes), and SIGTERM stays a drain.
os.environ.setdefault("ROLLOUT_PREEMPTION_NOTICE", "off")

# Fast health settings for tests; production defaults are minutes.
FAST = {
    "pending_poll_interval_s": "0.1",
    "health_check_interval_s": "0.2",
    "health_check_timeout_s": "2",
    "health_failure_threshold": "2",
}

LOG_TAIL_CHARS = 4000
LOGGED_PROCS = 6  # the last ones started: a thousand-engine test would drown the report


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    STARTED.clear()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    """A failed test's report ends with the logs of the daemons it started: a flake on CI is then
    diagnosable from CI's output alone."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and report.when in ("setup", "call"):
        for proc in STARTED[-LOGGED_PROCS:]:
            name = " ".join(a for a in proc.args[1:4] if a != "-m")
            report.sections.append((f"log of {name} ({proc.log_path.name}), last {LOG_TAIL_CHARS} chars",
                                    proc.tail(LOG_TAIL_CHARS)))


@dataclass
class ManagerHandle:
    proc: Proc
    url: str
    session: aiohttp.ClientSession
    token: str = ""  # sent as a bearer token when the manager was started with auth_token

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    async def get(self, path: str) -> tuple[int, Any]:
        async with self.session.get(self.url + path, headers=self.headers) as r:
            return r.status, await r.json()

    async def post(self, path: str, body: Any = None, *, data: bytes | None = None,
                   method: str = "POST", headers: dict[str, str] | None = None) -> tuple[int, Any]:
        kwargs = {"data": data} if data is not None else {"json": body}
        async with self.session.request(method, self.url + path, headers=self.headers if headers is None
                                        else headers, **kwargs) as r:
            return r.status, await r.json(content_type=None)

    async def put_senders(self, ips: list[list[str]], groups: int | None,
                          engines: int | None = None) -> tuple[int, Any]:
        body: dict[str, Any] = {"weight_sender_ips": ips}
        if groups is not None:
            body["num_mooncake_groups_per_sender"] = groups
        if engines is not None:
            body["num_mooncake_engines_per_group"] = engines
        return await self.post("/update_weight_senders", body, method="PUT")

    async def status(self) -> dict[str, Any]:
        return (await self.get("/get_instances_status"))[1]

    async def state_of(self, endpoint: str) -> str | None:
        for inst in (await self.status())["instances"]:
            if inst["endpoint"] == endpoint:
                return inst["state"]
        return None

    async def register(self, *targets: OnLoopback, wait_active: bool = True) -> None:
        """Register engines or boxes (a box with its weight receiver) on 127.0.0.1; by default wait
        until all are active."""
        for t in targets:
            body: dict[str, Any] = {"host": "127.0.0.1", "port": t.port}
            if getattr(t, "rport", None):
                body["weight_receiver_port"] = t.rport
            status, answer = await self.post("/register_rollout_instance", body)
            assert status == 200, answer
        for t in targets if wait_active else ():
            await async_wait_until(lambda t=t: self._is_active(t.endpoint), message=f"{t.endpoint} active")

    async def _is_active(self, endpoint: str) -> bool:
        return await self.state_of(endpoint) == "active"


@pytest.fixture
async def start_manager(tmp_path):
    """Start real daemons as child processes; all are killed at the end of the test."""
    started: list[ManagerHandle] = []
    session = aiohttp.ClientSession()

    async def start(port: int | None = None, **settings: Any) -> ManagerHandle:
        """``port``: listen there (e.g. to restart a manager on the address boxes know); default a free one."""
        port = port or free_port()
        log_path = tmp_path / f"manager-{port}.log"
        if log_path.exists():  # a restart on the same port keeps the earlier log
            log_path = tmp_path / f"manager-{port}-{len(started)}.log"
        proc = Proc(_manager_args(port, settings), log_path)
        handle = ManagerHandle(proc, f"http://127.0.0.1:{port}", session, str(settings.get("auth_token", "")))
        started.append(handle)
        await wait_http_ok(handle.url + "/health", proc)
        return handle

    yield start
    for handle in started:
        handle.proc.stop()
    await session.close()


def _manager_args(port: int, settings: dict[str, Any]) -> list[str]:
    args = [PY, "-m", "rollout_manager", "serve", "--bind", f"127.0.0.1:{port}"]
    for key, value in {**FAST, **settings}.items():
        args += ["--set", f"{key}={value}"]
    return args


@pytest.fixture(scope="module")
def shared_manager_url(tmp_path_factory):
    """One daemon for a module's many small requests (the malformed-body table)."""
    port = free_port()
    proc = Proc(_manager_args(port, {}), tmp_path_factory.mktemp("shared") / "manager.log")
    try:
        wait_http_ok_sync(f"http://127.0.0.1:{port}/health", proc)
        yield f"http://127.0.0.1:{port}", proc
    finally:
        proc.stop()


@pytest.fixture
async def start_manager_shared(shared_manager_url):
    url, proc = shared_manager_url
    async with aiohttp.ClientSession() as session:
        yield ManagerHandle(proc, url, session)


@dataclass
class StubEngine(OnLoopback):
    """A minimal in-process SGLang stand-in whose health answers the test controls."""

    port: int
    health_status: int = 200
    probes: int = 0
    runner: web.AppRunner | None = None
    seen: list[str] = field(default_factory=list)

    async def _health(self, request: web.Request) -> web.Response:
        self.probes += 1
        self.seen.append(request.path)
        return web.json_response({}, status=self.health_status)


@pytest.fixture
async def stub_engine():
    stubs: list[StubEngine] = []

    async def start(health_status: int = 200) -> StubEngine:
        stub = StubEngine(free_port(), health_status)
        app = web.Application()
        app.router.add_get("/health", stub._health)
        app.router.add_get("/health_generate", stub._health)
        stub.runner = web.AppRunner(app)
        await stub.runner.setup()
        await web.TCPSite(stub.runner, "127.0.0.1", stub.port).start()
        stubs.append(stub)
        return stub

    yield start
    for stub in stubs:
        if stub.runner:
            await stub.runner.cleanup()


@dataclass
class EngineHandle(OnLoopback):
    proc: Proc
    port: int


@pytest.fixture
async def start_engines(tmp_path):
    """Start CPU engines (real processes, seed 0 unless told) in parallel; all are killed at the end."""
    started: list[EngineHandle] = []

    async def start(*flag_sets: list[str]) -> list[EngineHandle]:
        handles = []
        taken = {h.port for h in started}
        for flags in flag_sets:
            port = free_port()
            while port in taken:  # engines start in parallel: a port not yet bound may be offered twice
                port = free_port()
            taken.add(port)
            args = [PY, "-m", "rollout_manager.cpu_engine", "--port", str(port), *flags]
            if "--seed" not in flags:
                args += ["--seed", "0"]
            handle = EngineHandle(Proc(args, tmp_path / f"engine-{port}.log"), port)
            started.append(handle)
            handles.append(handle)
        for handle in handles:
            await wait_http_ok(handle.url + "/health", handle.proc)
        return handles

    yield start
    for handle in started:
        handle.proc.stop()


@pytest.fixture
async def api() -> AsyncIterator[tuple[Manager, TestClient]]:
    """A manager of the default config behind its real HTTP app on a free 127.0.0.1 port, closed afterwards."""
    manager = Manager(Config())
    client = TestClient(TestServer(create_app(manager), host="127.0.0.1"))
    await client.start_server()
    try:
        yield manager, client
    finally:
        await client.close()
        await manager.close()
