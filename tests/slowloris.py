"""Slowloris against a real daemon: many connections that send request headers one byte at a time.

The daemon runs under a lowered open-file limit (soft and hard, since it raises its soft limit to the
hard one at start) with one CPU engine registered. While the slow connections trickle, ``/health`` is
asked every quarter second on a fresh connection. Used by ``test_hostile_callers.py`` at a small scale
and, run as a script, for the figures in docs/reliability.md::

    .venv/bin/python tests/slowloris.py --connections 1010 --nofile 1024 --duration 40
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from support import PY, Proc, async_wait_until, free_port, wait_http_ok

# Health checks every second, three misses remove an instance: an instance the manager cannot reach
# because its own descriptors ran out is removed within seconds.
HEALTH = {"pending_poll_interval_s": "0.2", "health_check_interval_s": "1", "health_check_timeout_s": "2",
          "health_failure_threshold": "3", "log_level": "info"}


@dataclass
class Figures:
    connections: int
    nofile: int
    opened: int = 0  # slow connections the server accepted (TCP connect succeeded)
    closed_by_server: int = 0  # of those, closed by the manager while still sending headers
    seconds_to_close: list[float] = field(default_factory=list)
    health_probes: int = 0
    health_failed: int = 0
    health_worst_s: float = 0.0
    health_errors: dict[str, int] = field(default_factory=dict)
    generate_calls: int = 0
    generate_failed: int = 0
    instances_removed: int = 0
    removal_reasons: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        closes = sorted(self.seconds_to_close)
        return {"connections": self.connections, "nofile": self.nofile, "opened": self.opened,
                "closed_by_server": self.closed_by_server,
                "median_s_to_close": round(closes[len(closes) // 2], 2) if closes else None,
                "health_probes": self.health_probes, "health_failed": self.health_failed,
                "health_worst_s": round(self.health_worst_s, 3), "health_errors": self.health_errors,
                "generate_calls": self.generate_calls, "generate_failed": self.generate_failed,
                "instances_removed": self.instances_removed,
                "removal_reasons": self.removal_reasons}


async def _slow_client(port: int, figures: Figures, stop: asyncio.Event, byte_every_s: float,
                       tried: asyncio.Queue[None]) -> None:
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5)
    except (OSError, asyncio.TimeoutError):
        tried.put_nowait(None)
        return
    figures.opened += 1
    tried.put_nowait(None)
    started = time.monotonic()
    try:
        writer.write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        while not stop.is_set():
            await writer.drain()
            try:  # EOF (b"") means the server closed us
                if await asyncio.wait_for(reader.read(1024), byte_every_s) == b"":
                    break
            except asyncio.TimeoutError:
                writer.write(b"a")
                continue
        else:
            return
    except OSError:
        pass
    figures.closed_by_server += 1
    figures.seconds_to_close.append(time.monotonic() - started)
    writer.close()


async def _probe_health(url: str, figures: Figures, stop: asyncio.Event) -> None:
    timeout = aiohttp.ClientTimeout(total=10)
    while not stop.is_set():
        t0 = time.monotonic()
        try:  # a fresh connection each time, as a new caller would open
            async with aiohttp.ClientSession(timeout=timeout) as s, s.get(url + "/health") as r:
                ok = r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            ok = False
            name = type(exc).__name__
            figures.health_errors[name] = figures.health_errors.get(name, 0) + 1
        figures.health_probes += 1
        figures.health_failed += 0 if ok else 1
        figures.health_worst_s = max(figures.health_worst_s, time.monotonic() - t0)
        try:
            await asyncio.wait_for(stop.wait(), 0.25)
        except asyncio.TimeoutError:
            pass


async def _generate(url: str, figures: Figures, stop: asyncio.Event) -> None:
    """One short generation a second through the manager, on a fresh connection each time."""
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    timeout = aiohttp.ClientTimeout(total=30)
    while not stop.is_set():
        try:
            async with aiohttp.ClientSession(timeout=timeout) as s, s.post(url + "/generate", json=body) as r:
                ok = r.status == 200 and len((await r.json())["output_ids"]) == 4
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
            ok = False
            name = f"generate {type(exc).__name__}"
            figures.health_errors[name] = figures.health_errors.get(name, 0) + 1
        figures.generate_calls += 1
        figures.generate_failed += 0 if ok else 1
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except asyncio.TimeoutError:
            pass


async def run(tmp: Path, *, connections: int, nofile: int, duration_s: float, byte_every_s: float = 2.0,
              settings: dict[str, str] | None = None, daemon_root: Path | None = None) -> Figures:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = connections + 256  # this process holds the slow connections itself
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard) if hard >= 0 else want, hard))
    figures = Figures(connections, nofile)
    port, eport = free_port(), free_port()
    engine = Proc([PY, "-m", "rollout_manager.cpu_engine", "--port", str(eport), "--seed", "0"],
                  tmp / f"engine-{eport}.log")
    args = [PY, "-m", "rollout_manager", "serve", "--bind", f"127.0.0.1:{port}"]
    for key, value in {**HEALTH, **(settings or {})}.items():
        args += ["--set", f"{key}={value}"]
    quoted = " ".join(f"'{a}'" for a in args)
    cd = f"cd '{daemon_root}' && " if daemon_root else ""  # another checkout's daemon, e.g. to compare
    manager = Proc(["bash", "-c", f"{cd}ulimit -n {nofile} && exec {quoted}"], tmp / f"manager-{port}.log")
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_http_ok(f"http://127.0.0.1:{eport}/health", engine)
        await wait_http_ok(url + "/health", manager)
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/register_rollout_instance", json={"host": "127.0.0.1", "port": eport}) as r:
                assert r.status == 200, await r.text()

            async def active() -> bool:
                async with s.get(url + "/get_instances_status") as r:
                    return [i["state"] for i in (await r.json())["instances"]] == ["active"]

            await async_wait_until(active, 30, message="the engine to become active")
        stop = asyncio.Event()
        tried: asyncio.Queue[None] = asyncio.Queue()
        clients = [asyncio.create_task(_slow_client(port, figures, stop, byte_every_s, tried))
                   for _ in range(connections)]
        for _ in range(connections):  # the attack is in place: every slow connection was tried
            await tried.get()
        probes = [asyncio.create_task(_probe_health(url, figures, stop)),
                  asyncio.create_task(_generate(url, figures, stop))]
        await asyncio.sleep(duration_s)  # the measurement window itself, not a synchronisation
        stop.set()
        await asyncio.gather(*probes, *clients)
        async with aiohttp.ClientSession() as s:
            await async_wait_until(lambda: _health_ok(s, url), 30, message="the manager to answer again")
            async with s.get(url + "/get_instances_status") as r:
                status = await r.json()
        removals = [e for e in status["recent_events"] if e["to"] == "dead"]
        figures.instances_removed = len(removals)
        figures.removal_reasons = [e["reason"] for e in removals]
        return figures
    finally:
        manager.stop()
        engine.stop()


async def _health_ok(s: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with s.get(url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
            return r.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return False


def main() -> None:
    import tempfile

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--connections", type=int, default=1010)
    p.add_argument("--nofile", type=int, default=1024, help="the daemon's open-file limit (soft and hard)")
    p.add_argument("--duration", type=float, default=40.0)
    p.add_argument("--set", action="append", default=[], help="KEY=VALUE for the daemon")
    p.add_argument("--daemon-root", type=Path, help="run the daemon from this checkout (e.g. an older one)")
    args = p.parse_args()
    settings = dict(kv.split("=", 1) for kv in args.set)
    with tempfile.TemporaryDirectory() as tmp:
        figures = asyncio.run(run(Path(tmp), connections=args.connections, nofile=args.nofile,
                                  duration_s=args.duration, settings=settings, daemon_root=args.daemon_root))
    print(json.dumps(figures.to_dict()))


if __name__ == "__main__":
    main()
