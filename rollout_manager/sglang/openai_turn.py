"""An OpenAI-style turn as SGLang's ``/generate`` body, and SGLang's answer read back for the OpenAI front.

The front (``rollout_manager.openai_front``) speaks OpenAI's field names; SGLang's wire keys (the sampling
parameters' names, ``output_token_logprobs``' layout) stay here, like everything else SGLang's.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any

from msgspec import UNSET

from rollout_manager.sglang.answer import AnswerMeta, GenerateAnswer
from rollout_manager.sglang.generate_request import KnownIds, Sampling, SequenceBody


@dataclass(frozen=True)
class CallTag:
    """One function a forced turn may call, in the model's own call format: the text that opens its call
    (the function's name written in), the JSON schema its arguments follow, the text that closes it."""

    begin: str
    schema: dict[str, Any]
    end: str


@dataclass(frozen=True)
class ForcedCalls:
    """A turn that must start with a tool call (OpenAI's ``tool_choice`` ``"required"`` or a named function):
    one of ``tags``, each opened with ``trigger`` (a prefix of every ``begin``); with ``one``, the answer
    ends after the first call. ``max_whitespace`` bounds consecutive whitespace in the arguments' JSON,
    so a model cannot spin on blanks inside them."""

    tags: tuple[CallTag, ...]
    trigger: str
    one: bool
    max_whitespace: int = 1


def structural_tag(forced: ForcedCalls) -> str:
    """SGLang 0.5.23's ``structural_tag`` sampling parameter (xgrammar's ``triggered_tags`` format, which
    SGLang compiles on CPU too: ``XGrammarGrammar.apply_vocab_mask`` has a CPU branch): at least one tag,
    the answer starting with one, and, with ``one``, nothing after the first. What SGLang's own
    ``FunctionCallParser.get_structure_constraint`` sends for ``tool_choice`` required or named."""
    tags = [{"type": "tag", "begin": t.begin, "end": t.end,
             "content": {"type": "json_schema", "json_schema": t.schema, "max_whitespace_cnt": forced.max_whitespace}}
            for t in forced.tags]
    return json.dumps({"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": [forced.trigger], "tags": tags, "at_least_one": True,
        "stop_after_first": forced.one}})


@dataclass(frozen=True)
class TurnSampling:
    """What an OpenAI request says about sampling, in its own terms (None: not given)."""

    max_tokens: int | None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    top_logprobs: int = 0  # the most likely tokens to report beside each sampled one (0: none)
    forced: ForcedCalls | None = None  # the answer must be tool calls (grammar-constrained on the boxes)
    experts_from: int | None = None  # R3: the routed experts of every position from this one (None: not asked)


def turn_body(ids: list[int], sampling: TurnSampling, *, stream: bool, ids_json: bytes | None = None,
              known: KnownIds | None = None) -> SequenceBody:
    """One sequence's ``/generate`` body: the prompt ids, the sampling, log-probs always asked for (the
    ledger keeps them; SGLang computes them at no extra forward pass), and SGLang's ``top_logprobs_num``
    when the caller wants the most likely tokens too. ``ids`` is the body's own, not a copy (a session's
    prompt is its whole history; nothing changes a body's ids in place); ``ids_json``: their JSON, when the
    caller encoded them already; ``known``: what the caller knows of them (a session's ledger)."""
    rest: dict[str, Any] = {}
    if sampling.temperature is not None:
        rest["temperature"] = sampling.temperature
    if sampling.top_p is not None:
        rest["top_p"] = sampling.top_p
    if sampling.stop:
        rest["stop"] = list(sampling.stop)
    if sampling.stop_token_ids:
        rest["stop_token_ids"] = list(sampling.stop_token_ids)
    if sampling.top_k is not None:
        rest["top_k"] = sampling.top_k
    if sampling.min_p is not None:
        rest["min_p"] = sampling.min_p
    if sampling.ignore_eos:
        rest["ignore_eos"] = True
    if sampling.forced is not None:
        rest["structural_tag"] = structural_tag(sampling.forced)
    params = Sampling(max_new_tokens=sampling.max_tokens, sampling_seed=sampling.seed, rest=rest)
    extra = {TOP_LOGPROBS_NUM: sampling.top_logprobs} if sampling.top_logprobs else {}
    return SequenceBody(ids, params, stream=stream, return_logprob=True, rest=extra,
                        routed_experts=sampling.experts_from is not None, experts_from=sampling.experts_from or 0,
                        ids_json=None if ids_json is None else (ids, ids_json), known_ids=known)


TOP_LOGPROBS_NUM = "top_logprobs_num"  # the /generate field asking for them
TOP_LOGPROBS = "output_top_logprobs"  # meta_info's per-token list: [[logprob, token_id, text or null], ...] or null


def _tops(meta: AnswerMeta, n: int) -> list[list[tuple[int, float]]] | None:
    """The last ``n`` tokens' most likely alternatives as (id, log-prob), from SGLang's per-token list
    (gathered by the manager over every chunk and box); None when the answer has none."""
    per_token = meta.per_token
    rows = None if per_token is UNSET else per_token.get(TOP_LOGPROBS)
    if rows is None:
        return None
    rows = rows[-n:] if n else []
    out = [[(int(e[1]), float(e[0])) for e in row if e and e[0] is not None] if row else [] for row in rows]
    return [[] for _ in range(n - len(out))] + out


@dataclass(frozen=True)
class TurnResult:
    """One sequence's answer as the front needs it: the ids sampled, their log-probs (None where the
    engine gave none), how it ended (OpenAI's word), and the weight versions it ran under."""

    output_ids: list[int]
    logprobs: list[float | None]
    finish_reason: str | None
    matched_stop: int | str | None
    prompt_tokens: int
    weight_version: Any
    weight_versions: list[dict[str, Any]]
    segments: list[dict[str, Any]]
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per output id: (id, log-prob), most likely first
    # R3: SGLang's rows (little-endian int32, ``layers x top_k`` a position) from the position asked for up to
    # the last token, which has none; None when not asked for or not in this answer (only a final one has them)
    routed_experts: bytes | None = None


def read_answer(answer: GenerateAnswer) -> TurnResult:
    """SGLang's answer (final or a cumulative stream chunk) -> :class:`TurnResult`. SGLang's finish types
    ``stop`` and ``length`` are OpenAI's words too; ``abort`` is reported as ``stop`` is not: it stays
    ``abort`` so a caller can tell."""
    meta = answer.meta_info
    ids = list(answer.output_ids)
    lps: list[float | None] = [None] * len(ids)
    if meta.output_token_logprobs is not UNSET:
        rows = meta.output_token_logprobs[-len(ids):] if ids else []
        lps = [row[0] if row and isinstance(row[0], (int, float)) else None for row in rows]
        lps += [None] * (len(ids) - len(lps))
    finish = meta.finish_reason
    kind = None if finish is None else finish.type
    matched = None if finish is None or finish.matched is UNSET or isinstance(finish.matched, list) else finish.matched
    versions = [] if meta.weight_versions is UNSET else [
        {"version": v.version, "start": v.start, "end": v.end} for v in meta.weight_versions]
    segments = [] if meta.segments is UNSET else [s.to_dict() for s in meta.segments]
    experts = None if meta.routed_experts is UNSET else base64.b64decode(meta.routed_experts.quoted[1:-1])
    return TurnResult(ids, lps, kind, matched, meta.prompt_tokens, meta.weight_version, versions, segments,
                      _tops(meta, len(ids)), experts)
