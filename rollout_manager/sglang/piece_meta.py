"""What SGLang's final ``meta_info`` says, merged over the pieces of a divided rollout (``rollout/pieces.py``),
so that the answer says it for the whole sequence as an undivided one would: which keys are summed, which are
the first piece's, which lengths are said again. The keys are SGLang 0.5.23's; only this package names them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from rollout_manager.sglang.finish import FinalMeta

# Final meta_info counts that SGLang gives per request and an undivided answer gives for the whole sequence.
SUMMED_META = ("reasoning_tokens", "num_retractions", "spec_verify_ct", "spec_num_correct_drafts",
               "spec_num_proposed_drafts")
# Final meta_info fields about the request's start (its prompt in the prefix cache, its wait, its first token):
# the first piece's are the whole sequence's. Those about its end are the last piece's, as they come.
FIRST_META = ("cached_tokens_details", "queue_time", "first_token_latency", "request_received_ts",
              "forward_entry_time", "prefill_finished_time")
# Final meta_info lengths of per-token lists the manager gathers over the whole sequence: key -> the list's key.
LOGPROBS_KEY = "output_token_logprobs"
LENGTH_META = {"output_token_logprobs_length": LOGPROBS_KEY,
               "output_token_sampling_mask_length": "output_token_sampling_mask"}


@dataclass(slots=True)
class PieceTally:
    """What the final meta_info of a divided sequence's pieces said, for its answer to say it for the whole
    sequence as an undivided one would (:meth:`merged`).

    ``cached_tokens`` is the first piece's (how much of the caller's prompt the prefix cache served) less
    what later pieces prefilled again beyond the one token per boundary an undivided run computes as well
    (the last token of a piece, which its engine never ran): ``prompt_tokens - cached_tokens`` is the
    prefill the request cost, the undivided figure when each piece stays on its instance.
    """

    cached: int | None = None  # the first piece's cached_tokens (None: not reported)
    prefilled: int = 0  # tokens later pieces prefilled again
    sums: dict[str, int] = field(default_factory=dict)
    first: dict[str, Any] = field(default_factory=dict)  # the first piece's FIRST_META fields
    pieces: int = 0  # pieces folded in

    def add(self, meta: FinalMeta, prompt: int, made_before: int) -> None:
        """A piece ended with ``meta``; its request's input was the ``prompt`` plus ``made_before`` tokens."""
        other = meta.other
        cached = other.get("cached_tokens")
        if self.pieces == 0:
            self.first = {k: other[k] for k in FIRST_META if k in other}
        if type(cached) is int:
            if self.pieces == 0:
                self.cached = cached
            else:
                self.prefilled += max(prompt + made_before - cached - 1, 0)
        for key in SUMMED_META:
            value = other.get(key)
            if type(value) is int:
                self.sums[key] = self.sums.get(key, 0) + value
        self.pieces += 1

    def merged(self, meta: FinalMeta, completion: int, per_token: dict[str, Any], logprobs: list[Any]) -> FinalMeta:
        """The final piece's ``meta`` (folded in already) with the whole sequence's counts and the ratios
        SGLang derives from them; ``completion``: the sequence's tokens; ``per_token`` (by meta_info key) and
        ``logprobs``: the per-token lists gathered over the sequence (their lengths are said again)."""
        lists = {**per_token, LOGPROBS_KEY: logprobs}
        other = dict(meta.other)
        if self.cached is not None and "cached_tokens" in other:
            other["cached_tokens"] = max(self.cached - self.prefilled, 0)
        for key, value in self.first.items():
            if key in other:
                other[key] = value
        for key, total in self.sums.items():
            if key in other:
                other[key] = total
        verified, correct, proposed = (self.sums.get(k) for k in SUMMED_META[2:])
        if "spec_accept_rate" in other and correct is not None and proposed:
            other["spec_accept_rate"] = correct / proposed
        if "spec_accept_length" in other and verified:
            other["spec_accept_length"] = completion / verified
        for key, of in LENGTH_META.items():
            if key in other and of in lists:
                other[key] = len(lists[of])
        return msgspec.structs.replace(meta, other=other)
