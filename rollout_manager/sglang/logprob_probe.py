"""The trust probe's wire format: a short fixed prompt sent as a prefill with per-token log-probs.

SGLang 0.5.23 answers ``return_logprob`` with ``logprob_start_len`` 0 with ``meta_info.input_token_logprobs``:
one ``[logprob, token_id, text_or_null]`` entry per input token, the first one's log-prob null (nothing
predicts it; ``SchedulerLogprobResultProcessor._process_input_token_logprobs`` prepends it). Those numbers are
a function of the weights the box serves and nothing else the manager sends, so boxes at one weight version
must agree on them within their arithmetic's noise: a box that does not serves other weights.
``max_new_tokens`` is 1, not 0: a request that may make no token is finished by the CPU engine before any
forward, and SGLang computes the prompt's log-probs in the same prefill either way.

SGLang 0.5.23 does not refuse an input id past its embedding table: its scheduler dies on it (an
``IndexError`` in the embedding) and takes the server down. So the probe's ids are spread below a rung of
:data:`ID_RUNGS` no higher than the ids the box is known to take (:func:`probe_limit`); boxes that know the
same rung get the same prompt, and are compared with each other.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import aiohttp

from rollout_manager.sglang import wire

PROBE_TOKENS = 32  # prompt length: one short prefill
PROBE_RID_PREFIX = "rollout-manager-probe-"
# The limits a probe prompt's ids are spread below: powers of two, then 32,000 (ordinary tokens in every
# tokenizer we know). Few rungs, so that boxes learning their vocabulary from what they serve soon share one.
ID_RUNGS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32000)


class ProbeFailed(Exception):
    """The box gave no usable answer to the probe (unreachable, an error status, or no log-probs)."""


def is_probe(body: object) -> bool:
    """Whether a ``/generate`` body is the trust probe (by its rid): the CPU engine and the test fakes leave
    it out of their fault injection and request counts, as they do health probes."""
    rid = body.get("rid") if isinstance(body, dict) else None
    return isinstance(rid, str) and rid.startswith(PROBE_RID_PREFIX)


def probe_limit(known: int) -> int | None:
    """The highest rung at or below ``known`` (every id below ``known`` is safe to send): the probe prompt's
    ids stay below it. None below the lowest rung: no probe can be sent yet."""
    fitting = [rung for rung in ID_RUNGS if rung <= known]
    return fitting[-1] if fitting else None


def probe_ids(limit: int, length: int = PROBE_TOKENS) -> list[int]:
    """The fixed prompt for a rung ``limit`` (:func:`probe_limit`): distinct ids spread below it."""
    return [(7 + 131 * i) % limit for i in range(length)]


def probe_body(ids: list[int], rid: str) -> dict[str, Any]:
    """A non-streaming greedy ``/generate`` of one token that returns every input token's log-prob."""
    return {"input_ids": ids, "rid": rid, "stream": False, "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}


def parse_input_logprobs(answer: Any, ids: list[int]) -> list[float]:
    """The log-prob of each input token after the first, from the answer to :func:`probe_body`. Raises
    :class:`ProbeFailed` when the answer does not carry them for exactly ``ids``."""
    meta = answer.get("meta_info") if isinstance(answer, dict) else None
    entries = meta.get("input_token_logprobs") if isinstance(meta, dict) else None
    if not isinstance(entries, list) or len(entries) != len(ids):
        got = len(entries) if isinstance(entries, list) else "none"
        raise ProbeFailed(f"the answer carries {got} input_token_logprobs for {len(ids)} input tokens")
    values: list[float] = []
    for i, (entry, token) in enumerate(zip(entries, ids)):
        if not isinstance(entry, (list, tuple)) or len(entry) < 2 or entry[1] != token:
            raise ProbeFailed(f"input_token_logprobs[{i}] is {entry!r}, not an entry for token {token}")
        if i == 0:
            continue  # null: nothing predicts the first token
        value = entry[0]
        if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
            raise ProbeFailed(f"input_token_logprobs[{i}] holds {value!r}, not a log-prob")
        values.append(float(value))
    return values


async def prefill_logprobs(session: aiohttp.ClientSession, base_url: str, ids: list[int], rid: str,
                           headers: dict[str, str], timeout_s: float) -> list[float]:
    """Send the probe to one box; its input tokens' log-probs (see :func:`parse_input_logprobs`)."""
    try:
        async with session.post(base_url + wire.GENERATE, json=probe_body(ids, rid), headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                raise ProbeFailed(f"{wire.GENERATE} answered HTTP {resp.status}: {(await resp.text())[:200]}")
            answer = await resp.json(content_type=None)
    except asyncio.TimeoutError:
        raise ProbeFailed(f"no answer within {timeout_s:g}s") from None
    except (aiohttp.ClientError, ValueError) as exc:
        raise ProbeFailed(f"{type(exc).__name__}: {exc}") from None
    return parse_input_logprobs(answer, ids)
