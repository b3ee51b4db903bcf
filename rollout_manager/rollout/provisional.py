"""Delivered tokens that no passing trust probe vouched for yet, and those a quarantine distrusted.

A box's tokens are provisional from when it made them until a probe of that box, sent after they were made,
passes (``Segment.trusted``, set through ``Migrator.mark``). Running sequences are cut back when their box is
quarantined; an answer that was already delivered cannot be. So every finished sequence's segments that are
not vouched for in full are kept here, by the box that made them, until one of:

- a passing probe of that box vouches for them (the probe was sent after they were made): they are let go;
- the box is quarantined (or its disagreement is held back by the floor): they become *distrusted samples*,
  listed with the answer's id (``meta_info.id``) and the segment (box, version, token range), numbered so a
  reader asks only for what is new (``GET /distrusted_samples?after=N``); the trainer plugin drops those
  samples before a training step (``trainer_plugin.distrust``). An answer that finishes while its box is
  distrusted goes straight to that list, and its segment says ``distrusted`` in its ``meta_info`` (the answer
  is built after this);
- the box is removed: nothing will judge it again (said in ``forgotten_tokens``).

A quarantine also starts a new *era* of its box (:meth:`Provisional.era`, kept on each ``Segment``): what the
box made before it was caught stays distrusted for good, even once it serves again at the same version. A
probe after its readmission vouches only for segments of the new era (``Migrator.mark`` asks :meth:`stale`);
a sequence that was between two attempts when its box was caught (not streaming, so not cut back then) is cut
back before its next attempt (:meth:`cut_at`, asked by generation), and an answer that still finishes with
such tokens is listed at once.

Bounds: ``KEEP_PENDING`` segments per box (a box alone at its version is never checked; the oldest beyond the
bound are let go and counted in ``forgotten_tokens``, as a user then has no protection for them) and
``KEEP_DISTRUSTED`` distrusted samples (a reader that falls further behind is told ``missed``).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from rollout_manager.instances.relay_messages import DistrustedItem
from rollout_manager.rollout.sequence import Segment, SequenceState

KEEP_PENDING = 50_000  # unvouched delivered segments kept per box
KEEP_DISTRUSTED = 100_000  # distrusted samples kept for readers


@dataclass(frozen=True, slots=True)
class DistrustedSample:
    """One delivered segment with tokens a quarantined box made unvouched (``item``: ``[first, end)`` of the
    answer's output tokens, ``first`` its first token no passing probe vouched for, the segment being
    ``[start, end)``); ``number`` orders them for readers."""

    number: int
    item: DistrustedItem

    def to_dict(self) -> dict[str, Any]:
        return {"number": self.number, **msgspec.structs.asdict(self.item)}


def unvouched_from(seg: Segment) -> int:
    """The first of ``seg``'s tokens no passing probe vouched for (its end: all vouched)."""
    return seg.start if seg.trusted is None else min(max(seg.trusted, seg.start), seg.end)


class Provisional:
    """The finished sequences' unvouched segments by box, and the distrusted samples (see the module)."""

    def __init__(self, wall: Callable[[], float] = time.time) -> None:
        self.wall = wall
        self._pending: dict[str, deque[tuple[str, Segment]]] = {}  # instance -> (request id, segment)
        self._distrusting: dict[str, str] = {}  # instance -> why its tokens are distrusted now
        # instance -> (quarantines so far, why the last one): kept after the box is removed, so that a sequence
        # holding its tokens is still cut back (one entry per box ever quarantined)
        self._eras: dict[str, tuple[int, str]] = {}
        self.distrusted: deque[DistrustedSample] = deque(maxlen=KEEP_DISTRUSTED)
        self.numbered = 0  # distrusted samples ever listed
        self.distrusted_tokens = 0
        self.forgotten_tokens = 0  # unvouched tokens let go unjudged (bound reached, or their box removed)

    # ------------------------------------------------------------ sequences finishing
    def finished(self, seq: SequenceState) -> None:
        """``seq`` finished (its answer goes out now): keep what is not vouched for, by box."""
        for seg in seq.segments:
            if unvouched_from(seg) >= seg.end:
                continue
            why = self._distrusting.get(seg.instance) or self._stale_why(seg)
            if why is not None:  # its answer is not out yet: it says so too
                if "distrusted" not in seg.outcome:
                    seg.outcome = f"{seg.outcome}; distrusted: {why}"
                self._list(seq.rid, seg, why)
                continue
            kept = self._pending.setdefault(seg.instance, deque())
            if len(kept) >= KEEP_PENDING:
                _, old = kept.popleft()
                self.forgotten_tokens += old.end - unvouched_from(old)
            kept.append((seq.rid, seg))

    # ------------------------------------------------------------ eras
    def era(self, instance: str) -> int:
        """How many times ``instance`` was quarantined: what a segment it starts now carries."""
        kept = self._eras.get(instance)
        return 0 if kept is None else kept[0]

    def stale(self, seg: Segment) -> bool:
        """Whether ``seg`` was made before a quarantine of its instance: no probe vouches for it any more."""
        kept = self._eras.get(seg.instance)
        return kept is not None and seg.era < kept[0]

    def _stale_why(self, seg: Segment) -> str | None:
        kept = self._eras.get(seg.instance)
        return kept[1] if kept is not None and seg.era < kept[0] else None

    def cut_at(self, seq: SequenceState) -> tuple[int, str] | None:
        """Where ``seq`` must be cut back before it goes on, and why: its first token made before a quarantine
        of its instance that no probe had vouched for (None: there is none)."""
        if not self._eras:
            return None
        at = seq.first_unvouched(self.stale)
        if at >= len(seq.output_ids):
            return None
        why = next((w for s in seq.segments if s.end > at and (w := self._stale_why(s)) is not None), "quarantined")
        return at, why

    def pending(self, instance: str) -> list[Segment]:
        """The delivered segments of ``instance`` not vouched for in full: a probe sent now may vouch for them."""
        return [seg for _, seg in self._pending.get(instance, ())]

    def settle(self, instance: str) -> None:
        """A probe of ``instance`` passed and vouched for some: let those go."""
        kept = self._pending.get(instance)
        if kept:
            left = deque((rid, seg) for rid, seg in kept if unvouched_from(seg) < seg.end)
            if left:
                self._pending[instance] = left
            else:
                del self._pending[instance]

    # ------------------------------------------------------------ verdicts
    def distrust(self, instance: str, why: str, quarantined: bool = False) -> int:
        """``instance`` is quarantined (or found wrong and kept serving): its unvouched delivered segments
        become distrusted samples, and so does every one it finishes until :meth:`trust_again`. ``quarantined``:
        out of service, so a new era begins (what it made so far is never vouched for). Returns the samples
        listed now."""
        self._distrusting[instance] = why
        if quarantined:
            self._eras[instance] = (self.era(instance) + 1, why)
        kept = self._pending.pop(instance, deque())
        for rid, seg in kept:
            self._list(rid, seg, why)
        return len(kept)

    def trust_again(self, instance: str) -> None:
        """``instance`` serves again (reloaded, its probe passed)."""
        self._distrusting.pop(instance, None)

    def forget(self, instance: str) -> None:
        """``instance`` was removed: what it made unvouched will never be judged."""
        self._distrusting.pop(instance, None)
        for _, seg in self._pending.pop(instance, ()):
            self.forgotten_tokens += seg.end - unvouched_from(seg)

    def _list(self, rid: str, seg: Segment, why: str) -> None:
        self.list_item(DistrustedItem(rid, seg.instance, seg.endpoint, seg.weight_version, seg.start, seg.end,
                                      unvouched_from(seg), why, self.wall()))

    # ------------------------------------------------------------ with relays (docs/relays.md)
    def distrusting_of(self, instance: str) -> str | None:
        """Why ``instance``'s delivered tokens are distrusted now (None: they are not)."""
        return self._distrusting.get(instance)

    def listed_after(self, after: int) -> list[DistrustedItem]:
        """A relay's distrusted samples numbered above ``after``, for its control process to list."""
        return [d.item for d in self.distrusted if d.number > after]

    def list_item(self, item: DistrustedItem) -> None:
        """List a distrusted sample under the next number: this process's own, or a relay's (the trainer reads one
        list whichever relay delivered it)."""
        self.numbered += 1
        self.distrusted_tokens += item.end - item.first
        self.distrusted.append(DistrustedSample(self.numbered, item))

    # ------------------------------------------------------------ readers
    def since(self, after: int) -> dict[str, Any]:
        """The distrusted samples numbered above ``after``; ``last``: the highest number listed (the next
        ``after``); ``missed``: samples numbered above ``after`` no longer kept (the reader fell behind)."""
        oldest = self.distrusted[0].number if self.distrusted else self.numbered + 1
        samples = [s.to_dict() for s in self.distrusted if s.number > after]
        return {"samples": samples, "last": self.numbered, "missed": max(0, oldest - after - 1)}

    def status(self) -> dict[str, Any]:
        """Counts for the status (a look per box, not per segment: it is read every second)."""
        return {"pending_segments": sum(len(v) for v in self._pending.values()),
                "distrusted_samples": self.numbered, "distrusted_tokens": self.distrusted_tokens,
                "forgotten_tokens": self.forgotten_tokens, "distrusting": sorted(self._distrusting)}
