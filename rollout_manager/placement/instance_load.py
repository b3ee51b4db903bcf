"""What a placement policy sees of one instance: the manager's own count of its load, and its speed."""

from __future__ import annotations

from dataclasses import dataclass

from rollout_manager.placement.box_speed import StepModel

__all__ = ["InstanceLoad"]


@dataclass
class InstanceLoad:
    """The manager's own view of one schedulable instance at the moment of a decision.

    ``in_flight_tokens`` is the remaining token budget (``max_new_tokens`` minus tokens already
    streamed) summed over the requests dispatched to it and not finished: an upper bound on its
    outstanding decode work. ``token_rate`` is aggregate tokens/s while busy; None until measured.
    ``step`` is its decode step time as a function of its running count (``box_speed``), the fleet's
    median box while it is not measured itself; None while no box is. Where it is known it is what
    rates are read from, at the count a placement would leave: an aggregate rate measured at whatever
    count the box happened to run says more about what it was given than about the box.
    ``predicted_tokens`` and ``longest_tokens``: what the length model predicts its sequences still
    make, in all and the longest of them (0 where nothing was predicted; see ``makespan.BoxWork``).
    ``max_in_flight``: the most sequences the manager places on it (its running bound; None: unbounded), which
    tail migration's swaps read: a box at its bound takes a moved sequence into its next free slot.
    """

    instance_id: str
    kind: str  # "remote" | "local"
    in_flight_requests: int
    in_flight_tokens: int
    token_rate: float | None = None
    lone_rate: float | None = None  # tokens/s one sequence alone would get (see lone_rate_weight)
    step: StepModel | None = None
    predicted_tokens: float = 0.0
    longest_tokens: float = 0.0
    max_in_flight: int | None = None
