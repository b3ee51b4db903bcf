"""The instance registry: the manager's single source of truth about rollout instances.

Pure state with no I/O: every lifecycle transition goes through :meth:`Registry.transition`, which checks
it is allowed, logs one line, records an event (visible in status) and notifies listeners, so the
scheduler and the version orchestrator never poll.
"""

from __future__ import annotations

import enum
import functools
import itertools
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from rollout_manager.errors import Conflict
from rollout_manager.osutil import format_endpoint
from rollout_manager.weights.box_versions import BoxVersions

log = logging.getLogger("rollout_manager.instances.registry")


class State(str, enum.Enum):
    PENDING = "pending"  # registered, waiting for its first successful /health_generate
    SYNCING = "syncing"  # receiving weights; takes no new requests
    ACTIVE = "active"  # serving
    DRAINING = "draining"  # finishing in-flight work before removal; takes no new requests
    DEAD = "dead"  # failed or removed; gone from the registry


class Kind(str, enum.Enum):
    REMOTE = "remote"  # a rollout box: gets weights pushed by the manager's senders
    LOCAL = "local"  # trainer-side: the trainer updates its weights itself


ALLOWED: dict[State, frozenset[State]] = {
    State.PENDING: frozenset({State.ACTIVE, State.SYNCING, State.DRAINING, State.DEAD}),
    State.SYNCING: frozenset({State.ACTIVE, State.DRAINING, State.DEAD}),
    State.ACTIVE: frozenset({State.SYNCING, State.DRAINING, State.DEAD}),
    State.DRAINING: frozenset({State.DEAD}),
    State.DEAD: frozenset(),
}


@dataclass
class Instance:
    id: str
    host: str
    port: int
    kind: Kind
    seq: int  # registration order; assignment is round-robin in this order
    mooncake_handshake_port: int | None = None
    weight_receiver_port: int | None = None
    state: State = State.PENDING
    weight_version: int = 0
    registered_at: float = 0.0
    state_since: float = 0.0
    sender: int | None = None
    group: int | None = None
    in_flight: int = 0
    in_flight_tokens: int = 0
    consecutive_failures: int = 0
    failures_total: int = 0  # every failure counted against it; unlike the above, no success clears it
    last_error: str | None = None
    last_error_at: float | None = None  # wall-clock time of last_error; both cleared on recovery
    waiting_for: str | None = None  # what keeps it from serving right now, in words (None: nothing)
    # How its /generate streams, from /server_info when it first became ready: "incremental" (deltas),
    # "cumulative" (every chunk repeats the whole output: more manager CPU per token), None (unknown).
    streaming: str | None = None
    server_stream_interval: int | None = None  # its --stream-interval (requests from here set their own)
    # What SGLang runs at once (/server_info, when it first became ready; None: not reported), and the
    # most sequences the dispatcher keeps in flight on it (from that and the configured bound).
    max_running_requests: int | None = None
    max_in_flight: int | None = None
    # The vocabulary size its launcher read from the model's config.json at registration (None: not sent).
    # SGLang does not report one, and its scheduler dies on an input id at or past it.
    declared_vocab_size: int | None = None
    # From /server_info and /model_info when it first became ready: its vocabulary size (the smaller of
    # what the server says and what was declared; None: neither is known), and the weight version it
    # reported before any push from here (None: unknown). Input ids and chunks are checked against both.
    vocab_size: int | None = None
    joined_version: str | None = None
    last_chunk_at: float = 0.0  # event-loop time of the last chunk it sent any request (0: none yet)
    box_token_digest: str | None = None  # sha256 of the box token its registration got (never shown)
    versions: BoxVersions = field(default_factory=BoxVersions)  # staged/activating versions, paused seconds

    # Computed once: host and port never change, and every sequence placed here reads both.
    @functools.cached_property
    def endpoint(self) -> str:
        return format_endpoint(self.host, self.port)

    @functools.cached_property
    def url(self) -> str:
        return f"http://{self.endpoint}"

    def set_error(self, error: str) -> None:
        """Record what went wrong, with its time, so a reader can tell a stale error from a fresh one."""
        self.last_error, self.last_error_at = error, time.time()

    def clear_error(self) -> None:
        """The instance recovered: an old error would only mislead."""
        self.last_error = self.last_error_at = None

    def wait_for(self, what: str | None) -> None:
        """Say what the instance waits for (None: nothing); logged once when it changes, so an instance
        out of service is never silent about why."""
        if what == self.waiting_for:
            return
        self.waiting_for = what
        if what is not None:
            log.info("instance %s %s (%s) waits for %s", self.id, self.endpoint, self.state.value, what)

    def to_dict(self, now: float) -> dict[str, Any]:
        return {
            "id": self.id,
            "endpoint": self.endpoint,
            "host": self.host,
            "port": self.port,
            "kind": self.kind.value,
            "state": self.state.value,
            "state_for_s": round(now - self.state_since, 3),
            "weight_version": self.weight_version,
            "sender": self.sender,
            "group": self.group,
            "mooncake_handshake_port": self.mooncake_handshake_port,
            "weight_receiver_port": self.weight_receiver_port,
            "in_flight": self.in_flight,
            "in_flight_tokens": self.in_flight_tokens,
            "consecutive_failures": self.consecutive_failures,
            "failures_total": self.failures_total,
            "last_error": self.last_error,
            "last_error_at": self.last_error_at,
            "waiting_for": self.waiting_for,
            "streaming": self.streaming,
            "server_stream_interval": self.server_stream_interval,
            "max_running_requests": self.max_running_requests,
            "vocab_size": self.vocab_size,
            "max_in_flight": self.max_in_flight,
        }


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

    def __post_init__(self) -> None:
        self.events = deque(maxlen=self.history)

    # ------------------------------------------------------------ queries
    def __len__(self) -> int:
        return len(self._instances)

    def __iter__(self) -> Iterator[Instance]:
        # Registration order: instances enter the dict in ``seq`` order and never move, so no sort
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

    def count(self, state: State, kind: Kind) -> int:
        """Instances in ``state`` of ``kind`` (what ``len(in_state(state, kind=kind))`` says, without the scan)."""
        return self._counts[state, kind]

    # ------------------------------------------------------------ changes
    def add_many(self, specs: list[tuple[str, int, Kind, int | None]],
                 receiver_port: int | None = None) -> list[Instance]:
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
                id=f"inst-{n}", host=host, port=port, kind=kind, seq=n,
                mooncake_handshake_port=hs_port, weight_receiver_port=receiver_port, registered_at=now,
                state_since=now,
            )
            self._instances[inst.id] = inst
            self._by_endpoint[ep] = inst.id
            self._record(inst, None, State.PENDING, f"registered ({kind.value})")
            added.append(inst)
        return added

    def add(self, host: str, port: int, kind: Kind, handshake_port: int | None = None,
            receiver_port: int | None = None) -> Instance:
        return self.add_many([(host, port, kind, handshake_port)], receiver_port)[0]

    def transition(self, inst: Instance, new: State, reason: str) -> bool:
        """Move ``inst`` to ``new``; False (and nothing changes) if the move is not allowed."""
        if inst.id not in self._instances or new not in ALLOWED[inst.state]:
            return False
        old = inst.state
        inst.state, inst.state_since = new, self.clock()
        inst.waiting_for = None  # whatever it waited for belonged to the old state
        if new == State.DEAD:
            del self._instances[inst.id]
            del self._by_endpoint[inst.endpoint]
        self._record(inst, old, new, reason)
        if new == State.DRAINING:  # whoever drains it waits on the dispatcher; the instance says so here
            inst.wait_for("in-flight requests to finish before removal")
        return True

    def _record(self, inst: Instance, old: State | None, new: State, reason: str) -> None:
        event = Event(self.wall(), inst.id, inst.endpoint, old, new, reason)
        if old is not None:
            self._counts[old, inst.kind] -= 1
        if new != State.DEAD:
            self._counts[new, inst.kind] += 1
        self.events.append(event)
        level = logging.WARNING if new == State.DEAD and "removed by request" not in reason else logging.INFO
        log.log(level, "instance %s %s %s -> %s: %s", inst.id, inst.endpoint,
                old.value if old else "new", new.value, reason)
        for listener in list(self.listeners):
            listener(inst, event)

    def counts(self) -> dict[str, int]:
        out = {s.value: 0 for s in State if s != State.DEAD}
        for inst in self._instances.values():
            out[inst.state.value] += 1
        return out
