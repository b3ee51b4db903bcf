"""OpenAI's response objects (chat completion, completion, their stream chunks, usage) from typed turn
results. Beside OpenAI's fields each choice carries ``token_ids`` (the ids sampled) and ``rollout``
(weight version, version spans, segments: which boxes made it), which the SDK keeps as extra fields."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

from rollout_manager import jsonutil
from rollout_manager.sglang.openai_turn import TurnResult


@dataclass(frozen=True)
class Reply:
    """What every object of one response shares."""

    id: str
    created: int
    model: str
    session_id: str | None


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def rollout_info(result: TurnResult) -> dict[str, Any]:
    out = {"weight_version": result.weight_version, "weight_versions": result.weight_versions,
           "segments": result.segments}
    if result.routed_experts is not None:  # R3, asked for: SGLang's base64 rows, as /generate answers them
        out["routed_experts"] = base64.b64encode(result.routed_experts).decode()
    return out


Tops = list[list[tuple[str, float]]]  # per sampled token: the most likely tokens' texts and log-probs


def chat_logprobs(tokens: list[str], logprobs: list[float | None], tops: Tops | None = None) -> dict[str, Any]:
    """``choices[i].logprobs`` of a chat answer; ``tops`` fills each token's ``top_logprobs``."""
    rows = tops if tops is not None else [[] for _ in tokens]
    return {"content": [{"token": t, "logprob": -9999.0 if lp is None else lp, "bytes": list(t.encode()),
                         "top_logprobs": [{"token": a, "logprob": alp, "bytes": list(a.encode())} for a, alp in row]}
                        for t, lp, row in zip(tokens, logprobs, rows)]}


def completion_logprobs(tokens: list[str], logprobs: list[float | None], offset: int = 0,
                        tops: Tops | None = None) -> dict[str, Any]:
    """``choices[i].logprobs`` of a text completion (``top_logprobs``: a dict per token, text -> log-prob)."""
    offsets, at = [], offset
    for t in tokens:
        offsets.append(at)
        at += len(t)
    top = None if tops is None else [dict(row) for row in tops]
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_choice(index: int, message: dict[str, Any], finish_reason: str | None, result: TurnResult,
                logprobs: dict[str, Any] | None) -> dict[str, Any]:
    """``message``: the assistant's (content and any ``tool_calls``); ``finish_reason`` as read with them."""
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason,
            "token_ids": result.output_ids, "rollout": rollout_info(result)}


def completion_choice(index: int, text: str, result: TurnResult, logprobs: dict[str, Any] | None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": result.finish_reason,
            "token_ids": result.output_ids, "rollout": rollout_info(result)}


def whole(reply: Reply, kind: str, choices: list[dict[str, Any]], prompt_ids: list[list[int]],
          prompt_tokens: int, completion_tokens: int, prompt_json: bytes | None = None) -> dict[str, Any]:
    """A non-streamed answer; ``kind`` is ``chat.completion`` or ``text_completion``. ``prompt_json``: the
    one prompt's ids already encoded (as they were for the engine)."""
    ids: Any = prompt_ids[0] if len(prompt_ids) == 1 else prompt_ids
    if prompt_json is not None and len(prompt_ids) == 1:
        ids = jsonutil.fragment(prompt_json)
    out: dict[str, Any] = {"id": reply.id, "object": kind, "created": reply.created, "model": reply.model,
                           "choices": choices, "usage": usage(prompt_tokens, completion_tokens),
                           "prompt_token_ids": ids}
    if reply.session_id is not None:
        out["session_id"] = reply.session_id
    return out


def chunk(reply: Reply, kind: str, choices: list[dict[str, Any]],
          usage_: dict[str, int] | None = None) -> dict[str, Any]:
    """A stream chunk; ``kind`` is ``chat.completion.chunk`` or ``text_completion``."""
    out: dict[str, Any] = {"id": reply.id, "object": kind, "created": reply.created, "model": reply.model,
                           "choices": choices}
    if usage_ is not None:
        out["usage"] = usage_
    return out
