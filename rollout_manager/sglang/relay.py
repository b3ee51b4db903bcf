"""A lean HTTP/1.1 client for the one call that is held for as long as a sequence runs: ``POST /generate``.

Why not aiohttp for it: thousands of sequences in flight each hold a call, and aiohttp's objects for
one (connection, protocol, parser, response, stream reader, timers) cost about 11 KB of Python memory
per stream. Here a call is one protocol object (:class:`Connection`), llhttp's parser (``httptools``)
and the loop's transport. Everything else (probes, admin calls) stays on aiohttp.

- **Keep-alive**: each instance has a bounded pool of idle connections, closed after
  :data:`IDLE_TIMEOUT_S`, shorter than uvicorn's 5 s keep-alive, so the manager does not pick a
  connection the server is closing. A reused connection that closes before any byte of an answer is
  retried once on a fresh one, as HTTP clients do. A connection goes back to the pool only after an
  answer read to its end that did not say ``Connection: close``.
- **One timeout mechanism**: each call's :class:`Deadline`, checked when due by the relay's one timer
  for every call in flight (:class:`.deadline.DeadlineClock`: not a loop timer per connection),
  which fails the call's waiter and closes the connection; nothing is injected into another reader.
- **The manager's own limits** (out of descriptors or memory, a connect timed out by a blocked loop)
  are waited out and retried (:class:`LocalLimits`), never blamed on the instance.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar, cast
from urllib.parse import urlsplit

import aiohttp
import httptools

from rollout_manager.sglang import wire
from rollout_manager.sglang.deadline import BoxBytes, Deadline, DeadlineClock
from rollout_manager.sglang.errors import EngineFailed
from rollout_manager.sglang.local_limits import LocalLimits, local_resource_error

IDLE_TIMEOUT_S = 2.0  # an idle connection is closed after this; uvicorn (SGLang) closes its own after 5 s
MAX_IDLE_PER_INSTANCE = 32  # idle connections kept per instance; more are closed
DRAIN_S = 1.0  # how long a connection waits for the end of an answer whose last frame was read already
READ_HIGH_WATER = 64 * 1024  # unread body bytes at which the connection stops reading from the socket
_NO_BODY: list[bytes] = []  # shared by every connection with nothing unread: never appended to
UNREAD_GRACE_S = 0.05  # how often an overdue deadline looks again while the reader has unread bytes
T = TypeVar("T")


@dataclass(frozen=True)
class CallBounds:
    """What one ``/generate`` call to an instance may take: the connect and stall timeouts, the first
    chunk's (None: ``stall_timeout_s``), the largest frame or answer (None: no bound), when the instance
    last sent any request a chunk (``activity``, loop time; see :class:`Deadline`), and the manager's
    own limits (see :mod:`.local_limits`)."""

    connect_timeout_s: float
    stall_timeout_s: float
    first_byte_timeout_s: float | None = None
    max_frame_bytes: int | None = None
    activity: Callable[[], float] | None = None
    limits: LocalLimits | None = None
    headers: dict[str, str] | None = None  # of the POST (None: JSON only); SGLangClient.generate_headers adds its key
    box_bytes: BoxBytes | None = None  # what the instance's calls hold together, and its bound (one per instance)


class _Stale(Exception):
    """A kept-alive connection closed before any byte of the answer: the server closed it while idle."""


class _Local(Exception):
    """The manager's own limit stopped the connect (nothing was sent)."""

    def __init__(self, error: OSError | str):
        self.error = error


_BUSY, _IDLE, _DRAINING, _CLOSED = range(4)
_Key = tuple[str, str, int]  # scheme, host, port


class Connection(asyncio.Protocol):
    """One HTTP/1.1 connection to an instance, serving one call at a time; its answer is read with
    :meth:`read`, and :meth:`release` hands it back (to the pool, or closed)."""

    __slots__ = ("relay", "key", "loop", "transport", "parser", "state", "reused", "deadline", "limits",
                 "waiter", "error", "body", "buffered", "paused", "status", "length", "keep", "complete", "got",
                 "timer", "armed", "connecting", "connect_started", "connect_s", "request")

    def __init__(self, relay: Relay, key: _Key, loop: asyncio.AbstractEventLoop):
        self.relay, self.key, self.loop = relay, key, loop
        self.transport: asyncio.Transport | None = None
        self.parser: httptools.HttpResponseParser | None = httptools.HttpResponseParser(self)
        self.state = _BUSY
        self.reused = False
        self.deadline: Deadline | None = None
        self.limits: LocalLimits | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.error: BaseException | None = None
        self.body: list[bytes] = _NO_BODY  # received, not read yet (a list only while there is some)
        self.buffered = 0
        self.paused = False
        self.status = 0  # of the answer, once its head is complete
        self.length: int | None = None  # its Content-Length; -1: chunked
        self.keep = False  # the answer allows the connection to be kept (HTTP/1.1, no Connection: close)
        self.complete = False  # the answer arrived to its end
        self.got = 0  # bytes received for this call
        self.timer: asyncio.TimerHandle | None = None  # an idle or draining connection's (not a call's)
        self.armed = 0  # the call's deadline entry in the relay's clock (0: none)
        self.connecting: asyncio.Task[object] | None = None
        self.connect_started = 0.0
        self.connect_s = 0.0
        self.request: bytes | None = None  # sent once connected (no closure per connect)

    # ------------------------------------------------------------------ the call
    async def exchange(self, request: bytes, deadline: Deadline, limits: LocalLimits, connect_s: float) -> None:
        """Send ``request`` (connecting first on a fresh connection) and wait for the answer's head."""
        self.deadline, self.limits = deadline, limits
        self.status, self.length, self.keep, self.complete, self.got, self.error = 0, None, False, False, 0, None
        if self.transport is None:
            self.connect_started, self.connect_s, self.request = self.loop.time(), connect_s, request
            key = self.key
            # The connection is its own protocol factory (__call__), and _connected a bound method: the
            # thousands of calls that connect at once leave no closures behind in the allocator's pools.
            self.connecting = self.loop.create_task(self.loop.create_connection(
                self, key[1], key[2], ssl=key[0] == "https" or None))
            self.connecting.add_done_callback(self._connected)
        elif self.transport.is_closing():
            raise _Stale()
        else:
            self.transport.write(request)
        del request
        self._arm()
        while not self.status:  # waited here, not in a coroutine of its own
            if self.error is None:
                waiter = self.waiter = self.loop.create_future()
                try:
                    await waiter
                finally:
                    self.waiter = None
            if self.error is not None:
                raise self.error

    def __call__(self) -> Connection:
        """The protocol factory of its own connect."""
        return self

    def _connected(self, task: asyncio.Task[object]) -> None:
        self.connecting, request, self.request = None, self.request, None
        if task.cancelled() or self.error is not None or self.state == _CLOSED:
            return
        exc = task.exception()
        if exc is None:
            assert self.transport is not None and request is not None
            self.transport.write(request)
            return
        local = local_resource_error(exc)
        if local is not None:
            self._fail(_Local(local))
        elif isinstance(exc, OSError):
            self._fail(EngineFailed(f"cannot connect to the instance ({type(exc).__name__}: {exc})"))
        else:
            self._fail(exc)

    async def read(self) -> bytes:
        """The next bytes of the answer's body, ``b""`` at its end; raises :class:`EngineFailed` when the
        call failed (after every byte that came before the failure was read)."""
        while (data := self.read_now()) is None:
            await self.readable()
        return data

    def read_now(self) -> bytes | None:
        """What :meth:`read` would return now; None when it would wait (then await :meth:`readable`).
        For a reader that holds the call for long: awaiting the future costs no coroutine frame."""
        body = self.body
        if body:
            data = body[0] if len(body) == 1 else b"".join(body)
            self.body = _NO_BODY
            self.buffered = 0
            if self.paused and self.transport is not None:
                self.paused = False
                self.transport.resume_reading()
            return data
        if self.complete:
            return b""
        if self.error is not None:
            raise self.error
        return None

    def readable(self) -> asyncio.Future[None]:
        """Done when :meth:`read_now` may have something new to say (bytes, the end, or a failure)."""
        waiter = self.waiter = self.loop.create_future()
        return waiter

    def release(self, finished: bool = False) -> None:
        """The call is over: keep the connection for the next call when its answer came to its end (or,
        ``finished``, only its end is missing: it waits :data:`DRAIN_S` for it), else close it."""
        if self.deadline is not None:
            self.deadline.hold(0)  # the reader holds nothing of this call any more
        self.deadline = None
        self._disarm()
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.state != _BUSY:
            return
        reusable = self.error is None and self.transport is not None and not self.transport.is_closing() \
            and not self.body and self.keep
        if reusable and self.complete:
            self.relay._park(self)
        elif reusable and finished:
            self.state = _DRAINING
            self.timer = self.loop.call_later(DRAIN_S, self.close)
        else:
            self.close()

    def close(self) -> None:
        if self.state == _IDLE:
            self.relay._drop(self)
        self.state = _CLOSED
        self._disarm()
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.connecting is not None:
            self.connecting.cancel()
        if self.transport is not None:
            self.transport.close()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def _fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        self._wake()

    # ------------------------------------------------------------------ the deadline, in the relay's clock
    def _arm(self, due: float | None = None) -> None:
        """Be looked at (:meth:`on_due`) at ``due``, by default when the call's deadline is due."""
        deadline = self.deadline
        if deadline is None:
            return
        if due is None:
            due = deadline.due()
            if self.connecting is not None:
                due = min(due, self.connect_started + self.connect_s)
        self._disarm()
        self.armed = self.relay.clock(self.loop).add(due, self)

    def _disarm(self) -> None:
        if self.armed:
            self.armed = 0
            self.relay.clock(self.loop).dropped()

    def on_due(self) -> None:
        deadline, limits = self.deadline, self.limits
        if self.state != _BUSY or self.error is not None or deadline is None or limits is None:
            return
        now = self.loop.time()
        if self.connecting is not None and now >= self.connect_started + self.connect_s:
            self.connecting.cancel()
            self.connecting = None
            if limits.timed_out_locally(self.connect_started, self.connect_s):
                self._fail(_Local(f"connect timed out while the manager's event loop was blocked "
                                  f"{limits.loop.blocked_s(self.connect_started):.1f}s (the manager is overloaded)"))
            else:
                self._fail(EngineFailed(f"cannot connect to the instance within {self.connect_s:g}s"))
            return
        if now < deadline.due():
            self._arm()
        elif self.body:  # bytes came that the reader has yet to see: the manager lags, not the instance
            self._arm(now + UNREAD_GRACE_S)
        else:
            self._fail(EngineFailed(deadline.describe()))
            self.close()

    # ------------------------------------------------------------------ asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's
        if self.state == _CLOSED:  # given up on while connecting
            transport.close()

    def data_received(self, data: bytes) -> None:
        if self.state == _IDLE:  # nothing is owed on an idle connection
            self.close()
            return
        self.got += len(data)
        if self.parser is None:
            return
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            if self.state == _BUSY:
                self._fail(EngineFailed(f"the instance sent a malformed HTTP answer ({type(exc).__name__}: {exc})"))
            self.close()

    def eof_received(self) -> bool | None:
        return None  # close; connection_lost says what it meant

    def connection_lost(self, exc: Exception | None) -> None:
        try:
            self._lost(exc)
        finally:  # the parser and this object refer to each other: freed now, not at a full collection
            self.parser = None
            self.transport = None

    def _lost(self, exc: Exception | None) -> None:
        if self.state == _IDLE:
            self.relay._drop(self)
        if self.state in (_IDLE, _DRAINING):
            self.state = _CLOSED
            if self.timer is not None:
                self.timer.cancel()
                self.timer = None
            return
        if self.status and self.length is None and self.error is None:  # a body that ends with the connection
            self.complete = True
        if self.complete or self.error is not None:
            self._wake()
            return
        raw = f"{type(exc).__name__}: {exc}" if exc is not None else f"closed after {self.got} byte(s) of its answer"
        if self.reused and self.got == 0:
            self._fail(_Stale())
        elif exc is not None and not self.status:
            self._fail(EngineFailed(f"connection to the instance failed ({raw})"))
        elif not self.status:
            self._fail(EngineFailed(f"the instance closed the connection without an answer (the engine died or "
                                    f"restarted; {raw})"))
        else:
            self._fail(EngineFailed(f"the instance's stream broke off mid-answer (the engine died or closed the "
                                    f"connection; {raw})"))

    # ------------------------------------------------------------------ llhttp's callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) == 14 and name.lower() == b"content-length":
            try:
                self.length = int(value)
            except ValueError:  # llhttp refuses it next
                pass
        elif len(name) == 17 and name.lower() == b"transfer-encoding":
            self.length = -1  # chunked (or refused by llhttp): not a body that ends with the connection

    def on_headers_complete(self) -> None:
        if self.parser is None:
            return
        code = self.parser.get_status_code()
        if 100 <= code < 200:  # an interim answer: the real one follows
            return
        self.status = code
        self.keep = self.parser.should_keep_alive()  # llhttp forgets it once the message is complete
        if self.deadline is not None:
            self.deadline.headers = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        if self.state != _BUSY:  # bytes after the last frame, beyond the end of the stream
            self.close()
            return
        if self.body is _NO_BODY:
            self.body = [body]
        else:
            self.body.append(body)
        self.buffered += len(body)
        if self.buffered >= READ_HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if not self.status:
            return
        self.complete = True
        if self.state == _DRAINING:
            if self.timer is not None:
                self.timer.cancel()
                self.timer = None
            self.state = _BUSY
            self.relay._park(self)
        else:
            self._wake()


class Relay:
    """The pools of kept-alive ``/generate`` connections, one per instance (``max_idle`` idle ones
    each at most; 0: none kept). :meth:`close` it with the manager's session."""

    def __init__(self, max_idle: int = MAX_IDLE_PER_INSTANCE, idle_timeout_s: float = IDLE_TIMEOUT_S):
        self.max_idle, self.idle_timeout_s = max_idle, idle_timeout_s
        self.idle: dict[_Key, list[Connection]] = {}
        self.closed = False
        self._keys: dict[str, tuple[_Key, bytes]] = {}
        self._clock: DeadlineClock | None = None

    def clock(self, loop: asyncio.AbstractEventLoop) -> DeadlineClock:
        """The one timer of the calls in flight on ``loop`` (a relay serves one loop at a time)."""
        clock = self._clock
        if clock is None or clock.loop is not loop:
            clock = self._clock = DeadlineClock(loop)
        return clock

    async def open(self, base_url: str, data: bytes, bounds: CallBounds,
                   then: Callable[[Connection, CallBounds], Awaitable[T]]) -> T:
        """POST ``data`` to ``base_url``'s ``/generate``; once the answer's status and headers came, what
        ``then`` makes of the connection (the connection is released if it raises). The caller reads the
        body and then releases the connection. ``then``, not a caller's coroutine awaiting this one: a
        frame less for each of the thousands of calls that may wait for their heads at once."""
        limits = bounds.limits or _DEFAULT_LIMITS
        limits.loop.ensure_started()
        key, start = self._key(base_url)
        first_s = bounds.stall_timeout_s if bounds.first_byte_timeout_s is None else bounds.first_byte_timeout_s
        deadline = Deadline(first_s, bounds.stall_timeout_s, bounds.activity, bounds.box_bytes)
        request = _request_head(start, bounds.headers, len(data)) + data
        del data  # orjson's output sits in a 4 KiB buffer whatever its length: not kept while connecting
        loop, attempt, fresh_only = deadline.loop, 0, False
        while True:
            conn = None if fresh_only else self._take(key)
            if conn is None:
                conn = Connection(self, key, loop)
            try:
                await conn.exchange(request, deadline, limits, bounds.connect_timeout_s)
                break
            except _Stale:
                fresh_only = True  # the server closed it while idle: once more, on a fresh connection
            except _Local as local:
                conn.close()
                if isinstance(local.error, OSError):  # out of descriptors: idle connections give theirs back
                    self.close_idle()
                await limits.wait_after(local.error, attempt)
                attempt += 1
                deadline.restart()
            except BaseException:
                conn.close()
                raise
            conn.close()
        del request
        try:
            return await then(conn, bounds)
        except BaseException:
            conn.release()
            raise

    def close(self) -> None:
        """Close every idle connection; those in use close when released."""
        self.closed = True
        self.close_idle()

    def close_idle(self) -> None:
        for conns in list(self.idle.values()):
            for conn in list(conns):
                conn.close()
        self.idle.clear()

    def _key(self, base_url: str) -> tuple[_Key, bytes]:
        """The pool's key for ``base_url`` and the request's first lines."""
        found = self._keys.get(base_url)
        if found is None:
            url = urlsplit(base_url)
            scheme = url.scheme or "http"
            port = url.port or (443 if scheme == "https" else 80)
            target = (url.path.rstrip("/") + wire.GENERATE).encode()  # under the base URL's own path, if any
            found = (scheme, url.hostname or "", port), b"POST " + target + b" HTTP/1.1\r\nHost: " + url.netloc.encode()
            if len(self._keys) > 4096:
                self._keys.clear()
            self._keys[base_url] = found
        return found

    def _take(self, key: _Key) -> Connection | None:
        conns = self.idle.get(key)
        while conns:
            conn = conns.pop()  # the most recently used: the least likely to be closing
            if not conns:
                del self.idle[key]
            if conn.timer is not None:
                conn.timer.cancel()
                conn.timer = None
            conn.state = _BUSY
            if conn.transport is not None and not conn.transport.is_closing():
                conn.reused = True
                return conn
            conn.close()
        return None

    def _park(self, conn: Connection) -> None:
        conns = self.idle.setdefault(conn.key, [])
        if self.closed or len(conns) >= self.max_idle:
            conn.close()
            return
        conn.state = _IDLE
        conns.append(conn)
        conn.timer = conn.loop.call_later(self.idle_timeout_s, conn.close)

    def _drop(self, conn: Connection) -> None:
        conns = self.idle.get(conn.key)
        if conns is not None and conn in conns:
            conns.remove(conn)
            if not conns:
                del self.idle[conn.key]


def _request_head(start: bytes, headers: dict[str, str] | None, length: int) -> bytes:
    lines = [start]
    for name, value in (headers or {"Content-Type": "application/json"}).items():
        lines.append(f"{name}: {value}".encode("latin-1"))
    lines.append(b"Content-Length: %d" % length)
    return b"\r\n".join(lines) + b"\r\n\r\n"


_DEFAULT_LIMITS = LocalLimits()
_ONE_SHOT = Relay(max_idle=0)  # for a session without a relay of its own: no connection is kept
_RELAYS: weakref.WeakKeyDictionary[aiohttp.ClientSession, Relay] = weakref.WeakKeyDictionary()


def attach(session: aiohttp.ClientSession, relay: Relay) -> None:
    """``/generate`` calls made with ``session`` go through ``relay`` (the manager's, with its pools)."""
    _RELAYS[session] = relay


def relay_for(session: aiohttp.ClientSession) -> Relay:
    """The relay attached to ``session``; without one, a relay that keeps no connection."""
    return _RELAYS.get(session, _ONE_SHOT)
