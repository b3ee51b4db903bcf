"""The segments of one attempt on one instance: one per weight version the engine made tokens with.

An instance may change weights under a running sequence (a staged version activated with a short
pause): the sequence keeps every token, and a new segment starts at the token where the version
changed, on the same instance, so every segment has one version and the caller sees the boundary.
Two sources say where: each chunk's ``meta_info.weight_version`` (to the chunk: the new segment starts at
the first token of the first chunk reporting the new version), and SGLang's (0.5.23) exact
``meta_info.weight_versions`` spans on the final chunk, which win when present and well formed.
"""

from __future__ import annotations

from typing import Any

from rollout_manager.instances.registry import Instance
from rollout_manager.rollout.sequence import Segment, SequenceState


def _changed(version: str, at: int) -> str:
    return f"weight version {version} from token {at}"


class AttemptSegments:
    """This attempt's segments, the last one (``current``) running; ``start``: the token it began at."""

    def __init__(self, seq: SequenceState, inst: Instance) -> None:
        self.seq = seq
        self.start = len(seq.output_ids)
        self.first = len(seq.segments)  # where this attempt's segments begin in seq.segments
        self.current = Segment(inst.id, inst.endpoint, None, self.start, self.start)
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
            seg = self.current = Segment(seg.instance, seg.endpoint, version, seg.end, end)
            self.seq.segments.append(seg)
            _note_version(self.seq, version)
        seg.end = end
        if version is not None:
            seg.weight_version = version

    def exact(self, spans: Any) -> None:
        """Cut this attempt's segments where the engine's ``weight_versions`` spans (``[{"version", "start",
        "end"}]`` over this request's tokens, SGLang >= 0.5.23) say; spans that do not cover exactly the
        tokens made, in order, are ignored (the per-chunk cuts stand)."""
        parsed = _spans(spans, self.made)
        if parsed is None:
            return
        seg = self.current
        cuts: list[Segment] = []
        for version, a, b in parsed:
            if cuts and cuts[-1].weight_version == version:
                cuts[-1].end = self.start + b
                continue
            if cuts:
                cuts[-1].outcome = _changed(version, self.start + a)
                _note_version(self.seq, version)
            cuts.append(Segment(seg.instance, seg.endpoint, version, self.start + a, self.start + b))
        cuts[-1].outcome = seg.outcome
        self.seq.segments[self.first:] = cuts
        self.current = cuts[-1]


def _note_version(seq: SequenceState, version: str) -> None:
    """A version the sequence now has tokens of, for its staleness bound and version floor."""
    if version.isascii() and version.isdigit() and int(version) not in seq.versions:
        seq.versions.append(int(version))


def _spans(spans: Any, made: int) -> list[tuple[str, int, int]] | None:
    if not isinstance(spans, list) or not spans:
        return None
    out: list[tuple[str, int, int]] = []
    at = 0
    for span in spans:
        if not isinstance(span, dict):
            return None
        version, a, b = span.get("version"), span.get("start"), span.get("end")
        if version is None or type(a) is not int or type(b) is not int or a != at or b < a:
            return None
        out.append((str(version), a, b))
        at = b
    return out if at == made else None
