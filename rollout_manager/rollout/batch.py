"""``/batch_generate_requests``: many requests, each answered once as an NDJSON line, in completion order.

The requests start only as the pool has room (:class:`_BatchRun`), and not while the caller has not
read what is done: a batch of 100,000 costs the manager its body and a window of running requests.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import sys
from collections import deque
from collections.abc import AsyncGenerator, Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import msgspec
from msgspec import UNSET, UnsetType

from rollout_manager import jsonutil
from rollout_manager.errors import ManagerError
from rollout_manager.placement.dispatch import accepted_at
from rollout_manager.rollout.request import Request
from rollout_manager.rollout.window import LOOKAHEAD, pacer
from rollout_manager.sglang.answer import GenerateAnswer as Answer

if TYPE_CHECKING:
    from rollout_manager.rollout.generation import Generator

log = logging.getLogger("rollout_manager.rollout.batch")

# NDJSON handed to the caller's connection at a time: aiohttp waits for the socket to drain at this much.
NDJSON_PIECE_BYTES = 64 * 1024
_ANSWERED = object()  # a task whose answer was handed over (``_BatchRun._done`` has nothing to add)
L = TypeVar("L")


class BatchLine(msgspec.Struct):
    """One request's result in a batch (an NDJSON line): its answer (``data``: a list for batched input),
    or the status and error it failed with. Encoded once, as it is handed to the caller (:meth:`to_json`)."""

    id: Any  # the caller's id for the request, as it sent it
    success: bool
    data: Answer | list[Answer] | UnsetType = UNSET
    status_code: int | UnsetType = UNSET
    error: str | UnsetType = UNSET

    @classmethod
    def failed(cls, rid: Any, status: int, error: str) -> BatchLine:
        return cls(rid, False, status_code=status, error=error)

    def to_json(self) -> dict[str, Any]:
        """The NDJSON line's object (``jsonutil.dumps`` encodes the answers in it through theirs)."""
        if self.success:
            return {"id": self.id, "success": True, "data": self.data}
        return {"id": self.id, "success": False, "status_code": self.status_code, "error": self.error}


class _BatchRun(Generic[L]):
    """One batch of requests, started only as they can run and as the caller reads the results.

    The requests are not all started at once: the batch holds back those beyond what the pool can run
    now (``Capacity.pool_bound``, plus :data:`LOOKAHEAD`), counted in ``Capacity.held_by_batches``, so a
    batch of 100,000 costs the manager its body and a window of running requests, not 100,000 waiting
    sequences. New requests start only when the caller asks for more results, and not while the results
    not yet handed to it exceed ``max_unsent`` bytes: a caller that stops reading stops its batch (the
    requests already running finish, and their results wait), and one that reads slowly sets its pace.
    Nor do they all start in one event-loop turn: at most what the loop's ``window.TurnPacer`` allows
    (shared with every other batch), the rest on the following turns, so that their placements do not
    block the loop in one go.
    """

    def __init__(self, generator: Generator, items: list[tuple[Any, Request]],
                 encode: Callable[[BatchLine], L], size: Callable[[L], int] | None = None,
                 max_unsent: int | None = None, piece: int | None = None) -> None:
        self.generator = generator
        self.dispatcher = generator.dispatcher
        self.pending = deque(items)
        self.encode, self.size, self.max_unsent, self.piece = encode, size, max_unsent, piece
        self.ready: deque[tuple[L, int]] = deque()  # finished, not yet handed over: (line, its size)
        self.unsent = 0  # bytes in ``ready``
        # Each running request's task (the generator's own coroutine, no wrapper) and its id.
        self.tasks: dict[asyncio.Future[Any], Any] = {}
        self.wake = asyncio.Event()
        self.accepted = self.dispatcher.clock()  # the no-instance wait of requests started later counts from here
        # The batch's context: when it was accepted (the no-instance wait counts from there), the same for
        # every request; its tasks and their done callbacks run in it (no copy per task or callback: nothing
        # the rollout flow runs sets a context variable; before Python 3.11 each task runs in a copy).
        self.context = contextvars.copy_context()
        self.context.run(accepted_at.set, self.accepted)
        self._answered_callback, self._done_callback = self._answered, self._done  # one of each for every task
        self.ended = False  # the caller went or every id was answered: nothing more starts

    def _run(self, rid: Any, request: Request) -> None:
        """Start one request as a task of its own coroutine (no wrapper's frame per request): a sequence's
        answer is handed to :meth:`_answered` in the step that builds it, anything else to :meth:`_done`."""
        try:
            # An id past the vocabulary (it crashes SGLang) fails its own line, before it is placed.
            self.generator.vocab.check(request.input_ids)
            run = self.generator.generate(request, answer=self._answered_callback)
        except Exception as exc:
            self._answer(rid, _failure(rid, exc))
            return
        if sys.version_info >= (3, 11):  # the batch's context itself: no copy per task
            task = asyncio.get_running_loop().create_task(run, context=self.context)
        else:
            task = self.context.run(asyncio.ensure_future, run)  # a copy of it
        self.tasks[task] = rid
        task.add_done_callback(self._done_callback, context=self.context)

    def _answered(self, data: Answer) -> None:
        """A request's answer, encoded at once: answers that come in one loop turn are never all waiting
        as Python objects for their tasks' done callbacks (the next turn)."""
        task = asyncio.current_task()
        assert task is not None
        rid = self.tasks.pop(task)
        self._answer(rid, BatchLine(rid, True, data))

    def _done(self, task: asyncio.Future[Any]) -> None:
        """A request's task ended: its line, unless :meth:`_answered` gave it (one sequence's answer) or
        :meth:`results` cancelled the task."""
        rid = self.tasks.pop(task, _ANSWERED)
        if rid is _ANSWERED or task.cancelled():
            return
        exc = task.exception()
        self._answer(rid, BatchLine(rid, True, task.result()) if exc is None else _failure(rid, exc))

    def _answer(self, rid: Any, line: BatchLine) -> None:
        try:
            out = self.encode(line)
        except Exception as exc:  # an answer that cannot be encoded still answers its id
            log.exception("result of request %r could not be encoded", rid)
            out = self.encode(BatchLine.failed(rid, 500, f"internal error: {exc}"))
        size = self.size(out) if self.size is not None else 0
        self.ready.append((out, size))
        self.unsent += size
        self.wake.set()

    def _start(self) -> None:
        """Start what the window has room for, at most what the loop's ``TurnPacer`` allows this turn;
        the rest on the next turn (the pacer calls this again), or when a request ends or the caller reads."""
        if self.ended or not self.pending or (self.max_unsent is not None and self.unsent > self.max_unsent):
            return
        room = self.dispatcher.capacity.pool_bound() + LOOKAHEAD - len(self.tasks)
        paced = pacer()
        allowed = min(room, paced.allowance())
        started = 0
        while self.pending and started < allowed:
            rid, request = self.pending.popleft()
            self.dispatcher.capacity.unhold(1)
            self._run(rid, request)
            started += 1
        paced.spent(started, self._start if self.pending and started < room else None)

    def _take(self) -> list[L]:
        """The next results to hand over: all that are ready, or about ``piece`` bytes of them."""
        out: list[L] = []
        taken = 0
        while self.ready and (not out or self.piece is None or taken + self.ready[0][1] <= self.piece):
            line, size = self.ready.popleft()
            out.append(line)
            taken += size
        self.unsent -= taken
        return out

    async def results(self) -> AsyncGenerator[list[L], None]:
        total = len(self.pending)
        self.dispatcher.capacity.hold(total)
        self.generator.begin_rollout()
        try:
            done = 0
            while done < total:
                self._start()
                while not self.ready:
                    self.wake.clear()
                    await self.wake.wait()
                    self._start()  # a request finished: its slot may go to the next one
                lines = self._take()
                done += len(lines)
                yield lines
        finally:
            self.ended = True
            self.dispatcher.capacity.unhold(len(self.pending))
            self.pending.clear()
            tasks = list(self.tasks)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def run_batch(
    generator: Generator, items: list[tuple[Any, Request]]
) -> AsyncGenerator[list[BatchLine], None]:
    """Run many requests; yield their results in completion order, in lists of what is ready.

    Every id appears exactly once. Requests start as the pool has room (see :class:`_BatchRun`).
    Closing the iterator early (the client went away) cancels the outstanding requests, which aborts
    them on their instances.
    """
    results = _BatchRun(generator, items, _same).results()
    try:
        async for lines in results:
            yield lines
    finally:
        await results.aclose()


async def run_batch_ndjson(generator: Generator, items: list[tuple[Any, Request]],
                           max_unsent_bytes: int) -> AsyncGenerator[bytes, None]:
    """:func:`run_batch` as NDJSON bytes, for a caller's connection: at most about 64 KiB at a time, and no
    new request started while more than ``max_unsent_bytes`` of results wait for the caller to read them."""
    results = _BatchRun(generator, items, _ndjson_line, len, max_unsent_bytes, NDJSON_PIECE_BYTES).results()
    try:
        async for lines in results:
            yield b"".join(lines)
    finally:
        await results.aclose()


def _failure(rid: Any, exc: BaseException) -> BatchLine:
    """The line of a request that failed: its status for the manager's errors, 500 for anything else."""
    if isinstance(exc, ManagerError):
        return BatchLine.failed(rid, exc.status, str(exc))
    log.error("request %r failed unexpectedly", rid, exc_info=exc)  # never lose an id, whatever happened
    return BatchLine.failed(rid, 500, f"internal error: {exc}")


def _same(line: BatchLine) -> BatchLine:
    return line


def _ndjson_line(line: BatchLine) -> bytes:
    return jsonutil.dumps(line) + b"\n"
