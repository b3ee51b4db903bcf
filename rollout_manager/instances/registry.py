"""The instance registry: the manager's single source of truth about rollout instances.

Pure state with no I/O: every lifecycle transition goes through :meth:`Registry.transition`, which checks
it is allowed, logs one line, records an event (visible in status) and notifies listeners, so the
scheduler and the version orchestrator never poll.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from rollout_manager.errors import Conflict
from rollout_manager.instances.instance import EngineFacts
from rollout_manager.instances.instance import Instance as Instance
from rollout_manager.instances.instance import Kind as Kind
from rollout_manager.instances.instance import State as State
from rollout_manager.osutil import format_endpoint

log = logging.getLogger("rollout_manager.instances.registry")


ALLOWED: dict[State, frozenset[State]] = {
    State.PENDING: frozenset({State.ACTIVE, State.SYNCING, State.DRAINING, State.DEAD}),
    State.SYNCING: frozenset({State.ACTIVE, State.DRAINING, State.EVACUATING, State.DEAD}),
    State.ACTIVE: frozenset({State.SYNCING, State.DRAINING, State.EVACUATING, State.DEAD}),
    State.DRAINING: frozenset({State.DEAD}),
    # Only its evacuation returns it to service (a cancelled notice: ``transition(..., notice_cancelled=True)``);
    # a weight push that ends, or an activation that fails, leaves it evacuating.
    State.EVACUATING: frozenset({State.DRAINING, State.DEAD}),
    State.DEAD: frozenset(),
}
# Where a box whose preemption notice was cancelled goes: syncing when it missed a version (weights/sync.py).
AFTER_CANCELLED_NOTICE = frozenset({State.ACTIVE, State.SYNCING})


@dataclass(frozen=True)
class Event:
    at: float  # wall-clock time
    instance_id: str
    endpoint: str
    old: State | None
    new: State
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "at": self.at,
            "instance": self.instance_id,
            "endpoint": self.endpoint,
            "from": self.old.value if self.old else None,
            "to": self.new.value,
            "reason": self.reason,
        }


Listener = Callable[[Instance, Event], None]


@dataclass
class Registry:
    clock: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time
    history: int = 200
    _instances: dict[str, Instance] = field(default_factory=dict)
    _by_endpoint: dict[str, str] = field(default_factory=dict)
    _ids: Iterable[int] = field(default_factory=lambda: itertools.count(1))
    events: deque[Event] = field(default_factory=deque)
    listeners: list[Listener] = field(default_factory=list)
    # How many instances are in each (state, kind), kept by _record: a check per request, O(1) at any pool size.
    _counts: Counter[tuple[State, Kind]] = field(default_factory=Counter)
    _active: tuple[Instance, ...] | None = None  # see active(); None: to be rebuilt

    def __post_init__(self) -> None:
        self.events = deque(maxlen=self.history)

    # ------------------------------------------------------------ queries
    def __len__(self) -> int:
        return len(self._instances)

    def __iter__(self) -> Iterator[Instance]:
        # Registration order: instances enter the dict in ``order`` order and never move, so no sort
        # (this runs on every dispatch decision; sorting 1,000 instances each time was measurable).
        return iter(list(self._instances.values()))

    def get(self, instance_id: str) -> Instance | None:
        return self._instances.get(instance_id)

    def by_endpoint(self, endpoint: str) -> Instance | None:
        iid = self._by_endpoint.get(endpoint)
        return self._instances.get(iid) if iid else None

    def in_state(self, *states: State, kind: Kind | None = None) -> list[Instance]:
        # Straight over the dict (no copy as in __iter__): the comprehension runs to its end before anything
        # else can change the registry.
        return [i for i in self._instances.values() if i.state in states and (kind is None or i.kind == kind)]

    def active(self) -> tuple[Instance, ...]:
        """The active instances, in registration order. Kept between state changes: every placement
        reads it, and filtering a thousand instances each time was measurable. Check ``state`` too where
        it matters (an instance's state written past the registry shows only there)."""
        if self._active is None:
            self._active = tuple(i for i in self._instances.values() if i.state == State.ACTIVE)
        return self._active

    def count(self, state: State, kind: Kind) -> int:
        """Instances in ``state`` of ``kind`` (what ``len(in_state(state, kind=kind))`` says, without the scan)."""
        return self._counts[state, kind]

    # ------------------------------------------------------------ changes
    def add_many(self, specs: list[tuple[str, int, Kind, int | None]], receiver_port: int | None = None, *,
                 declared_vocab_size: int | None = None, vocab_from_config: bool = False,
                 box_token_digest: str | None = None, preemptible: bool = False,
                 price_per_hour: float | None = None) -> list[Instance]:
        """Register several instances at once: all or none (409 names the duplicates)."""
        endpoints = [format_endpoint(h, p) for h, p, _, _ in specs]
        taken = [ep for ep in endpoints if ep in self._by_endpoint]
        repeated = sorted({ep for ep in endpoints if endpoints.count(ep) > 1})
        if taken:
            states = ", ".join(f"{ep} ({self.by_endpoint(ep).state.value})" for ep in taken)  # type: ignore[union-attr]
            raise Conflict(f"already registered: {states}")
        if repeated:
            raise Conflict(f"listed more than once: {', '.join(repeated)}")
        now, added = self.clock(), []
        for (host, port, kind, hs_port), ep in zip(specs, endpoints):
            n = next(self._ids)  # type: ignore[call-overload]
            inst = Instance(
                id=f"inst-{n}", host=host, port=port, kind=kind, order=n,
                mooncake_handshake_port=hs_port, weight_receiver_port=receiver_port, registered_at=now,
                declared_vocab_size=declared_vocab_size, vocab_from_config=vocab_from_config,
                box_token_digest=box_token_digest, preemptible=preemptible, price_per_hour=price_per_hour,
                state_since=now,  # the engine facts until the engine says more
                engine=EngineFacts(vocab_size=declared_vocab_size,
                                   vocab_checked=vocab_from_config and declared_vocab_size is not None),
            )
            self._instances[inst.id] = inst
            self._by_endpoint[ep] = inst.id
            self._record(inst, None, State.PENDING, f"registered ({kind.value})")
            added.append(inst)
        return added

    def add(self, host: str, port: int, kind: Kind, handshake_port: int | None = None,
            receiver_port: int | None = None, *, declared_vocab_size: int | None = None,
            vocab_from_config: bool = False, box_token_digest: str | None = None, preemptible: bool = False,
            price_per_hour: float | None = None) -> Instance:
        return self.add_many([(host, port, kind, handshake_port)], receiver_port,
                             declared_vocab_size=declared_vocab_size, vocab_from_config=vocab_from_config,
                             box_token_digest=box_token_digest, preemptible=preemptible,
                             price_per_hour=price_per_hour)[0]

    def adopt(self, inst: Instance, serving_version: int, reason: str, *, quiet: bool = False) -> Instance:
        """Take ``inst`` as another process built it (its id, order and state: ``mirror.py``): a relay following
        the control process, or a new control process taking what the relays still know."""
        inst.registered_at = inst.state_since = self.clock()
        self._ids = itertools.count(max(inst.order + 1, next(self._ids)))  # type: ignore[call-overload]
        self._instances[inst.id] = inst
        self._by_endpoint[inst.endpoint] = inst.id
        self._serve(inst, serving_version)
        self._record(inst, None, inst.state, reason, quiet=quiet)
        return inst

    def fresh_id(self) -> tuple[str, int]:
        """An id and order no instance has had here."""
        n = next(self._ids)  # type: ignore[call-overload]
        return f"inst-{n}", n

    def follow(self, inst: Instance, weight_version: int, serving_version: int, quarantined: str | None,
               waiting_for: str | None) -> None:
        """Another process's lifecycle fields of ``inst`` (``mirror.py``); its state goes through follow_state."""
        inst.weight_version, inst.quarantined, inst.waiting_for = weight_version, quarantined, waiting_for
        self._serve(inst, serving_version)

    def follow_state(self, inst: Instance, new: State, reason: str) -> None:
        """Move ``inst`` as another process moved it: that process checked the move (``transition``), and a
        follower may have missed the steps between two views."""
        if inst.id not in self._instances or inst.state == new:
            return
        old = inst.state
        inst.state, inst.state_since = new, self.clock()
        if new == State.DEAD:
            del self._instances[inst.id]
            del self._by_endpoint[inst.endpoint]
        self._record(inst, old, new, reason, quiet=True)  # the control process logged it

    @staticmethod
    def _serve(inst: Instance, serving_version: int) -> None:
        """The version ``inst`` serves while it is named at another one (an activation under way)."""
        activating = serving_version != inst.weight_version
        inst.versions.activating = inst.weight_version if activating else None
        inst.versions.serving_before = serving_version if activating else None

    def transition(self, inst: Instance, new: State, reason: str, *, notice_cancelled: bool = False) -> bool:
        """Move ``inst`` to ``new``; False (and nothing changes) if the move is not allowed. ``notice_cancelled``:
        the evacuation returns an evacuating box to service (``AFTER_CANCELLED_NOTICE``)."""
        allowed = AFTER_CANCELLED_NOTICE if notice_cancelled and inst.state == State.EVACUATING else ALLOWED[inst.state]
        if inst.id not in self._instances or new not in allowed:
            return False
        if new == State.ACTIVE and inst.quarantined is not None:
            inst.reloaded_in_quarantine = True  # a push ended here: it is reloaded, the probe decides
            self.wait_for(inst, f"a passing trust probe after its reload (quarantined: {inst.quarantined})")
            return False  # only lift_quarantine serves it again
        old = inst.state
        inst.state, inst.state_since = new, self.clock()
        inst.waiting_for = None  # whatever it waited for belonged to the old state
        if new == State.DEAD:
            del self._instances[inst.id]
            del self._by_endpoint[inst.endpoint]
        self._record(inst, old, new, reason)
        if new == State.DRAINING:  # whoever drains it waits on the dispatcher; the instance says so here
            self.wait_for(inst, "in-flight requests to finish before removal")
        return True

    # The rest of the lifecycle part. Others report here rather than write the instance, so each of its
    # fields is written in this module only (the other parts have their own owners: see instance.py).
    def wait_for(self, inst: Instance, what: str | None) -> None:
        """Say what ``inst`` waits for (None: nothing); logged once when it changes, so an instance
        out of service is never silent about why."""
        if what == inst.waiting_for:
            return
        inst.waiting_for = what
        if what is not None:
            log.info("instance %s %s (%s) waits for %s", inst.id, inst.endpoint, inst.state.value, what)

    def quarantine(self, inst: Instance, why: str) -> bool:
        """Take an active ``inst`` out of service as untrusted: ``syncing`` (so nothing places work on it and its
        next push reloads it), held there until :meth:`lift_quarantine`. False if it was not active."""
        if inst.state != State.ACTIVE or inst.quarantined is not None:
            return False
        inst.quarantined, inst.reloaded_in_quarantine = why, False
        return self.transition(inst, State.SYNCING, f"quarantined: {why}")

    def lift_quarantine(self, inst: Instance, why: str) -> bool:
        """``inst`` was reloaded and its probe passed: it serves again."""
        if inst.quarantined is None:
            return False
        inst.quarantined = None
        if inst.state == State.ACTIVE:
            return True
        return self.transition(inst, State.ACTIVE, f"quarantine lifted: {why}")

    def set_error(self, inst: Instance, error: str) -> None:
        """Record what went wrong, with its time, so a reader can tell a stale error from a fresh one."""
        inst.last_error, inst.last_error_at = error, self.wall()

    def clear_error(self, inst: Instance) -> None:
        """``inst`` recovered: an old error would only mislead."""
        inst.last_error = inst.last_error_at = None

    def set_weight_version(self, inst: Instance, version: int) -> None:
        """The version ``inst`` is named at now (weight sync's decision: pushed, activating, or rolled back)."""
        inst.weight_version = version

    def assign_sender(self, inst: Instance, sender: int | None, group: int | None) -> None:
        """The sender and transfer group that push ``inst`` its weights (the sender plan's decision)."""
        inst.sender, inst.group = sender, group

    def _record(self, inst: Instance, old: State | None, new: State, reason: str, *, quiet: bool = False) -> None:
        event = Event(self.wall(), inst.id, inst.endpoint, old, new, reason)
        self._active = None
        if old is not None:
            self._counts[old, inst.kind] -= 1
        if new != State.DEAD:
            self._counts[new, inst.kind] += 1
        self.events.append(event)
        level = logging.DEBUG if quiet else \
            logging.WARNING if new == State.DEAD and "removed by request" not in reason else logging.INFO
        log.log(level, "instance %s %s %s -> %s: %s", inst.id, inst.endpoint,
                old.value if old else "new", new.value, reason)
        for listener in list(self.listeners):
            listener(inst, event)

    def counts(self) -> dict[str, int]:
        out = {s.value: 0 for s in State if s != State.DEAD}
        for inst in self._instances.values():
            out[inst.state.value] += 1
        return out
