"""``POST /batch_generate_requests`` as the trainer streams it: one NDJSON line per request, resumed
across manager outages. :meth:`trainer_plugin.client.ManagerClient.batch_generate` is the entry point;
leaving its loop early closes the connection, which makes the manager abort what is still running.

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
import itertools
import json
import logging
import time
from collections.abc import AsyncGenerator, Iterable
from typing import Any, Protocol

import aiohttp

from rollout_manager.manager_client import RUN_ID_HEADER, ManagerHealth

from .client_errors import ClientStats, ManagerClientError, ManagerLost, ManagerRestarted, ManagerUnavailable

log = logging.getLogger("trainer_plugin.client")

PATH = "/batch_generate_requests"
# What the manager's failure lines say when it stops mid-batch: not the request's fault.
_SHUTDOWN_TEXT = "rollout manager is shutting down"
# One NDJSON result line: SGLang's answer with log-probs runs to tens of bytes a token (aiohttp's own
# default, 128 KiB, fails a 4k-token answer with log-probs).
MAX_LINE_BYTES = 256 * 1024 * 1024

Item = tuple[Any, dict[str, Any]]


class ManagerLink(Protocol):
    """What a batch stream needs of the client: its settings, its counters, a request that retries
    connection failures, and ``/health`` probes on a pool of their own."""

    base_url: str
    read_timeout_s: float | None
    stall_timeout_s: float | None
    restart_timeout_s: float
    probe_timeout_s: float
    max_resubmits: int
    stats: ClientStats

    async def send(self, method: str, path: str, body: Any, total: float | None,
                   headers: dict[str, str] | None = None) -> aiohttp.ClientResponse: ...

    async def probe_health(self) -> ManagerHealth | None: ...

    async def wait_for_manager(self, deadline: float, not_run_id: str | None) -> ManagerHealth | None: ...


class _StallTimeout(ManagerUnavailable):
    """A stream's manager showed no sign of life for ``restart_timeout_s``."""


class _Attempt:
    """One stream of a batch: which run serves it and whether that run said it is shutting down."""

    def __init__(self, size: int, again: bool = False) -> None:
        self.size = size
        self.again = again  # ids sent before, on a stream that was lost
        self.run_id: str | None = None
        self.received = 0
        self.shutting_down = False


async def stream_batch(link: ManagerLink, items: Iterable[Item]) -> AsyncGenerator[dict[str, Any], None]:
    """Each NDJSON line of the batch, resuming a lost stream with the unanswered ids (the module doc)."""
    listed = list(items)
    if link.restart_timeout_s <= 0:
        async for line in _stream_once(link, listed, _Attempt(len(listed))):
            yield line
        return
    pending = {_id_key(rid): (rid, req) for rid, req in listed}
    sent = set(pending)
    total, delivered, fruitless = len(pending), 0, 0
    stats = link.stats
    for streams in itertools.count():
        attempt = _Attempt(len(pending), again=streams > 0)
        reason: BaseException | str | None = None
        try:
            async for line in _stream_once(link, list(pending.values()), attempt):
                key = _id_key(line.get("id"))
                if key not in pending:
                    if key in sent:
                        stats.duplicates_dropped += 1
                        log.warning("%s: dropped a second answer for id %r", PATH, line.get("id"))
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
            stats.interruptions += 1
            raise _lost(link, pending, total, delivered, f"it stalled: {exc}") from exc
        except ManagerRestarted as exc:
            reason = exc
            stats.restarts_seen += 1
        except ManagerUnavailable as exc:
            reason = exc
        if not pending:
            return
        stats.interruptions += 1
        fruitless += 1
        if reason is None:
            reason = ("the manager is shutting down" if attempt.shutting_down else
                      f"the stream ended after {attempt.received} of {attempt.size} results")
        if fruitless > link.max_resubmits:
            raise _lost(link, pending, total, delivered,
                        f"{fruitless} streams in a row delivered nothing (last: {reason})")
        started = time.monotonic()
        log.warning("%s: %s; %d of %d request(s) unfinished; resubmitting them when the manager at %s answers "
                    "(up to %gs)", PATH, reason, len(pending), total, link.base_url, link.restart_timeout_s)
        # after a graceful shutdown the same run may still answer while it drains: wait for the next
        health = await link.wait_for_manager(started + link.restart_timeout_s,
                                             attempt.run_id if attempt.shutting_down else None)
        stats.outage_s += time.monotonic() - started
        if health is None:
            raise _lost(link, pending, total, delivered,
                        f"it did not come back within {link.restart_timeout_s:g}s after: {reason}")
        log.warning("%s: manager at %s answers (run %s) after %.1fs; resubmitting %d request(s)", PATH,
                    link.base_url, health.run_id, time.monotonic() - started, len(pending))
        stats.resubmitted += len(pending)


def _lost(link: ManagerLink, pending: dict[str, Item], total: int, delivered: int, why: str) -> ManagerLost:
    ids = [rid for rid, _ in pending.values()]
    shown = ", ".join(repr(i) for i in ids[:20]) + (f", ... ({len(ids) - 20} more)" if len(ids) > 20 else "")
    return ManagerLost(f"{PATH}: rollout manager at {link.base_url} lost: {why}; {len(ids)} of {total} "
                       f"request(s) unfinished and lost (ids {shown}); {delivered} were delivered", ids, delivered)


async def _stream_once(link: ManagerLink, items: list[Item], attempt: _Attempt) -> AsyncGenerator[dict[str, Any], None]:
    """One stream; raises :class:`ManagerUnavailable` if it breaks, :class:`ManagerRestarted` if another
    run answers while it is silent.

    A pump reads lines as they arrive, whatever the caller is doing: aiohttp drops what it
    buffered once the connection breaks, and a result that reached this host must not be
    generated again because the caller was busy when the manager died.
    """
    body = [[rid, req] for rid, req in items]
    # Sent again: a manager with relays continues each from the tokens the lost relay saved (docs/relays.md).
    resp = await link.send("POST", PATH, body, None, RESUME_HEADERS if attempt.again else None)
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
        if attempt.run_id is None and link.stall_timeout_s:  # a manager without the header
            health = await link.probe_health()
            attempt.run_id = None if health is None else health.run_id
        while True:
            get = asyncio.ensure_future(lines.get())
            raw = await _watch(link, get, attempt)
            if isinstance(raw, asyncio.TimeoutError):
                raise ManagerUnavailable(f"{PATH}: no data for {link.read_timeout_s}s "
                                         f"after {attempt.received} of {len(body)} results") from raw
            if isinstance(raw, (aiohttp.ClientError, OSError)):
                raise ManagerUnavailable(f"{PATH}: connection broke after {attempt.received} of {len(body)} "
                                         f"results: {raw or type(raw).__name__}") from raw
            if isinstance(raw, Exception):
                raise ManagerClientError(f"{PATH}: cannot read the answer after {attempt.received} results: "
                                         f"{raw!r}") from raw
            if not raw:
                break
            raw = raw.strip()
            if not raw:
                continue
            try:
                line = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise ManagerClientError(f"{PATH}: bad NDJSON line {raw[:200]!r}: {exc}") from exc
            attempt.received += 1
            yield line
    finally:
        for task in (get, pumping):
            if task is not None and not task.done():
                task.cancel()
        resp.close()  # early exit: drop the connection so the manager aborts the rest
    if attempt.received < len(body):
        raise ManagerUnavailable(f"{PATH}: stream ended after {attempt.received} of {len(body)} results")


async def _watch(link: ManagerLink, read: asyncio.Task[bytes | Exception], attempt: _Attempt) -> bytes | Exception:
    """The next line; while the stream is silent, probe ``/health`` to tell long sequences from a
    stall or a restart (see the module doc)."""
    stall = link.stall_timeout_s
    if stall is None:
        return await read
    down_since: float | None = None
    while True:
        done, _ = await asyncio.wait({read}, timeout=stall)
        if done:
            if down_since is not None:
                log.warning("%s: the stream from %s resumed after a stall of %.1fs", PATH, link.base_url,
                            time.monotonic() - down_since)
            return read.result()
        health = await link.probe_health()
        now = time.monotonic()
        if health is None:
            if down_since is None:
                down_since = now
                link.stats.stalls += 1
                log.warning("%s: rollout manager at %s stalled: no result for %gs (%d of %d answered) and /health "
                            "does not answer within %gs; keeping the stream open and waiting up to %gs", PATH,
                            link.base_url, stall + link.probe_timeout_s, attempt.received, attempt.size,
                            link.probe_timeout_s, link.restart_timeout_s)
            if now - down_since >= link.restart_timeout_s:
                raise _StallTimeout(f"no result and no answer to /health for {now - down_since + stall:.1f}s "
                                    f"({attempt.received} of {attempt.size} answered)")
            continue
        run_id = health.run_id
        if attempt.run_id is not None and run_id is not None and run_id != attempt.run_id:
            raise ManagerRestarted(f"the manager restarted (run {attempt.run_id} -> {run_id}) after "
                                   f"{attempt.received} of {attempt.size} results", attempt.run_id, run_id)
        if down_since is not None:
            log.warning("%s: rollout manager at %s answers again (same run) after a stall of %.1fs; the stream "
                        "goes on", PATH, link.base_url, now - down_since)
            down_since = None


RESUME_HEADERS = {"X-Rollout-Resume": "1"}


def _id_key(rid: Any) -> str:
    """Ids are compared as JSON values, as the manager does: ``1`` and ``"1"`` are different ids."""
    return json.dumps(rid, sort_keys=True)
