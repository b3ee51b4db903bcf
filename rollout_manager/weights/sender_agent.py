"""The weight sender: runs on each trainer node, holds the staged weights, writes them where told.

Runs in: trainer.

The trainer stages its full state dict into one registered host buffer (:meth:`SenderAgent.stage`);
the manager then asks, per transfer group, ``POST /push`` to one receiver. A group is a Mooncake
engine bound to one of this node's interfaces; a push splits the buffer into ``num_engines``
(``num_mooncake_engines_per_group``) shards, all in flight at once. Pushes of one group run one after the
other; groups run side by side. Per-shard checksums are computed once per version and returned, so
the receiver can refuse a corrupt transfer.

Deltas: the sender keeps a copy of the version it staged before (``keep_previous``), so the next one
can go to a receiver that holds that version as an exact sparse delta (:mod:`.delta`), encoded once
per version on the first ``GET /layout?delta_base=V`` and written to every such receiver. The
checksums it hands back are always those of the full new bytes.

The control API runs on its own thread and event loop, so the trainer's code stays synchronous.

Every transfer has a deadline (``transfer_timeout_s``): a receiver that stops taking bytes without
closing its connection fails the push (502) within it, rather than hold the push's thread and, through
it, the trainer's next :meth:`SenderAgent.stage` / :meth:`SenderAgent.stage_stream`, which wait for
running pushes to end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence

import numpy as np
import torch
from aiohttp import web

from rollout_manager.weights import delta
from rollout_manager.weights.agent_auth import token_middleware
from rollout_manager.weights.layout import HostBuffer, SlotWriter, WeightLayout, build_layout, stage
from rollout_manager.weights.mooncake_engine import MooncakeEngine
from rollout_manager.weights.protocol import (
    BadBody,
    DeltaOffer,
    LayoutAnswer,
    LayoutBody,
    PushAnswer,
    PushRequest,
    TransportName,
    parse_body,
)
from rollout_manager.weights.pusher import PushResult, push_buffer, source_view
from rollout_manager.weights.shards import shard_checksums, split_shards
from rollout_manager.weights.tcp_transport import TcpEngine
from rollout_manager.weights.transport import Transport

log = logging.getLogger("rollout_manager.sender")

AGENT: web.AppKey[SenderAgent] = web.AppKey("sender", object)  # type: ignore[arg-type]
# The manager's default weight_push_timeout_s: a transfer that outlives the manager's wait is useless.
DEFAULT_TRANSFER_TIMEOUT_S = 600.0


class SenderAgent:
    def __init__(self, ips: Sequence[str], port: int, *, protocol: str = "tcp", device_name: str = "",
                 auth_token: str | None = None, keep_previous: bool = True,
                 tcp_rate_bytes_per_s: float | None = None,
                 transfer_timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S):
        if transfer_timeout_s <= 0:
            raise ValueError("transfer_timeout_s must be > 0")
        self.ips = list(ips)
        self.transfer_timeout_s = transfer_timeout_s  # each push's transfer ends within this
        self.port = port
        self.protocol = protocol
        self.device_name = device_name
        self.auth_token = auth_token  # None: $ROLLOUT_MANAGER_AUTH_TOKEN
        self.buffer: HostBuffer | None = None
        self.layout: WeightLayout | None = None
        self.version: int | None = None
        self._engines: dict[tuple[str, str], Transport] = {}
        self._group_locks: dict[str, threading.Lock] = {}
        self._checksums: dict[tuple[int, int], list[str]] = {}
        self._gate = threading.Condition()
        self._pushes = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        # The previous version's bytes (for deltas), and the delta from it to the staged version.
        self.keep_previous = keep_previous
        self.tcp_rate_bytes_per_s = tcp_rate_bytes_per_s  # benchmarks: emulate a slow link per group
        self._prev: HostBuffer | None = None
        self._prev_key: tuple[int, str] | None = None  # (version, layout fingerprint) the copy holds
        self._delta: tuple[int, int, int] | None = None  # (base, version, bytes) of the delta in _blob
        self._blob: HostBuffer | None = None  # registered with every engine, grown when a delta does not fit
        self._delta_lock = threading.Lock()
        self.delta_encode_s = 0.0  # time the last delta took to encode
        self.bytes_sent = 0  # over every push, to see what peer bootstraps spare the trainer's links

    # ------------------------------------------------------------ trainer side
    def stage(self, state_dict: Mapping[str, torch.Tensor], version: int) -> WeightLayout:
        """Copy the state dict into the registered buffer as ``version`` (waits for running pushes)."""
        with self._gate:
            self._gate.wait_for(lambda: self._pushes == 0)
            self._keep_previous()
            layout = self._stage_locked(state_dict, version)
        log.info("staged version %d: %d tensors, %d bytes", version, len(layout), layout.total_bytes)
        return layout

    def stage_stream(self, items: Iterable[tuple[str, torch.Tensor]], version: int) -> WeightLayout:
        """Stage ``(name, tensor)`` pairs as they come (verl hands the gathered weights over one by
        one): each goes straight into its slot when it fits the last version's layout, so no second
        full copy of the model is ever held (on the GPU or off it). The first version, or one whose
        names, shapes or dtypes changed, is gathered in host memory and laid out anew."""
        with self._gate:
            self._gate.wait_for(lambda: self._pushes == 0)
            self._keep_previous()
            self.version = None  # the buffer is being rewritten: nothing in it is a version yet
            self._checksums.clear()
            buffer, last = self.buffer, self.layout
            if buffer is None or last is None:  # the first version: no slots to write into yet
                layout = self._stage_locked({n: t.detach().to("cpu", copy=True) for n, t in items}, version)
            else:
                layout = self._stage_into_slots(buffer, last, items, version)
        log.info("staged version %d as it streamed in: %d tensors, %d bytes", version, len(layout),
                 layout.total_bytes)
        return layout

    def _stage_into_slots(self, buffer: HostBuffer, layout: WeightLayout,
                          items: Iterable[tuple[str, torch.Tensor]], version: int) -> WeightLayout:
        """Write each tensor into its slot of ``layout`` while they all fit; lay out anew otherwise."""
        writer = SlotWriter(buffer)
        written: dict[str, None] = {}  # (ordered set)

        def copies_of_written() -> dict[str, torch.Tensor]:
            return {n: writer.read(layout[n]) for n in written}

        held: dict[str, torch.Tensor] | None = None
        for name, tensor in items:
            if held is None:
                spec = layout[name] if name in layout else None
                if spec is not None and spec.matches(tensor) and name not in written:
                    writer.write(spec, tensor.detach())
                    written[name] = None
                    continue
                held = copies_of_written()  # the layout changed: lay everything out anew
            held[name] = tensor.detach().to("cpu", copy=True)
        if held is None and len(written) < len(layout):  # fewer tensors than last time
            held = copies_of_written()
        if held is not None:
            return self._stage_locked(held, version)
        writer.finish()
        self.version = version
        return layout

    def _keep_previous(self) -> None:
        """Copy the staged version aside before it is overwritten (one memcpy per step), so the next
        version can be sent as a delta from it; the old delta is dropped."""
        self._delta = None
        buffer, layout, version = self.buffer, self.layout, self.version
        if not self.keep_previous or buffer is None or layout is None or version is None:
            self._prev_key = None
            return
        if self._prev is None or not self._prev.fits(layout):
            self._prev = HostBuffer.for_layout(layout, pin=False)
        self._prev.tensor[: layout.total_bytes].copy_(buffer.tensor[: layout.total_bytes])
        self._prev_key = (version, layout.fingerprint())

    @contextlib.contextmanager
    def _reading(self, version: int) -> Iterator[tuple[HostBuffer, WeightLayout]]:
        """Hold off restaging while the staged ``version`` is read (pushed or encoded)."""
        with self._gate:
            buffer, layout = self.buffer, self.layout
            if self.version != version or buffer is None or layout is None:
                raise PushRefused(409, f"version {version} is not staged (staged: {self.version})")
            self._pushes += 1  # no restage until this is done: buffer and layout stay as read
        try:
            yield buffer, layout
        finally:
            with self._gate:
                self._pushes -= 1
                self._gate.notify_all()

    def delta_offer(self, base: int, version: int | None) -> DeltaOffer | None:
        """The delta from ``base`` to the staged ``version``, encoded on first use; None when this sender
        does not hold ``base`` of the same layout (the receiver then gets a full push)."""
        if version is None or self._prev_key is None or self._prev_key[0] != base:
            return None
        try:
            found = self._delta_from(base, version)
        except PushRefused:  # restaged meanwhile
            return None
        return None if found is None else DeltaOffer(base_version=base, bytes=found[1])

    def _delta_from(self, base: int, version: int) -> tuple[HostBuffer, int] | None:
        with self._reading(version) as (buffer, layout), self._delta_lock:
            cached, blob_buf = self._delta, self._blob
            if cached is not None and blob_buf is not None and cached[:2] == (base, version):
                return blob_buf, cached[2]
            prev, key = self._prev, self._prev_key
            if prev is None or key != (base, layout.fingerprint()):
                return None
            t0 = time.perf_counter()
            total = layout.total_bytes
            blob = delta.encode(prev.array[:total], buffer.array[:total], base_version=base, version=version,
                                fingerprint=layout.fingerprint())
            self.delta_encode_s = time.perf_counter() - t0
            self._delta = None
            out = blob_buf
            if out is None or out.nbytes < len(blob):
                if out is not None:
                    for engine in self._engines.values():
                        engine.unregister(out.addr)
                out = HostBuffer(len(blob) + (len(blob) >> 2), pin=bool(buffer.pinned))  # some headroom
                for engine in self._engines.values():
                    engine.register(out.addr, out.nbytes)
                self._blob = out
            out.array[: len(blob)] = np.frombuffer(blob, dtype=np.uint8)
            self._delta = (base, version, len(blob))
            log.info("delta %d -> %d: %d bytes (%.1f%% of %d) in %.3fs", base, version, len(blob),
                     100 * len(blob) / max(total, 1), total, self.delta_encode_s)
            return out, len(blob)

    def _stage_locked(self, state_dict: Mapping[str, torch.Tensor], version: int) -> WeightLayout:
        layout = build_layout(state_dict)
        if self.buffer is None or not self.buffer.fits(layout):
            old = self.buffer
            self.buffer = HostBuffer.for_layout(layout)
            for engine in self._engines.values():
                if old is not None:
                    engine.unregister(old.addr)
                engine.register(self.buffer.addr, max(self.buffer.nbytes, 1))
        stage(state_dict, layout, self.buffer)
        self.layout, self.version = layout, version
        self._checksums.clear()
        return layout

    # ------------------------------------------------------------ pushes
    def _engine(self, ip: str, transport: TransportName = "mooncake") -> Transport:
        """The group's engine, bound to ``ip``; created (and given the buffer) on first use.

        One engine per group, every shard of a push in flight through it at once: on TCP that
        measured faster and cheaper in CPU than one engine per shard (docs/benchmarks.md, "Weight transfer").
        """
        engine = self._engines.get((ip, transport))
        if engine is None:
            if transport == "tcp":
                engine = TcpEngine(ip, listen=False, rate_bytes_per_s=self.tcp_rate_bytes_per_s).start()
            else:
                engine = MooncakeEngine(ip, self.protocol, self.device_name).start()
            if self.buffer is not None:
                engine.register(self.buffer.addr, max(self.buffer.nbytes, 1))
            if self._blob is not None:
                engine.register(self._blob.addr, self._blob.nbytes)
            self._engines[(ip, transport)] = engine
        return engine

    def push(self, req: PushRequest) -> PushAnswer:
        """Write the staged buffer to one receiver through group ``req.ip`` (blocking)."""
        if req.ip not in self.ips:
            raise PushRefused(400, f"{req.ip} is not one of this sender's interfaces {self.ips}")
        found = None
        if req.delta_base is not None:  # encoded at /layout time; this only looks it up
            found = self._delta_from(req.delta_base, req.version)
            if found is None:
                raise PushRefused(409, f"no delta from version {req.delta_base} to {req.version} here")
        with self._reading(req.version) as (buffer, layout), self._group_locks.setdefault(req.ip, threading.Lock()):
            engine = self._engine(req.ip, req.transport)
            total = layout.total_bytes
            key = (req.version, req.num_engines)
            if key not in self._checksums:
                shards = split_shards(total, req.num_engines)
                self._checksums[key] = shard_checksums(source_view(buffer.addr, total), shards)
            sums = self._checksums[key]
            sessions = list(req.session_ids)
            if found is not None and req.delta_addr is not None:
                blob, nbytes = found
                sent = push_buffer(engine, blob.addr, nbytes, sessions, req.delta_addr, req.num_engines,
                                   compute_checksums=False, timeout_s=self.transfer_timeout_s)
                result = PushResult(bytes=sent.bytes, seconds=sent.seconds, checksums=sums,
                                    shards=split_shards(total, req.num_engines))
            else:
                result = push_buffer(engine, buffer.addr, total, sessions, req.buffer_addr, req.num_engines,
                                     checksums=sums, only=req.only_shards, timeout_s=self.transfer_timeout_s)
            with self._gate:
                self.bytes_sent += result.bytes
        return PushAnswer(version=req.version, bytes=result.bytes, seconds=round(result.seconds, 6),
                          gbps=round(result.gbps, 3), shards=result.shards, checksums=result.checksums,
                          fingerprint=layout.fingerprint(), delta_base=req.delta_base)

    # ------------------------------------------------------------ control API on its own thread
    def start(self) -> SenderAgent:
        ready = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self._serve())
            except BaseException as exc:
                errors.append(exc)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._runner.cleanup() if self._runner else asyncio.sleep(0))
            loop.close()

        self._thread = threading.Thread(target=run, name="weight-sender", daemon=True)
        self._thread.start()
        ready.wait()
        if errors:
            raise RuntimeError(f"weight sender cannot start: {errors[0]}")
        return self

    async def _serve(self) -> None:
        app = web.Application(client_max_size=8 << 20, middlewares=[token_middleware(self.auth_token)])
        app[AGENT] = self
        app.router.add_get("/health", handle_info)
        app.router.add_get("/layout", handle_layout)
        app.router.add_post("/push", handle_push)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        for ip in self.ips:
            await web.TCPSite(self._runner, ip, self.port).start()
        log.info("weight sender listening on %s port %d", ", ".join(self.ips), self.port)

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:  # idempotent: a second stop is a no-op
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)
            self._loop = self._thread = None
        for engine in self._engines.values():
            engine.close()
        self._engines.clear()

    def __enter__(self) -> SenderAgent:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class PushRefused(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


async def handle_info(request: web.Request) -> web.Response:
    agent = request.app[AGENT]
    return web.json_response({"status": "ok", "ips": agent.ips, "version": agent.version,
                              "bytes_sent": agent.bytes_sent,
                              "fingerprint": agent.layout.fingerprint() if agent.layout else None})


async def handle_layout(request: web.Request) -> web.Response:
    agent = request.app[AGENT]
    layout, version = agent.layout, agent.version
    if layout is None:
        return web.json_response({"error": "nothing staged yet"}, status=404)
    offer = None
    base = request.query.get("delta_base")
    if base is not None:
        if not base.isdigit():
            return web.json_response({"error": f"delta_base must be a version, got {base!r}"}, status=400)
        offer = await asyncio.to_thread(agent.delta_offer, int(base), version)
    answer = LayoutAnswer(version=version, layout=LayoutBody.model_validate(layout.to_dict()),
                          fingerprint=layout.fingerprint(), delta=offer)
    return web.json_response(answer.model_dump())


async def handle_push(request: web.Request) -> web.Response:
    agent = request.app[AGENT]
    try:
        req = parse_body(await request.read(), PushRequest)
    except BadBody as exc:
        return web.json_response({"error": f"bad push body: {exc}"}, status=400)
    try:
        result = await asyncio.to_thread(agent.push, req)
    except PushRefused as exc:
        return web.json_response({"error": str(exc)}, status=exc.status)
    except Exception as exc:  # a transfer failure: report it, the manager decides
        log.warning("push of version %d via %s to %s failed: %s", req.version, req.ip, req.session_ids[0], exc)
        return web.json_response({"error": f"transfer failed: {exc}"}, status=502)
    return web.json_response(result.model_dump())
