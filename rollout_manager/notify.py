"""A level-free wake-up signal callable from synchronous code (registry listeners, accounting)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


class Signal:
    """``notify()`` wakes every current waiter; waiters re-check their condition themselves.

    Each waiter parks on a future of its own, with its timeout as a loop timer, rather than in
    ``asyncio.wait_for``: on Python 3.11 a ``wait_for`` whose inner wait completes as the task is
    cancelled can swallow the cancellation, and a shutdown then hangs on the task.
    """

    def __init__(self) -> None:
        self._waiters: set[asyncio.Future[None]] = set()

    def notify(self) -> None:
        if not self._waiters:  # the common case: told on every change, waited on rarely
            return
        waiters, self._waiters = self._waiters, set()
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    async def wait(self, timeout: float | None) -> None:
        """Wait for the next notify, at most ``timeout`` seconds (no error on timeout)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._waiters.add(fut)
        timer = None if timeout is None else loop.call_later(max(timeout, 0.0), _wake, fut)
        try:
            await fut
        finally:
            self._waiters.discard(fut)
            if timer is not None:
                timer.cancel()

    async def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """True once ``predicate()`` holds, False if ``timeout`` passes first."""
        deadline = time.monotonic() + timeout
        while not predicate():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            await self.wait(left)
        return True


async def bounded(work: Awaitable[T], timeout_s: float) -> T:
    """``work`` within ``timeout_s`` (else it is cancelled and TimeoutError raised), like
    ``asyncio.wait_for`` but without its Python 3.11 race: there, a wait_for whose inner work ends
    just as the caller is cancelled can swallow the cancellation, and the caller never stops."""
    task = asyncio.ensure_future(work)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    except asyncio.CancelledError:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise
    if not done:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise asyncio.TimeoutError(f"timed out after {timeout_s:g}s")
    return task.result()


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
