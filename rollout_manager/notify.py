"""A level-free wake-up signal callable from synchronous code (registry listeners, accounting)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


class Signal:
    """``notify()`` wakes every current waiter; waiters re-check their condition themselves."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, timeout: float | None) -> None:
        """Wait for the next notify, at most ``timeout`` seconds (no error on timeout)."""
        try:
            await asyncio.wait_for(self._event.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    async def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """True once ``predicate()`` holds, False if ``timeout`` passes first."""
        deadline = time.monotonic() + timeout
        while not predicate():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            await self.wait(left)
        return True
