"""The segments of one attempt on one instance: one per weight version the engine made tokens with.

An instance may change weights under a running sequence (a staged version activated with a short
pause): the sequence keeps every token, and a new segment starts at the token where the version
changed, on the same instance, so every segment has one version and the caller sees the boundary.
Two sources say where: the weight version each chunk reports (to the chunk: the new segment starts at
the first token of the first chunk reporting the new version), and SGLang's (0.5.23) exact spans on the
final chunk (:meth:`.finish.FinalMeta.spans`), which win when present, well formed and covering every token.
"""

from __future__ import annotations

from rollout_manager.instances.registry import Instance
from rollout_manager.rollout.sequence import PIECE_END, Segment, SequenceState
from rollout_manager.sglang.finish import VersionSpan


def _changed(version: str, at: int) -> str:
    return f"weight version {version} from token {at}"


class AttemptSegments:
    """This attempt's segments, the last one (``current``) running; ``start``: the token it began at.

    The next piece of a divided rollout on the instance the last one ran on extends that piece's segment
    (an undivided run would have one segment there); on another instance it starts a new one, and the last
    piece's says where the sequence went. ``era``: how many times ``inst`` was quarantined so far
    (``Provisional.era``), kept on every segment this attempt makes; a segment of an older era is never
    extended.
    """

    def __init__(self, seq: SequenceState, inst: Instance, era: int = 0) -> None:
        self.seq = seq
        self.start = len(seq.output_ids)
        last = seq.segments[-1] if seq.segments else None
        # What an extended segment held before this attempt: from where, at which version (none: not extended).
        self.base: tuple[int, str | None] | None = None
        if last is not None and last.outcome == PIECE_END:
            if last.instance == inst.id and last.end == self.start and last.era == era:
                last.outcome = "running"
                self.first = len(seq.segments) - 1
                self.current = last
                self.base = (last.start, last.weight_version)
                return
            last.outcome = f"{PIECE_END}; the next piece ran on {inst.endpoint}"
        self.first = len(seq.segments)  # where this attempt's segments begin in seq.segments
        self.current = Segment(inst.id, inst.endpoint, None, self.start, self.start, era=era)
        seq.segments.append(self.current)

    @property
    def made(self) -> int:
        """Tokens this attempt made."""
        return self.current.end - self.start

    def advance(self, version: str | None, new: int) -> None:
        """A chunk brought ``new`` tokens (now at the end of the sequence's ids), and the engine's latest
        reported ``version``."""
        seg = self.current
        end = len(self.seq.output_ids)
        if version == seg.weight_version:  # the usual chunk
            seg.end = end
            return
        if new and version is not None and seg.weight_version is not None and seg.end > seg.start:
            seg.outcome = _changed(version, seg.end)
            seg = self.current = Segment(seg.instance, seg.endpoint, version, seg.end, end, era=seg.era)
            self.seq.segments.append(seg)
            _note_version(self.seq, version)
        seg.end = end
        if version is not None:
            seg.weight_version = version

    def exact(self, spans: list[VersionSpan] | None) -> None:
        """Cut this attempt's segments where the engine's spans (over this request's tokens, SGLang >= 0.5.23)
        say; spans that do not cover exactly the tokens made are ignored (the per-chunk cuts stand)."""
        if not spans or spans[-1].end != self.made:
            return
        seg = self.current
        # A passing probe's vouching is a token index: it holds for whichever segments the exact cuts make.
        vouched = max((s.trusted for s in self.seq.segments[self.first:] if s.trusted is not None), default=None)
        cuts: list[Segment] = []
        for span in spans:
            version, a, b = span.version, span.start, span.end
            if cuts and cuts[-1].weight_version == version:
                cuts[-1].end = self.start + b
                continue
            if cuts and version is not None:
                cuts[-1].outcome = _changed(version, self.start + a)
                _note_version(self.seq, version)
            cuts.append(Segment(seg.instance, seg.endpoint, version, self.start + a, self.start + b,
                                trusted=vouched, era=seg.era))
        if self.base is not None:  # the extended segment's tokens from before this attempt stay as they were
            start, version = self.base
            if cuts[0].weight_version == version:
                cuts[0].start = start
            else:
                cuts.insert(0, Segment(seg.instance, seg.endpoint, version, start, self.start,
                                       _changed(str(cuts[0].weight_version), self.start), vouched, seg.era))
                if cuts[1].weight_version is not None:
                    _note_version(self.seq, cuts[1].weight_version)
        cuts[-1].outcome = seg.outcome
        self.seq.segments[self.first:] = cuts
        self.current = cuts[-1]


def _note_version(seq: SequenceState, version: str) -> None:
    """A version the sequence now has tokens of, for its staleness bound and version floor."""
    if version.isascii() and version.isdigit() and int(version) not in seq.versions:
        seq.versions.append(int(version))
