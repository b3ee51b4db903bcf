"""A relay's running sequences saved outside it, so a relay that dies costs each sequence at most
``relay_checkpoint_tokens`` tokens made again (docs/relays.md).

Each sequence of a batch gets a key from its caller's id, its place in the request and its prompt. With every
report (``relay_report_s``) the relay sends the control process the tokens each running sequence made since its
last save, once there are at least ``every`` of them; what the control process holds moves on only when a report
arrives. One report carries at most ``per_report`` tokens (``MAX_REPORT_TOKENS``: 512 KiB of ids), taken round the
sequences in turn; the rest goes in the next one, which the relay sends at once (``Outgoing.more``), so what
encoding and sending a report takes is bounded whatever the relay holds. When the trainer's client sends the
unanswered ids again (``X-Rollout-Resume``), the relay that gets them claims their saved tokens and each sequence
continues from there, as it would on another box after a failure.

Not saved: sequences that asked for routed experts or top log-probs (their per-token extras are not kept
outside), and single ``/generate`` calls (no id to find them by).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import Any

import msgspec

from rollout_manager import jsonutil
from rollout_manager.instances.relay_messages import Outgoing, SavedSegment, SavedTokens
from rollout_manager.rollout.request import Request, SequenceRequest
from rollout_manager.rollout.sequence import SequenceState

RESUME_HEADER = "X-Rollout-Resume"  # the trainer's client sends ids again after a lost stream
# Saved tokens one report carries at most (4 bytes each, 5.3 in the JSON): what encoding and sending a report takes
# stays about 1.5 MB whatever the relay holds, where one report of every held sequence's tokens took about 6 bytes
# a token in flight (docs/benchmarks.md, section 17). More reports cost the control process about 0.5 ms each against
# the 8 to 9 ms its 131,072 tokens take (0.062 to 0.072 us a token).
MAX_REPORT_TOKENS = 128 * 1024


def key_of(rid: Any, index: int, item: SequenceRequest) -> str:
    """The key a batch's sequence is saved under: its caller's id, its place in the request and its prompt (an
    id reused for another prompt is another key)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(jsonutil.dumps(rid))
    h.update(b"#%d#" % index)
    h.update(array("q", item.body.input_ids).tobytes())
    return h.hexdigest()


def keyed(items: Sequence[tuple[Any, Request]], saved: dict[str, SavedTokens] | None = None
          ) -> list[tuple[Any, Request]]:
    """``items`` with each sequence's key, and its saved tokens where ``saved`` has them."""
    out = []
    for rid, request in items:
        sequences = []
        for index, item in enumerate(request.sequences):
            key = key_of(rid, index, item)
            sequences.append(msgspec.structs.replace(item, resume_key=key,
                                                     resumed=None if saved is None else saved.get(key)))
        out.append((rid, msgspec.structs.replace(request, sequences=sequences)))
    return out


def keys_of(items: Sequence[tuple[Any, Request]]) -> list[str]:
    return [key_of(rid, i, item) for rid, request in items for i, item in enumerate(request.sequences)]


def resume(seq: SequenceState, saved: SavedTokens) -> None:
    """``seq`` goes on from the tokens another relay saved: they become its output so far, in their segments. Saved
    tokens without the log-probs the caller asked for are not used (it starts from its prompt)."""
    if seq.body.wants_logprobs and len(saved.logprobs) != saved.count:
        return
    seq.output_ids.frombytes(saved.ids)
    if seq.body.wants_logprobs:
        seq.logprobs.extend(saved.logprobs)
    seq.resume_segments([(s.instance, s.endpoint, s.weight_version, s.start, s.end) for s in saved.segments],
                        saved.versions)


class Checkpoints:
    """The running sequences this relay saves, and what of each the control process holds."""

    def __init__(self, every: int, per_report: int = MAX_REPORT_TOKENS) -> None:
        self.every = every
        self.per_report = per_report
        self._live: dict[str, tuple[SequenceState, int]] = {}  # key -> (sequence, tokens the control process holds)
        self._done: list[str] = []

    def track(self, key: str, seq: SequenceState) -> None:
        if seq.experts is None:
            self._live[key] = (seq, len(seq.output_ids))

    def end(self, key: str, finished: bool) -> None:
        """The sequence ended: its saved tokens are dropped once it finished or failed; a cancelled one (its caller
        went away) keeps them, for the caller that sends it again."""
        if self._live.pop(key, None) is not None and finished:
            self._done.append(key)

    def collect(self) -> Outgoing:
        """What the next report carries; nothing moves on here until it arrived (``Outgoing.arrived``). At most
        ``per_report`` tokens: a sequence's piece may stop short of what it made (the rest goes next time), and the
        sequences sent go to the back of the turn, so the next report starts with those this one left."""
        saved: list[SavedTokens] = []
        moved: list[tuple[str, SequenceState, int]] = []
        budget, more = self.per_report, False
        for key, (seq, held) in self._live.items():
            made = len(seq.output_ids)
            if (made - held < self.every and made >= held) or seq.per_token:
                continue
            if budget <= 0:
                more = True
                break
            start = min(held, made)  # cut back below what was saved: the control process cuts there too
            end = min(made, start + budget)
            more = more or end < made
            budget -= end - start
            logprobs = seq.logprobs[start:end] if len(seq.logprobs) == made else []
            with memoryview(seq.output_ids) as view:  # one copy of the ids, no array slice between
                ids = view[start:end].tobytes()
            saved.append(SavedTokens(key, start, ids, logprobs,
                                     [SavedSegment(s.instance, s.endpoint, s.weight_version, s.start, s.end)
                                      for s in seq.segments], list(seq.versions)))
            moved.append((key, seq, end))
        for key, _, _ in moved:  # round the sequences in turn
            self._live[key] = self._live.pop(key)
        done, self._done = self._done, []

        def arrived(missing: list[str]) -> None:
            for key, seq, made in moved:
                if key in self._live:
                    self._live[key] = (seq, made)
            for key in missing:  # the control process holds nothing of these (it started again): sent whole
                if key in self._live:
                    self._live[key] = (self._live[key][0], 0)

        def lost() -> None:
            self._done[:0] = done

        return Outgoing(saved, done, arrived, lost, more)

    @property
    def saving(self) -> int:
        """Running sequences with tokens the control process holds."""
        return sum(1 for _, held in self._live.values() if held)

    def status(self) -> dict[str, int]:
        return {"sequences": len(self._live), "every": self.every}
