"""Outgoing HTTP calls to SGLang servers (real ones or the CPU engine), via the wire module."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Coroutine
from dataclasses import dataclass
from typing import Any

import aiohttp

from rollout_manager import jsonutil
from rollout_manager.sglang import logprob_probe, wire
from rollout_manager.sglang.auth import SGLangAuth
from rollout_manager.sglang.deadline import Deadline
from rollout_manager.sglang.errors import REFUSAL_STATUSES, EngineFailed, EngineRejected, refusal
from rollout_manager.sglang.generate_request import SequenceBody, encode
from rollout_manager.sglang.local_limits import LocalLimits, local_resource_error
from rollout_manager.sglang.relay import CallBounds, Connection, relay_for
from rollout_manager.sglang.sse import ChunkDecoder, StreamError
from rollout_manager.sglang.wire import GenerateChunk

__all__ = ["REFUSAL_STATUSES", "CallBounds", "ChunkStream", "Deadline", "EngineFailed", "EngineRejected", "Probe",
           "SGLangClient", "ServerInfoError", "generate_batch_once", "generate_once", "open_stream", "refusal",
           "stream_generate"]

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

    async def prefill_logprobs(self, base_url: str, ids: list[int], rid: str, timeout_s: float) -> list[float]:
        """The trust probe (:mod:`rollout_manager.sglang.logprob_probe`): the log-probs of ``ids`` on one box."""
        return await logprob_probe.prefill_logprobs(self.session, base_url, ids, rid, self.generate_headers, timeout_s)

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


ERROR_BODY_BYTES = 64 * 1024  # of an error answer, read for its message


async def _raise_for_status(conn: Connection) -> None:
    """See :func:`refusal`; the error body is read up to a bound, within the call's deadline."""
    if conn.status < 400:
        return
    raw = b""
    while len(raw) < ERROR_BODY_BYTES:
        piece = await conn.read()
        if not piece:
            break
        raw += piece
        if conn.deadline is not None:
            conn.deadline.hold(len(raw))
    text = raw[:ERROR_BODY_BYTES].decode(errors="replace")[:2000]
    try:
        error: Any = jsonutil.loads(text)
    except ValueError:
        error = text
    raise refusal(conn.status, error, text)


def _frame_error(exc: StreamError) -> EngineRejected | EngineFailed:
    """An error frame carries its own status (``code``); SGLang's are 400s."""
    code = exc.error.get("code") if isinstance(exc.error, dict) else None
    return refusal(code if isinstance(code, int) and not isinstance(code, bool) and code >= 400 else 400,
                   exc.error)


class ChunkStream:
    """One streaming ``/generate`` call, read a read at a time: :meth:`poll` gives the chunks each read
    completes, and :meth:`readable` what to await when there are none yet. No async generator and no
    coroutine of its own while it waits: a sequence holds its call for as long as it runs, and every
    frame it waits in (a generator's, its ``aclosing``, the loop's registry of generators) costs memory
    for that long. :meth:`next` is the plain coroutine, for callers that do not hold many streams."""

    __slots__ = ("conn", "decoder")

    def __init__(self, conn: Connection, decoder: ChunkDecoder) -> None:
        self.conn, self.decoder = conn, decoder

    async def next(self) -> list[GenerateChunk]:
        """The chunks of the next read that completes any (in order); ``[]`` once the stream ended with
        ``[DONE]``. Raises :class:`EngineFailed` (or :class:`EngineRejected` for an error frame)."""
        while (chunks := self.poll()) is None:
            await self.readable()
        return chunks

    def readable(self) -> asyncio.Future[None]:
        """Done when :meth:`poll` may have something new (await it, then poll again); while the call waits
        for room under its instance's bound (``Deadline.blocked``), when it may read on."""
        deadline = self.conn.deadline
        if deadline is not None and deadline.blocked and deadline.box is not None:
            return deadline.box.room(deadline)
        return self.conn.readable()

    def poll(self) -> list[GenerateChunk] | None:
        """What :meth:`next` returns, if the bytes read so far say it; None when it must wait."""
        decoder, conn = self.decoder, self.conn
        deadline = conn.deadline
        assert deadline is not None
        while not decoder.done:
            if deadline.blocked:
                return None
            data = conn.read_now()
            if data is None:
                return None
            if not data:
                raise EngineFailed("stream ended without [DONE]")
            try:
                chunks = decoder.feed(data)
            except StreamError as exc:
                raise _frame_error(exc) from None
            except ValueError as exc:
                raise EngineFailed(f"undecodable stream: {exc}") from None
            del data  # the bytes read do not stay while the next read waits
            deadline.hold(decoder.pending)
            if chunks or decoder.done:
                deadline.chunk(len(chunks))
            if chunks:
                return chunks
        return []

    def close(self) -> None:
        """The call is over (read to its end or not): the connection goes back to its pool or is closed."""
        self.conn.release(self.decoder.done)


def open_stream(
    session: aiohttp.ClientSession,
    base_url: str,
    body: SequenceBody,
    bounds: CallBounds,
) -> Coroutine[Any, Any, ChunkStream]:
    """POST a streaming ``/generate``; its chunks are read with :meth:`ChunkStream.next`, and the stream
    must be closed (:meth:`ChunkStream.close`). A stream must end with ``[DONE]``.

    Through the session's :class:`~.relay.Relay` (:func:`~.relay.relay_for`), under :class:`CallBounds`:
    the instance owes the first chunk within ``first_byte_timeout_s``, longer while ``activity`` (when
    it last sent any request a chunk) shows it serving others, and each next chunk within
    ``stall_timeout_s`` of the last: bytes that complete no frame are no progress, and one frame may not
    exceed ``max_frame_bytes`` (see :class:`~.deadline.Deadline`). Long generations are fine while a hung
    or babbling engine is cut off with bounded memory. When the manager itself cannot connect (its own
    descriptor or memory limits), nothing was sent: the request waits and tries again, and the
    instance is not blamed. The relay's own coroutine, to await (the body is encoded at once): no frame
    of this function's while thousands of calls wait for their heads.
    """
    return relay_for(session).open(base_url, encode(body), bounds, _stream_of)


async def _stream_of(conn: Connection, bounds: CallBounds) -> ChunkStream:
    await _raise_for_status(conn)
    # One sequence per stream: cumulative chunks parse their news only.
    return ChunkStream(conn, ChunkDecoder(max_frame=bounds.max_frame_bytes))


async def _checked(conn: Connection, _bounds: CallBounds) -> Connection:
    await _raise_for_status(conn)
    return conn


async def stream_generate(
    session: aiohttp.ClientSession,
    base_url: str,
    body: SequenceBody,
    bounds: CallBounds,
) -> AsyncGenerator[GenerateChunk, None]:
    """:func:`open_stream` as an async generator of its chunks (tools and tests)."""
    stream = await open_stream(session, base_url, body, bounds)
    try:
        while chunks := await stream.next():
            chunks.reverse()
            while chunks:  # neither the chunks handed over nor the bytes read stay while the next read waits
                yield chunks.pop()
    finally:
        stream.close()


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
    output per body, each for its own ``rid``, is the instance's failure. The whole answer is bounded as one
    frame is: its items are short by construction (:func:`.generate_request.joinable`), and a bound per item
    would let one babbling call hold that many frames' worth of memory. Only items that carry routed experts
    (rows for every position, prompt included) get a frame's room each.
    """
    frame = bounds.max_frame_bytes
    rows = bodies[0].routed_experts  # a join key: all of the batch's bodies ask for them or none does
    raw = await _answer(session, base_url, bodies, bounds, frame * len(bodies) if frame and rows else frame)
    answers = _decode(raw)
    chunks = [GenerateChunk.of(a) for a in answers] if isinstance(answers, list) else []
    if not (len(chunks) == len(bodies) and all(_is_output(a) for a in answers)
            and all(c.meta.rid == b.rid for c, b in zip(chunks, bodies))):
        raise EngineFailed(f"unexpected answer to a batch of {len(bodies)}: {raw[:200]!r}")
    return chunks


async def _answer(session: aiohttp.ClientSession, base_url: str, body: SequenceBody | list[SequenceBody],
                  bounds: CallBounds,
                  max_bytes: int | None) -> bytes:
    """The whole body of a non-streaming ``/generate`` answer, at most ``max_bytes``."""
    conn = await relay_for(session).open(base_url, encode(body), bounds, _checked)
    try:
        if max_bytes is not None and (conn.length or 0) > max_bytes:
            raise EngineFailed(f"an answer of {conn.length} bytes, over the bound of {max_bytes} "
                               f"(engine_max_frame_mb)")
        parts: list[bytes] = []
        size = 0
        while data := await conn.read():
            size += len(data)
            if max_bytes is not None and size > max_bytes:
                raise EngineFailed(f"an answer of over {max_bytes} bytes, the bound (engine_max_frame_mb)")
            parts.append(data)
            deadline = conn.deadline
            if deadline is not None:
                deadline.hold(size)
                if deadline.blocked and deadline.box is not None:
                    await deadline.box.room(deadline)
        return b"".join(parts)
    finally:
        conn.release()


def _decode(raw: bytes) -> Any:
    try:
        return jsonutil.loads(raw)
    except ValueError as exc:
        raise EngineFailed(f"undecodable answer: {exc}") from None


def _is_output(answer: Any) -> bool:
    return isinstance(answer, dict) and isinstance(answer.get("meta_info"), dict)
