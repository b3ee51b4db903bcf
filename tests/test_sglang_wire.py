"""SGLang's wire format as the manager decodes it: frames, chunk modes, errors, continuation bodies."""

from __future__ import annotations

import pytest

from rollout_manager.sglang import wire


def chunk(ids, total, finish=None, lps=None):
    return wire.output_chunk(rid="r", output_ids=ids, prompt_tokens=3, completion_tokens=total,
                             finish=finish, weight_version="7", logprobs=lps)


def test_decoder_handles_frames_split_anywhere_and_done():
    frames = wire.sse_frame(chunk([1], 1)) + wire.sse_frame(chunk([1, 2], 2)) + wire.DONE_FRAME
    for cut in range(1, len(frames)):
        dec = wire.SSEDecoder()
        got = dec.feed(frames[:cut]) + dec.feed(frames[cut:])
        assert [c["output_ids"] for c in got] == [[1], [1, 2]] and dec.done


def test_error_frame_raises_stream_error_with_the_message():
    dec = wire.SSEDecoder()
    with pytest.raises(wire.StreamError, match="too long"):
        dec.feed(wire.sse_frame(wire.error_object("input too long")))


def test_progress_folds_cumulative_and_incremental_chunks_alike():
    lp = [[-0.1, 1, None], [-0.2, 2, None], [-0.3, 3, None]]
    cumulative, incremental = wire.SequenceProgress(), wire.SequenceProgress()
    for k in (1, 2, 3):
        assert cumulative.apply(chunk([1, 2, 3][:k], k, lps=lp[:k])) == 1
        assert incremental.apply(chunk([[1, 2, 3][k - 1]], k, lps=[lp[k - 1]])) == 1
    for p in (cumulative, incremental):
        assert p.output_ids == [1, 2, 3] and p.logprobs == lp
    # A cumulative chunk that repeats what was seen brings nothing new.
    assert cumulative.apply(chunk([1, 2, 3], 3, finish=wire.finish_reason(wire.LENGTH, length=3))) == 0
    assert cumulative.finish_reason == {"type": "length", "length": 3}


def test_continuation_body_extends_prompt_and_shrinks_budgets_without_touching_the_original():
    body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 10, "min_new_tokens": 4,
                                                     "temperature": 0}, "return_logprob": True}
    new = wire.continuation_body(body, [7, 8, 9], rid="x~1")
    assert new["input_ids"] == [5, 6, 7, 8, 9]
    assert new["sampling_params"] == {"max_new_tokens": 7, "min_new_tokens": 1, "temperature": 0}
    assert new["stream"] is True and new["rid"] == "x~1" and new["return_logprob"] is True
    assert body["input_ids"] == [5, 6] and body["sampling_params"]["max_new_tokens"] == 10
    # SGLang's default budget applies when the caller gave none; never below zero.
    assert wire.continuation_body({"input_ids": [1]}, [2] * 3, rid="y")["sampling_params"] == {
        "max_new_tokens": wire.DEFAULT_MAX_NEW_TOKENS - 3}
    assert wire.continuation_body(body, list(range(12)), rid="z")["sampling_params"]["max_new_tokens"] == 0


def test_split_batch_keeps_per_item_fields():
    body = {"input_ids": [[1], [2]], "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 2}],
            "return_logprob": True, "rid": ["a", "b"]}
    a, b = wire.split_batch(body)
    assert a == {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}, "return_logprob": True, "rid": "a"}
    assert b["sampling_params"] == {"max_new_tokens": 2} and b["rid"] == "b"


def test_update_weight_version_never_aborts_in_flight_requests():
    assert wire.update_weight_version_body(3) == {"new_version": "3", "abort_all_requests": False}
