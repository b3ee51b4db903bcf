"""Output lengths known early: a censored lognormal estimate per GRPO group, sharpened as siblings finish.

A step ends with its longest sequence, so the scheduler wants each sequence's final length before it is
made. Lengths are roughly lognormal, the samples of one prompt have similar lengths, and the same prompt
comes back every epoch with similar ones. :class:`LengthModel` keeps, per group (the caller's
``group_key``, else the samples of one prompt), a normal fit of the log lengths:

- a finished sibling is an exact observation;
- a running one is censored: it is at least as long as what it has made so far (``made``), which a fit
  on the finished ones alone would ignore, predicting short exactly where the long samples still run.
  The fit is a censored-normal EM (Tobit): each censored value is replaced by its conditional moments
  given ``X > log made``; a few iterations over the group, O(group size) each;
- the prior is the lengths the same prompt had before (a bounded LRU of prompt hash -> its last
  lengths), else the fleet's running figure over every finished sequence.

:meth:`LengthModel.predict` gives the conditional median (the scored prediction), mean and a quantile of
a running sequence's final length given what it has made. Nothing here is per token, and little is per
sequence: the manager calls :meth:`~LengthModel.start` and :meth:`~LengthModel.finish` once per sequence;
a group is fitted again only when one of its samples finishes (its running siblings' lengths are read then,
and when the status is asked for), from running sums of its finished lengths, so a start costs a hash of
the prompt and one ``exp`` and :meth:`~LengthModel.predict` (a piece boundary) reads the group's last fit.
Every prediction is remembered per "how much of the group had finished" bucket and scored when its
sequence ends (:class:`ErrorStats`). What outlives the daemon (the prompts' lengths and the fleet's figure)
goes out and comes back as a :class:`LengthHistory` (:meth:`~LengthModel.export`,
:meth:`~LengthModel.restore`); ``scheduler_state`` keeps it in a file. Pure: no I/O, no clock, no asyncio.
"""

from __future__ import annotations

import math
import sys
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from heapq import nlargest
from itertools import islice
from statistics import NormalDist

import msgspec
from cachetools import LRUCache

_STD = NormalDist()
_SQRT2 = math.sqrt(2.0)
MIN_SIGMA = 0.05  # log space: lengths of one group are never known better than ~5%
EM_ITERATIONS = 8
EM_TOLERANCE = 1e-3
MAX_FINISHED = 64  # finished log lengths kept per group (a GRPO group is n samples; the bound is for misuse)
# Running siblings a finish reads and predicts again, and a fit takes as censored: a group's work per event
# is bounded by this, not by how many callers sent one prompt at once (the fallback group of a hot prompt).
MAX_SIBLINGS = 16
# How prompt keys are made: Python's hash of the token tuple. Integers are never salted, so the key of a prompt
# is the same in every process of one Python version and word size, which is what a saved history needs.
KEY_SCHEME = f"tuple-hash/py{sys.version_info[0]}.{sys.version_info[1]}/{sys.hash_info.width}"
# Buckets of "the fraction of the group that had finished when the prediction was made".
BUCKETS = ("0", "0-25", "25-50", "50-75", "75-100")


def bucket(fraction: float) -> str:
    """The :data:`BUCKETS` label of a finished fraction in [0, 1]."""
    if fraction <= 0.0:
        return BUCKETS[0]
    return BUCKETS[min(4, math.ceil(fraction * 4.0))]


_Z: dict[float, float] = {}


def _z(q: float) -> float:
    """The standard normal's ``q``-quantile, computed once per ``q``."""
    z = _Z.get(q)
    if z is None:
        z = _Z[q] = _STD.inv_cdf(q)
    return z


def _log(length: int) -> float:
    return math.log(max(length, 1))


def _tail(a: float) -> float:
    """P(Z > a) for a standard normal Z."""
    return 0.5 * math.erfc(a / _SQRT2)


def _hazard(a: float) -> float:
    """phi(a) / P(Z > a): the mean of a standard normal above ``a`` (the inverse Mills ratio)."""
    q = _tail(a)
    if q < 1e-300:  # far tail: its asymptote
        return a + 1.0 / a
    return math.exp(-0.5 * a * a) / math.sqrt(2.0 * math.pi) / q


@dataclass(frozen=True, slots=True)
class Prior:
    """What is believed of a group before its own samples say anything: a normal on log length, worth
    ``weight`` observations."""

    mu: float
    var: float
    weight: float


def censored_fit(exact: Sequence[float], censored: Sequence[float], prior: Prior,
                 start: tuple[float, float] | None = None,
                 sums: tuple[int, float, float] | None = None) -> tuple[float, float]:
    """(mu, sigma) of a normal fitted to ``exact`` values and to values known only to exceed each of
    ``censored``, with ``prior`` as pseudo-observations (EM on the right-censored normal; ``start``: the
    last fit, from which a few iterations suffice). ``sums``: (count, sum, sum of squares) of ``exact``,
    kept by the caller, so the exact values are not summed again."""
    n, e1, e2 = sums if sums is not None else (len(exact), sum(exact), sum(x * x for x in exact))
    w = prior.weight + n + len(censored)
    s1 = prior.weight * prior.mu + e1
    s2 = prior.weight * (prior.var + prior.mu * prior.mu) + e2
    # a start that treats the censored values as exact (they are lower bounds, so it is low)
    mu = (s1 + sum(censored)) / w
    sigma = math.sqrt(max((s2 + sum(c * c for c in censored)) / w - mu * mu, MIN_SIGMA ** 2))
    if not censored:
        return mu, sigma
    if start is not None:
        mu, sigma = start
    for _ in range(EM_ITERATIONS):
        e1, e2 = s1, s2
        for c in censored:
            a = (c - mu) / sigma
            lam = _hazard(a)
            e1 += mu + sigma * lam
            e2 += mu * mu + sigma * sigma * (1.0 + a * lam) + 2.0 * mu * sigma * lam
        new_mu = e1 / w
        sigma = math.sqrt(max(e2 / w - new_mu * new_mu, MIN_SIGMA ** 2))
        done = abs(new_mu - mu) < EM_TOLERANCE
        mu = new_mu
        if done:
            break
    return mu, sigma


FLEET_PRIOR = Prior(math.log(512.0), 1.0, 1.0)  # before anything finished: a median of 512 tokens, wide


class Prediction(msgspec.Struct, frozen=True, gc=False):
    """A running sequence's final length in tokens, given what it has made: the conditional ``median``
    (what is scored), ``mean`` and the ``q``-``quantile``; ``finished_fraction`` of its group had
    finished."""

    median: float
    mean: float
    quantile: float
    q: float
    finished_fraction: float


def conditional(mu: float, sigma: float, made: int, q: float, budget: int | None) -> tuple[float, float, float]:
    """(median, mean, q-quantile) of a lognormal(mu, sigma) length known to be at least ``made``, capped at
    ``budget`` tokens (``max_new_tokens``; None: no cap)."""
    if made <= 1:  # nothing known beyond the fit (a length is at least 1): the lognormal's own figures
        cap = math.inf if budget is None else float(budget)
        return (min(math.exp(mu), cap), min(math.exp(mu + 0.5 * sigma * sigma), cap),
                min(math.exp(mu + sigma * _z(q)), cap))
    if made > 0:
        a = (_log(made) - mu) / sigma
        below, above = 1.0 - _tail(a), _tail(a)
    else:
        a, below, above = -math.inf, 0.0, 1.0
    if above < 1e-12:  # far beyond the fit: it is as long as it is, for all the fit can say
        median = mean = quant = float(made)
    else:
        def at(p: float) -> float:
            return math.exp(mu + sigma * _STD.inv_cdf(min(max(below + p * above, 1e-12), 1.0 - 1e-12)))

        median, quant = at(0.5), at(q)
        mean = math.exp(mu + 0.5 * sigma * sigma) * _tail(a - sigma) / above
    cap = math.inf if budget is None else float(budget)
    return (min(max(median, made), cap), min(max(mean, made), cap), min(max(quant, made), cap))


@dataclass(eq=False, slots=True)
class Track:
    """One running sequence: its group, prompt, budget, and how to read its running length."""

    group: LengthGroup
    prompt: int
    name: str
    progress: Callable[[], int] | None
    budget: int | None
    made: int = 0
    open: bool = True
    predicted: dict[str, float] = field(default_factory=dict)  # bucket -> first median predicted there

    def refresh(self) -> bool:
        """Read the running length; True if it moved (the group's fit is then out of date: the caller
        refits once, whatever the number of siblings read)."""
        if self.progress is not None:
            made = self.progress()
            if made != self.made:
                self.made = made
                return True
        return False


@dataclass(eq=False, slots=True)
class LengthGroup:
    """The samples of one group: finished log lengths, running tracks, the prior, and the cached fit."""

    prior: Prior
    from_history: bool = False  # the prior is the prompt's earlier lengths, not the fleet's figure
    finished: deque[float] = field(default_factory=lambda: deque(maxlen=MAX_FINISHED))
    running: set[Track] = field(default_factory=set)
    started: int = 0
    fit: tuple[float, float] | None = None
    last: tuple[float, float] | None = None  # the fit before the last change: where the next EM starts
    s1: float = 0.0  # sum of ``finished``
    s2: float = 0.0  # sum of its squares

    def add_finished(self, x: float) -> None:
        finished = self.finished
        if len(finished) == finished.maxlen:
            old = finished[0]
            self.s1 -= old
            self.s2 -= old * old
        finished.append(x)
        self.s1 += x
        self.s2 += x * x
        self.fit = None

    def fitted(self) -> tuple[float, float]:
        """The last fit; fitted again only after a sibling finished (or the status read the running)."""
        if self.fit is None:
            censored = [_log(t.made) for t in islice(self.running, MAX_SIBLINGS) if t.made > 0]
            self.fit = self.last = censored_fit(self.finished, censored, self.prior, self.last,
                                                (len(self.finished), self.s1, self.s2))
        return self.fit

    @property
    def finished_fraction(self) -> float:
        return len(self.finished) / self.started if self.started else 0.0


class ErrorSummary(msgspec.Struct, frozen=True):
    """Predictions scored at their sequence's end: how many, and the mean absolute error in tokens and in
    log space (|log predicted - log actual|: 0.1 is about 10% off)."""

    n: int
    mae_tokens: float
    mae_log: float


@dataclass(slots=True)
class ErrorStats:
    n: int = 0
    abs_tokens: float = 0.0
    abs_log: float = 0.0

    def add(self, predicted: float, actual: int) -> None:
        self.n += 1
        self.abs_tokens += abs(predicted - actual)
        self.abs_log += abs(math.log(max(predicted, 1.0)) - _log(actual))

    def summary(self) -> ErrorSummary:
        n = self.n or 1
        return ErrorSummary(self.n, round(self.abs_tokens / n, 3), round(self.abs_log / n, 5))


class RunningPrediction(msgspec.Struct, frozen=True):
    """A running sequence and what is predicted of it (the status' longest)."""

    rid: str
    made: int
    predicted: Prediction


class LengthsStatus(msgspec.Struct, frozen=True):
    """``/get_instances_status``'s ``lengths``: what the model holds, how good its predictions were (by
    the fraction of the group finished when they were made), and the running sequences predicted
    longest."""

    groups: int
    running: int
    finished: int
    history_prompts: int
    history_capacity: int
    fleet_median_tokens: float
    fleet_sigma_log: float
    errors: dict[str, ErrorSummary]
    longest: list[RunningPrediction]


class LengthHistory(msgspec.Struct, frozen=True):
    """What the model keeps across restarts: each prompt's last lengths (by prompt key, oldest first) and the
    fleet's figure (log-length mean and variance, and how many finished sequences it has seen). ``keys``
    names how the prompt keys were made (:data:`KEY_SCHEME`); a history made under other keys means nothing
    here and is refused."""

    keys: str
    fleet_mu: float
    fleet_var: float
    finished: int
    prompts: list[tuple[int, list[int]]]


class LengthModel:
    """Per-group online length estimates, the per-prompt history across epochs, and their scored error."""

    def __init__(self, history_capacity: int = 65536, group_capacity: int = 65536, history_depth: int = 16,
                 quantile: float = 0.9, history_weight: float = 0.5, fleet_weight: float = 1.0,
                 fleet_prior: Prior = FLEET_PRIOR):
        """``history_capacity`` prompts keep their last ``history_depth`` lengths, each worth
        ``history_weight`` of an observation of the group (the policy moves between epochs);
        ``fleet_weight``: what the fleet's figure is worth for a prompt never seen."""
        if not 0.0 < quantile < 1.0:
            raise ValueError("quantile must be in (0, 1)")
        self.q = quantile
        self.history_weight = history_weight
        self.fleet_weight = fleet_weight
        # prompt hash -> its last ``history_depth`` lengths, oldest first (lists, not deques: ``export`` hands
        # them to the encoder as they are)
        self.history: LRUCache[int, list[int]] = LRUCache(maxsize=history_capacity)
        self.history_depth = history_depth
        self.groups: LRUCache[str | int, LengthGroup] = LRUCache(maxsize=group_capacity)
        self.running: set[Track] = set()
        # the fleet's figure: an exponentially weighted mean and variance of every finished log length
        self.fleet = fleet_prior
        self.finished = 0
        self.errors = {b: ErrorStats() for b in BUCKETS}
        # With relays (docs/relays.md): the (prompt key, length) of each sequence finished here since the relay last
        # reported them, for the other relays' histories (None: not shared).
        self.shared: list[tuple[int, int]] | None = None

    # ------------------------------------------------------------ events
    def start(self, group_key: str | None, prompt: Sequence[int], name: str = "",
              progress: Callable[[], int] | None = None, budget: int | None = None) -> Track:
        """A sequence started: its group is ``group_key``, else its prompt's samples. Predicted once now."""
        pkey = hash(tuple(prompt))
        key: str | int = pkey if group_key is None else group_key
        group = self.groups.get(key)
        if group is None or (group_key is None and not group.running and group.finished):
            # a prompt's samples that all ended are last epoch's: its next samples are a new group
            group = self.groups[key] = LengthGroup(self._prior(pkey), pkey in self.history)
        group.started += 1
        track = Track(group, pkey, name, progress, budget)
        group.running.add(track)
        self.running.add(track)
        # Its first prediction (scored at its end): nothing made yet, so the fit's median, one exp.
        median = math.exp(group.fitted()[0])
        track.predicted[bucket(group.finished_fraction)] = median if budget is None else min(median, budget)
        return track

    def finish(self, track: Track, length: int) -> None:
        """A sequence ended with ``length`` tokens: score its predictions, sharpen its group, predict its
        running siblings again (each reads its running length once)."""
        if not track.open:
            return
        self._close(track)
        for where, predicted in track.predicted.items():
            self.errors[where].add(predicted, length)
        group = track.group
        group.add_finished(_log(length))
        self._add_history(track.prompt, length)
        if self.shared is not None:
            self.shared.append((track.prompt, length))
        self._learn(_log(length))
        where = bucket(group.finished_fraction)  # each sibling is predicted once per bucket (what is scored)
        due = [t for t in islice(group.running, MAX_SIBLINGS) if where not in t.predicted]
        if due:  # what the running have made, read once per bucket: the next fit censors at it
            for sibling in islice(group.running, MAX_SIBLINGS):
                sibling.refresh()
            for sibling in due:
                self._remember(sibling)

    def finished_elsewhere(self, ended: Sequence[tuple[int, int]]) -> None:
        """Sequences (prompt key, length) ended in other relays: the prompts' histories and the fleet's figure
        learn them (their groups are those relays')."""
        for prompt, length in ended:
            if length >= 1:
                self._add_history(prompt, length)
                self._learn(_log(length))

    def take_shared(self) -> list[tuple[int, int]]:
        """The (prompt key, length) of the sequences finished here since the last call (``shared``)."""
        taken, self.shared = self.shared or [], []
        return taken

    def _add_history(self, prompt: int, length: int) -> None:
        hist = self.history.get(prompt)
        if hist is None:
            hist = self.history[prompt] = []
        hist.append(length)
        if len(hist) > self.history_depth:
            del hist[0]

    def drop(self, track: Track) -> None:
        """A sequence failed or was cancelled: it leaves its group without an observation."""
        if track.open:
            self._close(track)
            track.group.started -= 1

    # ------------------------------------------------------------ predictions
    def predict(self, track: Track, made: int | None = None) -> Prediction:
        """``track``'s final length given ``made`` tokens so far (default: what it last reported)."""
        group = track.group
        mu, sigma = group.fitted()
        median, mean, quant = conditional(mu, sigma, track.made if made is None else made, self.q, track.budget)
        return Prediction(round(median, 1), round(mean, 1), round(quant, 1), self.q,
                          round(group.finished_fraction, 4))

    def left(self, track: Track, made: int) -> float:
        """Tokens ``track`` is expected to make still, given ``made``: the conditional median's rest, at least
        one, within its budget. Reads the group's last fit."""
        return self._rest(track, made, 0)

    def _rest(self, track: Track, made: int, which: int) -> float:
        """What is left of ``conditional``'s figure ``which`` (0: median, 2: quantile) given ``made``: at least
        one token, within the budget. Reads the group's last fit."""
        mu, sigma = track.group.fitted()
        left = max(conditional(mu, sigma, made, self.q, track.budget)[which] - made, 1.0)
        return left if track.budget is None else min(left, float(max(track.budget - made, 1)))

    @staticmethod
    def informed(track: Track) -> bool:
        """Whether ``track``'s group's fit rests on evidence (the prompt's earlier lengths, or a sibling that
        finished), not on the fleet's figure alone, which says every sequence alike."""
        group = track.group
        return group.from_history or bool(group.finished)

    def high(self, track: Track, made: int) -> float | None:
        """Tokens ``track`` still makes at the model's upper ``quantile``, given ``made``, where its group's fit
        is :meth:`informed`; None where it rests on the fleet's figure alone, which only says how wide
        lengths spread."""
        return self._rest(track, made, 2) if self.informed(track) else None

    def status(self, top: int = 10) -> LengthsStatus:
        """The model's state; every running sequence reads its running length (and is predicted: the
        prediction is scored when it ends)."""
        for track in self.running:
            if track.refresh():
                track.group.fit = None
        predicted = [(self._remember(t), t) for t in self.running]
        ranked = nlargest(top, predicted, key=lambda pt: pt[0].median)
        longest = [RunningPrediction(t.name, t.made, p) for p, t in ranked]
        return LengthsStatus(
            groups=len(self.groups), running=len(self.running), finished=self.finished,
            history_prompts=len(self.history), history_capacity=int(self.history.maxsize),
            fleet_median_tokens=round(math.exp(self.fleet.mu), 1), fleet_sigma_log=round(math.sqrt(self.fleet.var), 4),
            errors={b: e.summary() for b, e in self.errors.items() if e.n},
            longest=longest)

    # ------------------------------------------------------------ across restarts
    def export(self) -> LengthHistory:
        """The prompts' lengths and the fleet's figure, to be restored by a later daemon (O(prompts kept)). The
        lengths are the model's own lists, not copies (at 65,536 prompts of 16 lengths, export and encode take
        92 ms of the event loop this way, 167 ms with copies): encode it before the model changes."""
        return LengthHistory(KEY_SCHEME, self.fleet.mu, self.fleet.var, self.finished, list(self.history.items()))

    def restore(self, saved: LengthHistory) -> int:
        """Take ``saved``'s prompts and fleet figure (the prompts this model already knows keep theirs); the
        number of prompts taken. Raises ValueError, changing nothing, for a history made under other keys or
        with values no model makes."""
        if saved.keys != KEY_SCHEME:
            raise ValueError(f"prompt keys {saved.keys!r} are not this process's {KEY_SCHEME!r} "
                             "(another Python version or word size)")
        if not (math.isfinite(saved.fleet_mu) and math.isfinite(saved.fleet_var) and saved.fleet_var >= 0
                and saved.finished >= 0):
            raise ValueError("the fleet's figure is not a finite mean and variance")
        if any(not lengths or min(lengths) < 1 for _, lengths in saved.prompts):
            raise ValueError("a prompt's lengths are empty or below one token")
        taken = 0
        for key, lengths in saved.prompts[-int(self.history.maxsize):]:
            if key not in self.history:
                self.history[key] = lengths[-self.history_depth:]
                taken += 1
        self.fleet = Prior(saved.fleet_mu, max(saved.fleet_var, MIN_SIGMA ** 2), self.fleet.weight)
        self.finished = max(self.finished, saved.finished)
        return taken

    # ------------------------------------------------------------ inside
    def _close(self, track: Track) -> None:
        track.open = False
        track.group.running.discard(track)
        self.running.discard(track)
        track.progress = None  # let go of the sequence

    def _remember(self, track: Track) -> Prediction:
        prediction = self.predict(track)
        track.predicted.setdefault(bucket(prediction.finished_fraction), prediction.median)
        return prediction

    def _prior(self, prompt: int) -> Prior:
        """The prompt's earlier lengths (the fleet's spread when there are few), else the fleet's figure."""
        hist = self.history.get(prompt)
        fleet = Prior(self.fleet.mu, self.fleet.var, self.fleet_weight)
        if not hist:
            return fleet
        logs = [_log(n) for n in hist]
        k = len(logs)
        mu = sum(logs) / k
        own = sum((x - mu) ** 2 for x in logs) / k
        var = (own * k + self.fleet.var) / (k + 1)  # shrunk towards the fleet's spread
        return Prior(mu, max(var, MIN_SIGMA ** 2), self.history_weight * k)

    def _learn(self, x: float) -> None:
        """The fleet's figure moves towards a finished log length (weight 1/(n+1): the starting figure
        counts as one, then no less than 1/1000)."""
        self.finished += 1
        rate = max(1.0 / (self.finished + 1), 1e-3)
        f = self.fleet
        delta = x - f.mu
        mu = f.mu + rate * delta
        var = (1.0 - rate) * (f.var + rate * delta * delta)
        self.fleet = Prior(mu, max(var, MIN_SIGMA ** 2), f.weight)
