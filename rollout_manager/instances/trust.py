"""Whether a box serves the weights it is named at, judged from the trust probe's log-probs.

Boxes at one weight version hold the same weights, so they give the same log-probs for the same prompt, up
to their arithmetic's noise. The noise is the tolerance, on the mean absolute difference of the probe's
per-token log-probs (a mean, not a max: one near-tie token moves more than the rest without meaning much,
while a corrupted tensor moves every position):

The floors come from measurement (docs/reliability.md): on CPU the spread is exactly 0 (the CPU engine and real
SGLang, fp32 and bf16, whatever shares the probe's batch); on an H100 (benchmarks/measure_probe_spread_gpu.py:
8B dimensions, random weights, logits of standard deviation 3) the probe's mean moved by at most 5e-5 in fp32,
0.018 in fp16 and 0.12 in bf16 between batch compositions (the GEMMs' kernels are chosen by row count), about
as much at a simulated TP 2, and in proportion to the logits' scale (0.04 at deviation 1, 0.39 at 8):

- float32: 1e-3 (20 times the GPU spread);
- float16: 5e-2; bfloat16, and a dtype not known ("auto" serves the checkpoint's, which is bf16 for nearly
  every model served): 0.3 (2.5 times the GPU spread);
- quantized weights (fp8 and the like): 0.5, above bf16 (not measured);
- twice the above for TP > 1 (the all-reduce sums partial results in another order than one GPU does).

Since the spread grows with the model's logits, a floor alone cannot fit every model: where three or more boxes
probed a version, the tolerance is also at least :data:`SPREAD_FACTOR` times the fleet's own spread there (the
median over the boxes of each one's distance to its nearest peer: a wrong box is far from every peer, but it is
one of the boxes, so the median stays with the honest ones).

Two boxes of different settings are compared with the larger of their tolerances. ``trust_probe_tolerance``
replaces all of this with one number. A verdict (:func:`judge`):

- a box whose probe moved beyond the tolerance since it was checked at this version *changed*: it
  disagrees, whatever the others say (this also tells which of two boxes went wrong);
- else a box is checked when the boxes within the tolerance of it, itself included, are a strict majority
  of the unchanged boxes that probed this version; else it disagrees (of two boxes that differ, both);
- a box alone at its version, never checked there, stays provisional: nothing to compare it with;
- where the trainer posted the probe's reference log-probs for the version (its own model's forward), an
  unchanged box is judged by them instead of by its peers, with its own tolerance: within it, it is checked
  (a box alone at its version too); beyond it, it disagrees. Every box beyond it together is a fleet-wide
  disagreement (the trainer's and the fleet's arithmetic differ, or the trainer's weights are not the
  fleet's): the quarantine acts on none of them.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


class Trust(str, enum.Enum):
    PROVISIONAL = "provisional"  # no probe at the version it serves has passed yet: its tokens are unchecked
    CHECKED = "checked"  # its probe at the version it serves agrees with the other boxes at that version
    DISAGREES = "disagrees"  # its probe does not: it may serve other weights than it is named at


FP32_TOLERANCE = 1e-3
FP16_TOLERANCE = 5e-2
BF16_TOLERANCE = 0.3
QUANTIZED_TOLERANCE = 0.5
TP_FACTOR = 2.0
SPREAD_FACTOR = 4.0  # the tolerance is at least this many times the fleet's measured spread (see fleet_spread)
SPREAD_MIN_BOXES = 3  # fewer boxes give no spread to trust: one of two may be the wrong one


def tolerance(dtype: str | None, quantization: str | None, tp_size: int | None) -> float:
    """The largest mean absolute log-prob difference that is arithmetic noise, for a box served so."""
    name = (dtype or "").lower()
    if quantization:
        base = QUANTIZED_TOLERANCE
    elif name in ("float32", "fp32", "float"):
        base = FP32_TOLERANCE
    elif name in ("float16", "fp16", "half"):
        base = FP16_TOLERANCE
    else:  # bfloat16, "auto" (the checkpoint's: bf16 for nearly all), or not said
        base = BF16_TOLERANCE
    return base * (TP_FACTOR if tp_size is not None and tp_size > 1 else 1.0)


def mean_abs_diff(a: Sequence[float], b: Sequence[float]) -> float:
    """Mean absolute difference of two probes' log-probs (infinite when their lengths differ)."""
    if len(a) != len(b) or not a:
        return float("inf")
    return sum(abs(x - y) for x, y in zip(a, b)) / len(a)


@dataclass(frozen=True, slots=True)
class Probed:
    """One box's latest probe at a version, and its first passing one there (None: never checked there)."""

    values: tuple[float, ...]
    tolerance: float
    baseline: tuple[float, ...] | None = None


@dataclass(frozen=True, slots=True)
class Verdict:
    trust: Trust
    diff: float | None  # the mean absolute difference behind it: to its baseline, else to the nearest peer
    detail: str


def fleet_spread(boxes: Mapping[str, Probed]) -> float:
    """The honest spread among boxes at one version: the median of each box's distance to its nearest peer (0
    below :data:`SPREAD_MIN_BOXES` boxes)."""
    if len(boxes) < SPREAD_MIN_BOXES:
        return 0.0
    values = [p.values for p in boxes.values()]
    nearest = sorted(min(mean_abs_diff(a, b) for j, b in enumerate(values) if j != i) for i, a in enumerate(values))
    middle = nearest[len(nearest) // 2]
    return middle if math.isfinite(middle) else 0.0


def judge(boxes: Mapping[str, Probed], reference: Sequence[float] | None = None,
          calibrate: bool = True) -> dict[str, Verdict]:
    """The verdict on every box that probed one version, against each other and the trainer's ``reference``
    log-probs where given (see the module's docstring). ``calibrate``: widen the tolerances to the fleet's
    measured spread (off where the operator set one tolerance)."""
    floor = SPREAD_FACTOR * fleet_spread(boxes) if calibrate else 0.0
    boxes = {box: p if p.tolerance >= floor else dataclasses.replace(p, tolerance=floor) for box, p in boxes.items()}
    verdicts: dict[str, Verdict] = {}
    steady: dict[str, Probed] = {}
    for box, p in boxes.items():
        moved = mean_abs_diff(p.values, p.baseline) if p.baseline is not None else 0.0
        if moved > p.tolerance:
            verdicts[box] = Verdict(Trust.DISAGREES, moved, f"its probe moved by {moved:.3g} (tolerance "
                                                            f"{p.tolerance:g}) since it was checked at this version")
        else:
            steady[box] = p
    for box, p in steady.items():
        if reference is not None:
            off = mean_abs_diff(p.values, reference)
            if off > p.tolerance:
                verdicts[box] = Verdict(Trust.DISAGREES, off, f"its probe is {off:.3g} from the trainer's reference "
                                                              f"log-probs (tolerance {p.tolerance:g})")
                continue
            verdicts[box] = Verdict(Trust.CHECKED, off, f"within {off:.3g} of the trainer's reference log-probs")
            continue
        diffs = {other: mean_abs_diff(p.values, q.values) for other, q in steady.items() if other != box}
        if not diffs:
            trust = Trust.CHECKED if p.baseline is not None else Trust.PROVISIONAL
            verdicts[box] = Verdict(trust, None, "no other box at this version to compare with")
            continue
        agree = [o for o, d in diffs.items() if d <= max(p.tolerance, steady[o].tolerance)]
        nearest = min(diffs.values())
        if 2 * (len(agree) + 1) > len(steady):
            verdicts[box] = Verdict(Trust.CHECKED, nearest, f"agrees with {len(agree)} of {len(diffs)} other box(es)")
        else:
            verdicts[box] = Verdict(Trust.DISAGREES, nearest,
                                    f"agrees with {len(agree)} of {len(diffs)} other box(es) at this version "
                                    f"(nearest mean |log-prob difference| {nearest:.3g}, tolerance {p.tolerance:g})")
    return verdicts


@dataclass(frozen=True, slots=True)
class TrustRecord:
    """What the trust probe found of one box (``Instance.trust``): the probe monitor's, replaced whole."""

    version: int | None = None  # the version its verdict is about (None: never probed)
    verdict: Trust = Trust.PROVISIONAL
    diff: float | None = None
    detail: str | None = None
    checked_at: float | None = None  # wall-clock time of the probe behind the verdict
    probes: int = 0  # probes answered, all versions
    disagreements: int = 0  # verdicts of 'disagrees' given, all versions
    last_probe_error: str | None = None  # the last probe that got no usable answer (None: the last one did)
    waiting: str | None = None  # why no probe can be sent to it now (None: nothing keeps it from one)

    def state(self, serving: int) -> Trust:
        """Its trust at the version it serves now: provisional until a probe there was judged."""
        return self.verdict if self.version == serving else Trust.PROVISIONAL

    def to_dict(self, serving: int) -> dict[str, Any]:
        return {"state": self.state(serving).value, "version": self.version, "diff": self.diff,
                "detail": self.detail, "checked_at": self.checked_at, "probes": self.probes,
                "disagreements": self.disagreements, "last_probe_error": self.last_probe_error,
                "waiting": self.waiting}
