"""How long trainer-side ("local") instances generate each step before the trainer takes its GPUs back.

The rule (docs/placement.md, "Local + remote"): after each step the trainer reports how long it sat idle waiting
for rollouts (its bubble) and the manager measures how long remote instances sat idle. A bubble means
the trainer took its GPUs back too early, so local generation should last longer; idle remote
instances mean local instances took work the remote ones could have done, so it should last less.
The budget moves by ``gain`` times the difference, within bounds, and settles where both idle times
are equal: neither side waits for the other.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("rollout_manager.placement.local_budget")


@dataclass
class LocalBudget:
    budget_s: float
    min_s: float
    max_s: float
    gain: float = 0.5
    history: list[dict[str, float]] = field(default_factory=list)

    def update(self, trainer_bubble_s: float, remote_idle_s: float) -> float:
        """One step's evidence -> the next step's budget."""
        before = self.budget_s
        step = self.gain * (trainer_bubble_s - remote_idle_s)
        self.budget_s = min(max(before + step, self.min_s), self.max_s)
        self.history.append({"trainer_bubble_s": trainer_bubble_s, "remote_idle_s": remote_idle_s,
                             "budget_before_s": before, "budget_s": self.budget_s})
        del self.history[:-50]
        return self.budget_s


class LocalWindow:
    """While open, local instances take requests first; closing it moves their sequences to remote ones.

    The window opens at the first request after a step boundary (start-up, ``/update_metrics``) and
    closes when the budget runs out or the trainer calls ``/abort_local_requests``.
    """

    def __init__(self, on_change: Callable[[], None] = lambda: None) -> None:
        self.on_change = on_change
        self.is_open = False
        self.armed = True
        self.closed = asyncio.Event()
        self.closed.set()
        self._timer: asyncio.TimerHandle | None = None
        self.last_close_reason: str | None = None

    def open(self, budget_s: float) -> bool:
        if self.is_open or not self.armed:
            return False
        self.is_open, self.armed = True, False
        self.closed = asyncio.Event()
        self._timer = asyncio.get_running_loop().call_later(budget_s, self.close, f"budget of {budget_s:g}s used")
        log.info("local window open for %.3gs", budget_s)
        return True

    def close(self, reason: str) -> bool:
        if not self.is_open:
            return False
        self.is_open = False
        if self._timer is not None:
            self._timer.cancel()
        self.closed.set()
        self.last_close_reason = reason
        self.on_change()
        log.info("local window closed: %s; local sequences continue on remote instances", reason)
        return True

    def rearm(self) -> None:
        self.armed = True

    def to_dict(self) -> dict[str, Any]:
        return {"open": self.is_open, "armed": self.armed, "last_close_reason": self.last_close_reason}
