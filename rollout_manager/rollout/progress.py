"""What one sequence has made on one engine, checked chunk by chunk, and the token arrays it is kept in.

Beside the sequence's state (:mod:`.sequence`): the engine's chunks (:class:`.wire.GenerateChunk`) are
folded into the sequence's own lists here, so those lists only ever hold tokens the manager can vouch for.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollout_manager.sglang import wire
from rollout_manager.sglang.finish import NO_META, FinalMeta, FinishReason
from rollout_manager.sglang.wire import GenerateChunk

# Token ids at or above this are no model's (every vocabulary fits 32 bits): the bound when an instance's
# vocabulary size is not known.
TOKEN_ID_BOUND = 2**32
_UINT = "I" if array("I").itemsize == 4 else "L"  # a C array type holding exactly [0, TOKEN_ID_BOUND)


class BadChunk(ValueError):
    """A chunk the manager cannot vouch for: the engine broke its contract (not the caller's error)."""


def token_array(ids: Iterable[int] = ()) -> array[int]:
    """A sequence's token ids as the manager keeps them: 4 bytes each (a list of ints costs about 40)."""
    return array(_UINT, ids)


def as_list(ids: Sequence[int]) -> list[int]:
    """Token ids as the JSON list callers get (a C conversion for the manager's own arrays)."""
    return ids.tolist() if isinstance(ids, array) else list(ids)


def checked_token_ids(ids: list[Any], vocab_size: int) -> array[int] | str:
    """``ids`` as a :func:`token_array` when they are token ids of a ``vocab_size`` vocabulary (ints,
    not bools); otherwise why they are not.

    Built for the relay: the common case costs the C conversion to the unsigned 32-bit array the
    sequence keeps anyway (it refuses floats, strings, nulls, negatives and ids past 32 bits), a scan
    for bools and, when the vocabulary is known, a ``max``; the offending id is looked for only when
    something is wrong.
    """
    try:
        out = array(_UINT, ids)
    except (TypeError, OverflowError, ValueError):
        pass
    else:
        if bool not in map(type, ids) and (vocab_size >= TOKEN_ID_BOUND or not ids or max(out) < vocab_size):
            return out
    return bad_token_ids(ids, vocab_size) or f"token ids {str(ids)[:200]} are not a vocabulary's"


def bad_token_ids(ids: list[Any], vocab_size: int) -> str | None:
    """Why ``ids`` are not token ids of a ``vocab_size`` vocabulary (ints, not bools), or None."""
    for t in ids:
        if type(t) is not int:
            return f"token id {t!r} is not an integer"
        if not 0 <= t < vocab_size:
            return f"token id {t} is outside the vocabulary [0, {vocab_size})"
    return None


@dataclass(slots=True)
class SequenceProgress:
    """What one sequence has produced so far on one engine, whatever the chunk mode, checked.

    Chunks are classified by ``meta_info.completion_tokens`` (always cumulative): if ``output_ids``
    is as long as that count the chunk is cumulative, otherwise it is a delta.

    ``output_ids`` (a :func:`token_array`: 4 bytes a token, however long the sequence runs; a list handed
    in is copied into one) and ``logprobs`` may be handed in already holding what earlier segments made
    (the sequence's own): the engine's tokens are appended to them in place, so folding a chunk costs
    what the chunk brings, never the length of the sequence. ``made`` is this engine's share.

    Every chunk is checked before anything of it is kept, so the lists only ever hold tokens the manager
    can vouch for; :meth:`apply` raises :class:`BadChunk` (and changes nothing) for a chunk whose
    ``completion_tokens`` is missing, goes back or does not match its ids, whose cumulative ids rewrite
    what was sent, whose new ids are not in ``[0, vocab_size)``, that goes past ``limit`` tokens (the
    request's ``max_new_tokens``; None: no limit), that brings tokens after the final chunk, whose
    ``finish_reason`` is neither null nor an object with a string ``type`` (SGLang sends no other: the manager
    could not tell how the request ended), or whose ``weight_version`` ``version_ok`` refuses (None: any).
    """

    output_ids: array[int] = field(default_factory=token_array)
    logprobs: list[list[Any]] = field(default_factory=list)
    finish_reason: FinishReason | None = None  # decoded from the final chunk (None until then)
    # What the answer needs of the final chunk's meta_info; the shared :data:`NO_META` until then: a held
    # sequence keeps nothing of the chunks' meta_info but the few fields it reads.
    meta_info: FinalMeta = NO_META
    text: str | None = None
    weight_version: str | None = None  # the latest a chunk reported (chunks may leave it out)
    limit: int | None = None
    vocab_size: int = TOKEN_ID_BOUND
    version_ok: Callable[[Any], str | None] | None = None  # why a reported version is wrong, or None
    per_token: dict[str, list[Any]] = field(default_factory=dict)  # wire.PER_TOKEN_META_KEYS' lists, gathered
    chunks: int = 0  # chunks folded in
    _ids_start: int = field(init=False, repr=False)
    _lps_start: int = field(init=False, repr=False)
    _per_token_start: dict[str, int] | None = field(init=False, repr=False)  # None: no lists yet

    def __post_init__(self) -> None:
        if not isinstance(self.output_ids, array) or self.output_ids.typecode != _UINT:
            self.output_ids = token_array(self.output_ids)
        self._ids_start, self._lps_start = len(self.output_ids), len(self.logprobs)
        self._per_token_start = {k: len(v) for k, v in self.per_token.items()} if self.per_token else None

    @property
    def made(self) -> int:
        """Tokens this engine produced (not counting what the lists held at the start)."""
        return len(self.output_ids) - self._ids_start

    def apply(self, chunk: GenerateChunk) -> int:
        """Fold one chunk in; return how many new tokens it brought. Raises :class:`BadChunk`."""
        meta = chunk.meta_info
        ids = chunk.output_ids
        if ids is None:
            ids = []
        if not isinstance(meta, dict) or not isinstance(ids, list):
            raise BadChunk(f"a chunk without the meta_info object or the output_ids list: {str(chunk)[:200]}")
        skipped = chunk.skipped_ids  # ids the decoder left unparsed: they were seen already
        skipped_lps = chunk.skipped_logprobs
        total = meta.get("completion_tokens")
        before = self.made
        if type(total) is not int:
            raise BadChunk(f"completion_tokens is {total!r}, not a count (after {before} token(s))")
        if total < before:
            raise BadChunk(f"completion_tokens went back from {before} to {total}")
        if skipped > before or skipped_lps > len(self.logprobs) - self._lps_start:
            raise BadChunk("a chunk skipped tokens this sequence never saw")
        cumulative = len(ids) + skipped == total
        if cumulative:  # it repeats what was seen: only its tail is new, and the rest must be what was seen
            seen = before - skipped
            start = self._ids_start + skipped
            if seen and ids[:seen] != self.output_ids[start:start + seen].tolist():
                raise BadChunk(f"a cumulative chunk of {total} token(s) changed some of the {before} already sent")
            new = ids[seen:] if seen else ids
        elif before + len(ids) == total:
            new = ids
        else:
            raise BadChunk(f"completion_tokens {total} fits neither a cumulative nor a delta chunk of "
                           f"{len(ids)} id(s) after {before} token(s)")
        checked: array[int] | str | None = None
        if new:
            if self.finish_reason is not None:
                raise BadChunk(f"{len(new)} token(s) after the final chunk")
            if self.limit is not None and total > self.limit:
                raise BadChunk(f"{total} tokens for a request of max_new_tokens={self.limit}")
            checked = checked_token_ids(new, self.vocab_size)
            if isinstance(checked, str):
                raise BadChunk(checked)
        version = meta.get("weight_version")
        if version is not None and version != self.weight_version and self.version_ok is not None:
            why = self.version_ok(version)  # asked when it changes: chunks repeat the version they run on
            if why is not None:
                raise BadChunk(why)
        lps = meta.get("output_token_logprobs")
        if lps is not None and not isinstance(lps, list):
            raise BadChunk(f"output_token_logprobs is {type(lps).__name__}, not a list")
        finish = meta.get("finish_reason")
        if finish is not None:  # decoded once, from the final chunk
            try:
                finish = FinishReason.from_json(finish)
            except ValueError as exc:
                raise BadChunk(str(exc)) from None
        if isinstance(checked, array):
            self.output_ids.extend(checked)
        if lps is not None:
            seen_lps = len(self.logprobs) - self._lps_start - skipped_lps
            self.logprobs.extend(lps[seen_lps:] if cumulative else lps)
        for key in wire.PER_TOKEN_META_KEYS:
            entries = meta.get(key)
            if isinstance(entries, list):
                gathered = self.per_token.setdefault(key, [])
                starts = self._per_token_start
                if starts is None:
                    starts = self._per_token_start = {}
                seen = len(gathered) - starts.setdefault(key, 0)
                gathered.extend(entries[seen:] if cumulative else entries)
        text = chunk.text
        if text is not None:
            self.text = text if cumulative else (self.text or "") + text
        self.finish_reason = finish
        self.meta_info = NO_META if finish is None else FinalMeta.from_json(meta)
        if version is not None:
            self.weight_version = version
        self.chunks += 1
        return len(new)
