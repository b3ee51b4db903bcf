"""Dispatch: which instance serves the next sequence, and waiting until one can.

The manager sends every request itself, so it knows what runs where; the pure policies (one module each,
``policy_registry``) decide from the figures the fleet model keeps (``fleet_model.FleetModel``: rates, box
speeds, predicted work) within the bounds capacity keeps (``capacity.Capacity``: in flight, reservations,
the waiting queue). The dispatcher ties them together: it filters the candidates, asks the policy, reserves
the choice, and parks what cannot be placed until something changes.

A request waiting because every instance that could take it is full waits as long as it takes; only one that
no instance could serve at all fails after the wait timeout. An instance the request already failed on does
not count as one that could take it: a sequence whose only instances are those that failed it ends at the
wait timeout, whatever their health probes say, rather than wait on them for ever.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Callable, Collection
from typing import Protocol

from rollout_manager.errors import Unavailable
from rollout_manager.instances.registry import Event, Instance, Kind, Registry, State
from rollout_manager.notify import Signal
from rollout_manager.placement.affinity import AffinitySettings, AffinityTable, overloaded
from rollout_manager.placement.ask import Ask
from rollout_manager.placement.capacity import Capacity
from rollout_manager.placement.fleet_model import FleetModel
from rollout_manager.placement.instance_load import InstanceLoad
from rollout_manager.placement.local_budget import LocalWindow
from rollout_manager.placement.makespan import Makespan
from rollout_manager.placement.policy import PlacementPolicy
from rollout_manager.placement.waiting import Waiter

# When the caller's request entered the manager (monotonic), for a request started later than that
# (run_batch holds a batch's requests back until there is room): its wait for an instance counts from
# then. Unset: from the moment it asks.
accepted_at: contextvars.ContextVar[float | None] = contextvars.ContextVar("accepted_at", default=None)


class EvacuatingBoxes(Protocol):
    """Boxes with a preemption notice that still take what they are predicted to finish in time
    (``rollout.evacuation.Evacuator``)."""

    generation: int  # moves on whenever what they may take is made again (every evacuation tick)

    def admitting(self, ask: Ask) -> list[Instance]: ...

    def taken(self, inst: Instance, ask: Ask) -> None: ...

    def room(self) -> bool: ...


class Dispatcher:
    def __init__(self, registry: Registry, policy: PlacementPolicy, *, clock: Callable[[], float] = time.monotonic,
                 max_in_flight_per_instance: int = 0, max_in_flight_total: int = 0, gather_s: float = 0.0,
                 share: tuple[int, int] = (0, 1)):
        """``max_in_flight_per_instance``, ``max_in_flight_total``: the bounds (``Capacity``). ``gather_s``: under
        the makespan policy, a burst of predicted requests is placed this long after its first arrives (0: at the
        end of that event-loop turn), so a step's requests, which come over many turns, go longest predicted first.
        ``share``: this relay's part of each instance's bound (``Capacity``)."""
        self.gather_s = gather_s
        self.registry = registry
        self.policy = policy
        self.clock = clock
        # In flight, bounds, reservations and the queue of requests waiting for room (placement.capacity).
        self.capacity = Capacity(registry, max_in_flight_per_instance=max_in_flight_per_instance,
                                 max_in_flight_total=max_in_flight_total, longest_first=isinstance(policy, Makespan),
                                 share=share)
        # What the policies read of each box: rates, speeds, predicted work, idle time (placement.fleet_model).
        self.fleet = FleetModel(registry, clock)
        self._none_since: float | None = clock()  # since when no instance is active (None: one is)
        self.changed = Signal()  # any change in who can take work, or in load
        self.local = LocalWindow(on_change=self._changed)  # while open, local instances serve first
        self.closing = False
        self._soon = False  # a placing pass is scheduled for the end of this event-loop turn (see acquire)
        # Affinity (None: off): which instance holds which trajectory's or prompt's prefix.
        self.affinity: AffinityTable | None = None
        # Narrows the clean remote boxes with room for a sequence predicted to make the tokens given (None: no
        # prediction), e.g. the longest onto non-preemptible boxes (placement.preemptible); None: no narrowing.
        self.narrow_remote: Callable[[list[Instance], float | None], list[Instance]] | None = None
        self.evacuating: EvacuatingBoxes | None = None  # evacuating boxes that may take a sequence (None: none)
        self._evacuation_offered = -1  # the evacuations' generation the queue was last offered to them at
        self.makespan = policy if isinstance(policy, Makespan) else None
        registry.listeners.append(self._on_event)

    def enable_affinity(self, settings: AffinitySettings | None = None) -> AffinityTable:
        self.affinity = AffinityTable(settings)
        return self.affinity

    def _on_event(self, inst: Instance, event: Event) -> None:
        self.capacity.rebound(inst)
        self.fleet.on_event(inst, event)
        if event.new == State.ACTIVE:
            self._none_since = None
        elif event.old == State.ACTIVE and not self.registry.in_state(State.ACTIVE):
            self._none_since = self.clock()
        if event.new == State.DEAD and self.affinity is not None:
            self.affinity.forget_instance(inst.id)
        self._changed()

    def _changed(self) -> None:
        """Who can take work, or the load, changed: wake the generic waiters, place queued requests."""
        self.changed.notify()
        self._place_waiting()

    def recovered(self, inst: Instance) -> None:
        """``inst`` recovered from failures (a probe or a request succeeded there): requests that avoided
        it may be placed there now. Not a registry transition, so nothing else would tell the queue."""
        self._changed()

    def _usable(self, avoid: Collection[str], allow: Callable[[Instance], bool] | None) -> list[Instance]:
        """Active instances that may serve a request (full or not): those it need not avoid and may use,
        local ones only while the local window is open."""
        local_ok = self.local.is_open
        return [i for i in self.registry.in_state(State.ACTIVE)
                if (i.id not in avoid or i.health.consecutive_failures == 0) and (allow is None or allow(i))
                and (local_ok or i.kind == Kind.REMOTE)]

    def try_acquire(self, ask: Ask) -> Instance | None:
        """Pick an instance for ``ask`` now, or None. Local (trainer-side) instances are offered the work first.

        An instance this sequence already failed on (``ask.avoid``) is used again only once it has recovered (a
        health check or another request succeeded there); instances with recent failures get work
        only when no clean instance is there. ``ask.prefer`` (affinity: it holds the request's prefix)
        wins while it is clean and not overloaded; ``ask.allow`` restricts the candidates. Under the makespan
        policy the policy itself weighs ``prefer`` (staying where the prefix is cached) against moving, priced
        at one prefill of ``ask.context``, and places by ``ask.predicted`` and ``ask.high``.
        """
        capacity = self.capacity
        if capacity.in_flight >= capacity.max_in_flight_total:
            return None
        tokens, avoid, prefer, allow = ask.tokens, ask.avoid, ask.prefer, ask.allow
        predicted, context, high = ask.predicted, ask.context, ask.high
        local_ok = self.local.is_open
        bound_of, remote_kind, active = capacity.bound_of, Kind.REMOTE, State.ACTIVE
        # One pass over the pool (this runs for every sequence): what _usable admits, less the full ones,
        # each group split into clean instances and those with recent failures.
        local_clean: list[Instance] = []
        local_failing: list[Instance] = []
        remote_clean: list[Instance] = []
        remote_failing: list[Instance] = []
        for i in self.registry.active():
            failures = i.health.consecutive_failures
            if i.state is not active or (failures and i.id in avoid) or (allow is not None and not allow(i)):
                continue
            if i.kind is remote_kind:
                if i.load.in_flight < bound_of(i):
                    (remote_failing if failures else remote_clean).append(i)
            elif local_ok and i.load.in_flight < bound_of(i):
                (local_failing if failures else local_clean).append(i)
        if self.evacuating is not None:  # a box with a notice, for what it is predicted to finish before its end
            remote_clean += self._evacuating_for(ask)
        if self.narrow_remote is not None and len(remote_clean) > 1:  # the step's tail off boxes that may vanish
            remote_clean = self.narrow_remote(remote_clean, predicted if high is None else high)
        now = self.clock()
        groups = ((local_clean, local_failing), (remote_clean, remote_failing))
        for clean, failing in groups if local_clean or local_failing else groups[1:]:
            loads = self.fleet.loads_of(clean or failing, now)  # once per group, for both decisions
            if self.makespan is not None:
                inst = self._place(loads, tokens, now, predicted, prefer if clean else None, context, high)
            else:
                inst = self._preferred(clean, loads, prefer, tokens, now) if prefer is not None and clean else None
                inst = inst or self._pick(loads, tokens, now)
            if inst is not None:
                if inst.state is State.EVACUATING and self.evacuating is not None:
                    self.evacuating.taken(inst, ask)
                return inst
        return None

    def _evacuating_for(self, ask: Ask) -> list[Instance]:
        """The evacuating boxes that admit ``ask`` (``EvacuatingBoxes``) and have room for it."""
        assert self.evacuating is not None
        allow, bound_of = ask.allow, self.capacity.bound_of
        return [i for i in self.evacuating.admitting(ask) if i.load.in_flight < bound_of(i)
                and not i.health.consecutive_failures and (allow is None or allow(i))]

    def _place_on_evacuating(self) -> None:
        """Offer what still waits, in the queue's order, to the evacuating boxes alone. The queue stops at its
        first request that fits nowhere (the ones behind would not fit either), but a box with a notice takes
        only what it is predicted to finish in time, so a short request behind a long one may go there. Once per
        generation of their admissions (an evacuation tick) while one has room: a pass scans the whole queue."""
        evacuating, capacity = self.evacuating, self.capacity
        if (evacuating is None or not capacity.queued() or self.closing
                or evacuating.generation == self._evacuation_offered or not evacuating.room()):
            return
        self._evacuation_offered = evacuating.generation
        for w in capacity.waiters():
            if capacity.in_flight >= capacity.max_in_flight_total:
                return
            ask = w.ask
            boxes = self._evacuating_for(ask)
            if not boxes:
                continue
            now = self.clock()
            loads = self.fleet.loads_of(boxes, now)
            if self.makespan is not None:
                inst = self._place(loads, ask.tokens, now, ask.predicted, None, ask.context, ask.high)
            else:
                inst = self._pick(loads, ask.tokens, now)
            if inst is not None:
                evacuating.taken(inst, ask)
                w.future.set_result(inst)

    def _preferred(self, clean: list[Instance], loads: list[InstanceLoad], prefer: str, tokens: int,
                   now: float) -> Instance | None:
        at = next((k for k, i in enumerate(clean) if i.id == prefer), None)
        if at is None:
            return None
        settings = self.affinity.settings if self.affinity is not None else AffinitySettings()
        if overloaded(loads[at], loads, tokens, self.policy, settings.max_slowdown):
            return None
        mine = clean[at]
        self._reserve(mine, tokens, now)
        return mine

    def _pick(self, loads: list[InstanceLoad], tokens: int, now: float) -> Instance | None:
        if not loads:
            return None
        chosen = self.policy.pick(loads, tokens, now)
        inst = self.registry.get(chosen) if chosen else None
        if inst is None:
            return None
        self._reserve(inst, tokens, now)
        return inst

    def _place(self, loads: list[InstanceLoad], tokens: int, now: float, predicted: float | None,
               prefer: str | None, context: int | None, high: float | None = None) -> Instance | None:
        policy = self.makespan
        assert policy is not None
        chosen = policy.place(loads, tokens, now, predicted, prefer, context, high) if loads else None
        inst = self.registry.get(chosen) if chosen else None
        if inst is None:
            return None
        self.fleet.placed(inst.id, policy.counted(tokens, predicted, high), predicted)
        self._reserve(inst, tokens, now)
        return inst

    def _reserve(self, inst: Instance, tokens: int, now: float) -> None:
        self.capacity.reserve(inst, tokens)
        self.fleet.busy_changed(inst, now)

    async def acquire(self, ask: Ask, timeout_s: float) -> Instance:
        """Wait until the policy places this sequence, within the bounds; raises Unavailable when no
        instance could serve it for ``timeout_s``.

        The wait counts from ``ask.since`` (a sequence's first failure in a row: its retries share one
        wait), else :data:`accepted_at`, else now, and only while no instance could take the request at
        all: while some could but are full, it waits for their capacity, however long (see
        :meth:`_expire`). Instances in ``ask.avoid`` (it failed there) may take it again once they recovered,
        but never count as ones that could: past the wait it fails rather than try them again.

        Requests that cannot be placed at once wait in capacity's ``WaitQueue`` (arrival order; under
        the makespan policy longest predicted first), placed in one pass whenever something changes
        (:meth:`_place_waiting`).
        """
        if self.closing:
            raise Unavailable("rollout manager is shutting down; no new work is placed")
        now = self.clock()
        since = ask.since
        if since is None:
            since = accepted_at.get()
        since = now if since is None else min(since, now)
        if self._left(since, timeout_s, now) <= 0 and not self._fresh(ask.avoid, ask.allow):
            raise self._unavailable(timeout_s)  # its wait is over, and only instances that failed it are left
        # Under the makespan policy a predicted request always queues and the queue is placed at the end of
        # this event-loop turn: a step's requests arrive together, and so are placed longest predicted first.
        burst = self.makespan is not None and ask.predicted is not None
        if not self.capacity.queued() and not burst:  # nobody is waiting ahead of it
            inst = self.try_acquire(ask)
            if inst is not None:
                return inst
        loop = asyncio.get_running_loop()
        waiter = Waiter(ask, loop.create_future(), since)
        self.capacity.park(waiter)
        self._arm(waiter, waiter.since + timeout_s - now, timeout_s)
        try:
            if burst:
                if not self._soon:
                    self._soon = True
                    if self.gather_s > 0:
                        loop.call_later(self.gather_s, self._place_soon)
                    else:
                        loop.call_soon(self._place_soon)
            else:
                self._place_waiting()  # it may fit now (a queue stuck on constrained requests)
            return await waiter.future
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
                self.release(waiter.future.result(), ask.tokens)  # placed just as its caller went away
            raise
        finally:
            if waiter.timer is not None:
                waiter.timer.cancel()
            if not waiter.future.done():
                waiter.future.cancel()
            self.capacity.unpark(waiter)

    def _place_soon(self) -> None:
        self._soon = False
        self._place_waiting()

    def _arm(self, waiter: Waiter, delay_s: float, timeout_s: float) -> None:
        waiter.timer = asyncio.get_running_loop().call_later(max(delay_s, 0.0), self._expire, waiter, timeout_s)

    def _expire(self, waiter: Waiter, timeout_s: float) -> None:
        """The waiter's deadline: it fails only if no instance could serve it for ``timeout_s``.

        Some instance it did not fail on could take it but all are full (their bounds, the overall
        bound, the policy's limits): it waits for capacity, and the time does not count; a caller who
        sent 100,000 requests wants them done, not failed. Otherwise the time without any active instance
        counts from when the pool last had one (or the wait began, if later), and instances it failed on
        do not stop the clock even once they recovered: a sequence an engine fails every time it is
        tried there would otherwise wait for ever.
        """
        if waiter.future.done():
            return
        if self._fresh(waiter.ask.avoid, waiter.ask.allow):
            self._place_waiting()  # room may have come without a change the queue was told of
            if not waiter.future.done():
                self._arm(waiter, timeout_s, timeout_s)  # waiting for capacity: look again a timeout later
            return
        left = self._left(waiter.since, timeout_s, self.clock())
        if left > 0:  # the pool emptied while it waited: the time without an instance counts from then
            self._arm(waiter, left, timeout_s)
            return
        waiter.future.set_exception(self._unavailable(timeout_s))

    def _fresh(self, avoid: Collection[str], allow: Callable[[Instance], bool] | None) -> bool:
        """Whether an instance the request did not fail on could serve it (full or not)."""
        return any(i.id not in avoid for i in self._usable(avoid, allow))

    def _left(self, since: float, timeout_s: float, now: float) -> float:
        """What is left of a wait that began at ``since``; the time without any active instance counts
        only from when the pool last had one."""
        start = since if self._none_since is None else max(since, self._none_since)
        return timeout_s - (now - start)

    def _unavailable(self, timeout_s: float) -> Unavailable:
        active = len(self.registry.in_state(State.ACTIVE))
        return Unavailable(f"no rollout instance could take the request within {timeout_s:g}s ({active} active)")

    def _place_waiting(self) -> None:
        """Place queued requests in order until one cannot be placed (``WaitQueue.place``)."""
        self.capacity.place(self._try_waiter, self._closed)
        self._place_on_evacuating()

    def offer_waiting(self) -> None:
        """Offer what waits again, after a change no registry event or release told of (an evacuation's
        admissions made again)."""
        self._place_waiting()

    def _try_waiter(self, w: Waiter) -> Instance | None:
        return self.try_acquire(w.ask)

    def _closed(self) -> Exception | None:
        return Unavailable("rollout manager is shutting down; no new work is placed") if self.closing else None

    def close(self) -> None:
        """The manager is shutting down: place no more work; waiting requests fail now."""
        self.closing = True
        self._changed()

    def progress(self, inst: Instance, tokens: int, chunk_at: float, timed: bool = False) -> None:
        """A chunk with ``tokens`` new tokens (0 or more) came from ``inst`` at event-loop time ``chunk_at``.
        One call per chunk: the chunk's time and its tokens' load in one place. ``timed``: the caller times
        its sequence's chunks itself (``FleetModel.step_gap``); else the box's chunks are windowed
        (``BoxSpeeds.observe``)."""
        self.capacity.made(inst, tokens, chunk_at)
        if tokens:
            self.fleet.made(inst, tokens, timed)

    def release(self, inst: Instance, tokens_left: int) -> None:
        """A sequence left ``inst`` (finished or failed) with ``tokens_left`` of its budget unused."""
        self.fleet.ending(inst)
        self.capacity.release(inst, tokens_left)
        self.fleet.busy_changed(inst, self.clock())
        self._changed()

    def waiting_predicted(self) -> float | None:
        """What the next request to be placed is predicted to make: the head of the queue's prediction, else
        (a batch's requests held back, or none predicted) the last one placed with a prediction."""
        head = self.capacity.head()
        return head.predicted if head is not None and head.predicted is not None else self.fleet.last_predicted

    def claim(self, inst: Instance, tokens: int, over: int = 0) -> bool:
        """Reserve ``inst`` for a sequence tail migration moves there, past the dispatch policy (the
        migration policy chose it); False if it cannot take work now, or is ``over`` past its bound (a swap
        while requests wait: the box takes the sequence into its next free slot, and no waiting request is
        placed there meanwhile, since the box is past its bound)."""
        if self.closing or inst.state != State.ACTIVE or self.registry.get(inst.id) is not inst:
            return False
        if not self.capacity.claim(inst, tokens, over):
            return False
        self.fleet.busy_changed(inst, self.clock())
        return True
