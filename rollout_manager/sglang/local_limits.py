"""The manager's own resource limits, told apart from an instance's failures.

A connection that fails because the *manager* is out of file descriptors, socket buffers or memory
(``EMFILE``, ``ENFILE``, ``ENOBUFS``, ``ENOMEM``) says nothing about the instance: nothing was sent,
so the request waits in the manager and goes out as soon as the manager can open a connection, and
no instance is ever blamed (counted towards removal) for it.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import time

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

    async def wait_after(self, error: OSError, attempt: int) -> None:
        """Back off after the ``attempt``-th local failure (0-based) of one request."""
        self.events += 1
        self.last_error = f"{errno.errorcode.get(error.errno or 0, error.errno)}: {error.strerror}"
        now = time.monotonic()
        if now - self._last_log >= self.LOG_EVERY_S:
            self._last_log = now
            log.warning("the manager hit its own limit opening a connection (%s); requests wait in the "
                        "manager (%d waiting now); no instance is blamed. Raise the open-file limit "
                        "(ulimit -n) if this persists", self.last_error, self.waiting + 1)
        self.waiting += 1
        try:
            await asyncio.sleep(min(self.MIN_DELAY_S * (2 ** attempt), self.MAX_DELAY_S))
        finally:
            self.waiting -= 1

    def to_dict(self) -> dict[str, object]:
        return {"waiting_for_connection": self.waiting, "local_limit_events": self.events,
                "last_local_limit_error": self.last_error}
