"""One rollout instance, in parts by who writes them.

Many modules read an instance; each part has one writer, so a field's value has one explanation:

- the :class:`Instance` itself: identity (what it registered as; never changes) and lifecycle (state, what
  it waits for, its last error, the weight version it is named at, its sender group): the registry's
  (``registry.py``), the only module that assigns them. Weight sync and the sender plan change the
  version and the group through the registry's methods.
- :class:`Load`: capacity's (``placement/capacity.py``): sequences and tokens the dispatcher placed there.
- :class:`Health`: the health monitor's (``health.py``): failures counted towards removal.
- :class:`EngineFacts`: the health monitor's, frozen: what the engine said about itself when it became
  ready, replaced whole, never edited field by field.
- ``versions`` (:class:`BoxVersions`): weight sync's (``weights/sync.py``): staged and activating versions.
- ``trust`` (:class:`TrustRecord`): the trust probe's (``probe.py``), frozen, replaced whole: whether the box
  serves the weights it is named at.
- ``ids_served``: the rollout path's (``served_ids.note_served``): the token ids it has been seen to take.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from rollout_manager.instances.box_versions import BoxVersions
from rollout_manager.instances.trust import TrustRecord
from rollout_manager.osutil import format_endpoint


class State(str, enum.Enum):
    PENDING = "pending"  # registered, waiting for its first successful /health_generate
    SYNCING = "syncing"  # receiving weights; takes no new requests
    ACTIVE = "active"  # serving
    DRAINING = "draining"  # finishing in-flight work before removal; takes no new requests
    # Told it will be taken back (a preemption notice): new work only what it can finish, no migration target,
    # no weight push; its sequences finish there or move (rollout/evacuation.py) until its deadline removes it, or
    # a cancel returns it.
    EVACUATING = "evacuating"
    DEAD = "dead"  # failed or removed; gone from the registry


class Kind(str, enum.Enum):
    REMOTE = "remote"  # a rollout box: gets weights pushed by the manager's senders
    LOCAL = "local"  # trainer-side: the trainer updates its weights itself


@dataclass(slots=True)
class Load:
    """What the dispatcher placed on the instance. Written on every placement, release and chunk, so
    plain slots: reading or bumping one costs what a field of the instance itself did."""

    in_flight: int = 0  # sequences placed here and not yet released
    in_flight_tokens: int = 0  # tokens those sequences may still make here (their reserved budgets)
    max_in_flight: int | None = None  # the most it may hold (its own bound within the configured one)
    last_chunk_at: float = 0.0  # event-loop time of the last chunk it sent any request (0: none yet)


@dataclass(slots=True)
class Health:
    """Failures counted against the instance: the health monitor's, as it alone removes an instance at
    ``health_failure_threshold`` and clears the count when a probe or request succeeds. The error text
    shown with them is not here: probes, requests and weight pushes all report one, so it lives with the
    lifecycle (``Instance.last_error``), where the registry records whoever reported it last."""

    consecutive_failures: int = 0  # cleared by a success
    failures_total: int = 0  # every failure counted against it; no success clears it


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """What the engine said about itself (``/server_info``, ``/model_info``) when it became ready.
    Replaced whole by the health monitor, so a reader never sees half of one answer."""

    # How its /generate streams: "incremental" (deltas), "cumulative" (every chunk repeats the whole
    # output: more manager CPU per token), None (unknown).
    streaming: str | None = None
    server_stream_interval: int | None = None  # its --stream-interval (requests from here set their own)
    max_running_requests: int | None = None  # what SGLang runs at once (None: not reported)
    # Its vocabulary size: the smaller of what the server says and what its launcher declared (None:
    # neither is known). SGLang's scheduler dies on an input id at or past it.
    vocab_size: int | None = None
    # Whether ``vocab_size`` comes from a source that cannot be wrong (the server's own report, or the model's
    # config.json read by its launcher): only then may the manager's own requests use ids up to it.
    vocab_checked: bool = False
    joined_version: str | None = None  # the weight version it reported before any push from here
    # Whether it returns the experts each token was routed to (SGLang's --enable-return-routed-experts; None:
    # not said): only such an engine may take a sequence that asks for them (routed-expert replay, R3).
    routed_experts: bool | None = None
    # How it computes (``--dtype``, ``--quantization``, ``--tp-size``): the trust probe's tolerance follows them.
    dtype: str | None = None
    quantization: str | None = None
    tp_size: int | None = None
    # ``--speculative-algorithm`` (None: none, or not said). Placement needs no special case for it: the box's
    # learned step curve (placement.box_speed) shows what drafting buys at each batch size, and the tail goes
    # where that curve says it ends soonest.
    speculative_algorithm: str | None = None


@dataclass
class Instance:
    # identity: set at registration, never changed
    id: str
    host: str
    port: int
    kind: Kind
    order: int  # registration order; assignment is round-robin in this order
    mooncake_handshake_port: int | None = None
    weight_receiver_port: int | None = None
    registered_at: float = 0.0
    # The vocabulary size sent at registration (None: not sent), and whether its launcher read it from the
    # model's config.json (``vocab_source`` "model_config") rather than somebody declaring it.
    declared_vocab_size: int | None = None
    vocab_from_config: bool = False
    box_token_digest: str | None = None  # sha256 of the box token its registration got (never shown)
    # What the box said it is: its cloud may take it back (spot, preemptible), and what it costs (None: not said).
    preemptible: bool = False
    price_per_hour: float | None = None
    # lifecycle: the registry's
    state: State = State.PENDING
    state_since: float = 0.0
    waiting_for: str | None = None  # what keeps it from serving right now, in words (None: nothing)
    last_error: str | None = None  # the last failure anyone reported (a probe, a request, a weight push)
    last_error_at: float | None = None  # wall-clock time of last_error; both cleared on recovery
    weight_version: int = 0  # the version it is named at (see BoxVersions.serving for what it serves)
    # Why it was taken out of service as untrusted (None: it is not): it stays out of ``active`` until a
    # reload and a passing probe lift it (``instances/quarantine.py``).
    quarantined: str | None = None
    # A weight push completed on it since it was quarantined (its move to ``active`` was refused): a full
    # reload, at whatever version, after which a passing probe lets it serve again.
    reloaded_in_quarantine: bool = False
    sender: int | None = None
    group: int | None = None
    # the other owners' parts
    load: Load = field(default_factory=Load)
    health: Health = field(default_factory=Health)
    engine: EngineFacts = EngineFacts()
    versions: BoxVersions = field(default_factory=BoxVersions)  # staged/activating versions, paused seconds
    trust: TrustRecord = TrustRecord()  # what the trust probe found
    # 1 + the largest token id it has been seen to take (in a prompt it answered, or sampled): every id below
    # is safe to send it. The rollout path's, through ``served_ids.note_served``.
    ids_served: int = 0
    # Computed once: host and port never change, and every sequence placed here reads both.
    endpoint: str = field(init=False)
    url: str = field(init=False)

    def __post_init__(self) -> None:
        self.endpoint = format_endpoint(self.host, self.port)
        self.url = f"http://{self.endpoint}"

    def to_dict(self, now: float) -> dict[str, Any]:
        load, health, engine = self.load, self.health, self.engine
        return {
            "id": self.id,
            "endpoint": self.endpoint,
            "host": self.host,
            "port": self.port,
            "kind": self.kind.value,
            "preemptible": self.preemptible,
            "price_per_hour": self.price_per_hour,
            "state": self.state.value,
            "state_for_s": round(now - self.state_since, 3),
            "weight_version": self.weight_version,
            "sender": self.sender,
            "group": self.group,
            "mooncake_handshake_port": self.mooncake_handshake_port,
            "weight_receiver_port": self.weight_receiver_port,
            "in_flight": load.in_flight,
            "in_flight_tokens": load.in_flight_tokens,
            "consecutive_failures": health.consecutive_failures,
            "failures_total": health.failures_total,
            "last_error": self.last_error,
            "last_error_at": self.last_error_at,
            "waiting_for": self.waiting_for,
            "quarantined": self.quarantined,
            "streaming": engine.streaming,
            "server_stream_interval": engine.server_stream_interval,
            "max_running_requests": engine.max_running_requests,
            "vocab_size": engine.vocab_size,
            "vocab_checked": engine.vocab_checked,
            "ids_served": self.ids_served,
            "routed_experts": engine.routed_experts,
            "speculative_algorithm": engine.speculative_algorithm,
            "max_in_flight": load.max_in_flight,
            "trust": self.trust.to_dict(self.versions.serving(self.weight_version)),
        }
