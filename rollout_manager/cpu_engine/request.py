"""The CPU engine's request side: a /generate body checked and parsed into typed sequence specs.

SGLang's order of checks (its schema, then the tokenizer manager's, then the scheduler's margin) decides
which error a caller sees; the HTTP status of each is decided in server.py.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from rollout_manager.cpu_engine import routed_experts
from rollout_manager.cpu_engine.model import EngineSampling
from rollout_manager.sglang import wire


class RequestRefused(ValueError):
    """A request the engine refuses (HTTP 400)."""



# SGLang sampling keys accepted but without effect here (no tokenizer, no penalties, no grammars).
_NOOP_SAMPLING_KEYS = {
    "stop",
    "stop_regex",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_p",
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
    "custom_params",
    "logit_bias",
}
_SAMPLING_KEYS = {
    "max_new_tokens",
    "min_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop_token_ids",
    "ignore_eos",
    "sampling_seed",
    "stream_interval",
    "n",
} | _NOOP_SAMPLING_KEYS

# SGLang's scheduler keeps this many tokens of the context back from the input
# (max_req_input_len = max_req_len - 5 with max_req_len = context_len - 1, in tp_worker.py).
_SCHEDULER_INPUT_MARGIN = 6


@dataclass
class SequenceSpec:
    """One validated sequence of a /generate call."""

    rid: str
    input_ids: list[int]
    params: EngineSampling
    return_logprob: bool
    index: int | None  # position in a batch, None for a single request
    stream_interval: int | None = None  # sampling_params.stream_interval (None: the server's)
    return_routed_experts: bool = False  # the body's, the same for every item of a batch
    routed_experts_start_len: int = 0
    # SGLang's logprob_start_len: with return_logprob, the prompt position from which input_token_logprobs
    # are returned (None: SGLang's -1 default, none)
    logprob_start_len: int | None = None
    top_logprobs_num: int = 0  # with return_logprob: the most likely tokens reported beside each output token


@dataclass
class EngineRequest:
    specs: list[SequenceSpec]
    stream: bool
    batched: bool


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _parse_sampling(raw: Any, *, where: str) -> EngineSampling:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise RequestRefused(f"{where}sampling_params must be an object")
    unknown = set(raw) - _SAMPLING_KEYS
    if unknown:
        raise RequestRefused(f"{where}unknown sampling_params {sorted(unknown)}")
    p = EngineSampling()
    if "max_new_tokens" in raw:
        v = raw["max_new_tokens"]
        if v is not None and (not _is_int(v) or v < 0):
            raise RequestRefused(f"{where}max_new_tokens must be a non-negative integer or null")
        p.max_new_tokens = v
    if raw.get("min_new_tokens") is not None:
        v = raw["min_new_tokens"]
        if not _is_int(v) or v < 0:
            raise RequestRefused(f"{where}min_new_tokens must be a non-negative integer")
        p.min_new_tokens = v
    if raw.get("temperature") is not None:
        v = raw["temperature"]
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
            raise RequestRefused(f"{where}temperature must be a number >= 0")
        p.temperature = float(v)
    if raw.get("top_p") is not None:
        v = raw["top_p"]
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v <= 1:
            raise RequestRefused(f"{where}top_p must be in (0, 1]")
        p.top_p = float(v)
    if raw.get("top_k") is not None:
        v = raw["top_k"]
        if not _is_int(v) or (v < 1 and v != -1):
            raise RequestRefused(f"{where}top_k must be -1 (disabled) or at least 1")
        p.top_k = v
    if raw.get("stop_token_ids") is not None:
        v = raw["stop_token_ids"]
        if not isinstance(v, list) or not all(_is_int(t) for t in v):
            raise RequestRefused(f"{where}stop_token_ids must be a list of integers")
        p.stop_token_ids = list(v)
    if raw.get("ignore_eos") is not None:
        if not isinstance(raw["ignore_eos"], bool):
            raise RequestRefused(f"{where}ignore_eos must be a boolean")
        p.ignore_eos = raw["ignore_eos"]
    if raw.get("sampling_seed") is not None:
        if not _is_int(raw["sampling_seed"]):
            raise RequestRefused(f"{where}sampling_seed must be an integer")
        p.sampling_seed = raw["sampling_seed"]
    if raw.get("stream_interval") is not None and not _is_int(raw["stream_interval"]):
        raise RequestRefused(f"{where}stream_interval must be an integer")
    if raw.get("n", 1) != 1:
        raise RequestRefused(f"{where}only n=1 is supported")
    return p


def parse_generate_body(body: Any, *, vocab_size: int, context_len: int) -> EngineRequest:
    """Validate a /generate body into sequence specs. Raises RequestRefused with a clear message."""
    if not isinstance(body, dict):
        raise RequestRefused("the body must be a JSON object")
    if body.get("text") is not None:
        raise RequestRefused("this engine has no tokenizer: send input_ids, not text")
    for key in ("input_embeds", "image_data", "audio_data", "video_data"):
        if body.get(key) is not None:
            raise RequestRefused(f"{key} is not supported by this engine")
    ids = body.get("input_ids")
    if not isinstance(ids, list) or not ids:
        raise RequestRefused("input_ids must be a non-empty list of token ids (or a list of such lists)")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestRefused("stream must be a boolean")
    batched = wire.is_batched(body)
    if batched:
        n = len(ids)
        for key in wire.PER_ITEM_KEYS:
            value = body.get(key)
            if isinstance(value, list) and len(value) != n:
                raise RequestRefused(f"{key} is a list of {len(value)} items for a batch of {n}")
        parts = wire.split_batch(body)  # a string rid names the items rid_0, rid_1, ... as in SGLang
    else:
        for key in wire.PER_ITEM_KEYS:
            if isinstance(body.get(key), list):
                raise RequestRefused(f"{key} must not be a list for a single (unbatched) request")
        parts = [body]
    wants_experts, experts_start = routed_experts.requested(body)
    specs: list[SequenceSpec] = []
    seen: set[str] = set()
    for i, part in enumerate(parts):
        where = f"item {i}: " if batched else ""
        seq = part.get("input_ids")
        if not isinstance(seq, list) or not seq:
            raise RequestRefused(f"{where}input_ids must be a non-empty list of token ids")
        for t in seq:
            if not _is_int(t) or not 0 <= t < vocab_size:
                raise RequestRefused(f"{where}input_ids holds {t!r}, not a token id in [0, {vocab_size})")
        params = _parse_sampling(part.get("sampling_params"), where=where)
        n_in = len(seq)
        if n_in >= context_len:
            raise RequestRefused(
                f"{where}The input ({n_in} tokens) is longer than the model's context length ({context_len} tokens)."
            )
        if params.max_new_tokens is not None and params.max_new_tokens + n_in > context_len:
            raise RequestRefused(
                f"{where}Requested token count exceeds the model's maximum context length of {context_len} "
                f"tokens. You requested a total of {params.max_new_tokens + n_in} tokens: {n_in} tokens from the "
                f"input and {params.max_new_tokens} tokens for the completion."
            )
        rlp = part.get("return_logprob", False)
        if rlp is None:
            rlp = False
        if not isinstance(rlp, bool):
            raise RequestRefused(f"{where}return_logprob must be a boolean (or a list of booleans)")
        start = part.get("logprob_start_len")
        if start is not None and (not _is_int(start) or start < -1 or start >= n_in):
            raise RequestRefused(f"{where}logprob_start_len must be an integer in [-1, {n_in}) (the input's length)")
        rid = part.get("rid")
        if rid is None or rid == "":
            rid = uuid.uuid4().hex
        if not isinstance(rid, str):
            raise RequestRefused(f"{where}rid must be a string")
        if rid in seen:
            raise RequestRefused(f"duplicate rid {rid!r} in the batch")
        seen.add(rid)
        top = part.get("top_logprobs_num") or 0
        if not _is_int(top) or top < 0:
            raise RequestRefused(f"{where}top_logprobs_num must be a non-negative integer")
        raw_params = part.get("sampling_params") or {}
        specs.append(SequenceSpec(rid, list(seq), params, rlp, i if batched else None,
                                  stream_interval=raw_params.get("stream_interval"),
                                  return_routed_experts=wants_experts, routed_experts_start_len=experts_start,
                                  logprob_start_len=start if rlp and start is not None and start >= 0 else None,
                                  top_logprobs_num=top if rlp else 0))
    return EngineRequest(specs, stream, batched)

