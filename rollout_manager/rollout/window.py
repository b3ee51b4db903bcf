"""The sequences of one batched ``/generate`` start only as the pool can run them.

Started all at once, every sequence of a batch waits in the manager as a task and its state: about
3.8 kB each (docs/bounds.md has the measurement), so one 64 MB body of one-token prompts would hold
tens of GB while it waits. As ``/batch_generate_requests`` does (``batch._BatchRun``), a batch starts
what the dispatcher's capacity allows plus a lookahead, so a slot freed on an instance is taken at
once; the rest stay the decoded request's items (``rollout.request``), counted in
``Dispatcher.held_by_batches`` until they start.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from rollout_manager.rollout.dispatch import Dispatcher

# Sequences (or requests) a batch starts beyond what the pool can run now, so that a slot freed on an
# instance is taken at once, from the dispatcher's queue, rather than after the batch's next turn.
LOOKAHEAD = 64


class StartWindow:
    """Runs ``start(i)`` for ``i`` in ``range(count)``, at most the pool's capacity plus
    :data:`LOOKAHEAD` at a time; ``wake`` is set whenever one ends, ``error`` holds the first failure."""

    def __init__(self, dispatcher: Dispatcher, count: int, start: Callable[[int], Awaitable[Any]]) -> None:
        self.dispatcher = dispatcher
        self.count = count
        self.start = start
        self.next = 0  # the next index to start
        self.done = 0
        self.running: set[asyncio.Future[Any]] = set()
        self.wake = asyncio.Event()
        self.error: BaseException | None = None
        self.closed = False
        dispatcher.held_by_batches += count

    def fill(self) -> None:
        """Start what the pool has room for now: its capacity plus :data:`LOOKAHEAD`, less what every
        batch started and is still running (``Dispatcher.windowed``: this one's and the others', so that
        batched requests inside a ``/batch_generate_requests`` share one window rather than multiply
        it), and at least one of its own, so that every batch moves."""
        d = self.dispatcher
        room = d.capacity() + LOOKAHEAD - d.windowed
        if not self.running:
            room = max(room, 1)
        while not self.closed and self.next < self.count and room > 0:
            task = asyncio.ensure_future(self.start(self.next))
            self.next += 1
            d.held_by_batches -= 1
            d.windowed += 1
            room -= 1
            self.running.add(task)
            task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Future[Any]) -> None:
        self.running.discard(task)
        self.dispatcher.windowed -= 1
        self.done += 1
        if not task.cancelled() and task.exception() is not None and self.error is None:
            self.error = task.exception()
        self.wake.set()
        self.fill()  # its slot goes to the next one

    async def close(self) -> None:
        """Start nothing more; cancel what runs (which aborts it on its instance) and wait for it."""
        self.closed = True
        self.dispatcher.held_by_batches -= self.count - self.next
        self.next = self.count
        tasks = list(self.running)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
