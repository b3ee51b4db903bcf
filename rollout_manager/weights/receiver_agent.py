"""The weight receiver: runs beside SGLang on each rollout box and loads verified weights into it.

Runs in: box.

This module is its HTTP side (routes, the process's entry point); its state and the transfers are a
:class:`~rollout_manager.weights.receiver.Receiver`, the loads into SGLang
:mod:`rollout_manager.weights.receiver_loader`.
The manager drives it over HTTP (it is one brain; this agent only moves and checks bytes):

- ``POST /prepare {version, layout}``: make sure a registered receive buffer matching the layout
  exists (allocated once, reused every step while the layout stays the same) and answer where the
  sender should write: Mooncake session ids and the buffer address.
- ``POST /commit {version, fingerprint, shards, checksums}``: after the sender wrote, verify every
  shard's checksum; only then load the tensors into SGLang as rollout_manager/sglang/weight_loader.py
  does (buckets without a flush, one payload per TP rank, inside a weight-update session from 0.5.21 on;
  then a flush once SGLang is idle, a read-back of a sample, and the version set explicitly and confirmed
  by ``/model_info``). A corrupt or partial transfer is refused with 422 and never loaded; a
  data-parallel server (``dp_size > 1``) with 409, and so is a layout whose names or shapes the served
  model's checkpoint does not have (also at ``/prepare``, before any byte moves).
- ``POST /commit {..., stage: true}``: verify the same way, then hold the version *staged* in the buffer
  beside the one SGLang serves, without touching SGLang; ``POST /activate {version, mode}`` then loads it
  inside a short pause of generation (:mod:`rollout_manager.weights.activation`). At most one version is
  staged: the buffer holds it, so a newer push replaces it (a superseded staged version is dropped).
- ``GET /health``, ``GET /info``.

Peers: the buffer keeps the last verified version with the trainer's checksums of it, so the agent can
serve it to a box that joins (``GET /layout``, then ``POST /serve``: the mirror of the sender's
``/push``, through the same engines into the puller's prepared buffer). The puller verifies against those
checksums, the trainer's, never against anything this agent computes. While it serves the buffer is
read-only: a ``/prepare`` or ``/commit`` waits for the serves in flight, and a serve of a version the
buffer no longer holds verified is refused (409).

Deltas: the buffer keeps the last verified version. When ``/prepare`` offers a delta from exactly that
version (same layout), the agent answers a registered landing area (``delta_addr``) and keeps the
buffer; ``/commit`` then applies the delta there, verifies the result against the checksums of the
full new bytes (a mismatch: 422 naming the bad shards, which the manager rewrites in full), and reloads
only the tensors whose bytes changed since the last load, provided SGLang still reports the version this
agent last loaded (a server that restarted under the agent gets every tensor). Any other ``/prepare`` means a full push:
the buffer's version is forgotten and the next load reloads every tensor.

SGLang is never patched: the same HTTP endpoints serve real SGLang and the CPU engine.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from rollout_manager.sglang.auth import SGLangAuth
from rollout_manager.weights.agent_auth import token_middleware
from rollout_manager.weights.layout import WeightLayout
from rollout_manager.weights.protocol import (
    ActivateRequest,
    BadBody,
    CommitRequest,
    PrepareRequest,
    ServeRequest,
    parse_body,
)
from rollout_manager.weights.receiver import Receiver
from rollout_manager.weights.receiver_faults import ReceiverFaults
from rollout_manager.weights.refused import CommitRefused

log = logging.getLogger("rollout_manager.receiver")

AGENT: web.AppKey[Receiver] = web.AppKey("agent", object)  # type: ignore[arg-type]


def bad_body(what: str, message: str) -> web.Response:
    return web.json_response({"error": f"bad {what} body: {message}"}, status=400)


def refused(exc: CommitRefused, what: str | None = None, version: int | None = None) -> web.Response:
    """The agent's answer to a refusal: its status, ``{"error", "bad_shards"?}``; logged as ``what`` of
    ``version`` was refused when ``what`` is given."""
    if what is not None:
        log.warning("%s of version %d refused: %s", what, version, exc)
    body: dict[str, Any] = {"error": str(exc)}
    if exc.bad_shards is not None:
        body["bad_shards"] = exc.bad_shards
    return web.json_response(body, status=exc.status)


async def handle_prepare(request: web.Request) -> web.Response:
    agent = request.app[AGENT]
    try:
        req = parse_body(await request.read(), PrepareRequest)
    except BadBody as exc:
        return bad_body("prepare", str(exc))
    try:  # what the schema cannot see: slots inside the buffer, no overlaps, known dtypes and format
        layout = WeightLayout.from_dict(req.layout.model_dump())
    except (KeyError, TypeError, ValueError) as exc:
        return bad_body("prepare", f"field 'layout': {exc}")
    try:
        await agent.loader.check_layout(layout, strict=False)  # checked again, strictly, before the load
    except CommitRefused as exc:
        return refused(exc, "prepare", req.version)
    async with agent.busy:
        await agent.writable()
        answer = await asyncio.to_thread(agent.prepare, layout, req.transport, req.delta_base, req.delta_bytes)
    agent.faults.prepared()
    return web.json_response(answer.model_dump())


async def handle_commit(request: web.Request) -> web.Response:
    agent = request.app[AGENT]
    try:
        req = parse_body(await request.read(), CommitRequest)
    except BadBody as exc:
        return bad_body("commit", str(exc))
    async with agent.busy:
        await agent.writable()
        try:
            result = await agent.commit(req)
        except CommitRefused as exc:
            return refused(exc, "commit", req.version)
    log.info("version %d loaded into SGLang (verify %.3fs, load %.3fs)", req.version, result.verify_s,
             result.load_s)
    return web.json_response(result.model_dump())


async def handle_activate(request: web.Request) -> web.Response:
    agent = request.app[AGENT]
    try:
        req = parse_body(await request.read(), ActivateRequest)
    except BadBody as exc:
        return bad_body("activate", str(exc))
    async with agent.busy:
        try:
            answer = await agent.activate(req)
        except CommitRefused as exc:
            return refused(exc, "activation", req.version)
    log.info("version %d activated (%s): paused %.3fs, load %.3fs, %d tensors", req.version, req.mode,
             answer.paused_s, answer.load_s, answer.reloaded)
    return web.json_response(answer.model_dump())


async def handle_info(request: web.Request) -> web.Response:
    return web.json_response(request.app[AGENT].info())


async def handle_layout(request: web.Request) -> web.Response:
    answer = request.app[AGENT].held_layout()
    if answer is None:
        return web.json_response({"error": "no verified version held"}, status=404)
    return web.json_response(answer.model_dump())


async def handle_serve(request: web.Request) -> web.Response:
    agent = request.app[AGENT]
    try:
        req = parse_body(await request.read(), ServeRequest)
    except BadBody as exc:
        return bad_body("serve", str(exc))
    try:
        answer = await agent.serve_peer(req)
    except CommitRefused as exc:
        return refused(exc)
    except Exception as exc:  # a transfer failure: report it, the manager falls back to the sender
        log.warning("serving version %d to %s failed: %s", req.version, req.session_ids[0], exc)
        return web.json_response({"error": f"transfer failed: {exc}"}, status=502)
    log.info("served version %d to %s: %d bytes in %.3fs", req.version, req.session_ids[0], answer.bytes,
             answer.seconds)
    return web.json_response(answer.model_dump())


def create_app(agent: Receiver) -> web.Application:
    app = web.Application(client_max_size=64 << 20, middlewares=[token_middleware()])
    app[AGENT] = agent
    app.router.add_get("/health", handle_info)
    app.router.add_get("/info", handle_info)
    app.router.add_post("/prepare", handle_prepare)
    app.router.add_post("/commit", handle_commit)
    app.router.add_post("/activate", handle_activate)
    app.router.add_get("/layout", handle_layout)
    app.router.add_post("/serve", handle_serve)
    return app


async def serve(agent: Receiver, bind_host: str, port: int) -> None:
    await agent.start()
    runner = web.AppRunner(create_app(agent), access_log=None, handle_signals=False)
    await runner.setup()
    try:
        await web.TCPSite(runner, bind_host, port).start()
    except OSError as exc:
        await agent.close()
        raise SystemExit(f"receiver-agent: cannot listen on {bind_host}:{port}: {exc.strerror or exc}") from None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"receiver-agent ready on http://{bind_host}:{port} mooncake {agent.session_ids[0]}", flush=True)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        await agent.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rollout-manager receiver-agent", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", required=True, help="this box's address the senders write to")
    parser.add_argument("--port", type=int, required=True, help="control port (HTTP) for the manager")
    parser.add_argument("--bind", default=None, help="address to listen on (default: --host)")
    parser.add_argument("--sglang-url", required=True, help="e.g. http://127.0.0.1:30000")
    parser.add_argument("--protocol", default="tcp", choices=["tcp", "rdma"])
    parser.add_argument("--device-name", default="")
    parser.add_argument("--engines", type=int, default=1, help="Mooncake engines sharing the buffer")
    parser.add_argument("--bucket-mb", type=int, default=256)
    parser.add_argument("--flush-wait-s", type=float, default=30.0,
                        help="after a load, how long to wait for SGLang to go idle so it can flush its cache")
    parser.add_argument("--readback-tensors", type=int, default=0,
                        help="tensors read back through SGLang's /get_weights_by_name after a full load through "
                             "/commit (the drain path) and compared (0: none; activations never read back: the "
                             "manager's trust probe checks what SGLang serves)")
    parser.add_argument("--load-timeout-s", type=float, default=600.0,
                        help="longest one weight load into SGLang (or one transfer to a peer) may take")
    parser.add_argument("--log-level", default="info")
    ReceiverFaults.add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    agent = Receiver(args.host, args.sglang_url, protocol=args.protocol, device_name=args.device_name,
                      num_engines=args.engines, bucket_bytes=args.bucket_mb << 20,
                      flush_wait_s=args.flush_wait_s, faults=ReceiverFaults.from_args(args),
                      load_timeout_s=args.load_timeout_s, auth=SGLangAuth.from_env(),
                      readback_tensors=args.readback_tensors)
    asyncio.run(serve(agent, args.bind or args.host, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
