"""Coalesce concurrent single generate calls into ``/batch_generate_requests`` streams.

verl's agent loops ask for one sequence at a time (``server_manager.generate`` per sample, all of a
step's samples started together). Sent as they come, a step of B x n samples is B x n HTTP requests
to the manager. :class:`RequestBatcher` holds each call for at most ``window_s`` (or until
``max_batch`` calls are waiting), sends what gathered as one NDJSON batch, and resolves each caller
as soon as its own line comes back, in completion order, so streaming consumers (verl V1's
TransferQueue, the ReplayBuffer that samples groups as they finish) see every result as early as
with single requests.

A caller that goes away (cancelled) is dropped from its batch; when every caller of a batch is gone,
the stream is closed, which makes the manager abort what it still runs for it.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
from collections.abc import AsyncGenerator, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from .batch_stream import PATH
from .client import ManagerHTTPError

log = logging.getLogger("trainer_plugin.batcher")


@dataclass
class _WaitingBatch:
    waiters: dict[str, asyncio.Future[Any]] = field(default_factory=dict)
    bodies: dict[str, dict[str, Any]] = field(default_factory=dict)
    tokens: int = 0
    task: asyncio.Task[None] | None = None


class BatchSender(Protocol):
    """What sends a batch: one manager's client, or the spread over its relays (``relay_spread``)."""

    def batch_generate(self, items: Iterable[tuple[Any, dict[str, Any]]]) -> AsyncGenerator[dict[str, Any], None]: ...


class RequestBatcher:
    """One per event loop and manager; not thread-safe (a Ray async actor is one loop)."""

    def __init__(self, client: BatchSender, *, window_s: float = 0.005, max_batch: int = 1024,
                 max_batch_tokens: int = 1_000_000):
        """``max_batch_tokens``: prompt tokens per batch, so a batch body (a few bytes per token) stays
        well inside the manager's ``max_request_body_mb``."""
        if window_s < 0 or max_batch < 1 or max_batch_tokens < 1:
            raise ValueError(f"window_s must be >= 0, max_batch and max_batch_tokens >= 1, got "
                             f"{window_s}, {max_batch}, {max_batch_tokens}")
        self.client = client
        self.window_s = window_s
        self.max_batch = max_batch
        self.max_batch_tokens = max_batch_tokens
        self._ids = itertools.count()
        self._open = _WaitingBatch()
        self._timer: asyncio.TimerHandle | None = None
        self._running: set[asyncio.Task[None]] = set()
        self.batches_sent = 0
        self.requests_sent = 0

    async def generate(self, body: dict[str, Any]) -> dict[str, Any]:
        """SGLang's final answer for one ``/generate`` body; raises the manager's error for this one."""
        loop = asyncio.get_running_loop()
        key = str(next(self._ids))
        fut: asyncio.Future[Any] = loop.create_future()
        tokens = _prompt_tokens(body)
        if self._open.waiters and self._open.tokens + tokens > self.max_batch_tokens:
            self._flush()
        batch = self._open
        batch.waiters[key] = fut
        batch.bodies[key] = body
        batch.tokens += tokens
        fut.add_done_callback(functools.partial(self._on_done, batch))
        if len(batch.waiters) >= self.max_batch or batch.tokens >= self.max_batch_tokens:
            self._flush()
        elif self._timer is None:
            self._timer = loop.call_later(self.window_s, self._flush)
        return await fut

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._open = self._open, _WaitingBatch()
        live = {k: f for k, f in batch.waiters.items() if not f.done()}
        if not live:
            return
        batch.waiters = live
        batch.task = asyncio.get_running_loop().create_task(self._run(batch))
        self._running.add(batch.task)
        batch.task.add_done_callback(self._running.discard)

    def _on_done(self, batch: _WaitingBatch, fut: asyncio.Future[Any]) -> None:
        # Only a cancelled caller matters here: if nobody of this batch is left, stop its stream.
        if fut.cancelled() and batch.task is not None and not batch.task.done() \
                and all(f.done() for f in batch.waiters.values()):
            batch.task.cancel()

    async def _run(self, batch: _WaitingBatch) -> None:
        items = [(k, batch.bodies.pop(k)) for k in batch.waiters]
        batch.bodies.clear()
        self.batches_sent += 1
        self.requests_sent += len(items)
        waiting = dict(batch.waiters)
        try:
            async for line in self.client.batch_generate(items):
                fut = waiting.pop(str(line.get("id")), None)
                if fut is None or fut.done():
                    continue
                if line.get("success"):
                    fut.set_result(line.get("data"))
                else:
                    fut.set_exception(ManagerHTTPError("POST", PATH, int(line.get("status_code") or 502),
                                                       str(line.get("error")), line))
        except asyncio.CancelledError:
            for fut in waiting.values():
                fut.cancel()
            raise
        except Exception as exc:
            for fut in waiting.values():
                if not fut.done():
                    fut.set_exception(exc)
            return
        for key, fut in waiting.items():  # batch_generate raises if ids are missing; belt and braces
            if not fut.done():
                fut.set_exception(ManagerHTTPError("POST", PATH, 502, f"no result for batch item {key}"))

    async def close(self) -> None:
        """Cancel what is still running (the manager aborts it) and the open window."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for fut in self._open.waiters.values():
            fut.cancel()
        self._open = _WaitingBatch()
        tasks = list(self._running)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _prompt_tokens(body: dict[str, Any]) -> int:
    ids = body.get("input_ids")
    if not isinstance(ids, list):
        return 0
    return sum(len(x) for x in ids if isinstance(x, list)) if ids and isinstance(ids[0], list) else len(ids)
