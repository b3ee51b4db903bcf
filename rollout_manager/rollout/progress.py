"""What one sequence has made on one engine, checked chunk by chunk, and the token arrays it is kept in.

Beside the sequence's state (:mod:`.sequence`): the engine's chunks, decoded in ``sglang/``
(:class:`.wire.GenerateChunk`), are folded into the sequence's own lists here, so those lists only ever
hold tokens the manager can vouch for.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollout_manager.sglang.finish import NO_META, FinalMeta, FinishReason
from rollout_manager.sglang.routed_experts import Base64Rows, RoutedExperts
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

    Whether a chunk is cumulative or a delta is the chunk's to say (:attr:`.wire.GenerateChunk.cumulative`).

    ``output_ids`` (a :func:`token_array`: 4 bytes a token, however long the sequence runs; a list handed
    in is copied into one) and ``logprobs`` may be handed in already holding what earlier segments made
    (the sequence's own): the engine's tokens are appended to them in place, so folding a chunk costs
    what the chunk brings, never the length of the sequence. ``made`` is this engine's share.

    Every chunk is checked before anything of it is kept, so the lists only ever hold tokens the manager
    can vouch for; :meth:`apply` raises :class:`BadChunk` (and changes nothing) for a chunk the decoder
    found malformed (its ``fault``), whose token count goes back or does not match its ids, whose
    cumulative ids rewrite what was sent, whose new ids are not in ``[0, vocab_size)``, that goes past
    ``limit`` tokens (the request's ``max_new_tokens``; None: no limit), that brings tokens after the final
    chunk, or whose reported weight version ``version_ok`` refuses (None: any).
    """

    output_ids: array[int] = field(default_factory=token_array)
    logprobs: list[list[Any]] = field(default_factory=list)
    finish: FinishReason | None = None  # the final chunk's (None until then)
    # What the answer keeps of the final chunk's engine fields; the shared :data:`NO_META` until then: a held
    # sequence keeps nothing of the chunks' but the few fields it reads.
    final: FinalMeta = NO_META
    text: str | None = None
    weight_version: str | None = None  # the latest a chunk reported (chunks may leave it out)
    limit: int | None = None
    vocab_size: int = TOKEN_ID_BOUND
    version_ok: Callable[[Any], str | None] | None = None  # why a reported version is wrong, or None
    per_token: dict[str, list[Any]] = field(default_factory=dict)  # the chunks' other per-token lists, gathered
    chunks: int = 0  # chunks folded in
    tokens_at: float | None = None  # event-loop time of its last read that brought tokens (a box's step time)
    # The sequence's routed experts when it asked for them (R3; None: it did not), and its prompt's length:
    # the final chunk's rows are checked against what this engine owes and kept there.
    experts: RoutedExperts | None = None
    prompt: int = 0
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
        if chunk.fault is not None:
            raise BadChunk(chunk.fault)
        ids, meta = chunk.ids, chunk.meta
        skipped = chunk.skipped_ids  # ids the decoder left unparsed: they were seen already
        skipped_lps = chunk.skipped_logprobs
        total = meta.total
        before = self.made
        if total < before:
            raise BadChunk(f"the token count went back from {before} to {total}")
        if skipped > before or skipped_lps > len(self.logprobs) - self._lps_start:
            raise BadChunk("a chunk skipped tokens this sequence never saw")
        cumulative = chunk.cumulative
        if cumulative:  # it repeats what was seen: only its tail is new, and the rest must be what was seen
            seen = before - skipped
            start = self._ids_start + skipped
            if seen and ids[:seen] != self.output_ids[start:start + seen].tolist():
                raise BadChunk(f"a cumulative chunk of {total} token(s) changed some of the {before} already sent")
            new = ids[seen:] if seen else ids
        elif before + len(ids) == total:
            new = ids
        else:
            raise BadChunk(f"a count of {total} token(s) fits neither a cumulative nor a delta chunk of "
                           f"{len(ids)} id(s) after {before} token(s)")
        checked: array[int] | str | None = None
        if new:
            if self.finish is not None:
                raise BadChunk(f"{len(new)} token(s) after the final chunk")
            if self.limit is not None and total > self.limit:
                raise BadChunk(f"{total} tokens for a request of max_new_tokens={self.limit}")
            checked = checked_token_ids(new, self.vocab_size)
            if isinstance(checked, str):
                raise BadChunk(checked)
        rows = None if self.experts is None else self._routed_rows(chunk, len(new))  # no call per chunk without R3
        version = meta.version
        if version is not None and version != self.weight_version and self.version_ok is not None:
            why = self.version_ok(version)  # asked when it changes: chunks repeat the version they run on
            if why is not None:
                raise BadChunk(why)
        if isinstance(checked, array):
            self.output_ids.extend(checked)
        if rows is not None:
            assert self.experts is not None
            self.experts.add(rows, self.prompt + len(self.output_ids))
        lps = meta.logprobs
        if lps is not None:
            seen_lps = len(self.logprobs) - self._lps_start - skipped_lps
            self.logprobs.extend(lps[seen_lps:] if cumulative else lps)
        if meta.per_token is not None:
            starts = self._per_token_start
            if starts is None:
                starts = self._per_token_start = {}
            for key, entries in meta.per_token.items():
                gathered = self.per_token.setdefault(key, [])
                seen = len(gathered) - starts.setdefault(key, 0)
                gathered.extend(entries[seen:] if cumulative else entries)
        text = chunk.text
        if text is not None:
            self.text = text if cumulative else (self.text or "") + text
        self.finish = chunk.finish
        self.final = meta.final
        if version is not None:
            self.weight_version = version
        self.chunks += 1
        return len(new)

    def _routed_rows(self, chunk: GenerateChunk, new: int) -> Base64Rows | None:
        """The final chunk's routed-expert rows to keep (None: none), checked; raises :class:`BadChunk`.

        A finished request owes them; an abort may carry them (SGLang sends an abort's too) or not (the next
        engine's prefill computes what is missing). A refusal's are not the sequence's (SGLang ran a stand-in
        prompt), so they are ignored."""
        finish, experts = chunk.finish, self.experts
        if experts is None or finish is None:
            return None
        rows = chunk.meta.experts
        if finish.is_abort:
            if rows is None or finish.caller_status is not None:
                return None
        elif rows is None:
            raise BadChunk("the final chunk carries no routed experts, which the request asked for")
        why = experts.check(rows, self.prompt + len(self.output_ids) + new)
        if why is not None:
            raise BadChunk(why)
        return rows
