"""Scale: many instances and many sequences in flight, with the manager under a low open-file limit.

A few helper processes serve ``--instances`` fake SGLang ports (benchmarks/fake_sglang.py's app, one
aiohttp site per port; each helper raises its own open-file limit: it is not what is measured).
A real manager is started with ``prlimit --nofile=SOFT:HARD`` (soft 1024; hard as the machine has it,
or 1024 too with ``--hard 1024``, when the daemon cannot raise its soft limit), and the script

1. registers every instance with ``POST /register_rollout_instance`` and times until all are active;
2. measures the manager's idle CPU with every instance registered (``/proc/<pid>/stat``);
3. sends ``--sequences`` sequences of ``--tokens`` tokens in ``--batches`` ``/batch_generate_requests``
   all at once, checks every output exactly (the fake answers tokens 1..n), and counts instances
   removed (must be 0), the manager's peak RSS (VmHWM), its CPU per sequence and per token, the wall
   time, and its open sockets to the instances (from ``/proc/<pid>/fd`` and ``/proc/<pid>/net/tcp``):
   how many sequences in flight share a connection.
4. with ``--hold``: the fakes hold every stream before its final chunk until every sequence holds its
   tokens in the manager; the script reads the manager's RSS there (once its CPU is quiet), lets the
   streams finish, and reports bytes per token in flight: (RSS - idle RSS) / tokens held, with the RSS
   held and the peak (VmHWM, which also covers every sequence finishing at once). The throughput-aware
   policy places 8 sequences on an instance before it has measured its rate, so keep ``--sequences``
   at most 8 x ``--instances``. See docs/memory.md.
5. with ``--routed-experts LAYERSxTOP_K``: every sequence asks for routed-expert replay (R3), the fakes answer
   it as SGLang does (benchmarks/fake_sglang.py: rows on the final chunk only) and every answer's experts are
   checked; ``--r3 LAYERSxTOP_K`` runs the whole measurement twice, R3 off then on (a fresh fleet and manager
   each), and prints the CPU and bytes per token of the two with their ratio. The experts reach the manager
   with each sequence's final chunk, so they weigh on the peak (every sequence finishing at once), not on
   the tokens held before it.

    .venv/bin/python benchmarks/bench_scale.py                      # 1,000 instances, 8,000 x 64 tokens
    .venv/bin/python benchmarks/bench_scale.py --hard 1024          # the daemon cannot raise its limit
    .venv/bin/python benchmarks/bench_scale.py --instances 50 --sequences 400   # development
    .venv/bin/python benchmarks/bench_scale.py --tokens 1024 --hold             # bytes per token in flight
    .venv/bin/python benchmarks/bench_scale.py --tokens 1024 --hold --trace-memory --instances 100 --sequences 800
    .venv/bin/python benchmarks/bench_scale.py --tokens 1024 --hold --trace-memory --trace-frames 8 ...  # by site
    .venv/bin/python benchmarks/bench_scale.py --tokens 1024 --hold --allocator-stats ...  # RSS by allocator
    .venv/bin/python benchmarks/bench_scale.py --instances 16 --sequences 128 --tokens 4096 --hold --r3 48x8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_manager_overhead import cpu_s, stop_all
from fake_sglang import parse_shape, routed_rows

from rollout_manager.osutil import free_port

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


# ---------------------------------------------------------------- the fake fleet (helper processes)
async def serve_fake(count: int, tokens: int, cumulative: bool, hold: bool,
                     experts: tuple[int, int] | None = None) -> None:
    """Serve ``count`` ports from this process; print them as one JSON line, then serve until killed."""
    from aiohttp import web

    from benchmarks.fake_sglang import make_app

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    runner = web.AppRunner(make_app(tokens, incremental=not cumulative, hold=hold, experts=experts),
                           access_log=None,
                           handle_signals=False)
    await runner.setup()
    ports = []
    for _ in range(count):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        site = web.SockSite(runner, sock, backlog=1024)
        await site.start()
        ports.append(sock.getsockname()[1])
    print(json.dumps(ports), flush=True)
    await asyncio.Event().wait()


def start_fleet(instances: int, helpers: int, tokens: int, cumulative: bool, hold: bool, logs: Path,
                procs: list[subprocess.Popen[bytes]], experts: tuple[int, int] | None = None) -> list[list[int]]:
    """Start the helpers; each one's ports."""
    counts = [instances // helpers + (1 if k < instances % helpers else 0) for k in range(helpers)]
    started = []
    for k, count in enumerate(counts):
        p = subprocess.Popen([PY, __file__, "--serve-fake", str(count), "--tokens", str(tokens),
                              *(["--cumulative"] if cumulative else []), *(["--hold"] if hold else []),
                              *(["--routed-experts", f"{experts[0]}x{experts[1]}"] if experts else [])],
                             cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=open(logs / f"fake{k}.log", "wb"),
                             start_new_session=True)
        procs.append(p)
        started.append(p)
    ports: list[list[int]] = []
    for p in started:
        assert p.stdout is not None
        line = p.stdout.readline()
        if not line:
            raise RuntimeError("a fake helper died at start; see its log")
        ports.append(json.loads(line))
    return ports


# ---------------------------------------------------------------- /proc readings of the manager
def status_kb(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return -1


def sockets(pid: int, ports: set[int]) -> tuple[int, int, dict[int, int]]:
    """(descriptors, sockets, connections per instance port) the manager holds now."""
    inodes = set()
    fds = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        fds += 1
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    per_port: dict[int, int] = {}
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[9] in inodes:
                port = int(f[2].rsplit(":", 1)[1], 16)  # remote port
                if port in ports:
                    per_port[port] = per_port.get(port, 0) + 1
    return fds, len(inodes), per_port


# ---------------------------------------------------------------- the run
# What holds a sequence's bytes, by the source file that allocated them (first match wins).
OWNERS = (
    ("its tokens (array) and progress", ("rollout_manager/rollout/progress.py",)),
    ("the caller's body, parsed and validated", ("pydantic/", "rollout_manager/jsonutil.py",
                                                 "rollout_manager/api/")),
    ("aiohttp client: connection, parser, response, stream reader", ("aiohttp/", "aiohappyeyeballs/", "yarl/",
                                                                      "multidict/")),
    ("the relay's connection (sglang/relay.py: protocol, llhttp parser, deadline)",
     ("rollout_manager/sglang/relay.py",)),
    ("the rollout flow's state and coroutines", ("rollout_manager/",)),
    ("asyncio tasks and the standard library", ("/lib/python3",)),
)


def print_memory_owners(probe: dict[str, Any], sequences: int) -> None:
    """Bytes per held sequence by owner, from benchmarks/memprobe's snapshot diff (Python allocations
    only: what C code allocates outside Python's allocator, such as kernel socket buffers, is not here)."""
    totals: dict[str, int] = {}
    for filename, size in probe["files"].items():
        owner = next((name for name, parts in OWNERS if any(p in filename for p in parts)), "other")
        totals[owner] = totals.get(owner, 0) + size
    n = max(sequences, 1)
    print(f"  traced Python allocations per held sequence: {sum(totals.values()) / n:,.0f} bytes")
    for owner, size in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"    {size / n:8,.0f} B  {owner}")
    for where, size in probe["lines"][:10]:
        print(f"    biggest line: {where} {size / n:,.0f} B per sequence")
    if len(probe.get("sites", [[[""]]])[0][0]) > 1:  # --trace-frames: the biggest sites with their callers
        root = str(ROOT) + "/"
        for frames, size in probe["sites"]:
            if size / n >= 100:
                print(f"    {size / n:6,.0f} B per sequence from " + " <- ".join(
                    f.replace(root, "") for f in reversed(frames[-4:])))


def print_allocators(accounts: dict[str, dict[str, int]], sequences: int, rss_bytes: int) -> None:
    """The RSS a held sequence costs, split by the allocator that holds it (benchmarks/memprobe): pymalloc's
    live blocks, its free blocks in pools still in use and its empty pools (touched, kept while their
    arena holds anything), glibc malloc's in use and free; the rest is neither (mostly pages of both
    touched and then freed, or code and libraries)."""
    idle, held, n = accounts["idle"], accounts["held"], max(sequences, 1)
    parts = {key: (held.get(key, 0) - idle.get(key, 0)) / n for key in held}
    named = ("pymalloc_live", "pymalloc_free_blocks", "pymalloc_empty_pools", "malloc_in_use", "malloc_free")
    print(f"  allocators, per held sequence: RSS {rss_bytes / n:,.0f} B = " + ", ".join(
        f"{key} {parts[key]:,.0f}" for key in named if key in parts) +
        f", other {rss_bytes / n - sum(parts.get(k, 0) for k in named):,.0f}")


async def get_status(s: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    for _ in range(100):  # the manager may briefly fail to accept while it is out of descriptors
        try:
            async with s.get(url + "/get_instances_status", timeout=aiohttp.ClientTimeout(total=30)) as r:
                data: dict[str, Any] = await r.json()
                return data
        except (aiohttp.ClientError, asyncio.TimeoutError):
            await asyncio.sleep(0.2)
    raise RuntimeError("the manager does not answer /get_instances_status")


async def wait_health(url: str, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError("the manager exited at start; see its log")
            try:
                async with s.get(url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError("the manager did not come up")


async def ndjson_lines(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """The lines of an NDJSON answer, however long (aiohttp's own line reader refuses lines over 128 KiB, and
    an answer with routed experts is megabytes)."""
    buf = bytearray()
    async for data in content.iter_any():
        buf += data
        while (end := buf.find(b"\n")) >= 0:
            yield bytes(buf[:end])
            del buf[:end + 1]
    if buf.strip():
        yield bytes(buf)


async def run(args: argparse.Namespace) -> dict[str, float]:
    """One measurement (printed); its figures: CPU per token, bytes per token held and at the peak."""
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    machine_soft, machine_hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    hard = args.hard if args.hard else machine_hard
    procs: list[subprocess.Popen[bytes]] = []
    try:
        t0 = time.monotonic()
        helper_ports = start_fleet(args.instances, args.helpers, args.tokens, args.cumulative, args.hold, logs,
                                   procs, args.routed_experts)
        ports = [port for some in helper_ports for port in some]
        print(f"fleet: {len(ports)} fake SGLang ports in {args.helpers} helper processes "
              f"({time.monotonic() - t0:.1f}s)", flush=True)
        mport = free_port()
        sets = [a for kv in args.set for a in ("--set", kv)]
        cmd = ["prlimit", f"--nofile={args.soft}:{hard}", PY, "-m", "rollout_manager", "serve",
               "--bind", f"127.0.0.1:{mport}", "--log-level", "warning", *sets]
        env = dict(os.environ)
        probe_out = str(logs / "memprobe.json")
        probe = args.trace_memory or args.allocator_stats
        if probe:  # benchmarks/memprobe/sitecustomize.py traces the manager's allocations
            env.update(MEMPROBE_OUT=probe_out, MEMPROBE_FRAMES=str(args.trace_frames),
                       MEMPROBE_TRACE="1" if args.trace_memory else "0", PYTHONPATH=os.pathsep.join(
                           [str(ROOT / "benchmarks" / "memprobe"), env.get("PYTHONPATH", "")]))
            Path(probe_out + ".done").unlink(missing_ok=True)
        manager = subprocess.Popen(cmd, cwd=ROOT, stdout=open(logs / "manager.log", "wb"),
                                   stderr=subprocess.STDOUT, start_new_session=True, env=env)
        procs.append(manager)
        url = f"http://127.0.0.1:{mport}"
        await wait_health(url, manager)
        # prlimit execs Python in place, so the manager's pid is the child's
        limit = Path(f"/proc/{manager.pid}/limits").read_text()
        nofile = next(line for line in limit.splitlines() if line.startswith("Max open files")).split()[3:5]
        print(f"manager: started as `{' '.join(cmd[:2])} ... serve`; machine limit soft {machine_soft} hard "
              f"{machine_hard}; the daemon runs with soft {nofile[0]} hard {nofile[1]}", flush=True)
        pid = manager.pid

        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            # 1. registrations
            t0 = time.monotonic()
            for port in ports:
                async with s.post(url + "/register_rollout_instance",
                                  json={"host": "127.0.0.1", "port": port}) as r:
                    if r.status != 200:
                        raise RuntimeError(f"register: HTTP {r.status} {await r.text()}")
            t_reg = time.monotonic() - t0
            while True:
                st = await get_status(s, url)
                if st["ready_instances"] == len(ports):
                    break
                if time.monotonic() - t0 > 300:
                    raise RuntimeError(f"not all active after 300s: {st['counts']}")
                await asyncio.sleep(0.1)
            t_active = time.monotonic() - t0
            print(f"registration: {len(ports)} POSTs in {t_reg:.2f}s; all active {t_active:.2f}s after the "
                  f"first POST", flush=True)

            # 2. idle CPU
            await asyncio.sleep(1.0)
            c0, w0 = cpu_s(pid), time.monotonic()
            await asyncio.sleep(args.idle_s)
            idle = (cpu_s(pid) - c0) / (time.monotonic() - w0)
            fds, socks, per_port = sockets(pid, set(ports))
            print(f"idle: {100 * idle:.1f}% of one core over {args.idle_s:g}s with {len(ports)} instances; "
                  f"{fds} descriptors, {socks} sockets, {sum(per_port.values())} to instances; "
                  f"RSS {status_kb(pid, 'VmRSS') / 1024:.0f} MB", flush=True)
            idle_rss_kb = status_kb(pid, "VmRSS")
            if probe:
                os.kill(pid, signal.SIGUSR1)  # the baseline: every instance registered, nothing run

            # 3. the load
            per_batch = args.sequences // args.batches
            expected = list(range(1, args.tokens + 1))
            experts = args.routed_experts
            rows = None if experts is None else routed_rows(experts, 0, 3 + args.tokens)  # prompts of 3
            bad: list[str] = []
            done = 0

            async def batch(b: int) -> None:
                nonlocal done
                items = [[f"{b}-{i}", {"input_ids": [1 + (i % 97), 2, 3],
                                       "sampling_params": {"max_new_tokens": args.tokens, "temperature": 0},
                                       **({"return_routed_experts": True} if experts else {})}]
                         for i in range(per_batch)]
                seen = set()
                async with s.post(url + "/batch_generate_requests", json=items,
                                  timeout=aiohttp.ClientTimeout(total=None)) as r:
                    if r.status != 200:
                        raise RuntimeError(f"batch: HTTP {r.status} {await r.text()}")
                    async for raw in ndjson_lines(r.content):
                        line = json.loads(raw)
                        seen.add(line["id"])
                        done += 1
                        data = line.get("data") or {}
                        meta = data.get("meta_info") or {}
                        if not line["success"] or data.get("output_ids") != expected or \
                                meta.get("completion_tokens") != args.tokens or \
                                meta.get("routed_experts") != rows:
                            bad.append(json.dumps(line)[:300])
                missing = per_batch - len(seen)
                if missing:
                    bad.append(f"batch {b}: {missing} ids never answered")

            peak = {"fds": 0, "socks": 0, "to_instances": 0, "max_per_instance": 0, "waiting_conn": 0,
                    "in_flight": 0}
            samples: list[tuple[int, int, int]] = []  # (in flight on instances, waiting to connect, connections)

            async def sample() -> None:
                while True:
                    fds, socks, per_port = sockets(pid, set(ports))
                    st = await get_status(s, url)
                    in_flight = sum(i.get("in_flight", 0) for i in st["instances"])
                    conns = sum(per_port.values())
                    peak["fds"] = max(peak["fds"], fds)
                    peak["socks"] = max(peak["socks"], socks)
                    peak["to_instances"] = max(peak["to_instances"], conns)
                    peak["max_per_instance"] = max(peak["max_per_instance"], max(per_port.values(), default=0))
                    peak["waiting_conn"] = max(peak["waiting_conn"], st["manager"].get("waiting_for_connection", 0))
                    peak["in_flight"] = max(peak["in_flight"], in_flight)
                    samples.append((in_flight, st["manager"].get("waiting_for_connection", 0), conns))
                    await asyncio.sleep(args.sample_s)

            async def hold_and_release() -> None:
                """With --hold: wait until every sequence holds its tokens in the manager, read its RSS there,
                then let the fakes finish the streams."""
                deadline = time.monotonic() + args.hold_timeout_s
                held = {"sequences": 0, "tokens": 0}
                while time.monotonic() < deadline:
                    held = {"sequences": 0, "tokens": 0}
                    for some in helper_ports:
                        async with s.get(f"http://127.0.0.1:{some[0]}/fake_held") as r:
                            for k, v in (await r.json()).items():
                                held[k] += v
                    if held["sequences"] >= n_all:
                        break
                    await asyncio.sleep(0.2)
                else:
                    print(f"  hold: only {held['sequences']} of {n_all} sequences held after "
                          f"{args.hold_timeout_s:g}s; measuring anyway", flush=True)
                # the fakes wrote every token; let the manager read them (its CPU goes quiet), then read RSS
                quiet = time.monotonic() + 30
                while time.monotonic() < quiet:
                    c, w = cpu_s(pid), time.monotonic()
                    await asyncio.sleep(0.5)
                    if (cpu_s(pid) - c) / (time.monotonic() - w) < 0.05:
                        break
                rss = status_kb(pid, "VmRSS")
                hold_result.update(held, rss_kb=rss)
                if probe:
                    os.kill(pid, signal.SIGUSR2)
                    while not Path(probe_out + ".done").exists():
                        await asyncio.sleep(0.2)
                for some in helper_ports:
                    async with s.post(f"http://127.0.0.1:{some[0]}/fake_release") as r:
                        await r.read()

            n_all = per_batch * args.batches
            hold_result: dict[str, int] = {}
            c0, w0 = cpu_s(pid), time.monotonic()
            sampler = asyncio.create_task(sample())
            try:
                await asyncio.gather(*(batch(b) for b in range(args.batches)),
                                     *([hold_and_release()] if args.hold else []))
            finally:
                sampler.cancel()
                await asyncio.gather(sampler, return_exceptions=True)
            wall = time.monotonic() - w0
            cpu = cpu_s(pid) - c0
            n = per_batch * args.batches
            st = await get_status(s, url)
            removed = len(ports) - st["ready_instances"]
            events = [e for e in st.get("recent_events", []) if "dead" in json.dumps(e).lower()]
            print(f"load: {n} sequences x {args.tokens} tokens in {args.batches} batches at once: "
                  f"{wall:.1f}s wall, {n / wall:.0f} sequences/s", flush=True)
            print(f"  exact outputs: {done - len(bad)}/{n}; instances removed: {removed} "
                  f"(active {st['ready_instances']}/{len(ports)}, counts {st['counts']}); dead events: {len(events)}")
            print(f"  manager CPU: {cpu:.1f}s = {1000 * cpu / n:.2f} ms per sequence, "
                  f"{1e6 * cpu / (n * args.tokens):.1f} us per token; peak RSS (VmHWM) "
                  f"{status_kb(pid, 'VmHWM') / 1024:.0f} MB")
            print(f"  manager: {json.dumps(st['manager'])}")
            # HTTP/1.1 streams one answer per connection: sharing would show as fewer connections than
            # sequences streaming; the sample with the most connections shows how they compare
            top = max(samples, key=lambda x: x[2], default=(0, 0, 0))
            print(f"  connections: peak {peak['fds']} descriptors, {peak['socks']} sockets, "
                  f"{peak['to_instances']} to instances (at most {peak['max_per_instance']} to one instance); "
                  f"peak {peak['in_flight']} sequences in flight on instances, "
                  f"{peak['waiting_conn']} waiting for a connection; at the sample with the most connections: "
                  f"{top[0]} sequences placed on instances, {top[1]} of them waiting for a connection, "
                  f"{top[2]} connections to instances")
            figures = {"cpu_us_per_token": 1e6 * cpu / (n * args.tokens)}
            if hold_result:
                # the memory figure: what the manager holds per token in flight, above its idle footprint
                peak_kb, tokens = status_kb(pid, "VmHWM"), hold_result["tokens"]
                figures.update(held=1024 * (hold_result["rss_kb"] - idle_rss_kb) / max(tokens, 1),
                               peak=1024 * (peak_kb - idle_rss_kb) / max(tokens, 1))
                print(f"  memory: {hold_result['sequences']} sequences held {tokens} tokens in flight; RSS idle "
                      f"{idle_rss_kb / 1024:.0f} MB, with them all held {hold_result['rss_kb'] / 1024:.0f} MB, "
                      f"peak {peak_kb / 1024:.0f} MB: "
                      f"{1024 * (hold_result['rss_kb'] - idle_rss_kb) / max(tokens, 1):.1f} bytes per token held, "
                      f"{1024 * (peak_kb - idle_rss_kb) / max(tokens, 1):.1f} bytes per token at the peak")
                if probe:
                    probed = json.loads(Path(probe_out).read_text())
                    if "allocator" in probed:
                        print_allocators(probed["allocator"], hold_result["sequences"],
                                         1024 * (hold_result["rss_kb"] - idle_rss_kb))
                    else:
                        print_memory_owners(probed, hold_result["sequences"])
            for line in bad[:5]:
                print("  BAD:", line)
            if bad or removed:
                raise SystemExit(1)
            return figures
    finally:
        stop_all(procs)


def compare_r3(args: argparse.Namespace) -> None:
    """``--r3``: the measurement with R3 off, then on, and what R3 adds."""
    shape = args.r3
    print("== routed-expert replay off", flush=True)
    off = asyncio.run(run(argparse.Namespace(**{**vars(args), "routed_experts": None})))
    print(f"== routed-expert replay on, {shape[0]} layers x top-{shape[1]}", flush=True)
    on = asyncio.run(run(argparse.Namespace(**{**vars(args), "routed_experts": shape})))
    experts = shape[0] * shape[1] * 4
    print(f"R3 {shape[0]}x{shape[1]} against off, {args.sequences} x {args.tokens} tokens: manager CPU "
          f"{on['cpu_us_per_token']:.2f} against {off['cpu_us_per_token']:.2f} us per token")
    if "held" in on:
        print(f"  bytes per token held {on['held']:,.1f} against {off['held']:,.1f} (the experts come with the "
              f"final chunk); at the peak {on['peak']:,.1f} against {off['peak']:,.1f}; the experts' own bytes "
              f"{experts:,} a token, {experts * 4 // 3:,} as base64")
        print(f"  bytes per token held {on['held'] - off['held']:+,.0f}, at the peak (the next line) "
              f"{on['peak'] - off['peak']:+,.0f}")
        extra = f"{on['peak'] - off['peak']:+,.0f}"
    else:
        extra = "not measured (no --hold)"
    print(f"r3: cpu per token {on['cpu_us_per_token'] / off['cpu_us_per_token']:.2f}x, bytes per token {extra} "
          f"(experts {experts:,})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--instances", type=int, default=1000)
    parser.add_argument("--sequences", type=int, default=8000)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--helpers", type=int, default=2, help="fake SGLang processes serving the ports")
    parser.add_argument("--cumulative", action="store_true",
                        help="fakes stream cumulative chunks (SGLang's default) instead of deltas")
    parser.add_argument("--soft", type=int, default=1024, help="the manager's soft open-file limit at start")
    parser.add_argument("--hard", type=int, default=0, help="its hard limit (default: the machine's)")
    parser.add_argument("--idle-s", type=float, default=10.0)
    parser.add_argument("--sample-s", type=float, default=0.5, help="how often descriptors are counted")
    parser.add_argument("--hold", action="store_true",
                        help="fakes hold each stream's final chunk until every sequence is in flight; report "
                             "the manager's bytes per token in flight")
    parser.add_argument("--hold-timeout-s", type=float, default=600.0)
    parser.add_argument("--trace-memory", action="store_true",
                        help="with --hold: trace the manager's Python allocations (tracemalloc, which slows it) "
                             "and print what a held sequence costs, by owner")
    parser.add_argument("--allocator-stats", action="store_true",
                        help="with --hold: print what the allocators (pymalloc, glibc malloc) hold per held "
                             "sequence, live and free (instead of --trace-memory: the manager runs at full speed)")
    parser.add_argument("--trace-frames", type=int, default=1,
                        help="with --trace-memory: frames per traced allocation; above 1, also print the "
                             "biggest allocation sites with their callers")
    parser.add_argument("--routed-experts", type=parse_shape, default=None, metavar="LAYERSxTOP_K",
                        help="every sequence asks for routed experts (R3), which the fakes send in this shape")
    parser.add_argument("--r3", type=parse_shape, default=None, metavar="LAYERSxTOP_K",
                        help="run twice, R3 off then on in this shape (Qwen3-30B-A3B: 48x8), and compare")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="manager config")
    parser.add_argument("--logs", default="/tmp/bench-scale")
    parser.add_argument("--serve-fake", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_fake:
        asyncio.run(serve_fake(args.serve_fake, args.tokens, args.cumulative, args.hold, args.routed_experts))
    else:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout` still stops the helpers
        if args.r3:
            compare_r3(args)
        else:
            asyncio.run(run(args))


if __name__ == "__main__":
    main()
