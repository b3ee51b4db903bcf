"""Each instance's trust figure: the trainer's log-prob mismatch on the tokens it made, step after step.

The trainer plugin splits each step's gap between the trainer's log-probs (verl's ``old_log_probs``) and
the rollout's (``rollout_log_probs``) by the box that made each token (``trainer_plugin.mismatch``) and
posts it (``POST /update_mismatch``). Here each instance keeps an exponentially weighted mean of its
per-step mean ``|trainer - rollout|`` gap (and of the k3 KL estimate), the step it last reported, and
its ratio to the fleet's median. A single box's bad GPU, kernel or stray weight write shows as one
instance far above the median; every instance above ``mismatch_floor`` together says the trainer and
the fleet disagree as a whole (a dtype, a weight sync gone wrong): then it is not the boxes' fault.

Nothing here takes an instance out of service (``quarantine.py`` acts on the verdicts). No I/O; the event
loop alone writes it.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class MismatchSettings:
    alpha: float = 0.3  # weight of the newest step in the moving average
    outlier_multiple: float = 3.0  # above this multiple of the fleet's median: called out
    floor: float = 0.05  # mean |gap| under which nothing is called out

    @classmethod
    def from_config(cls, cfg: Any) -> MismatchSettings:
        return cls(cfg.mismatch_ewma_alpha, cfg.mismatch_outlier_multiple, cfg.mismatch_floor)


@dataclass(frozen=True, slots=True)
class BoxReport:
    """One instance's figures for one step, as the trainer measured them."""

    instance: str
    tokens: int
    mean_abs_diff: float
    k3_kl: float


@dataclass(slots=True)
class BoxFigures:
    """One instance's running figures."""

    mean_abs_diff: float  # exponentially weighted over steps
    k3_kl: float
    last_mean_abs_diff: float
    last_k3_kl: float
    last_step: int
    steps: int = 1
    tokens: int = 0


@dataclass(frozen=True, slots=True)
class Fleet:
    """The fleet's side of the figures: the median the ratios are taken to, and whether all disagree."""

    median: float | None
    instances: int
    above_floor: int
    fleet_wide: bool

    def to_dict(self) -> dict[str, Any]:
        return {"median_mean_abs_diff": self.median, "instances": self.instances, "above_floor": self.above_floor,
                "fleet_wide": self.fleet_wide}


class MismatchLedger:
    """The trust figures of every instance that reported; read by status, metrics and the status page."""

    def __init__(self, settings: MismatchSettings | None = None) -> None:
        self.settings = settings or MismatchSettings()
        self.by_instance: dict[str, BoxFigures] = {}
        self.last_step: int | None = None
        self.unattributed_tokens = 0

    def report(self, step: int, boxes: Sequence[BoxReport], unattributed_tokens: int = 0) -> None:
        """Fold one step's figures in (an instance reported twice in a step keeps the token-weighted mean)."""
        merged: dict[str, BoxReport] = {}
        for box in boxes:
            seen = merged.get(box.instance)
            if seen is not None:
                n = seen.tokens + box.tokens
                box = BoxReport(box.instance, n,
                                (seen.mean_abs_diff * seen.tokens + box.mean_abs_diff * box.tokens) / n,
                                (seen.k3_kl * seen.tokens + box.k3_kl * box.tokens) / n)
            merged[box.instance] = box
        a = self.settings.alpha
        for box in merged.values():
            t = self.by_instance.get(box.instance)
            if t is None:
                self.by_instance[box.instance] = BoxFigures(box.mean_abs_diff, box.k3_kl, box.mean_abs_diff, box.k3_kl,
                                                       step, tokens=box.tokens)
                continue
            t.mean_abs_diff += a * (box.mean_abs_diff - t.mean_abs_diff)
            t.k3_kl += a * (box.k3_kl - t.k3_kl)
            t.last_mean_abs_diff, t.last_k3_kl, t.last_step = box.mean_abs_diff, box.k3_kl, step
            t.steps += 1
            t.tokens += box.tokens
        self.last_step = step if self.last_step is None else max(self.last_step, step)
        self.unattributed_tokens += unattributed_tokens

    def forget(self, keep: Iterable[str]) -> None:
        """Drop the figures of instances no longer registered (their ids are never reused)."""
        live = set(keep)
        for gone in [i for i in self.by_instance if i not in live]:
            del self.by_instance[gone]

    def fleet(self, live: Iterable[str] | None = None) -> Fleet:
        """The median over the instances that reported (and, given ``live``, are still registered)."""
        figures = [t.mean_abs_diff for i, t in self._reported(live)]
        above = sum(f > self.settings.floor for f in figures)
        return Fleet(statistics.median(figures) if figures else None, len(figures), above,
                     fleet_wide=len(figures) >= 2 and above == len(figures))

    def of(self, instance: str, fleet: Fleet) -> dict[str, Any] | None:
        """One instance's figure for the status (None: it has not reported)."""
        t = self.by_instance.get(instance)
        if t is None:
            return None
        ratio = t.mean_abs_diff / fleet.median if fleet.median else None
        return {"mean_abs_diff": t.mean_abs_diff, "k3_kl": t.k3_kl, "last_mean_abs_diff": t.last_mean_abs_diff,
                "last_k3_kl": t.last_k3_kl, "last_step": t.last_step, "steps": t.steps, "tokens": t.tokens,
                "ratio_to_median": ratio, "above_median_multiple": self.is_outlier(t, fleet),
                "verdict": self.verdict(t, fleet, ratio)}

    def is_outlier(self, t: BoxFigures, fleet: Fleet) -> bool:
        """Above the floor and above ``outlier_multiple`` x the fleet's median (never when all disagree)."""
        s = self.settings
        if fleet.fleet_wide or t.mean_abs_diff <= s.floor or fleet.instances < 2:
            return False
        return fleet.median is None or fleet.median <= 0 or t.mean_abs_diff > s.outlier_multiple * fleet.median

    def verdict(self, t: BoxFigures, fleet: Fleet, ratio: float | None) -> str:
        if fleet.fleet_wide:
            return "every instance disagrees with the trainer together: not this instance's fault"
        if self.is_outlier(t, fleet):
            times = f"{ratio:.1f}x" if ratio is not None else "far above"
            return (f"mismatch {times} the fleet's median (above {self.settings.outlier_multiple:g}x): "
                    "suspect this instance")
        if t.mean_abs_diff > self.settings.floor and fleet.instances < 2:
            return "above the floor, but no other instance to compare with"
        return "ok"

    def summary(self, live: Iterable[str] | None = None) -> dict[str, Any]:
        """The fleet's line for the status: median, counts, who is called out, and what it means."""
        live_ids = None if live is None else list(live)
        fleet = self.fleet(live_ids)
        outliers = sorted(i for i, t in self._reported(live_ids) if self.is_outlier(t, fleet))
        if fleet.fleet_wide:
            note = ("every instance's mismatch is above mismatch_floor: the trainer and the whole fleet disagree "
                    "(dtype, weight sync, the trainer itself), not one box")
        elif outliers:
            note = f"{len(outliers)} instance(s) above {self.settings.outlier_multiple:g}x the fleet's median"
        elif fleet.instances:
            note = "no instance stands out"
        else:
            note = "no mismatch reported yet (the trainer posts it after each step)"
        return {**fleet.to_dict(), "last_step": self.last_step, "outliers": outliers,
                "unattributed_tokens": self.unattributed_tokens, "outlier_multiple": self.settings.outlier_multiple,
                "floor": self.settings.floor, "note": note}

    def _reported(self, live: Iterable[str] | None) -> list[tuple[str, BoxFigures]]:
        if live is None:
            return list(self.by_instance.items())
        return [(i, self.by_instance[i]) for i in live if i in self.by_instance]
