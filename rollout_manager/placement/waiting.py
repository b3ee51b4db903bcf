"""The requests waiting in the manager for an instance, and the order they are placed in.

The dispatcher parks a request here when no instance can take it now (every one full, or none active)
and places the queue in one pass whenever something changes, rather than waking every waiter to try
again: with thousands waiting and a thousand instances, that herd (each wake-up a full pick over the
pool) blocked the event loop for seconds. Who may take a request, and when a wait is over, stay the
dispatcher's; this module keeps the order and the pass.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from rollout_manager.instances.registry import Instance
from rollout_manager.placement.ask import Ask

__all__ = ["Waiter", "WaitQueue", "MAX_SKIPPED"]

MAX_SKIPPED = 32  # constrained requests one placing pass may step over


@dataclass(eq=False)
class Waiter:
    """A request waiting in the manager for an instance: what it asks, and its wait."""

    ask: Ask
    future: asyncio.Future[Instance]
    since: float  # when its wait for an instance began (``ask.since``, else dispatch.accepted_at, else its ask)
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)

    @property
    def tokens(self) -> int:
        return self.ask.tokens

    @property
    def predicted(self) -> float | None:
        """Tokens it is predicted to make on this placement (None: no prediction)."""
        return self.ask.predicted

    @property
    def high(self) -> float | None:
        """An upper quantile of what it makes, where the length model has evidence for one."""
        return self.ask.high

    @property
    def constrained(self) -> bool:
        return self.ask.constrained


class WaitQueue:
    """Waiters in the order they are offered: first come first served, or (``longest_first``: the makespan
    policy) ahead of every waiter predicted shorter, one without a prediction counting as shortest, so the
    policy's greedy placement is longest-processing-time-first."""

    def __init__(self, longest_first: bool = False) -> None:
        self.longest_first = longest_first
        self._queue: deque[Waiter] = deque()
        self._placing = False

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __contains__(self, waiter: Waiter) -> bool:
        return waiter in self._queue

    def add(self, waiter: Waiter) -> None:
        queue = self._queue
        predicted = waiter.predicted
        if not self.longest_first or predicted is None:
            queue.append(waiter)
            return
        at = len(queue)
        while at > 0:  # from the back: arrivals of one step come with similar predictions, so this is short
            ahead = queue[at - 1].predicted
            if ahead is not None and ahead >= predicted:
                break
            at -= 1
        queue.insert(at, waiter)

    def head(self) -> Waiter | None:
        """The next waiter to be offered (None: nobody waits)."""
        for waiter in self._queue:
            if not waiter.future.done():
                return waiter
        return None

    def waiters(self) -> list[Waiter]:
        """The waiters still waiting, in the order they are offered (the fleet's demand reads them)."""
        return [w for w in self._queue if not w.future.done()]

    def leave(self, waiter: Waiter) -> None:
        """``waiter`` stopped waiting (placed, timed out or cancelled): dropped now if it is behind others
        (rare), else with the done waiters at the head."""
        queue = self._queue
        if waiter in queue and queue[0] is not waiter:
            queue.remove(waiter)
        while queue and queue[0].future.done():
            queue.popleft()

    def place(self, try_place: Callable[[Waiter], Instance | None], closed: Callable[[], Exception | None]) -> None:
        """Place waiters in order until one cannot be placed (``try_place`` None); ``closed()``: the error
        every waiter left fails with once nothing more is placed (None: open).

        A waiter that cannot be placed blocks those behind it (under the policy's limits the ones behind
        would not fit either), unless it carries its own constraints (instances to avoid, a staleness
        bound): up to :data:`MAX_SKIPPED` such waiters are stepped over, so one of them cannot hold up the
        rest. Not reentrant: a placement that changes load calls back here and returns at once.
        """
        if self._placing or not self._queue:
            return
        self._placing = True
        queue = self._queue
        skipped: list[Waiter] = []
        try:
            while queue:
                waiter = queue[0]
                if waiter.future.done():
                    queue.popleft()
                    continue
                error = closed()
                if error is not None:
                    waiter.future.set_exception(error)
                    continue
                inst = try_place(waiter)
                if inst is not None:
                    queue.popleft()
                    waiter.future.set_result(inst)
                    continue
                if not waiter.constrained or len(skipped) >= MAX_SKIPPED:
                    break
                skipped.append(queue.popleft())
        finally:
            queue.extendleft(reversed(skipped))
            self._placing = False
