"""The trainer's log-prob mismatch, attributed to the box that made each token (``POST /update_mismatch``).

verl recomputes the trainer's log-prob of every rollout token (``old_log_probs``) and keeps the rollout's
own (``rollout_log_probs``); its ``rollout_corr_helper`` reports their gap for the whole batch. Every
sample the manager answers carries ``meta_info.segments`` (which instance made output tokens
``[start, end)`` and at which weight version; the proxy keeps them in verl's ``extra_fields``), so the
gap can be split by box: :func:`tally_boxes` is that split, pure (lists, numpy arrays or torch tensors
in, numbers out) so it is tested without verl. Per box it sums, over the tokens the box made and the
response mask keeps, ``|old - rollout|`` and the k3 estimator of KL(rollout || trainer),
``exp(r) - r - 1`` with ``r = old - rollout`` clamped to +-20 as ``rollout_corr_helper`` clamps it.
:class:`StepMismatch` adds the tallies of a step's micro-batches up and makes the body the manager takes.

Tokens no segment covers (a multi-turn agent loop keeps the first turn's ``extra_fields`` only in
verl 0.9.1, so later turns' tokens have no segments) are counted as ``unattributed_tokens``, never
guessed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# rollout_corr_helper's SAFETY_BOUND: a log-ratio beyond it says "wildly off" already, and exp() stays finite
LOG_RATIO_BOUND = 20.0


@dataclass(frozen=True, slots=True)
class BoxKey:
    """One box as segments name it (the manager's instance id and its endpoint)."""

    instance: str
    endpoint: str


@dataclass(slots=True)
class BoxTally:
    """Sums over the tokens one box made: enough to add micro-batches up before taking means."""

    tokens: int = 0
    abs_diff_sum: float = 0.0
    k3_sum: float = 0.0

    def add(self, other: BoxTally) -> None:
        self.tokens += other.tokens
        self.abs_diff_sum += other.abs_diff_sum
        self.k3_sum += other.k3_sum

    @property
    def mean_abs_diff(self) -> float:
        return self.abs_diff_sum / self.tokens if self.tokens else 0.0

    @property
    def k3_kl(self) -> float:
        return self.k3_sum / self.tokens if self.tokens else 0.0


@dataclass(slots=True)
class Tallies:
    """A batch split by box, and the masked tokens no segment covers."""

    boxes: dict[BoxKey, BoxTally] = field(default_factory=dict)
    unattributed_tokens: int = 0

    def add(self, other: Tallies) -> None:
        for key, tally in other.boxes.items():
            self.boxes.setdefault(key, BoxTally()).add(tally)
        self.unattributed_tokens += other.unattributed_tokens


def _row(values: Any) -> np.ndarray:
    """One sample's values as a 1-D float64 array (a torch tensor is detached and moved to the CPU)."""
    if hasattr(values, "detach"):
        values = values.detach().float().cpu().numpy()
    return np.asarray(values, dtype=np.float64).reshape(-1)


def tally_boxes(segments: Sequence[Sequence[Mapping[str, Any]] | None], old_log_probs: Iterable[Any],
                rollout_log_probs: Iterable[Any], response_mask: Iterable[Any]) -> Tallies:
    """Split a batch's mismatch by the box that made each token.

    ``segments[i]``: sample ``i``'s ``meta_info.segments`` (``instance``, ``endpoint``, ``start``, ``end`` in
    output tokens, which are the response's first tokens), None or empty when unknown; the other three:
    one row per sample over its response positions (padded rows are fine: the mask says which count).
    """
    out = Tallies()
    for segs, old, rollout, mask in zip(segments, old_log_probs, rollout_log_probs, response_mask, strict=True):
        old_row, rollout_row, mask_row = _row(old), _row(rollout), _row(mask) > 0
        n = min(len(old_row), len(rollout_row), len(mask_row))
        counted = mask_row[:n].copy()
        with np.errstate(invalid="ignore"):  # -inf on one side is as far off as the bound; on both, no gap
            gap = np.nan_to_num(old_row[:n] - rollout_row[:n], nan=0.0, posinf=LOG_RATIO_BOUND,
                                neginf=-LOG_RATIO_BOUND)
        ratio = np.clip(gap, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        for seg in segs or ():
            start, end = max(0, int(seg["start"])), min(n, int(seg["end"]))
            if end <= start:
                continue
            take = counted[start:end]
            r = ratio[start:end][take]
            if r.size:
                key = BoxKey(str(seg["instance"]), str(seg.get("endpoint") or ""))
                out.boxes.setdefault(key, BoxTally()).add(
                    BoxTally(int(r.size), float(np.abs(r).sum()), float((np.exp(r) - r - 1.0).sum())))
            counted[start:end] = False  # a token belongs to one segment: overlapping ones never count it twice
        out.unattributed_tokens += int(counted.sum())
    return out


@dataclass(slots=True)
class StepMismatch:
    """A step's tallies, added up over its micro-batches; :meth:`body` is ``POST /update_mismatch``'s."""

    tallies: Tallies = field(default_factory=Tallies)

    def add(self, tallies: Tallies) -> None:
        self.tallies.add(tallies)

    def __bool__(self) -> bool:
        return bool(self.tallies.boxes)

    def body(self, step: int) -> dict[str, Any]:
        boxes = [{"instance": k.instance, "endpoint": k.endpoint, "tokens": t.tokens,
                  "mean_abs_diff": _finite(t.mean_abs_diff), "k3_kl": _finite(t.k3_kl)}
                 for k, t in sorted(self.tallies.boxes.items(), key=lambda kv: kv[0].instance)]
        return {"step": int(step), "boxes": boxes, "unattributed_tokens": self.tallies.unattributed_tokens}


def _finite(value: float) -> float:
    """A non-finite log-prob (a -inf from either side) is as far off as the clamp allows, not a NaN in JSON."""
    return value if math.isfinite(value) else LOG_RATIO_BOUND


FIELDS = ("old_log_probs", "rollout_log_probs", "response_mask", "extra_fields")


def tally_batch(data: Any) -> Tallies:
    """:func:`tally_boxes` over verl's batch as its V1 trainer reads it back from TransferQueue (a
    TensorDict: jagged nested or padded tensors, ``extra_fields`` a stack of per-sample dicts)."""
    extras = per_sample(data["extra_fields"])
    segments = [e.get("segments") if isinstance(e, Mapping) else None for e in extras]
    return tally_boxes(segments, per_sample(data["old_log_probs"]), per_sample(data["rollout_log_probs"]),
                       per_sample(data["response_mask"]))


def per_sample(values: Any) -> list[Any]:
    """One entry per sample, from a nested (jagged) tensor, a padded one, a non-tensor stack or a list."""
    if getattr(values, "is_nested", False):
        return list(values.unbind())
    if hasattr(values, "tolist") and not hasattr(values, "detach"):
        return list(values.tolist())
    return list(values)
