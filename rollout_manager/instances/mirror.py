"""The fleet as another process sees it: each instance's view, the changes between two views, and a
registry made to follow them.

With relay processes (docs/relays.md) one control process owns registration, health, weights and trust;
each relay places sequences on its own copy of the registry. The control process sends each relay the
views that changed (``ViewTracker``); the relay applies them (``follow``), so its dispatcher, vocabulary
bound and metrics see the same registry events they would in one process. The same views go the other
way when a control process starts again: it adopts the instances the relays still know (``adopt``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import msgspec

from rollout_manager.instances.health import adopt_engine
from rollout_manager.instances.instance import EngineFacts
from rollout_manager.instances.registry import Instance, Kind, Registry, State
from rollout_manager.instances.version import WeightVersion
from rollout_manager.osutil import format_endpoint


class TrustView(msgspec.Struct, frozen=True, omit_defaults=True, array_like=True):
    """The control process's trust verdicts on one box, as its relays act on them (``rollout.trust_follower``):
    trust probes announced (``sent``, the last at ``version``), the last of them that passed (``passed``: what
    the box made before it is vouched for), and why its delivered tokens are distrusted now (None: they are not)."""

    sent: int = 0
    version: int = 0
    passed: int = 0
    distrusting: str | None = None


NO_TRUST = TrustView()


class InstanceView(msgspec.Struct, frozen=True, omit_defaults=True):
    """What a relay needs of one instance: who it is, whether it serves and at what version, what its
    engine takes. Failure counts, trust figures and push records stay with the control process."""

    id: str
    host: str
    port: int
    kind: Kind
    order: int
    state: State
    weight_version: int = 0
    serving_version: int = 0  # differs from weight_version while it activates (BoxVersions.serving)
    quarantined: str | None = None
    waiting_for: str | None = None
    engine: EngineFacts = EngineFacts()
    mooncake_handshake_port: int | None = None
    weight_receiver_port: int | None = None
    declared_vocab_size: int | None = None
    vocab_from_config: bool = False
    box_token_digest: str | None = None  # so a new control process still knows each box's own token
    preemptible: bool = False
    price_per_hour: float | None = None
    trust: TrustView = NO_TRUST


class FleetDelta(msgspec.Struct, frozen=True, omit_defaults=True):
    """One line of the control process's fleet stream: the views that changed since the last line and the
    ids removed (``full``: these views are the whole fleet; any other instance is gone)."""

    run_id: str
    weight_version: int
    changed: list[InstanceView] = []
    removed: list[str] = []
    full: bool = False


def view_of(inst: Instance, trust: TrustView = NO_TRUST) -> InstanceView:
    return InstanceView(
        id=inst.id, host=inst.host, port=inst.port, kind=inst.kind, order=inst.order, state=inst.state,
        weight_version=inst.weight_version, serving_version=inst.versions.serving(inst.weight_version),
        quarantined=inst.quarantined, waiting_for=inst.waiting_for, engine=inst.engine,
        mooncake_handshake_port=inst.mooncake_handshake_port, weight_receiver_port=inst.weight_receiver_port,
        declared_vocab_size=inst.declared_vocab_size, vocab_from_config=inst.vocab_from_config,
        box_token_digest=inst.box_token_digest, preemptible=inst.preemptible, price_per_hour=inst.price_per_hour,
        trust=trust)


class ViewTracker:
    """The control process's side of one subscriber: what it was last sent, so each line carries only the
    instances whose view changed (a thousand boxes' views go once, then a handful per change)."""

    def __init__(self) -> None:
        self._sent: dict[str, InstanceView] = {}
        self._version: int | None = None

    def delta(self, run_id: str, registry: Registry, version: WeightVersion,
              trust_of: Callable[[Instance], TrustView] | None = None) -> FleetDelta | None:
        """The next line for this subscriber, None when nothing changed since the last one."""
        full = self._version is None
        now = {inst.id: view_of(inst, NO_TRUST if trust_of is None else trust_of(inst)) for inst in registry}
        changed = [v for iid, v in now.items() if self._sent.get(iid) != v]
        removed = [iid for iid in self._sent if iid not in now]
        if not (full or changed or removed or version.current != self._version):
            return None
        self._sent, self._version = now, version.current
        return FleetDelta(run_id, version.current, changed, removed, full)


ViewListener = Callable[[Instance, "InstanceView | None", InstanceView], None]


def follow(registry: Registry, version: WeightVersion, delta: FleetDelta, on_view: ViewListener | None = None,
           seen: dict[str, InstanceView] | None = None) -> None:
    """Make ``registry`` (a relay's) what the control process says: new instances added with its ids,
    states and versions taken as they are (the control process already checked each move), removed ones
    dead, so the relay's parts hear the same events as the control process's did."""
    version.current = max(version.current, delta.weight_version)
    keep = {v.id for v in delta.changed}
    gone = list(delta.removed)
    if delta.full:
        gone += [inst.id for inst in registry if inst.id not in keep]
    for iid in gone:
        inst = registry.get(iid)
        if inst is not None:
            registry.follow_state(inst, State.DEAD, "removed by the control process")
    for iid in gone:
        if seen is not None:
            seen.pop(iid, None)
    for view in delta.changed:
        inst = registry.get(view.id)
        if inst is not None and (inst.host, inst.port, inst.kind) != (view.host, view.port, view.kind):
            registry.follow_state(inst, State.DEAD, "its id names another instance at the control process")
            inst = None
            if seen is not None:
                seen.pop(view.id, None)
        if inst is None:
            inst = adopt(registry, view, "as the control process registered it", quiet=True)
        else:
            adopt_engine(inst, view.engine)
            registry.follow(inst, view.weight_version, view.serving_version, view.quarantined, view.waiting_for)
            if inst.state != view.state:
                registry.follow_state(inst, view.state, "as the control process moved it")
        if seen is not None:
            before = seen.get(view.id)
            seen[view.id] = view
            if on_view is not None:
                on_view(inst, before, view)


def adopt(registry: Registry, view: InstanceView, why: str, *, quiet: bool = False) -> Instance:
    """Add the instance ``view`` describes to ``registry`` with its id, order and state."""
    return registry.adopt(
        Instance(id=view.id, host=view.host, port=view.port, kind=view.kind, order=view.order,
                 mooncake_handshake_port=view.mooncake_handshake_port, weight_receiver_port=view.weight_receiver_port,
                 declared_vocab_size=view.declared_vocab_size, vocab_from_config=view.vocab_from_config,
                 box_token_digest=view.box_token_digest, preemptible=view.preemptible,
                 price_per_hour=view.price_per_hour, engine=view.engine, state=view.state,
                 weight_version=view.weight_version, quarantined=view.quarantined),
        view.serving_version, why, quiet=quiet)


def views_of(registry: Registry, trust_of: Callable[[Instance], TrustView] | None = None) -> list[InstanceView]:
    return [view_of(inst, NO_TRUST if trust_of is None else trust_of(inst)) for inst in registry]


def adopt_all(registry: Registry, views: Iterable[InstanceView], why: str) -> list[Instance]:
    """A new control process takes the instances a relay still knows and it does not, under their ids unless
    the id went to a box registered since it started (then under a new one; the relays follow the rename)."""
    out = []
    for view in views:
        if registry.by_endpoint(format_endpoint(view.host, view.port)) is not None:
            continue
        if registry.get(view.id) is not None:
            iid, order = registry.fresh_id()
            view = msgspec.structs.replace(view, id=iid, order=order)
        out.append(adopt(registry, view, why))
    return out
