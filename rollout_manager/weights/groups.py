"""Who pushes weights to whom: sender transfer groups per network interface, instances round-robin.

Pure functions. Each trainer node runs one sender; its groups are bound round-robin to the node's
interfaces that ``allowed_sender_ips`` admits, so traffic spreads over every allowed NIC. Instances are
dealt to (sender, group) slots in registration order, interleaving senders first so consecutive
instances land on different trainer nodes.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from rollout_manager.errors import BadRequest

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class Group:
    sender: int  # trainer node index, in the order the trainer reported them
    group: int  # group index within that sender
    ip: str  # the interface this group's transfer engine binds to

    def to_dict(self) -> dict[str, object]:
        return {"sender": self.sender, "group": self.group, "ip": self.ip}


def filter_ips(ips: Iterable[str], allowed: Sequence[Network]) -> list[str]:
    """The IPs of ``ips`` inside any allowed network, in their given order, without repeats."""
    out: list[str] = []
    for ip in ips:
        addr = ipaddress.ip_address(ip)
        if any(addr in net for net in allowed if net.version == addr.version) and ip not in out:
            out.append(ip)
    return out


def plan_groups(
    sender_ips: Sequence[Sequence[str]], allowed: Sequence[Network], groups_per_sender: int
) -> list[list[Group]]:
    """Groups per sender, each bound to an allowed interface of that sender, round-robin.

    Raises BadRequest naming the node when none of its IPs is allowed.
    """
    plan: list[list[Group]] = []
    for s, ips in enumerate(sender_ips):
        usable = filter_ips(ips, allowed)
        if not usable:
            nets = ", ".join(str(n) for n in allowed)
            raise BadRequest(
                f"weight sender {s}: none of its IPs {list(ips)} is inside allowed_sender_ips ({nets})"
            )
        plan.append([Group(s, g, usable[g % len(usable)]) for g in range(groups_per_sender)])
    return plan


def slot_order(plan: Sequence[Sequence[Group]]) -> list[Group]:
    """All groups in dealing order: group 0 of every sender, then group 1 of every sender, ..."""
    order: list[Group] = []
    depth = max((len(groups) for groups in plan), default=0)
    for g in range(depth):
        order.extend(groups[g] for groups in plan if g < len(groups))
    return order


def assign(instance_ids: Sequence[str], plan: Sequence[Sequence[Group]]) -> dict[str, Group]:
    """Deal instances (in registration order) to groups round-robin; even by construction."""
    slots = slot_order(plan)
    if not slots:
        return {}
    return {iid: slots[i % len(slots)] for i, iid in enumerate(instance_ids)}

