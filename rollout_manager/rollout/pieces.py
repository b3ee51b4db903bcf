"""Divided rollouts: a long sequence generated in pieces, so its placement is decided again at each boundary.

Each attempt of a divided sequence asks its instance for at most one piece (``max_new_tokens`` capped,
``sglang.generate_request.continuation(piece=...)``); a piece that ends by that cap is not the sequence's
end, and the next piece continues exactly from the tokens made, as after a failure but with nothing
failed: the generator asks the dispatcher again, preferring the instance the sequence is on (whose prefix
cache holds it: no prefill), with the tokens still expected. The sizes are this module's
(:meth:`PieceSettings.size`); what the pieces' engines said that the answer counts over the whole sequence
is :class:`~rollout_manager.sglang.piece_meta.PieceTally`'s (SGLang's meta_info keys are the sglang
package's). A divided sequence's own part, :class:`Pieces`, is written by its methods only
(tests/test_sequence_parts.py). docs/rollout.md, "Divided rollouts", says why each choice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rollout_manager.sglang.finish import FinalMeta
from rollout_manager.sglang.piece_meta import PieceTally


@dataclass(frozen=True, slots=True)
class PieceSettings:
    """``tokens``: the smallest piece (0: sequences are never divided); ``min_budget``: a sequence whose
    ``max_new_tokens`` is below it runs whole; ``max_tokens``: the largest piece."""

    tokens: int = 0
    min_budget: int = 1024
    max_tokens: int = 4096

    def applies(self, budget: int | None) -> bool:
        """Whether a sequence with this ``max_new_tokens`` is divided at all (its body must allow it too:
        ``SequenceBody.divisible``)."""
        return self.tokens > 0 and budget is not None and budget >= self.min_budget

    def size(self, made: int, remaining: int, median: float | None = None) -> int | None:
        """The next piece's most tokens for a sequence with ``made`` tokens and ``remaining`` of its budget
        (None: it runs to its end, the piece would hold all that is left).

        The first piece is the group's predicted ``median`` length where there is one (most samples then end
        in it, and those that do not are the tail, placed again just as that shows), else ``tokens``; each
        later one as long as the sequence so far (a move costs one prefill of that many tokens, paid back
        over at least as many decoded), within ``[tokens, max_tokens]``.
        """
        want = (median or 0.0) if made == 0 else float(made)
        piece = min(max(int(want), self.tokens), max(self.max_tokens, self.tokens))
        return piece if piece < remaining else None


@dataclass(slots=True)
class Pieces:
    """A divided sequence's part (``SequenceState.pieces``, made when it is first divided; None for the others):
    the most tokens the running attempt may make, the boundaries crossed, whether the last attempt ended at one
    (the next attempt is the next piece, not a continuation after a failure), and what the pieces' engines said
    for the answer to count over the whole sequence. Written by these methods alone."""

    size: int | None = None  # the running attempt's most tokens (None: all that is left)
    crossed: int = 0  # piece boundaries crossed
    at_boundary: bool = False
    tally: PieceTally | None = None

    def next(self, size: int | None) -> None:
        """The next attempt makes at most ``size`` tokens (``PieceSettings.size``)."""
        self.size = size

    def ended(self, final: FinalMeta, prompt: int, made_before: int) -> None:
        """An attempt made its piece, its engine saying ``final``; its input was the ``prompt`` plus
        ``made_before`` tokens."""
        self.at_boundary = True
        self.crossed += 1
        if self.tally is None:
            self.tally = PieceTally()
        self.tally.add(final, prompt, made_before)

    def left_boundary(self) -> None:
        """The next attempt continues the sequence (it began, or the sequence was cut back), not a piece."""
        self.at_boundary = False

    def whole(self, meta: FinalMeta, prompt: int, made_before: int, completion: int, per_token: dict[str, Any],
              logprobs: list[Any]) -> FinalMeta:
        """The last piece's ``meta`` counted over every piece (as it is when no piece ended before it)."""
        if self.tally is None:
            return meta
        self.tally.add(meta, prompt, made_before)
        return self.tally.merged(meta, completion, per_token, logprobs)

    def restart(self) -> None:
        """The sequence starts again from its prompt: what earlier pieces said no longer counts."""
        self.tally, self.at_boundary = None, False
