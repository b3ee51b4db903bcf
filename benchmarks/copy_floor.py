"""The floor under relaying large values: a uvloop process that receives messages over 127.0.0.1 (reads as they
come), joins each message's reads once and sends the message on, and nothing else. Its CPU per MB (utime + stime
from /proc, the kernel's socket copies and page faults included) is what any relay of those bytes costs at the
least on this machine: ``bench_relay.py --r3`` runs it beside the manager to put R3's cost per MB of experts
against it.

    .venv/bin/python benchmarks/copy_floor.py --mb 8 --messages 64      # one JSON line: ms of CPU per MB
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def cpu() -> tuple[float, float]:
    fields = Path(f"/proc/{os.getpid()}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / TICK, int(fields[12]) / TICK


def peer(role: str, port: int, size: int, count: int) -> None:
    """The sender (``count`` messages of ``size`` bytes) or the sink (reads them all), a process of its own."""
    s = socket.create_connection(("127.0.0.1", port))
    if role == "send":
        message = b"A" * size
        for _ in range(count):
            s.sendall(message)
    else:
        got = 0
        while got < size * count and (data := s.recv(1 << 20)):
            got += len(data)
    s.close()


class Relay(asyncio.Protocol):
    """Holds a message's reads in a list, joins them once at its end and writes the message on."""

    def __init__(self, out: asyncio.Transport, size: int, done: asyncio.Future[None]) -> None:
        self.out, self.size, self.done = out, size, done
        self.parts: list[bytes] = []
        self.held = 0

    def data_received(self, data: bytes) -> None:
        self.parts.append(data)
        self.held += len(data)
        while self.held >= self.size:
            whole = b"".join(self.parts)
            self.out.write(whole[:self.size])
            rest = whole[self.size:]
            self.parts, self.held = ([rest] if rest else []), len(rest)

    def connection_lost(self, exc: Exception | None) -> None:
        self.done.set_result(None)


async def run(size: int, count: int) -> dict[str, float]:
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    sink_side: asyncio.Future[asyncio.Transport] = loop.create_future()

    class Out(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            sink_side.set_result(transport)  # type: ignore[arg-type]

    def child(role: str, port: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, __file__, "--peer", role, str(port), "--mb", str(size / 2**20),
                                 "--messages", str(count)])

    out_server = await loop.create_server(Out, "127.0.0.1", 0)
    sink = child("sink", out_server.sockets[0].getsockname()[1])
    out = await sink_side
    in_server = await loop.create_server(lambda: Relay(out, size, done), "127.0.0.1", 0)
    user, system = cpu()
    sender = child("send", in_server.sockets[0].getsockname()[1])
    await done
    while out.get_write_buffer_size():
        await asyncio.sleep(0.001)
    user1, system1 = cpu()
    out.close()
    await asyncio.to_thread(sender.wait)
    await asyncio.to_thread(sink.wait)
    mb = size * count / 1e6
    return {"user_ms_per_mb": (user1 - user) / mb * 1e3, "sys_ms_per_mb": (system1 - system) / mb * 1e3,
            "ms_per_mb": (user1 - user + system1 - system) / mb * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=8.0, help="bytes of one message, in MiB")
    parser.add_argument("--messages", type=int, default=64)
    parser.add_argument("--peer", nargs=2, metavar=("ROLE", "PORT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    size = int(args.mb * 2**20)
    if args.peer:
        peer(args.peer[0], int(args.peer[1]), size, args.messages)
        return
    try:
        import uvloop
    except ImportError:  # the manager runs on uvloop when installed (the fast extra)
        print(json.dumps(asyncio.run(run(size, args.messages))))
        return
    print(json.dumps(uvloop.run(run(size, args.messages))))


if __name__ == "__main__":
    main()
