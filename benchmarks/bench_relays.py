"""Relay processes (docs/relays.md): what running the manager as a control process and N relays costs.

Fake SGLang ports that answer at once (benchmarks/fake_sglang.py, served by bench_scale's helper processes), so
what is measured is the manager. Three managers run side by side against the same fleet: ``relays = 0`` (one
process), ``relays = 1`` and ``relays = 2`` (a supervisor, a control process and the relays). Every figure is read
from ``/proc/<pid>/stat`` (utime + stime) and ``/proc/<pid>/status`` of each of a manager's processes.

1. **CPU per relayed token**, summed over all of a manager's processes: ``--sequences`` of ``--tokens`` tokens in
   ``--batches`` NDJSON ``/batch_generate_requests``, each on a connection of its own (the kernel spreads
   connections over the relays: SO_REUSEPORT), every output checked exactly; ``--rounds`` rounds, the three
   managers in a rotated order each round. Then the same with routed-expert replay (``--r3 LAYERSxTOP_K``,
   ``--r3-sequences`` sequences): every answer's experts are checked against the fake's rows.
2. **The control process**: its CPU over an idle stretch with the relays connected (``--idle-s``), with a fourth
   manager (``relays = 2``, ``relay_report_s = --fast-report-s``) beside them, so the difference is what a
   report costs; its CPU under the load above, less its idle rate, per sequence placed; then ``--big-instances``
   more ports registered with every manager and an idle stretch again: what a box costs the control process
   (health checks, and each relay's fleet stream re-reading every instance's view every 0.25 s). The fleet
   stream's re-scan is also timed in this process (``ViewTracker.delta`` over a registry of that many boxes).
   From these: how many boxes and sequences a second one control process serves, and how many relays 10,000
   GPUs at 5k tokens/s need, dense and with R3.
3. **Bytes per token in flight** (bench_scale's ``--hold``): for each of the three, a fresh fleet whose fakes
   hold every stream before its final chunk and a fresh manager; each relay's RSS with every stream held, less
   its idle RSS, over the tokens its sequences hold (its ``in_flight`` times the tokens a held stream sent).

    nice -n 10 .venv/bin/python benchmarks/bench_relays.py --set engine_max_instance_buffer_mb=1024   # the recorded run
    # 3. alone, without saved tokens (the docs' second command):
    nice -n 10 .venv/bin/python benchmarks/bench_relays.py --memory-only --set relay_checkpoint_tokens=0 \\
        --set engine_max_instance_buffer_mb=1024
    nice -n 10 .venv/bin/python benchmarks/bench_relays.py --rounds 1 --sequences 128 --idle-s 3 --big-instances 100
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_manager_overhead import cpu_s, stop_all
from bench_scale import get_status, ndjson_lines, start_fleet, status_kb, wait_health
from fake_sglang import parse_shape, routed_rows

from rollout_manager.osutil import descendants, free_port

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
CONFIGS = (0, 1, 2)  # relays = 0 (one process), 1, 2
FLEET_TICK_S = 0.25  # instances/relay_hub.TICK_S: each relay's fleet stream re-reads every view this often


# ---------------------------------------------------------------- pure helpers
def role_of(args: Sequence[str]) -> str | None:
    """A manager process's role from its command line: ``single``, ``control``, ``relay N``, ``supervisor``
    (``serve`` without ``--role``: with relays it starts the others), None for anything else."""
    if "rollout_manager" not in args or "serve" not in args:
        return None
    if "--role" not in args[:-1]:
        return "supervisor"
    role = args[args.index("--role") + 1]
    if role == "relay" and "--relay-index" in args[:-1]:
        return f"relay {args[args.index('--relay-index') + 1]}"
    return role


def median_worst(values: Sequence[float], higher_is_worse: bool = True) -> tuple[float, float]:
    """The median and the worst of ``values``."""
    return statistics.median(values), (max(values) if higher_is_worse else min(values))


@dataclass(frozen=True)
class ControlCosts:
    """What the control process spends, measured: per box per second (health checks; its own share), per box
    per relay per second (that relay's fleet stream re-reading the box's view), per relay report, and per
    sequence placed (on the relays; seen by the control process only through the reports)."""

    box_s: float  # CPU seconds a second per box, with no relay
    box_relay_s: float  # CPU seconds a second per box and relay
    report_s: float  # CPU seconds per report received
    sequence_s: float  # CPU seconds per sequence placed
    token_s: float = 0.0  # CPU seconds per token a relay saves there (relay_checkpoint_tokens)
    reports_per_s: float = 2.0  # 1 / relay_report_s

    def per_second(self, boxes: int, relays: int, sequences_per_s: float, saved_tokens_per_s: float = 0.0) -> float:
        """CPU seconds a second of one control process serving this much."""
        return (boxes * (self.box_s + relays * self.box_relay_s) + relays * self.reports_per_s * self.report_s
                + sequences_per_s * self.sequence_s + saved_tokens_per_s * self.token_s)

    def boxes_per_core(self, relays: int) -> int:
        """Boxes one control process serves with ``relays`` relays, on a whole core, nothing else to do."""
        per_box = self.box_s + relays * self.box_relay_s
        left = 1.0 - relays * self.reports_per_s * self.report_s
        return max(0, math.floor(left / per_box + 1e-9)) if per_box > 0 else sys.maxsize


def relays_needed(tokens_per_s: float, cpu_s_per_token: float, busy: float = 1.0) -> int:
    """Relays (one core each, at most ``busy`` of it) that relay ``tokens_per_s``."""
    return math.ceil(tokens_per_s * cpu_s_per_token / busy)


# ---------------------------------------------------------------- a manager and its processes
def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


@dataclass
class Managed:
    """One manager started by this script: its processes by role."""

    relays: int
    proc: subprocess.Popen[bytes]
    url: str
    pids: dict[str, int] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return "relays=0 (one process)" if not self.relays else f"relays={self.relays}"

    def find(self) -> None:
        """The manager's processes by role (the supervisor's children, once they are up)."""
        found = {}
        for pid in [self.proc.pid, *descendants(self.proc.pid)]:
            role = role_of(_cmdline(pid))
            if role is not None:
                found["single" if role == "supervisor" and not self.relays else role] = pid
        want = 1 if not self.relays else 2 + self.relays
        if len(found) != want:
            raise RuntimeError(f"{self.name}: processes {found}, wanted {want}")
        self.pids = found

    def cpu(self) -> dict[str, float]:
        """CPU seconds of each process so far; raises if one was started again (its time would be lost)."""
        out = {}
        for role, pid in self.pids.items():
            if role_of(_cmdline(pid)) is None:
                raise RuntimeError(f"{self.name}: {role} (pid {pid}) is gone: started again mid-measurement")
            out[role] = cpu_s(pid)
        return out

    def ran(self) -> dict[str, float]:
        return {role: run_s(pid) for role, pid in self.pids.items()}

    def rss_kb(self) -> dict[str, int]:
        return {role: status_kb(pid, "VmRSS") for role, pid in self.pids.items()}


def run_s(pid: int) -> float:
    """Seconds ``pid``'s threads ran (``/proc/<pid>/task/*/schedstat``, nanoseconds: an idle process's fraction
    of a percent of a core is below what 10 ms clock ticks resolve over seconds)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended: its time is no longer counted anywhere
    return total / 1e9


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


def _relay_cpu(d: dict[str, float]) -> float:
    return sum(v for k, v in d.items() if k.startswith("relay") or k == "single")


async def start_manager(relays: int, logs: Path, procs: list[subprocess.Popen[bytes]], common: Sequence[str],
                        *sets: str) -> Managed:
    port = free_port()
    cmd = [PY, "-m", "rollout_manager", "serve", "--bind", f"127.0.0.1:{port}", "--log-level", "warning",
           "--set", f"relays={relays}", *[a for kv in (*common, *sets) for a in ("--set", kv)]]
    tag = f"relays{relays}" + ("-" + "-".join(s.replace("=", "") for s in sets) if sets else "")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=open(logs / f"manager-{tag}.log", "wb"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    procs.append(proc)
    m = Managed(relays, proc, f"http://127.0.0.1:{port}")
    await wait_health(m.url, proc)
    deadline = time.monotonic() + 30
    while True:
        try:
            m.find()
            break
        except RuntimeError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)
    return m


async def register(s: aiohttp.ClientSession, m: Managed, ports: Sequence[int]) -> None:
    """Register ``ports`` and wait until all are active and every relay reported with all of them known."""
    for port in ports:
        async with s.post(m.url + "/register_rollout_instance", json={"host": "127.0.0.1", "port": port}) as r:
            if r.status != 200:
                raise RuntimeError(f"register: HTTP {r.status} {await r.text()}")
    deadline = time.monotonic() + 300
    while True:
        st = await get_status(s, m.url)
        relays = st.get("relays") or []
        if st["ready_instances"] == len(st["instances"]) and len(relays) == m.relays and \
                all(r["connected"] and r["report_age_s"] is not None for r in relays):
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"{m.name}: not all active or reporting after 300s: {st['counts']}")
        await asyncio.sleep(0.2)
    await asyncio.sleep(1.0)  # the relays' registries follow the last changes


async def relays_status(s: aiohttp.ClientSession, m: Managed) -> dict[int, dict[str, Any]]:
    """Each relay's last report by pid."""
    st = await get_status(s, m.url)
    return {r["pid"]: r for r in st.get("relays") or []}


# ---------------------------------------------------------------- load
@dataclass
class Load:
    sequences: int
    tokens: int
    wall_s: float
    cpu: dict[str, float]  # CPU seconds by role over the load (utime + stime)
    ran: dict[str, float]  # the same from schedstat (nanoseconds)
    per_relay: dict[str, int]  # sequences each relay finished
    bad: list[str]


async def load(m: Managed, sequences: int, tokens: int, batches: int, experts: tuple[int, int] | None) -> Load:
    """``sequences`` in ``batches`` NDJSON batches at once, each on a fresh connection; outputs checked."""
    expected = list(range(1, tokens + 1))
    rows = None if experts is None else routed_rows(experts, 0, 3 + tokens)  # prompts of 3
    per_batch = sequences // batches
    bad: list[str] = []

    async def batch(b: int) -> None:
        items = [[f"{b}-{i}", {"input_ids": [1 + (i % 97), 2, 3],
                               "sampling_params": {"max_new_tokens": tokens, "temperature": 0},
                               **({"return_routed_experts": True} if experts else {})}]
                 for i in range(per_batch)]
        seen = set()
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s, \
                s.post(m.url + "/batch_generate_requests", json=items,
                       timeout=aiohttp.ClientTimeout(total=None)) as r:
            if r.status != 200:
                raise RuntimeError(f"batch: HTTP {r.status} {await r.text()}")
            async for raw in ndjson_lines(r.content):
                line = json.loads(raw)
                seen.add(line["id"])
                data = line.get("data") or {}
                meta = data.get("meta_info") or {}
                if not line["success"] or data.get("output_ids") != expected or \
                        meta.get("completion_tokens") != tokens or meta.get("routed_experts") != rows:
                    bad.append(json.dumps(line)[:300])
        if len(seen) != per_batch:
            bad.append(f"batch {b}: {per_batch - len(seen)} ids never answered")

    async with aiohttp.ClientSession() as s:
        before_relays = await relays_status(s, m)
        c0, r0, w0 = m.cpu(), m.ran(), time.monotonic()
        await asyncio.gather(*(batch(b) for b in range(batches)))
        wall = time.monotonic() - w0
        c1, r1 = m.cpu(), m.ran()
        per_relay: dict[str, int] = {}
        if m.relays:  # each relay's count, once its next report is in
            await asyncio.sleep(1.2)
            after = await relays_status(s, m)
            for role, pid in m.pids.items():
                if role.startswith("relay"):
                    per_relay[role] = after[pid]["finished"] - before_relays[pid]["finished"]
    return Load(per_batch * batches, tokens, wall, _delta(c1, c0), _delta(r1, r0), per_relay, bad)


# ---------------------------------------------------------------- idle
async def idle(managers: Sequence[Managed], idle_s: float) -> list[dict[str, float]]:
    """CPU seconds a second of each manager's processes over one idle stretch, all of them at once."""
    await asyncio.sleep(1.0)
    c0, w0 = [m.ran() for m in managers], time.monotonic()
    await asyncio.sleep(idle_s)
    wall = time.monotonic() - w0
    return [{k: v / wall for k, v in _delta(m.ran(), c).items()} for m, c in zip(managers, c0)]


def time_fleet_rescan(boxes: int, repeat: int = 20) -> float:
    """CPU seconds one fleet-stream tick spends on a registry of ``boxes`` active instances when nothing changed
    (``ViewTracker.delta``: every instance's view built and compared), best of ``repeat``."""
    from rollout_manager.instances.health import adopt_engine
    from rollout_manager.instances.instance import EngineFacts
    from rollout_manager.instances.mirror import ViewTracker
    from rollout_manager.instances.registry import Kind, Registry, State
    from rollout_manager.instances.version import WeightVersion

    registry, version = Registry(), WeightVersion()
    for inst in registry.add_many([(f"10.{n // 250}.{n % 250}.1", 30000, Kind.REMOTE, None) for n in range(boxes)]):
        adopt_engine(inst, EngineFacts(vocab_size=151_936, max_running_requests=256))
        registry.transition(inst, State.ACTIVE, "healthy")
    tracker = ViewTracker()
    tracker.delta("run", registry, version)
    best = math.inf
    for _ in range(repeat):
        t0 = time.process_time()
        assert tracker.delta("run", registry, version) is None
        best = min(best, time.process_time() - t0)
    return best


# ---------------------------------------------------------------- memory
async def hold_run(relays: int, args: argparse.Namespace, logs: Path) -> dict[str, float]:
    """Bytes per token in flight of each relay (``single`` for one process): a fresh holding fleet and manager."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        helper_ports = start_fleet(args.instances, args.helpers, args.tokens, False, True, logs, procs)
        ports = [p for some in helper_ports for p in some]
        m = await start_manager(relays, logs, procs, args.set)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            await register(s, m, ports)
            await asyncio.sleep(1.0)
            # the control process's idle CPU rate (health checks, the fleet stream, the relays' idle reports),
            # taken out of what it ran under the load: what is left is what the load cost it
            idle0, idle_t = m.ran(), time.monotonic()
            await asyncio.sleep(args.hold_idle_s)
            idle_rate = {k: v / (time.monotonic() - idle_t) for k, v in _delta(m.ran(), idle0).items()}
            idle_rss = m.rss_kb()
            ran0, t0 = m.ran(), time.monotonic()
            task = asyncio.create_task(load(m, args.hold_sequences, args.tokens, args.batches, None))
            held = {"sequences": 0, "tokens": 0}
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not task.done():
                held = {"sequences": 0, "tokens": 0}
                for some in helper_ports:
                    async with s.get(f"http://127.0.0.1:{some[0]}/fake_held") as r:
                        for k, v in (await r.json()).items():
                            held[k] += v
                if held["sequences"] >= args.hold_sequences:
                    break
                await asyncio.sleep(0.2)
            if held["sequences"] < args.hold_sequences:
                raise RuntimeError(f"{m.name}: only {held['sequences']} of {args.hold_sequences} streams held")
            quiet = time.monotonic() + 30  # the manager read every token: its CPU goes quiet
            while time.monotonic() < quiet:
                c = sum(m.cpu().values())
                await asyncio.sleep(0.5)
                if sum(m.cpu().values()) - c < 0.025:
                    break
            await asyncio.sleep(2 * 0.5 + 0.2)  # every relay reported its in_flight since
            rss, ran, ran_s = m.rss_kb(), _delta(m.ran(), ran0), time.monotonic() - t0
            in_flight = {r["pid"]: r["in_flight"] for r in (await get_status(s, m.url)).get("relays") or []}
            for some in helper_ports:
                async with s.post(f"http://127.0.0.1:{some[0]}/fake_release") as r:
                    await r.read()
            done = await task
            if done.bad:
                raise RuntimeError(f"{m.name}: {len(done.bad)} bad answers: {done.bad[:2]}")
        per_seq = held["tokens"] / held["sequences"]
        idle = idle_rate.get("control", 0.0) * ran_s
        out = {"control_cpu_per_token": max(ran.get("control", 0.0) - idle, 0.0) / held["tokens"]}
        if relays:
            print(f"  {m.name}: the control process ran {ran['control']:.2f}s from the load's start until every "
                  f"stream was held ({ran_s:.1f}s), {idle:.2f}s of it at its idle rate: "
                  f"{us(out['control_cpu_per_token'])} us per token held beyond idle")
        for role, pid in m.pids.items():
            if role == "supervisor":
                continue
            # the control process holds the relays' saved tokens: its figure is over every token held
            seqs = in_flight[pid] if role.startswith("relay") else held["sequences"]
            out[role] = 1024 * (rss[role] - idle_rss[role]) / max(1.0, seqs * per_seq)
            print(f"  {m.name} {role}: {seqs} sequences x {per_seq:.0f} tokens held, RSS idle "
                  f"{idle_rss[role] / 1024:.0f} MB, held {rss[role] / 1024:.0f} MB: {out[role]:.1f} bytes a token",
                  flush=True)
        return out
    finally:
        stop_all(procs)


# ---------------------------------------------------------------- the run
def us(x: float) -> str:
    return f"{1e6 * x:.3f}"


def print_memory(held: dict[int, dict[str, float]]) -> None:
    def per_relay(n: int) -> dict[str, float]:
        return {k: v for k, v in held[n].items() if k not in ("control", "control_cpu_per_token")}

    for n in CONFIGS:
        vals = list(per_relay(n).values())
        control = f"; the control process {held[n]['control']:.1f} over every token held" if n else ""
        print(f"bytes per token in flight, {'one process' if not n else f'relays={n}'}: " +
              ", ".join(f"{k} {v:.1f}" for k, v in per_relay(n).items()) + f" (worst {max(vals):.1f}; goal 16 per "
              f"relay: {'met' if max(vals) <= 16 else 'not met'}){control}")
    print(f"relays: bytes per token in flight per relay, two relays against one: {max(per_relay(2).values()):.1f} "
          f"against {max(per_relay(1).values()):.1f} (one process {held[0]['single']:.1f})")


async def run(args: argparse.Namespace) -> None:
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    if args.memory_only:  # 3. alone (with --set, such as relay_checkpoint_tokens=0)
        print()
        print_memory({n: await hold_run(n, args, logs) for n in CONFIGS})
        return
    procs: list[subprocess.Popen[bytes]] = []
    experts = args.r3
    try:
        helper_ports = start_fleet(args.instances, args.helpers, args.tokens, False, False, logs, procs, experts)
        ports = [p for some in helper_ports for p in some]
        managers = [await start_manager(n, logs, procs, args.set) for n in CONFIGS]
        fast = await start_manager(2, logs, procs, args.set, f"relay_report_s={args.fast_report_s}")
        many = await start_manager(args.many_relays, logs, procs, args.set)  # idle only: the control's cost per relay
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            for m in (*managers, fast, many):
                await register(s, m, ports)
        print(f"fleet: {len(ports)} fake SGLang ports ({experts[0]}x{experts[1]} routed experts when asked) in "
              f"{args.helpers} helper processes; managers: " + ", ".join(
                  f"{m.name} pids {m.pids}" for m in managers), flush=True)

        # 2a. idle, the relays connected: the control process's rate, and with 10x the reports
        rates = await idle([*managers, fast, many], args.idle_s)
        for m, r in zip([*managers, fast, many], rates):
            print(f"idle {args.idle_s:g}s, {len(ports)} instances, {m.name}"
                  f"{f' report every {args.fast_report_s:g}s' if m is fast else ''}: " +
                  ", ".join(f"{k} {100 * v:.2f}%" for k, v in r.items()) + " of a core", flush=True)
        idle_control = {m.relays: rates[i].get("control", 0.0) for i, m in enumerate(managers)}
        extra_reports = 2 * (1 / args.fast_report_s - 1 / 0.5)  # two relays, reports a second above the default
        report_s = max(0.0, (rates[3]["control"] - rates[2]["control"]) / extra_reports)

        # 1. dense and R3 loads, rounds with the managers in a rotated order
        results: dict[str, dict[int, list[Load]]] = {"dense": {n: [] for n in CONFIGS},
                                                     "r3": {n: [] for n in CONFIGS}}
        for kind, seqs, exp in (("dense", args.sequences, None), ("r3", args.r3_sequences, experts)):
            for rnd in range(args.rounds):
                for k in range(len(managers)):
                    m = managers[(rnd + k) % len(managers)]
                    got = await load(m, seqs, args.tokens, args.batches, exp)
                    if got.bad:
                        raise RuntimeError(f"{m.name}: {len(got.bad)} bad answers, first: {got.bad[:2]}")
                    results[kind][m.relays].append(got)
                    tok = got.sequences * got.tokens
                    print(f"{kind} round {rnd + 1} {m.name}: {got.sequences} x {got.tokens} tokens exact, "
                          f"{got.wall_s:.1f}s wall; CPU " + ", ".join(f"{k2} {v:.2f}s" for k2, v in got.cpu.items())
                          + f" = {us(sum(got.cpu.values()) / tok)} us a token"
                          + (f"; finished by relay {got.per_relay}" if got.per_relay else ""), flush=True)

        # 2b. boxes: more ports registered with every manager, idle again
        big_ports: list[int] = []
        if args.big_instances:
            big = start_fleet(args.big_instances, args.helpers, 8, False, False, logs, procs)
            big_ports = [p for some in big for p in some]
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
                for m in (*managers, many):
                    await register(s, m, big_ports)
            big_rates = await idle([*managers, many], args.idle_s)
            for m, r in zip([*managers, many], big_rates):
                print(f"idle {args.idle_s:g}s, {len(ports) + len(big_ports)} instances, {m.name}: " +
                      ", ".join(f"{k} {100 * v:.2f}%" for k, v in r.items()) + " of a core", flush=True)
        rescan = time_fleet_rescan(args.rescan_boxes)
        print(f"fleet stream re-scan, nothing changed, {args.rescan_boxes} boxes: {1e3 * rescan:.2f} ms a tick "
              f"({1e6 * rescan / args.rescan_boxes:.2f} us a box), every {FLEET_TICK_S}s per relay", flush=True)
    finally:
        stop_all(procs)

    # 3. memory: fresh fleets and managers
    held: dict[int, dict[str, float]] = {}
    for n in CONFIGS:
        held[n] = await hold_run(n, args, logs)

    # ---------------------------------------------------------------- the figures
    def per_token(got: Load, part: str = "all") -> float:
        cpu = sum(got.cpu.values()) if part == "all" else _relay_cpu(got.cpu) if part == "relays" \
            else got.cpu.get(part, 0.0)
        return cpu / (got.sequences * got.tokens)

    def ratios(a: Sequence[Load], b: Sequence[Load]) -> list[float]:
        """Round by round: ``a``'s CPU per token over ``b``'s."""
        return [per_token(x) / per_token(y) for x, y in zip(a, b)]

    print()
    print(f"== figures (2-core VM; {os.cpu_count()} cores here: at most two processes run at once, so scaling past "
          f"two processes is argued from the per-process costs below, not shown)")
    for kind, label in (("dense", "dense"), ("r3", f"R3 {experts[0]}x{experts[1]}")):
        res = results[kind]
        seqs = res[0][0].sequences
        line = ", ".join(f"relays={n} {us(mid)} us (worst {us(worst)})" for n in CONFIGS
                         for mid, worst in [median_worst([per_token(g) for g in res[n]])])
        print(f"manager CPU per relayed token, all processes, {label}, {seqs} x {args.tokens} tokens, "
              f"{args.rounds} rounds: {line}")
        r21, r20, r10 = ratios(res[2], res[1]), ratios(res[2], res[0]), ratios(res[1], res[0])
        print(f"  {label}: relays=2 / relays=1 {median_worst(r21)[0]:.3f}x (worst {max(r21):.3f}x; goal at most 1.1x: "
              f"{'met' if max(r21) <= 1.1 else 'met in median' if median_worst(r21)[0] <= 1.1 else 'not met'}); "
              f"relays=2 / one process {median_worst(r20)[0]:.3f}x (worst {max(r20):.3f}x); relays=1 / one process "
              f"{median_worst(r10)[0]:.3f}x (worst {max(r10):.3f}x)")
        relay_tok = [per_token(g, "relays") for g in res[2]]
        ctl = statistics.median(per_token(g, "control") for g in res[2])
        sup = statistics.median(per_token(g, "supervisor") for g in res[2])
        print(f"  {label}: relays=2, the relays' own CPU {us(median_worst(relay_tok)[0])} us a token "
              f"(worst {us(max(relay_tok))}); control {us(ctl)}, supervisor {us(sup)}")
    dense2 = results["dense"][2]
    above = [(g.ran["control"] - idle_control[2] * g.wall_s) / g.sequences for g in dense2]
    ctl_seq = [g.ran["control"] / g.sequences for g in dense2]  # its idle time included: a bound from above
    saved_token_s = max(held[n]["control_cpu_per_token"] for n in (1, 2))
    print(f"control process, relays=2: idle {100 * idle_control[2]:.2f}% of a core ({100 * idle_control[1]:.2f}% "
          f"with one relay) with {len(ports)} instances; per report {us(report_s)} us (reports every "
          f"{args.fast_report_s:g}s against 0.5s); per sequence placed {us(statistics.median(ctl_seq))} us, its idle "
          f"time included (worst {us(max(ctl_seq))}; above idle {us(statistics.median(above))}); per token saved "
          f"{us(saved_token_s)} us (the held streams beyond its idle rate, worse of relays=1 and 2)")
    if big_ports:
        nb = len(big_ports)
        box = {m.relays: (big_rates[i].get("control", big_rates[i].get("single", 0.0)) -
                          rates[i].get("control", rates[i].get("single", 0.0))) / nb for i, m in enumerate(managers)}
        box[args.many_relays] = (big_rates[-1]["control"] - rates[-1]["control"]) / nb
        box_relay = max(0.0, (box[args.many_relays] - box[1]) / (args.many_relays - 1))
        box_none = max(0.0, box[1] - box_relay)
        print(f"control process per box: {us(box[1])} us a second with one relay, {us(box[2])} with two, "
              f"{us(box[args.many_relays])} with {args.many_relays} (one process, all of it: {us(box[0])}); so "
              f"{us(box_none)} us a box-second of its own (health checks, one fleet scan) and {us(box_relay)} per "
              f"relay (the fleet scan itself, timed in process: {us(rescan / args.rescan_boxes / FLEET_TICK_S)})")
        costs = ControlCosts(box_none, box_relay, report_s, statistics.median(ctl_seq), saved_token_s)
        tok = {kind: [per_token(g, "relays") for g in results[kind][2]] for kind in ("dense", "r3")}
        tps = args.gpus * args.gpu_tokens_s
        seq_per_s = tps / args.plan_tokens
        print(f"plan: {args.gpus:,} GPUs x {args.gpu_tokens_s:,} tokens/s = {tps / 1e6:.0f}M tokens/s, "
              f"{seq_per_s:,.0f} sequences/s of {args.plan_tokens:,} tokens; one control process places at least "
              f"{1 / costs.sequence_s:,.0f} sequences/s and takes {1 / costs.token_s / 1e6:.1f}M saved tokens/s "
              f"(a whole core, nothing else)")
        for kind, label in (("dense", "dense"), ("r3", f"R3 {experts[0]}x{experts[1]}")):
            n, n_worst = relays_needed(tps, statistics.median(tok[kind])), relays_needed(tps, max(tok[kind]))
            saved = tps if kind == "dense" else 0.0  # R3 sequences are not saved
            print(f"  {label}: {n} relays at a whole core each ({n_worst} at the worst round); the control process "
                  f"then spends " + ", ".join(
                      f"{100 * costs.per_second(b, n, seq_per_s, saved):.0f}% of a core at {b:,} boxes" for b in
                      (args.gpus // 8, args.gpus)) + f" ({100 * saved * costs.token_s:.0f}% of it saving tokens), "
                  f"and serves at most {costs.boxes_per_core(n):,} boxes with {n} relays")
    dense, r3 = ratios(results["dense"][2], results["dense"][1]), ratios(results["r3"][2], results["r3"][1])
    print(f"relays: cpu per token relays=2/relays=1 dense {statistics.median(dense):.3f}x (worst {max(dense):.3f}x), "
          f"R3 {statistics.median(r3):.3f}x (worst {max(r3):.3f}x)")
    print_memory(held)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--instances", type=int, default=64)
    parser.add_argument("--sequences", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--batches", type=int, default=16, help="NDJSON batches at once, each on its own connection")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--r3", type=parse_shape, default=(48, 8), metavar="LAYERSxTOP_K")
    parser.add_argument("--r3-sequences", type=int, default=128)
    parser.add_argument("--hold-sequences", type=int, default=512, help="at most 8 x --instances")
    parser.add_argument("--hold-idle-s", type=float, default=5.0,
                        help="seconds the control process's idle CPU rate is measured before the held load")
    parser.add_argument("--helpers", type=int, default=2)
    parser.add_argument("--idle-s", type=float, default=10.0)
    parser.add_argument("--fast-report-s", type=float, default=0.05)
    parser.add_argument("--big-instances", type=int, default=1000)
    parser.add_argument("--many-relays", type=int, default=4, help="an idle manager with this many relays")
    parser.add_argument("--rescan-boxes", type=int, default=1000)
    parser.add_argument("--gpus", type=int, default=10_000)
    parser.add_argument("--gpu-tokens-s", type=int, default=5_000)
    parser.add_argument("--plan-tokens", type=int, default=2_000, help="tokens a sequence, for sequences/s")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="every manager's config")
    parser.add_argument("--memory-only", action="store_true", help="only bytes per token in flight (3.)")
    parser.add_argument("--logs", default="/tmp/bench-relays")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout` still stops the helpers
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
