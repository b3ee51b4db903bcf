"""Dispatch accounting: which instance serves the next sequence, and the load it carries.

The manager sends every request itself, so it counts in-flight requests and tokens per instance and
measures token rates from its own streams; the pure policy in ``scheduling.py`` decides from those
numbers. Requests wait here (bounded) while no instance can take them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection

from rollout_manager.errors import Unavailable
from rollout_manager.instances.registry import Event, Instance, Kind, Registry, State
from rollout_manager.notify import Signal
from rollout_manager.rollout.affinity import AffinitySettings, AffinityTable, overloaded
from rollout_manager.rollout.local_budget import LocalWindow
from rollout_manager.rollout.scheduling import InstanceLoad, Policy, TokenRateMeter, lone_rate_weight


class Dispatcher:
    def __init__(self, registry: Registry, policy: Policy, *, clock: Callable[[], float] = time.monotonic):
        self.registry = registry
        self.policy = policy
        self.clock = clock
        self.changed = Signal()  # any change in who can take work, or in load
        self.local = LocalWindow(on_change=self.changed.notify)  # while open, local instances serve first
        self.closing = False
        self.meters: dict[str, TokenRateMeter] = {}
        self.streamed_tokens = 0  # every token relayed so far: a live tokens/s needs no finished sequence
        self.waiting = 0  # requests parked in acquire() because no instance can take them now
        self._idle_since: dict[str, float] = {}
        self._idle_s: dict[str, float] = {}
        # Tail migration: each instance's lone-sequence rate under the batch model of scheduling.py.
        self.batch_half = 64.0
        self.lone_meters: dict[str, TokenRateMeter] = {}
        # Affinity (None: off): which instance holds which trajectory's or prompt's prefix.
        self.affinity: AffinityTable | None = None
        registry.listeners.append(self._on_event)

    def enable_affinity(self, settings: AffinitySettings | None = None) -> AffinityTable:
        self.affinity = AffinityTable(settings)
        return self.affinity

    def _on_event(self, inst: Instance, event: Event) -> None:
        if event.new == State.DEAD:
            self.meters.pop(inst.id, None)
            self.lone_meters.pop(inst.id, None)
            self._idle_since.pop(inst.id, None)
            self._idle_s.pop(inst.id, None)
            if self.affinity is not None:
                self.affinity.forget_instance(inst.id)
        elif event.new == State.ACTIVE and inst.in_flight == 0:
            self._idle_since.setdefault(inst.id, self.clock())
        elif event.old == State.ACTIVE:  # syncing or draining: no work is possible, so none is idle time
            since = self._idle_since.pop(inst.id, None)
            if since is not None:
                self._idle_s[inst.id] = self._idle_s.get(inst.id, 0.0) + self.clock() - since
        self.changed.notify()

    def meter(self, inst: Instance) -> TokenRateMeter:
        meter = self.meters.get(inst.id)  # called per relayed chunk: build a meter only the first time
        if meter is None:
            meter = self.meters[inst.id] = TokenRateMeter()
        return meter

    def load_of(self, inst: Instance, now: float) -> InstanceLoad:
        return InstanceLoad(inst.id, inst.kind.value, inst.in_flight, inst.in_flight_tokens,
                            self.meter(inst).rate(now))

    def try_acquire(self, tokens: int, avoid: Collection[str] = (), prefer: str | None = None,
                    allow: Callable[[Instance], bool] | None = None) -> Instance | None:
        """Pick an instance now, or None. Local (trainer-side) instances are offered the work first.

        An instance this sequence already failed on is used again only once it has recovered (a
        health check or another request succeeded there); instances with recent failures get work
        only when no clean instance is there. ``prefer`` (affinity: it holds the request's prefix)
        wins while it is clean and not overloaded; ``allow`` restricts the candidates (the staleness
        bound).
        """
        usable = [i for i in self.registry.in_state(State.ACTIVE)
                  if (i.id not in avoid or i.consecutive_failures == 0) and (allow is None or allow(i))]
        local = [i for i in usable if i.kind == Kind.LOCAL] if self.local.is_open else []
        remote = [i for i in usable if i.kind == Kind.REMOTE]
        for group in (local, remote):
            clean = [i for i in group if i.consecutive_failures == 0]
            inst = self._preferred(clean, prefer, tokens) if prefer is not None else None
            inst = inst or self._pick(clean or group, tokens)
            if inst is not None:
                return inst
        return None

    def _preferred(self, clean: list[Instance], prefer: str, tokens: int) -> Instance | None:
        mine = next((i for i in clean if i.id == prefer), None)
        if mine is None:
            return None
        now = self.clock()
        loads = [self.load_of(i, now) for i in clean]
        settings = self.affinity.settings if self.affinity is not None else AffinitySettings()
        if overloaded(self.load_of(mine, now), loads, tokens, self.policy, settings.max_slowdown):
            return None
        self._reserve(mine, tokens, now)
        return mine

    def _pick(self, candidates: list[Instance], tokens: int) -> Instance | None:
        if not candidates:
            return None
        now = self.clock()
        chosen = self.policy.pick([self.load_of(i, now) for i in candidates], tokens, now)
        inst = self.registry.get(chosen) if chosen else None
        if inst is None:
            return None
        self._reserve(inst, tokens, now)
        return inst

    def _reserve(self, inst: Instance, tokens: int, now: float) -> None:
        inst.in_flight += 1
        inst.in_flight_tokens += tokens
        self._busy_changed(inst, now)

    async def acquire(self, tokens: int, timeout_s: float, avoid: Collection[str] = (), prefer: str | None = None,
                      allow: Callable[[Instance], bool] | None = None) -> Instance:
        """Wait (bounded) until the policy places this sequence; raises Unavailable at the deadline."""
        deadline = self.clock() + timeout_s
        counted = False  # counted in ``waiting`` from its first failed try until it leaves
        try:
            while True:
                if self.closing:
                    raise Unavailable("rollout manager is shutting down; no new work is placed")
                inst = self.try_acquire(tokens, avoid, prefer, allow)
                if inst is not None:
                    return inst
                left = deadline - self.clock()
                if left <= 0:
                    active = len(self.registry.in_state(State.ACTIVE))
                    raise Unavailable(
                        f"no rollout instance could take the request within {timeout_s:g}s "
                        f"({active} active)"
                    )
                if not counted:
                    counted = True
                    self.waiting += 1
                await self.changed.wait(left)
        finally:
            if counted:
                self.waiting -= 1

    def close(self) -> None:
        """The manager is shutting down: place no more work; waiting requests fail now."""
        self.closing = True
        self.changed.notify()

    def progress(self, inst: Instance, tokens: int) -> None:
        """``tokens`` new tokens streamed from ``inst``."""
        self.streamed_tokens += tokens
        inst.in_flight_tokens = max(inst.in_flight_tokens - tokens, 0)
        now = self.clock()
        self.meter(inst).observe(tokens, now)
        self.lone_meter(inst).observe(tokens * lone_rate_weight(inst.in_flight, self.batch_half), now)

    def release(self, inst: Instance, tokens_left: int) -> None:
        """A sequence left ``inst`` (finished or failed) with ``tokens_left`` of its budget unused."""
        inst.in_flight = max(inst.in_flight - 1, 0)
        inst.in_flight_tokens = max(inst.in_flight_tokens - tokens_left, 0)
        self._busy_changed(inst, self.clock())
        self.changed.notify()

    # ------------------------------------------------------------ tail migration
    def lone_meter(self, inst: Instance) -> TokenRateMeter:
        meter = self.lone_meters.get(inst.id)
        if meter is None:
            meter = self.lone_meters[inst.id] = TokenRateMeter()
        return meter

    def lone_rate(self, inst: Instance, now: float) -> float | None:
        """Tokens/s a lone sequence gets on ``inst``, measured at whatever batch it ran."""
        return self.lone_meter(inst).rate(now)

    def claim(self, inst: Instance, tokens: int) -> bool:
        """Reserve ``inst`` for a sequence tail migration moves there, past the dispatch policy (the
        migration policy chose it); False if it cannot take work now."""
        if self.closing or inst.state != State.ACTIVE or self.registry.get(inst.id) is not inst:
            return False
        inst.in_flight += 1
        inst.in_flight_tokens += tokens
        self._busy_changed(inst, self.clock())
        return True

    # ------------------------------------------------------------ idle time, for the local budget
    def _busy_changed(self, inst: Instance, now: float) -> None:
        self.meter(inst).set_in_flight(inst.in_flight, now)
        self.lone_meter(inst).set_in_flight(inst.in_flight, now)
        since = self._idle_since.get(inst.id)
        if inst.in_flight > 0 and since is not None:
            self._idle_s[inst.id] = self._idle_s.get(inst.id, 0.0) + now - since
            del self._idle_since[inst.id]
        elif inst.in_flight == 0 and since is None:
            self._idle_since[inst.id] = now

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
            elif inst.in_flight == 0:
                self._idle_since[inst.id] = now
            total += idle
        return total / len(insts) if insts else 0.0
