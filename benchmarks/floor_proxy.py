"""The least a Python proxy can do per ``/generate``: read the body, make one upstream call round-robin
with aiohttp's client, return its bytes. No validation, no dispatch state, no continuation.

bench_manager_overhead.py runs it beside the manager and sglang-router, twice: on aiohttp's server (the
floor of any design built on aiohttp's server and client) and with ``--plain``, on a plain asyncio
protocol framed as the manager's fast lane frames (``api.lane_head``): the difference is
what aiohttp's web layer costs per request.

    python benchmarks/floor_proxy.py [--plain] PORT BACKEND_URL [BACKEND_URL ...]
"""

from __future__ import annotations

import asyncio
import itertools
import sys
from pathlib import Path

import aiohttp
import uvloop
from aiohttp import web

SESSION: web.AppKey[aiohttp.ClientSession] = web.AppKey("session", aiohttp.ClientSession)


def make_app(backends: list[str]) -> web.Application:
    upstream = itertools.cycle(backends)
    app = web.Application()

    async def open_session(app: web.Application) -> None:
        app[SESSION] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def close_session(app: web.Application) -> None:
        await app[SESSION].close()

    async def generate(request: web.Request) -> web.Response:
        body = await request.read()
        async with request.app[SESSION].post(next(upstream) + "/generate", data=body,
                                             headers={"Content-Type": "application/json"}) as resp:
            return web.Response(body=await resp.read(), status=resp.status, content_type="application/json")

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "healthy"})

    app.on_startup.append(open_session)
    app.on_cleanup.append(close_session)
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", health)
    return app


class PlainProxy(asyncio.Protocol):
    """One connection: frame each request (head, Content-Length body), forward it, answer in order."""

    def __init__(self, session: aiohttp.ClientSession, upstream: itertools.cycle[str]) -> None:
        self.session, self.upstream = session, upstream
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.busy = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.busy:
            self.next()

    def next(self) -> None:
        from rollout_manager.api.fast_lane import answer_bytes
        from rollout_manager.api.lane_head import parse_head

        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        if self.buf.startswith(b"GET /health "):
            del self.buf[:end + 4]
            assert self.transport is not None
            self.transport.write(answer_bytes(200, b'{"status":"healthy"}', False))
            return self.next()
        parsed = parse_head(bytes(self.buf[:end + 4]), 1 << 26)
        assert parsed is not None, bytes(self.buf[:200])
        size = parsed.size + parsed.length
        if len(self.buf) < size:
            return
        body = bytes(self.buf[end + 4:size])
        del self.buf[:size]
        self.busy = True
        asyncio.get_running_loop().create_task(self.forward(body))

    async def forward(self, body: bytes) -> None:
        from rollout_manager.api.fast_lane import answer_bytes

        async with self.session.post(next(self.upstream) + "/generate", data=body,
                                     headers={"Content-Type": "application/json"}) as resp:
            data = await resp.read()
        assert self.transport is not None
        self.transport.write(answer_bytes(resp.status, data, False))
        self.busy = False
        self.next()


async def serve_plain(port: int, backends: list[str]) -> None:
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    upstream = itertools.cycle(backends)
    server = await asyncio.get_running_loop().create_server(lambda: PlainProxy(session, upstream), "127.0.0.1", port)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    if sys.argv[1] == "--plain":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        uvloop.run(serve_plain(int(sys.argv[2]), sys.argv[3:]))
    else:
        uvloop.install()
        web.run_app(make_app(sys.argv[2:]), host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None)
