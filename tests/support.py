"""Shared test plumbing: free loopback ports, child processes that are always reaped, polling with deadlines."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

from rollout_manager.launch.box import free_port

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


class Proc:
    """A child process in its own process group, killed with its children on stop()."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None):
        self.args = args
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.popen = subprocess.Popen(
            args, stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT,
            env={**os.environ, **(env or {})}, start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            os.kill(self.popen.pid, sig)

    def wait(self, timeout: float) -> int:
        return self.popen.wait(timeout)

    def stop(self) -> None:
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.popen.wait(10)
        self._log.close()


async def wait_until(pred: Callable[[], Awaitable[Any] | Any], timeout: float = 20.0,
                     interval: float = 0.05, what: str = "condition") -> Any:
    """Poll ``pred`` until it returns something truthy; fail the test at the deadline."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = pred()
        if asyncio.iscoroutine(last):
            last = await last
        if last:
            return last
        await asyncio.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last value: {last!r}")


async def http_ok(url: str) -> bool:
    try:
        async with aiohttp.ClientSession() as s, s.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
            return r.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return False


async def wait_http_ok(url: str, proc: Proc | None = None, timeout: float = 60.0) -> None:
    async def ready() -> bool:
        if proc is not None and proc.popen.poll() is not None:
            raise AssertionError(f"{proc.args} exited with {proc.popen.returncode}:\n{proc.log()}")
        return await http_ok(url)

    await wait_until(ready, timeout, 0.1, f"{url} to answer 200")


def wait_http_ok_sync(url: str, proc: Proc | None = None, timeout: float = 60.0) -> None:
    """The same, for synchronous fixtures."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.popen.poll() is not None:
            raise AssertionError(f"{proc.args} exited with {proc.popen.returncode}:\n{proc.log()}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {url}")


class OnLoopback:
    """Something serving HTTP on 127.0.0.1:``port``."""

    port: int

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.endpoint}"


class Box(OnLoopback):
    """One rollout box: a CPU engine and its weight receiver agent."""

    def __init__(self, tmp_path: Path, model_json: str = "{}", *receiver_flags: str, token: str = ""):
        self.port, self.rport = free_port(), free_port()
        self.engine = Proc([PY, "-m", "rollout_manager.cpu_engine", "--port", str(self.port), "--seed", "0",
                            "--model-config", model_json], tmp_path / f"engine-{self.port}.log")
        self.receiver = Proc([PY, "-m", "rollout_manager.weights.receiver_agent", "--host", "127.0.0.1",
                              "--port", str(self.rport), "--sglang-url", f"http://127.0.0.1:{self.port}",
                              *receiver_flags], tmp_path / f"receiver-{self.rport}.log",
                             env={"MC_LOG_LEVEL": "ERROR", "GLOG_minloglevel": "2",
                                  "ROLLOUT_MANAGER_AUTH_TOKEN": token})

    async def ready(self) -> None:
        await wait_http_ok(self.url + "/health", self.engine)
        await wait_http_ok(f"http://127.0.0.1:{self.rport}/health", self.receiver)

    def stop(self) -> None:
        self.engine.stop()
        self.receiver.stop()
