"""Requests the fast lane must not answer itself (issue 28): callers without the token, heads that
HTTP/1.1 requires a server to refuse, and the memory of connections that left.

Black-box against real daemons with the lane on and off: the lane is only a shortcut, so every answer
here must be the one aiohttp's path gives, and as soon."""

from __future__ import annotations

import asyncio
import gc
import gzip
import json
import time
import tracemalloc
import weakref
from typing import Any

import pytest
import uvloop
from support import async_wait_until

from rollout_manager.api.connections import ConnectionGuard, ConnectionLimits
from rollout_manager.api.fast_lane import FastLane, LaneStats

TOKEN = "refusals-t0ken"
BODY = json.dumps({"input_ids": [3, 4], "sampling_params": {"temperature": 0.0, "max_new_tokens": 2}}).encode()


GZIPPED = gzip.compress(BODY)


def head(*fields: bytes, line: bytes = b"POST /generate HTTP/1.1", eol: bytes = b"\r\n") -> bytes:
    return eol.join([line, *fields]) + eol + eol


def auth() -> bytes:
    return b"Authorization: Bearer " + TOKEN.encode()


def length(n: int = len(BODY)) -> bytes:
    return b"Content-Length: " + str(n).encode()


# name -> the raw request (head and body) on a fresh connection
CASES: dict[str, bytes] = {
    "plain": head(b"Host: x", auth(), length()) + BODY,
    "no Host": head(auth(), length()) + BODY,
    "two Hosts": head(b"Host: x", b"Host: y", auth(), length()) + BODY,
    "129 header fields": head(b"Host: x", auth(), length(), *(b"X-F%d: v" % i for i in range(126))) + BODY,
    "Content-Encoding gzip on a plain body": head(b"Host: x", auth(), length(), b"Content-Encoding: gzip") + BODY,
    "Content-Encoding gzip on a gzipped body": head(b"Host: x", auth(), length(len(GZIPPED)),
                                                     b"Content-Encoding: gzip") + GZIPPED,
    "Content-Encoding identity": head(b"Host: x", auth(), length(), b"Content-Encoding: identity") + BODY,
    "bare LF on /generate": head(b"Host: x", auth(), length(), eol=b"\n") + BODY,
    "bare LF on /health": head(b"Host: x", line=b"GET /health HTTP/1.1", eol=b"\n"),
    "bare LF in one field": head(b"Host: x\nX-A: b", auth(), length()) + BODY,
    "4,301-digit Content-Length": head(b"Host: x", auth(), b"Content-Length: " + b"1" * 4301) + BODY,
    "Content-Length with a sign": head(b"Host: x", auth(), b"Content-Length: +" + str(len(BODY)).encode()) + BODY,
}


async def answer_of(port: int, raw: bytes, timeout_s: float) -> int | str | None:
    """The status the manager answers ``raw`` with on a new connection; None if it closed without one,
    "silence" if nothing came within ``timeout_s``."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        try:
            line = await asyncio.wait_for(reader.readline(), timeout_s)
        except asyncio.TimeoutError:
                return "silence"
        except ConnectionResetError:
            return None
        return int(line.split()[1]) if line else None
    finally:
        writer.close()


def port_of(m: Any) -> int:
    return int(m.url.rsplit(":", 1)[1])


@pytest.mark.slow
async def test_heads_http_requires_refusing_get_aiohttps_answer_at_once_on_the_lane(start_manager, start_engines):
    """Missing or doubled Host, too many fields, a Content-Encoding, bare LF line ends, an absurd
    Content-Length: the lane answered some with 200, some with silence until the header timeout, one
    with a traceback. Each must get what aiohttp's path gives, within a second or two."""
    settings = {"auth_token": TOKEN, "http_header_timeout_s": "30"}
    on = await start_manager(**settings)
    off = await start_manager(**settings, http_fast_generate="false")
    (engine,) = await start_engines([])
    await on.register(engine)
    await off.register(engine)
    got = {}
    for name, raw in CASES.items():
        got[name] = (await answer_of(port_of(on), raw, 5), await answer_of(port_of(off), raw, 5))
    assert {name: pair for name, pair in got.items() if pair[0] != pair[1]} == {}, got
    taken = {"plain", "Content-Encoding identity", "Content-Encoding gzip on a gzipped body"}
    assert all(got[name][1] == 200 for name in taken), got
    assert got["Content-Encoding gzip on a plain body"][1] == 400  # was a 500 on aiohttp's path too
    refused = set(CASES) - taken
    assert all(isinstance(got[name][1], int) and got[name][1] >= 400 for name in refused), got
    log = on.proc.log_path.read_text()
    assert "fast_lane.py" not in log and "lane_head.py" not in log, log  # aiohttp logs its own refusals


@pytest.mark.slow
@pytest.mark.parametrize("fast", [True, False])
async def test_callers_without_the_token_cannot_hold_connections(start_manager, start_engines, fast):
    """20 heads without a token that declare a 1,000-byte body and stall, at max_client_connections=16:
    each gets 401 at once, and the token's holders keep /generate and /health."""
    m = await start_manager(auth_token=TOKEN, max_client_connections="16", http_body_timeout_s="60",
                            http_fast_generate=str(fast).lower())
    (engine,) = await start_engines([])
    await m.register(engine)
    stall = head(b"Host: x", b"Content-Type: application/json", b"Content-Length: 1000") + b'{"input_ids": ['
    stallers = [await asyncio.open_connection("127.0.0.1", port_of(m)) for _ in range(20)]
    try:
        t0 = time.monotonic()
        for _, writer in stallers:
            writer.write(stall)
        statuses = []
        for reader, _ in stallers:  # none is left waiting (the lane kept 16 of them busy for 60 s)
            try:
                line = await asyncio.wait_for(reader.readline(), 5)
            except ConnectionResetError:
                line = b""
            statuses.append(int(line.split()[1]) if line else None)
        # 401 each, or closed (or 503) at the cap of 16 to make room for later ones: never kept busy
        assert set(statuses) <= {401, 503, None} and statuses.count(401) >= 10, statuses
        assert time.monotonic() - t0 < 5
        for _ in range(3):  # the stallers still hold their connections open
            status, answer = await m.get("/health")
            assert status == 200, answer
            status, answer = await m.post("/generate", json.loads(BODY))
            assert status == 200 and len(answer["output_ids"]) == 2, answer
    finally:
        for _, writer in stallers:
            writer.close()


class _Route:
    """A lane route that takes every head and never sees a body (the bodies here never complete)."""

    def admit(self, fields: dict[str, str]) -> bool:
        return True

    def check(self, fields: dict[str, str], body: bytes) -> Any:
        return None

    async def run(self, prepared: Any) -> tuple[int, bytes]:
        return 200, b"{}"


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])  # uvloop: the daemon's
def test_a_lane_and_its_buffer_are_freed_when_the_caller_leaves_without_the_garbage_collector(loop):
    """Callers that upload most of a large body and close: the lane and its buffer must go with the
    connection (they and the connection pointed at each other, so only a full collection freed them,
    480 MB for sixty 8 MiB uploads on a quiet manager)."""
    (uvloop.run if loop == "uvloop" else asyncio.run)(uploads_then_leave())


async def uploads_then_leave() -> None:
    limits = ConnectionLimits(keepalive_s=60, header_s=60, body_s=60, max_total=100, max_waiting_per_client=100)
    guard = ConnectionGuard(limits)
    lanes: list[weakref.ref[FastLane]] = []
    live: list[FastLane] = []

    def make_lane(owner: Any) -> FastLane:
        lane = FastLane(owner, _Route(), 32 << 20, 60, lambda: b"{}", LaneStats())
        lanes.append(weakref.ref(lane))
        live.append(lane)
        return lane

    server = await asyncio.get_running_loop().create_server(
        guard.protocol_factory(asyncio.Protocol, make_lane), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    upload = 4 << 20
    gc.collect()
    gc.disable()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(4):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(head(b"Host: x", length(8 << 20)) + b"x" * upload)
            await writer.drain()
            await async_wait_until(lambda: len(live[-1].buf) >= upload, message="the upload received")
            writer.close()
            await writer.wait_closed()
        live.clear()
        await async_wait_until(lambda: all(ref() is None for ref in lanes), timeout_s=10,
                               message="every lane freed once its connection was lost")
        grown = tracemalloc.get_traced_memory()[0] - before
        assert grown < upload, f"{grown} bytes still held after the callers left"
    finally:
        tracemalloc.stop()
        gc.enable()
        server.close()
        await server.wait_closed()
