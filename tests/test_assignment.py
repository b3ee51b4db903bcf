"""Sender groups per allowed interface and round-robin instance assignment (pure functions)."""

from __future__ import annotations

from collections import Counter

import pytest

from rollout_manager.config import parse_networks
from rollout_manager.errors import BadRequest
from rollout_manager.weights.groups import assign, filter_ips, plan_groups, slot_order

ALL = parse_networks("0.0.0.0/0")


def test_filter_by_cidr_and_exact_ip_keeps_order_and_drops_repeats():
    allowed = parse_networks("10.1.0.0/16, 192.168.0.9")
    ips = ["192.168.0.8", "10.1.2.3", "192.168.0.9", "10.2.0.1", "10.1.2.3"]
    assert filter_ips(ips, allowed) == ["10.1.2.3", "192.168.0.9"]


def test_ipv6_addresses_only_match_ipv6_networks():
    assert filter_ips(["::1", "127.0.0.1"], ALL) == ["127.0.0.1"]
    assert filter_ips(["::1"], parse_networks("::/0")) == ["::1"]


def test_groups_bind_round_robin_over_each_nodes_allowed_interfaces():
    plan = plan_groups([["10.0.0.1", "10.0.0.2", "172.16.0.1"], ["10.0.1.1"]],
                       parse_networks("10.0.0.0/8"), groups_per_sender=3)
    assert [g.ip for g in plan[0]] == ["10.0.0.1", "10.0.0.2", "10.0.0.1"]
    assert [g.ip for g in plan[1]] == ["10.0.1.1"] * 3
    assert [(g.sender, g.group) for g in plan[1]] == [(1, 0), (1, 1), (1, 2)]


def test_node_without_allowed_ip_is_refused_naming_it():
    with pytest.raises(BadRequest, match=r"weight sender 1: none of its IPs \['192.168.1.1'\]"):
        plan_groups([["10.0.0.1"], ["192.168.1.1"]], parse_networks("10.0.0.0/8"), 1)


def test_dealing_interleaves_senders_then_groups():
    plan = plan_groups([["1.1.1.1"], ["2.2.2.2"]], ALL, 2)
    assert [(g.sender, g.group) for g in slot_order(plan)] == [(0, 0), (1, 0), (0, 1), (1, 1)]


@pytest.mark.parametrize("n_instances", [1, 3, 4, 7, 13])
def test_assignment_is_even_and_in_registration_order(n_instances):
    plan = plan_groups([["1.1.1.1", "1.1.1.2"], ["2.2.2.2"]], ALL, 2)
    ids = [f"i{k}" for k in range(n_instances)]
    mapping = assign(ids, plan)
    load = Counter((g.sender, g.group) for g in mapping.values())
    assert max(load.values()) - min(load.values(), default=0) <= 1 or len(load) < 4
    assert (mapping["i0"].sender, mapping["i0"].group) == (0, 0)
    if n_instances > 1:
        assert mapping["i1"].sender == 1  # consecutive instances go to different trainer nodes


def test_more_groups_than_instances_and_no_senders():
    plan = plan_groups([["1.1.1.1"]], ALL, 8)
    assert len({(g.sender, g.group) for g in assign(["a", "b"], plan).values()}) == 2
    assert assign(["a"], []) == {}


def test_re_dealing_after_instances_leave_stays_even():
    plan = plan_groups([["1.1.1.1", "1.1.1.2"]], ALL, 2)
    ids = [f"i{k}" for k in range(6)]
    survivors = [i for i in ids if i not in ("i0", "i2", "i4")]  # every instance of group 0 left
    load = Counter((g.sender, g.group) for g in assign(survivors, plan).values())
    assert sorted(load.values()) == [1, 2]
