"""Short non-streaming ``/generate`` calls to one instance, sent together as one SGLang batch.

Every HTTP request costs the manager's client and the engine's HTTP server and tokenizer manager the
same, whatever it carries; for a sequence of a few tokens that per-request cost is most of the work.
Calls for the same instance that start in the same turn of the event loop (and may share a batch:
:func:`.generate_request.joinable`) leave as one batched request at the start of the next turn. No call waits for
company: a lone call goes alone, at once. Each call still gets its own answer or error, so the
generation path above sees no difference, and continuation loses nothing a lone call would not: a
non-streaming answer comes whole or not at all.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from rollout_manager.sglang.client import (
    CallBounds,
    EngineFailed,
    EngineRejected,
    generate_batch_once,
    generate_once,
)
from rollout_manager.sglang.generate_request import SequenceBody, join_key, joinable
from rollout_manager.sglang.wire import GenerateChunk

log = logging.getLogger("rollout_manager.sglang.coalesce")


@dataclass
class _Batch:
    """The calls that share an instance, a turn of the loop and a :func:`.generate_request.join_key`."""

    key: tuple[Any, ...]
    calls: list[_Call] = field(default_factory=list)
    task: asyncio.Task[None] | None = None  # the request, once sent
    left: int = 0  # callers that went away before their answer

    def leave(self) -> None:
        """A caller went away: once all have, the request is cut (their sequences are aborted on the
        engine by their callers, by ``rid``)."""
        self.left += 1
        if self.left == len(self.calls) and self.task is not None:
            self.task.cancel()


@dataclass
class _Call:
    body: SequenceBody
    answer: asyncio.Future[GenerateChunk]
    batch: _Batch | None = None


@dataclass
class CoalesceStats:
    engine_calls: int = 0  # HTTP requests made
    sequences: int = 0  # sequences they carried
    split_after_refusal: int = 0  # batches refused whole, then sent one call per sequence


class Coalescer:
    """Joins concurrent short calls per instance into SGLang batches of at most ``max_items``
    (1: never join). One per manager; the calls' :class:`CallBounds` are the same for all."""

    def __init__(self, max_items: int = 64) -> None:
        self.loop = asyncio.get_running_loop()  # built in the loop it serves; asked once, not per call
        self.max_items = max(1, max_items)
        self.stats = CoalesceStats()
        self._open: dict[str, list[_Batch]] = {}  # base_url -> batches filling this turn
        self._sending: set[asyncio.Task[None]] = set()

    async def generate_once(self, session: aiohttp.ClientSession, base_url: str, body: SequenceBody,
                            bounds: CallBounds) -> GenerateChunk:
        """:func:`client.generate_once`, through a batch when others start for ``base_url`` now."""
        if self.max_items == 1 or not joinable(body):
            self.stats.engine_calls += 1
            self.stats.sequences += 1
            return await generate_once(session, base_url, body, bounds)
        call = _Call(body, self.loop.create_future())
        self._join(session, base_url, call, bounds)
        try:
            return await call.answer
        finally:
            if not call.answer.done():  # the caller went away: its batch need not wait for it
                call.answer.cancel()
                assert call.batch is not None
                call.batch.leave()

    def _join(self, session: aiohttp.ClientSession, base_url: str, call: _Call, bounds: CallBounds) -> None:
        batches = self._open.get(base_url)
        if batches is None:
            batches = self._open[base_url] = []
            self.loop.call_soon(self._flush, session, base_url, bounds)
        key = join_key(call.body)
        batch = next((b for b in batches if b.key == key), None)
        if batch is None:
            batch = _Batch(key)
            batches.append(batch)
        batch.calls.append(call)
        call.batch = batch
        if len(batch.calls) >= self.max_items:
            batches.remove(batch)
            self._start(session, base_url, batch, bounds)

    def _flush(self, session: aiohttp.ClientSession, base_url: str, bounds: CallBounds) -> None:
        for batch in self._open.pop(base_url, []):
            self._start(session, base_url, batch, bounds)

    def _start(self, session: aiohttp.ClientSession, base_url: str, batch: _Batch,
               bounds: CallBounds) -> None:
        task = batch.task = asyncio.ensure_future(self._send(session, base_url, batch.calls, bounds))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)
        if batch.left == len(batch.calls):  # all left in this very turn
            task.cancel()

    async def _send(self, session: aiohttp.ClientSession, base_url: str, calls: list[_Call],
                    bounds: CallBounds) -> None:
        """Make the call and settle every caller's answer."""
        try:
            if len(calls) == 1:
                await self._send_one(session, base_url, calls[0], bounds)
                return
            self.stats.engine_calls += 1
            self.stats.sequences += len(calls)
            try:
                answers = await generate_batch_once(session, base_url, [c.body for c in calls], bounds)
            except EngineRejected:
                # Refused whole: which item, SGLang does not say. Each alone gets its own verdict.
                self.stats.split_after_refusal += 1
                await asyncio.gather(*(self._send_one(session, base_url, c, bounds) for c in calls))
                return
            except EngineFailed as exc:
                for c in calls:
                    _settle(c.answer, exc=EngineFailed(str(exc)))
                return
            for c, answer in zip(calls, answers):
                _settle(c.answer, answer)
        except asyncio.CancelledError:
            for c in calls:
                c.answer.cancel()
            raise
        except Exception as exc:  # a bug here must fail the calls (500), never leave them waiting or blame the engine
            log.exception("shared call of %d sequence(s) to %s failed inside the manager", len(calls), base_url)
            for c in calls:
                _settle(c.answer, exc=RuntimeError(f"internal error in a shared engine call: {exc!r}"))

    async def _send_one(self, session: aiohttp.ClientSession, base_url: str, call: _Call,
                        bounds: CallBounds) -> None:
        if call.answer.done():
            return
        self.stats.engine_calls += 1
        self.stats.sequences += 1
        try:
            _settle(call.answer, await generate_once(session, base_url, call.body, bounds))
        except (EngineFailed, EngineRejected) as exc:
            _settle(call.answer, exc=exc)


def _settle(answer: asyncio.Future[GenerateChunk], result: GenerateChunk | None = None, *,
            exc: BaseException | None = None) -> None:
    if answer.done():
        return
    if exc is not None:
        answer.set_exception(exc)
    else:
        assert result is not None
        answer.set_result(result)
