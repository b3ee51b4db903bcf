"""Dispatch accounting: which instance serves the next sequence, and the load it carries.

The manager sends every request itself, so it counts in-flight requests and tokens per instance and
measures token rates from its own streams; the pure policy in ``scheduling.py`` decides from those
numbers. Requests wait here while no instance can take them.

Admission is bounded here, whatever the policy says: an instance gets at most its own
``max_running_requests`` (what SGLang runs at once; more would only queue inside the engine, where a
failure loses them and its connections pile up) and the whole pool at most ``max_in_flight_total``
(each sequence in flight holds one of the manager's connections and its buffers). Past either bound
requests wait here, first come first served. A request waiting because every instance that could take
it is full waits as long as it takes; only one that no instance could serve at all fails after the
wait timeout. An instance the request already failed on does not count as one that could take it: a
sequence whose only instances are those that failed it ends at the wait timeout, whatever their health
probes say, rather than wait on them for ever.

Each instance's ``Load`` (in flight, tokens reserved, its bound, its last chunk's time) is written here
only; everyone else reads it.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Callable, Collection

from rollout_manager.errors import Unavailable
from rollout_manager.instances.registry import Event, Instance, Kind, Registry, State
from rollout_manager.notify import Signal
from rollout_manager.osutil import open_file_limit
from rollout_manager.placement.affinity import AffinitySettings, AffinityTable, overloaded
from rollout_manager.placement.ask import Ask
from rollout_manager.placement.box_speed import BoxCurve, BoxSpeeds, StepModel
from rollout_manager.placement.instance_load import InstanceLoad
from rollout_manager.placement.local_budget import LocalWindow
from rollout_manager.placement.makespan import BoxWork, Makespan
from rollout_manager.placement.policy import PlacementPolicy
from rollout_manager.placement.rate_meter import TokenRateMeter, lone_rate_weight
from rollout_manager.placement.waiting import Waiter, WaitQueue

_RATE_REUSE_S = 0.01  # how long a computed rate is reused while its meter does not change
_UNKNOWN = object()  # not in the rate cache (None there is a rate not yet measured)
# In flight on an instance that reports no max_running_requests (an SGLang older than the field, a
# stand-in engine): SGLang's own default on a mid-sized GPU is of this order.
DEFAULT_INSTANCE_MAX_IN_FLIGHT = 1024
# The most sequences in flight at once when no bound is configured, whatever the open-file limit: each
# costs the manager tens of kB (a connection, its buffers, the sequence), and one event loop relays them.
MAX_IN_FLIGHT_TOTAL_CEILING = 65536

# When the caller's request entered the manager (monotonic), for a request started later than that
# (run_batch holds a batch's requests back until there is room): its wait for an instance counts from
# then. Unset: from the moment it asks.
accepted_at: contextvars.ContextVar[float | None] = contextvars.ContextVar("accepted_at", default=None)


def default_max_in_flight_total(soft_open_files: int | None = None) -> int:
    """The overall bound when none is configured: what the open-file limit leaves for connections to
    instances. Half of it is callers' (api.connections); of the other half a reserve stays for health
    probes, weight agents and logs."""
    soft = open_file_limit()[0] if soft_open_files is None else soft_open_files
    if soft <= 0:  # unlimited or unknown
        return MAX_IN_FLIGHT_TOTAL_CEILING
    return max(min(soft // 2 - min(soft // 8, 1024), MAX_IN_FLIGHT_TOTAL_CEILING), 16)


# Box curves kept across restarts (Dispatcher.speed_curves): every box of a large fleet, and a bound on the
# addresses of boxes that never come back (preemptible ones return elsewhere).
MAX_REMEMBERED_CURVES = 4096


class Dispatcher:
    def __init__(self, registry: Registry, policy: PlacementPolicy, *, clock: Callable[[], float] = time.monotonic,
                 max_in_flight_per_instance: int = 0, max_in_flight_total: int = 0, gather_s: float = 0.0):
        """``max_in_flight_per_instance``: 0 takes each instance's own ``max_running_requests`` (or
        :data:`DEFAULT_INSTANCE_MAX_IN_FLIGHT` where it reports none); N caps every instance at N too.
        ``max_in_flight_total``: 0 takes :func:`default_max_in_flight_total`. ``gather_s``: under the makespan
        policy, a burst of predicted requests is placed this long after its first arrives (0: at the end of
        that event-loop turn), so a step's requests, which come over many turns, go longest predicted first."""
        self.gather_s = gather_s
        self.registry = registry
        self.policy = policy
        self.clock = clock
        self.max_in_flight_per_instance = max_in_flight_per_instance
        self.max_in_flight_total = max_in_flight_total or default_max_in_flight_total()
        self.in_flight = 0  # sequences placed on an instance and not yet released, over every instance
        self.held_by_batches = 0  # requests a batch accepted and holds back until it has room (run_batch)
        self.windowed = 0  # sequences of batched /generate requests started and not yet ended (rollout.window)
        self._none_since: float | None = clock()  # since when no instance is active (None: one is)
        self.changed = Signal()  # any change in who can take work, or in load
        self.local = LocalWindow(on_change=self._changed)  # while open, local instances serve first
        self.closing = False
        self.meters: dict[str, TokenRateMeter] = {}
        self.streamed_tokens = 0  # every token relayed so far: a live tokens/s needs no finished sequence
        self._soon = False  # a placing pass is scheduled for the end of this event-loop turn (see acquire)
        self._rates: dict[str, float | None] = {}  # see _rate
        self._loads: dict[str, InstanceLoad] = {}  # see load_of
        self._rates_at = 0.0
        self.waiting = 0  # requests parked in acquire() because no instance can take them now
        self.last_predicted: float | None = None  # what the last sequence placed with a prediction was to make
        # Those requests (placement.waiting), first come first served; under makespan longest predicted first.
        self._queue = WaitQueue(longest_first=isinstance(policy, Makespan))
        self._idle_since: dict[str, float] = {}
        self._idle_s: dict[str, float] = {}
        # Tail migration: each instance's lone-sequence rate under the batch model of scheduling.py.
        self.batch_half = 64.0
        self.lone_meters: dict[str, TokenRateMeter] = {}
        # Affinity (None: off): which instance holds which trajectory's or prompt's prefix.
        self.affinity: AffinityTable | None = None
        # Narrows the clean remote boxes with room for a sequence predicted to make the tokens given (None: no
        # prediction), e.g. the longest onto non-preemptible boxes (placement.preemptible); None: no narrowing.
        self.narrow_remote: Callable[[list[Instance], float | None], list[Instance]] | None = None
        # Each instance's decode step time by running count, learned from its streams (box_speed), and,
        # under the makespan policy, what its sequences are predicted still to make (makespan.BoxWork).
        self.speeds = BoxSpeeds()
        self.remembered_speeds: dict[str, StepModel] = {}  # by endpoint, from before a restart (remember_speeds)
        self.work: dict[str, BoxWork] = {}
        self.makespan = policy if isinstance(policy, Makespan) else None
        registry.listeners.append(self._on_event)

    def enable_affinity(self, settings: AffinitySettings | None = None) -> AffinityTable:
        self.affinity = AffinityTable(settings)
        return self.affinity

    def _on_event(self, inst: Instance, event: Event) -> None:
        inst.load.max_in_flight = self.bound_of(inst)
        if event.old is None and self.remembered_speeds:  # a box this daemon's predecessor had measured
            model = self.remembered_speeds.get(inst.endpoint)
            if model is not None:
                self.speeds.seed(inst.id, model)
        if event.new == State.ACTIVE:
            self._none_since = None
        elif event.old == State.ACTIVE and not self.registry.in_state(State.ACTIVE):
            self._none_since = self.clock()
        if event.new == State.DEAD:
            self.meters.pop(inst.id, None)
            self._loads.pop(inst.id, None)
            self.lone_meters.pop(inst.id, None)
            self.speeds.forget(inst.id)
            self.work.pop(inst.id, None)
            self._idle_since.pop(inst.id, None)
            self._idle_s.pop(inst.id, None)
            if self.affinity is not None:
                self.affinity.forget_instance(inst.id)
        elif event.new == State.ACTIVE and inst.load.in_flight == 0:
            self._idle_since.setdefault(inst.id, self.clock())
        elif event.old == State.ACTIVE:  # syncing or draining: no work is possible, so none is idle time
            since = self._idle_since.pop(inst.id, None)
            if since is not None:
                self._idle_s[inst.id] = self._idle_s.get(inst.id, 0.0) + self.clock() - since
        self._changed()

    def _changed(self) -> None:
        """Who can take work, or the load, changed: wake the generic waiters, place queued requests."""
        self.changed.notify()
        self._place_waiting()

    def speed_curves(self) -> list[BoxCurve]:
        """The measured boxes' learned step curves by endpoint (what a restarted daemon starts from), then the
        remembered ones of boxes not back yet (a box that rejoins late still finds its curve), at most
        ``MAX_REMEMBERED_CURVES`` in all."""
        models, _ = self.speeds.models()
        out = [BoxCurve(inst.endpoint, m.a, m.b) for inst in self.registry if (m := models.get(inst.id)) is not None]
        here = {c.endpoint for c in out}
        out += [BoxCurve(e, m.a, m.b) for e, m in self.remembered_speeds.items() if e not in here]
        return out[:MAX_REMEMBERED_CURVES]

    def remember_speeds(self, curves: list[BoxCurve]) -> None:
        """Curves from before a restart, told at start before any box registers: a box registering at one of
        these endpoints starts from its curve (``_on_event``)."""
        self.remembered_speeds = {c.endpoint: StepModel(c.base_s, c.per_sequence_s) for c in curves}

    def bound_of(self, inst: Instance) -> int:
        """The most sequences ``inst`` may have in flight from here (see ``__init__``)."""
        own = inst.engine.max_running_requests
        cap = self.max_in_flight_per_instance
        if own is None:
            return cap or DEFAULT_INSTANCE_MAX_IN_FLIGHT
        return min(own, cap) if cap else own

    def recovered(self, inst: Instance) -> None:
        """``inst`` recovered from failures (a probe or a request succeeded there): requests that avoided
        it may be placed there now. Not a registry transition, so nothing else would tell the queue."""
        self._changed()

    def capacity(self) -> int:
        """Sequences the active pool can run at once: the instances' bounds, within the overall one."""
        # the registry's kept active tuple (a batch asks on every turn it starts requests in), not a new list
        active = State.ACTIVE
        return min(sum(self.bound_of(i) for i in self.registry.active() if i.state is active),
                   self.max_in_flight_total)

    def admission_status(self) -> dict[str, int]:
        """The bounds and who waits on them (status page, ``/get_instances_status``)."""
        return {"in_flight": self.in_flight, "max_in_flight_total": self.max_in_flight_total,
                "capacity": self.capacity(), "waiting_for_instance": self.waiting,
                "held_by_batches": self.held_by_batches, "requests_waiting": self.waiting + self.held_by_batches}

    def _usable(self, avoid: Collection[str], allow: Callable[[Instance], bool] | None) -> list[Instance]:
        """Active instances that may serve a request (full or not): those it need not avoid and may use,
        local ones only while the local window is open."""
        local_ok = self.local.is_open
        return [i for i in self.registry.in_state(State.ACTIVE)
                if (i.id not in avoid or i.health.consecutive_failures == 0) and (allow is None or allow(i))
                and (local_ok or i.kind == Kind.REMOTE)]

    def meter(self, inst: Instance) -> TokenRateMeter:
        meter = self.meters.get(inst.id)  # called per relayed chunk: build a meter only the first time
        if meter is None:
            meter = self.meters[inst.id] = TokenRateMeter()
        return meter

    def load_of(self, inst: Instance, now: float) -> InstanceLoad:
        """The instance's load now. One object per instance, refreshed in place: a placement reads
        every candidate's, and building a thousand of them per placement was measurable."""
        return self._loads_of([inst], now)[0]

    def _loads_of(self, insts: list[Instance], now: float) -> list[InstanceLoad]:
        """:meth:`load_of` for each of ``insts``, in one loop: a placement runs it over the whole pool, and
        a method call per instance was a third of a placement's time at a thousand instances.

        Rates are remembered for up to ``_RATE_REUSE_S``: recomputing a thousand of them for every
        placement was most of the manager's CPU. An instance's entry is dropped as soon as its meter
        changes (a chunk, a start or an end), so what is reused is only the decay over a few ms."""
        if not 0 <= now - self._rates_at <= _RATE_REUSE_S:
            self._rates.clear()
            self._rates_at = now
        rates, loads, out, work = self._rates, self._loads, [], self.work
        models, fleet = self.speeds.models()
        for inst in insts:
            iid = inst.id
            load = loads.get(iid)
            if load is None:
                load = loads[iid] = InstanceLoad(iid, inst.kind.value, 0, 0)
            own = inst.load
            load.in_flight_requests = own.in_flight
            load.in_flight_tokens = own.in_flight_tokens
            rate = rates.get(iid, _UNKNOWN)
            if rate is _UNKNOWN:
                rate = rates[iid] = self.meter(inst).rate(now)
            load.token_rate = rate  # type: ignore[assignment]
            load.lone_rate = None
            load.step = models.get(iid, fleet)
            load.max_in_flight = own.max_in_flight
            if work:  # the makespan policy's predicted work (empty under the others)
                box = work.get(iid)
                load.predicted_tokens, load.longest_tokens = (box.tokens, box.longest) if box else (0.0, 0.0)
            out.append(load)
        return out

    def try_acquire(self, ask: Ask) -> Instance | None:
        """Pick an instance for ``ask`` now, or None. Local (trainer-side) instances are offered the work first.

        An instance this sequence already failed on (``ask.avoid``) is used again only once it has recovered (a
        health check or another request succeeded there); instances with recent failures get work
        only when no clean instance is there. ``ask.prefer`` (affinity: it holds the request's prefix)
        wins while it is clean and not overloaded; ``ask.allow`` restricts the candidates. Under the makespan
        policy the policy itself weighs ``prefer`` (staying where the prefix is cached) against moving, priced
        at one prefill of ``ask.context``, and places by ``ask.predicted`` and ``ask.high``.
        """
        if self.in_flight >= self.max_in_flight_total:
            return None
        tokens, avoid, prefer, allow = ask.tokens, ask.avoid, ask.prefer, ask.allow
        predicted, context, high = ask.predicted, ask.context, ask.high
        local_ok = self.local.is_open
        bound_of, remote_kind, active = self.bound_of, Kind.REMOTE, State.ACTIVE
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
        if self.narrow_remote is not None and len(remote_clean) > 1:  # the step's tail off boxes that may vanish
            remote_clean = self.narrow_remote(remote_clean, predicted if high is None else high)
        now = self.clock()
        groups = ((local_clean, local_failing), (remote_clean, remote_failing))
        for clean, failing in groups if local_clean or local_failing else groups[1:]:
            loads = self._loads_of(clean or failing, now)  # once per group, for both decisions
            if self.makespan is not None:
                inst = self._place(loads, tokens, now, predicted, prefer if clean else None, context, high)
            else:
                inst = self._preferred(clean, loads, prefer, tokens, now) if prefer is not None and clean else None
                inst = inst or self._pick(loads, tokens, now)
            if inst is not None:
                return inst
        return None

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
        box = self.work.get(inst.id)
        if box is None:
            box = self.work[inst.id] = BoxWork()
        box.placed(*policy.counted(tokens, predicted, high))
        if predicted is not None:
            self.last_predicted = predicted
        self._reserve(inst, tokens, now)
        return inst

    def _reserve(self, inst: Instance, tokens: int, now: float) -> None:
        load = inst.load
        load.in_flight += 1
        load.in_flight_tokens += tokens
        self.in_flight += 1
        self._busy_changed(inst, now)

    async def acquire(self, ask: Ask, timeout_s: float) -> Instance:
        """Wait until the policy places this sequence, within the bounds; raises Unavailable when no
        instance could serve it for ``timeout_s``.

        The wait counts from ``ask.since`` (a sequence's first failure in a row: its retries share one
        wait), else :data:`accepted_at`, else now, and only while no instance could take the request at
        all: while some could but are full, it waits for their capacity, however long (see
        :meth:`_expire`). Instances in ``ask.avoid`` (it failed there) may take it again once they recovered,
        but never count as ones that could: past the wait it fails rather than try them again.

        Requests that cannot be placed at once wait in ``placement.waiting.WaitQueue`` (arrival order; under
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
        if not self._queue and not burst:  # nobody is waiting ahead of it
            inst = self.try_acquire(ask)
            if inst is not None:
                return inst
        loop = asyncio.get_running_loop()
        waiter = Waiter(ask, loop.create_future(), since)
        self._queue.add(waiter)
        self.waiting += 1
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
            self.waiting -= 1
            if not waiter.future.done():
                waiter.future.cancel()
            self._queue.leave(waiter)

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
        self._queue.place(self._try_waiter, self._closed)

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
        its sequence's chunks itself (:meth:`step_gap`); else the box's chunks are windowed
        (``BoxSpeeds.observe``)."""
        load = inst.load
        load.last_chunk_at = chunk_at
        if not tokens:
            return
        iid = inst.id
        self.streamed_tokens += tokens
        load.in_flight_tokens = max(load.in_flight_tokens - tokens, 0)
        now = self.clock()
        if not timed:
            self.speeds.observe(iid, tokens, load.in_flight, now)
        box = self.work.get(iid)
        if box is not None and box.tokens:
            box.made(tokens, load.in_flight)
        self._rates.pop(iid, None)
        (self.meters.get(iid) or self.meter(inst)).observe(tokens, now)
        (self.lone_meters.get(iid) or self.lone_meter(inst)).observe(
            tokens * lone_rate_weight(load.in_flight, self.batch_half), now)

    def step_gap(self, inst: Instance, tokens: int, gap_s: float) -> None:
        """One sequence on ``inst`` made ``tokens`` in the ``gap_s`` seconds since its previous chunk: that many
        decode steps at the box's count in flight (``BoxSpeeds.observe_gap``)."""
        self.speeds.observe_gap(inst.id, tokens, inst.load.in_flight, gap_s, self.clock())

    def unreserve(self, inst: Instance, tokens: int) -> None:
        """``tokens`` of what a sequence reserved on ``inst`` will not be made there after all."""
        load = inst.load
        load.in_flight_tokens = max(load.in_flight_tokens - tokens, 0)

    def release(self, inst: Instance, tokens_left: int) -> None:
        """A sequence left ``inst`` (finished or failed) with ``tokens_left`` of its budget unused."""
        load = inst.load
        box = self.work.get(inst.id)
        if box is not None:
            box.ended(load.in_flight)
        if load.in_flight > 0:
            self.in_flight = max(self.in_flight - 1, 0)
        load.in_flight = max(load.in_flight - 1, 0)
        load.in_flight_tokens = max(load.in_flight_tokens - tokens_left, 0)
        self._busy_changed(inst, self.clock())
        self._changed()

    # ------------------------------------------------------------ tail migration
    def lone_meter(self, inst: Instance) -> TokenRateMeter:
        meter = self.lone_meters.get(inst.id)
        if meter is None:
            meter = self.lone_meters[inst.id] = TokenRateMeter()
        return meter

    def lone_rate(self, inst: Instance, now: float) -> float | None:
        """Tokens/s a lone sequence gets on ``inst``, measured at whatever batch it ran."""
        return self.lone_meter(inst).rate(now)

    def requests_waiting(self) -> int:
        """Requests waiting for a slot: parked here, or held back by their batch until it has room."""
        return self.waiting + self.held_by_batches

    def waiting_predicted(self) -> float | None:
        """What the next request to be placed is predicted to make: the head of the queue's prediction, else
        (a batch's requests held back, or none predicted) the last one placed with a prediction."""
        head = self._queue.head()
        return head.predicted if head is not None and head.predicted is not None else self.last_predicted

    def waiters(self) -> list[Waiter]:
        """Requests parked here for an instance, in the order they are offered."""
        return self._queue.waiters()

    def claim(self, inst: Instance, tokens: int, over: int = 0) -> bool:
        """Reserve ``inst`` for a sequence tail migration moves there, past the dispatch policy (the
        migration policy chose it); False if it cannot take work now, or is ``over`` past its bound (a swap
        while requests wait: the box takes the sequence into its next free slot, and no waiting request is
        placed there meanwhile, since the box is past its bound)."""
        if self.closing or inst.state != State.ACTIVE or self.registry.get(inst.id) is not inst:
            return False
        load = inst.load
        if load.in_flight >= self.bound_of(inst) + over or self.in_flight >= self.max_in_flight_total + over:
            return False
        load.in_flight += 1
        load.in_flight_tokens += tokens
        self.in_flight += 1
        self._busy_changed(inst, self.clock())
        return True

    # ------------------------------------------------------------ idle time, for the local budget
    def _busy_changed(self, inst: Instance, now: float) -> None:
        """``inst``'s in-flight count moved by one. Its busy time starts or ends only between 0 and 1;
        above that its meters and idle time have nothing to learn."""
        iid, n = inst.id, inst.load.in_flight
        if n > 1:
            return
        self._rates.pop(iid, None)
        meter = self.meters.get(iid) or self.meter(inst)
        if n > 0 and not meter.busy:  # idle to busy: its first chunk will carry a prefill, not decode steps
            self.speeds.busy(iid)
        meter.set_in_flight(n, now)
        (self.lone_meters.get(iid) or self.lone_meter(inst)).set_in_flight(n, now)
        idle_since = self._idle_since
        since = idle_since.get(iid)
        if n > 0 and since is not None:
            self._idle_s[iid] = self._idle_s.get(iid, 0.0) + now - since
            del idle_since[iid]
        elif n == 0 and since is None:
            idle_since[iid] = now

    def take_idle_seconds(self, kind: Kind) -> float:
        """Mean idle seconds of active ``kind`` instances since the last call (then restart counting)."""
        now = self.clock()
        insts = self.registry.in_state(State.ACTIVE, kind=kind)
        total = 0.0
        for inst in insts:
            idle = self._idle_s.pop(inst.id, 0.0)
            if inst.id in self._idle_since:
                idle += now - self._idle_since[inst.id]
                self._idle_since[inst.id] = now
            elif inst.load.in_flight == 0:
                self._idle_since[inst.id] = now
            total += idle
        return total / len(insts) if insts else 0.0
