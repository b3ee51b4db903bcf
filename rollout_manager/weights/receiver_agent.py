"""The weight receiver: runs beside SGLang on each rollout box and loads verified weights into it.

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
import time
from collections.abc import Sequence
from typing import Any

import aiohttp
from aiohttp import web

from rollout_manager.sglang.auth import SGLangAuth
from rollout_manager.sglang.checkpoint import ServedModel
from rollout_manager.sglang.weight_loader import LoadRefused, LoadSettings, NamedTensors, SGLangWeights
from rollout_manager.weights import activation, delta
from rollout_manager.weights.activation import readback_sample
from rollout_manager.weights.agent_auth import token_middleware
from rollout_manager.weights.layout import HostBuffer, WeightLayout, unpack
from rollout_manager.weights.mooncake_engine import MooncakeEngine
from rollout_manager.weights.protocol import (
    ActivateRequest,
    BadBody,
    CommitAnswer,
    CommitRequest,
    LayoutAnswer,
    LayoutBody,
    PrepareAnswer,
    PrepareRequest,
    PushAnswer,
    ServeRequest,
    TransportName,
    parse_body,
)
from rollout_manager.weights.pusher import PushResult, push_buffer
from rollout_manager.weights.receiver_faults import NO_FAULTS, ReceiverFaults
from rollout_manager.weights.refused import CommitRefused
from rollout_manager.weights.shards import Shard, verify_shards
from rollout_manager.weights.tcp_transport import TcpEngine
from rollout_manager.weights.transport import Transport

log = logging.getLogger("rollout_manager.receiver")

AGENT: web.AppKey[ReceiverAgent] = web.AppKey("agent", object)  # type: ignore[arg-type]


class ReceiverAgent:
    def __init__(self, host: str, sglang_url: str, *, protocol: str = "tcp", device_name: str = "",
                 num_engines: int = 1, bucket_bytes: int = 256 << 20, load_timeout_s: float = 600.0,
                 flush_wait_s: float = 30.0, faults: ReceiverFaults = NO_FAULTS,
                 auth: SGLangAuth | None = None, readback_tensors: int = 4,
                 readback_rows: int = 4):
        self.host = host
        self.auth = auth or SGLangAuth()  # SGLang's --api-key/--admin-api-key, where it runs with them
        self.sglang_url = sglang_url.rstrip("/")
        # The Mooncake engines (one session id each, all sharing the buffer); engines[0] does the handshake.
        self.engines: list[MooncakeEngine] = [
            MooncakeEngine(host, protocol, device_name) for _ in range(max(num_engines, 1))]
        self.tcp: TcpEngine | None = None  # the plain-TCP transport, started when first asked for
        self.bucket_bytes = bucket_bytes
        self.load_timeout_s = load_timeout_s
        self.flush_wait_s = flush_wait_s  # how long SGLang may take to go idle for the cache flush
        self.readback_tensors, self.readback_rows = readback_tensors, readback_rows
        self.readback = 0  # tensors the last load read back from SGLang and found equal
        self._served: ServedModel | None = None  # the served checkpoint's names and shapes (None: unknown)
        self._served_path: str | None = None  # the model_path they were read for
        self.buffer: HostBuffer | None = None
        self.layout: WeightLayout | None = None
        self.version: int | None = None  # last version loaded into SGLang
        self.held: tuple[int, str] | None = None  # (version, layout fingerprint) the buffer holds, verified
        self.dirty: set[str] | None = None  # tensors whose bytes may differ from SGLang's (None: all)
        self.delta_buffer: HostBuffer | None = None  # where the sender writes a delta
        self.reloaded = 0  # tensors the last load sent to SGLang
        self.staged: int | None = None  # the verified version the buffer holds for /activate (None: none)
        # Why the last activation failed after SGLang was paused (SGLang left paused: out of service until a
        # full load succeeds); None: no such failure.
        self.failed: str | None = None
        self.busy = asyncio.Lock()
        self.faults = faults  # what a test told it to get wrong (nothing, outside tests)
        # Serving peers: the trainer's (shards, checksums) of the held version; serves in flight.
        self.sums: tuple[list[Shard], list[str]] | None = None
        self.served_bytes = 0
        self._serving = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        for engine in self.engines:
            await asyncio.to_thread(engine.start)
        self.session = aiohttp.ClientSession()

    async def close(self) -> None:
        if self.session:
            await self.session.close()
        for engine in self._all_engines():
            engine.close()

    def _all_engines(self) -> list[Transport]:
        return [*self.engines, *([self.tcp] if self.tcp else [])]

    @property
    def session_ids(self) -> list[str]:
        return [e.session_id for e in self.engines]

    def info(self) -> dict[str, Any]:
        return {
            "session_ids": self.session_ids,
            "handshake_port": self.engines[0].rpc_port,
            "sglang_url": self.sglang_url,
            "weight_version": self.version,
            "buffer_bytes": self.buffer.nbytes if self.buffer else 0,
            "layout_fingerprint": self.layout.fingerprint() if self.layout else None,
            "buffer_version": self.held[0] if self.held else None,  # verified bytes of that layout
            "staged_version": self.staged,  # verified, waiting for /activate
            "activation_failed": self.failed,
            "served_bytes": self.served_bytes,  # to peers
        }

    # ------------------------------------------------------------ serving peers
    async def writable(self) -> None:
        """Wait until no peer is reading the buffer (the caller holds ``busy``, so none starts)."""
        await self._idle.wait()

    def held_layout(self) -> LayoutAnswer | None:
        """The verified version the buffer holds and its layout, which a peer bootstrap prepares for."""
        if self.held is None or self.layout is None or self.sums is None:
            return None
        if self.held[1] != self.layout.fingerprint():
            return None
        return LayoutAnswer(version=self.held[0], layout=LayoutBody.model_validate(self.layout.to_dict()),
                            fingerprint=self.held[1])

    async def serve_peer(self, req: ServeRequest) -> PushAnswer:
        """Write the held verified version into a puller's buffer; refused (409) unless this buffer holds
        exactly ``req.version`` of ``req.fingerprint``. Answers the trainer's checksums of that version."""
        async with self.busy:
            sums, buffer, layout = self.sums, self.buffer, self.layout
            if self.held != (req.version, req.fingerprint) or sums is None or buffer is None or layout is None:
                held = self.held[0] if self.held else None
                raise CommitRefused(409, f"version {req.version} of layout {req.fingerprint[:12]} is not held verified "
                                         f"here (held: {held})")
            if req.transport == "tcp" and self.tcp is None:
                self.tcp = TcpEngine(self.host).start()
                self.tcp.register(buffer.addr, max(buffer.nbytes, 1))
            engines: list[Transport] = [self.tcp] if req.transport == "tcp" and self.tcp else list(self.engines)
            self._serving += 1
            self._idle.clear()
        try:
            result = await asyncio.to_thread(self._write_to_peer, req, buffer.addr, layout.total_bytes, engines)
        finally:
            self._serving -= 1
            if not self._serving:
                self._idle.set()
        self.served_bytes += result.bytes
        return PushAnswer(version=req.version, bytes=result.bytes, seconds=round(result.seconds, 6),
                          gbps=round(result.gbps, 3), shards=sums[0], checksums=sums[1],
                          fingerprint=req.fingerprint)

    def _write_to_peer(self, req: ServeRequest, addr: int, total: int, engines: list[Transport]) -> PushResult:
        assert self.buffer is not None
        sessions = list(req.session_ids)
        if self.faults.serving_stops_after_first_shard():  # the first shard lands, then this box is gone
            push_buffer(engines, addr, total, sessions, req.buffer_addr, req.num_engines, compute_checksums=False,
                        only=[0])
            self.faults.died_serving()
        flip = self.faults.serve_flip(total)
        if flip is not None:
            self.buffer.array[flip] ^= 0xFF
        try:
            return push_buffer(engines, addr, total, sessions, req.buffer_addr, req.num_engines,
                               compute_checksums=False, timeout_s=self.load_timeout_s)  # a blackholed puller
        finally:
            if flip is not None:
                self.buffer.array[flip] ^= 0xFF

    # ------------------------------------------------------------ prepare
    def prepare(self, layout: WeightLayout, transport: TransportName = "mooncake", delta_base: int | None = None,
                delta_bytes: int | None = None) -> PrepareAnswer:
        """A registered buffer for ``layout``; reallocated only when it no longer fits. A delta offer from
        the version the buffer holds is taken (a landing area for it is answered); otherwise the buffer is
        about to be overwritten, so what it held is forgotten."""
        fingerprint = layout.fingerprint()
        held = self.held[0] if self.held and self.held[1] == fingerprint else None
        if transport == "tcp" and self.tcp is None:
            self.tcp = TcpEngine(self.host).start()
            if self.buffer is not None:
                self.tcp.register(self.buffer.addr, max(self.buffer.nbytes, 1))
        if self.buffer is None or not self.buffer.fits(layout):
            if self.buffer is not None:
                for engine in self._all_engines():
                    engine.unregister(self.buffer.addr)
            self.buffer = HostBuffer.for_layout(layout)
            for engine in self._all_engines():
                engine.register(self.buffer.addr, max(self.buffer.nbytes, 1))
            log.info("receive buffer of %d bytes registered at 0x%x", self.buffer.nbytes, self.buffer.addr)
            held = None
        self.layout = layout
        delta_addr = None
        if delta_base is not None and delta_bytes is not None and held == delta_base:
            delta_addr = self._delta_area(delta_bytes).addr
        else:  # a full push follows: neither the buffer's version nor what changed in it is known any more
            self.held, self.dirty = None, None
            self._drop_staged("a full push")
        sessions = [self.tcp.session_id] if transport == "tcp" and self.tcp else self.session_ids
        return PrepareAnswer(session_ids=sessions, buffer_addr=self.buffer.addr, buffer_bytes=self.buffer.nbytes,
                             fingerprint=fingerprint, held_version=held, delta_addr=delta_addr)

    def _delta_area(self, nbytes: int) -> HostBuffer:
        """The registered landing area for deltas, grown (with headroom) when one does not fit."""
        if self.delta_buffer is None or self.delta_buffer.nbytes < nbytes:
            if self.delta_buffer is not None:
                for engine in self._all_engines():
                    engine.unregister(self.delta_buffer.addr)
            self.delta_buffer = HostBuffer(nbytes + (nbytes >> 2) + 4096)
            for engine in self._all_engines():
                engine.register(self.delta_buffer.addr, self.delta_buffer.nbytes)
        return self.delta_buffer

    def _touched(self, layout: WeightLayout, applied: delta.Applied, ranges: Sequence[Shard] = ()) -> set[str]:
        specs = layout.specs
        hit = delta.touched_tensors([s.offset for s in specs], [s.offset + s.nbytes for s in specs], applied,
                                    [(off, off + length) for off, length in ranges])
        return {specs[i].name for i in hit}

    def _apply_delta(self, req: CommitRequest, layout: WeightLayout) -> float:
        """Apply the delta that landed; the bytes it may have changed join ``dirty``. Returns seconds."""
        assert self.buffer is not None and req.delta_base is not None and req.delta_bytes is not None
        fingerprint = layout.fingerprint()
        area = self.delta_buffer
        if self.held != (req.delta_base, fingerprint) or area is None or req.delta_bytes > area.nbytes:
            raise CommitRefused(409, f"no delta from version {req.delta_base} was prepared here; call /prepare first")
        self.held = None  # the buffer is being rewritten
        blob = area.array[: req.delta_bytes]
        self.faults.delta_landed(blob)
        t0 = time.perf_counter()
        try:
            applied = delta.apply(memoryview(blob), self.buffer.array, fingerprint=fingerprint,  # type: ignore[arg-type]
                                  base_version=req.delta_base)
        except delta.DeltaError as exc:  # nothing was changed; the checksums will say whether that is wrong
            log.warning("delta for version %d not applied: %s", req.version, exc)
            applied = delta.Applied()
        if applied.failed_blocks:
            log.warning("delta for version %d: blocks %s did not decode", req.version, applied.failed_blocks)
        if self.dirty is not None:
            self.dirty |= self._touched(layout, applied)
        return time.perf_counter() - t0

    def _drop_staged(self, why: str) -> None:
        if self.staged is not None:
            log.info("staged version %d dropped: %s overwrites the buffer", self.staged, why)
            self.staged = None

    # ------------------------------------------------------------ commit
    async def commit(self, req: CommitRequest) -> CommitAnswer:
        if self.buffer is None or self.layout is None or self.layout.fingerprint() != req.fingerprint:
            raise CommitRefused(409, "no prepared buffer for this layout; call /prepare first")
        layout = self.layout
        self._drop_staged(f"version {req.version}")  # the buffer now holds (part of) the new version
        apply_s = None
        if req.delta_base is not None:
            apply_s = round(await asyncio.to_thread(self._apply_delta, req, layout), 6)
        else:
            self.held = None
        self.faults.landed(self.buffer.array, layout.total_bytes)
        t0 = time.perf_counter()
        bad = await asyncio.to_thread(verify_shards, self.buffer.array, list(req.shards), list(req.checksums))
        verify_s = time.perf_counter() - t0
        if bad:
            if self.dirty is not None:  # the repair rewrites these shards: their tensors reload too
                self.dirty |= self._touched(layout, delta.Applied(), [req.shards[i] for i in bad])
            raise CommitRefused(422, f"checksum mismatch in shard(s) {bad}; nothing loaded", bad_shards=bad)
        self.held = (req.version, layout.fingerprint())
        self.sums = (list(req.shards), list(req.checksums))  # the trainer's, for serving peers
        if req.stage:
            self.staged = req.version
            log.info("version %d verified and staged (SGLang serves %s)", req.version, self.version)
            return CommitAnswer(ok=True, version=req.version, verify_s=round(verify_s, 6), load_s=0.0, buckets=0,
                                reloaded=0, apply_s=apply_s, staged=True)
        t1 = time.perf_counter()
        names = None if self.dirty is None or self.version is None else set(self.dirty)
        try:
            await self.check_layout(layout)
            buckets = await self._load(req.version, names)
        except BaseException:
            self.dirty = None  # what SGLang holds now is not known: the next load sends every tensor
            raise
        self.version, self.dirty = req.version, set()
        if self.failed is not None:  # an activation failed with SGLang paused: a full load is in, serve again
            try:
                await self._weights().resume()
            except LoadRefused as exc:
                raise CommitRefused(exc.status, str(exc)) from None
            log.info("version %d fully loaded after a failed activation; SGLang continues", req.version)
            self.failed = None
        return CommitAnswer(ok=True, version=req.version, verify_s=round(verify_s, 6),
                            load_s=round(time.perf_counter() - t1, 6), buckets=buckets, reloaded=self.reloaded,
                            apply_s=apply_s, readback=self.readback)

    def _weights(self) -> SGLangWeights:
        assert self.session is not None
        return SGLangWeights(self.session, self.sglang_url, self.auth, LoadSettings(
            self.bucket_bytes, self.load_timeout_s, self.flush_wait_s, self.readback_tensors, self.readback_rows))

    async def check_layout(self, layout: WeightLayout, *, strict: bool = True) -> None:
        """Refuse (409) a layout SGLang would load silently partially (a name its model does not know) or
        die on (a shape other than its own), judged by the served checkpoint's headers; a server whose
        checkpoint is not readable on this box is not judged (the read-back after the load still is).
        An SGLang that does not answer is a refusal when ``strict`` (a load needs it), else not judged."""
        try:
            weights = self._weights()
            facts = await weights.server_facts()
            if facts.model_path != self._served_path:
                self._served, self._served_path = await weights.served_model(facts), facts.model_path
        except LoadRefused as exc:
            if not strict:
                log.info("layout not checked before the transfer: %s", exc)
                return
            raise CommitRefused(exc.status, str(exc)) from None
        if self._served is None:
            return
        problems = self._served.problems((s.name, s.shape) for s in layout.specs)
        if problems:
            more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
            raise CommitRefused(409, f"the layout does not fit the model SGLang serves ({self._served.path}): "
                                     f"{'; '.join(problems[:5])}{more}; nothing loaded")

    async def _load(self, version: int, names: set[str] | None = None) -> int:
        """Load the buffer's tensors in ``names`` (None: all; none: the smallest one) into SGLang (see
        rollout_manager/sglang/weight_loader.py), and read a sample back. A partial load happens only
        when SGLang still reports the version this agent last loaded: a server that restarted under
        the agent (or was loaded by someone else) gets every tensor. Returns the buckets; ``reloaded``
        says how many tensors went."""
        weights = self._weights()
        named, loading = await self.selection(weights, names)
        self.reloaded = len(loading)
        try:
            report = await weights.load(loading, version, sample=readback_sample(named, self.readback_tensors, version),
                                        served=self._served)
        except LoadRefused as exc:
            raise CommitRefused(exc.status, str(exc)) from None
        self.readback = report.readback
        return report.buckets

    async def selection(self, weights: SGLangWeights, names: set[str] | None) -> tuple[NamedTensors, NamedTensors]:
        """(every tensor of the buffer, those to load): ``names`` (None: all; none: the smallest one),
        or all when SGLang does not report the version this agent last loaded."""
        assert self.buffer is not None and self.layout is not None and self.session is not None
        named = unpack(self.buffer, self.layout)
        if names is not None:
            try:
                reported = await weights.reported_version()
            except LoadRefused as exc:
                raise CommitRefused(exc.status, str(exc)) from None
            if reported != str(self.version):
                log.warning("SGLang at %s reports weight_version %r, not %s as last loaded by this agent (it "
                            "restarted?): loading every tensor, not only the %d changed", self.sglang_url, reported,
                            self.version, len(names))
                names = None
        if names is not None:
            chosen = [(n, t) for n, t in named if n in names]
            loading = chosen or ([min(named, key=lambda item: item[1].nbytes)] if named else [])
        else:
            loading = named
        return named, loading


# ---------------------------------------------------------------- HTTP


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
        await agent.check_layout(layout, strict=False)  # checked again, strictly, before the load
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
            answer = await activation.activate(agent, req)
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


def create_app(agent: ReceiverAgent) -> web.Application:
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


async def serve(agent: ReceiverAgent, bind_host: str, port: int) -> None:
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
    parser.add_argument("--readback-tensors", type=int, default=4,
                        help="tensors read back from SGLang after each load and compared (0: none)")
    parser.add_argument("--load-timeout-s", type=float, default=600.0,
                        help="longest one weight load into SGLang (or one transfer to a peer) may take")
    parser.add_argument("--log-level", default="info")
    ReceiverFaults.add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    agent = ReceiverAgent(args.host, args.sglang_url, protocol=args.protocol, device_name=args.device_name,
                          num_engines=args.engines, bucket_bytes=args.bucket_mb << 20,
                          flush_wait_s=args.flush_wait_s, faults=ReceiverFaults.from_args(args),
                          load_timeout_s=args.load_timeout_s, auth=SGLangAuth.from_env(),
                          readback_tensors=args.readback_tensors)
    asyncio.run(serve(agent, args.bind or args.host, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
