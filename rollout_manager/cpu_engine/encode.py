"""The CPU engine's encoders of SGLang's output: ``/generate`` output objects and ``/metrics`` text.

Spelled as SGLang 0.5.x spells them (:mod:`rollout_manager.sglang.wire` holds the contract's names), so the
stand-in is held to the format the manager decodes.
"""

from __future__ import annotations

from typing import Any


def logprob_entry(logprob: float | None, token_id: int) -> list[Any]:
    """One ``output_token_logprobs`` (or ``input_token_logprobs``) entry: ``[logprob, token_id, text_or_null]``
    (the first input token's log-prob is null: nothing predicts it)."""
    return [None if logprob is None else float(logprob), int(token_id), None]


def output_chunk(
    *,
    rid: str,
    output_ids: list[int],
    prompt_tokens: int,
    completion_tokens: int,
    finish: dict[str, Any] | None,
    weight_version: str,
    logprobs: list[list[Any]] | None = None,
    input_logprobs: list[list[Any]] | None = None,
    text: str | None = None,
    index: int | None = None,
    e2e_latency: float | None = None,
    top_logprobs: list[list[list[Any]]] | None = None,
) -> dict[str, Any]:
    """One ``/generate`` output object (a stream chunk, or the whole non-streaming answer)."""
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": finish,
        "prompt_tokens": prompt_tokens,
        "weight_version": weight_version,
        "completion_tokens": completion_tokens,
        "cached_tokens": 0,
    }
    if logprobs is not None:
        meta["output_token_logprobs"] = logprobs
    if input_logprobs is not None:
        meta["input_token_logprobs"] = input_logprobs
    if top_logprobs is not None:  # SGLang's output_top_logprobs: per output token, [[logprob, id, null], ...]
        meta["output_top_logprobs"] = top_logprobs
    if e2e_latency is not None:
        meta["e2e_latency"] = e2e_latency
    out: dict[str, Any] = {"text": text, "output_ids": output_ids, "meta_info": meta}
    if index is not None:
        out["index"] = index
    return out


def metrics_text(values: dict[str, float], *, model_name: str) -> str:
    """Prometheus text exposition of gauges named like SGLang's (``sglang:...``)."""
    label = model_name.replace("\\", "\\\\").replace('"', '\\"')
    lines = []
    for name, value in values.items():
        lines.append(f"# TYPE {name} gauge")
        lines.append(f'{name}{{model_name="{label}"}} {float(value)}')
    return "\n".join(lines) + "\n"
