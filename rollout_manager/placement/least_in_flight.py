"""The least-in-flight placement policy (pure)."""

from __future__ import annotations

from collections.abc import Sequence

from rollout_manager.placement.instance_load import InstanceLoad

__all__ = ["LeastInFlight"]


def _least_loaded_key(c: InstanceLoad) -> tuple[int, int, str]:
    return (c.in_flight_requests, c.in_flight_tokens, c.instance_id)


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
