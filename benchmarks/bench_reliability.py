"""Reliability: broken engines, hostile callers and manager restarts, one scenario per finding of issue 18.

Each scenario starts a fresh ``rollout-manager serve`` process, CPU engines
(``python -m rollout_manager.cpu_engine``, greedy, so every output is checked token for token against
the same model run in this process) and, where an engine must misbehave while it stays up,
benchmarks/misbehaving_sglang.py (it relays registration and health to a CPU engine and breaks only
``/generate``). It applies the load and the fault, then records:

- requests lost: never answered, or failed, where the fault is not the caller's; where it is, the
  status codes the caller got (target 4xx with an error);
- tokens wrong / regenerated: tokens returned as success that differ from the reference (or that came
  from an instance reporting a weight version the manager never pushed), and tokens made twice (the
  segments' lengths minus the final length);
- healthy instances removed (from the manager's ``-> dead`` log lines and its final status);
- the manager's peak RSS (VmHWM) with its RSS when the fault began, and the worst ``/health`` latency
  during the fault (a poller: one probe on a new connection every 0.1 s, 30 s timeout; failed probes
  counted).

Every scenario is bounded: past its deadline it is stopped and reported as such. The manager runs with
``pending_poll_interval_s=0.1`` (fast start) and ``health_check_interval_s=2`` (so that an instance a
fault makes look dead is removed within the scenario); everything else is the default configuration.

    .venv/bin/python benchmarks/bench_reliability.py                     # every scenario, full loads
    .venv/bin/python benchmarks/bench_reliability.py --quick             # small loads, short faults
    .venv/bin/python benchmarks/bench_reliability.py --scenario flood --scenario slowloris
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import logging
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_manager_overhead import spawn, stop_all, wait_ok
from bench_scale import sockets, status_kb

from rollout_manager.osutil import free_port

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
MANAGER_SETS = ("pending_poll_interval_s=0.1", "health_check_interval_s=2")
WRONG_MODES = {  # scenario -> (misbehaving_sglang mode, the fault in words)
    "wrong_backwards": ("backwards", "1 engine's cumulative ids go backwards"),
    "wrong_completion_tokens": ("bad_ct", "1 engine's chunks lack completion_tokens"),
    "wrong_too_many": ("too_many", "1 engine sends 6 tokens past the budget"),
    "wrong_ids": ("bad_ids", '1 engine sends ids -5, "x", 1.5, 10^12'),
    "wrong_version": ("bad_version", '1 engine reports weight_version "999"'),
}
Popen = subprocess.Popen[bytes]


# ---------------------------------------------------------------- results


@dataclass
class Row:
    scenario: str
    load: str
    fault: str
    lost: str = "-"
    wrong: str = "-"
    removed: str = "-"
    rss: str = "-"
    health: str = "-"
    wall: str = "-"
    notes: str = ""


COLUMNS = (("scenario", "scenario"), ("load", "load"), ("fault", "fault"), ("lost", "requests lost"),
           ("wrong", "tokens wrong / regenerated"), ("removed", "healthy instances removed"),
           ("rss", "manager peak RSS MB (at fault start)"), ("health", "worst /health s (failed probes)"),
           ("wall", "wall s"), ("notes", "notes"))


def table(rows: Sequence[Row]) -> str:
    def cell(v: str) -> str:
        return v.replace("|", "\\|").replace("\n", " ")

    out = ["| " + " | ".join(h for _, h in COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    out += ["| " + " | ".join(cell(str(getattr(r, k))) for k, _ in COLUMNS) + " |" for r in rows]
    return "\n".join(out)


# ---------------------------------------------------------------- the reference model


_MODEL: list[Any] = []
_REFS: dict[tuple[tuple[int, ...], int], list[int]] = {}


def reference(prompt: Sequence[int], budget: int) -> list[int]:
    """What a CPU engine (seed 0, tiny) answers greedily: every output is compared with this."""
    key = (tuple(prompt), budget)
    if key not in _REFS:
        from rollout_manager.cpu_engine.model import build_model, reference_generate

        if not _MODEL:
            _MODEL.append(build_model(0, "tiny"))
        _REFS[key] = reference_generate(_MODEL[0], list(prompt), budget)[0]
    return _REFS[key]


def prompt_of(i: int) -> list[int]:
    return [i % 250 + 1, 7, (i // 250) % 250 + 1]


def gen_body(i: int, tokens: int) -> dict[str, Any]:
    return {"input_ids": prompt_of(i), "sampling_params": {"max_new_tokens": tokens, "temperature": 0}}


def mixed(n: int) -> list[list[Any]]:
    """Half short requests (at most ``engine_stream_interval`` tokens: the manager asks the engine for one
    answer) and half long ones (streamed), so both of its engine paths meet the fault."""
    return [[i, gen_body(i, SHORT if i % 2 == 0 else LONG)] for i in range(n)]


SHORT, LONG = 8, 40
MIXED = f"{SHORT} (one answer) / {LONG} (streamed) tokens"


# ---------------------------------------------------------------- processes


@dataclass
class Manager:
    proc: Popen
    port: int
    log: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class Run:
    """One scenario's processes (all stopped by :meth:`close`) and its manager readings."""

    name: str
    logs: Path
    procs: list[Popen] = field(default_factory=list)
    managers: list[Manager] = field(default_factory=list)
    hwm_kb: int = 0

    def spawn(self, args: list[str], label: str) -> Popen:
        p: Popen = spawn(args, self.logs / f"{self.name}-{label}.log")
        self.procs.append(p)
        return p

    async def manager(self, *sets: str, nofile: int | None = None, port: int | None = None) -> Manager:
        port = port or free_port()
        cmd = [PY, "-m", "rollout_manager", "serve", "--bind", f"127.0.0.1:{port}", "--log-level", "warning",
               *[a for kv in (*MANAGER_SETS, *sets) for a in ("--set", kv)]]
        if nofile:  # prlimit execs the manager in place: same pid
            cmd = ["prlimit", f"--nofile={nofile}:{nofile}", *cmd]
        label = f"manager{len(self.managers)}"
        m = Manager(self.spawn(cmd, label), port, self.logs / f"{self.name}-{label}.log")
        self.managers.append(m)
        await wait_ok(m.url + "/health", timeout=60)
        return m

    def cpu_engine(self, *flags: str) -> str:
        port = free_port()
        self.spawn([PY, "-m", "rollout_manager.cpu_engine", "--port", str(port), "--seed", "0", *flags],
                   f"engine{port}")
        return f"127.0.0.1:{port}"

    def misbehaving(self, mode: str, upstream: str, *flags: str) -> str:
        port = free_port()
        self.spawn([PY, str(ROOT / "benchmarks/misbehaving_sglang.py"), "--port", str(port), "--mode", mode,
                    "--upstream", "http://" + upstream, *flags], f"bad-{mode}")
        return f"127.0.0.1:{port}"

    def instant_fake(self, tokens: int) -> str:
        port = free_port()
        self.spawn([PY, str(ROOT / "benchmarks/fake_sglang.py"), "--port", str(port), "--chunks", str(tokens),
                    "--incremental-streaming-output"], f"fake{port}")
        return f"127.0.0.1:{port}"

    def memory(self) -> None:
        """Fold the live managers' VmHWM into the scenario's peak."""
        for m in self.managers:
            if m.proc.poll() is None:
                try:
                    self.hwm_kb = max(self.hwm_kb, status_kb(m.pid, "VmHWM"))
                except OSError:
                    pass

    def rss_mb(self, m: Manager) -> float:
        try:
            return status_kb(m.pid, "VmRSS") / 1024
        except OSError:
            return float("nan")

    def dead(self) -> dict[str, str]:
        """Endpoints the managers' logs say went dead, with the reason."""
        out: dict[str, str] = {}
        for m in self.managers:
            try:
                text = m.log.read_text(errors="replace")
            except OSError:
                continue
            for match in re.finditer(r"instance \S+ (\S+) \w+ -> dead: ([^\n]*)", text):
                out.setdefault(match.group(1), match.group(2))
        return out

    def log_lines(self, pattern: str) -> list[str]:
        found = []
        for m in self.managers:
            try:
                found += [line for line in m.log.read_text(errors="replace").splitlines() if re.search(pattern, line)]
            except OSError:
                pass
        return found

    def close(self) -> None:
        for m in self.managers:  # a frozen manager cannot die of SIGKILL any slower, but be explicit
            try:
                os.kill(m.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        stop_all(self.procs)


async def status(url: str, timeout: float = 10.0) -> dict[str, Any] | None:
    try:
        async with aiohttp.ClientSession() as s, s.get(url + "/get_instances_status",
                                                       timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            if r.status == 200:
                data: dict[str, Any] = await r.json()
                return data
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
        pass
    return None


async def register(url: str, endpoints: Sequence[str], timeout: float = 60.0) -> None:
    """Register ``endpoints`` (each answering /health first) and wait until all are active."""
    for ep in endpoints:
        await wait_ok(f"http://{ep}/health", timeout=timeout)
    async with aiohttp.ClientSession() as s:
        for ep in endpoints:
            host, port = ep.rsplit(":", 1)
            async with s.post(url + "/register_rollout_instance", json={"host": host, "port": int(port)}) as r:
                if r.status != 200:
                    raise RuntimeError(f"registering {ep}: HTTP {r.status} {await r.text()}")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = await status(url)
        if st and set(endpoints) <= set(st.get("ready_instance_endpoints") or []):
            return
        await asyncio.sleep(0.1)
    raise RuntimeError(f"{endpoints} not all active after {timeout:g}s")


async def removed(run: Run, url: str, healthy: Sequence[str]) -> tuple[str, list[str]]:
    """(how many healthy instances were removed, with why; the other endpoints that went dead)."""
    dead = run.dead()
    st = await status(url, timeout=30)
    gone = {ep for ep in healthy if ep in dead}
    if st is not None:
        active = set(st.get("ready_instance_endpoints") or [])
        gone |= {ep for ep in healthy if ep not in active}
    text = str(len(gone))
    if gone:
        why = sorted({dead.get(ep, "not active at the end") for ep in gone})
        text += f" of {len(healthy)} ({'; '.join(w[:90] for w in why)})"
    others = sorted(ep for ep in dead if ep not in healthy)
    return text, others


# ---------------------------------------------------------------- measurement during the fault


class Poller:
    """Probe ``/health`` every ``every_s`` on a new connection; sample the managers' VmHWM too."""

    def __init__(self, run: Run, url: Callable[[], str], every_s: float = 0.1, timeout_s: float = 30.0):
        self.run, self.url, self.every_s, self.timeout_s = run, url, every_s, timeout_s
        self.worst = 0.0
        self.probes = 0
        self.failed = 0
        self._probe_started: float | None = None
        self._task: asyncio.Task[None] | None = None
        self.rss_at_start = float("nan")

    def start(self) -> Poller:
        if self.run.managers:
            self.rss_at_start = self.run.rss_mb(self.run.managers[-1])
        self._task = asyncio.create_task(self._loop())
        return self

    async def _loop(self) -> None:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
            while True:
                self.run.memory()
                self._probe_started = t0 = time.monotonic()
                ok = False
                try:
                    async with s.get(self.url() + "/health", timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as r:
                        await r.read()
                        ok = r.status == 200
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                    pass
                self._probe_started = None
                self.worst = max(self.worst, time.monotonic() - t0)
                self.probes += 1
                self.failed += not ok
                await asyncio.sleep(self.every_s)

    async def stop(self) -> None:
        if self._probe_started is not None:  # a probe still waiting counts for as long as it waited
            self.worst = max(self.worst, time.monotonic() - self._probe_started)
            self.probes += 1
            self.failed += 1
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.run.memory()

    def health(self) -> str:
        return f"{self.worst:.2f}" + (f" ({self.failed}/{self.probes})" if self.failed else "")

    def rss(self) -> str:
        return f"{self.run.hwm_kb / 1024:.0f} ({self.rss_at_start:.0f})"


@dataclass
class Batch:
    lines: dict[str, dict[str, Any]] = field(default_factory=dict)  # json.dumps(id) -> NDJSON line
    status: int | None = None
    error: str | None = None
    wall: float = 0.0
    timed_out: bool = False


async def send_batch(url: str, items: list[list[Any]], deadline_s: float,
                     session: aiohttp.ClientSession | None = None) -> Batch:
    """POST one ``/batch_generate_requests`` and read its lines until it ends or ``deadline_s`` passes."""
    out = Batch()
    t0 = time.monotonic()

    async def read(s: aiohttp.ClientSession) -> None:
        async with s.post(url + "/batch_generate_requests", json=items,
                          timeout=aiohttp.ClientTimeout(total=None)) as r:
            out.status = r.status
            if r.status != 200:
                out.error = (await r.text())[:200]
                return
            async for raw in r.content:
                if raw.strip():
                    line = json.loads(raw)
                    out.lines[json.dumps(line.get("id"))] = line

    try:
        if session is None:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
                await asyncio.wait_for(read(s), deadline_s)
        else:
            await asyncio.wait_for(read(session), deadline_s)
    except asyncio.TimeoutError:
        out.timed_out = True
        out.error = f"deadline {deadline_s:g}s hit"
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"[:200]
    out.wall = time.monotonic() - t0
    return out


@dataclass
class Score:
    n: int = 0
    unanswered: int = 0
    failed: collections.Counter[str] = field(default_factory=collections.Counter)
    first_error: str = ""
    wrong_tokens: int = 0
    wrong_results: int = 0
    regenerated: int = 0
    continued: int = 0

    @property
    def lost(self) -> int:
        return self.unanswered + sum(self.failed.values())

    def lost_text(self) -> str:
        if not self.lost:
            return f"0 of {self.n}"
        parts = []
        if self.unanswered:
            parts.append(f"{self.unanswered} unanswered")
        if self.failed:
            parts.append("failed " + ", ".join(f"{v}x HTTP {k}" for k, v in sorted(self.failed.items())))
        return f"{self.lost} of {self.n} ({'; '.join(parts)})"

    def wrong_text(self) -> str:
        text = f"{self.wrong_tokens} / {self.regenerated}"
        if self.wrong_results:
            text += f" ({self.wrong_results} results wrong)"
        return text


def score(items: list[list[Any]], lines: dict[str, dict[str, Any]],
          expected: Callable[[dict[str, Any]], list[int]], bad_version: str | None = None) -> Score:
    """Compare every answer with the reference; ``bad_version``: tokens under it count as wrong."""
    sc = Score(n=len(items))
    for rid, body in items:
        line = lines.get(json.dumps(rid))
        if line is None:
            sc.unanswered += 1
            continue
        if not line.get("success"):
            sc.failed[str(line.get("status_code"))] += 1
            sc.first_error = sc.first_error or str(line.get("error"))[:160]
            continue
        data = line.get("data") or {}
        out = data.get("output_ids") or []
        ref = expected(body)
        wrong = sum(1 for a, b in zip(out, ref) if a != b) + abs(len(out) - len(ref))
        meta = data.get("meta_info") or {}
        segments = meta.get("segments") or []
        if bad_version is not None:
            if segments:
                wrong += sum(int(sg["end"]) - int(sg["start"]) for sg in segments
                             if str(sg.get("weight_version")) == bad_version)
            elif str(meta.get("weight_version")) == bad_version:
                wrong += len(out)
        sc.wrong_tokens += wrong
        sc.wrong_results += wrong > 0
        if segments:
            made = sum(int(sg["end"]) - int(sg["start"]) for sg in segments)
            sc.regenerated += max(0, made - len(out))
            sc.continued += len(segments) > 1
    return sc


def by_budget(body: dict[str, Any]) -> list[int]:
    return reference(body["input_ids"], int(body["sampling_params"]["max_new_tokens"]))


async def side_generate(url: str, stop: asyncio.Event, tokens: int = 8, timeout_s: float = 30.0,
                        pause_s: float = 0.5) -> tuple[int, int, float]:
    """Another caller's single ``/generate`` requests, one after the other, until ``stop``:
    (sent, failed or wrong, worst latency)."""
    sent = bad = 0
    worst = 0.0
    i = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        while not stop.is_set():
            body = gen_body(10_000 + i, tokens)
            i += 1
            t0 = time.monotonic()
            ok = False
            try:
                async with s.post(url + "/generate", json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                    data = await r.json(content_type=None)
                    ok = r.status == 200 and data.get("output_ids") == by_budget(body)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
                pass
            worst = max(worst, time.monotonic() - t0)
            sent += 1
            bad += not ok
            try:
                await asyncio.wait_for(stop.wait(), pause_s)
            except asyncio.TimeoutError:
                pass
    return sent, bad, worst


# ---------------------------------------------------------------- scenarios: broken engines


async def wrong_tokens(run: Run, args: argparse.Namespace) -> Row:
    mode, fault = WRONG_MODES[run.name]
    n = 16 if args.quick else 40
    healthy = run.cpu_engine()
    m = await run.manager()
    bad = run.misbehaving(mode, healthy)
    await register(m.url, [healthy, bad])
    items = mixed(n)
    for _, body in items:
        by_budget(body)
    poll = Poller(run, lambda: m.url).start()
    batch = await send_batch(m.url, items, 40 if args.quick else 60)
    await poll.stop()
    sc = score(items, batch.lines, by_budget, bad_version="999" if mode == "bad_version" else None)
    gone, others = await removed(run, m.url, [healthy])
    notes = [f"misbehaving engine removed: {'yes' if bad in others else 'no'}"]
    if sc.continued:
        notes.append(f"{sc.continued} continued elsewhere")
    if sc.first_error:
        notes.append(f"error: {sc.first_error}")
    if batch.error:
        notes.append(f"batch: {batch.error}")
    return Row(run.name, f"{n} requests x {MIXED}; 1 misbehaving + 1 healthy CPU engine", fault,
               sc.lost_text(), sc.wrong_text(), gone, poll.rss(), poll.health(), f"{batch.wall:.1f}",
               "; ".join(notes))


async def engine_fault(run: Run, args: argparse.Namespace) -> Row:
    """endless / http404 / error_frame / silent: an engine that never gives a token, beside a healthy one."""
    name = run.name
    quick = args.quick
    spec: dict[str, tuple[str, int, float, str]] = {  # mode, requests, deadline, fault
        "endless": ("endless", 16 if quick else 40, 25 if quick else 90,
                    f"1 engine: HTTP 200 then {args.endless_kbps:g} KiB/s per answer, no frame boundary"),
        "http404": ("http404", 60, 40 if quick else 60, "1 engine answers every /generate 404"),
        "error_frame": ("error_frame", 60, 40 if quick else 60,
                        "1 engine answers every /generate with an error frame (one-shot: a 400)"),
        "silent": ("silent", 8 if quick else 20, 45 if quick else 330,
                   "1 engine's /generate never sends a byte (stream_stall_timeout_s default 300)"),
    }
    mode, n, deadline, fault = spec[name]
    healthy = run.cpu_engine()
    m = await run.manager()
    bad = run.misbehaving(mode, healthy, "--endless-kbps", str(args.endless_kbps))
    await register(m.url, [healthy, bad])
    items = mixed(n)
    for _, body in items:
        by_budget(body)
    poll = Poller(run, lambda: m.url).start()
    stop = asyncio.Event()
    side = asyncio.create_task(side_generate(m.url, stop)) if name == "endless" else None
    batch = await send_batch(m.url, items, deadline)
    stop.set()
    side_result = await side if side is not None else None
    await poll.stop()
    sc = score(items, batch.lines, by_budget)
    gone, others = await removed(run, m.url, [healthy])
    notes = [f"misbehaving engine removed: {'yes' if bad in others else 'no'}"]
    if batch.timed_out:
        notes.append(f"batch not done at the {deadline:g}s deadline ({len(batch.lines)} answered)")
    else:
        notes.append(f"batch done in {batch.wall:.1f}s")
    if side_result is not None:
        sent, failed, worst = side_result
        notes.append(f"another caller's /generate: worst {worst:.1f}s, {failed}/{sent} failed")
    if sc.first_error:
        notes.append(f"error: {sc.first_error}")
    if name == "silent":
        said = run.log_lines(r"no data|first byte|stall")
        if said:
            notes.append("manager log: " + said[0].split(": ", 1)[-1][:140])
    return Row(name, f"{n} requests x {MIXED}; 1 misbehaving + 1 healthy CPU engine", fault,
               sc.lost_text(), sc.wrong_text(), gone, poll.rss(), poll.health(), f"{batch.wall:.1f}",
               "; ".join(notes))


# ---------------------------------------------------------------- scenarios: callers


async def flood(run: Run, args: argparse.Namespace) -> Row:
    n = 10_000 if args.quick else 100_000
    deadline = 150 if args.quick else 480
    engines = [run.cpu_engine(), run.cpu_engine()]
    m = await run.manager()
    await register(m.url, engines)
    items: list[list[Any]] = [[i, gen_body(i, 1)] for i in range(n)]
    size_mb = len(json.dumps(items)) / 1e6
    for _, body in items:
        by_budget(body)
    peak: dict[str, int] = collections.defaultdict(int)

    async def watch() -> None:
        while True:
            st = await status(m.url, timeout=5)
            for inst in (st or {}).get("instances") or []:
                peak[inst["endpoint"]] = max(peak[inst["endpoint"]], int(inst.get("in_flight") or 0))
            if st:
                peak["waiting"] = max(peak["waiting"], int(st.get("requests_waiting_for_instance") or 0))
            await asyncio.sleep(1.0)

    watcher = asyncio.create_task(watch())
    poll = Poller(run, lambda: m.url).start()
    batch = await send_batch(m.url, items, deadline)
    await poll.stop()
    watcher.cancel()
    await asyncio.gather(watcher, return_exceptions=True)
    sc = score(items, batch.lines, by_budget)
    gone, _ = await removed(run, m.url, engines)
    notes = [f"peak in flight per engine {max((peak[e] for e in engines), default=0)}, "
             f"peak waiting in the manager {peak['waiting']}"]
    notes.append(f"batch not done at the {deadline}s deadline" if batch.timed_out else
                 f"{n / max(batch.wall, 1e-9):.0f} requests/s")
    if sc.first_error:
        notes.append(f"error: {sc.first_error}")
    if batch.error and not batch.timed_out:
        notes.append(f"batch: {batch.error}")
    return Row("flood", f"1 batch of {n:,} one-token requests ({size_mb:.1f} MB); 2 CPU engines",
               "the batch itself", sc.lost_text(), sc.wrong_text(), gone, poll.rss(), poll.health(),
               f"{batch.wall:.1f}", "; ".join(notes))


async def slowloris(run: Run, args: argparse.Namespace) -> Row:
    conns = 1010
    hold = 20.0 if args.quick else 60.0
    engines = [run.cpu_engine(), run.cpu_engine()]
    m = await run.manager(nofile=1024)
    await register(m.url, engines)
    poll = Poller(run, lambda: m.url).start()
    stop = asyncio.Event()
    side = asyncio.create_task(side_generate(m.url, stop, tokens=16))
    t0 = time.monotonic()

    async def connect() -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        try:  # from another loopback address, so a per-address cap can tell them from the poller
            return await asyncio.wait_for(asyncio.open_connection("127.0.0.1", m.port, local_addr=("127.0.0.2", 0)), 5)
        except (OSError, asyncio.TimeoutError):
            return None

    opened: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    for k in range(0, conns, 100):
        opened += [c for c in await asyncio.gather(*(connect() for _ in range(min(100, conns - k)))) if c]
    header = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 100_000
    pos = 0
    while time.monotonic() - t0 < hold:
        for _, w in opened:
            if not w.is_closing():
                try:
                    w.write(header[pos:pos + 1])
                except (OSError, RuntimeError):
                    pass
        pos += 1
        await asyncio.sleep(2.0)
    closed_by_manager = sum(1 for r, w in opened if r.at_eof() or w.is_closing())
    stop.set()
    sent, failed, worst = await side
    for _, w in opened:
        w.close()
    await poll.stop()
    wall = time.monotonic() - t0
    await asyncio.sleep(2.0)
    gone, _ = await removed(run, m.url, engines)
    lost = f"{failed} of {sent} /generate" + (" (refused or timed out)" if failed else "")
    notes = (f"{len(opened)} slow connections opened from 127.0.0.2, {closed_by_manager} closed by the manager "
             f"within {hold:g}s; another caller's /generate worst {worst:.1f}s")
    return Row("slowloris", f"{conns} connections sending a header byte every 2 s for {hold:g}s; "
               "/generate x 16 tokens every 0.5 s; 2 CPU engines", "manager at ulimit -n 1024 (soft = hard)",
               lost, "-", gone, poll.rss(), poll.health(), f"{wall:.1f}", notes)


async def slow_readers(run: Run, args: argparse.Namespace) -> Row:
    clients = 12
    per, tokens = (200, 512) if args.quick else (1000, 1024)
    deadline = 75.0 if args.quick else 120.0  # past a write timeout of a minute
    backends = [run.instant_fake(tokens), run.instant_fake(tokens)]
    m = await run.manager()
    await register(m.url, backends)
    poll = Poller(run, lambda: m.url).start()
    t0 = time.monotonic()
    socks: list[socket.socket] = []
    unsent: list[str] = []
    for c in range(clients):
        items = [[f"{c}-{i}", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": tokens}}]
                 for i in range(per)]
        body = json.dumps(items).encode()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # and never read
        sock.settimeout(10)  # the body fits the socket buffers; never hang here whatever the manager does
        socks.append(sock)
        try:
            sock.connect(("127.0.0.1", m.port))
            sock.sendall(b"POST /batch_generate_requests HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                         b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        except OSError as exc:
            unsent.append(f"{type(exc).__name__}")
    ports = {s.getsockname()[1] for s in socks if s.fileno() >= 0}

    # a well-behaved caller beside them: small batches, read at once
    expected = list(range(1, 17))
    good = Score()
    stop = asyncio.Event()

    async def polite() -> None:
        b = 0
        while not stop.is_set():
            items = [[f"p{b}-{i}", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 16}}]
                     for i in range(20)]
            b += 1
            res = await send_batch(m.url, items, 30)
            part = score(items, res.lines, lambda _: expected)
            good.n += part.n
            good.unanswered += part.unanswered
            good.failed.update(part.failed)
            good.wrong_tokens += part.wrong_tokens
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except asyncio.TimeoutError:
                pass

    polite_task = asyncio.create_task(polite())
    idle = 0
    while time.monotonic() - t0 < deadline:  # until the manager has nothing left to do, or the deadline
        await asyncio.sleep(1.0)
        st = await status(m.url)
        busy = st is None or sum(int(i.get("in_flight") or 0) for i in st.get("instances") or []) > 0 \
            or int(st.get("requests_waiting_for_instance") or 0) > 0
        idle = 0 if busy else idle + 1
        if idle >= 3 and time.monotonic() - t0 > 5:
            break
    settled = time.monotonic() - t0
    rss_held = run.rss_mb(m)
    held = sum(sockets(m.pid, ports)[2].values())
    dropped_at = None  # then until the manager lets go of the stalled connections (a write timeout), or the deadline
    while held and time.monotonic() - t0 < deadline:
        await asyncio.sleep(1.0)
        held = sum(sockets(m.pid, ports)[2].values())
        if not held:
            dropped_at = time.monotonic() - t0
    stop.set()
    await polite_task
    for s in socks:
        s.close()
    await poll.stop()
    await asyncio.sleep(3.0)
    rss_after = run.rss_mb(m)
    gone, _ = await removed(run, m.url, backends)
    let_go = (f"the manager closed all {clients} stalled connections {dropped_at:.0f}s after their batches were sent"
              if dropped_at is not None else
              f"the manager still held {held} of {clients} stalled connections at {time.monotonic() - t0:.0f}s"
              if held else f"the manager had closed all {clients} stalled connections by then")
    notes = (f"manager {'idle' if settled < deadline else 'still busy'} after {settled:.0f}s (RSS {rss_held:.0f} MB); "
             f"{let_go}; RSS {rss_after:.0f} MB 3 s after the clients closed"
             + (f"; {len(unsent)} could not send their batch ({unsent[0]})" if unsent else ""))
    return Row("slow_readers", f"{clients} clients x {per} requests x {tokens} tokens (2 instant fake engines); "
               "another caller's batches of 20", "the 12 clients never read their answers",
               f"{good.lost_text()} of the other caller's", f"{good.wrong_tokens} / -", gone, poll.rss(),
               poll.health(), f"{settled:.1f}", notes)


async def raw_request(port: int, head: bytes, body: bytes = b"", timeout: float = 30.0) -> tuple[int, bytes]:
    """Send bytes as they are (aiohttp would refuse some); (status, body) of the answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(-1), timeout)
    finally:
        writer.close()
    status_line, _, rest = data.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


async def odd_input(run: Run, args: argparse.Namespace) -> Row:
    token = "reliability-bench-token"
    engine = run.cpu_engine()
    m = await run.manager(f"auth_token={token}")
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as s:
        for ep in [engine]:
            await wait_ok(f"http://{ep}/health")
            host, port = ep.rsplit(":", 1)
            async with s.post(m.url + "/register_rollout_instance", json={"host": host, "port": int(port)}) as r:
                assert r.status == 200, await r.text()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            async with s.get(m.url + "/get_instances_status") as r:
                if (await r.json())["ready_instances"] == 1:
                    break
            await asyncio.sleep(0.1)
    poll = Poller(run, lambda: m.url).start()
    t0 = time.monotonic()
    results: list[str] = []
    auth = f"Authorization: Bearer {token}\r\n".encode()
    head = b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    for depth in (255, 300, 1024, 100_000):
        body = (b'{"input_ids":[1,2,3],"sampling_params":{"max_new_tokens":2,"custom_params":{"x":'
                + b"[" * depth + b"]" * depth + b"}}}")
        code, answer = await raw_request(m.port, head + auth, body)
        results.append(f"nesting {depth}: {code}")
    plain = json.dumps(gen_body(1, 2)).encode()
    code, _ = await raw_request(m.port, head + b"Authorization: Bearer \xff\r\n", plain)
    results.append(f"0xFF in Authorization: {code}")
    batch = json.dumps([[1, gen_body(1, 2)], ["1", gen_body(2, 2)]]).encode()
    code, answer = await raw_request(m.port, head.replace(b"/generate", b"/batch_generate_requests") + auth, batch)
    ids = re.findall(rb'"id":\s*(?:"1"|1)(?=[,}\s])', answer)
    results.append(f"ids 1 and \"1\": {code}, {len(ids)} line(s)")
    await poll.stop()
    alive = m.proc.poll() is None
    gone, _ = await removed(run, m.url, [engine])
    return Row("odd_input", "one request each; 1 CPU engine; manager with a token", "deep JSON nesting in "
               "sampling_params.custom_params, a raw 0xFF byte in Authorization, ids 1 and \"1\" in one batch",
               "caller's fault; statuses: " + ", ".join(results), "-", gone, poll.rss(), poll.health(),
               f"{time.monotonic() - t0:.1f}", "manager still up" if alive else "MANAGER EXITED")


# ---------------------------------------------------------------- scenarios: the manager stops


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((time.monotonic(), record.getMessage()))


async def manager_stops(run: Run, args: argparse.Namespace) -> Row:
    """restart: SIGKILL after half the results, a new manager on the same port, the engines registered
    again as their launchers would. sigstop: SIGSTOP after half, SIGCONT after the freeze. The trainer
    side is trainer_plugin's RolloutStream with its defaults."""
    from trainer_plugin.client import ManagerClient
    from trainer_plugin.streaming import RolloutStream

    kill = run.name == "restart"
    n, tokens = 200, 16
    freeze = 5.0 if args.quick else 20.0
    deadline = 60.0 if args.quick else 120.0
    flags = ("--max-running-requests", "8", "--token-delay-s", "0.02")  # results come over a few seconds
    engines = [run.cpu_engine(*flags), run.cpu_engine(*flags)]
    m = await run.manager()
    await register(m.url, engines)
    prompts = [prompt_of(i) for i in range(n)]
    for p in prompts:
        reference(p, tokens)
    handler = _Collect()
    logging.getLogger("trainer_plugin").addHandler(handler)
    current = [m]
    poll: Poller | None = None
    delivered: list[str] = []
    wrong = 0
    times: list[float] = []
    fault_at: float | None = None
    error = ""
    reregistered: list[float] = []
    background: list[asyncio.Task[None]] = []

    async def come_back(new: Manager) -> None:
        await register(new.url, engines)
        reregistered.append(time.monotonic())

    async def step() -> None:
        nonlocal wrong, fault_at, poll
        async with ManagerClient(m.url) as client:
            stream = RolloutStream(client, prompts, n=1, min_stream_batch_size=1,
                                   sampling_params={"max_new_tokens": tokens, "temperature": 0},
                                   output="micro_batch")
            async for mb in stream:
                ids = list(mb.non_tensors["request_id"])
                for row, rid in enumerate(ids):
                    g = int(str(rid).rsplit("-", 2)[1])
                    length = int(mb.non_tensors["response_len"][row])
                    out = [int(t) for t in mb.tensors["responses"][row, :length].tolist()]
                    ref = reference(prompts[g], tokens)
                    wrong += sum(1 for a, b in zip(out, ref) if a != b) + abs(len(out) - len(ref))
                    delivered.append(str(rid))
                    times.append(time.monotonic())
                if fault_at is None and len(delivered) >= n // 2:
                    fault_at = time.monotonic()
                    poll = Poller(run, lambda: current[0].url).start()
                    run.memory()
                    if kill:
                        os.kill(m.pid, signal.SIGKILL)
                        m.proc.wait()
                        new = await run.manager(port=m.port)
                        current[0] = new
                        background.append(asyncio.create_task(come_back(new)))
                    else:
                        os.kill(m.pid, signal.SIGSTOP)
                        asyncio.get_running_loop().call_later(freeze, os.kill, m.pid, signal.SIGCONT)

    t0 = time.monotonic()
    try:
        await asyncio.wait_for(step(), deadline)
    except asyncio.TimeoutError:
        error = f"step not done at the {deadline:g}s deadline"
    except Exception as exc:  # what the trainer would see
        error = f"{type(exc).__name__}: {exc}"[:200]
    finally:
        logging.getLogger("trainer_plugin").removeHandler(handler)
    wall = time.monotonic() - t0
    for task in background:  # the poller sees the restart through, whatever the client did
        try:
            await asyncio.wait_for(task, 30)
        except Exception:  # reported as not re-registered
            task.cancel()
    if poll is not None:
        await poll.stop()
    unique = set(delivered)
    lost = n - len(unique)
    dup = len(delivered) - len(unique)
    gone, _ = await removed(run, current[0].url, engines)
    notes: list[str] = []
    if fault_at is not None:
        after = [t for t in times if t > fault_at]
        gaps = [b - a for a, b in zip([fault_at, *after], after)]
        notes.append(f"{len(after)} delivered after the fault; longest silence {max(gaps):.1f}s" if gaps
                     else "nothing delivered after the fault")
        if kill:
            notes.append("engines registered again " + (f"{reregistered[0] - fault_at:.1f}s after the kill"
                                                        if reregistered else "NOT"))
        warned = [(t - fault_at, msg) for t, msg in handler.records if t >= fault_at]
        notes.append(f"client reported it after {warned[0][0]:.1f}s: {warned[0][1][:120]}" if warned
                     else "client logged no warning")
    if error:
        notes.append("step raised " + error if not error.startswith("step not") else error)
    fault = ("manager SIGKILLed after half the results, restarted on the same port" if kill
             else f"manager SIGSTOPped {freeze:g}s after half the results")
    lost_text = f"{lost} of {n}" + (f", {dup} delivered twice" if dup else ", 0 delivered twice")
    return Row(run.name, f"RolloutStream: {n} requests x {tokens} tokens; 2 CPU engines", fault, lost_text,
               f"{wrong} / -", gone, poll.rss() if poll else "-", poll.health() if poll else "-", f"{wall:.1f}",
               "; ".join(notes))


# ---------------------------------------------------------------- driver

SCENARIOS: dict[str, Callable[[Run, argparse.Namespace], Awaitable[Row]]] = {
    **{name: wrong_tokens for name in WRONG_MODES},
    "endless": engine_fault,
    "http404": engine_fault,
    "error_frame": engine_fault,
    "silent": engine_fault,
    "flood": flood,
    "slowloris": slowloris,
    "slow_readers": slow_readers,
    "odd_input": odd_input,
    "restart": manager_stops,
    "sigstop": manager_stops,
}
LIMIT_S = {"silent": 420.0, "flood": 600.0}  # the whole scenario, start-up included; others: 300 s


async def main_async(args: argparse.Namespace) -> None:
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    names = args.scenario or list(SCENARIOS)
    rows: list[Row] = []
    t_all = time.monotonic()
    for name in names:
        run = Run(name, logs)
        t0 = time.monotonic()
        limit = LIMIT_S.get(name, 300.0)
        try:
            row = await asyncio.wait_for(SCENARIOS[name](run, args), limit)
        except asyncio.TimeoutError:
            row = Row(name, "-", "-", notes=f"GAVE UP: scenario over its {limit:g}s limit")
        except Exception as exc:  # one scenario's breakage must not hide the others' figures
            row = Row(name, "-", "-", notes=f"ERROR: {type(exc).__name__}: {exc}"[:300])
        finally:
            run.close()
        rows.append(row)
        print(f"[{time.monotonic() - t_all:6.0f}s] {name} ({time.monotonic() - t0:.0f}s): "
              + json.dumps(row.__dict__), flush=True)
    print(f"\n{'quick' if args.quick else 'full'} run, {len(rows)} scenario(s) in {time.monotonic() - t_all:.0f}s; "
          f"{os.cpu_count()} cores; manager --set {' '.join(MANAGER_SETS)}; logs in {logs}\n")
    print(table(rows))
    if args.out:
        Path(args.out).write_text(table(rows) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", action="append", choices=list(SCENARIOS), help="run only these (repeat)")
    parser.add_argument("--quick", action="store_true", help="small loads and short faults")
    parser.add_argument("--endless-kbps", type=float, default=640.0, help="endless: KiB/s per stream")
    parser.add_argument("--logs", default=os.environ.get("BENCH_LOGS", "/tmp/bench-reliability"))
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # slowloris opens ~1,000 sockets from here
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout` still stops the processes
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
