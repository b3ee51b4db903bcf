"""Relay cost: manager CPU per relayed token, by how the engines stream and how long sequences are.

64 sequences of N tokens (N = 1,024 and 4,096) are asked of a real manager process as non-streaming
``/generate`` calls (what a trainer sends), all at once. Behind it two fake SGLang backends
(benchmarks/fake_sglang.py: instant, cheap to run) stream each sequence in one of these ways:

- ``cumulative/1``: SGLang's defaults (cumulative chunks, server stream interval 1) and a manager that
  sends no per-request interval (``engine_stream_interval=0``): the relay before issue 14.
- ``cumulative/req``: SGLang's defaults, the manager's per-request ``stream_interval`` (this version's
  default): an instance that was not started by launch_sglang.sh.
- ``incremental/1``: ``--incremental-streaming-output``, interval 1, no per-request interval.
- ``incremental/req``: ``--incremental-streaming-output`` and the manager's per-request interval: an
  instance started by launch_sglang.sh.
- ``incremental/server16``: ``--incremental-streaming-output --stream-interval 16``, no per-request interval.

The figure is the manager's CPU time (utime + stime from ``/proc/<pid>/stat``, all its threads) over the
load, divided by the tokens relayed. Every output is checked token for token. Everything runs in one
run, so the ratios are comparable.

With ``--r3 48x8 [2x4 ...]`` every mode also runs with routed-expert replay (R3) on, one run per shape
(layers x top-k: Qwen3-30B-A3B is 48x8): the fakes answer ``return_routed_experts`` as SGLang does
(rows on the final chunk only), every request asks for them, every answer's experts are checked equal to
what the engine sent, and the table gains the cost against R3 off, and the manager's peak RSS above its
RSS before the loads, per token (VmHWM: all sequences finishing at once; the experts' own bytes are
``layers x top_k x 4`` a token, 4/3 of that as base64). It then says what R3 costs per MB of base64 (on minus
off) against the floor of relaying those bytes at all on this machine (benchmarks/copy_floor.py: a bare uvloop
process that receives each final chunk's bytes, joins them once and sends them on; its CPU per MB, the kernel's
copies included), and the best ratio to R3 off that floor allows.

    .venv/bin/python benchmarks/bench_relay.py                 # 64 x 1024 and 64 x 4096, every mode
    .venv/bin/python benchmarks/bench_relay.py --interval 32 --lengths 4096 --modes incremental/req
    .venv/bin/python benchmarks/bench_relay.py --modes incremental/req cumulative/req --r3 48x8 2x4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_manager_overhead import cpu_s, register_backends, spawn, stop_all, wait_ok
from bench_scale import status_kb
from fake_sglang import parse_shape, routed_rows

from rollout_manager.osutil import free_port

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable

# name -> (fake backend flags, whether the manager sends its per-request interval)
MODES: dict[str, tuple[list[str], bool]] = {
    "cumulative/1": ([], False),
    "cumulative/req": ([], True),
    "incremental/1": (["--incremental-streaming-output"], False),
    "incremental/req": (["--incremental-streaming-output"], True),
    "incremental/server16": (["--incremental-streaming-output", "--stream-interval", "16"], False),
}


async def relay(manager: str, sequences: int, tokens: int, experts: tuple[int, int] | None = None) -> float:
    """Send ``sequences`` non-streaming requests at once (asking for routed experts of shape ``experts``
    when given); check each output; return the wall time."""
    prompt = [1, 2, 3, 4]
    body: dict[str, Any] = {"input_ids": prompt,
                            "sampling_params": {"max_new_tokens": tokens, "temperature": 0}}
    expected = list(range(1, tokens + 1))
    rows = None
    if experts is not None:
        body["return_routed_experts"] = True
        rows = routed_rows(experts, 0, len(prompt) + tokens)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=1800)) as s:
        async def one() -> None:
            async with s.post(manager + "/generate", json=body) as r:
                out = await r.json()
                if r.status != 200 or out["output_ids"] != expected or \
                        out["meta_info"].get("routed_experts") != rows:
                    raise RuntimeError(f"HTTP {r.status}: wrong output ({str(out)[:200]})")

        t0 = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(sequences)))
        return time.perf_counter() - t0


@dataclass
class Figures:
    """One mode's (and R3 shape's) figures at one length: median CPU, its run's wall time, and the peak RSS
    per token above the manager's RSS before the loads (VmHWM: it covers this length and the shorter ones
    run before it)."""

    us_per_token: float
    wall_s: float
    peak_bytes_per_token: float


async def run_mode(mode: str, lengths: list[int], sequences: int, interval: int,
                   logs: Path, repeat: int = 1, experts: tuple[int, int] | None = None) -> dict[int, Figures]:
    flags, per_request = MODES[mode]
    if experts is not None:
        flags = [*flags, "--routed-experts", f"{experts[0]}x{experts[1]}"]
    procs: list[subprocess.Popen] = []
    try:
        backends = []
        name = mode.replace("/", "_") + ("" if experts is None else f"-r3-{experts[0]}x{experts[1]}")
        for k in range(2):
            port = free_port()
            procs.append(spawn([PY, str(ROOT / "benchmarks/fake_sglang.py"), "--port", str(port),
                                "--chunks", str(max(lengths)), *flags], logs / f"{name}-backend{k}.log"))
            backends.append(f"http://127.0.0.1:{port}")
        mport = free_port()
        sets = ["pending_poll_interval_s=0.1", f"engine_stream_interval={interval if per_request else 0}",
                "stream_stall_timeout_s=1800"]
        manager = spawn([PY, "-m", "rollout_manager", "serve", "--bind", f"127.0.0.1:{mport}", "--log-level",
                         "warning", *[a for kv in sets for a in ("--set", kv)]],
                        logs / f"{name}-manager.log")
        procs.append(manager)
        url = f"http://127.0.0.1:{mport}"
        await register_backends(url, backends)
        await wait_ok(url + "/health")
        await relay(url, 4, 64, experts)  # warm up connections and code paths
        rss_kb = status_kb(manager.pid, "VmRSS")
        out = {}
        for n in sorted(lengths):
            runs = []
            for _ in range(repeat):  # the median run: one run is under a second, and as noisy
                before = cpu_s(manager.pid)
                wall = await relay(url, sequences, n, experts)
                runs.append(((cpu_s(manager.pid) - before) / (sequences * n) * 1e6, wall))
            cpu, wall = sorted(runs)[len(runs) // 2]
            out[n] = Figures(cpu, wall, 1024 * (status_kb(manager.pid, "VmHWM") - rss_kb) / (sequences * n))
        return out
    finally:
        stop_all(procs)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--interval", type=int, default=64, help="the manager's engine_stream_interval (default 64)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--repeat", type=int, default=3, help="runs per length; the median is printed")
    parser.add_argument("--r3", type=parse_shape, nargs="*", default=[], metavar="LAYERSxTOP_K",
                        help="also run every mode with routed-expert replay on, per shape (Qwen3-30B-A3B: 48x8)")
    args = parser.parse_args()
    args.lengths.sort()
    logs = Path(os.environ.get("BENCH_LOGS", "/tmp/bench-relay"))
    logs.mkdir(parents=True, exist_ok=True)
    results = {mode: await run_mode(mode, args.lengths, args.sequences, args.interval, logs, args.repeat)
               for mode in args.modes}
    print(f"manager CPU per relayed token, {args.sequences} non-streaming sequences at once, "
          f"per-request interval {args.interval} ('req'); µs/token (wall s), median of {args.repeat} runs")
    print(f"{'mode':<22}" + "".join(f"{f'{n} tokens':>20}" for n in args.lengths)
          + (f"{'growth':>9}" if len(args.lengths) > 1 else ""))
    for mode, row in results.items():
        cells = "".join(f"{f'{row[n].us_per_token:.2f} ({row[n].wall_s:.1f}s)':>20}" for n in args.lengths)
        growth = (f"{row[args.lengths[-1]].us_per_token / row[args.lengths[0]].us_per_token:>8.2f}x"
                  if len(args.lengths) > 1 else "")
        print(f"{mode:<22}{cells}{growth}")
    base = args.modes[0]
    for n in args.lengths:
        ratios = ", ".join(f"{m} {results[base][n].us_per_token / results[m][n].us_per_token:.0f}x"
                           for m in args.modes[1:])
        if ratios:
            print(f"{n} tokens, cheaper than {base}: {ratios}")
    if args.r3:
        await r3_table(args, results, logs)


def r3_cell(on: Figures, off: Figures) -> str:
    return (f"{on.us_per_token:.2f} ({on.us_per_token / off.us_per_token:.2f}x), "
            f"{on.peak_bytes_per_token:,.0f} ({off.peak_bytes_per_token:,.0f})")


async def r3_table(args: argparse.Namespace, off: dict[str, dict[int, Figures]], logs: Path) -> None:
    """Run every mode again with R3 on, per shape; print its cost against R3 off (``off``, this run's)."""
    on = {(mode, shape): await run_mode(mode, args.lengths, args.sequences, args.interval, logs, args.repeat,
                                        shape)
          for shape in args.r3 for mode in args.modes}
    print("\nrouted-expert replay (R3) on against off: µs/token (x off), peak RSS bytes per token (off)")
    print(f"{'mode':<22}{'shape':>7}{'experts B/token':>16}"
          + "".join(f"{f'{n} tokens':>34}" for n in args.lengths))
    for (mode, shape), row in on.items():
        cells = "".join(f"{r3_cell(row[n], off[mode][n]):>34}" for n in args.lengths)
        print(f"{mode:<22}{f'{shape[0]}x{shape[1]}':>7}{shape[0] * shape[1] * 4:>16,}{cells}")
    n, mode, shape = args.lengths[-1], args.modes[0], args.r3[0]
    print("\nR3's CPU per MB of experts' base64 (on - off), and the floor: a bare uvloop relay that receives the "
          "bytes, joins each final chunk's reads once and sends them on (benchmarks/copy_floor.py, same run)")
    for shape_ in args.r3:
        text = shape_[0] * shape_[1] * 4 * 4 // 3  # base64 bytes a token
        floor = copy_floor(text * n, args.sequences)
        for mode_ in args.modes:
            on_, off_ = on[mode_, shape_][n], off[mode_][n]
            best = (off_.us_per_token + floor * text / 1e3) / off_.us_per_token
            per_mb = (on_.us_per_token - off_.us_per_token) / text * 1e3
            print(f"{mode_:<22}{f'{shape_[0]}x{shape_[1]}':>7}  {per_mb:.2f} ms/MB against a floor of {floor:.2f} "
                  f"ms/MB: at best {best:.2f}x off at {n} tokens")
    print(f"the last line: {mode}, {shape[0]}x{shape[1]}, {args.sequences} x {n} tokens; bytes per token at the peak")
    print(f"r3: cpu per token {on[mode, shape][n].us_per_token / off[mode][n].us_per_token:.2f}x, bytes per token "
          f"{on[mode, shape][n].peak_bytes_per_token - off[mode][n].peak_bytes_per_token:+,.0f} "
          f"(experts {shape[0] * shape[1] * 4:,})")


def copy_floor(message_bytes: int, messages: int) -> float:
    """ms of CPU per MB for a bare relay of ``messages`` messages of ``message_bytes`` (benchmarks/copy_floor.py)."""
    out = subprocess.run([PY, str(ROOT / "benchmarks/copy_floor.py"), "--mb", str(message_bytes / 2**20),
                          "--messages", str(messages)], capture_output=True, text=True, check=True, timeout=600)
    return float(json.loads(out.stdout.strip().splitlines()[-1])["ms_per_mb"])


if __name__ == "__main__":
    asyncio.run(main())
