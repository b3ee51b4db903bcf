"""Shared test plumbing: free loopback ports, child processes that are always reaped, polling with deadlines."""

from __future__ import annotations

import asyncio
import inspect
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

from rollout_manager import jsonutil
from rollout_manager.osutil import descendants as descendants  # re-exported: tests import it from here
from rollout_manager.osutil import free_port, port_is_bindable

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
T = TypeVar("T")
# The child processes started since the current test began: their logs go in its failure report.
STARTED: list[Proc] = []


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
        STARTED.append(self)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def tail(self, chars: int) -> str:
        """The end of its log, read from the file (safe after stop(); the child wrote it, not us)."""
        try:
            return self.log_path.read_bytes()[-chars:].decode(errors="replace")
        except OSError as exc:
            return f"(log unreadable: {exc})"

    def signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            os.kill(self.popen.pid, sig)

    def wait(self, timeout: float) -> int:
        """Its exit status; a test failure with the end of its log if it is still running after ``timeout``."""
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after {timeout:g}s; its log ends:\n{self.log()[-3000:]}") from None

    def stop(self) -> None:
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.popen.wait(10)
        self._log.close()


Message = str | Callable[[], str]  # a callable is asked only on failure, so it can describe the final state


def _timed_out(timeout_s: float, message: Message, last: Any) -> AssertionError:
    text = message() if callable(message) else message
    return AssertionError(f"timed out after {timeout_s:g}s waiting for {text}; last value: {last!r}")


def rss_mb(pid: int) -> float:
    """A process's resident memory now, in MiB (from /proc)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def wait_until(predicate: Callable[[], T], timeout_s: float = 20.0, *, interval_s: float = 0.05,
               message: Message = "condition") -> T:
    """Poll ``predicate`` until it returns something truthy and return that; fail the test at the deadline.

    The predicate is always tried once more at the deadline, and what it raises propagates unchanged.
    For synchronous code (fixtures, threads); inside the event loop use :func:`async_wait_until`.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        last = predicate()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise _timed_out(timeout_s, message, last)
        time.sleep(interval_s)


async def async_wait_until(predicate: Callable[[], Any], timeout_s: float = 20.0, *, interval_s: float = 0.05,
                           message: Message = "condition") -> Any:
    """:func:`wait_until` for the event loop: ``predicate`` may be a plain or an async function."""
    deadline = time.monotonic() + timeout_s
    while True:
        last = predicate()
        if inspect.isawaitable(last):
            last = await last
        if last:
            return last
        if time.monotonic() >= deadline:
            raise _timed_out(timeout_s, message, last)
        await asyncio.sleep(interval_s)


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

    await async_wait_until(ready, timeout, interval_s=0.1, message=f"{url} to answer 200")


def wait_http_ok_sync(url: str, proc: Proc | None = None, timeout: float = 60.0) -> None:
    """The same, for synchronous fixtures."""
    import urllib.error
    import urllib.request

    def ready() -> bool:
        if proc is not None and proc.popen.poll() is not None:
            raise AssertionError(f"{proc.args} exited with {proc.popen.returncode}:\n{proc.log()}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    wait_until(ready, timeout, interval_s=0.1, message=f"{url} to answer 200")


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


def alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != b"Z"


def as_json(value: Any) -> Any:
    """What a caller gets for ``value`` (an answer, a list of them, a batch line): encoded as the manager
    sends it, and decoded."""
    return jsonutil.loads(jsonutil.dumps(value))


_quiet_taken: set[int] = set()


def quiet_port(host: str = "127.0.0.1") -> int:
    """A free port below the kernel's ephemeral range, for a server that binds late (real SGLang binds its
    port only after loading the model, many seconds after the test picked it). A port from
    :func:`free_port` is the kernel's next ephemeral one, which any outgoing connection or Ray worker
    started meanwhile may take first; ports below the range are never handed out by the kernel."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(1000):
        port = rng.randrange(max(low - 12288, 1024), low)
        if port not in _quiet_taken and port_is_bindable(host, port):
            _quiet_taken.add(port)
            return port
    return free_port(host)


@contextmanager
def local_ray_cluster(env: dict[str, str], head: dict[str, Any], others: list[dict[str, Any]],
                      namespace: str) -> Iterator[Any]:
    """A Ray cluster of nodes on loopback addresses, this process connected to it in a namespace of its own.
    ``env`` is set while it runs (the nodes' raylets, hence their workers and actors, inherit it) and restored
    after; ``head`` and each of ``others`` are a node's arguments (``Cluster``'s head_node_args, ``add_node``)."""
    import uuid

    import ray
    from ray.cluster_utils import Cluster

    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    c = Cluster(initialize_head=True, head_node_args={**head, "include_dashboard": False})
    try:
        for node in others:
            c.add_node(**node)
        c.wait_for_nodes()
        ray.init(address=c.address, namespace=f"{namespace}-{uuid.uuid4().hex[:8]}", log_to_driver=False)
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
