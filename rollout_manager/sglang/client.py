"""Outgoing HTTP calls to SGLang servers (real ones or the CPU engine), via the wire module."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp

from rollout_manager import jsonutil
from rollout_manager.sglang import wire
from rollout_manager.sglang.local_limits import LocalLimits, local_resource_error

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
    """One shared aiohttp session; every call has its own timeout."""

    def __init__(self, session: aiohttp.ClientSession, limits: LocalLimits | None = None):
        self.session = session
        self.limits = limits or LocalLimits()

    async def probe(self, base_url: str, path: str, timeout_s: float) -> Probe:
        self.limits.loop.ensure_started()
        started = asyncio.get_running_loop().time()
        try:
            async with self.session.get(
                base_url + path, timeout=aiohttp.ClientTimeout(total=timeout_s)
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
        """``GET /server_info``; raises :class:`ServerInfoError` when it cannot be read."""
        try:
            async with self.session.get(
                base_url + wire.SERVER_INFO, timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as resp:
                if resp.status != 200:
                    raise ServerInfoError(f"{wire.SERVER_INFO}: HTTP {resp.status}")
                return wire.ServerInfo.from_json(await resp.json(content_type=None))
        except asyncio.TimeoutError:
            raise ServerInfoError(f"{wire.SERVER_INFO} timed out after {timeout_s:g}s") from None
        except (aiohttp.ClientError, ValueError) as exc:
            raise ServerInfoError(f"{wire.SERVER_INFO}: {type(exc).__name__}: {exc}") from None

    async def post_json(self, base_url: str, path: str, body: Any, timeout_s: float) -> tuple[int, Any]:
        async with self.session.post(
            base_url + path, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)
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
    """The engine refused the request as malformed (4xx, or an error frame in the stream).

    This is the caller's error: returned as is, never retried, never held against the instance.
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
                         limits: LocalLimits) -> aiohttp.ClientResponse:
    """POST ``/generate``. When the manager itself cannot connect (its own descriptor or memory
    limits), nothing was sent: wait and try again, without blaming the instance."""
    attempt = 0
    loop = asyncio.get_running_loop()
    limits.loop.ensure_started()
    while True:
        started = loop.time()
        try:
            return await session.post(url, data=data, timeout=timeout, headers=JSON_HEADERS)
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


async def _raise_for_status(resp: aiohttp.ClientResponse) -> None:
    """A 4xx is the caller's (SGLang refused the request), a 5xx the instance's."""
    if resp.status < 400:
        return
    text = (await resp.text())[:2000]
    try:
        error: Any = jsonutil.loads(text)
    except ValueError:
        error = text
    if resp.status < 500:
        raise EngineRejected(resp.status, error)
    raise EngineFailed(f"HTTP {resp.status}: {text[:200]}")


@contextlib.asynccontextmanager
async def _generate_call(session: aiohttp.ClientSession, base_url: str, body: dict[str, Any], *,
                         connect_timeout_s: float, stall_timeout_s: float, limits: LocalLimits | None,
                         silence: str) -> AsyncIterator[aiohttp.ClientResponse]:
    """POST ``/generate`` and hand over the answer; whatever goes wrong, then or while the caller reads
    it, comes out as :class:`EngineRejected` (4xx) or :class:`EngineFailed` saying what happened
    (``silence``: how a read timeout is described)."""
    timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout_s, sock_read=stall_timeout_s)
    try:
        resp = await _post_generate(session, base_url + wire.GENERATE, jsonutil.dumps(body), timeout,
                                    limits or LocalLimits())
        async with resp:
            await _raise_for_status(resp)
            yield resp
    except aiohttp.ConnectionTimeoutError:
        raise EngineFailed(f"cannot connect to the instance within {connect_timeout_s:g}s") from None
    except asyncio.TimeoutError:
        raise EngineFailed(f"{silence} for {stall_timeout_s:g}s (stalled)") from None
    except (aiohttp.ClientError, OSError) as exc:
        raise EngineFailed(transport_failure(exc)) from None


async def stream_generate(
    session: aiohttp.ClientSession,
    base_url: str,
    body: dict[str, Any],
    *,
    connect_timeout_s: float,
    stall_timeout_s: float,
    limits: LocalLimits | None = None,
) -> AsyncIterator[dict[str, Any]]:
    """POST a streaming ``/generate`` and yield its chunks; a stream must end with ``[DONE]``.

    ``stall_timeout_s`` bounds the silence between two reads, not the whole request, so long
    generations are fine while a hung engine is detected. When the manager itself cannot connect
    (its own descriptor or memory limits), nothing was sent: the request waits and tries again,
    and the instance is not blamed.
    """
    decoder = wire.SSEDecoder(skip_seen=True)  # one sequence per stream: cumulative chunks parse their news only
    async with _generate_call(session, base_url, body, connect_timeout_s=connect_timeout_s,
                              stall_timeout_s=stall_timeout_s, limits=limits, silence="no data") as resp:
        async for data in resp.content.iter_any():
            try:
                chunks = decoder.feed(data)
            except wire.StreamError as exc:
                raise EngineRejected(400, exc.error) from None
            except ValueError as exc:
                raise EngineFailed(f"undecodable stream: {exc}") from None
            for chunk in chunks:
                yield chunk
            if decoder.done:
                return
    if not decoder.done:
        raise EngineFailed("stream ended without [DONE]")


async def generate_once(
    session: aiohttp.ClientSession,
    base_url: str,
    body: dict[str, Any],
    *,
    connect_timeout_s: float,
    stall_timeout_s: float,
    limits: LocalLimits | None = None,
) -> AsyncIterator[dict[str, Any]]:
    """POST a non-streaming ``/generate`` and yield its one answer, like a stream of one final chunk.

    For short sequences: one answer costs both ends far less than a stream, and what a failure loses
    (every token of the request) is no more than a stream at the manager's chunk interval loses.
    SGLang answers a request its scheduler refuses with the abort's status (400 ``{"error": ...}``),
    not with a 200 carrying the abort, so the caller's errors still come back as EngineRejected.
    ``stall_timeout_s`` bounds the whole wait for the answer.
    """
    async with _generate_call(session, base_url, body, connect_timeout_s=connect_timeout_s,
                              stall_timeout_s=stall_timeout_s, limits=limits, silence="no answer") as resp:
        raw = await resp.read()
    try:
        answer = jsonutil.loads(raw)
    except ValueError as exc:
        raise EngineFailed(f"undecodable answer: {exc}") from None
    if not isinstance(answer, dict) or not isinstance(answer.get("meta_info"), dict):
        raise EngineFailed(f"unexpected answer: {raw[:200]!r}")
    yield answer
