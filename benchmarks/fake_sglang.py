"""A fake SGLang backend that answers at once: it isolates the cost of whatever sits in front of it.

``/generate`` streams ``--chunks`` cumulative chunks (one token each) in SGLang's format and ends with
``[DONE]``; non-streaming requests get the final object. Health endpoints answer 200.
"""

from __future__ import annotations

import argparse

from aiohttp import web

from rollout_manager.sglang import wire


def make_app(chunks: int) -> web.Application:
    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt = body.get("input_ids") or [0]
        budget = (body.get("sampling_params") or {}).get("max_new_tokens") or chunks
        n = min(chunks, budget)
        rid = body.get("rid") or "fake"

        def chunk(k: int) -> dict:
            finish = wire.finish_reason(wire.LENGTH, length=n) if k == n else None
            return wire.output_chunk(rid=rid, output_ids=list(range(1, k + 1)), prompt_tokens=len(prompt),
                                     completion_tokens=k, finish=finish, weight_version="0")

        if not body.get("stream"):
            return web.json_response(chunk(n))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for k in range(1, n + 1):
            await resp.write(wire.sse_frame(chunk(k)))
        await resp.write(wire.DONE_FRAME)
        await resp.write_eof()
        return resp

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "model_path": "fake", "is_generation": True})

    app = web.Application()
    app.router.add_post(wire.GENERATE, generate)
    for path in (wire.HEALTH, wire.HEALTH_GENERATE, wire.SERVER_INFO, "/get_server_info", "/get_model_info"):
        app.router.add_get(path, ok)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--chunks", type=int, default=8)
    args = parser.parse_args()
    web.run_app(make_app(args.chunks), host="127.0.0.1", port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
