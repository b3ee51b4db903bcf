"""The tail benchmark's processes: the simulated fleet, managers (this checkout's and an earlier revision's,
from a ``git worktree``), and sglang-router (from a venv of its own, installed on demand)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import aiohttp
from bench_manager_overhead import wait_ok
from tail_fleet import BoxSpec, LengthModel

from rollout_manager.osutil import free_port

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
ROUTER_PACKAGE = "sglang-router==0.3.2"
# Settings every manager here gets first (a later --set of the same key wins): quick registration, the
# fleet's cheap /health, logs kept short.
MANAGER_DEFAULTS = ("pending_poll_interval_s=0.1", "health_check_path=/health", "health_check_interval_s=5")


class Procs:
    """Processes started here, each in its own session, by the URL they serve."""

    def __init__(self) -> None:
        self.by_url: dict[str, subprocess.Popen[bytes]] = {}

    def spawn(self, url: str, args: list[str], log: Path, *, cwd: Path = ROOT,
              env: dict[str, str] | None = None, stdout_pipe: bool = False) -> subprocess.Popen[bytes]:
        out = subprocess.PIPE if stdout_pipe else open(log, "wb")
        proc = subprocess.Popen(args, stdout=out, stderr=open(log.with_suffix(".err"), "wb") if stdout_pipe
                                else subprocess.STDOUT, cwd=cwd, env=env, start_new_session=True)
        self.by_url[url] = proc
        return proc

    def stop(self, url: str) -> None:
        proc = self.by_url.pop(url, None)
        if proc is not None:
            _kill(proc)

    def terminate(self, url: str, timeout_s: float = 60.0) -> None:
        """Stop it as an operator would (SIGTERM: a manager finishes its shutdown, writing what it keeps),
        killed if it is still running after ``timeout_s``."""
        proc = self.by_url.pop(url, None)
        if proc is None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            _kill(proc)

    def stop_all(self) -> None:
        for url in list(self.by_url):
            self.stop(url)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def spawn_fleet(procs: Procs, specs: list[BoxSpec], model: LengthModel, logs: Path,
                stream_interval: int = 1) -> tuple[list[str], int]:
    """Start the fleet (its boxes' ``--stream-interval``: ``stream_interval``); its boxes' URLs and its pid, once
    it says where it listens."""
    proc = procs.spawn("fleet", [PY, str(ROOT / "benchmarks" / "tail_fleet.py"),
                                 "--boxes", json.dumps([asdict(s) for s in specs]),
                                 "--lengths", json.dumps(asdict(model)), "--stream-interval", str(stream_interval)],
                       logs / "fleet.log", stdout_pipe=True)
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    if not line.startswith("FLEET "):
        raise RuntimeError(f"the fleet did not start (see {logs / 'fleet.err'}): {line!r}")
    ready = json.loads(line[len("FLEET "):])
    return [f"http://127.0.0.1:{p}" for p in ready["ports"]], int(ready["pid"])


def install_router(cache: Path) -> Path | None:
    """The python of a venv with sglang-router under ``cache`` (made on first use), or None when it cannot
    be installed (said on stderr)."""
    venv = cache / "router-venv"
    py = venv / "bin" / "python"
    probe = [str(py), "-c", "import sglang_router.launch_router"]
    if py.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return py
    try:
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True, capture_output=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", ROUTER_PACKAGE], check=True, capture_output=True,
                       timeout=600)
        subprocess.run(probe, check=True, capture_output=True)
    except (subprocess.SubprocessError, OSError) as exc:
        err = getattr(exc, "stderr", b"") or b""
        print(f"sglang-router could not be installed ({exc}; {err.decode(errors='replace')[-300:]}); "
              "falling back to round robin from the client", file=sys.stderr)
        return None
    return py


async def start_router(procs: Procs, py: Path, urls: list[str], logs: Path) -> str | None:
    """sglang-router round robin over ``urls``; its URL, or None when it does not come up."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    procs.spawn(url, [str(py), "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
                      "--prometheus-port", str(free_port()), "--policy", "round_robin", "--log-level", "warn",
                      "--worker-urls", *urls], logs / "router.log")
    try:
        await wait_ok(url + "/health", timeout=120)
    except RuntimeError:
        print(f"sglang-router did not come up (see {logs / 'router.log'}); falling back to round robin from "
              "the client", file=sys.stderr)
        procs.stop(url)
        return None
    return url


def worktree(rev: str, cache: Path) -> Path:
    """A checkout of ``rev`` under ``cache`` (``git worktree add --detach``), made once per revision."""
    sha = subprocess.run(["git", "rev-parse", "--verify", f"{rev}^{{commit}}"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout.strip()
    path = cache / f"baseline-{sha[:12]}"
    if not (path / "rollout_manager").is_dir():
        subprocess.run(["git", "worktree", "add", "--detach", "--force", str(path), sha], cwd=ROOT, check=True,
                       capture_output=True)
    return path


async def start_manager(procs: Procs, root: Path, settings: list[str], backends: list[str], log: Path) -> str:
    """``rollout-manager serve`` from the checkout at ``root`` (this venv), the backends registered and ready."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    sets = [arg for kv in (*MANAGER_DEFAULTS, *settings) for arg in ("--set", kv)]
    env = {**os.environ, "PYTHONPATH": str(root)}
    procs.spawn(url, [PY, "-m", "rollout_manager", "serve", "--bind", f"127.0.0.1:{port}", "--log-level", "warning",
                      *sets], log, cwd=root, env=env)
    await wait_ok(url + "/health")
    async with aiohttp.ClientSession() as s:
        for backend in backends:
            host, bport = backend.removeprefix("http://").rsplit(":", 1)
            async with s.post(url + "/register_rollout_instance", json={"host": host, "port": int(bport)}) as r:
                if r.status != 200:
                    raise RuntimeError(f"registering {backend} with {url}: HTTP {r.status} {await r.text()}")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            async with s.get(url + "/get_instances_status") as r:
                if (await r.json())["ready_instances"] == len(backends):
                    return url
            await asyncio.sleep(0.1)
    raise RuntimeError(f"the manager at {url} did not take the fleet into service (see {log})")
