"""One sequence's state across the instances it runs on: tokens, segments, moves, versions.

Shared by generation (which runs sequences) and tail migration (which moves them).
"""

from __future__ import annotations

import secrets
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rollout_manager.instances.registry import Instance, Kind, State
from rollout_manager.placement.lengths import Track
from rollout_manager.rollout.pieces import Pieces
from rollout_manager.rollout.progress import token_array
from rollout_manager.sglang.errors import EngineError
from rollout_manager.sglang.finish import NO_META, FinalMeta, FinishReason
from rollout_manager.sglang.generate_request import SequenceBody
from rollout_manager.sglang.routed_experts import RoutedExperts
from rollout_manager.sglang.wire import DEFAULT_MAX_NEW_TOKENS

# The outcome of a segment whose attempt ended at a piece boundary of a divided rollout (rollout.pieces): the
# next piece extends it when it runs on the same instance, and says where it went otherwise.
PIECE_END = "piece ended"


@dataclass(slots=True)
class Segment:
    instance: str
    endpoint: str
    weight_version: str | None
    start: int
    end: int
    outcome: str = "running"
    # Its tokens before this index passed a trust probe of its instance (None: none did); those after it are
    # cut back if the instance is quarantined (``cut_point``).
    trusted: int | None = None
    # How many times its instance had been quarantined when the segment began (``Provisional.era``): a segment
    # of an earlier era was made before a quarantine, and no later probe of that instance vouches for it.
    era: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"instance": self.instance, "endpoint": self.endpoint, "weight_version": self.weight_version,
                "start": self.start, "end": self.end, "outcome": self.outcome}


@dataclass(slots=True)
class Migration:
    """Tail migration's part of a sequence: written by ``migration.py`` alone (``Migrator``), read by the
    attempt that runs the sequence."""

    moves: int = 0  # moves so far
    moved_at: float | None = None  # when the last one was decided
    target: Instance | None = None  # where it was decided to go (that instance is already reserved for it)
    reserved: int = 0  # tokens reserved on target
    leaving: bool = False  # the running segment is being taken off its instance
    reason: str = ""  # why it is being taken off ("": tail migration; else an eviction's reason)
    # A quarantined instance it has tokens of: cut back to before the first it made unvouched before it goes on.
    cut: str | None = None


@dataclass(frozen=True, slots=True)
class Refusal:
    """A refusal (HTTP 400 or an error frame) waiting for one other instance's verdict: which instance
    refused, and SGLang's error. Another instance's tokens overrule it; a second refusal confirms it."""

    instance: Instance
    error: EngineError


@dataclass(slots=True)  # one per sequence, read and written all along its run
class SequenceState:
    """Everything known about one sequence across the instances it has been on, in parts by who writes them:

    - identity (``body``, ``rid``, ``engine_rid``, ``min_version``, ``budget``, ``seed``): set when the sequence
      is made.
    - what it made and where (the token lists, ``texts``, ``live_text``, ``segments``, ``versions``): the
      attempt's (``attempt.py``, folding chunks through ``progress.py`` and ``attempt_segments.py``); a
      staleness restart throws them away through :meth:`restart`.
    - how it ends (``finish``, ``meta``, ``failures``, ``refused``, ``second_opinion``): the attempt's, and
      generation's for a sequence that needs no instance.

    And parts, each an object whose fields one module writes (tests/test_sequence_parts.py checks it):

    - ``migration`` (:class:`Migration`): tail migration's (``migration.py``).
    - ``pieces`` (:class:`~rollout_manager.rollout.pieces.Pieces`, a divided rollout's; None for the others):
      written by its own methods (``pieces.py``), which generation and the attempt call.
    - ``experts`` (:class:`~rollout_manager.sglang.routed_experts.RoutedExperts`, when the caller asked for
      them): written by its own methods, which the attempt's chunks and this class's cuts call.
    - ``track`` (:class:`~rollout_manager.placement.lengths.Track`, its place in the length model): the length
      model's; generation sets it once, when the sequence is made.
    """

    body: SequenceBody  # the caller's, as decoded (shared with the request: never copied per sequence)
    rid: str  # the caller's id for it (its answer's meta_info.id), else the manager's
    # The manager's own id, unique whatever the caller sent (callers may reuse ids, e.g. verl's det-{n}): what
    # the engines are sent, suffixed per attempt, so an abort by id reaches this sequence and no other.
    engine_rid: str = ""
    output_ids: array[int] = field(default_factory=token_array)  # 4 bytes a token, for as long as it runs
    logprobs: list[list[Any]] = field(default_factory=list)
    # The engine's other per-token lists (top log-probs, ...: wire.PER_TOKEN_META_KEYS), gathered over chunks.
    per_token: dict[str, list[Any]] = field(default_factory=dict)
    texts: list[str | None] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    # Tuples and a shared empty dict until something is recorded: most sequences never fail, and every
    # field made empty per sequence costs its bytes for as long as the sequence runs.
    failures: tuple[str, ...] = ()
    meta: FinalMeta = NO_META  # what the answer keeps of the finishing engine's own fields
    finish: FinishReason | None = None  # how it ended, as seen from the sequence's first token
    live_text: str | None = None  # the running segment's text so far (None: not known)
    migration: Migration = field(default_factory=Migration)
    versions: list[int] = field(default_factory=list)  # the registry's weight version of each segment
    discarded: tuple[Segment, ...] = ()  # segments a staleness restart threw away
    refused: Refusal | None = None
    second_opinion: bool = False  # the one extra try a refusal may have was used
    # The caller's min_weight_version (0: none): the sequence runs only on instances at that version or newer.
    min_version: int = 0
    pieces: Pieces | None = None  # a divided rollout's part (:meth:`divided`)
    track: Track | None = None  # its place in the length model (None: prediction is off)

    # ``max_new_tokens``; None when the caller set no limit (the engine stops at its context). Read from
    # the body once: it never changes, and what is left is asked several times per attempt.
    budget: int | None = field(init=False)
    # The sampling seed every engine request of the sequence carries (see sampling_seed).
    seed: Any = field(init=False)
    # Its routed experts so far when the caller asked for them (R3; None: not asked).
    experts: RoutedExperts | None = field(init=False)

    def __post_init__(self) -> None:
        self.budget = self.body.sampling.max_new_tokens
        self.seed = sampling_seed(self.body)
        self.experts = RoutedExperts(self.body.experts_from) if self.body.routed_experts else None
        if not self.engine_rid:
            self.engine_rid = self.rid

    def divided(self) -> Pieces:
        """The sequence's :class:`Pieces`, made the first time it is divided."""
        pieces = self.pieces
        if pieces is None:
            pieces = self.pieces = Pieces()
        return pieces

    @property
    def at_boundary(self) -> bool:
        """Whether the last attempt ended at a piece boundary (the next one is the next piece)."""
        pieces = self.pieces
        return pieces is not None and pieces.at_boundary

    def restart(self) -> None:
        """Throw away what the sequence made (a staleness restart): it starts again from its prompt; what
        was thrown away stays visible as ``discarded``."""
        self.discarded += tuple(self.segments)
        self.segments.clear()
        self.versions.clear()
        del self.output_ids[:]
        self.logprobs.clear()
        self.per_token.clear()
        self.texts.clear()
        self.live_text = None
        if self.pieces is not None:
            self.pieces.restart()
        if self.experts is not None:
            self.experts.reset()

    def resume_segments(self, spans: list[tuple[str, str, str | None, int, int]], versions: list[int]) -> None:
        """The segments of tokens another relay made and saved (``rollout.checkpoints``): where and at which
        version each part was made; the text of a saved part is not known."""
        self.segments[:] = [Segment(instance, endpoint, version, start, end, "saved by its relay, continued here")
                            for instance, endpoint, version, start, end in spans]
        self.versions[:] = versions
        self.texts[:] = [None] if spans else []

    def cut_point(self, instance: str) -> int:
        """Where a quarantine of ``instance`` cuts this sequence back to: the first token ``instance`` made that
        no passing probe vouched for (``Segment.trusted``); the sequence's length when there is none."""
        return self.first_unvouched(lambda seg: seg.instance == instance)

    def first_unvouched(self, which: Callable[[Segment], bool]) -> int:
        """The first token no passing probe vouched for in the segments ``which`` picks; the sequence's length
        when there is none."""
        for seg in self.segments:
            if not which(seg):
                continue
            trusted = seg.start if seg.trusted is None else min(max(seg.trusted, seg.start), seg.end)
            if trusted < seg.end:
                return trusted
        return len(self.output_ids)

    def cut_back(self, at: int, why: str) -> None:
        """Throw away the tokens from ``at`` on (made by a quarantined instance since it was last vouched for):
        the sequence continues from there, as after a failure; the cut part stays visible in ``discarded`` with
        ``why``. Routed experts asked for keep their rows of the positions before the cut (the rows of the
        forwards that made the kept tokens) and the next engine is asked for the rest."""
        if at >= len(self.output_ids):
            return
        kept: list[Segment] = []
        cut: list[Segment] = []
        for seg in self.segments:
            if seg.end <= at:
                kept.append(seg)
                continue
            if seg.start < at:
                kept.append(Segment(seg.instance, seg.endpoint, seg.weight_version, seg.start, at,
                                    f"cut back at token {at}: {why}", seg.trusted, seg.era))
            cut.append(Segment(seg.instance, seg.endpoint, seg.weight_version, max(seg.start, at), seg.end,
                               f"distrusted: {why}", None, seg.era))
        self.discarded += tuple(cut)
        self.segments[:] = kept
        self.versions[:] = [v for v in self.versions if any(s.weight_version == str(v) for s in kept)]
        del self.output_ids[at:]
        del self.logprobs[at:]
        for values in self.per_token.values():
            del values[at:]
        self.texts[:] = [None] if kept else []  # the text up to a cut inside a chunk is not known
        self.live_text = None
        if self.pieces is not None:
            self.pieces.left_boundary()  # the next attempt continues after a cut, not after a piece
        if self.experts is not None:
            # Position p's row is the routing of the forward that fed token p: the kept tokens' forwards end
            # at position prompt + at - 1, whose forward made token ``at`` (cut).
            self.experts.cut(len(self.body.input_ids) + at - 1)

    @property
    def remaining(self) -> int | None:
        budget = self.budget
        return None if budget is None else max(budget - len(self.output_ids), 0)

    @property
    def limit(self) -> int | None:
        """The most tokens the running attempt may make: what is left, or less for one piece (None: no limit)."""
        remaining, pieces = self.remaining, self.pieces
        piece = None if pieces is None else pieces.size
        return remaining if piece is None or (remaining is not None and remaining < piece) else piece

    @property
    def reserve(self) -> int:
        """The tokens to reserve on an instance: what the attempt may make, or an estimate when there is no
        limit."""
        limit = self.limit
        return DEFAULT_MAX_NEW_TOKENS if limit is None else limit

    def known_text(self, current: str | None = "") -> str | None:
        """The finished segments' text plus ``current``; None when any part of it is unknown."""
        parts = [*self.texts, current]
        return None if any(t is None for t in parts) else "".join(t for t in parts if t is not None)


def version_floor(seq: SequenceState) -> int:
    """The oldest weight version ``seq`` may run on next (0: any): for a caller that asked for a
    ``min_weight_version``, that version, and never one older than a version the sequence already ran on
    (its tokens would go back in time). Without one, versions are bounded by ``max_staleness`` only."""
    if seq.min_version <= 0:
        return 0
    return max(seq.min_version, max(seq.versions, default=0))


def within_version(lo: int, hi: int, version: int, bound: int) -> bool:
    """Whether segments on versions ``lo..hi`` plus one on ``version`` span at most ``bound`` versions."""
    return max(hi, version) - min(lo, version) <= bound


def version_check(inst: Instance, start: int) -> Callable[[Any], str | None] | None:
    """Why a weight version that a chunk from ``inst`` reports is wrong (None: it is right), for a segment
    that began at the registry's version ``start``; None when versions are not checked.

    The manager vouches for what it pushed: a remote instance reports the version it joined with until a
    push, then the pushed version. While a push is under way (``syncing``) a newer one may show up before
    the registry records it, and chunks read after the registry moved may still carry the older one;
    both are right. A local instance's weights are the trainer's to name, and an instance whose version
    before any push is unknown (its ``/model_info`` unreadable) is not checked until a push.
    """
    joined = inst.engine.joined_version
    if inst.kind == Kind.LOCAL or (start == 0 and joined is None):
        return None

    def why(version: Any) -> str | None:
        text = version if isinstance(version, str) else str(version)
        if start == 0 and text == joined:
            return None
        if text.isascii() and text.isdigit():
            n = int(text)
            if max(start, 1) <= n and (inst.state == State.SYNCING or n <= inst.weight_version):
                return None
        pushed = f"was pushed version {inst.weight_version}" if inst.weight_version else \
            f"reported {joined!r} when it joined, and no version was pushed to it since"
        return f"weight_version {version!r}, but the instance {pushed}"

    return why
# SGLang accepts any int64 seed; 31 bits stay exact in every JSON reader.
SEED_BITS = 31


def sampling_seed(body: SequenceBody) -> Any:
    """The ``sampling_seed`` a sequence is sent with: the caller's, or one of its own when it gave none.

    Under ``--enable-deterministic-inference`` SGLang samples a request without a seed with seed 42
    (``sampling_batch_info.py``): the samples of one prompt all come out the same, and a GRPO group's
    advantage is zero. Its seeded sampler keys each draw on (seed, position), so the same seed sent with
    a continuation draws what the uninterrupted request would have drawn. The caller's body is not
    copied to carry it: the seed goes into each engine body as it is built (``continuation(seed=...)``).
    """
    given = body.sampling.sampling_seed
    return secrets.randbits(SEED_BITS) if given is None else given


def with_failures(message: str, seq: SequenceState, shown: int = 3) -> str:
    """``message``, and what the sequence's attempts failed with (the last ``shown`` of them)."""
    if not seq.failures:
        return message
    last = "; ".join(seq.failures[-shown:])
    more = f" (the last {shown} shown)" if len(seq.failures) > shown else ""
    return f"{message}; sequence {seq.rid} failed on {len(seq.failures)} attempt(s){more}: {last}"


def with_floor(message: str, seq: SequenceState) -> str:
    """``message``, and the version the sequence needed when it needed one."""
    floor = version_floor(seq)
    if floor <= 0:
        return message
    why = f"min_weight_version={seq.min_version}" if floor == seq.min_version else "its tokens' version"
    return f"{message}; it may run only on weight version {floor} or newer ({why})"
