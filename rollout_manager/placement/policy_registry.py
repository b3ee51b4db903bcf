"""The placement policies by name (``scheduler_policy``), and the one factory that builds them.

A new policy is a module of its own with a ``name`` and a ``pick`` (``policy.PlacementPolicy``), and one row
in :data:`POLICIES`; ``config.Config.scheduler_policy`` lists the same names.
"""

from __future__ import annotations

from collections.abc import Callable

from rollout_manager.placement.least_in_flight import LeastInFlight
from rollout_manager.placement.makespan import Makespan
from rollout_manager.placement.policy import PlacementPolicy
from rollout_manager.placement.round_robin import RoundRobin
from rollout_manager.placement.throughput_aware import ThroughputAware

__all__ = ["POLICIES", "POLICY_NAMES", "DEFAULT_POLICY", "make_policy"]

POLICIES: dict[str, Callable[..., PlacementPolicy]] = {
    RoundRobin.name: RoundRobin,
    LeastInFlight.name: LeastInFlight,
    ThroughputAware.name: ThroughputAware,
    Makespan.name: Makespan,
}
POLICY_NAMES: tuple[str, ...] = tuple(POLICIES)
DEFAULT_POLICY = Makespan.name


def make_policy(name: str, **options: object) -> PlacementPolicy:
    """The policy configured as ``name`` (``scheduler_policy``); ``options`` go to its constructor."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}") from None
    return factory(**options)
