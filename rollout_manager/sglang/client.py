"""Outgoing HTTP calls to SGLang servers (real ones or the CPU engine), via the wire module."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from rollout_manager import jsonutil
from rollout_manager.sglang import wire
from rollout_manager.sglang.auth import SGLangAuth
from rollout_manager.sglang.generate_request import SequenceBody, encode
from rollout_manager.sglang.local_limits import LocalLimits, local_resource_error
from rollout_manager.sglang.sse import ChunkDecoder, StreamError
from rollout_manager.sglang.wire import GenerateChunk

JSON_HEADERS = {"Content-Type": "application/json"}


@dataclass(frozen=True)
class Probe:
    """The outcome of one health probe."""

    status: int | None  # HTTP status, None when no answer came
    error: str | None = None
    local: bool = False  # the manager itself could not connect (out of descriptors, ...): says nothing

    @property
    def ready(self) -> bool:
        return self.status is not None and 200 <= self.status < 300

    @property
    def failed(self) -> bool:
        """Counts against the instance: no answer or a 5xx. A 4xx is the caller's fault, not the box's,
        and the manager's own limits are the manager's."""
        return not self.local and (self.status is None or self.status >= 500)

    def describe(self) -> str:
        return self.error or f"HTTP {self.status}"


class SGLangClient:
    """One shared aiohttp session; every call has its own timeout, and carries SGLang's key for its level
    (``auth``: the keys the servers run with; none by default)."""

    def __init__(self, session: aiohttp.ClientSession, limits: LocalLimits | None = None,
                 auth: SGLangAuth | None = None):
        self.session = session
        self.limits = limits or LocalLimits()
        self.auth = auth or SGLangAuth()
        self.generate_headers = {**JSON_HEADERS, **self.auth.headers()}  # for CallBounds.headers

    async def probe(self, base_url: str, path: str, timeout_s: float) -> Probe:
        self.limits.loop.ensure_started()
        started = asyncio.get_running_loop().time()
        try:
            async with self.session.get(
                base_url + path, headers=self.auth.headers(), timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as resp:
                await resp.read()
                return Probe(resp.status)
        except asyncio.TimeoutError:
            if self.limits.timed_out_locally(started, timeout_s):  # the manager's loop was blocked, not the box
                return Probe(None, f"{path} timed out while the manager's event loop was blocked "
                                   f"{self.limits.loop.blocked_s(started):.1f}s", local=True)
            return Probe(None, f"{path} timed out after {timeout_s:g}s")
        except (aiohttp.ClientError, OSError) as exc:
            local = local_resource_error(exc)
            if local is not None:
                return Probe(None, f"{path}: the manager could not connect: {local}", local=True)
            if not isinstance(exc, aiohttp.ClientError):
                raise
            return Probe(None, f"{path}: {type(exc).__name__}: {exc}")

    async def server_info(self, base_url: str, timeout_s: float) -> wire.ServerInfo:
        """``GET /server_info``, completed by ``GET /model_info`` where the server has it (the live
        weight version, and the vocabulary size where reported); raises :class:`ServerInfoError` when
        ``/server_info`` cannot be read. A missing or unreadable ``/model_info`` only leaves those unknown."""
        try:
            async with self.session.get(
                base_url + wire.SERVER_INFO, headers=self.auth.headers(), timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as resp:
                if resp.status != 200:
                    raise ServerInfoError(f"{wire.SERVER_INFO}: HTTP {resp.status}")
                info = wire.ServerInfo.from_json(await resp.json(content_type=None))
        except asyncio.TimeoutError:
            raise ServerInfoError(f"{wire.SERVER_INFO} timed out after {timeout_s:g}s") from None
        except (aiohttp.ClientError, ValueError) as exc:
            raise ServerInfoError(f"{wire.SERVER_INFO}: {type(exc).__name__}: {exc}") from None
        try:
            async with self.session.get(
                base_url + wire.MODEL_INFO, headers=self.auth.headers(), timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as resp:
                if resp.status == 200:
                    return info.with_model_info(await resp.json(content_type=None))
        except (asyncio.TimeoutError, aiohttp.ClientError, ValueError):
            pass
        return info

    async def post_json(self, base_url: str, path: str, body: Any, timeout_s: float) -> tuple[int, Any]:
        """POST to one of SGLang's admin-optional endpoints (abort, pause, ...), with its admin key."""
        async with self.session.post(
            base_url + path, json=body, headers=self.auth.admin_headers(),
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as resp:
            try:
                data = await resp.json(content_type=None)
            except ValueError:
                data = {"raw": (await resp.text())[:500]}
            return resp.status, data

    async def abort(self, base_url: str, rid: str, timeout_s: float = 5.0) -> bool:
        """Best effort: the instance may already be gone."""
        try:
            status, _ = await self.post_json(base_url, wire.ABORT_REQUEST, wire.abort_body(rid), timeout_s)
            return status < 300
        except (asyncio.TimeoutError, aiohttp.ClientError):
            return False


class ServerInfoError(Exception):
    """``/server_info`` could not be read (no answer, not 200, not JSON)."""


class EngineRejected(Exception):
    """The engine refused the request as malformed (400, 413 or 422, or an error frame in the stream).

    Most likely the caller's error, as SGLang says; generation asks one other instance to be sure.
    """

    def __init__(self, status: int, error: Any):
        self.status = status
        self.error = error
        super().__init__(f"HTTP {status}: {error}")


class EngineFailed(Exception):
    """The instance failed while serving (no answer, 5xx, reset, stall, stream cut short)."""


def transport_failure(exc: BaseException) -> str:
    """Say what happened to the instance in words. aiohttp's own text for a cut stream
    (``TransferEncodingError: 400, message='Not enough data...'``) reads like a client error, although
    the 400 is aiohttp's internal code and the engine most likely died mid-answer."""
    raw = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, aiohttp.ClientPayloadError):  # TransferEncodingError, ContentLengthError, ...
        return f"the instance's stream broke off mid-answer (the engine died or closed the connection; {raw})"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return f"the instance closed the connection without an answer (the engine died or restarted; {raw})"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return f"cannot connect to the instance ({raw})"
    if isinstance(exc, (aiohttp.ClientOSError, OSError)):
        return f"connection to the instance failed ({raw})"
    return raw


async def _post_generate(session: aiohttp.ClientSession, url: str, data: bytes, timeout: aiohttp.ClientTimeout,
                         limits: LocalLimits, retrying: Callable[[], None] | None = None,
                         headers: dict[str, str] | None = None) -> aiohttp.ClientResponse:
    """POST ``/generate``. When the manager itself cannot connect (its own descriptor or memory
    limits), nothing was sent: wait and try again (telling ``retrying``), without blaming the instance."""
    attempt = 0
    loop = asyncio.get_running_loop()
    limits.loop.ensure_started()
    while True:
        started = loop.time()
        try:
            return await session.post(url, data=data, timeout=timeout, headers=headers or JSON_HEADERS)
        except (aiohttp.ClientError, OSError) as exc:
            local: OSError | str | None = local_resource_error(exc)
            if (local is None and isinstance(exc, aiohttp.ConnectionTimeoutError) and timeout.connect
                    and limits.timed_out_locally(started, timeout.connect)):
                local = f"connect timed out while the manager's event loop was blocked " \
                        f"{limits.loop.blocked_s(started):.1f}s (the manager is overloaded)"
            if local is None:
                raise
            await limits.wait_after(local, attempt)
            attempt += 1
            if retrying is not None:
                retrying()


# The statuses with which SGLang refuses a request it finds malformed (FastAPI's 422 included); any other
# 4xx on /generate (404 or 405: not SGLang's /generate at that address; 401, 403: credentials the
# manager was never given; 429: a proxy's limit) says nothing about the caller's body.
REFUSAL_STATUSES = frozenset({400, 413, 422})
ERROR_BODY_BYTES = 64 * 1024  # of an error answer, read for its message


def refusal(status: int, error: Any, text: str | None = None) -> EngineRejected | EngineFailed:
    """What an error status (of the answer, or of an error frame) from ``/generate`` means; ``text``:
    the error as received, for the message."""
    if status in REFUSAL_STATUSES:
        return EngineRejected(status, error)
    if text is None:
        text = error if isinstance(error, str) else jsonutil.dumps(error).decode(errors="replace")
    if 400 <= status < 500:
        return EngineFailed(f"HTTP {status} on {wire.GENERATE}, which no valid request gets from SGLang "
                            f"(not the caller's error): {text[:200]}")
    return EngineFailed(f"HTTP {status}: {text[:200]}")


async def _raise_for_status(resp: aiohttp.ClientResponse, deadline: _Deadline) -> None:
    """See :func:`refusal`; the error body is read up to a bound, within the deadline."""
    if resp.status < 400:
        return
    raw = b""
    while len(raw) < ERROR_BODY_BYTES:
        piece = await resp.content.read(ERROR_BODY_BYTES - len(raw))
        if not piece:
            break
        raw += piece
        deadline.taken = len(raw)
    text = raw.decode(errors="replace")[:2000]
    try:
        error: Any = jsonutil.loads(text)
    except ValueError:
        error = text
    raise refusal(resp.status, error, text)


def _frame_error(exc: StreamError) -> EngineRejected | EngineFailed:
    """An error frame carries its own status (``code``); SGLang's are 400s."""
    code = exc.error.get("code") if isinstance(exc.error, dict) else None
    return refusal(code if isinstance(code, int) and not isinstance(code, bool) and code >= 400 else 400,
                   exc.error)


UNREAD_GRACE_S = 0.05  # how often an overdue deadline looks again while the reader has unread bytes


class _Overdue(Exception):
    """Set on a response's stream by :class:`_Deadline` when the instance owes a chunk for too long."""


class _Deadline:
    """When the instance owes this request its next complete chunk, and what to say when it is late.

    Before the first chunk: ``first_s`` after the request, or after the instance last sent a chunk to
    any request (``activity``, loop time) when that is later, for an instance that serves others is
    alive and this request waits in its queue; never later than ``stall_s`` after the request. After
    a chunk: ``stall_s`` after the last one. Bytes that complete no frame do not count, so an engine
    that trickles bytes is cut off like a silent one. One timer per request; a chunk only records its
    time, and the timer re-arms itself when it finds the deadline moved.
    """

    def __init__(self, first_s: float, stall_s: float, activity: Callable[[], float] | None):
        self.loop = asyncio.get_running_loop()
        self.started = self.loop.time()
        self.first_s, self.stall_s = min(first_s, stall_s), stall_s
        self.activity = activity
        self.last: float | None = None  # when the last chunk came
        self.chunks = 0
        self.headers = False  # the status line and headers came
        self.pending: Callable[[], int] = lambda: 0  # bytes of an unfinished frame held now
        self.taken = 0  # bytes the reader took from the stream so far
        self._handle: asyncio.TimerHandle | None = None
        self._waiting: asyncio.Task[Any] | None = None
        self.expired = False  # the wait for the headers was cancelled for being overdue
        self._stream: aiohttp.StreamReader | None = None

    def chunk(self, n: int = 1) -> None:
        """``n`` complete chunks came."""
        self.last = self.loop.time()
        self.chunks += n

    def due(self) -> float:
        if self.last is not None:
            return self.last + self.stall_s
        since = self.started
        if self.activity is not None:
            since = max(since, self.activity())
        return min(since + self.first_s, self.started + self.stall_s)

    def overdue(self) -> bool:
        return self.loop.time() >= self.due()

    def describe(self) -> str:
        """What happened, in measured times, with the bound that ended it."""
        now = self.loop.time()
        pending = self.pending()
        partial = f"; {pending} byte(s) of an unfinished frame came meanwhile" if pending else ""
        if self.last is not None:
            return (f"no complete chunk for {now - self.last:.1f}s after {self.chunks} chunk(s) "
                    f"(stream_stall_timeout_s={self.stall_s:g}){partial}")
        waited = now - self.started
        what = "no first chunk" if self.headers else "no answer at all (not even the HTTP status)"
        busy = self.activity() if self.activity is not None else self.started
        if busy + self.first_s > self.started + self.stall_s:  # the instance served others: queueing, up to stall_s
            return (f"{what} after {waited:.1f}s, while the instance kept sending chunks to other requests "
                    f"(stream_stall_timeout_s={self.stall_s:g}){partial}")
        silent = now - max(busy, self.started)
        return (f"{what} after {waited:.1f}s, and nothing from the instance to any request for {silent:.1f}s "
                f"(engine_first_byte_timeout_s={self.first_s:g}){partial}")

    def restart(self) -> None:
        """Nothing was sent yet (the manager waited on its own limits): the instance owes nothing so far."""
        self.started = self.loop.time()

    def start(self) -> None:
        """Arm the timer; until :meth:`watch`, an overdue answer cancels the waiting task (which then
        finds ``expired`` set: see :func:`_generate_call`)."""
        self._waiting = asyncio.current_task()
        self._arm()

    def watch(self, stream: aiohttp.StreamReader) -> None:
        """From now on, fail reads of ``stream`` with :class:`_Overdue` once the deadline passes."""
        self.headers, self._waiting, self._stream = True, None, stream

    def _arm(self) -> None:
        self._handle = self.loop.call_at(self.due(), self._check)

    def _check(self) -> None:
        if not self.overdue():
            self._arm()
        elif self._stream is not None:
            if self._stream.total_bytes > self.taken:  # bytes came that the reader has yet to see: the
                self._handle = self.loop.call_later(UNREAD_GRACE_S, self._check)  # manager lags, not the instance
                return
            self._stream.set_exception(_Overdue(self.describe()))
        elif self._waiting is not None:
            self.expired = True
            self._waiting.cancel()

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()


@dataclass(frozen=True)
class CallBounds:
    """What one ``/generate`` call to an instance may take: the connect and stall timeouts, the first
    chunk's (None: ``stall_timeout_s``), the largest frame or answer (None: no bound), when the instance
    last sent any request a chunk (``activity``, loop time; see :class:`_Deadline`), and the manager's
    own limits (see :func:`_post_generate`)."""

    connect_timeout_s: float
    stall_timeout_s: float
    first_byte_timeout_s: float | None = None
    max_frame_bytes: int | None = None
    activity: Callable[[], float] | None = None
    limits: LocalLimits | None = None
    headers: dict[str, str] | None = None  # of the POST (None: JSON only); SGLangClient.generate_headers adds its key


@contextlib.asynccontextmanager
async def _generate_call(session: aiohttp.ClientSession, base_url: str, body: SequenceBody | list[SequenceBody],
                         bounds: CallBounds) -> AsyncIterator[tuple[aiohttp.ClientResponse, _Deadline]]:
    """POST ``/generate`` and hand over the answer with its :class:`_Deadline`, already watching the
    body; whatever goes wrong, then or while the caller reads it, comes out as :class:`EngineRejected`
    or :class:`EngineFailed` saying what happened."""
    connect_timeout_s, stall_timeout_s = bounds.connect_timeout_s, bounds.stall_timeout_s
    # aiohttp's own read timeout stays as a backstop (it only sees silence, not progress).
    timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout_s, sock_read=stall_timeout_s)
    first_s = stall_timeout_s if bounds.first_byte_timeout_s is None else bounds.first_byte_timeout_s
    deadline = _Deadline(first_s, stall_timeout_s, bounds.activity)
    try:
        deadline.start()
        try:
            resp = await _post_generate(session, base_url + wire.GENERATE, encode(body), timeout,
                                        bounds.limits or LocalLimits(), deadline.restart, bounds.headers)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not deadline.expired or (task is not None and hasattr(task, "uncancel") and task.uncancel() > 0):
                raise  # not (only) the deadline's doing
            raise EngineFailed(deadline.describe()) from None
        async with resp:
            deadline.watch(resp.content)
            await _raise_for_status(resp, deadline)
            yield resp, deadline
    except _Overdue as exc:
        raise EngineFailed(str(exc)) from None
    except aiohttp.ConnectionTimeoutError:
        raise EngineFailed(f"cannot connect to the instance within {connect_timeout_s:g}s") from None
    except asyncio.TimeoutError:
        raise EngineFailed(f"no data for {deadline.loop.time() - (deadline.last or deadline.started):.1f}s "
                           f"(stalled; stream_stall_timeout_s={stall_timeout_s:g})") from None
    except (aiohttp.ClientError, OSError) as exc:
        raise EngineFailed(transport_failure(exc)) from None
    finally:
        deadline.close()


async def stream_generate(
    session: aiohttp.ClientSession,
    base_url: str,
    body: SequenceBody,
    bounds: CallBounds,
) -> AsyncGenerator[GenerateChunk, None]:
    """POST a streaming ``/generate`` and yield its chunks; a stream must end with ``[DONE]``.

    Under :class:`CallBounds`: the instance owes the first chunk within ``first_byte_timeout_s``, longer
    while ``activity`` (when it last sent any request a chunk) shows it serving others, and each next
    chunk within ``stall_timeout_s`` of the last: bytes that complete no frame are no progress, and one
    frame may not exceed ``max_frame_bytes`` (see :class:`_Deadline`). Long generations are fine while
    a hung or babbling engine is cut off with bounded memory. When the manager itself cannot connect
    (its own descriptor or memory limits), nothing was sent: the request waits and tries again, and
    the instance is not blamed.
    """
    # One sequence per stream: cumulative chunks parse their news only.
    decoder = ChunkDecoder(max_frame=bounds.max_frame_bytes)
    async with _generate_call(session, base_url, body, bounds) as (resp, deadline):
        deadline.pending = lambda: decoder.pending
        async for data in resp.content.iter_any():
            deadline.taken += len(data)
            try:
                chunks = decoder.feed(data)
            except StreamError as exc:
                raise _frame_error(exc) from None
            except ValueError as exc:
                raise EngineFailed(f"undecodable stream: {exc}") from None
            del data  # neither the bytes read nor the chunks parsed stay while the next read waits
            if chunks or decoder.done:
                deadline.chunk(len(chunks))
            chunks.reverse()
            while chunks:
                yield chunks.pop()
            if decoder.done:
                return
    if not decoder.done:
        raise EngineFailed("stream ended without [DONE]")


async def generate_once(
    session: aiohttp.ClientSession,
    base_url: str,
    body: SequenceBody,
    bounds: CallBounds,
) -> GenerateChunk:
    """POST a non-streaming ``/generate`` and return its one answer (what a stream's final chunk holds).

    For short sequences: one answer costs both ends far less than a stream, and what a failure loses
    (every token of the request) is no more than a stream at the manager's chunk interval loses.
    SGLang answers a request its scheduler refuses with the abort's status (400 ``{"error": ...}``),
    not with a 200 carrying the abort, so the caller's errors still come back as EngineRejected.
    The answer is due as a stream's first chunk is (see :func:`stream_generate`), and may not be
    larger than ``max_frame_bytes``.
    """
    raw = await _answer(session, base_url, body, bounds, bounds.max_frame_bytes)
    answer = _decode(raw)
    if not _is_output(answer):
        raise EngineFailed(f"unexpected answer: {raw[:200]!r}")
    return GenerateChunk.of(answer)


async def generate_batch_once(
    session: aiohttp.ClientSession,
    base_url: str,
    bodies: list[SequenceBody],
    bounds: CallBounds,
) -> list[GenerateChunk]:
    """Several single-sequence, non-streaming bodies as one SGLang batch (:func:`.generate_request.encode`);
    returns each body's answer, in order, as :func:`generate_once` would.

    SGLang answers a batch with one list once every item is done, and refuses the whole batch when one
    item is refused, so an :class:`EngineRejected` here names no item. An answer that is not one
    output per body, each for its own ``rid``, is the instance's failure.
    """
    frame = bounds.max_frame_bytes
    raw = await _answer(session, base_url, bodies, bounds,
                        None if frame is None else frame * len(bodies))
    answers = _decode(raw)
    if not (isinstance(answers, list) and len(answers) == len(bodies)
            and all(_is_output(a) and a["meta_info"].get("id") == b.rid for a, b in zip(answers, bodies))):
        raise EngineFailed(f"unexpected answer to a batch of {len(bodies)}: {raw[:200]!r}")
    return [GenerateChunk.of(a) for a in answers]


async def _answer(session: aiohttp.ClientSession, base_url: str, body: SequenceBody | list[SequenceBody],
                  bounds: CallBounds,
                  max_bytes: int | None) -> bytes:
    """The whole body of a non-streaming ``/generate`` answer, at most ``max_bytes``."""
    async with _generate_call(session, base_url, body, bounds) as (resp, deadline):
        if max_bytes is not None and (resp.content_length or 0) > max_bytes:
            raise EngineFailed(f"an answer of {resp.content_length} bytes, over the bound of {max_bytes} "
                               f"(engine_max_frame_mb)")
        parts: list[bytes] = []
        size = 0
        deadline.pending = lambda: size
        async for data in resp.content.iter_any():
            size += len(data)
            deadline.taken = size
            if max_bytes is not None and size > max_bytes:
                raise EngineFailed(f"an answer of over {max_bytes} bytes, the bound (engine_max_frame_mb)")
            parts.append(data)
        return b"".join(parts)


def _decode(raw: bytes) -> Any:
    try:
        return jsonutil.loads(raw)
    except ValueError as exc:
        raise EngineFailed(f"undecodable answer: {exc}") from None


def _is_output(answer: Any) -> bool:
    return isinstance(answer, dict) and isinstance(answer.get("meta_info"), dict)
