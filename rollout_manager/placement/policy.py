"""What a placement policy is: it picks an instance for a request, or holds the request in the manager.

The policies are pure (no I/O, no asyncio, time an argument), so the daemon and the discrete-event simulators
(``benchmarks/bench_scheduling.py``, ``benchmarks/sim_tail.py``) run exactly the same decisions; each lives in
its own module (``round_robin``, ``least_in_flight``, ``throughput_aware``, ``makespan``), and
``policy_registry`` builds one by name. The manager dispatches every request itself, so it knows each
instance's in-flight requests and tokens without asking SGLang (0.5.23's ``/server_info`` has no
running/queued counts), and measures each instance's token rate from its own streams
(``rate_meter.TokenRateMeter``).

A policy may answer ``None`` ("hold it in the manager's queue"): the manager keeps the request and offers it
again when something completes. Holding is what keeps instance-side queues short, and a short queue is what
makes a preemption cheap: what has to move is what sat on the dead instance.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from rollout_manager.placement.instance_load import InstanceLoad

__all__ = ["PlacementPolicy"]


@runtime_checkable
class PlacementPolicy(Protocol):
    """Pick an instance id from ``candidates`` or None to hold the request in the manager.

    Contract: never return an id that is not in ``candidates``; with no candidates return None;
    return None with candidates present only if the policy limits queues and all are full.
    ``request_tokens`` is the request's remaining token budget.
    """

    name: str

    def pick(
        self, candidates: Sequence[InstanceLoad], request_tokens: int, now: float
    ) -> str | None: ...
