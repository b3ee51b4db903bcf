"""The manager's own resource limits, told apart from an instance's failures.

A connection that fails because the *manager* is out of file descriptors, socket buffers or memory
(``EMFILE``, ``ENFILE``, ``ENOBUFS``, ``ENOMEM``) says nothing about the instance: nothing was sent,
so the request waits in the manager and goes out as soon as the manager can open a connection, and
no instance is ever blamed (counted towards removal) for it.

Nor is a timeout that ran out while the manager's own event loop was too busy to run anything: with
a thousand instances and thousands of sequences arriving at once, the loop can be blocked for
seconds, and a connection the kernel completed at once still times out by the loop's clock.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import time
from collections import deque

log = logging.getLogger("rollout_manager.local_limits")

LOCAL_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


def local_resource_error(exc: BaseException) -> OSError | None:
    """The manager-side OSError behind ``exc`` (aiohttp wraps it), or None when it is not one."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        for candidate in (current, getattr(current, "os_error", None)):
            if isinstance(candidate, OSError) and candidate.errno in LOCAL_ERRNOS:
                return candidate
        current = current.__cause__ or current.__context__
    return None


class LoopWatch:
    """Measures how long the running event loop was blocked: a timer that fires late by that much.

    Started on first use from a coroutine, so it needs no wiring; it wakes ``TICK_S`` apart.
    """

    TICK_S = 0.25
    MIN_LAG_S = 0.05  # lateness below this is scheduling noise, not a block
    WARN_LAG_S = 1.0  # a block this long delays every caller and probe: logged, at most every LOG_EVERY_S
    LOG_EVERY_S = 30.0

    def __init__(self) -> None:
        self._lags: deque[tuple[float, float]] = deque(maxlen=512)  # (when the block ended, its length)
        self._task: asyncio.Task[None] | None = None
        self._due: float | None = None
        self.total_s = 0.0  # seconds blocked since started, over blocks of at least MIN_LAG_S
        self.longest_s = 0.0
        self._last_log: float | None = None

    def ensure_started(self) -> None:
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self._due = loop.time() + self.TICK_S  # a block before its first run counts too
            self._task = loop.create_task(self._run(), name="loop-watch")

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(max(0.0, (self._due or 0.0) - loop.time()))
            now = loop.time()
            if self._due is not None and now - self._due >= self.MIN_LAG_S:
                self._record(now, now - self._due)
            self._due = now + self.TICK_S

    def _record(self, now: float, lag: float) -> None:
        self._lags.append((now, lag))
        self.total_s += lag
        self.longest_s = max(self.longest_s, lag)
        if lag >= self.WARN_LAG_S and (self._last_log is None or now - self._last_log >= self.LOG_EVERY_S):
            self._last_log = now
            log.warning("the manager's event loop was blocked for %.1fs by its own work (%.1fs in all since "
                        "start): callers, probes and streams waited; timeouts in that time blame no instance",
                        lag, self.total_s)

    def blocked_s(self, since: float) -> float:
        """Seconds the loop was blocked between ``since`` (``loop.time()``) and now, a block still
        going on (the tick is overdue) included."""
        now = asyncio.get_running_loop().time()
        spans = list(self._lags)
        if self._due is not None and now - self._due >= self.MIN_LAG_S:
            spans.append((now, now - self._due))
        return sum(max(0.0, end - max(since, end - lag)) for end, lag in spans if end > since)


class LocalLimits:
    """Counts the waits the manager's own limits cause, for status and metrics, and paces retries."""

    MIN_DELAY_S = 0.01
    MAX_DELAY_S = 0.5
    LOG_EVERY_S = 10.0

    def __init__(self) -> None:
        self.waiting = 0  # requests waiting right now for the manager to be able to connect
        self.events = 0  # connection attempts that hit a manager-side limit, since start
        self.last_error: str | None = None
        self._last_log = -self.LOG_EVERY_S
        self.loop = LoopWatch()

    def timed_out_locally(self, started: float, timeout_s: float) -> bool:
        """A ``timeout_s`` timeout that ran out since ``started`` (``loop.time()``) is the manager's own
        doing when the loop was blocked for so long that the instance did not get ``timeout_s`` of a
        responsive manager."""
        self.loop.ensure_started()
        elapsed = asyncio.get_running_loop().time() - started
        return elapsed - self.loop.blocked_s(started) < timeout_s

    async def wait_after(self, error: OSError | str, attempt: int) -> None:
        """Back off after the ``attempt``-th local failure (0-based) of one request."""
        self.events += 1
        self.last_error = error if isinstance(error, str) else \
            f"{errno.errorcode.get(error.errno or 0, error.errno)}: {error.strerror}"
        now = time.monotonic()
        if now - self._last_log >= self.LOG_EVERY_S:
            self._last_log = now
            hint = "" if isinstance(error, str) else " Raise the open-file limit (ulimit -n) if this persists"
            log.warning("the manager hit its own limit opening a connection (%s); requests wait in the "
                        "manager (%d waiting now); no instance is blamed.%s", self.last_error, self.waiting + 1,
                        hint)
        self.waiting += 1
        try:
            await asyncio.sleep(min(self.MIN_DELAY_S * (2 ** attempt), self.MAX_DELAY_S))
        finally:
            self.waiting -= 1

    def to_dict(self) -> dict[str, object]:
        return {"waiting_for_connection": self.waiting, "local_limit_events": self.events,
                "last_local_limit_error": self.last_error, "event_loop_blocked_s": round(self.loop.total_s, 3),
                "event_loop_longest_block_s": round(self.loop.longest_s, 3)}
