"""The round-robin placement policy (pure)."""

from __future__ import annotations

from collections.abc import Sequence

from rollout_manager.placement.instance_load import InstanceLoad

__all__ = ["RoundRobin"]


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
