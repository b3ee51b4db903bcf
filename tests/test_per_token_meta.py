"""Per-token meta_info lists (top log-probs, token-id log-probs) gathered over every chunk, as the tokens are:
SGLang's incremental streams carry each chunk's own entries, cumulative ones repeat them all."""

from __future__ import annotations

from typing import Any

from rollout_manager.rollout.answers import final_output
from rollout_manager.rollout.progress import SequenceProgress
from rollout_manager.sglang.finish import FinishReason
from rollout_manager.sglang.generate_request import SequenceBody
from rollout_manager.sglang.wire import GenerateChunk


def chunk(ids: list[int], total: int, tops: list[Any], finish: Any = None) -> dict[str, Any]:
    return {"output_ids": ids, "meta_info": {"completion_tokens": total, "finish_reason": finish,
                                             "output_top_logprobs": tops, "output_token_ids_logprobs": tops}}


def top(t: int) -> list[list[Any]]:
    return [[-0.5, t, None], [-1.5, t + 1, None]]


def test_incremental_chunks_are_gathered() -> None:
    progress = SequenceProgress()
    progress.apply(GenerateChunk.of(chunk([1, 2], 2, [top(1), top(2)])))
    progress.apply(GenerateChunk.of(chunk([3], 3, [top(3)], {"type": "length"})))
    for key in ("output_top_logprobs", "output_token_ids_logprobs"):
        assert progress.per_token[key] == [top(1), top(2), top(3)]


def test_cumulative_chunks_and_a_second_segment() -> None:
    gathered: dict[str, list[Any]] = {}
    first = SequenceProgress(per_token=gathered)
    first.apply(GenerateChunk.of(chunk([1], 1, [top(1)])))
    first.apply(GenerateChunk.of(chunk([1, 2], 2, [top(1), top(2)])))  # cumulative: repeats the first
    second = SequenceProgress(per_token=gathered)  # continued elsewhere: its chunks count from 0
    second.apply(GenerateChunk.of(chunk([3, 4], 2, [top(3), top(4)], {"type": "length"})))
    assert gathered["output_top_logprobs"] == [top(1), top(2), top(3), top(4)]
    body = {"input_ids": [9], "sampling_params": {"sampling_seed": 5}}
    out = final_output(SequenceBody.of(body), rid="r", output_ids=[1, 2, 3, 4], logprobs=[],
                            finish=FinishReason("length"), engine_meta=second.final, segments=[], text=None,
                            e2e_latency=0.1, index=None,
                            per_token=gathered).to_json()
    assert out["meta_info"]["output_top_logprobs"] == gathered["output_top_logprobs"]
    assert out["meta_info"]["sampling_seed"] == 5
