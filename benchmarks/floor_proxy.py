"""The least a Python aiohttp proxy can do per ``/generate``: read the body, make one upstream call
round-robin, return its bytes. No validation, no dispatch state, no continuation.

bench_manager_overhead.py runs it beside the manager and sglang-router: it is the floor any design built
on aiohttp's server and client pays per request on this machine.

    python benchmarks/floor_proxy.py PORT BACKEND_URL [BACKEND_URL ...]
"""

from __future__ import annotations

import itertools
import sys

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


if __name__ == "__main__":
    uvloop.install()
    web.run_app(make_app(sys.argv[2:]), host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None)
