"""The fleet model the policies read: what each box does, learned from the manager's own streams.

Per instance: its token rate and its lone-sequence rate (``TokenRateMeter``), its decode step time by running
count (``BoxSpeeds``, seeded from the curves a restarted daemon remembers), under the makespan policy the
tokens its sequences are predicted still to make (``BoxWork``), and its idle time (the local budget's). The
dispatcher tells it of every placement, chunk and release; ``load_of`` gives a policy one instance's figures.

Its figures (``streamed_tokens``, ``last_predicted``, ``batch_half``) are written by this module's methods only
(tests/test_placement_parts.py checks it).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from rollout_manager.instances.registry import Event, Instance, Kind, Registry, State
from rollout_manager.placement.box_speed import BoxCurve, BoxSpeeds, StepModel
from rollout_manager.placement.instance_load import InstanceLoad
from rollout_manager.placement.makespan import BoxWork
from rollout_manager.placement.rate_meter import TokenRateMeter, lone_rate_weight

_RATE_REUSE_S = 0.01  # how long a computed rate is reused while its meter does not change
_UNKNOWN = object()  # not in the rate cache (None there is a rate not yet measured)
# Box curves kept across restarts (FleetModel.speed_curves): every box of a large fleet, and a bound on the
# addresses of boxes that never come back (preemptible ones return elsewhere).
MAX_REMEMBERED_CURVES = 4096


class FleetModel:
    def __init__(self, registry: Registry, clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = registry
        self.clock = clock
        self.meters: dict[str, TokenRateMeter] = {}
        self.streamed_tokens = 0  # every token relayed so far: a live tokens/s needs no finished sequence
        self.last_predicted: float | None = None  # what the last sequence placed with a prediction was to make
        self._rates: dict[str, float | None] = {}  # see loads_of
        self._loads: dict[str, InstanceLoad] = {}  # see load_of
        self._rates_at = 0.0
        self._idle_since: dict[str, float] = {}
        self._idle_s: dict[str, float] = {}
        # Tail migration: each instance's lone-sequence rate under the batch model of rate_meter.py.
        self.batch_half = 64.0
        self.lone_meters: dict[str, TokenRateMeter] = {}
        # Each instance's decode step time by running count, learned from its streams (box_speed), and,
        # under the makespan policy, what its sequences are predicted still to make (makespan.BoxWork).
        self.speeds = BoxSpeeds()
        self.remembered_speeds: dict[str, StepModel] = {}  # by endpoint, from before a restart (remember_speeds)
        self.work: dict[str, BoxWork] = {}

    def use_batch_half(self, batch_half: float) -> None:
        """The batch model tail migration prices lone rates with (``TailMigration.batch_half``)."""
        self.batch_half = batch_half

    def on_event(self, inst: Instance, event: Event) -> None:
        """A registry transition: seed a returning box's curve, forget a dead one, count idle time while active."""
        if event.old is None and self.remembered_speeds:  # a box this daemon's predecessor had measured
            model = self.remembered_speeds.get(inst.endpoint)
            if model is not None:
                self.speeds.seed(inst.id, model)
        if event.new == State.DEAD:
            self.meters.pop(inst.id, None)
            self._loads.pop(inst.id, None)
            self.lone_meters.pop(inst.id, None)
            self.speeds.forget(inst.id)
            self.work.pop(inst.id, None)
            self._idle_since.pop(inst.id, None)
            self._idle_s.pop(inst.id, None)
        elif event.new == State.ACTIVE and inst.load.in_flight == 0:
            self._idle_since.setdefault(inst.id, self.clock())
        elif event.old == State.ACTIVE:  # syncing or draining: no work is possible, so none is idle time
            since = self._idle_since.pop(inst.id, None)
            if since is not None:
                self._idle_s[inst.id] = self._idle_s.get(inst.id, 0.0) + self.clock() - since

    # ------------------------------------------------------------ box speeds across restarts
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
        these endpoints starts from its curve (``on_event``)."""
        self.remembered_speeds = {c.endpoint: StepModel(c.base_s, c.per_sequence_s) for c in curves}

    # ------------------------------------------------------------ what the policies read
    def meter(self, inst: Instance) -> TokenRateMeter:
        meter = self.meters.get(inst.id)  # called per relayed chunk: build a meter only the first time
        if meter is None:
            meter = self.meters[inst.id] = TokenRateMeter()
        return meter

    def lone_meter(self, inst: Instance) -> TokenRateMeter:
        meter = self.lone_meters.get(inst.id)
        if meter is None:
            meter = self.lone_meters[inst.id] = TokenRateMeter()
        return meter

    def lone_rate(self, inst: Instance, now: float) -> float | None:
        """Tokens/s a lone sequence gets on ``inst``, measured at whatever batch it ran."""
        return self.lone_meter(inst).rate(now)

    def load_of(self, inst: Instance, now: float) -> InstanceLoad:
        """The instance's load now. One object per instance, refreshed in place: a placement reads
        every candidate's, and building a thousand of them per placement was measurable."""
        return self.loads_of([inst], now)[0]

    def loads_of(self, insts: list[Instance], now: float) -> list[InstanceLoad]:
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

    # ------------------------------------------------------------ what the dispatcher tells it
    def placed(self, iid: str, counted: tuple[float, float], predicted: float | None) -> None:
        """The makespan policy placed a sequence on ``iid``, counting ``counted`` (``Makespan.counted``)."""
        box = self.work.get(iid)
        if box is None:
            box = self.work[iid] = BoxWork()
        box.placed(*counted)
        if predicted is not None:
            self.last_predicted = predicted

    def made(self, inst: Instance, tokens: int, timed: bool) -> None:
        """``inst`` streamed ``tokens`` (more than 0) new tokens (``Dispatcher.progress``)."""
        iid = inst.id
        self.streamed_tokens += tokens
        in_flight = inst.load.in_flight
        now = self.clock()
        if not timed:
            self.speeds.observe(iid, tokens, in_flight, now)
        box = self.work.get(iid)
        if box is not None and box.tokens:
            box.made(tokens, in_flight)
        self._rates.pop(iid, None)
        (self.meters.get(iid) or self.meter(inst)).observe(tokens, now)
        (self.lone_meters.get(iid) or self.lone_meter(inst)).observe(
            tokens * lone_rate_weight(in_flight, self.batch_half), now)

    def step_gap(self, inst: Instance, tokens: int, gap_s: float) -> None:
        """One sequence on ``inst`` made ``tokens`` in the ``gap_s`` seconds since its previous chunk: that many
        decode steps at the box's count in flight (``BoxSpeeds.observe_gap``)."""
        self.speeds.observe_gap(inst.id, tokens, inst.load.in_flight, gap_s, self.clock())

    def ending(self, inst: Instance) -> None:
        """A sequence is about to leave ``inst`` (its count in flight not yet lowered)."""
        box = self.work.get(inst.id)
        if box is not None:
            box.ended(inst.load.in_flight)

    def busy_changed(self, inst: Instance, now: float) -> None:
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

    # ------------------------------------------------------------ idle time, for the local budget
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
