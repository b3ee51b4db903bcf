"""Weight-push throughput over loopback: Mooncake TCP in several layouts against plain multi-stream TCP.

Not a test: prints markdown tables. Run from the repository root:

    .venv/bin/python benchmarks/bench_weight_transfer.py --size-mib 1024 --repeat 3

A ``--size-mib`` buffer is pushed to ``--receivers`` receivers, each its own process on 127.0.1.<r+1>
(the sender's groups bind 127.0.0.<g+1>). A setting (G, E) means G transfer groups, each one
interface, and E shards per group. Receivers are assigned to groups round-robin; a group pushes to
its receivers one after the other, groups run concurrently; with more groups than receivers a
receiver's buffer is split over the groups that serve it. Three Mooncake variants per setting:

- ``1 engine``: one engine per group, its E shards submitted together (``write_many``, poll mode);
- ``E engines``: one engine per shard on the sender, all on the group's IP, one receiver engine;
- ``E+E engines``: one engine per shard on the sender, and the receiver registers its buffer with E
  engines too, shard i going to receiver engine i.

Plain TCP (``TcpEngine``) is run with the same (G, E), E = parallel streams; the baseline row is one
group with 4 streams. Figures are GB/s (10^9 bytes/s) of all bytes delivered, the median of
``--repeat`` timed runs; each configuration first does one untimed run into zeroed receivers whose
bytes are verified by per-shard checksums. Timed rounds interleave the configurations, so load from
other processes spreads over all of them. A second table gives CPU seconds per GB delivered (sender
and receiver processes, every thread): on a small shared box it is steadier than throughput, and it
bounds throughput on a dedicated one (cores / CPU-s-per-GB).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# Mooncake logs through glog; keep its INFO/WARNING chatter out of the tables (receivers inherit it).
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

from rollout_manager.weights import HostBuffer, MooncakeEngine, TcpEngine, push_buffer, shard_checksums, split_shards

ALIGN = 4096
VERIFY_SHARDS = 8


def _parse_env(items: list[str]) -> dict[str, str]:
    env = {}
    for item in items:
        k, _, v = item.partition("=")
        env[k] = v
    return env


# -- receiver process -------------------------------------------------------------------------------
def receiver_main(index: int, size: int, max_engines: int, mc_env: dict[str, str], conn) -> None:
    host = f"127.0.1.{index + 1}"
    buf = HostBuffer(size)
    engines = []
    for _ in range(max_engines):
        e = MooncakeEngine(host, env=mc_env).start()
        e.register(buf.addr, buf.nbytes)
        engines.append(e)
    tcp = TcpEngine(host).start()
    tcp.register(buf.addr, buf.nbytes)
    conn.send({"addr": buf.addr, "mooncake": [e.session_id for e in engines], "tcp": tcp.session_id})
    while True:
        cmd = conn.recv()
        if cmd == "clear":
            buf.array[:] = 0
            conn.send("ok")
        elif cmd == "cpu":
            conn.send(time.process_time())
        elif cmd == "checksums":
            conn.send(shard_checksums(buf.array, split_shards(size, VERIFY_SHARDS, ALIGN)))
        elif cmd == "quit":
            conn.send("bye")
            os._exit(0)  # skip the engines' slow destructors; the process is going away


class Receivers:
    def __init__(self, n: int, size: int, max_engines: int, mc_env: dict[str, str]):
        ctx = mp.get_context("spawn")
        self.conns, self.procs, self.info = [], [], []
        for i in range(n):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=receiver_main, args=(i, size, max_engines, mc_env, child), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        self.info = [c.recv() for c in self.conns]

    def call(self, cmd: str) -> list:
        for c in self.conns:
            c.send(cmd)
        return [c.recv() for c in self.conns]

    def close(self) -> None:
        self.call("quit")
        for p in self.procs:
            p.join(timeout=10)


# -- push plans -------------------------------------------------------------------------------------
def plan(groups: int, receivers: int, size: int) -> list[list[tuple[int, int, int]]]:
    """Per group: [(receiver, offset, length), ...] pushed in order."""
    work: list[list[tuple[int, int, int]]] = [[] for _ in range(groups)]
    if groups <= receivers:
        for r in range(receivers):
            work[r % groups].append((r, 0, size))
    else:
        for r in range(receivers):
            serving = [g for g in range(groups) if g % receivers == r]
            for g, (off, length) in zip(serving, split_shards(size, len(serving), ALIGN)):
                work[g].append((r, off, length))
    return work


class Sender:
    def __init__(self, buf: HostBuffer, mc_env: dict[str, str]):
        self.buf = buf
        self.mc_env = mc_env
        self._mc: dict[tuple[int, int], MooncakeEngine] = {}
        self._tcp: dict[tuple[int, int], TcpEngine] = {}

    def mooncake(self, group: int, index: int) -> MooncakeEngine:
        key = (group, index)
        if key not in self._mc:
            e = MooncakeEngine(f"127.0.0.{group + 1}", env=self.mc_env).start()
            e.register(self.buf.addr, self.buf.nbytes)
            self._mc[key] = e
        return self._mc[key]

    def tcp(self, group: int, streams: int) -> TcpEngine:
        key = (group, streams)
        if key not in self._tcp:
            e = TcpEngine(f"127.0.0.{group + 1}", streams=streams, listen=False).start()
            e.register(self.buf.addr, self.buf.nbytes)
            self._tcp[key] = e
        return self._tcp[key]

    def close_tcp(self) -> None:
        for e in self._tcp.values():
            e.close()


def run_once(sender: Sender, rx: Receivers, groups: int, per_group: int, variant: str, size: int,
             mode: str | None = None) -> float:
    work = plan(groups, len(rx.info), size)
    errors: list[BaseException] = []

    def group_job(g: int) -> None:
        try:
            for r, off, length in work[g]:
                info = rx.info[r]
                if variant == "tcp":
                    engines, targets = sender.tcp(g, per_group), [info["tcp"]]
                elif variant == "1 engine":
                    engines, targets = sender.mooncake(g, 0), [info["mooncake"][0]]
                elif variant == "E engines":
                    engines = [sender.mooncake(g, i) for i in range(per_group)]
                    targets = [info["mooncake"][0]]
                elif variant == "E+E engines":
                    engines = [sender.mooncake(g, i) for i in range(per_group)]
                    targets = info["mooncake"][:per_group]
                else:
                    raise ValueError(variant)
                push_buffer(engines, sender.buf.addr + off, length, targets, info["addr"] + off, per_group,
                            align=ALIGN, compute_checksums=False, mode=mode)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=group_job, args=(g,)) for g in range(groups) if work[g]]
    cpu0 = time.process_time() + sum(rx.call("cpu"))
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    cpu = time.process_time() + sum(rx.call("cpu")) - cpu0
    if errors:
        raise errors[0]
    gb = len(rx.info) * size / 1e9
    return gb / dt, cpu / gb


def warm_and_verify(sender: Sender, rx: Receivers, expected: list[str], cfg: tuple, size: int) -> None:
    """One untimed run (connections, handshakes) into cleared receivers, then check every byte."""
    groups, per_group, variant, mode = cfg
    rx.call("clear")
    run_once(sender, rx, groups, per_group, variant, size, mode)
    for got in rx.call("checksums"):
        if got != expected:
            raise RuntimeError(f"data mismatch after {variant} ({groups},{per_group}) mode {mode}")


def measure_all(sender: Sender, rx: Receivers, expected: list[str], configs: list[tuple], size: int,
                repeat: int) -> dict[tuple, tuple[float, float] | str]:
    """Median (GB/s, CPU s/GB) per config. Rounds interleave the configs, so load from elsewhere on
    the box spreads over all of them instead of skewing one."""
    rates: dict[tuple, list[tuple[float, float]]] = {}
    failed: dict[tuple, str] = {}
    for cfg in configs:
        try:
            warm_and_verify(sender, rx, expected, cfg, size)
            rates[cfg] = []
        except Exception as exc:
            failed[cfg] = f"error: {exc}"
    for _ in range(repeat):
        for cfg in rates:
            groups, per_group, variant, mode = cfg
            rates[cfg].append(run_once(sender, rx, groups, per_group, variant, size, mode))
    out: dict[tuple, tuple[float, float] | str] = {
        cfg: (statistics.median(x[0] for x in r), statistics.median(x[1] for x in r)) for cfg, r in rates.items()}
    out.update(failed)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--receivers", type=int, default=2)
    ap.add_argument("--settings", default="1x1,1x4,2x4,2x8,4x4", help="GROUPSxSHARDS,...")
    ap.add_argument("--variants", default="1 engine,E engines,E+E engines,tcp")
    ap.add_argument("--baseline-streams", type=int, default=4)
    ap.add_argument("--modes", default="poll,batch,async_batch,threads",
                    help="write modes compared at setting --modes-at with one engine per group ('' skips)")
    ap.add_argument("--modes-at", default="1x4")
    ap.add_argument("--mc-env", action="append", default=[], metavar="KEY=VALUE",
                    help="MC_* setting for every Mooncake engine, e.g. MC_TCP_SLICE_SIZE=1048576")
    args = ap.parse_args()

    size = args.size_mib << 20
    settings = [tuple(int(x) for x in s.split("x")) for s in args.settings.split(",") if s]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    mc_env = _parse_env(args.mc_env)
    max_rx_engines = max([e for _, e in settings] + [1]) if "E+E engines" in variants else 1

    t_setup = time.perf_counter()
    buf = HostBuffer(size)
    buf.array[:] = os.getpid() & 0xFF  # a pattern that a zeroed receiver cannot match by accident
    buf.array[::4093] = 7
    buf.array[::65537] = 201
    t0 = time.perf_counter()
    expected = shard_checksums(buf.array, split_shards(size, VERIFY_SHARDS, ALIGN))
    ck = time.perf_counter() - t0
    rx = Receivers(args.receivers, size, max_rx_engines, mc_env)
    sender = Sender(buf, mc_env)
    print(f"# weight push: {args.size_mib} MiB to {args.receivers} receivers over loopback, "
          f"median of {args.repeat}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}, "
          f"MC env {mc_env or '{}'}")
    print(f"checksums (xxh3_64, {VERIFY_SHARDS} shards, {args.size_mib} MiB): {size / ck / 1e9:.1f} GB/s; "
          f"setup {time.perf_counter() - t_setup:.1f} s\n", flush=True)

    try:
        base_cfg = (1, args.baseline_streams, "tcp", None)
        configs = [base_cfg] + [(g, e, v, None) for g, e in settings for v in variants]
        modes = [m for m in args.modes.split(",") if m]
        mg, me = (int(x) for x in args.modes_at.split("x"))
        configs += [(mg, me, "1 engine", m) for m in modes]
        configs = list(dict.fromkeys(configs))
        res = measure_all(sender, rx, expected, configs, size, args.repeat)
        base_r = res[base_cfg]
        assert not isinstance(base_r, str), base_r
        base, base_cpu = base_r

        def cell(cfg: tuple) -> str:
            r = res[cfg]
            return r if isinstance(r, str) else f"{r[0]:.2f} ({r[0] / base:.2f})"

        def cpu_cell(cfg: tuple) -> str:
            r = res[cfg]
            return "-" if isinstance(r, str) else f"{r[1]:.2f}"

        print(f"baseline: plain TCP, 1 group, {args.baseline_streams} streams: {base:.2f} GB/s, "
              f"{base_cpu:.2f} CPU s/GB\n")
        print("Throughput, GB/s delivered (ratio to the baseline):\n")
        print("| groups x shards | " + " | ".join(variants) + " |")
        print("|" + " --- |" * (len(variants) + 1))
        for g, e in settings:
            print(f"| {g} x {e} | " + " | ".join(cell((g, e, v, None)) for v in variants) + " |")
        print("\nCPU cost, CPU seconds per GB delivered (sender + receivers, all threads; lower is better):\n")
        print("| groups x shards | " + " | ".join(variants) + " |")
        print("|" + " --- |" * (len(variants) + 1))
        for g, e in settings:
            print(f"| {g} x {e} | " + " | ".join(cpu_cell((g, e, v, None)) for v in variants) + " |")
        if modes:
            print(f"\nMooncake write modes, one engine per group, {mg} x {me}:\n")
            print("| mode | GB/s (x base) | CPU s/GB |\n| --- | --- | --- |")
            for m in modes:
                cfg = (mg, me, "1 engine", m)
                print(f"| {m} | {cell(cfg)} | {cpu_cell(cfg)} |")
        print(f"\nload average at the end: {os.getloadavg()[0]:.2f} (1 min); run took "
              f"{time.perf_counter() - t_setup:.0f} s")
    finally:
        sender.close_tcp()
        rx.close()
        sys.stdout.flush()
        # Mooncake engines' destructors take up to ~1 s each, holding the GIL; the process is ending.
        os._exit(0)


if __name__ == "__main__":
    main()
