"""Every transfer wait has a deadline (issue 28): a receiver that stops taking bytes without closing
its connection (blackholed) fails the write within the deadline, and the sender's trainer is not held.

Loopback only: a socket that accepts and never reads (or answers the header, then stops reading) for
the plain TCP engine and the sender agent; a receiver process stopped with SIGSTOP for Mooncake.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import aiohttp
import numpy as np
import pytest
import torch

from rollout_manager.osutil import free_port
from rollout_manager.weights import HostBuffer, MooncakeEngine, TcpEngine, TransferError, mooncake_available
from rollout_manager.weights.protocol import PushRequest
from rollout_manager.weights.sender_agent import SenderAgent

SIZE = 64 << 20  # far more than loopback's socket buffers take while nobody reads
DEADLINE_S = 0.5


class Blackhole:
    """A TCP listener on 127.0.0.1 that accepts and never reads; with ``accept_header`` it first answers
    the engine's frame header (so the sender is inside its payload) and then stops reading."""

    def __init__(self, accept_header: bool = False) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.accept_header = accept_header
        self.conns: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.server.getsockname()[1]}"

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            self.conns.append(conn)
            if self.accept_header:
                with contextlib.suppress(OSError):
                    conn.recv(20, socket.MSG_WAITALL)
                    conn.sendall(b"\x00")

    def close(self) -> None:
        self.server.close()
        for conn in self.conns:
            conn.close()


def within(seconds: float, call: Callable[[], None]) -> BaseException | None:
    """Run ``call`` on a daemon thread; its exception (None: it returned). A call still blocked after
    ``seconds`` fails the test rather than hang it."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, f"still blocked after {seconds}s"
    return outcome[0]


@pytest.fixture
def source() -> Iterator[HostBuffer]:
    yield HostBuffer(SIZE)


@pytest.mark.parametrize("accept_header", [False, True], ids=["silent", "stops reading"])
@pytest.mark.parametrize("streams", [1, 4])
def test_a_tcp_write_to_a_blackholed_receiver_fails_at_its_deadline(source: HostBuffer, accept_header: bool,
                                                                    streams: int) -> None:
    hole = Blackhole(accept_header)
    sink = HostBuffer(SIZE)
    with TcpEngine("127.0.0.1", listen=False, streams=streams) as sender, TcpEngine("127.0.0.1") as good:
        sender.register(source.addr, source.nbytes)
        good.register(sink.addr, sink.nbytes)
        t0 = time.monotonic()
        error = within(10, lambda: sender.write_many(hole.target, [(source.addr, 0, SIZE)], timeout_s=DEADLINE_S))
        took = time.monotonic() - t0
        assert isinstance(error, TransferError) and error.code == -2, error
        assert f"within {DEADLINE_S:g}s" in str(error)
        assert DEADLINE_S <= took < DEADLINE_S + 2, took
        # The engine is not spoiled: the cut connections were dropped, a good receiver still gets it all.
        source.array[:] = 7
        sender.write_many(good.session_id, [(source.addr, sink.addr, SIZE)], timeout_s=30)
        assert np.array_equal(sink.array, source.array)
    hole.close()


def test_without_a_deadline_the_tcp_engine_behaves_as_before(source: HostBuffer) -> None:
    sink = HostBuffer(SIZE)
    with TcpEngine("127.0.0.1", listen=False) as sender, TcpEngine("127.0.0.1") as good:
        sender.register(source.addr, source.nbytes)
        good.register(sink.addr, sink.nbytes)
        source.array[:] = 3
        sender.write_many(good.session_id, [(source.addr, sink.addr, SIZE)])
        assert np.array_equal(sink.array, source.array)


def _weights() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(4 << 20, dtype=torch.float32)}  # 16 MiB


async def test_a_push_to_a_blackholed_receiver_fails_and_the_trainer_can_stage_again(monkeypatch) -> None:
    monkeypatch.delenv("ROLLOUT_MANAGER_AUTH_TOKEN", raising=False)
    hole = Blackhole(accept_header=True)
    port = free_port()
    sender = SenderAgent(["127.0.0.1"], port, auth_token="", transfer_timeout_s=1.0).start()
    try:
        sender.stage(_weights(), version=1)
        req = PushRequest(version=1, ip="127.0.0.1", num_engines=2, transport="tcp", session_ids=[hole.target],
                          buffer_addr=0)
        t0 = time.monotonic()
        async with aiohttp.ClientSession() as s, s.post(
                f"http://127.0.0.1:{port}/push", data=json.dumps(req.model_dump(exclude_none=True)),
                timeout=aiohttp.ClientTimeout(total=20)) as r:
            answer = await r.json()
        assert r.status == 502 and "within 1s" in answer["error"], answer
        assert time.monotonic() - t0 < 4
        # The push thread let go of the staged buffer: the next version stages at once.
        staged = threading.Thread(target=sender.stage_stream, args=(iter(_weights().items()), 2))
        staged.start()
        staged.join(10)
        assert not staged.is_alive() and sender.version == 2
    finally:
        sender.stop()
        hole.close()


# ---------------------------------------------------------------- Mooncake over loopback

RECEIVER = """
import sys, time
from rollout_manager.weights import HostBuffer, MooncakeEngine
buf = HostBuffer(int(sys.argv[1]))
engine = MooncakeEngine("127.0.0.2").start()
engine.register(buf.addr, buf.nbytes)
print(engine.session_id, buf.addr, flush=True)
sys.stdin.read()  # until the test closes the pipe
"""


@pytest.mark.slow
@pytest.mark.skipif(not mooncake_available(), reason="mooncake transfer engine not installed")
def test_a_mooncake_write_to_a_stopped_receiver_fails_at_its_deadline_and_is_released(source: HostBuffer) -> None:
    proc = subprocess.Popen([sys.executable, "-c", RECEIVER, str(SIZE)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "MC_LOG_LEVEL": "ERROR"})
    sender = MooncakeEngine("127.0.0.1").start()
    try:
        assert proc.stdout is not None
        target, addr = proc.stdout.readline().split()
        sender.register(source.addr, source.nbytes)
        sender.write_many(target, [(source.addr, int(addr), SIZE)], timeout_s=30)  # connected, warm
        os.kill(proc.pid, signal.SIGSTOP)
        quarter = SIZE // 4
        items = [(source.addr + k * quarter, int(addr) + k * quarter, quarter) for k in range(4)]
        t0 = time.monotonic()
        with pytest.raises(TransferError) as info:
            sender.write_many(target, items, timeout_s=DEADLINE_S)
        assert info.value.code == -2 and "released" in str(info.value)
        assert time.monotonic() - t0 < DEADLINE_S + 2
        assert sender.orphans > 0  # still Mooncake's: polled until they end
        os.kill(proc.pid, signal.SIGCONT)
        assert sender.settle(20) and sender.orphans == 0  # they ended, and their batch ids were freed
        sender.write_many(target, items, timeout_s=30)  # and the engine still works
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        sender.close()
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(10)
