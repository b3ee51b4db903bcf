"""When an engine owes a ``/generate`` call its next chunk (:class:`Deadline`), and the one timer that
checks every call in flight (:class:`DeadlineClock`). Used by the relay (:mod:`.relay`)."""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable
from typing import Protocol


class Timed(Protocol):
    """A call in a :class:`DeadlineClock`: ``armed`` is its entry's token (0: none)."""

    armed: int

    def on_due(self) -> None:
        """Its entry came due (the clock cleared ``armed`` first)."""


class BoxBytes:
    """The bytes of unfinished frames (or answers) held at once for one instance's calls, and their bound.

    Each call is bounded by its frame bound (``engine_max_frame_mb``); a box that babbles on many calls at
    once would still hold that much for every one of them, so a broken box could fill the manager's memory.
    The bound here is the manager's own limit, not a rule the box broke: many large frames at once (routed
    experts' final frames, thousands of positions each) are a healthy box's answers. So a call that would
    take the box's calls past ``limit`` is not failed: the first becomes the ``holder`` and reads on, to the
    end of its frame or to its own frame bound (which is the box's fault); the others wait (:meth:`room`)
    until the holder's frame is done or the calls hold less than ``limit`` again. A waiting call does not
    read, so its connection stops reading from the socket, and the box's calls hold at most ``limit`` plus
    one frame plus a socket read each.
    """

    __slots__ = ("limit", "held", "holder", "waiting")

    def __init__(self, limit: int | None) -> None:
        self.limit = limit  # None: no bound
        self.held = 0
        self.holder: Deadline | None = None  # the one call reading on past the bound
        self.waiting: list[tuple[Deadline, asyncio.Future[None]]] = []

    def room(self, deadline: Deadline) -> asyncio.Future[None]:
        """Done when ``deadline``'s call may read on (it was told to wait: ``deadline.blocked``)."""
        waiter = deadline.loop.create_future()
        self.waiting.append((deadline, waiter))
        if self.holder is None:  # the one reading on finished meanwhile
            self._next()
        return waiter

    def _next(self) -> None:
        """The holder is done: under the bound again, every waiting call reads on; else the longest waiting
        one becomes the holder (one at a time, so the calls that wait add no more than they hold now)."""
        if self.limit is None or self.held <= self.limit:
            waiting, self.waiting = self.waiting, []
            for deadline, waiter in waiting:
                deadline.blocked = False
                if not waiter.done():
                    waiter.set_result(None)
            return
        while self.waiting:
            deadline, waiter = self.waiting.pop(0)
            if not waiter.done():  # not given up on
                deadline.blocked = False
                self.holder = deadline
                waiter.set_result(None)
                return

    def leave(self, deadline: Deadline) -> None:
        """``deadline``'s call is over: it neither waits nor holds the right to read on."""
        if deadline.blocked:
            self.waiting = [w for w in self.waiting if w[0] is not deadline]
        if self.holder is deadline:
            self.holder = None
        if self.holder is None and self.waiting:
            self._next()


class Deadline:
    """When the instance owes a call its next complete chunk, and what to say when it is late.

    Before the first chunk: ``first_s`` after the request, or after the instance last sent a chunk to
    any request (``activity``, loop time) when that is later, for an instance that serves others is
    alive and this request waits in its queue; never later than ``stall_s`` after the request. After
    a chunk: ``stall_s`` after the last one. Bytes that complete no frame do not count, so an engine
    that trickles bytes is cut off like a silent one. A chunk only records its time; the call
    re-arms itself in the clock when it finds the deadline moved.
    """

    __slots__ = ("loop", "started", "first_s", "stall_s", "activity", "last", "chunks", "headers", "unframed",
                 "box", "blocked")

    def __init__(self, first_s: float, stall_s: float, activity: Callable[[], float] | None,
                 box: BoxBytes | None = None):
        self.loop = asyncio.get_running_loop()
        self.started = self.loop.time()
        self.first_s, self.stall_s = min(first_s, stall_s), stall_s
        self.activity = activity
        self.last: float | None = None  # when the last chunk came
        self.chunks = 0
        self.headers = False  # the status line and headers came
        self.unframed = 0  # bytes of an unfinished frame (or answer) the reader holds now (:meth:`hold`)
        self.box = box  # what the instance's calls hold together (None: not counted)
        self.blocked = False  # the call must wait before it reads on (BoxBytes.room)

    def hold(self, n: int) -> None:
        """The reader now holds ``n`` bytes of an unfinished frame (or answer) of this call (0: none, as
        when the call ends). When that takes the instance's calls past their bound together, this call
        either reads on as the box's one ``holder`` or is ``blocked`` until there is room (:class:`BoxBytes`)."""
        box = self.box
        if box is None:
            self.unframed = n
            return
        grew = n > self.unframed
        box.held += n - self.unframed
        self.unframed = n
        if grew:
            if box.limit is not None and box.held > box.limit and box.held > n:
                if box.holder is None:
                    box.holder = self
                elif box.holder is not self:
                    self.blocked = True
        elif box.holder is self or (n == 0 and self.blocked):  # its frame is done, or the call is over
            box.leave(self)

    def chunk(self, n: int = 1) -> None:
        """``n`` complete chunks came."""
        self.last = self.loop.time()
        self.chunks += n

    def due(self) -> float:
        if self.last is not None:
            return self.last + self.stall_s
        since = self.started
        if self.activity is not None:
            since = max(since, self.activity())
        return min(since + self.first_s, self.started + self.stall_s)

    def restart(self) -> None:
        """Nothing was sent yet (the manager waited on its own limits): the instance owes nothing so far."""
        self.started = self.loop.time()

    def describe(self) -> str:
        """What happened, in measured times, with the bound that ended it."""
        now = self.loop.time()
        partial = f"; {self.unframed} byte(s) of an unfinished frame came meanwhile" if self.unframed else ""
        if self.last is not None:
            stalled = "" if self.unframed else "stalled; "  # nothing at all came since: the engine stalled
            return (f"no complete chunk for {now - self.last:.1f}s after {self.chunks} chunk(s) "
                    f"({stalled}stream_stall_timeout_s={self.stall_s:g}){partial}")
        waited = now - self.started
        what = "no first chunk" if self.headers else "no answer at all (not even the HTTP status)"
        busy = self.activity() if self.activity is not None else self.started
        if busy + self.first_s > self.started + self.stall_s:  # the instance served others: queueing, up to stall_s
            return (f"{what} after {waited:.1f}s, while the instance kept sending chunks to other requests "
                    f"(stream_stall_timeout_s={self.stall_s:g}){partial}")
        silent = now - max(busy, self.started)
        return (f"{what} after {waited:.1f}s, and nothing from the instance to any request for {silent:.1f}s "
                f"(engine_first_byte_timeout_s={self.first_s:g}){partial}")


class DeadlineClock:
    """The deadlines of every call in flight on one loop, under one loop timer.

    Not a loop timer per call (uvloop's cost about 0.5 KB each, for as long as a sequence streams): a
    heap of ``(due, token, call)``; an entry counts only while the call's ``armed`` is its token, so
    re-arming or ending a call leaves its old entry to be skipped (:meth:`dropped` counts them, and the
    heap is rebuilt without them once they are the majority). As a loop timer would: an entry is looked
    at (``on_due``) no earlier than its due time, the loop's clock resolution aside; a call whose
    deadline moved meanwhile re-arms itself.
    """

    __slots__ = ("loop", "heap", "handle", "handle_at", "tokens", "stale")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.heap: list[tuple[float, int, Timed]] = []
        self.handle: asyncio.TimerHandle | None = None
        self.handle_at = 0.0
        self.tokens = itertools.count(1)
        self.stale = 0  # entries in the heap that no longer count

    def add(self, due: float, conn: Timed) -> int:
        """Look at ``conn`` at ``due``; returns the entry's token (for ``conn.armed``)."""
        token = next(self.tokens)
        heapq.heappush(self.heap, (due, token, conn))
        if self.handle is None or due < self.handle_at:
            if self.handle is not None:
                self.handle.cancel()
            self.handle, self.handle_at = self.loop.call_at(due, self._fire), due
        return token

    def dropped(self) -> None:
        """One entry no longer counts."""
        self.stale += 1
        if self.stale > 256 and 2 * self.stale > len(self.heap):
            self.heap = [e for e in self.heap if e[2].armed == e[1]]
            heapq.heapify(self.heap)
            self.stale = 0

    def _fire(self) -> None:
        heap, fired_at = self.heap, self.handle_at
        self.handle = None
        upto = max(self.loop.time(), fired_at)
        while heap and heap[0][0] <= upto:
            _, token, conn = heapq.heappop(heap)
            if conn.armed != token:
                self.stale = max(self.stale - 1, 0)
                continue
            conn.armed = 0
            conn.on_due()
        if heap and self.handle is None:
            self.handle, self.handle_at = self.loop.call_at(heap[0][0], self._fire), heap[0][0]
