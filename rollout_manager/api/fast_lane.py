"""A lean HTTP/1.1 path for the request a trainer sends thousands of times: non-streaming ``POST /generate``.

aiohttp's web layer (request and response objects, the middleware chain, the handler task, the payload
writer) cost 0.03-0.07 ms of CPU per request in benchmark 1 (the same bare proxy on aiohttp's server and
on a plain asyncio protocol), a third to a half of sglang-router's whole path, and kept the manager
below the router's requests/s. The lane frames requests itself and takes only the plain case: a head aiohttp's parser
would take the same way (``lane_head``: llhttp, strict) with the request line ``POST /generate HTTP/1.1``,
one ``Content-Length`` within the body limit and nothing the lane would have to interpret, a head the
route admits (its bearer token, checked before any body is awaited), and a body the route accepts as is
(see :class:`LaneRoute`). Anything else (another route, HTTP/1.0, a chunked or encoded body, a missing
token, a body the route refuses or a streaming request) is handed, with every byte received since that
request began, to aiohttp's handler, which keeps the connection from then on. So errors and every
other route have one implementation, aiohttp's, and the lane is only ever a shortcut for a request that
would succeed there too.

Connections stay under the :mod:`connections` guard: the lane reports its phases (busy from an admitted
head to the answer, idle after) exactly as aiohttp's path does. A caller without the token is aiohttp's
at once (401), so it never holds a connection busy while it withholds its body. When the connection is
lost the lane lets go of its buffers and of the connection, so nothing waits for the garbage collector.
"""

from __future__ import annotations

import asyncio
import http
import logging
import time
from collections.abc import Awaitable, Callable
from email.utils import formatdate
from typing import Any, Protocol

from rollout_manager import jsonutil
from rollout_manager.api.lane_head import HeadReader, LaneHead
from rollout_manager.errors import INTERNAL_ERROR

log = logging.getLogger("rollout_manager.api.fast_lane")

PIPELINE_BUFFER = 1 << 20  # bytes of later requests buffered while one runs; then reading pauses


class LaneStats:
    """Counters shared by every connection's lane (exported by ``connection_metrics``)."""

    __slots__ = ("answered", "handed_over")

    def __init__(self) -> None:
        self.answered = 0
        self.handed_over = 0


class LaneRoute(Protocol):
    """The route's side: ``admit`` runs on the head, before any body is awaited, and is False for a head
    aiohttp's path must answer (no token, a field the route refuses); ``check`` runs at once on the
    complete request and returns what ``run`` needs, or None when aiohttp's path must answer it (a
    refusal, a streaming request); ``run`` answers it (status and JSON body) and never raises: its errors
    are answers too."""

    def admit(self, headers: dict[str, str]) -> bool: ...

    def check(self, headers: dict[str, str], body: bytes) -> Any | None: ...

    def run(self, prepared: Any) -> Awaitable[tuple[int, bytes]]: ...


class LaneOwner(Protocol):
    """The connection the lane serves (``connections.GuardedProtocol``)."""

    transport: asyncio.Transport | None

    def hand_over(self, pending: bytes) -> None: ...

    def lane_busy(self) -> None: ...

    def lane_idle(self) -> None: ...


class _Clock:
    """The ``Date`` header, formatted once a second."""

    def __init__(self) -> None:
        self.second = -1
        self.value = b""

    def date(self) -> bytes:
        now = int(time.time())
        if now != self.second:
            self.second, self.value = now, formatdate(now, usegmt=True).encode()
        return self.value


DATE = _Clock()
PHRASES = {s.value: s.phrase.encode() for s in http.HTTPStatus}


def answer_bytes(status: int, body: bytes, close: bool) -> bytes:
    head = (b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\nDate: %s\r\n"
            % (status, PHRASES.get(status, b"Unknown"), len(body), DATE.date()))
    return head + (b"Connection: close\r\n\r\n" if close else b"\r\n") + body


class FastLane:
    """One connection's lane: frames requests, runs one at a time in order, hands over when it must."""

    def __init__(self, owner: LaneOwner, route: LaneRoute, max_body: int, body_timeout_s: float,
                 on_body_timeout: Callable[[], bytes], stats: LaneStats) -> None:
        self.owner = owner
        self.route = route
        self.stats = stats
        self.max_body = max_body
        self.body_timeout_s = body_timeout_s
        self.on_body_timeout = on_body_timeout  # the 408 answer's JSON body (and the refusal counted)
        self.buf = bytearray()
        self.reader: HeadReader | None = None  # the head being received
        self.head: LaneHead | None = None  # the head of the request whose body is awaited or that runs
        self.task: asyncio.Task[None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.write_paused = False
        self.read_paused = False
        self.done = False  # handed over or closed: nothing more happens here

    # ------------------------------------------------------------ transport events
    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.task is None and not self.write_paused:
            self._advance()
        elif len(self.buf) > PIPELINE_BUFFER and not self.read_paused:
            self._pause_reading()

    def connection_lost(self) -> None:
        """The caller left: what runs for it is cancelled (its sequences are aborted), as aiohttp's
        ``handler_cancellation`` does."""
        self.done = True
        self._cancel_timer()
        if self.task is not None:
            self.task.cancel()
        self.buf, self.reader, self.head = bytearray(), None, None  # up to max_body each: not left to gc

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.task is None and not self.done:
            self._advance()

    # ------------------------------------------------------------ framing
    def _advance(self) -> None:
        """Start the next complete request in the buffer, if any; hand over at the first one the lane
        does not take."""
        if self.done:
            return
        head = self.head
        if head is None:
            if self.reader is None:
                self.reader = HeadReader(self.max_body)
            got = self.reader.feed(self.buf)
            if got is None:
                return
            if not isinstance(got, LaneHead) or not self.route.admit(got.fields):  # HAND_OVER, or a refusal
                self._hand_over()
                return
            head = self.head = got
            self.reader = None
            self.owner.lane_busy()
        start, length = head.size, head.length
        if len(self.buf) < start + length:
            if self.timer is None:
                self.timer = asyncio.get_running_loop().call_later(self.body_timeout_s, self._body_late)
            return
        self._cancel_timer()
        try:
            prepared = self.route.check(head.fields, bytes(self.buf[start:start + length]))
        except Exception:  # a bug in a check: aiohttp's path runs the same checks and answers 500 for it
            log.exception("checking POST /generate on the fast lane")
            prepared = None
        if prepared is None:
            self._hand_over()
            return
        close = not head.keep_alive
        self.task = asyncio.get_running_loop().create_task(self._answer(prepared, start + length, close))

    async def _answer(self, prepared: Any, size: int, close: bool) -> None:
        try:
            status, body = await self.route.run(prepared)
        except Exception:  # run answers its own errors; this is the last resort, never a dead connection
            log.exception("unhandled error in POST /generate")
            status, body = 500, jsonutil.dumps({"error": INTERNAL_ERROR})
        transport = self.owner.transport
        if self.done or transport is None or transport.is_closing():
            return
        transport.write(answer_bytes(status, body, close))
        self.stats.answered += 1
        del self.buf[:size]
        self.head, self.task = None, None
        if close:
            self.done = True
            transport.close()
            return
        self.owner.lane_idle()
        if self.read_paused and len(self.buf) <= PIPELINE_BUFFER:
            self.read_paused = False
            transport.resume_reading()
        if self.buf and not self.write_paused:
            self._advance()

    def _body_late(self) -> None:
        """The body did not arrive within ``http_body_timeout_s``: 408, and the connection is closed."""
        self.timer = None
        transport = self.owner.transport
        self.done = True
        if transport is not None and not transport.is_closing():
            transport.write(answer_bytes(408, self.on_body_timeout(), True))
            transport.close()

    def _hand_over(self) -> None:
        self.done = True
        self.stats.handed_over += 1
        self._cancel_timer()
        pending, self.buf = bytes(self.buf), bytearray()
        if self.read_paused:
            self.read_paused = False
            if self.owner.transport is not None:
                self.owner.transport.resume_reading()
        self.owner.hand_over(pending)

    def _pause_reading(self) -> None:
        if self.owner.transport is not None:
            self.read_paused = True
            self.owner.transport.pause_reading()

    def _cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
