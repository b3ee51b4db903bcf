"""The weight receiver: runs beside SGLang on each rollout box and loads verified weights into it.

The manager drives it over HTTP (it is one brain; this agent only moves and checks bytes):

- ``POST /prepare {version, layout}``: make sure a registered receive buffer matching the layout
  exists (allocated once, reused every step while the layout stays the same) and answer where the
  sender should write: Mooncake session ids and the buffer address.
- ``POST /commit {version, fingerprint, shards, checksums}``: after the sender wrote, verify every
  shard's checksum; only then load the tensors into SGLang with ``/update_weights_from_tensor`` in
  buckets (``flush_cache`` and ``weight_version`` on the last one), one payload per TP rank, inside a
  weight-update session (``/begin_weight_update`` ... ``/end_weight_update``) on SGLang 0.5.21 and later,
  without one on older servers (the version comes from ``/server_info``). A corrupt or partial transfer
  is refused with 422 and never loaded; a data-parallel server (``dp_size > 1``) with 409.
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
only the tensors whose bytes changed since the last load. Any other ``/prepare`` means a full push:
the buffer's version is forgotten and the next load reloads every tensor.

SGLang is never patched: the same HTTP endpoints serve real SGLang and the CPU engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

import aiohttp
import torch
from aiohttp import web

from rollout_manager.sglang import tensor_payload, wire
from rollout_manager.weights import delta
from rollout_manager.weights.agent_auth import token_middleware
from rollout_manager.weights.layout import HostBuffer, WeightLayout, unpack
from rollout_manager.weights.mooncake_engine import MooncakeEngine
from rollout_manager.weights.protocol import (
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
from rollout_manager.weights.shards import Shard, verify_shards
from rollout_manager.weights.tcp_transport import TcpEngine
from rollout_manager.weights.transport import Transport

log = logging.getLogger("rollout_manager.receiver")

AGENT: web.AppKey[ReceiverAgent] = web.AppKey("agent", object)  # type: ignore[arg-type]


class ReceiverAgent:
    def __init__(self, host: str, sglang_url: str, *, protocol: str = "tcp", device_name: str = "",
                 num_engines: int = 1, bucket_bytes: int = 256 << 20, load_timeout_s: float = 600.0,
                 flush_wait_s: float = 30.0, fault_corrupt: bool = False, fault_die_after_prepare: bool = False,
                 fault_corrupt_delta: bool = False, fault_die_mid_serve: bool = False,
                 fault_corrupt_serve: bool = False):
        self.host = host
        self.sglang_url = sglang_url.rstrip("/")
        # The Mooncake engines (one session id each, all sharing the buffer); engines[0] does the handshake.
        self.engines: list[MooncakeEngine] = [
            MooncakeEngine(host, protocol, device_name) for _ in range(max(num_engines, 1))]
        self.tcp: TcpEngine | None = None  # the plain-TCP transport, started when first asked for
        self.bucket_bytes = bucket_bytes
        self.load_timeout_s = load_timeout_s
        self.flush_wait_s = flush_wait_s  # how long SGLang may take to go idle for the cache flush
        self.buffer: HostBuffer | None = None
        self.layout: WeightLayout | None = None
        self.version: int | None = None  # last version loaded into SGLang
        self.held: tuple[int, str] | None = None  # (version, layout fingerprint) the buffer holds, verified
        self.dirty: set[str] | None = None  # tensors whose bytes may differ from SGLang's (None: all)
        self.delta_buffer: HostBuffer | None = None  # where the sender writes a delta
        self.reloaded = 0  # tensors the last load sent to SGLang
        self.busy = asyncio.Lock()
        # Test faults: flip a byte of what landed before verifying; exit once the sender may write.
        self.fault_corrupt = fault_corrupt
        self.fault_die_after_prepare = fault_die_after_prepare
        self.fault_corrupt_delta = fault_corrupt_delta  # flip a byte of every delta before applying it
        self.fault_die_mid_serve = fault_die_mid_serve  # exit after serving the first shard to a peer
        self.fault_corrupt_serve = fault_corrupt_serve  # serve peers one wrong byte
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
        if self.fault_die_mid_serve:  # the first shard lands, then this box is gone
            push_buffer(engines, addr, total, sessions, req.buffer_addr, req.num_engines, compute_checksums=False,
                        only=[0])
            os._exit(1)
        flip = total // 2 if self.fault_corrupt_serve and total else None
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
        if self.fault_corrupt_delta and req.delta_bytes:
            blob[-1] ^= 0xFF
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

    # ------------------------------------------------------------ commit
    async def commit(self, req: CommitRequest) -> CommitAnswer:
        if self.buffer is None or self.layout is None or self.layout.fingerprint() != req.fingerprint:
            raise CommitRefused(409, "no prepared buffer for this layout; call /prepare first")
        layout = self.layout
        apply_s = None
        if req.delta_base is not None:
            apply_s = round(await asyncio.to_thread(self._apply_delta, req, layout), 6)
        else:
            self.held = None
        if self.fault_corrupt and layout.total_bytes:
            self.buffer.array[layout.total_bytes // 2] ^= 0xFF
        t0 = time.perf_counter()
        bad = await asyncio.to_thread(verify_shards, self.buffer.array, list(req.shards), list(req.checksums))
        verify_s = time.perf_counter() - t0
        if bad:
            if self.dirty is not None:  # the repair rewrites these shards: their tensors reload too
                self.dirty |= self._touched(layout, delta.Applied(), [req.shards[i] for i in bad])
            raise CommitRefused(422, f"checksum mismatch in shard(s) {bad}; nothing loaded", bad_shards=bad)
        self.held = (req.version, layout.fingerprint())
        self.sums = (list(req.shards), list(req.checksums))  # the trainer's, for serving peers
        t1 = time.perf_counter()
        names = None if self.dirty is None or self.version is None else set(self.dirty)
        buckets = await self._load(req.version, names)
        self.version, self.dirty = req.version, set()
        return CommitAnswer(ok=True, version=req.version, verify_s=round(verify_s, 6),
                            load_s=round(time.perf_counter() - t1, 6), buckets=buckets, reloaded=self.reloaded,
                            apply_s=apply_s)

    async def _load(self, version: int, names: set[str] | None = None) -> int:
        """``/update_weights_from_tensor`` in buckets of about ``bucket_bytes``, for the tensors in ``names``
        (None: all; none: the smallest one, which still carries the new ``weight_version``); the session,
        where the server has them, is closed whatever happens, since SGLang refuses a second begin while
        one is open. Returns the buckets; ``reloaded`` says how many tensors went."""
        assert self.buffer is not None and self.layout is not None and self.session is not None
        named = unpack(self.buffer, self.layout)
        if names is not None:
            chosen = [(n, t) for n, t in named if n in names]
            named = chosen or ([min(named, key=lambda item: item[1].nbytes)] if named else [])
        self.reloaded = len(named)
        cuda = torch.cuda.is_available()
        buckets: list[list[tuple[str, torch.Tensor]]] = [[]]
        size = 0
        for name, tensor in named:
            if buckets[-1] and size + tensor.nbytes > self.bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append((name, tensor))
            size += tensor.nbytes
        info = await self._server_info()
        if info.dp_size > 1:
            raise CommitRefused(409, wire.dp_refusal(self.sglang_url, info.dp_size))
        opened = await self._begin_session(wire.weight_update_sessions(info.version))
        try:
            for i, bucket in enumerate(buckets):
                payloads, keep_alive = self._payloads(bucket, info, cuda)
                last = i == len(buckets) - 1
                body = wire.update_weights_from_tensor_body(payloads, flush_cache=last,
                                                            weight_version=str(version) if last else None)
                try:
                    await self._call(wire.UPDATE_WEIGHTS_FROM_TENSOR, body, f"bucket {i}")
                except CommitRefused as exc:
                    if not (last and wire.cache_not_flushed(str(exc))):
                        raise
                    await self._flush_when_idle()  # the weights are in; only the old prefix cache is left
                del keep_alive  # SGLang has copied the tensors its IPC handles point at
        except BaseException:
            if opened:  # close the session whatever happened, or SGLang refuses the next begin
                try:
                    await self._call(wire.END_WEIGHT_UPDATE, wire.end_weight_update_body(), "end_weight_update")
                except (CommitRefused, aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    log.warning("could not close the weight-update session after a failed load: %s", exc)
            raise
        if opened:
            await self._call(wire.END_WEIGHT_UPDATE, wire.end_weight_update_body(), "end_weight_update")
        return len(buckets)

    def _payloads(self, bucket: list[tuple[str, torch.Tensor]], info: wire.ServerInfo,
                  cuda: bool) -> tuple[list[str], list[torch.Tensor]]:
        """One ``serialized_named_tensors`` entry per TP rank, each for that rank, as SGLang's own
        ``weight_sync`` helper builds them: on a GPU box rank r gets IPC handles to a copy on its own GPU
        (SGLang's rank r opens entry r only, and must not map another rank's device); on CPU every rank
        gets the tensors by value. Also returns the tensors the handles point at, to keep alive.

        Device indices are pickled as numbers, which SGLang's patched reductions accept as they are:
        this agent must see the GPUs as SGLang does (launch_sglang.sh starts both with one environment).
        """
        if not cuda:  # views share the whole buffer's storage, which pickling would copy once per tensor
            payload = tensor_payload.serialize_named_tensors([(n, t.clone()) for n, t in bucket])
            return [payload] * info.tp_size, []
        payloads: list[str] = []
        keep: list[torch.Tensor] = []
        for rank in range(info.tp_size):
            gpu = info.gpu_of_rank(rank)
            if gpu >= torch.cuda.device_count():
                raise CommitRefused(500, f"SGLang's TP rank {rank} runs on GPU {gpu}, which this agent does not see "
                                         f"({torch.cuda.device_count()} visible); start it with SGLang's "
                                         f"CUDA_VISIBLE_DEVICES")
            on_gpu = [(n, t.to(f"cuda:{gpu}", non_blocking=True)) for n, t in bucket]
            torch.cuda.synchronize(gpu)
            payloads.append(tensor_payload.serialize_named_tensors(on_gpu, share_memory=True))
            keep.extend(t for _, t in on_gpu)
        return payloads, keep

    async def _call(self, path: str, body: dict[str, Any], what: str) -> dict[str, Any]:
        """POST to SGLang; anything but 200 with ``success`` true is a :class:`CommitRefused`."""
        assert self.session is not None
        async with self.session.post(self.sglang_url + path, json=body,
                                     timeout=aiohttp.ClientTimeout(total=self.load_timeout_s)) as r:
            status, answer = r.status, await _answer(r)
        if status != 200 or not answer.get("success", False):
            raise CommitRefused(502, f"SGLang refused {what}: HTTP {status} {answer}")
        return answer

    async def _flush_when_idle(self) -> None:
        """Flush SGLang's prefix cache once nothing runs there (a request the manager had not drained,
        a health probe), waiting up to ``flush_wait_s``: serving from a cache the old weights made
        would mix versions inside one sequence, so no flush means no commit."""
        assert self.session is not None
        wait = self.flush_wait_s
        log.info("SGLang at %s could not flush its cache with requests running; waiting up to %gs for it to "
                 "go idle", self.sglang_url, wait)
        async with self.session.post(self.sglang_url + wire.flush_cache_path(wait),
                                     timeout=aiohttp.ClientTimeout(total=wait + 30)) as r:
            status, text = r.status, (await r.text())[:200]
        if status != 200:
            raise CommitRefused(503, f"the weights are loaded but SGLang's prefix cache could not be flushed "
                                     f"within {wait:g}s (requests still running or queued there): HTTP {status} "
                                     f"{text.strip()}")

    async def _begin_session(self, sessions: bool | None) -> bool:
        """Open a weight-update session where the server has them (``sessions``: from its version; None
        when unknown: a 404 then means an older server without them). Returns whether one was opened."""
        assert self.session is not None
        if sessions is False:
            return False
        for attempt in range(2):
            async with self.session.post(self.sglang_url + wire.BEGIN_WEIGHT_UPDATE,
                                         json=wire.begin_weight_update_body(),
                                         timeout=aiohttp.ClientTimeout(total=self.load_timeout_s)) as r:
                status, answer = r.status, await _answer(r)
            if status == 200 and answer.get("success", False):
                return True
            if status == 404 and sessions is None:
                return False
            if attempt == 0 and answer.get("message") == wire.SESSION_ALREADY_OPEN_MESSAGE:
                # Left open by a load that died half-way (this agent is the only one loading): close it.
                log.warning("SGLang had a weight-update session open from an earlier load; closing it")
                await self._call(wire.END_WEIGHT_UPDATE, wire.end_weight_update_body(), "end_weight_update")
                continue
            raise CommitRefused(502, f"SGLang refused begin_weight_update: HTTP {status} {answer}")
        raise AssertionError("unreachable")

    async def _server_info(self) -> wire.ServerInfo:
        assert self.session is not None
        try:
            async with self.session.get(self.sglang_url + wire.SERVER_INFO,
                                        timeout=aiohttp.ClientTimeout(total=30)) as r:
                if r.status != 200:
                    raise CommitRefused(502, f"SGLang's {wire.SERVER_INFO} answered HTTP {r.status}")
                return wire.ServerInfo.from_json(await r.json(content_type=None))
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            raise CommitRefused(502, f"cannot read SGLang's {wire.SERVER_INFO}: {type(exc).__name__}: {exc}") from None


async def _answer(r: aiohttp.ClientResponse) -> dict[str, Any]:
    text = await r.text()
    try:
        answer = json.loads(text)
    except ValueError:
        return {"raw": text[:300]}
    return answer if isinstance(answer, dict) else {"raw": answer}


class CommitRefused(Exception):
    def __init__(self, status: int, message: str, bad_shards: list[int] | None = None):
        super().__init__(message)
        self.status = status
        self.bad_shards = bad_shards


# ---------------------------------------------------------------- HTTP


def bad_body(what: str, message: str) -> web.Response:
    return web.json_response({"error": f"bad {what} body: {message}"}, status=400)


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
    async with agent.busy:
        await agent.writable()
        answer = await asyncio.to_thread(agent.prepare, layout, req.transport, req.delta_base, req.delta_bytes)
    if agent.fault_die_after_prepare:
        asyncio.get_running_loop().call_later(0.05, os._exit, 1)
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
            log.warning("commit of version %d refused: %s", req.version, exc)
            body: dict[str, Any] = {"error": str(exc)}
            if exc.bad_shards is not None:
                body["bad_shards"] = exc.bad_shards
            return web.json_response(body, status=exc.status)
    log.info("version %d loaded into SGLang (verify %.3fs, load %.3fs)", req.version, result.verify_s,
             result.load_s)
    return web.json_response(result.model_dump())


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
        return web.json_response({"error": str(exc)}, status=exc.status)
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
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--fault-corrupt", action="store_true", help="test: corrupt every transfer")
    parser.add_argument("--fault-die-after-prepare", action="store_true", help="test: exit mid-transfer")
    parser.add_argument("--fault-corrupt-delta", action="store_true", help="test: corrupt every delta that lands")
    parser.add_argument("--fault-die-mid-serve", action="store_true", help="test: exit while serving a peer")
    parser.add_argument("--fault-corrupt-serve", action="store_true", help="test: serve peers a wrong byte")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    agent = ReceiverAgent(args.host, args.sglang_url, protocol=args.protocol, device_name=args.device_name,
                          num_engines=args.engines, bucket_bytes=args.bucket_mb << 20,
                          flush_wait_s=args.flush_wait_s, fault_corrupt=args.fault_corrupt,
                          fault_die_after_prepare=args.fault_die_after_prepare,
                          fault_corrupt_delta=args.fault_corrupt_delta, fault_die_mid_serve=args.fault_die_mid_serve,
                          fault_corrupt_serve=args.fault_corrupt_serve)
    asyncio.run(serve(agent, args.bind or args.host, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
