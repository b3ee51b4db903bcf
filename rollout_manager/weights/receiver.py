"""The receiver agent's state (:class:`Receiver`): its receive buffer (what it holds verified, staged, or serves
to peers) and the transfers into and out of it; SGLang's side is its
:class:`~rollout_manager.weights.receiver_loader.Loader`.

Runs in: box.

The routes that drive it are :mod:`rollout_manager.weights.receiver_agent`, whose docstring tells the protocol.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

import aiohttp

from rollout_manager.sglang.auth import SGLangAuth
from rollout_manager.sglang.weight_loader import LoadSettings
from rollout_manager.weights import activation, delta
from rollout_manager.weights.layout import HostBuffer, WeightLayout, unpack
from rollout_manager.weights.mooncake_engine import MooncakeEngine
from rollout_manager.weights.protocol import (
    ActivateAnswer,
    ActivateRequest,
    CommitAnswer,
    CommitRequest,
    LayoutAnswer,
    LayoutBody,
    PrepareAnswer,
    PushAnswer,
    ServeRequest,
    TransportName,
)
from rollout_manager.weights.pusher import PushResult, push_buffer
from rollout_manager.weights.receiver_faults import NO_FAULTS, ReceiverFaults
from rollout_manager.weights.receiver_loader import Loader
from rollout_manager.weights.refused import CommitRefused
from rollout_manager.weights.shards import Shard, verify_shards
from rollout_manager.weights.tcp_transport import TcpEngine
from rollout_manager.weights.transport import Transport

log = logging.getLogger("rollout_manager.receiver")


class Receiver:
    """One box's receiver: the buffer part here (one writer at a time: callers hold ``busy``) and SGLang's
    part, ``loader``."""

    def __init__(self, host: str, sglang_url: str, *, protocol: str = "tcp", device_name: str = "",
                 num_engines: int = 1, bucket_bytes: int = 256 << 20, load_timeout_s: float = 600.0,
                 flush_wait_s: float = 30.0, faults: ReceiverFaults = NO_FAULTS,
                 auth: SGLangAuth | None = None, readback_tensors: int = 0,
                 readback_rows: int = 4):
        self.host = host
        self.loader = Loader(sglang_url.rstrip("/"), auth or SGLangAuth(), LoadSettings(
            bucket_bytes, load_timeout_s, flush_wait_s, readback_tensors, readback_rows))
        # The Mooncake engines (one session id each, all sharing the buffer); engines[0] does the handshake.
        self.engines: list[MooncakeEngine] = [
            MooncakeEngine(host, protocol, device_name) for _ in range(max(num_engines, 1))]
        self.tcp: TcpEngine | None = None  # the plain-TCP transport, started when first asked for
        self.buffer: HostBuffer | None = None
        self.layout: WeightLayout | None = None
        self.held: tuple[int, str] | None = None  # (version, layout fingerprint) the buffer holds, verified
        self.delta_buffer: HostBuffer | None = None  # where the sender writes a delta
        self.staged: int | None = None  # the verified version the buffer holds for /activate (None: none)
        self.busy = asyncio.Lock()
        self.faults = faults  # what a test told it to get wrong (nothing, outside tests)
        # Serving peers: the trainer's (shards, checksums) of the held version; serves in flight.
        self.sums: tuple[list[Shard], list[str]] | None = None
        self.served_bytes = 0
        self._serving = 0
        self._idle = asyncio.Event()
        self._idle.set()

    async def start(self) -> None:
        for engine in self.engines:
            await asyncio.to_thread(engine.start)
        self.loader.session = aiohttp.ClientSession()

    async def close(self) -> None:
        if self.loader.session:
            await self.loader.session.close()
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
            "sglang_url": self.loader.sglang_url,
            "weight_version": self.loader.version,
            "buffer_bytes": self.buffer.nbytes if self.buffer else 0,
            "layout_fingerprint": self.layout.fingerprint() if self.layout else None,
            "buffer_version": self.held[0] if self.held else None,  # verified bytes of that layout
            "staged_version": self.staged,  # verified, waiting for /activate
            "activation_failed": self.loader.failed,
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
        try:  # bounded: a blackholed puller
            return push_buffer(engines, addr, total, sessions, req.buffer_addr, req.num_engines,
                               compute_checksums=False, timeout_s=self.loader.settings.load_timeout_s)
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
            self.held = None
            self.loader.forget()
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
        self.loader.may_differ(self._touched(layout, applied))
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
            # the repair rewrites these shards: their tensors reload too
            self.loader.may_differ(self._touched(layout, delta.Applied(), [req.shards[i] for i in bad]))
            raise CommitRefused(422, f"checksum mismatch in shard(s) {bad}; nothing loaded", bad_shards=bad)
        self.held = (req.version, layout.fingerprint())
        self.sums = (list(req.shards), list(req.checksums))  # the trainer's, for serving peers
        if req.stage:
            self.staged = req.version
            log.info("version %d verified and staged (SGLang serves %s)", req.version, self.loader.version)
            return CommitAnswer(ok=True, version=req.version, verify_s=round(verify_s, 6), load_s=0.0, buckets=0,
                                reloaded=0, apply_s=apply_s, staged=True)
        t1 = time.perf_counter()
        buckets = await self.loader.commit(layout, unpack(self.buffer, layout), req.version)
        return CommitAnswer(ok=True, version=req.version, verify_s=round(verify_s, 6),
                            load_s=round(time.perf_counter() - t1, 6), buckets=buckets, reloaded=self.loader.reloaded,
                            apply_s=apply_s, readback=self.loader.readback)

    # ------------------------------------------------------------ activate
    async def activate(self, req: ActivateRequest) -> ActivateAnswer:
        """Load the staged version inside a short pause of generation (:mod:`rollout_manager.weights.activation`);
        the caller holds ``busy``. Once loaded it is the served version, no longer staged."""
        staged = activation.Staged(self.staged)
        if self.staged is not None and self.layout is not None and self.buffer is not None \
                and self.held == (self.staged, self.layout.fingerprint()):
            staged = activation.Staged(self.staged, self.layout, self.buffer)
        answer = await activation.activate(self.loader, staged, req)
        self.staged = None
        return answer
