"""Chaos under load, as bounded tests (issue 8).

1. 2,000 greedy requests, 200 in flight (half through NDJSON batches as the trainer sends them, half
   as concurrent ``/generate`` calls), over 4 CPU engines while a seeded chaos task SIGKILLs a random
   active engine every 0.5-1 s and starts and registers a replacement on a new port. Every request
   completes with the reference sequence, every id once, segments tiling the output (no token made
   twice), the manager's RSS bounded, no in-flight accounting left over, dead instances removed.
2. An engine that stalls without closing its connections, under load: everything completes, the
   stalled engine is removed, nothing hangs.
3. An engine whose weight load outlasts many health-check intervals (``--load-delay-s``: its health
   endpoints answer 503 meanwhile) is not declared dead, with requests in flight at the version bump
   and more arriving during the load.

Two bugs the load tests found (now fixed) have their own small deterministic tests:
a continued sequence reports ``finish_reason.length`` = its last segment's budget, and a sequence
whose final chunk arrived just before its engine died is continued past its stop token. The load
tests check both on every result too.

Engines are forked from a warm helper (``engine_zygote.py``: the real ``cpu_engine`` command line,
without re-importing torch per engine), so replacing an engine every half second fits on 2 cores.
Each test prints one ``CHAOS-REPORT {json}`` line (``pytest -s``) with the figures of the report.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from support import PY, ROOT, OnLoopback, async_wait_until, free_port, rss_mb

from rollout_manager.cpu_engine.model import build_model, reference_generate

pytestmark = pytest.mark.slow  # every test here starts real processes

MAX_NEW = 16
GREEDY = {"temperature": 0.0, "max_new_tokens": MAX_NEW}
N_PROMPTS, N_SAMPLES = 125, 16  # GRPO-style: 125 prompts x 16 samples = 2,000 requests
CONCURRENCY = 200
RSS_BOUND_MB = 100


# ---------------------------------------------------------------------------- engines


@dataclass
class ForkedEngine(OnLoopback):
    pid: int
    port: int
    log_path: Path
    flags: tuple[str, ...]
    killed: bool = False

    def alive(self) -> bool:
        try:
            os.kill(self.pid, 0)  # the helper ignores SIGCHLD, so a dead child is reaped at once
        except ProcessLookupError:
            return False
        return True

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""


class Fleet:
    """CPU engines forked from one warm helper process; every engine is killed by its pid at the end."""

    def __init__(self, tmp_path: Path):
        self.tmp_path = tmp_path
        self.engines: list[ForkedEngine] = []
        self.used_ports: set[int] = set()
        self.dead_cpu_s = 0.0
        self._lock = asyncio.Lock()
        self._helper_log = open(tmp_path / "engine-zygote.log", "wb")
        self.helper = subprocess.Popen(
            [PY, str(ROOT / "tests" / "engine_zygote.py")], cwd=ROOT, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self._helper_log, text=True, start_new_session=True,
        )

    async def ready(self) -> None:
        line = await asyncio.wait_for(asyncio.to_thread(self.helper.stdout.readline), 60)
        assert line.strip() == "ready", f"engine helper did not start: {line!r}"

    def _new_port(self) -> int:
        while True:
            port = free_port()
            if port not in self.used_ports:  # a new endpoint each time, never a dead one's
                self.used_ports.add(port)
                return port

    async def spawn(self, *flags: str, wait: bool = True) -> ForkedEngine:
        async with self._lock:
            port = self._new_port()
            log_path = self.tmp_path / f"engine-{port}.log"
            args = ["--port", str(port), "--seed", "0", *flags]
            self.helper.stdin.write(json.dumps([str(log_path), *args]) + "\n")
            self.helper.stdin.flush()
            pid = int(await asyncio.wait_for(asyncio.to_thread(self.helper.stdout.readline), 30))
        engine = ForkedEngine(pid, port, log_path, tuple(flags))
        self.engines.append(engine)
        if wait:
            await self.wait_ready(engine)
        return engine

    async def wait_ready(self, engine: ForkedEngine, timeout: float = 30.0) -> None:
        async with aiohttp.ClientSession() as s:
            async def healthy() -> bool:
                if not engine.alive():
                    raise AssertionError(f"engine {engine.flags} on port {engine.port} exited:\n{engine.log()}")
                try:
                    async with s.get(engine.url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                        return r.status == 200
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    return False

            await async_wait_until(healthy, timeout, interval_s=0.02,
                                   message=lambda: f"engine on port {engine.port} to be healthy:\n{engine.log()}")

    def kill(self, engine: ForkedEngine) -> None:
        try:
            self.dead_cpu_s += _proc_cpu(engine.pid)
        except (OSError, IndexError):
            pass
        engine.killed = True
        try:
            os.kill(engine.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def cpu_s(self) -> float:
        """CPU seconds used by every engine so far (killed ones counted when killed)."""
        live = 0.0
        for e in self.alive():
            try:
                live += _proc_cpu(e.pid)
            except (OSError, IndexError):
                pass
        return self.dead_cpu_s + live

    def alive(self) -> list[ForkedEngine]:
        return [e for e in self.engines if not e.killed and e.alive()]

    def stop(self) -> None:
        for engine in self.engines:
            if engine.alive():
                self.kill(engine)
        if self.helper.poll() is None:
            try:
                os.killpg(self.helper.pid, signal.SIGKILL)  # the helper and anything it forked
            except ProcessLookupError:
                pass
        self.helper.wait(10)
        self._helper_log.close()


@pytest.fixture
async def fleet(tmp_path):
    f = Fleet(tmp_path)
    try:
        await f.ready()
        yield f
    finally:
        f.stop()


@pytest.fixture
async def load_session():
    """The load's own client: no connection cap (aiohttp's default of 100 would cap the concurrency)."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        yield s


# ---------------------------------------------------------------------------- references and checks


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(8)
    return [[rng.randrange(256) for _ in range(rng.randint(1, 8))] for _ in range(N_PROMPTS)]


@pytest.fixture(scope="module")
def references(prompts) -> dict[tuple[int, ...], list[int]]:
    """Greedy output per distinct prompt, computed in-process exactly as the engine does."""
    model = build_model(0)
    return {tuple(p): reference_generate(model, p, MAX_NEW)[0] for p in prompts}


def requests_for(prompts: list[list[int]], samples: int, prefix: str) -> list[tuple[str, list[int]]]:
    return [(f"{prefix}{i}-{k}", p) for i, p in enumerate(prompts) for k in range(samples)]


@dataclass
class Tally:
    requests: int = 0
    ok: int = 0
    continued: int = 0
    segments: int = 0
    tokens: int = 0
    regenerated: int = 0
    max_segments: int = 0  # most instances one sequence needed (max_attempts_per_request bounds it)
    segments_hist: dict[int, int] = field(default_factory=dict)  # segments per result -> results
    empty_segments: int = 0  # failed segments that produced no token (sent to an instance already gone)
    errors: list[str] = field(default_factory=list)

    def check(self, rid: str, prompt: list[int], data: Any, references: dict) -> None:
        """One result: the reference tokens, finished by length, segments tiling [0, len) exactly."""
        self.requests += 1
        out = data["output_ids"]
        meta = data["meta_info"]
        segs = meta["segments"]
        problems = []
        if out != references[tuple(prompt)]:
            problems.append(f"output {out} != reference {references[tuple(prompt)]}")
        finish = meta["finish_reason"]
        if not isinstance(finish, dict) or finish.get("type") != "length":
            problems.append(f"finish_reason {finish}")
        elif finish.get("length") != MAX_NEW:
            problems.append(f"finish_reason.length {finish.get('length')} != {MAX_NEW}")
        bounds = [(s["start"], s["end"]) for s in segs]
        tiles = (bool(segs) and segs[0]["start"] == 0 and segs[-1]["end"] == len(out)
                 and all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
                 and all(s <= e for s, e in bounds))
        if not tiles:
            problems.append(f"segments {bounds} do not tile [0, {len(out)})")
        if segs and segs[-1]["outcome"] != "finished":
            problems.append(f"last segment outcome {segs[-1]['outcome']!r}")
        # An earlier segment ended because its engine failed, or because tail migration moved it on.
        if any(not s["outcome"].startswith(("failed", "migrated to ")) for s in segs[:-1]):
            problems.append(f"earlier segments neither failed nor migrated: {[s['outcome'] for s in segs]}")
        if problems:
            self.errors.append(f"{rid}: " + "; ".join(problems))
            return
        self.ok += 1
        self.tokens += len(out)
        self.segments += len(segs)
        self.continued += len(segs) > 1
        self.max_segments = max(self.max_segments, len(segs))
        self.segments_hist[len(segs)] = self.segments_hist.get(len(segs), 0) + 1
        self.empty_segments += sum(1 for s, e in bounds[:-1] if s == e)
        self.regenerated += sum(e - s for s, e in bounds) - len(out)


def _proc_cpu(pid: int) -> float:
    """User + system CPU seconds of a process (fields 14 and 15 of /proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def auth_headers(m) -> dict[str, str]:
    return dict(getattr(m, "headers", {}) or {})


# ---------------------------------------------------------------------------- load


async def ndjson_batch(session: aiohttp.ClientSession, m, items: list[tuple[str, list[int]]]) -> list[dict]:
    body = [[rid, {"input_ids": p, "sampling_params": GREEDY}] for rid, p in items]
    lines = []
    async with session.post(m.url + "/batch_generate_requests", json=body, headers=auth_headers(m)) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            if raw.strip():
                lines.append(json.loads(raw))
    return lines


async def run_ndjson(session, m, items, batch_size: int, tally: Tally, ids_seen: list[str], refs: dict) -> None:
    """The trainer's way: one batch after another, each streamed back as NDJSON."""
    by_id = dict(items)
    for start in range(0, len(items), batch_size):
        chunk = items[start:start + batch_size]
        lines = await ndjson_batch(session, m, chunk)
        got = [line["id"] for line in lines]
        assert sorted(got) == sorted(rid for rid, _ in chunk), "every id exactly once per batch"
        for line in lines:
            ids_seen.append(line["id"])
            if not line["success"]:
                tally.requests += 1
                tally.errors.append(f"{line['id']}: {line.get('status_code')} {line.get('error')}")
            else:
                tally.check(line["id"], by_id[line["id"]], line["data"], refs)


async def run_generate(session, m, items, concurrency: int, tally: Tally, ids_seen: list[str],
                       refs: dict) -> None:
    """Concurrent single ``/generate`` calls, at most ``concurrency`` in flight."""
    sem = asyncio.Semaphore(concurrency)

    async def one(rid: str, prompt: list[int]) -> None:
        async with sem:
            body = {"input_ids": prompt, "sampling_params": GREEDY, "rid": rid}
            async with session.post(m.url + "/generate", json=body, headers=auth_headers(m)) as r:
                data = await r.json(content_type=None)
                status = r.status
        ids_seen.append(rid)
        if status != 200:
            tally.requests += 1
            tally.errors.append(f"{rid}: HTTP {status} {data}")
            return
        if data["meta_info"].get("id") != rid:
            tally.errors.append(f"{rid}: answered as {data['meta_info'].get('id')}")
        tally.check(rid, prompt, data, refs)

    await asyncio.gather(*(one(rid, p) for rid, p in items))


async def register(m, *engines: ForkedEngine, wait_active: bool = True, **extra: Any) -> None:
    for e in engines:
        status, body = await m.post("/register_rollout_instance", {"host": "127.0.0.1", "port": e.port, **extra})
        assert status == 200, body
    if wait_active:
        for e in engines:
            await async_wait_until(lambda e=e: _state_is(m, e.endpoint, "active"),
                                   message=f"{e.endpoint} active")


async def _state_is(m, endpoint: str, state: str) -> bool:
    return await m.state_of(endpoint) == state


async def settle(m, fleet: Fleet, removed: list[str], timeout: float = 30.0) -> dict[str, Any]:
    """Wait until the registry is exactly the live engines, all active, and nothing is in flight."""
    alive = {e.endpoint for e in fleet.alive()}

    async def settled() -> dict[str, Any] | None:
        st = await m.status()
        insts = {i["endpoint"]: i for i in st["instances"]}
        if set(insts) != alive or any(i["state"] != "active" for i in insts.values()):
            return None
        if any(i["in_flight"] or i["in_flight_tokens"] for i in insts.values()):
            return None
        return st

    st = await async_wait_until(settled, timeout, interval_s=0.1,
                                message=f"registry == live engines {sorted(alive)}, all active, in_flight 0; "
                                f"removed {len(removed)} dead")
    assert not set(removed) & {i["endpoint"] for i in st["instances"]}
    return st


def report(name: str, **figures: Any) -> None:
    print(f"\nCHAOS-REPORT {json.dumps({'scenario': name, **figures})}", flush=True)


# ---------------------------------------------------------------------------- 1. SIGKILL chaos


async def chaos_monkey(m, fleet: Fleet, rng: random.Random, stop: asyncio.Event, killed: list[str],
                       *, period: tuple[float, float] = (0.5, 1.0)) -> None:
    """Every 0.5-1 s: SIGKILL a random active engine (never the last one), start and register a new one."""
    while True:
        try:
            await asyncio.wait_for(stop.wait(), rng.uniform(*period))
            return
        except asyncio.TimeoutError:
            pass
        active = {i["endpoint"] for i in (await m.status())["instances"] if i["state"] == "active"}
        alive = fleet.alive()
        candidates = [e for e in alive if e.endpoint in active]
        if len(alive) < 2 or not candidates:
            continue  # keep at least one engine alive
        victim = rng.choice(candidates)
        fleet.kill(victim)
        killed.append(victim.endpoint)
        replacement = await fleet.spawn()
        await register(m, replacement, wait_active=False)


async def test_2000_requests_at_200_concurrent_while_engines_are_sigkilled_and_replaced(
        start_manager, fleet, load_session, prompts, references):
    # A kill every 0.75 s over 4 engines (each lives ~3 s) hits a sequence up to 6 times (segments_hist
    # in the report: 7 segments ~5 per run). The default budget of 8 attempts would lose a request in
    # some runs through no fault of its own, so this test allows more; no_instance_wait bounds hangs.
    m = await start_manager(no_instance_wait_timeout_s="30", max_attempts_per_request="16")
    engines = [await fleet.spawn() for _ in range(4)]
    await register(m, *engines)

    # Warm-up (no faults): connections, allocator arenas, rate meters; then the RSS baseline.
    warm, warm_ids = Tally(), []
    await run_ndjson(load_session, m, requests_for(prompts[:25], 8, "w"), 200, warm, warm_ids, references)
    assert not warm.errors, warm.errors[:5]
    rss_before = rss_mb(m.proc.pid)

    items = requests_for(prompts, N_SAMPLES, "r")
    rng = random.Random(1234)
    rng.shuffle(items)
    half = len(items) // 2
    tally, ids_seen, killed = Tally(), [], []
    stop = asyncio.Event()
    t0 = time.monotonic()
    cpu0 = (_proc_cpu(m.proc.pid), fleet.cpu_s())
    monkey = asyncio.ensure_future(chaos_monkey(m, fleet, random.Random(42), stop, killed))
    try:
        await asyncio.wait_for(asyncio.gather(
            run_ndjson(load_session, m, items[:half], CONCURRENCY // 2, tally, ids_seen, references),
            run_generate(load_session, m, items[half:], CONCURRENCY // 2, tally, ids_seen, references),
        ), timeout=100)
    finally:
        stop.set()
        await monkey  # surfaces any error of the chaos task
    wall = time.monotonic() - t0
    manager_cpu, engines_cpu = _proc_cpu(m.proc.pid) - cpu0[0], fleet.cpu_s() - cpu0[1]
    rss_after = rss_mb(m.proc.pid)

    assert sorted(ids_seen) == sorted(rid for rid, _ in items), "every request answered exactly once"
    assert not tally.errors, f"{len(tally.errors)} bad results, e.g. {tally.errors[:5]}"
    assert tally.ok == len(items) == 2000 and tally.regenerated == 0
    assert len(killed) >= 10, f"only {len(killed)} kills in {wall:.1f}s: the chaos did not run"
    assert tally.continued > 0, "the kills should have interrupted some sequences"
    st = await settle(m, fleet, killed)
    assert st["generation"]["failed"] == 0, st["generation"]
    growth = rss_after - rss_before
    report("sigkill", requests=len(items), concurrency=CONCURRENCY, engines=4, max_new_tokens=MAX_NEW,
           kills=len(killed), restarts=len(killed), lost=len(items) - tally.ok, continued=tally.continued,
           segments=tally.segments, max_segments=tally.max_segments, regenerated=tally.regenerated,
           segments_hist=dict(sorted(tally.segments_hist.items())), empty_segments=tally.empty_segments,
           wall_s=round(wall, 1),
           rss_before_mb=round(rss_before, 1), rss_after_mb=round(rss_after, 1), rss_growth_mb=round(growth, 1),
           manager_continuations=st["generation"].get("continuations"), manager_cpu_s=round(manager_cpu, 1),
           engines_cpu_s=round(engines_cpu, 1))
    assert growth < RSS_BOUND_MB, f"manager RSS grew {growth:.1f} MB ({rss_before:.1f} -> {rss_after:.1f})"


# ---------------------------------------------------------------------------- 2. a stalled engine


async def test_engine_that_stalls_with_open_connections_under_load(start_manager, fleet, load_session, prompts,
                                                                   references):
    stall_timeout = 1.0
    # Token by token (engine_stream_interval=1): the stall comes after a given token count.
    m = await start_manager(stream_stall_timeout_s=str(stall_timeout), no_instance_wait_timeout_s="30",
                            engine_stream_interval="1")
    healthy = [await fleet.spawn() for _ in range(3)]
    stalling = await fleet.spawn("--stall-after-tokens", "300")  # mid-way through the first batch
    await register(m, *healthy, stalling)
    rss_before = rss_mb(m.proc.pid)

    items = requests_for(prompts[:75], 8, "s")  # 600 requests, 200 per NDJSON batch
    tally, ids_seen = Tally(), []
    t0 = time.monotonic()
    cpu0 = (_proc_cpu(m.proc.pid), fleet.cpu_s())
    await asyncio.wait_for(run_ndjson(load_session, m, items, CONCURRENCY, tally, ids_seen, references),
                           timeout=60)
    wall = time.monotonic() - t0
    manager_cpu, engines_cpu = _proc_cpu(m.proc.pid) - cpu0[0], fleet.cpu_s() - cpu0[1]
    rss_after = rss_mb(m.proc.pid)

    assert sorted(ids_seen) == sorted(rid for rid, _ in items)
    assert not tally.errors, f"{len(tally.errors)} bad results, e.g. {tally.errors[:5]}"
    assert tally.ok == len(items) and tally.regenerated == 0
    assert tally.continued > 0, "some sequences should have been on the stalled engine"
    assert stalling.alive(), "the stalled engine keeps its process and connections"
    await async_wait_until(lambda: _gone(m, stalling.endpoint), 10, message="stalled engine removed")
    st = await m.status()
    assert {i["endpoint"] for i in st["instances"]} == {e.endpoint for e in healthy}
    assert all(i["in_flight"] == 0 and i["in_flight_tokens"] == 0 for i in st["instances"])
    assert st["generation"]["failed"] == 0
    # The log keeps the details of the removal (the event may have scrolled out of recent_events).
    removal = [e for e in st["recent_events"] if e["endpoint"] == stalling.endpoint and e["to"] == "dead"]
    report("stall", requests=len(items), concurrency=CONCURRENCY, engines=4, max_new_tokens=MAX_NEW,
           stall_after_tokens=300, stream_stall_timeout_s=stall_timeout, lost=len(items) - tally.ok,
           continued=tally.continued, regenerated=tally.regenerated, wall_s=round(wall, 1),
           rss_growth_mb=round(rss_after - rss_before, 1),
           manager_cpu_s=round(manager_cpu, 1), engines_cpu_s=round(engines_cpu, 1),
           removal_reason=removal[0]["reason"] if removal else None)


async def _gone(m, endpoint: str) -> bool:
    return await m.state_of(endpoint) is None


# ---------------------------------------------------------------------------- found by the load tests


async def test_continued_sequence_reports_the_callers_length(start_manager, fleet, references, prompts):
    """A continued sequence must finish as one instance would have: ``length`` = the caller's budget.

    Bug (found by the SIGKILL test, where about half the results were continued): the last segment's
    engine was asked for the *remaining* tokens, and its ``finish_reason`` (``{"type": "length",
    "length": remaining}``) is returned as is, so a 16-token request continued after 5 tokens reports
    ``length: 11``. SGLang reports the request's ``max_new_tokens`` there.
    """
    m = await start_manager(engine_stream_interval="1")  # token by token: the engine dies after 5 sent
    dying = await fleet.spawn("--die-after-tokens", "5", "--token-delay-s", "0.005")
    healthy = await fleet.spawn()
    await register(m, dying)  # the only choice for the first attempt
    prompt = prompts[0]
    req = asyncio.ensure_future(m.post("/generate", {"input_ids": prompt, "sampling_params": GREEDY}))
    await async_wait_until(lambda: not dying.alive(), message="the dying engine to die")
    await register(m, healthy)
    status, out = await req
    assert status == 200, out
    assert out["output_ids"] == references[tuple(prompt)]
    first, second = out["meta_info"]["segments"]
    assert first["end"] == second["start"] > 0 and second["end"] == MAX_NEW
    assert out["meta_info"]["completion_tokens"] == MAX_NEW
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": MAX_NEW}


async def test_sequence_whose_final_chunk_arrived_is_not_continued_past_its_stop(start_manager, fleet):
    """An engine that dies after sending a sequence's final chunk but before ``data: [DONE]``.

    Bug (found by the SIGKILL test: in one of four runs one result had a last segment
    ``failed: ClientPayloadError`` although all its tokens had arrived): a stream cut before
    ``[DONE]`` is a failure even when its last chunk already carried ``finish_reason``, so the
    sequence is continued whenever it has budget left. With a length finish that is harmless (no
    budget left: the manager makes up a length finish, and drops the text and meta_info); with a
    stop it is not: the sequence is continued *past its stop token* on another instance and the
    trainer gets tokens no engine would have produced.
    """
    m = await start_manager()
    model = build_model(0)
    prompt = [1, 2, 3]
    free = reference_generate(model, prompt, MAX_NEW)[0]
    stop = free[4]
    assert stop not in free[:4]
    params = {**GREEDY, "stop_token_ids": [stop]}
    expected = reference_generate(model, prompt, MAX_NEW, stop_token_ids=[stop])[0]
    assert len(expected) == 5
    # Exits right after writing its 5th token, which is the final chunk (finish_reason stop).
    dying = await fleet.spawn("--die-after-tokens", "5")
    healthy = await fleet.spawn()
    await register(m, dying)
    req = asyncio.ensure_future(m.post("/generate", {"input_ids": prompt, "sampling_params": params}))
    await async_wait_until(lambda: not dying.alive(), message="the dying engine to die")
    await register(m, healthy)
    status, out = await asyncio.wait_for(req, 30)
    assert status == 200, out
    segments = [(s["start"], s["end"], s["outcome"][:40]) for s in out["meta_info"]["segments"]]
    assert out["output_ids"] == expected, segments
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


# ---------------------------------------------------------------------------- 3. slow weight load


LOAD_DELAY_S = 3.0  # the CPU engine's --load-delay-s: health answers 503 while the load runs
WEIGHT_MODEL = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2}


async def test_weight_load_longer_than_health_interval_is_not_death(start_manager, fleet, load_session, tmp_path):
    """Probes every 0.2 s (0.5 s timeout, 2 failures evict) would remove the box within ~0.5 s of its
    3 s load; the manager does not probe syncing instances, so it comes back active at version 1."""
    from support import Proc

    from rollout_manager.weights.sender_agent import SenderAgent

    sender_port = free_port()
    interval, probe_timeout, threshold = 0.2, 0.5, 2  # 2 failed probes (503, or 0.5 s timeouts) evict
    m = await start_manager(weight_sender_base_port=str(sender_port), allowed_sender_ips="127.0.0.0/8",
                            weight_transport="tcp", weight_push_timeout_s="30",
                            health_check_interval_s=str(interval), health_check_timeout_s=str(probe_timeout),
                            health_failure_threshold=str(threshold), weight_activation="drain")
    sender = SenderAgent(["127.0.0.1"], sender_port).start()
    model_json = json.dumps(WEIGHT_MODEL)
    slow = await fleet.spawn("--model-config", model_json, "--load-delay-s", str(LOAD_DELAY_S),
                             "--token-delay-s", "0.02")
    rport = free_port()
    receiver = Proc([PY, "-m", "rollout_manager.weights.receiver_agent", "--host", "127.0.0.1",
                     "--port", str(rport), "--sglang-url", slow.url], tmp_path / f"receiver-{rport}.log",
                    env={"MC_LOG_LEVEL": "ERROR", "GLOG_minloglevel": "2"})
    cleanup: list[asyncio.Future] = []
    try:
        await async_wait_until(lambda: _http_ok(load_session, f"http://127.0.0.1:{rport}/health"), 30,
                               message="receiver agent up")
        await register(m, slow, weight_receiver_port=rport)
        status, _ = await m.put_senders([["127.0.0.1"]], 1, engines=1)
        assert status == 200

        old, new = build_model(0, **WEIGHT_MODEL), build_model(7, **WEIGHT_MODEL)
        await asyncio.to_thread(sender.stage, dict(new.state_dict()), 1)
        states: list[str | None] = []
        stop = asyncio.Event()

        async def watch() -> None:
            while not stop.is_set():
                states.append(await m.state_of(slow.endpoint))
                await asyncio.sleep(0.05)

        async def generate(prompt: list[int]) -> dict[str, Any]:
            status, out = await m.post("/generate", {"input_ids": prompt, "sampling_params": GREEDY})
            assert status == 200, out
            return out

        rng = random.Random(3)
        prompts = [[rng.randrange(256) for _ in range(rng.randint(1, 6))] for _ in range(40)]
        watcher = asyncio.ensure_future(watch())
        cleanup.append(watcher)
        before = [asyncio.ensure_future(generate(p)) for p in prompts[:20]]  # in flight at the bump
        cleanup.extend(before)
        await async_wait_until(lambda: _in_flight(m, 5), message="requests on the instance")
        t0 = time.monotonic()
        bump = asyncio.ensure_future(m.post("/update_weight_version", {"wait_for_instances": "all", "timeout_s": 30}))
        await async_wait_until(lambda: _state_is(m, slow.endpoint, "syncing"), message="syncing")
        during = [asyncio.ensure_future(generate(p)) for p in prompts[20:]]  # wait in the manager
        cleanup.extend(during)
        status, res = await bump
        took = time.monotonic() - t0
        stop.set()
        await watcher
        st = await m.status()
        # The instance went active -> syncing -> active, never dead ...
        assert not [e for e in st["recent_events"] if e["to"] == "dead"], st["recent_events"]
        assert "syncing" in states and None not in states, states
        assert status == 200 and not res["timed_out"], res
        outs = await asyncio.wait_for(asyncio.gather(*before, *during), 30)
        st = await m.status()
        # ... though its load outlasted several intervals and what failed probes need to remove it.
        assert took >= LOAD_DELAY_S > threshold * (interval + probe_timeout)
        (inst,) = st["instances"]
        assert inst["state"] == "active" and inst["weight_version"] == 1
        assert inst["consecutive_failures"] == 0, inst
        assert inst["in_flight"] == 0 and inst["in_flight_tokens"] == 0
        # Requests in flight at the bump drained on version 0; those that came during the load waited
        # and ran on version 1; none was lost, none mixes versions.
        versions = []
        for i, (prompt, out) in enumerate(zip(prompts, outs)):
            (seg,) = out["meta_info"]["segments"]
            versions.append(seg["weight_version"])
            model = {"0": old, "1": new}[seg["weight_version"]]
            assert out["output_ids"] == reference_generate(model, prompt, MAX_NEW)[0], i
        assert "0" in versions[:20] and set(versions[20:]) == {"1"}, versions
        report("slow_weight_load", requests=len(prompts), load_delay_s=LOAD_DELAY_S, health_interval_s=interval,
               health_check_timeout_s=probe_timeout, bump_to_active_s=round(took, 2), lost=0, regenerated=0)
    finally:
        for task in cleanup:
            task.cancel()
        await asyncio.gather(*cleanup, return_exceptions=True)
        sender.stop()
        receiver.stop()


async def _in_flight(m, n: int) -> bool:
    return sum(i["in_flight"] for i in (await m.status())["instances"]) >= n


async def _http_ok(session: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
            return r.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return False
