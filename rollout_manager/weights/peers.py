"""Who a box that joins (or fell behind) pulls the current version from: the nearest peer holding it.

Runs in: manager.

A peer is an active remote instance at exactly the wanted version whose receiver agent can serve its
verified buffer (:meth:`Receiver.serve_peer`). Nearest first: the same sender group (same trainer
interface, so likely the same cluster), then the same subnet (IPv4 /24, IPv6 /64), then any; among
equals the peer serving the fewest pulls right now, then registration order. Pure functions: the
manager's :class:`WeightSync` asks, and falls back to the trainer's sender when there is none.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping

from rollout_manager.instances.registry import Instance, Kind, State

SAME_GROUP, SAME_SUBNET, ANY = 0, 1, 2  # distance classes, nearest first


def subnet(host: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network | None:
    """The /24 (IPv4) or /64 (IPv6) holding ``host``; None for a name (no subnet is guessed)."""
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return None
    return ipaddress.ip_network(f"{addr}/{24 if addr.version == 4 else 64}", strict=False)


def distance(puller: Instance, peer: Instance) -> int:
    if puller.sender is not None and (puller.sender, puller.group) == (peer.sender, peer.group):
        return SAME_GROUP
    mine = subnet(puller.host)
    return SAME_SUBNET if mine is not None and mine == subnet(peer.host) else ANY


def holders(instances: Iterable[Instance], puller: Instance, version: int) -> list[Instance]:
    """Instances that can serve ``version`` to ``puller``: active, remote, at that version, with a receiver."""
    return [i for i in instances if i is not puller and i.state == State.ACTIVE and i.kind == Kind.REMOTE
            and i.weight_version == version and i.weight_receiver_port is not None]


def choose_peer(puller: Instance, candidates: Iterable[Instance], serving: Mapping[str, int]) -> Instance | None:
    """The nearest candidate, the least busy among equals (``serving``: pulls in flight per instance id)."""
    ranked = sorted(candidates, key=lambda p: (distance(puller, p), serving.get(p.id, 0), p.order))
    return ranked[0] if ranked else None
