"""SGLang's ``model_update_lock`` (``sglang/srt/utils/aio_rwlock.py``), which decides when a weight update runs.

Every /generate holds it shared for its whole life; a weight-update call (begin, load, end) that comes while
generation is not paused takes it exclusively, so it waits until the requests in flight have finished, and
requests that arrive meanwhile wait behind it (writer preference).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class RWLock:
    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._readers = 0
        self._writer = False
        self._waiting_writers = 0

    @asynccontextmanager
    async def shared(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writer and not self._waiting_writers)
            self._readers += 1
        try:
            yield
        finally:
            async with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        async with self._cond:
            self._waiting_writers += 1
            try:
                await self._cond.wait_for(lambda: not self._writer and not self._readers)
            finally:
                self._waiting_writers -= 1
            self._writer = True
        try:
            yield
        finally:
            async with self._cond:
                self._writer = False
                self._cond.notify_all()

    @property
    def held(self) -> bool:
        """Whether any request (or update) holds it: SGLang's ``is_locked()``."""
        return bool(self._readers or self._writer)
