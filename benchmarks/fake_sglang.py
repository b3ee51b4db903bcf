"""A fake SGLang backend that answers at once: it isolates the cost of whatever sits in front of it.

``/generate`` streams up to ``--chunks`` tokens (token ``k`` is the integer ``k``) in SGLang's format and
ends with ``[DONE]``; non-streaming requests get the final object (a list of them for a batch). As
SGLang 0.5.23 does, it sends a chunk for the first token, then every ``stream_interval`` tokens
(``sampling_params.stream_interval``, else ``--stream-interval``) and at the end; chunks are cumulative
(the whole output so far, SGLang's default) or, with ``--incremental-streaming-output``, deltas.
``/server_info`` reports both settings. Frames are built from pre-encoded bytes, so that even long
cumulative streams cost the fake far less than their reader.

With ``--routed-experts LAYERSxTOP_K`` it answers routed-expert replay (R3) as SGLang 0.5.23 started with
``--enable-return-routed-experts`` does (``/server_info`` says so): a request with ``return_routed_experts``
gets ``meta_info.routed_experts`` on its final chunk only (or its non-streaming answer), base64 of
little-endian int32 rows of ``LAYERS x TOP_K`` ids for positions ``[min(start, seqlen - 1), seqlen - 1)``
(``start`` the request's ``routed_experts_start_len``, ``seqlen`` prompt plus completion): the rows are
:func:`routed_rows`, which depend on the position, so a benchmark sees a misaligned or short answer.
"""

from __future__ import annotations

import argparse
import asyncio
import binascii
import functools
import sys
from array import array
from typing import Any

from aiohttp import web

from rollout_manager import jsonutil
from rollout_manager.cpu_engine.encode import output_chunk
from rollout_manager.sglang import wire


def parse_shape(text: str) -> tuple[int, int]:
    """``"48x8"`` (layers x top-k) as ``(48, 8)``."""
    layers, top_k = (int(x) for x in text.lower().split("x"))
    if layers <= 0 or top_k <= 0:
        raise ValueError(f"a routed-experts shape of {text!r}")
    return layers, top_k


@functools.lru_cache(maxsize=64)
def routed_rows(shape: tuple[int, int], start: int, seqlen: int) -> str:
    """``meta_info.routed_experts`` of a request that started at ``start`` and ended with ``seqlen``
    positions: expert ``(p + l * top_k + k) % 128`` for position ``p``, layer ``l``, slot ``k`` (ids < 128,
    as Qwen3-30B-A3B's 128 experts), base64 of little-endian int32. Kept per shape, so that 64 equal
    sequences cost the fake one encoding."""
    layers, top_k = shape
    first = min(start, seqlen - 1)
    period = array("i", [(p + j) % 128 for p in range(128) for j in range(layers * top_k)])
    if sys.byteorder == "big":
        period.byteswap()
    row = layers * top_k * 4
    rows = bytes(period) * ((seqlen - 1) // 128 + 2)  # whole periods from position 0 past the last
    return binascii.b2a_base64(rows[first * row:(seqlen - 1) * row], newline=False).decode("ascii")


def make_app(chunks: int, *, incremental: bool = False, stream_interval: int = 1,
             hold: bool = False, experts: tuple[int, int] | None = None) -> web.Application:
    """With ``hold``, every stream waits before its final chunk until ``POST /fake_release``, so that all
    sequences hold their tokens in flight at once; ``GET /fake_held`` counts the streams waiting and the
    tokens they sent (a memory benchmark reads the manager's RSS there). With ``experts`` (layers, top-k),
    requests that ask for routed experts get them (the module's docstring)."""
    held = {"sequences": 0, "tokens": 0}
    release = asyncio.Event()

    def routed(body: dict[str, Any], prompt: list[int], n: int) -> str | None:
        """The final output's ``routed_experts`` for ``body``, or None when not asked (or not enabled)."""
        if experts is None or not body.get("return_routed_experts"):
            return None
        return routed_rows(experts, int(body.get("routed_experts_start_len") or 0), len(prompt) + n)

    def answer(prompt: list[int], params: dict[str, Any], rid: str, body: dict[str, Any]) -> dict[str, Any]:
        n = min(chunks, params.get("max_new_tokens") or chunks)
        out = output_chunk(rid=rid, output_ids=list(range(1, n + 1)), prompt_tokens=len(prompt),
                           completion_tokens=n, finish=wire.finish_reason(wire.LENGTH, length=n),
                           weight_version="0")
        rows = routed(body, prompt, n)
        if rows is not None:
            out["meta_info"]["routed_experts"] = rows
        return out

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if wire.is_batched(body):  # SGLang answers a non-streaming batch with one list, in order
            if body.get("stream"):
                return web.json_response({"error": "the fake streams single sequences only"}, status=400)
            return web.json_response([answer(sub["input_ids"], sub.get("sampling_params") or {}, sub["rid"], sub)
                                      for sub in wire.split_batch(body)])
        prompt = body.get("input_ids") or [0]
        params = body.get("sampling_params") or {}
        budget = params.get("max_new_tokens") or chunks
        n = min(chunks, budget)
        rid = body.get("rid") or "fake"
        interval = int(params.get("stream_interval") or stream_interval)

        def meta(k: int) -> bytes:
            finish = wire.finish_reason(wire.LENGTH, length=n) if k == n else None
            out = {"id": rid, "finish_reason": finish, "prompt_tokens": len(prompt),
                   "weight_version": "0", "completion_tokens": k, "cached_tokens": 0}
            rows = routed(body, prompt, n) if k == n else None  # the final chunk only, as SGLang
            if rows is not None:
                out["routed_experts"] = rows
            return jsonutil.dumps(out)

        if not body.get("stream"):
            return web.json_response(answer(prompt, params, rid, body))
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
                                  "stream_interval": stream_interval,
                                  "enable_return_routed_experts": experts is not None})

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
    parser.add_argument("--routed-experts", type=parse_shape, default=None, metavar="LAYERSxTOP_K",
                        help="answer return_routed_experts with rows of this shape (e.g. 48x8)")
    args = parser.parse_args()
    web.run_app(make_app(args.chunks, incremental=args.incremental_streaming_output,
                         stream_interval=args.stream_interval, experts=args.routed_experts),
                host="127.0.0.1", port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
