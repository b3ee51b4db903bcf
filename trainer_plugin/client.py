"""Async HTTP client for the rollout manager's API, as the trainer uses it.

- Every call has a timeout: ``connect_timeout_s`` to open the connection and ``timeout_s`` for a
  whole control call; generation calls have no total limit (a long sequence may take minutes) but
  an optional ``read_timeout_s`` of silence.
- Only *connection* failures are retried (the manager is not up yet, or restarting): an answer with
  a 4xx or 5xx status is the manager's verdict and is raised at once as :class:`ManagerHTTPError`.
  Once a request may have reached the manager (the connection broke mid-answer) it is not resent,
  except for ``GET`` calls, which change nothing.
- ``/batch_generate_requests`` is streamed: :meth:`ManagerClient.batch_generate` yields one dict per
  NDJSON line as the manager finishes each request. Leaving the loop early closes the connection,
  which makes the manager abort what is still running.

A manager restart costs only the tokens in flight (``restart_timeout_s`` > 0, the default):

- **Broken stream** (the manager was killed or restarted, or dropped the connection): the manager
  aborts a batch whose connection is gone (``handler_cancellation``), so nothing of it still runs
  there. The client waits, up to ``restart_timeout_s``, for ``/health`` to answer at the same URL,
  then sends exactly the ids not answered yet, in a new batch; the ids stay the same and unique, and
  a line for an id already delivered is dropped (counted in ``stats.duplicates_dropped``).
- **Graceful restart**: lines failed with 503 "rollout manager is shutting down" are not final; they
  are sent again once a manager with a *different* ``run_id`` answers.
- **Quiet stream**: a batch stream is legitimately silent while long sequences run, so silence alone
  proves nothing. After ``stall_timeout_s`` without a line the client probes ``/health`` (on its own
  small connection pool, so busy streams cannot starve the probe):

  - same ``run_id`` (the stream's manager, named by the ``X-Rollout-Manager-Run-Id`` header) ->
    still working: keep waiting, silently;
  - a different ``run_id`` -> restarted: the stream's work is gone; resubmit as above;
  - no answer -> a **stall** (frozen, overloaded or unreachable manager): logged as a warning and
    counted in ``stats.stalls``, and the stream is *kept open*. A frozen manager that resumes
    (SIGSTOP/SIGCONT, a long GC or swap pause) still holds the batch and carries on, so nothing is
    run twice; closing and resubmitting would make it abort and regenerate everything in flight.
    If neither the stream nor ``/health`` shows a sign of life for ``restart_timeout_s``, the batch
    fails with :class:`ManagerLost`.

Bounded: each outage waits at most ``restart_timeout_s``, and ``max_resubmits`` resubmissions in a
row that deliver nothing (a manager that crashes on every attempt) end the batch. The final error,
:class:`ManagerLost` (a :class:`ManagerUnavailable`), lists the unfinished ids. ``restart_timeout_s=0``
keeps the old behaviour: the first broken stream raises :class:`ManagerUnavailable`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from rollout_manager.manager_client import (
    HEALTH,
    RUN_ID_HEADER,
    ManagerAPIError,
    ManagerHealth,
    bearer_headers,
    decode,
    env_token,
    error_message,
)
from rollout_manager.manager_client import base_url as base_url_of
from rollout_manager.retry import Backoff, retry_async

log = logging.getLogger("trainer_plugin.client")

__all__ = ["RUN_ID_HEADER", "ClientStats", "ManagerClient", "ManagerClientError", "ManagerHTTPError",
           "ManagerLost", "ManagerRestarted", "ManagerUnavailable"]
# What the manager's failure lines say when it stops mid-batch: not the request's fault.
_SHUTDOWN_TEXT = "rollout manager is shutting down"
# One NDJSON result line: SGLang's answer with log-probs runs to tens of bytes a token (aiohttp's own
# default, 128 KiB, fails a 4k-token answer with log-probs).
MAX_LINE_BYTES = 256 * 1024 * 1024

# Connection problems that mean "the request never reached the manager": always safe to retry.
_CONNECT_ERRORS: tuple[type[BaseException], ...] = (aiohttp.ClientConnectorError,)
# Problems after the request may have been sent: retried only for GET.
_TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (
    aiohttp.ServerDisconnectedError,
    aiohttp.ClientOSError,
    aiohttp.ClientPayloadError,
)


class ManagerClientError(ManagerAPIError, RuntimeError):
    """Base class of everything this client raises (the manager API's one error type,
    :class:`rollout_manager.manager_client.ManagerAPIError`)."""


class ManagerUnavailable(ManagerClientError):
    """The manager could not be reached (after the retries), or the connection broke mid-call."""


class ManagerRestarted(ManagerUnavailable):
    """The manager that ran a stream is gone: another run of it answers at the same URL."""

    def __init__(self, message: str, old_run_id: str | None, new_run_id: str | None):
        super().__init__(message)
        self.old_run_id = old_run_id
        self.new_run_id = new_run_id


class ManagerLost(ManagerUnavailable):
    """The manager did not come back in time: ``unfinished`` are the ids of the batch never answered."""

    def __init__(self, message: str, unfinished: list[Any], delivered: int):
        super().__init__(message)
        self.unfinished = unfinished
        self.delivered = delivered


@dataclass
class ClientStats:
    """What the client did to survive manager outages (cumulative over its batches)."""

    interruptions: int = 0  # batch streams lost: broken, ended early, restarted or shut-down manager
    resubmitted: int = 0  # requests sent again after an interruption
    stalls: int = 0  # silent streams during which /health did not answer either
    restarts_seen: int = 0  # a different run_id answered than the one that ran the stream
    duplicates_dropped: int = 0  # lines for ids already delivered
    outage_s: float = 0.0  # time spent waiting for the manager to come back


class _StallTimeout(ManagerUnavailable):
    """A stream's manager showed no sign of life for ``restart_timeout_s``."""


class _Attempt:
    """One stream of a batch: which run serves it and whether that run said it is shutting down."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.run_id: str | None = None
        self.received = 0
        self.shutting_down = False


class ManagerHTTPError(ManagerClientError):
    """The manager answered with an error status; ``message`` is its ``{"error": ...}`` text."""

    status: int

    def __init__(self, method: str, path: str, status: int, message: str, body: Any = None):
        super().__init__(f"{method} {path} -> HTTP {status}: {message}", status=status, message=message, body=body)
        self.method = method
        self.path = path


class ManagerClient:
    """One manager, one ``aiohttp`` session (created lazily inside the running event loop).

    Use as ``async with ManagerClient("http://127.0.0.1:5000") as client: ...`` or call
    :meth:`close` yourself.
    """

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 30.0,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float | None = None,
        retries: int = 3,
        retry_backoff_s: float = 0.5,
        max_connections: int = 256,
        auth_token: str | None = None,
        stall_timeout_s: float | None = 10.0,
        restart_timeout_s: float = 120.0,
        probe_timeout_s: float = 5.0,
        max_resubmits: int = 5,
    ):
        """``auth_token``: sent as ``Authorization: Bearer``; default ``$ROLLOUT_MANAGER_AUTH_TOKEN``.

        ``stall_timeout_s``: silence on a generation stream before ``/health`` is probed (None or 0:
        never); ``restart_timeout_s``: how long a batch waits for a manager that is down or frozen
        (0: no resubmission); ``probe_timeout_s``: a ``/health`` probe slower than this counts as no
        answer; ``max_resubmits``: resubmissions in a row that deliver nothing before giving up.
        """
        if restart_timeout_s < 0 or probe_timeout_s <= 0 or max_resubmits < 0:
            raise ValueError(f"restart_timeout_s and max_resubmits must be >= 0 and probe_timeout_s > 0, got "
                             f"{restart_timeout_s}, {max_resubmits}, {probe_timeout_s}")
        self.auth_token = auth_token if auth_token is not None else env_token()
        self.base_url = base_url_of(base_url)
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.retries = retries
        self.retry_backoff_s = retry_backoff_s
        self.max_connections = max_connections
        self.stall_timeout_s = stall_timeout_s or None
        self.restart_timeout_s = restart_timeout_s
        self.probe_timeout_s = probe_timeout_s
        self.max_resubmits = max_resubmits
        self.stats = ClientStats()
        self._session: aiohttp.ClientSession | None = None
        self._probe_session: aiohttp.ClientSession | None = None

    # ------------------------------------------------------------ session
    async def __aenter__(self) -> ManagerClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        for session in (self._session, self._probe_session):
            if session is not None and not session.closed:
                await session.close()
        self._session = self._probe_session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # no total timeout on the session: each call passes its own
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.max_connections),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s),
                headers=bearer_headers(self.auth_token) or None,
            )
        return self._session

    def _timeout(self, total: float | None) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=total, connect=None, sock_connect=self.connect_timeout_s,
                                     sock_read=self.read_timeout_s if total is None else None)

    # ------------------------------------------------------------ core
    async def _open(self, method: str, path: str, body: Any, total: float | None) -> aiohttp.ClientResponse:
        """Send a request, retrying connection failures; return the response with a 2xx status."""
        url = self.base_url + path
        retryable = _CONNECT_ERRORS + (_TRANSPORT_ERRORS if method == "GET" else ())
        kwargs: dict[str, Any] = {"timeout": self._timeout(total)}
        if body is not None:
            kwargs["json"] = body

        def retrying(attempt: int, delay: float, exc: object) -> None:
            log.warning("%s %s: %s; retrying in %.2fs (%d/%d)", method, url, exc, delay, attempt, self.retries)

        try:
            resp = await retry_async(lambda: self.session.request(method, url, **kwargs),
                                     Backoff(self.retry_backoff_s, float("inf"), attempts=self.retries + 1),
                                     retry_on=retryable, on_retry=retrying)
        except retryable as exc:
            raise ManagerUnavailable(
                f"{method} {url}: rollout manager not reachable after {self.retries + 1} attempt(s): {exc}"
            ) from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise ManagerUnavailable(f"{method} {url}: connection failed: {exc}") from exc
        except asyncio.TimeoutError as exc:
            raise ManagerUnavailable(f"{method} {url}: timed out") from exc
        if resp.status >= 400:
            try:
                raw = await resp.read()
            finally:
                resp.release()
            raise _http_error(method, path, resp.status, raw)
        return resp

    async def _call(self, method: str, path: str, body: Any = None, *, total: float | None = -1.0) -> Any:
        """One request, one JSON answer."""
        total = self.timeout_s if total == -1.0 else total
        resp = await self._open(method, path, body, total)
        try:
            return await resp.json(content_type=None)
        except (aiohttp.ClientError, OSError) as exc:
            if method == "GET":  # one more go for a read-only call whose answer broke off
                return await self._retry_get(path, total, exc)
            raise ManagerUnavailable(f"{method} {path}: connection broke while reading the answer: {exc}") from exc
        except asyncio.TimeoutError as exc:
            raise ManagerUnavailable(f"{method} {path}: timed out reading the answer") from exc
        except json.JSONDecodeError as exc:
            raise ManagerClientError(f"{method} {path}: answer is not JSON: {exc}") from exc
        finally:
            resp.release()

    async def _retry_get(self, path: str, total: float | None, first: BaseException) -> Any:
        resp = await self._open("GET", path, None, total)
        try:
            return await resp.json(content_type=None)
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            raise ManagerUnavailable(f"GET {path}: answer broke off twice ({first}; {exc})") from exc
        finally:
            resp.release()

    # ------------------------------------------------------------ endpoints
    async def health(self) -> dict[str, Any]:
        """``GET /health``: ``{"status", "version", "weight_version", "instances": {state: n}}``."""
        return await self._call("GET", HEALTH)

    async def get_instances_status(self) -> dict[str, Any]:
        return await self._call("GET", "/get_instances_status")

    async def register_local_rollout_instances(self, endpoints: Sequence[tuple[str, int]]) -> dict[str, Any]:
        return await self._call("POST", "/register_local_rollout_instances", [[h, p] for h, p in endpoints])

    async def update_weight_senders(self, weight_sender_ips: list[list[str]], *,
                                    num_mooncake_groups_per_sender: int | None = None,
                                    num_mooncake_engines_per_group: int | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"weight_sender_ips": weight_sender_ips}
        if num_mooncake_groups_per_sender is not None:
            body["num_mooncake_groups_per_sender"] = num_mooncake_groups_per_sender
        if num_mooncake_engines_per_group is not None:
            body["num_mooncake_engines_per_group"] = num_mooncake_engines_per_group
        return await self._call("PUT", "/update_weight_senders", body)

    async def generate(self, body: dict[str, Any]) -> Any:
        """``POST /generate`` (non-streaming): SGLang's final answer, with the manager's ``segments``.

        A connection that breaks (the manager died or restarted, which aborts the request there) is
        sent again once the manager answers ``/health``, within ``restart_timeout_s``.
        """
        tries = 0
        while True:
            try:
                return await self._call("POST", "/generate", {**body, "stream": False}, total=None)
            except ManagerLost:
                raise
            except ManagerUnavailable as exc:
                tries += 1
                if self.restart_timeout_s <= 0 or tries > self.max_resubmits:
                    raise
                self.stats.interruptions += 1
                started = time.monotonic()
                log.warning("POST /generate: %s; sending it again when the manager at %s answers (up to %gs)",
                            exc, self.base_url, self.restart_timeout_s)
                health = await self._wait_for_manager(started + self.restart_timeout_s, None)
                self.stats.outage_s += time.monotonic() - started
                if health is None:
                    raise ManagerLost(f"POST /generate: rollout manager at {self.base_url} did not come back "
                                      f"within {self.restart_timeout_s:g}s after: {exc}; the request "
                                      f"(rid {body.get('rid')!r}) is lost", [body.get("rid")], 0) from exc
                self.stats.resubmitted += 1

    async def batch_generate(self, items: Iterable[tuple[Any, dict[str, Any]]]) -> AsyncGenerator[dict[str, Any], None]:
        """``POST /batch_generate_requests``: yield each NDJSON line (one per request, completion order).

        Each line is ``{"id", "success": true, "data": <SGLang answer>}`` or
        ``{"id", "success": false, "status_code", "error"}``, each id exactly once. A lost stream is
        resumed with the unanswered ids (see the module doc); when the manager does not come back in
        time this raises :class:`ManagerLost` naming them. With ``restart_timeout_s=0`` a broken
        stream raises :class:`ManagerUnavailable` at once, as before.
        """
        listed = list(items)
        if self.restart_timeout_s <= 0:
            async for line in self._stream_once(listed, _Attempt(len(listed))):
                yield line
            return
        pending = {_id_key(rid): (rid, req) for rid, req in listed}
        sent = set(pending)
        total, delivered, fruitless = len(pending), 0, 0
        while True:
            attempt = _Attempt(len(pending))
            reason: BaseException | str | None = None
            try:
                async for line in self._stream_once(list(pending.values()), attempt):
                    key = _id_key(line.get("id"))
                    if key not in pending:
                        if key in sent:
                            self.stats.duplicates_dropped += 1
                            log.warning("/batch_generate_requests: dropped a second answer for id %r", line.get("id"))
                            continue
                        yield line  # an id never sent: the caller decides what that means
                        continue
                    if not line.get("success") and line.get("status_code") == 503 \
                            and _SHUTDOWN_TEXT in str(line.get("error")):
                        attempt.shutting_down = True  # not final: sent again to the next run
                        continue
                    del pending[key]
                    delivered += 1
                    fruitless = 0
                    yield line
            except ManagerLost:
                raise
            except _StallTimeout as exc:  # the outage already lasted restart_timeout_s
                self.stats.interruptions += 1
                raise self._lost(pending, total, delivered, f"it stalled: {exc}") from exc
            except ManagerRestarted as exc:
                reason = exc
                self.stats.restarts_seen += 1
            except ManagerUnavailable as exc:
                reason = exc
            if not pending:
                return
            self.stats.interruptions += 1
            fruitless += 1
            if reason is None:
                reason = ("the manager is shutting down" if attempt.shutting_down else
                          f"the stream ended after {attempt.received} of {attempt.size} results")
            if fruitless > self.max_resubmits:
                raise self._lost(pending, total, delivered,
                                 f"{fruitless} streams in a row delivered nothing (last: {reason})")
            started = time.monotonic()
            log.warning("/batch_generate_requests: %s; %d of %d request(s) unfinished; resubmitting them when "
                        "the manager at %s answers (up to %gs)", reason, len(pending), total, self.base_url,
                        self.restart_timeout_s)
            # after a graceful shutdown the same run may still answer while it drains: wait for the next
            health = await self._wait_for_manager(started + self.restart_timeout_s,
                                                  attempt.run_id if attempt.shutting_down else None)
            self.stats.outage_s += time.monotonic() - started
            if health is None:
                raise self._lost(pending, total, delivered,
                                 f"it did not come back within {self.restart_timeout_s:g}s after: {reason}")
            log.warning("/batch_generate_requests: manager at %s answers (run %s) after %.1fs; resubmitting %d "
                        "request(s)", self.base_url, health.run_id, time.monotonic() - started, len(pending))
            self.stats.resubmitted += len(pending)

    def _lost(self, pending: dict[str, tuple[Any, dict[str, Any]]], total: int, delivered: int,
              why: str) -> ManagerLost:
        ids = [rid for rid, _ in pending.values()]
        shown = ", ".join(repr(i) for i in ids[:20]) + (f", ... ({len(ids) - 20} more)" if len(ids) > 20 else "")
        return ManagerLost(f"/batch_generate_requests: rollout manager at {self.base_url} lost: {why}; "
                           f"{len(ids)} of {total} request(s) unfinished and lost (ids {shown}); "
                           f"{delivered} were delivered", ids, delivered)

    async def _stream_once(self, items: list[tuple[Any, dict[str, Any]]],
                           attempt: _Attempt) -> AsyncGenerator[dict[str, Any], None]:
        """One ``/batch_generate_requests`` stream; raises :class:`ManagerUnavailable` if it breaks,
        :class:`ManagerRestarted` if another run answers while it is silent.

        A pump reads lines as they arrive, whatever the caller is doing: aiohttp drops what it
        buffered once the connection breaks, and a result that reached this host must not be
        generated again because the caller was busy when the manager died.
        """
        body = [[rid, req] for rid, req in items]
        resp = await self._open("POST", "/batch_generate_requests", body, None)
        lines: asyncio.Queue[bytes | Exception] = asyncio.Queue()

        async def pump() -> None:
            try:
                while True:
                    raw = await resp.content.readline(max_line_length=MAX_LINE_BYTES)
                    lines.put_nowait(raw)
                    if not raw:
                        return
            except Exception as exc:  # handed to the reader, which turns it into the right error
                lines.put_nowait(exc)

        pumping = asyncio.ensure_future(pump())
        get: asyncio.Task[bytes | Exception] | None = None
        try:
            attempt.run_id = resp.headers.get(RUN_ID_HEADER)
            if attempt.run_id is None and self.stall_timeout_s:  # a manager without the header
                health = await self._probe_health()
                attempt.run_id = None if health is None else health.run_id
            while True:
                get = asyncio.ensure_future(lines.get())
                raw = await self._watch(get, attempt)
                if isinstance(raw, asyncio.TimeoutError):
                    raise ManagerUnavailable(f"/batch_generate_requests: no data for {self.read_timeout_s}s "
                                             f"after {attempt.received} of {len(body)} results") from raw
                if isinstance(raw, (aiohttp.ClientError, OSError)):
                    raise ManagerUnavailable(
                        f"/batch_generate_requests: connection broke after {attempt.received} of "
                        f"{len(body)} results: {raw or type(raw).__name__}") from raw
                if isinstance(raw, Exception):
                    raise ManagerClientError(f"/batch_generate_requests: cannot read the answer after "
                                             f"{attempt.received} results: {raw!r}") from raw
                if not raw:
                    break
                raw = raw.strip()
                if not raw:
                    continue
                try:
                    line = json.loads(raw)
                except json.JSONDecodeError as exc:
                    raise ManagerClientError(f"/batch_generate_requests: bad NDJSON line {raw[:200]!r}: {exc}") from exc
                attempt.received += 1
                yield line
        finally:
            for task in (get, pumping):
                if task is not None and not task.done():
                    task.cancel()
            resp.close()  # early exit: drop the connection so the manager aborts the rest
        if attempt.received < len(body):
            raise ManagerUnavailable(
                f"/batch_generate_requests: stream ended after {attempt.received} of {len(body)} results"
            )

    async def _watch(self, read: asyncio.Task[bytes | Exception], attempt: _Attempt) -> bytes | Exception:
        """The next line; while the stream is silent, probe ``/health`` to tell long sequences from a
        stall or a restart (see the module doc)."""
        stall = self.stall_timeout_s
        if stall is None:
            return await read
        down_since: float | None = None
        while True:
            done, _ = await asyncio.wait({read}, timeout=stall)
            if done:
                if down_since is not None:
                    log.warning("/batch_generate_requests: the stream from %s resumed after a stall of %.1fs",
                                self.base_url, time.monotonic() - down_since)
                return read.result()
            health = await self._probe_health()
            now = time.monotonic()
            if health is None:
                if down_since is None:
                    down_since = now
                    self.stats.stalls += 1
                    log.warning("/batch_generate_requests: rollout manager at %s stalled: no result for %gs "
                                "(%d of %d answered) and /health does not answer within %gs; keeping the stream "
                                "open and waiting up to %gs", self.base_url, stall + self.probe_timeout_s,
                                attempt.received, attempt.size, self.probe_timeout_s, self.restart_timeout_s)
                if now - down_since >= self.restart_timeout_s:
                    raise _StallTimeout(f"no result and no answer to /health for {now - down_since + stall:.1f}s "
                                        f"({attempt.received} of {attempt.size} answered)")
                continue
            run_id = health.run_id
            if attempt.run_id is not None and run_id is not None and run_id != attempt.run_id:
                raise ManagerRestarted(f"the manager restarted (run {attempt.run_id} -> {run_id}) after "
                                       f"{attempt.received} of {attempt.size} results", attempt.run_id, run_id)
            if down_since is not None:
                log.warning("/batch_generate_requests: rollout manager at %s answers again (same run) after a "
                            "stall of %.1fs; the stream goes on", self.base_url, now - down_since)
                down_since = None

    @property
    def probe_session(self) -> aiohttp.ClientSession:
        """A pool of its own: streams holding every connection of the main pool cannot delay a probe."""
        if self._probe_session is None or self._probe_session.closed:
            self._probe_session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=4))
        return self._probe_session

    async def _probe_health(self) -> ManagerHealth | None:
        """``/health``'s answer, or None if it does not answer 200 within ``probe_timeout_s``."""
        try:
            async with self.probe_session.get(self.base_url + HEALTH,
                                              timeout=aiohttp.ClientTimeout(total=self.probe_timeout_s)) as r:
                if r.status != 200:
                    return None
                body = await r.json(content_type=None)
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError):
            return None
        return ManagerHealth.from_json(body) if isinstance(body, dict) else None

    async def _wait_for_manager(self, deadline: float, not_run_id: str | None) -> ManagerHealth | None:
        """Poll ``/health`` until it answers (from a run other than ``not_run_id``) or the deadline."""
        def fresh(health: ManagerHealth | None) -> bool:
            return health is not None and (not_run_id is None or health.run_id != not_run_id)

        health = await retry_async(self._probe_health, Backoff(0.05, 1.0, deadline_s=deadline - time.monotonic()),
                                   again=lambda h: not fresh(h))
        return health if fresh(health) else None

    async def abort_local_requests(self) -> dict[str, Any]:
        return await self._call("POST", "/abort_local_requests", {})

    async def update_weight_version(self, new_version: int | None = None, *, wait_for: int | str | None = None,
                                    timeout_s: float = 600.0, wait_until: str = "serving") -> dict[str, Any]:
        """Publish a staged weight version; with ``wait_for`` ("all" or a count) wait until that many instances
        serve it (``wait_until`` "staged": hold it verified, ready to activate)."""
        body: dict[str, Any] = {"timeout_s": float(timeout_s)}
        if wait_until != "serving":
            body["wait_until"] = wait_until
        if new_version is not None:
            body["new_version"] = int(new_version)
        if wait_for is not None:
            body["wait_for_instances"] = wait_for
        return await self._call("POST", "/update_weight_version", body, total=timeout_s + 30)

    async def update_metrics(self, *, step_time_s: float, trainer_bubble_time_s: float,
                             step_throughput: float) -> dict[str, Any]:
        return await self._call("POST", "/update_metrics", {
            "step_time_s": float(step_time_s),
            "trainer_bubble_time_s": float(trainer_bubble_time_s),
            "step_throughput": float(step_throughput),
        })


def _id_key(rid: Any) -> str:
    """Ids are compared as JSON values, as the manager does: ``1`` and ``"1"`` are different ids."""
    return json.dumps(rid, sort_keys=True)


def _http_error(method: str, path: str, status: int, raw: bytes) -> ManagerHTTPError:
    body = decode(raw)
    return ManagerHTTPError(method, path, status, error_message(body), None if isinstance(body, str) else body)
