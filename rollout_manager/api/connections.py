"""Bounds on callers' connections, so that no caller can use up the manager's descriptors.

aiohttp's server has no timeout for reading a request's headers, keeps idle connections for an hour
and accepts connections until ``accept()`` fails for want of descriptors, which also starves the
manager's own connections to its instances. Here every connection is in one of three phases:

- idle: between requests, nothing of the next one received yet; closed after ``keepalive_s``;
- partial: bytes of a request arrived but its headers are not complete; closed ``header_s`` after
  its first byte, however slowly bytes keep coming (slowloris);
- busy: a handler runs; never closed here (a body that trickles is bounded by ``body_s`` in
  ``http.read_json``; a streaming answer may legitimately take minutes).

Open connections are capped in total, below the open-file limit; at the cap a waiting connection is
closed to make room (one idle for a while, else the one sending headers the longest, see
``_victim``), so a new caller is not the one to go while slow ones stay, even under a flood of new
connections. Only when every connection is busy is the new one refused (503).

Per client address only waiting (idle or partial) connections are capped, and only those that have
waited ``GRACE_S`` are closed for it: a trainer host that opens a thousand streams at once has
each of them busy within milliseconds, so it is never cut, however many it runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from aiohttp import web

from rollout_manager import jsonutil
from rollout_manager.api.fast_lane import FastLane
from rollout_manager.api.http import BODY_TIMEOUT, Handler
from rollout_manager.config import Config
from rollout_manager.osutil import open_file_limit

log = logging.getLogger("rollout_manager.api.connections")

IDLE, PARTIAL, BUSY = "idle", "partial", "busy"
SUMMARY_EVERY_S = 60.0  # closures and refusals are logged as one summary line at most this often
GRACE_S = 1.0  # a waiting connection younger than this is never closed to make room (a burst of new callers)


@dataclass(frozen=True)
class ConnectionLimits:
    keepalive_s: float
    header_s: float
    body_s: float
    max_total: int
    max_waiting_per_client: int

    @classmethod
    def from_config(cls, cfg: Config, open_files: int | None = None) -> ConnectionLimits:
        """``max_client_connections = 0`` takes half the soft open-file limit: the other half stays for
        the manager's own connections to instances and weight agents, its logs and sockets."""
        total = cfg.max_client_connections
        if total <= 0:
            soft = open_file_limit()[0] if open_files is None else open_files
            total = max(soft // 2, 16) if soft > 0 else 1 << 19
        return cls(cfg.http_keepalive_timeout_s, cfg.http_header_timeout_s, cfg.http_body_timeout_s,
                   total, cfg.max_idle_connections_per_client)


class GuardedProtocol(asyncio.Protocol):
    """Sits between the transport and the HTTP handler and reports the phase to the guard.

    The handler is the fast lane (``fast_lane``) when one is given, until it hands the connection over,
    else aiohttp's. Only the ``asyncio.Protocol`` interface is used, so nothing depends on aiohttp's
    internals.
    """

    def __init__(self, guard: ConnectionGuard, make_inner: Callable[[], asyncio.Protocol],
                 make_lane: Callable[[GuardedProtocol], FastLane] | None = None) -> None:
        self.guard = guard
        self.make_inner = make_inner
        self.make_lane = make_lane
        self.inner: asyncio.Protocol | None = None
        self.lane: FastLane | None = None
        self.transport: asyncio.Transport | None = None
        self.client = ""
        self.phase = IDLE
        self.since = 0.0
        self.closing = False
        self.admitted = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not subclasses
        peer = transport.get_extra_info("peername")
        self.client = str(peer[0]) if isinstance(peer, tuple) and peer else str(peer)
        if not self.guard.admit(self):
            return
        self.admitted = True
        if self.make_lane is not None:
            self.lane = self.make_lane(self)
        else:
            self.hand_over(b"")

    def hand_over(self, pending: bytes) -> None:
        """aiohttp's handler takes the connection for good, starting with ``pending`` (bytes the lane
        received and did not answer)."""
        self.lane = None
        self.inner = self.make_inner()
        self.inner.connection_made(cast(asyncio.Transport, self.transport))
        if pending:
            self.inner.data_received(pending)

    def lane_busy(self) -> None:
        self.guard.busy(self)

    def lane_idle(self) -> None:
        self.guard.idle_again(self)

    def data_received(self, data: bytes) -> None:
        if not self.admitted:
            return
        if self.phase == IDLE:
            self.guard.started_sending(self)
        if self.lane is not None:
            self.lane.data_received(data)
        elif self.inner is not None:
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.inner is not None else None

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.lost(self)
        if self.lane is not None:  # the lane points back here: drop it now, not at the next full collection
            self.lane.connection_lost()
            self.lane = None
        if self.inner is not None:
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.lane is not None:
            self.lane.pause_writing()
        elif self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.lane is not None:
            self.lane.resume_writing()
        elif self.inner is not None:
            self.inner.resume_writing()


class ConnectionGuard:
    """Tracks every connection's phase; closes slow and surplus ones (see the module's docstring)."""

    def __init__(self, limits: ConnectionLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self.clock = clock
        self.open = 0
        # waiting connections per phase, in the order they entered it, so the oldest is first
        self.idle: OrderedDict[GuardedProtocol, None] = OrderedDict()
        self.partial: OrderedDict[GuardedProtocol, None] = OrderedDict()
        self.waiting_by_client: dict[str, OrderedDict[GuardedProtocol, None]] = {}
        self.crowded: set[str] = set()  # clients past max_waiting_per_client, trimmed by sweep()
        self.counts = {"idle_closed": 0, "slow_headers_closed": 0, "evicted": 0, "refused": 0}
        self._logged = dict(self.counts)
        self._last_summary = clock()
        self._sweeper: asyncio.Task[None] | None = None

    # ------------------------------------------------------------ wiring
    def protocol_factory(self, make_inner: Callable[[], asyncio.Protocol],
                         make_lane: Callable[[GuardedProtocol], FastLane] | None = None
                         ) -> Callable[[], GuardedProtocol]:
        return lambda: GuardedProtocol(self, make_inner, make_lane)

    def install(self, app: web.Application) -> None:
        """Add the middleware that marks connections busy (first, so it wraps every other) and the
        body read timeout. Call before the app is frozen (before ``AppRunner.setup``)."""
        app.middlewares.insert(0, self.middleware)
        app[BODY_TIMEOUT] = self.limits.body_s

    def start(self) -> None:
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        proto = request.transport.get_protocol() if request.transport is not None else None
        if not isinstance(proto, GuardedProtocol):  # an in-process test server: nothing to track
            return await handler(request)
        self.busy(proto)
        try:
            return await handler(request)
        finally:
            self.idle_again(proto)

    # ------------------------------------------------------------ events
    def busy(self, proto: GuardedProtocol) -> None:
        """A request's handler starts: the connection is out of every waiting list until it ends."""
        self._leave_waiting(proto)
        proto.phase = BUSY

    def idle_again(self, proto: GuardedProtocol) -> None:
        """A request was answered: the connection waits for the next one (the keep-alive clock runs)."""
        if not proto.closing and proto.transport is not None and not proto.transport.is_closing():
            self._enter(proto, IDLE)

    def admit(self, proto: GuardedProtocol) -> bool:
        """A new connection: make room for it, or refuse it (503) when every connection is busy."""
        if self.open >= self.limits.max_total:
            victim = self._victim()
            if victim is None:
                self.counts["refused"] += 1
                self._refuse(proto)
                return False
            self._close(victim, "evicted")
        self.open += 1
        self._enter(proto, IDLE)
        return True

    def _victim(self) -> GuardedProtocol | None:
        """Who goes at the cap: a connection idle past ``GRACE_S`` (a keep-alive nobody uses), else the
        one sending headers the longest, else the oldest new one (not yet sent a byte)."""
        idle = next(iter(self.idle), None)
        if idle is not None and self.clock() - idle.since >= GRACE_S:
            return idle
        return next(iter(self.partial), None) or idle

    def started_sending(self, proto: GuardedProtocol) -> None:
        """The first bytes of a request on an idle connection: its headers' clock starts."""
        if proto.phase == IDLE and not proto.closing:
            self._leave_waiting(proto)
            self._enter(proto, PARTIAL)

    def lost(self, proto: GuardedProtocol) -> None:
        if not proto.admitted:  # refused: never counted
            return
        self._leave_waiting(proto)
        if not proto.closing:
            proto.closing = True
            self.open -= 1

    # ------------------------------------------------------------ bookkeeping
    def _enter(self, proto: GuardedProtocol, phase: str) -> None:
        proto.phase, proto.since = phase, self.clock()
        (self.idle if phase == IDLE else self.partial)[proto] = None
        mine = self.waiting_by_client.get(proto.client)
        if mine is None:  # not setdefault: that would build a dict per call, twice per request
            mine = self.waiting_by_client[proto.client] = OrderedDict()
        mine[proto] = None
        if len(mine) > self.limits.max_waiting_per_client:
            self.crowded.add(proto.client)

    def _leave_waiting(self, proto: GuardedProtocol) -> None:
        self.idle.pop(proto, None)
        self.partial.pop(proto, None)
        mine = self.waiting_by_client.get(proto.client)
        if mine is not None:
            mine.pop(proto, None)
            if not mine:
                del self.waiting_by_client[proto.client]

    def _close(self, proto: GuardedProtocol, why: str) -> None:
        """Close a waiting connection now; its descriptor is free once the transport lets go of it."""
        self._leave_waiting(proto)
        if not proto.closing:
            proto.closing = True
            self.open -= 1
        self.counts[why] += 1
        if proto.transport is not None:
            proto.transport.close()

    def _refuse(self, proto: GuardedProtocol) -> None:
        assert proto.transport is not None
        body = jsonutil.dumps({"error": f"too many connections to the manager ({self.limits.max_total} open, "
                                        f"all busy: max_client_connections); retry later"})
        head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\nRetry-After: 1\r\n\r\n").encode()
        proto.transport.write(head + body)
        proto.transport.close()

    def sweep(self) -> None:
        """Close idle connections past the keep-alive timeout, partial ones past the header timeout,
        and a crowded client's oldest waiting ones past its cap. Every dict is in phase order, so only
        the expired prefix is looked at."""
        now = self.clock()
        for waiting, limit, why in ((self.idle, self.limits.keepalive_s, "idle_closed"),
                                    (self.partial, self.limits.header_s, "slow_headers_closed")):
            while waiting:
                proto = next(iter(waiting))
                if now - proto.since < limit:
                    break
                self._close(proto, why)
        for client in list(self.crowded):
            mine = self.waiting_by_client.get(client)
            while mine and len(mine) > self.limits.max_waiting_per_client:
                proto = next(iter(mine))
                if now - proto.since < GRACE_S:
                    break
                self._close(proto, "evicted")
            if not mine or len(mine) <= self.limits.max_waiting_per_client:
                self.crowded.discard(client)
        self._summarize(now)

    def _summarize(self, now: float) -> None:
        if now - self._last_summary < SUMMARY_EVERY_S:
            return
        self._last_summary = now
        new = {k: v - self._logged[k] for k, v in self.counts.items()}
        self._logged = dict(self.counts)
        if new["slow_headers_closed"] or new["evicted"] or new["refused"]:
            log.warning("callers' connections in the last %gs: %d closed for slow headers (> %gs, "
                        "http_header_timeout_s), %d closed to make room and %d refused at the cap of %d "
                        "(max_client_connections); %d open now", SUMMARY_EVERY_S, new["slow_headers_closed"],
                        self.limits.header_s, new["evicted"], new["refused"], self.limits.max_total, self.open)

    async def _sweep_forever(self) -> None:
        period = min(max(min(self.limits.keepalive_s, self.limits.header_s) / 4, 0.05), 1.0)
        while True:
            await asyncio.sleep(period)
            self.sweep()

    def stats(self) -> dict[str, Any]:
        return {"open": self.open, "idle": len(self.idle), "partial": len(self.partial),
                "max_total": self.limits.max_total, **self.counts}


async def start_site(runner: web.AppRunner, guard: ConnectionGuard, host: str, port: int,
                     make_lane: Callable[[GuardedProtocol], FastLane] | None = None, *,
                     reuse_port: bool = False) -> web.BaseSite:
    """Listen on ``host:port`` with every connection going through ``guard`` (and through a fast lane
    from ``make_lane`` first, when given). ``reuse_port``: other processes listen on it too (relays; the kernel
    spreads new connections over them)."""
    site = GuardedSite(runner, guard, host, port, make_lane=make_lane, reuse_port=reuse_port)
    await site.start()
    return site


class GuardedSite(web.BaseSite):
    """A TCP site whose connections go through a :class:`ConnectionGuard` (aiohttp's ``TCPSite``
    hands the runner's server straight to ``create_server``)."""

    def __init__(self, runner: web.AppRunner, guard: ConnectionGuard, host: str, port: int,
                 backlog: int = 1024, make_lane: Callable[[GuardedProtocol], FastLane] | None = None,
                 reuse_port: bool = False) -> None:
        super().__init__(runner, backlog=backlog)
        self.reuse_port = reuse_port
        self.guard = guard
        self.make_lane = make_lane
        self.host, self.port = host, port

    @property
    def name(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            self.guard.protocol_factory(server, self.make_lane), self.host or None, self.port, backlog=self._backlog,
            reuse_port=self.reuse_port or None)
