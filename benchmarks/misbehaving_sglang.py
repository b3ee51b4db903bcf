"""A fake SGLang server that stays up and passes its health checks but misbehaves on ``/generate``.

Every path but ``POST /generate`` (``/health_generate``, ``/server_info``, ``/get_model_info``,
``/abort_request``, ...) is relayed to ``--upstream``, a real (CPU) engine, so registration sees a
healthy, well-described engine whatever the manager asks at registration. ``/generate`` misbehaves as
``--mode`` says. The token modes take the right tokens from the upstream (a non-streaming call with
the same prompt and budget: greedy CPU engines are deterministic) and then break the stream (or, for
a ``stream: false`` request, the one answer, likewise):

- ``backwards``: cumulative chunks whose ids go back to an earlier prefix (``[1,2,3]``, ``[1,2]``, ...);
- ``bad_ct``: cumulative chunks without ``completion_tokens``;
- ``too_many``: 6 tokens more than ``max_new_tokens``;
- ``bad_ids``: two good tokens, then ``-5, "x", 1.5, 10**12``;
- ``bad_version``: the right tokens, reported under ``weight_version`` "999";

and the others never give tokens:

- ``endless``: HTTP 200, then bytes without a frame boundary, ``--endless-kbps`` per connection, forever;
- ``http404``: 404 with FastAPI's body, as SGLang answers a path it does not serve;
- ``error_frame``: HTTP 200 and one ``data: {"error": ...}`` frame (a 400 as SGLang words it), then ``[DONE]``;
- ``silent``: reads the request and never sends a byte, not even the status line.

    .venv/bin/python benchmarks/misbehaving_sglang.py --port 31000 --upstream http://127.0.0.1:30000 --mode backwards
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import aiohttp
from aiohttp import web

from rollout_manager.cpu_engine.encode import output_chunk
from rollout_manager.sglang import wire
from rollout_manager.sglang.sse import sse_frame

MODES = ("backwards", "bad_ct", "too_many", "bad_ids", "bad_version", "endless", "http404", "error_frame",
         "silent")
TOKEN_MODES = MODES[:5]
EXTRA_TOKENS = 6  # how far past the budget ``too_many`` goes
BAD_IDS: list[Any] = [-5, "x", 1.5, 10**12]
_HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}


def chunk(rid: str, ids: list[Any], prompt: int, total: int | None, finish: dict[str, Any] | None,
          version: str) -> bytes:
    """One frame; ``total`` None leaves ``completion_tokens`` out."""
    obj = output_chunk(rid=rid, output_ids=ids, prompt_tokens=prompt, completion_tokens=total or 0,
                            finish=finish, weight_version=version, text="")
    if total is None:
        del obj["meta_info"]["completion_tokens"]
    return sse_frame(obj)


def frames(mode: str, rid: str, good: list[int], prompt: int, version: str) -> list[bytes]:
    """The broken stream for a token mode, given the right tokens ``good`` (already past the budget
    for ``too_many``)."""
    n = len(good)
    end = wire.finish_reason(wire.LENGTH, length=n)
    if mode == "backwards":  # cumulative 1..n-1, then a shorter prefix, then all n: ids go back twice
        out = [chunk(rid, good[:k], prompt, k, None, version) for k in range(1, n)]
        back = good[:max(1, n - 2)]
        out.append(chunk(rid, back, prompt, len(back), None, version))
        out.append(chunk(rid, good, prompt, n, end, version))
        return out
    if mode == "bad_ct":
        return [chunk(rid, good[:k], prompt, None, end if k == n else None, version) for k in range(1, n + 1)]
    if mode == "bad_ids":
        ids: list[Any] = good[:min(2, n - 1)]
        out = [chunk(rid, ids[:k], prompt, k, None, version) for k in range(1, len(ids) + 1)]
        ids = ids + BAD_IDS
        out.append(chunk(rid, ids, prompt, len(ids), wire.finish_reason(wire.LENGTH, length=len(ids)), version))
        return out
    if mode == "bad_version":
        version = "999"
    return [chunk(rid, good[:k], prompt, k, end if k == n else None, version) for k in range(1, n + 1)]


def final(mode: str, rid: str, good: list[int], prompt: int, version: str) -> dict[str, Any]:
    """The broken one-shot answer (``stream: false``) for a token mode."""
    ids: list[Any] = list(good)
    total: int | None = len(good)
    if mode == "backwards":  # more ids than completion_tokens says: a prefix again after the output
        ids = good + good[:2]
    elif mode == "bad_ct":
        total = None
    elif mode == "bad_ids":
        ids = good[:2] + BAD_IDS
        total = len(ids)
    elif mode == "bad_version":
        version = "999"
    obj = output_chunk(rid=rid, output_ids=ids, prompt_tokens=prompt, completion_tokens=total or 0,
                            finish=wire.finish_reason(wire.LENGTH, length=len(ids)), weight_version=version,
                            text="")
    if total is None:
        del obj["meta_info"]["completion_tokens"]
    return obj


def make_app(mode: str, upstream: str, endless_kbps: float) -> web.Application:
    state: dict[str, aiohttp.ClientSession] = {}

    def session() -> aiohttp.ClientSession:
        if "s" not in state:
            state["s"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                               timeout=aiohttp.ClientTimeout(total=120))
        return state["s"]

    async def relay(request: web.Request) -> web.Response:
        """Anything but /generate: the upstream engine answers."""
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        async with session().request(request.method, upstream + request.path_qs, headers=headers,
                                     data=await request.read()) as r:
            body = await r.read()
            keep = {k: v for k, v in r.headers.items() if k.lower() not in _HOP}
            return web.Response(status=r.status, body=body, headers=keep)

    async def generate(request: web.Request) -> web.StreamResponse:
        if mode == "silent":
            await request.read()
            await asyncio.Event().wait()  # until the manager gives up and closes the connection
        if mode == "http404":
            return web.json_response({"detail": "Not Found"}, status=404)
        body = await request.json()
        stream = body.get("stream") is True
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream" if stream else "application/json"})
        if mode == "error_frame" and not stream:  # SGLang answers a refused one-shot request with its status
            return web.json_response(wire.error_object("The engine refuses this request.", 400), status=400)
        if mode == "error_frame":
            await resp.prepare(request)
            await resp.write(sse_frame(wire.error_object("The engine refuses this request.", 400)))
            await resp.write(wire.DONE_FRAME)
            return resp
        if mode == "endless":
            await resp.prepare(request)
            piece = b"x" * 16384
            pause = len(piece) / (endless_kbps * 1024)
            await resp.write(b"data: " if stream else b'{"output_ids": [')
            while True:  # ends when the manager closes the connection (the write raises)
                await resp.write(piece)
                await asyncio.sleep(pause)
        # token modes: the right tokens from the upstream, then a broken stream of them
        params = dict(body.get("sampling_params") or {})
        budget = wire.token_budget(body)
        if mode == "too_many" and budget is not None:
            params["max_new_tokens"] = budget + EXTRA_TOKENS
        ask = {"input_ids": body["input_ids"], "sampling_params": params}
        async with session().post(upstream + wire.GENERATE, json=ask) as r:
            answer = await r.json()
            if r.status != 200:
                return web.json_response(answer, status=r.status)
        good = [int(t) for t in answer["output_ids"]]
        version = str(answer["meta_info"].get("weight_version", "0"))
        rid = str(body.get("rid") or "fake")
        if not stream:
            return web.json_response(final(mode, rid, good, len(body["input_ids"]), version))
        await resp.prepare(request)
        for frame in frames(mode, rid, good, len(body["input_ids"]), version):
            await resp.write(frame)
        await resp.write(wire.DONE_FRAME)
        await resp.write_eof()
        return resp

    async def close(app: web.Application) -> None:
        if "s" in state:
            await state["s"].close()

    app = web.Application(client_max_size=256 * 1024 * 1024)
    app.router.add_post(wire.GENERATE, generate)
    app.router.add_route("*", "/{tail:.*}", relay)
    app.on_cleanup.append(close)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="the engine that answers everything but /generate")
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--endless-kbps", type=float, default=640.0, help="endless: KiB/s per connection")
    args = parser.parse_args()
    web.run_app(make_app(args.mode, args.upstream.rstrip("/"), args.endless_kbps), host="127.0.0.1",
                port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
