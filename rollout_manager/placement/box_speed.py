"""Each box's decode speed as a function of how many sequences it runs, learned from its own streams.

Under continuous batching (SGLang) one decode step makes one token for every running sequence and costs
about ``a + b * n`` seconds for ``n`` running: a fixed part (the weights read once per step) and a part
per sequence (its KV cache). So a box's speed is not one number: a box that ran one sequence and one that
ran forty show very different token rates though they are the same box. Ranking boxes by a measured
aggregate rate therefore feeds on itself (a box given little looks slow and is given little); ranking by
the fitted ``step_s(n)`` at the count a placement would leave compares like with like.

The fit is online, from the chunks the manager relays anyway. The manager times each sequence's chunks:
``k`` tokens ``gap`` seconds after that sequence's previous chunk are ``k`` decode steps of ``gap / k``
seconds at the box's count in flight (:meth:`BoxSpeeds.observe_gap`), one observation ``(n, step_s)``
weighted by its duration and decayed with ``tau_s`` of the clock. Where only the box's chunks in all are
known (:meth:`BoxSpeeds.observe`, the simulator's exact counts): over a window of ``window_s`` the box made
``tokens`` tokens with on average ``n`` in flight, ``window * n / tokens`` seconds a step; that misreads
chunks that come in bursts (a step's sequences started together), so the manager does not use it.
A box seen at one count only fixes the level, not the slope: its slope comes from the
fleet's shape (boxes that were seen at several counts; before any, ``DEFAULT_BATCH_HALF``), scaled to its
level. A box never measured is the fleet's median box, never a slow one. Pure: time is an argument.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import median

import msgspec

__all__ = ["BoxCurve", "StepModel", "StepFit", "StepStatus", "BoxSpeeds", "DEFAULT_BATCH_HALF"]

# The shape before any box showed its slope: a sequence runs at half its lone speed beside this many
# others (the batch model scheduling.per_sequence_rate assumes: a GPU's memory-bound decode).
DEFAULT_BATCH_HALF = 64.0
_SHAPE_VAR = 4.0  # variance of the counts a box was seen at for its own slope to count half
_MIN_A = 1e-6


@dataclass(frozen=True, slots=True)
class StepModel:
    """Seconds per decode step of a box: ``a + b * n`` with ``n`` sequences running."""

    a: float
    b: float

    def step_s(self, n: float) -> float:
        return self.a + self.b * max(n, 1.0)

    def rate(self, n: float) -> float:
        """Tokens/s the box makes in all with ``n`` running."""
        return max(n, 1.0) / self.step_s(n)

    def drain_s(self, longest: float, tokens: float) -> float:
        """Seconds until a box running sequences with ``tokens`` left in all, the longest ``longest`` of
        them, is empty: ``longest`` steps, and each sequence is in ``its own`` of them (exact for this
        model while nothing joins)."""
        return self.a * longest + self.b * tokens


class BoxCurve(msgspec.Struct, frozen=True):
    """A box's learned step curve under its endpoint, kept across restarts of the daemon (its instance id is
    new after one; the box at that address is most likely the same machine)."""

    endpoint: str
    base_s: float
    per_sequence_s: float


class StepStatus(msgspec.Struct, frozen=True):
    """One box's learned speed curve as the status shows it: a decode step costs ``base_ms`` plus
    ``per_sequence_ms`` for each running sequence; ``measured`` False: the fleet's median box stands in."""

    base_ms: float
    per_sequence_ms: float
    measured: bool
    lone_tokens_per_s: float
    full_tokens_per_s: float  # in all, at ``full_running`` sequences (its running bound)
    full_running: int
    seen_s: float  # busy seconds it was observed for


class StepFit:
    """One box's observations ``(mean in flight, seconds per step)``, decayed, and the fit they give."""

    __slots__ = ("window_s", "tau_s", "w", "sx", "sy", "sxx", "sxy", "seen_s", "start", "tokens", "n_sum",
                 "chunks", "decayed_at")

    def __init__(self, window_s: float, tau_s: float) -> None:
        self.window_s, self.tau_s = window_s, tau_s
        self.w = self.sx = self.sy = self.sxx = self.sxy = 0.0
        self.seen_s = 0.0  # busy seconds folded in, undecayed: how much evidence there is
        self.start: float | None = None
        self.tokens = 0
        self.n_sum = 0
        self.chunks = 0
        self.decayed_at: float | None = None

    def restart(self) -> None:
        """The box went from idle to busy: the next chunk opens a window (what it carries is a prefill's
        wait, not decode steps)."""
        self.start = None
        self.tokens = self.n_sum = self.chunks = 0

    def observe(self, tokens: int, n: int, now: float) -> bool:
        """A chunk of ``tokens`` with ``n`` in flight at ``now``; True when it closed a window."""
        start = self.start
        if start is None:
            self.start = now
            return False
        self.tokens += tokens
        self.n_sum += n
        self.chunks += 1
        if now - start < self.window_s or self.tokens <= 0:
            return False
        self.add(self.n_sum / self.chunks, (now - start) * self.n_sum / self.chunks / self.tokens, now - start)
        self.start = now
        self.tokens = self.n_sum = self.chunks = 0
        return True

    def add_gap(self, x: float, y: float, dt: float, now: float) -> None:
        """One sequence's gap between two chunks: ``y`` seconds per step at ``x`` in flight over ``dt``
        seconds. Many sequences' gaps cover the same time, so the decay follows the clock, not ``dt``."""
        last = self.decayed_at
        self.decayed_at = now
        self._fold(x, y, dt, 1.0 if last is None or now <= last else math.exp(-(now - last) / self.tau_s))
        self.seen_s += dt / max(x, 1.0)  # busy seconds: the box's, not each of its sequences'

    def add(self, x: float, y: float, dt: float) -> None:
        """One observation: ``y`` seconds per step at ``x`` in flight, over ``dt`` seconds."""
        self._fold(x, y, dt, math.exp(-dt / self.tau_s))
        self.seen_s += dt

    def _fold(self, x: float, y: float, dt: float, keep: float) -> None:
        """The sums decayed by ``keep``, then one observation weighted by ``dt`` added."""
        self.w = self.w * keep + dt
        self.sx = self.sx * keep + dt * x
        self.sy = self.sy * keep + dt * y
        self.sxx = self.sxx * keep + dt * x * x
        self.sxy = self.sxy * keep + dt * x * y

    @property
    def spread(self) -> float:
        """Variance of the counts the box was seen at (0: one count only; its slope is unknown)."""
        if self.w <= 0:
            return 0.0
        mx = self.sx / self.w
        return max(self.sxx / self.w - mx * mx, 0.0)

    def fit(self, shape: StepModel) -> StepModel | None:
        """``a + b * n`` through the observations; the slope leans on ``shape`` (scaled to this box's
        level) as far as the box was seen at one count only."""
        if self.w <= 0:
            return None
        mx, my = self.sx / self.w, self.sy / self.w
        scale = my / shape.step_s(mx)
        b = shape.b * scale
        var = self.spread
        if var > 0:
            own = (self.sxy / self.w - mx * my) / var
            k = var / (var + _SHAPE_VAR)
            b = k * own + (1.0 - k) * b
        b = min(max(b, 0.0), my / max(mx, 1.0))  # never a negative cost, never a negative fixed part
        return StepModel(max(my - b * max(mx, 1.0), _MIN_A), b)


class BoxSpeeds:
    """Step models of every box, learned from their streams; the fleet's median box for one not measured.

    The dispatcher calls :meth:`busy` when a box goes from idle to busy, :meth:`observe` for every relayed
    chunk (a sum, and a fold once per ``window_s``) and :meth:`model` when placing.
    """

    def __init__(self, window_s: float = 0.5, tau_s: float = 60.0, min_seen_s: float = 1.0) -> None:
        if window_s <= 0 or tau_s <= 0 or min_seen_s < 0:
            raise ValueError("window_s and tau_s must be > 0, min_seen_s >= 0")
        self.window_s, self.tau_s, self.min_seen_s = window_s, tau_s, min_seen_s
        self.fits: dict[str, StepFit] = {}
        self._models: dict[str, StepModel] = {}  # boxes measured well enough to stand on their own
        self._fleet: StepModel | None = None
        self._shape = StepModel(1.0 - 1.0 / DEFAULT_BATCH_HALF, 1.0 / DEFAULT_BATCH_HALF)
        self._dirty: set[str] = set()  # boxes with new observations, refitted when next asked
        self._folds = 0  # folds since the fleet's figures were taken: they are taken again every box's worth

    def fit_of(self, iid: str) -> StepFit:
        fit = self.fits.get(iid)
        if fit is None:
            fit = self.fits[iid] = StepFit(self.window_s, self.tau_s)
        return fit

    def busy(self, iid: str) -> None:
        self.fit_of(iid).restart()

    def observe(self, iid: str, tokens: int, n: int, now: float) -> None:
        """A chunk of ``tokens`` from ``iid`` with ``n`` sequences in flight there."""
        fit = self.fits.get(iid) or self.fit_of(iid)
        if fit.observe(tokens, n, now) and fit.seen_s >= self.min_seen_s:
            self._dirty.add(iid)

    def observe_gap(self, iid: str, tokens: int, n: int, gap_s: float, now: float) -> None:
        """A chunk of ``tokens`` from one sequence on ``iid``, ``gap_s`` after that sequence's previous chunk,
        with ``n`` in flight: ``tokens`` decode steps in ``gap_s``. Exact whenever chunks come, unlike
        :meth:`observe`'s windows over the box's chunks in all: when a box's sequences start together their
        chunks come in bursts an interval apart, and a window that closes inside a burst counts a fraction
        of the tokens made in it (with chunks every 64 tokens, a full box's step looked ten times as long
        and the fitted curve all per-sequence cost)."""
        if tokens <= 0 or gap_s <= 0:
            return
        fit = self.fits.get(iid) or self.fit_of(iid)
        fit.add_gap(float(n), gap_s / tokens, gap_s, now)
        if fit.seen_s >= self.min_seen_s:
            self._dirty.add(iid)

    def add(self, iid: str, n: float, step_s: float, dt: float) -> None:
        """One observation straight in (tests, the simulator): ``step_s`` per step at ``n`` over ``dt``."""
        fit = self.fit_of(iid)
        fit.add(n, step_s, dt)
        if fit.seen_s >= self.min_seen_s:
            self._dirty.add(iid)

    def seed(self, iid: str, model: StepModel, weight_s: float = 1.0) -> None:
        """Start ``iid`` from ``model`` (a curve learned before a restart): two observations of ``weight_s``
        busy seconds each, alone and at a full batch, so it counts as measured at once and its own streams
        outweigh the seed within a second or two of decoding."""
        if not (model.a > 0 and model.b >= 0 and math.isfinite(model.a) and math.isfinite(model.b)):
            return
        for n in (1.0, DEFAULT_BATCH_HALF):
            self.add(iid, n, model.step_s(n), weight_s)

    def forget(self, iid: str) -> None:
        self.fits.pop(iid, None)
        self._dirty.discard(iid)
        if self._models.pop(iid, None) is not None:
            self._folds = len(self._models) + 1  # the fleet's figures are taken again

    def _refit(self) -> None:
        """Refit the boxes with new observations; every box's worth of folds, the fleet's shape and median
        box too (a thousand boxes folding twice a second must not mean a thousand fits per placement)."""
        fits, models, shape = self.fits, self._models, self._shape
        for iid in self._dirty:
            f = fits.get(iid)
            m = f.fit(shape) if f is not None else None
            if m is not None:
                models[iid] = m
        self._folds += len(self._dirty)
        self._dirty.clear()
        if self._fleet is not None and self._folds < len(models):
            return
        self._folds = 0
        own = [m for iid, m in models.items() if fits[iid].spread >= _SHAPE_VAR]
        if own:  # the fleet's own shape: slope per unit of fixed cost, from boxes that showed theirs
            shape = self._shape = StepModel(1.0, median(m.b / m.a for m in own))
            for iid in list(models):  # every box's slope leans on it: refit them (once per box's worth of folds)
                m = fits[iid].fit(shape)
                if m is not None:
                    models[iid] = m
        self._fleet = StepModel(median(m.a for m in models.values()), median(m.b for m in models.values())) \
            if models else None

    def models(self) -> tuple[dict[str, StepModel], StepModel | None]:
        """Every measured box's model and the fleet's median box, up to date: a placement reads a thousand
        boxes' from these two rather than calling :meth:`model` for each."""
        if self._dirty:
            self._refit()
        return self._models, self._fleet

    def model(self, iid: str) -> StepModel | None:
        """``iid``'s step model; the fleet's median box while it is not measured; None while none is."""
        if self._dirty:
            self._refit()
        return self._models.get(iid, self._fleet)

    def describe(self, iid: str, running_bound: int) -> StepStatus | None:
        """What the status shows of ``iid``'s speed curve (None while no box is measured): the model it is
        placed by, whether that is its own or the fleet's median box, and the tokens/s it gives alone and at
        ``running_bound`` sequences."""
        models, fleet = self.models()
        own = models.get(iid)
        m = own if own is not None else fleet
        if m is None:
            return None
        fit = self.fits.get(iid)
        return StepStatus(round(m.a * 1e3, 4), round(m.b * 1e3, 5), own is not None,
                          round(m.rate(1), 1), round(m.rate(running_bound), 1), running_bound,
                          round(fit.seen_s, 1) if fit is not None else 0.0)

    def measured(self, iid: str) -> bool:
        if self._dirty:
            self._refit()
        return iid in self._models
