"""A fake SGLang backend that answers at once: it isolates the cost of whatever sits in front of it.

``/generate`` streams up to ``--chunks`` tokens (token ``k`` is the integer ``k``) in SGLang's format and
ends with ``[DONE]``; non-streaming requests get the final object (a list of them for a batch). As
SGLang 0.5.23 does, it sends a chunk for the first token, then every ``stream_interval`` tokens
(``sampling_params.stream_interval``, else ``--stream-interval``) and at the end; chunks are cumulative
(the whole output so far, SGLang's default) or, with ``--incremental-streaming-output``, deltas.
``/server_info`` reports both settings. Frames are built from pre-encoded bytes, so that even long
cumulative streams cost the fake far less than their reader.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from aiohttp import web

from rollout_manager import jsonutil
from rollout_manager.cpu_engine.encode import output_chunk
from rollout_manager.sglang import wire


def make_app(chunks: int, *, incremental: bool = False, stream_interval: int = 1,
             hold: bool = False) -> web.Application:
    """With ``hold``, every stream waits before its final chunk until ``POST /fake_release``, so that all
    sequences hold their tokens in flight at once; ``GET /fake_held`` counts the streams waiting and the
    tokens they sent (a memory benchmark reads the manager's RSS there)."""
    held = {"sequences": 0, "tokens": 0}
    release = asyncio.Event()

    def answer(prompt: list[int], params: dict[str, Any], rid: str) -> dict[str, Any]:
        n = min(chunks, params.get("max_new_tokens") or chunks)
        return output_chunk(rid=rid, output_ids=list(range(1, n + 1)), prompt_tokens=len(prompt),
                                 completion_tokens=n, finish=wire.finish_reason(wire.LENGTH, length=n),
                                 weight_version="0")

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if wire.is_batched(body):  # SGLang answers a non-streaming batch with one list, in order
            if body.get("stream"):
                return web.json_response({"error": "the fake streams single sequences only"}, status=400)
            return web.json_response([answer(sub["input_ids"], sub.get("sampling_params") or {}, sub["rid"])
                                      for sub in wire.split_batch(body)])
        prompt = body.get("input_ids") or [0]
        params = body.get("sampling_params") or {}
        budget = params.get("max_new_tokens") or chunks
        n = min(chunks, budget)
        rid = body.get("rid") or "fake"
        interval = int(params.get("stream_interval") or stream_interval)

        def meta(k: int) -> bytes:
            finish = wire.finish_reason(wire.LENGTH, length=n) if k == n else None
            return jsonutil.dumps({"id": rid, "finish_reason": finish, "prompt_tokens": len(prompt),
                                   "weight_version": "0", "completion_tokens": k, "cached_tokens": 0})

        if not body.get("stream"):
            return web.json_response(answer(prompt, params, rid))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        ids = bytearray()  # the comma-separated ids of the chunk being built (all so far when cumulative)
        sent = 0
        for k in range(1, n + 1):
            if ids:
                ids += b","
            ids += str(k).encode()
            if not (k == n or k - sent >= interval or sent == 0):  # the first token goes out at once
                continue
            if k == n and hold and not release.is_set():
                held["sequences"] += 1
                held["tokens"] += sent
                await release.wait()
                held["sequences"] -= 1
                held["tokens"] -= sent
            sent = k
            frame: list[Any] = [b'data: {"text":null,"output_ids":[', bytes(ids), b'],"meta_info":', meta(k),
                                b"}\n\n"]
            await resp.write(b"".join(frame))
            if incremental:
                ids = bytearray()
        await resp.write(wire.DONE_FRAME)
        await resp.write_eof()
        return resp

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "model_path": "fake", "is_generation": True, "version": "0.5.23",
                                  "tp_size": 1, "dp_size": 1, "incremental_streaming_output": incremental,
                                  "stream_interval": stream_interval})

    async def held_now(request: web.Request) -> web.Response:
        return web.json_response(held)

    async def release_all(request: web.Request) -> web.Response:
        release.set()
        return web.json_response(held)

    app = web.Application()
    app.router.add_post(wire.GENERATE, generate)
    app.router.add_get("/fake_held", held_now)
    app.router.add_post("/fake_release", release_all)
    for path in (wire.HEALTH, wire.HEALTH_GENERATE, wire.SERVER_INFO, "/get_server_info", "/get_model_info"):
        app.router.add_get(path, ok)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--chunks", type=int, default=8, help="tokens per sequence at most")
    parser.add_argument("--incremental-streaming-output", action="store_true")
    parser.add_argument("--stream-interval", type=int, default=1)
    args = parser.parse_args()
    web.run_app(make_app(args.chunks, incremental=args.incremental_streaming_output,
                         stream_interval=args.stream_interval),
                host="127.0.0.1", port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
