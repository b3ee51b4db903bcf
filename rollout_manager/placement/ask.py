"""What a sequence asks of the dispatcher for its next attempt: one value, built by the generator from the
sequence's state (``rollout.generation``), read by the dispatcher, its wait queue and the policies."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rollout_manager.instances.registry import Instance

__all__ = ["Ask"]


@dataclass(frozen=True, slots=True)
class Ask:
    """One request for an instance.

    ``tokens``: what placing it reserves (its budget left). ``avoid``: instances it failed on (used again only
    once recovered, and never counted as ones that could take it). ``prefer``: the instance whose prefix cache
    holds it (affinity, or the box a divided rollout's last piece ran on). ``allow``: which instances may take it
    (its staleness bound, version floor, routed experts; None: any). ``since``: when its wait for an instance
    began (its first failure in a row; None: ``dispatch.accepted_at``, else now). ``predicted``: the tokens it is
    expected to make on this placement (the length model's figure; None: no prediction). ``context``: what a
    move would prefill (prompt and tokens made). ``high``: an upper quantile of what it makes, where the length
    model has evidence for one (``Makespan.place``).
    """

    tokens: int
    avoid: frozenset[str] = frozenset()
    prefer: str | None = None
    allow: Callable[[Instance], bool] | None = None
    since: float | None = None
    predicted: float | None = None
    context: int | None = None
    high: float | None = None

    @property
    def constrained(self) -> bool:
        """It may be unplaceable where others are not (instances it must avoid, a version bound)."""
        return bool(self.avoid) or self.allow is not None
