"""Who pushes weights to whom: sender transfer groups per network interface, instances round-robin.

Runs in: manager.

Each trainer node runs one sender; its groups are bound round-robin to the node's
interfaces that ``allowed_sender_ips`` admits, so traffic spreads over every allowed NIC. Instances are
dealt to (sender, group) slots in registration order, interleaving senders first so consecutive
instances land on different trainer nodes. The planning is pure functions; :class:`SenderPlan` holds
the current plan and re-deals on every registration and removal.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from rollout_manager.config import Config
from rollout_manager.errors import BadRequest
from rollout_manager.instances.registry import Event, Instance, Kind, Registry, State
from rollout_manager.notify import Signal
from rollout_manager.osutil import format_endpoint

log = logging.getLogger("rollout_manager.weights.groups")

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


class SenderPlan:
    """The trainer nodes' senders, their transfer groups, and the remote instances dealt to them.

    The trainer reports its nodes' IPs (``PUT /update_weight_senders``); every registration and
    removal of a remote instance re-deals the instances, so groups stay even as boxes come and go.
    """

    def __init__(self, registry: Registry, config: Config) -> None:
        self.registry = registry
        self.allowed = config.allowed_networks
        self.base_port = config.weight_sender_base_port
        self.protocol = config.mooncake_transfer_protocol
        self.device_name = config.mooncake_transfer_device_name
        self.groups_per_sender = config.num_mooncake_groups_per_sender
        self.engines_per_group = config.num_mooncake_engines_per_group
        self.sender_ips: list[list[str]] = []
        self.plan: list[list[Group]] = []
        self.changed = Signal()  # senders reported: pushes waiting for one can go
        registry.listeners.append(self._on_event)

    def update(self, sender_ips: list[list[str]], groups_per_sender: int | None = None,
               engines_per_group: int | None = None) -> None:
        """New senders; raises BadRequest (and changes nothing) when a node has no allowed IP."""
        groups = groups_per_sender or self.groups_per_sender
        plan = plan_groups(sender_ips, self.allowed, groups)
        self.sender_ips, self.plan, self.groups_per_sender = sender_ips, plan, groups
        if engines_per_group:
            self.engines_per_group = engines_per_group
        self._deal()
        self.changed.notify()
        log.info("weight senders updated: %d sender(s), %d group(s) each, %d engine(s) per group",
                 len(plan), groups, self.engines_per_group)

    def group_of(self, inst: Instance) -> Group | None:
        if inst.sender is None or inst.group is None:
            return None
        return self.plan[inst.sender][inst.group]

    def sender_url(self, sender: int) -> str:
        """A sender's control API: its node's first allowed IP, on ``weight_sender_base_port``."""
        return f"http://{format_endpoint(self.plan[sender][0].ip, self.base_port)}"

    def assignment_of(self, inst: Instance) -> dict[str, Any]:
        """What a registering box is told about its weight transfers."""
        group = self.group_of(inst)
        return {
            "sender": inst.sender,
            "group": inst.group,
            "sender_ip": group.ip if group else None,
            "num_mooncake_engines_per_group": self.engines_per_group,
            "mooncake_transfer_protocol": self.protocol,
            "mooncake_transfer_device_name": self.device_name,
        }

    def status(self) -> dict[str, Any]:
        return {
            "num_mooncake_groups_per_sender": self.groups_per_sender,
            "num_mooncake_engines_per_group": self.engines_per_group,
            "weight_sender_base_port": self.base_port,
            "mooncake_transfer_protocol": self.protocol,
            "mooncake_transfer_device_name": self.device_name,
            "senders": [
                {
                    "sender": s,
                    "ips": self.sender_ips[s],
                    "groups": [
                        {**g.to_dict(), "instances": [
                            i.endpoint for i in self.registry if i.sender == s and i.group == g.group
                        ]}
                        for g in groups
                    ],
                }
                for s, groups in enumerate(self.plan)
            ],
        }

    def _on_event(self, inst: Instance, event: Event) -> None:
        if inst.kind == Kind.REMOTE and (event.old is None or event.new == State.DEAD):
            self._deal()

    def _deal(self) -> None:
        remote = self.registry.in_state(*State, kind=Kind.REMOTE)
        mapping = assign([i.id for i in remote], self.plan)
        for inst in remote:
            group = mapping.get(inst.id)
            self.registry.assign_sender(inst, group.sender if group else None, group.group if group else None)
