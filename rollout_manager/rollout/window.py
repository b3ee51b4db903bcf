"""The sequences of one batched ``/generate`` start only as the pool can run them.

Started all at once, every sequence of a batch waits in the manager as a task and its state: about
3.8 kB each (docs/bounds.md has the measurement), so one 64 MB body of one-token prompts would hold
tens of GB while it waits. As ``/batch_generate_requests`` does (``batch._BatchRun``), a batch starts
what the dispatcher's capacity allows plus a lookahead, so a slot freed on an instance is taken at
once; the rest stay the decoded request's items (``rollout.request``), counted in
``Capacity.held_by_batches`` until they start.

Nor does a window start all it has room for in one event-loop turn: each start's first step is a
placement (about 0.65 ms at 1,000 instances), so 8,000 started at once blocked the loop, and with it
every probe, stream and caller, for seconds. :class:`TurnPacer` lets everything on one loop that starts
many requests start at most :data:`START_PER_TURN` per turn together, and resumes the rest on the next.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

from rollout_manager.placement.dispatch import Dispatcher

log = logging.getLogger("rollout_manager.rollout.window")

# Sequences (or requests) a batch starts beyond what the pool can run now, so that a slot freed on an
# instance is taken at once, from the dispatcher's queue, rather than after the batch's next turn.
LOOKAHEAD = 64
# Requests (or sequences) started per event-loop turn, by all batches on the loop together: their first
# steps (placements) run in the next turn, so that turn's block is about this many placements
# (docs/benchmarks.md, benchmark 10, has the measurement this was picked from).
START_PER_TURN = 64


class TurnPacer:
    """Shares :data:`START_PER_TURN` starts per event-loop turn among whatever starts many requests.

    A starter asks :meth:`allowance`, starts at most that many, and reports them with :meth:`spent`,
    passing its ``resume`` callback if it had more to start: ``resume`` runs on the next turn, from a
    callback scheduled after the turn's first starts, so those take their first step before it, with
    I/O polled in between. A turn thus runs about this many first steps (twice at worst, when starts
    come on both sides of that callback). Starters resume in the order they were held back, one that
    got none before one that got some. A ``resume`` must check that its starter still runs: it may
    have ended before its turn came.
    """

    def __init__(self) -> None:  # no reference to its loop: the loop's entry in ``_pacers`` would never go
        self.left = START_PER_TURN
        self.armed = False  # the next turn's callback is scheduled
        self.held: dict[Callable[[], None], None] = {}  # starters held back, in order, each once

    def allowance(self) -> int:
        return self.left

    def spent(self, started: int, resume: Callable[[], None] | None = None) -> None:
        self.left -= started
        if resume is not None:
            self.held[resume] = None
        if not self.armed and (started or self.held):
            self.armed = True
            asyncio.get_running_loop().call_soon(self._turn)

    def _turn(self) -> None:
        self.armed = False
        self.left = START_PER_TURN
        held, self.held = list(self.held), {}
        for n, resume in enumerate(held):
            if not self.left:  # the rest keep their places, ahead of those held back again this turn
                self.held = {**dict.fromkeys(held[n:]), **self.held}
                self.spent(0)
                return
            try:
                resume()  # one held back again is queued for the next turn
            except Exception:  # the others still get their turns
                log.exception("a batch could not start its next requests")


_pacers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, TurnPacer] = weakref.WeakKeyDictionary()


def pacer() -> TurnPacer:
    """The running loop's :class:`TurnPacer`: one per loop, shared by every batch on it."""
    loop = asyncio.get_running_loop()
    found = _pacers.get(loop)
    if found is None:
        found = _pacers[loop] = TurnPacer()
    return found


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
        dispatcher.capacity.hold(count)

    def fill(self) -> None:
        """Start what the pool has room for now: its capacity plus :data:`LOOKAHEAD`, less what every
        batch started and is still running (``Capacity.windowed``: this one's and the others', so that
        batched requests inside a ``/batch_generate_requests`` share one window rather than multiply
        it), and at least one of its own, so that every batch moves; at most what the loop's
        :class:`TurnPacer` allows this turn, and the rest on the next."""
        if self.closed:
            return
        capacity = self.dispatcher.capacity
        room = capacity.pool_bound() + LOOKAHEAD - capacity.windowed
        if not self.running:
            room = max(room, 1)
        paced = pacer()
        allowed = paced.allowance()
        started = 0
        while self.next < self.count and room > 0 and started < allowed:
            task = asyncio.ensure_future(self.start(self.next))
            self.next += 1
            capacity.start_windowed()
            room -= 1
            started += 1
            self.running.add(task)
            task.add_done_callback(self._ended)
        paced.spent(started, self.fill if room > 0 and self.next < self.count else None)

    def _ended(self, task: asyncio.Future[Any]) -> None:
        self.running.discard(task)
        self.dispatcher.capacity.end_windowed()
        self.done += 1
        if not task.cancelled() and task.exception() is not None and self.error is None:
            self.error = task.exception()
        self.wake.set()
        self.fill()  # its slot goes to the next one

    async def close(self) -> None:
        """Start nothing more; cancel what runs (which aborts it on its instance) and wait for it."""
        self.closed = True
        self.dispatcher.capacity.unhold(self.count - self.next)
        self.next = self.count
        tasks = list(self.running)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
