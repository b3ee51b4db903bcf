"""Which rollout instance gets the next generation request.

Pure policy code: no I/O, no asyncio, and time is an argument, so the daemon and the discrete-event
simulator (``benchmarks/bench_scheduling.py``) run exactly the same decisions. The manager dispatches
every request itself, so it knows each instance's in-flight requests and tokens without asking SGLang
(0.5.23's ``/server_info`` has no running/queued counts), and it measures each instance's token rate
from its own streams with :class:`TokenRateMeter`.

A policy may answer ``None`` ("hold it in the manager's queue"): the manager keeps the request and
offers it again when something completes. Holding is what keeps instance-side queues short, and a
short queue is what makes a preemption cheap: what has to move is what sat on the dead instance.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

__all__ = [
    "InstanceLoad",
    "TokenRateMeter",
    "Policy",
    "RoundRobin",
    "LeastInFlight",
    "ThroughputAware",
    "POLICY_NAMES",
    "DEFAULT_POLICY",
    "make_policy",
]


@dataclass
class InstanceLoad:
    """The manager's own view of one schedulable instance at the moment of a decision.

    ``in_flight_tokens`` is the remaining token budget (``max_new_tokens`` minus tokens already
    streamed) summed over the requests dispatched to it and not finished: an upper bound on its
    outstanding decode work. ``token_rate`` is aggregate tokens/s while busy; None until measured.
    """

    instance_id: str
    kind: str  # "remote" | "local"
    in_flight_requests: int
    in_flight_tokens: int
    token_rate: float | None = None


class TokenRateMeter:
    """Exponentially weighted aggregate token rate of one instance, on a *busy-time* clock.

    Why busy time: the figure the scheduler needs is capacity (tokens/s the instance delivers while
    it has work), not utilisation. Time with nothing in flight says nothing about capacity, so the
    clock stops while idle and the estimate stays frozen instead of decaying to zero between
    batches. Time with work in flight but no tokens (a stall, a slow prefill) is real evidence of a
    slow instance, so the clock runs and the estimate decays toward the truth.

    Maths: ``S`` is the token count decayed by ``exp(-busy_dt / tau)``; for a constant rate ``r``
    after busy time ``T``, ``S = r * tau * (1 - exp(-T / tau))``, so dividing by that factor gives an
    unbiased estimate from the first second on (a plain average while ``T << tau``, an EWMA with time
    constant ``tau`` later). The rate is unknown (None) until ``min_busy_s`` of busy time was seen.

    Call :meth:`set_in_flight` whenever the instance's in-flight count changes and :meth:`observe`
    for every streamed chunk (tokens newly produced, summed over its sequences); observe a
    request's last chunk before lowering the count, so its tokens land in busy time.
    """

    def __init__(self, tau_s: float = 5.0, min_busy_s: float = 1.0) -> None:
        if tau_s <= 0 or min_busy_s < 0:
            raise ValueError("tau_s must be > 0 and min_busy_s >= 0")
        self.tau_s = tau_s
        self.min_busy_s = min_busy_s
        self._decayed_tokens = 0.0
        self._busy_s = 0.0
        self._busy = False
        self._last: float | None = None

    @property
    def busy(self) -> bool:
        return self._busy

    def _elapsed_busy(self, now: float) -> float:
        if not self._busy or self._last is None:
            return 0.0
        return max(0.0, now - self._last)

    def _advance(self, now: float) -> None:
        dt = self._elapsed_busy(now)
        if dt > 0:
            self._decayed_tokens *= math.exp(-dt / self.tau_s)
            self._busy_s += dt
        if self._last is None or now > self._last:
            self._last = now

    def set_in_flight(self, count: int, now: float) -> None:
        """Start or stop the busy clock: the instance is busy while ``count > 0``."""
        self._advance(now)
        self._busy = count > 0

    def observe(self, tokens: int, now: float) -> None:
        """Record ``tokens`` generated (over all its sequences) since the previous call.

        They were made across the busy interval since then, not at ``now``, so they get that
        interval's mean decay; counting them as fresh would bias the rate up by ~dt/(2*tau).
        """
        dt = self._elapsed_busy(now)
        self._advance(now)
        weight = -math.expm1(-dt / self.tau_s) * self.tau_s / dt if dt > 0 else 1.0
        self._decayed_tokens += max(0, tokens) * weight

    def rate(self, now: float) -> float | None:
        """Tokens/s while busy, or None before ``min_busy_s`` of busy time. Does not mutate."""
        dt = self._elapsed_busy(now)
        busy_s = self._busy_s + dt
        if busy_s <= 0 or busy_s < self.min_busy_s - 1e-9:  # tolerate float clock sums
            return None
        tokens = self._decayed_tokens * math.exp(-dt / self.tau_s)
        return tokens / (self.tau_s * -math.expm1(-busy_s / self.tau_s))


@runtime_checkable
class Policy(Protocol):
    """Pick an instance id from ``candidates`` or None to hold the request in the manager.

    Contract: never return an id that is not in ``candidates``; with no candidates return None;
    return None with candidates present only if the policy limits queues and all are full.
    ``request_tokens`` is the request's remaining token budget.
    """

    name: str

    def pick(
        self, candidates: Sequence[InstanceLoad], request_tokens: int, now: float
    ) -> str | None: ...


def _least_loaded_key(c: InstanceLoad) -> tuple[int, int, str]:
    return (c.in_flight_requests, c.in_flight_tokens, c.instance_id)


class RoundRobin:
    """Cycle through instance ids in sorted order; robust to instances joining and leaving."""

    name = "round_robin"

    def __init__(self) -> None:
        self._last: str | None = None

    def pick(
        self, candidates: Sequence[InstanceLoad], request_tokens: int, now: float
    ) -> str | None:
        if not candidates:
            return None
        ids = sorted(c.instance_id for c in candidates)
        last = self._last
        chosen = next((i for i in ids if last is None or i > last), ids[0])
        self._last = chosen
        return chosen


class LeastInFlight:
    """Fewest in-flight requests, ties by fewest in-flight tokens, then id.

    Never holds unless ``max_in_flight`` is given (then an instance at that count is full).
    """

    name = "least_in_flight"

    def __init__(self, max_in_flight: int | None = None) -> None:
        if max_in_flight is not None and max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        self.max_in_flight = max_in_flight

    def pick(
        self, candidates: Sequence[InstanceLoad], request_tokens: int, now: float
    ) -> str | None:
        cap = self.max_in_flight
        open_ = [c for c in candidates if cap is None or c.in_flight_requests < cap]
        if not open_:
            return None
        return min(open_, key=_least_loaded_key).instance_id


class ThroughputAware:
    """Short per-instance queues sized by measured rate; earliest expected completion wins.

    An instance is *full* when adding the request would push the expected drain time of its
    in-flight tokens, ``(in_flight_tokens + request_tokens) / token_rate``, past
    ``target_drain_s``; below ``min_concurrency`` requests it accepts work anyway, because decode
    throughput grows with batch size and an underfilled batch wastes the GPU. So no instance holds
    much more than ``target_drain_s`` of work, which bounds what a preemption has to move, and the
    rest waits in the manager, where it stays free to go to whichever instance frees up first.

    Among instances that are not full the request goes where it is expected to finish first, by
    the same formula (the new request has the largest budget, so under continuous batching it is
    the last of that instance's work to finish); faster instances receive work in proportion.

    Tokens are budgets (``max_new_tokens`` left), so the drain time is a worst case: every
    sequence running to its limit. ``target_drain_s`` is therefore in those units; it also means an
    instance too slow to finish even a few full-budget requests within it keeps only
    ``min_concurrency`` of them, which is what protects the batch's tail from slow instances.

    An instance with no measured rate yet gets a probe share of ``probe_in_flight`` requests
    (default ``min_concurrency``), served before measured ones so that it gets measured; beyond
    that it waits for its measurement. ``max_in_flight`` is an optional hard cap. The defaults come
    from ``benchmarks/bench_scheduling.py`` (4 instances, speeds 1:2:3:4, budget 8x the median).
    """

    name = "throughput_aware"

    def __init__(
        self,
        target_drain_s: float = 200.0,
        min_concurrency: int = 8,
        probe_in_flight: int | None = None,
        max_in_flight: int | None = None,
    ) -> None:
        if target_drain_s <= 0:
            raise ValueError("target_drain_s must be > 0")
        if min_concurrency < 1:
            raise ValueError("min_concurrency must be >= 1")
        if max_in_flight is not None and max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        self.target_drain_s = target_drain_s
        self.min_concurrency = min_concurrency
        self.probe_in_flight = min_concurrency if probe_in_flight is None else probe_in_flight
        self.max_in_flight = max_in_flight

    def _expected_finish_s(self, c: InstanceLoad, request_tokens: int) -> float:
        rate = c.token_rate or 0.0
        work = c.in_flight_tokens + request_tokens
        return work / rate if rate > 0 else math.inf

    def is_full(self, c: InstanceLoad, request_tokens: int) -> bool:
        """True if ``c`` should not take a request of ``request_tokens`` right now."""
        if self.max_in_flight is not None and c.in_flight_requests >= self.max_in_flight:
            return True
        if c.token_rate is None:
            return c.in_flight_requests >= self.probe_in_flight
        if c.in_flight_requests < self.min_concurrency:
            return False
        return self._expected_finish_s(c, request_tokens) > self.target_drain_s

    def pick(
        self, candidates: Sequence[InstanceLoad], request_tokens: int, now: float
    ) -> str | None:
        open_ = [c for c in candidates if not self.is_full(c, request_tokens)]
        if not open_:
            return None
        probes = [c for c in open_ if c.token_rate is None]
        if probes:
            return min(probes, key=_least_loaded_key).instance_id
        best = min(
            open_,
            key=lambda c: (
                self._expected_finish_s(c, request_tokens),
                c.in_flight_requests,
                c.instance_id,
            ),
        )
        return best.instance_id


_POLICIES: dict[str, Callable[..., Policy]] = {
    RoundRobin.name: RoundRobin,
    LeastInFlight.name: LeastInFlight,
    ThroughputAware.name: ThroughputAware,
}
POLICY_NAMES: tuple[str, ...] = tuple(_POLICIES)
DEFAULT_POLICY = ThroughputAware.name


def make_policy(name: str, **kw: object) -> Policy:
    """Build a policy by name; keyword arguments go to its constructor."""
    try:
        factory = _POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}") from None
    return factory(**kw)
