"""SGLang's wire format as the manager decodes it: frames, chunk modes, errors, continuation bodies."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_manager.cpu_engine.encode import output_chunk
from rollout_manager.rollout.answers import final_output, partial_output
from rollout_manager.rollout.progress import BadChunk, SequenceProgress
from rollout_manager.rollout.sequence import Segment
from rollout_manager.sglang import wire
from rollout_manager.sglang.finish import NO_META, FinalMeta, FinishReason
from rollout_manager.sglang.generate_request import SequenceBody
from rollout_manager.sglang.sse import ChunkDecoder, SSEDecoder, StreamError, sse_frame
from rollout_manager.sglang.wire import GenerateChunk


def chunk(ids: list[int], total: int, finish: Any = None,
          lps: list[list[Any]] | None = None) -> dict[str, Any]:
    return output_chunk(rid="r", output_ids=ids, prompt_tokens=3, completion_tokens=total,
                             finish=finish, weight_version="7", logprobs=lps)


def test_decoder_handles_frames_split_anywhere_and_done() -> None:
    frames = sse_frame(chunk([1], 1)) + sse_frame(chunk([1, 2], 2)) + wire.DONE_FRAME
    for cut in range(1, len(frames)):
        dec = SSEDecoder()
        got = dec.feed(frames[:cut]) + dec.feed(frames[cut:])
        assert [c["output_ids"] for c in got] == [[1], [1, 2]] and dec.done


def test_error_frame_raises_stream_error_with_the_message() -> None:
    dec = SSEDecoder()
    with pytest.raises(StreamError, match="too long"):
        dec.feed(sse_frame(wire.error_object("input too long")))


def test_progress_folds_cumulative_and_incremental_chunks_alike() -> None:
    lp = [[-0.1, 1, None], [-0.2, 2, None], [-0.3, 3, None]]
    cumulative, incremental = SequenceProgress(), SequenceProgress()
    for k in (1, 2, 3):
        assert cumulative.apply(GenerateChunk.of(chunk([1, 2, 3][:k], k, lps=lp[:k]))) == 1
        assert incremental.apply(GenerateChunk.of(chunk([[1, 2, 3][k - 1]], k, lps=[lp[k - 1]]))) == 1
    for p in (cumulative, incremental):
        assert p.output_ids.tolist() == [1, 2, 3] and p.logprobs == lp
    # A cumulative chunk that repeats what was seen brings nothing new.
    last = GenerateChunk.of(chunk([1, 2, 3], 3, finish=wire.finish_reason(wire.LENGTH, length=3)))
    assert cumulative.apply(last) == 0
    assert cumulative.finish == FinishReason("length", length=3)
    assert cumulative.final == FinalMeta(weight_version="7", other={"cached_tokens": 0})


def test_split_batch_keeps_per_item_fields() -> None:
    body = {"input_ids": [[1], [2]], "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 2}],
            "return_logprob": True, "rid": ["a", "b"]}
    a, b = wire.split_batch(body)
    assert a == {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}, "return_logprob": True, "rid": "a"}
    assert b["sampling_params"] == {"max_new_tokens": 2} and b["rid"] == "b"


def test_split_batch_names_items_of_a_string_rid_as_sglang_does() -> None:
    # SGLang's GenerateReqInput._normalize_rid: a string rid for n items becomes rid_0 ... rid_{n-1}.
    parts = wire.split_batch({"input_ids": [[1], [2], [3]], "rid": "r"})
    assert [p["rid"] for p in parts] == ["r_0", "r_1", "r_2"]
    assert wire.split_batch({"input_ids": [1], "rid": "r"})[0]["rid"] == "r"


def test_an_abort_with_a_4xx_status_code_is_the_callers_error() -> None:
    refused = {"type": "abort", "message": "Input length (9 tokens) exceeds the maximum allowed length",
               "status_code": 400, "err_type": "BadRequestError"}  # FINISH_ABORT.to_json of the scheduler
    assert FinishReason.from_json(refused).caller_status == 400
    assert FinishReason.from_json({**refused, "status_code": 404}).caller_status == 404
    for not_callers in ({**refused, "status_code": None}, {**refused, "status_code": 503},
                        {"type": "abort", "message": "Abort"}, {**refused, "status_code": True},
                        {**refused, "type": "stop"}, wire.finish_reason(wire.LENGTH, length=3)):
        assert FinishReason.from_json(not_callers).caller_status is None


def test_update_weight_version_never_aborts_in_flight_requests() -> None:
    assert wire.update_weight_version_body(3) == {"new_version": "3", "abort_all_requests": False}


def test_progress_keeps_the_last_reported_weight_version_when_chunks_leave_it_out() -> None:
    p = SequenceProgress()
    p.apply(GenerateChunk.of(chunk([1], 1)))
    assert p.weight_version == "7"
    p.apply(GenerateChunk.of({"output_ids": [1, 2], "meta_info": {"completion_tokens": 2, "finish_reason": None}}))
    assert p.weight_version == "7" and p.output_ids.tolist() == [1, 2]


def test_an_engine_reads_the_token_budget_of_a_single_sequence_body() -> None:
    assert wire.token_budget({"input_ids": [1], "sampling_params": {"max_new_tokens": 5}}) == 5
    assert wire.token_budget({"input_ids": [1], "sampling_params": {"max_new_tokens": 0}}) == 0
    for params in (None, {}):
        assert wire.token_budget({"input_ids": [1], "sampling_params": params}) == wire.DEFAULT_MAX_NEW_TOKENS
    # null is no limit in SGLang (it stops at the context end), not its default of 128.
    assert wire.token_budget({"input_ids": [1], "sampling_params": {"max_new_tokens": None}}) is None


def test_finish_length_of_a_continued_request_counts_from_the_sequence_start() -> None:
    length = FinishReason.of(wire.LENGTH, length=6)
    assert length.rebased(4).to_json() == {"type": "length", "length": 10}
    assert length == FinishReason("length", length=6)  # the engine's is not modified
    assert length.rebased(0) == length
    # Only a numeric length moves; other reasons and an unknown length pass through.
    stop = FinishReason.of(wire.STOP, matched=2)
    assert stop.rebased(4) is stop
    for unknown in ({"type": "length", "length": None}, {"type": "length", "length": "6"}, {"type": "length"}):
        assert FinishReason.from_json(unknown).rebased(4).to_json() == unknown


def test_abort_is_recognised_with_its_message() -> None:
    aborted = FinishReason.of(wire.ABORT, message="Abort by pause_generation")
    assert aborted.is_abort and aborted.abort_message == "Abort by pause_generation"
    assert wire.finish_reason(wire.ABORT) == {"type": "abort", "message": "Abort"}
    no_message = FinishReason.from_json({"type": "abort", "message": None})
    assert no_message.abort_message == "{'type': 'abort', 'message': None}"
    for other in (FinishReason.of(wire.STOP), FinishReason.of(wire.LENGTH, length=1), FinishReason("Abort")):
        assert not other.is_abort


@pytest.mark.parametrize("finish", ["stop", "abort", 1, True, [], {}, {"type": None}, {"type": 3},
                                    {"message": "no type"}])
def test_a_finish_reason_that_is_not_an_object_with_a_type_is_a_bad_chunk(finish: Any) -> None:
    """SGLang sends an object with a string type (io_struct.FinishReasonDict) or null: from anything else
    the manager cannot tell whether the request ended on its own, so the chunk is refused, nothing kept."""
    p = SequenceProgress()
    p.apply(GenerateChunk.of(chunk([1], 1)))
    with pytest.raises(BadChunk, match="finish_reason"):
        p.apply(GenerateChunk.of(chunk([1, 2], 2, finish=finish)))
    assert p.output_ids.tolist() == [1] and p.finish is None and p.final is NO_META and p.chunks == 1


@pytest.mark.parametrize("error, message", [
    (wire.error_object("input too long"), "input too long"),  # SGLang's body
    ({"message": "bad rid"}, "bad rid"),  # the inner object alone (an error frame's payload)
    ({"error": "Request body must be a JSON object."}, "Request body must be a JSON object."),
    ({"error": {"type": "BadRequest"}}, "{'type': 'BadRequest'}"),
    ("plain text", "plain text"),
    (None, "None"),
])
def test_error_message_reads_sglang_error_bodies(error: Any, message: str) -> None:
    assert wire.error_message(error) == message


def test_final_output_covers_the_whole_sequence_and_keeps_the_engine_extras() -> None:
    body = {"input_ids": [5, 6, 7], "return_logprob": True}
    engine_meta = chunk([9], 3, finish=wire.finish_reason(wire.LENGTH, length=4),
                        lps=[[-0.5, 9, None]])["meta_info"]
    engine_meta["cached_tokens"] = 2
    segments = [Segment("a", "h:1", "6", 0, 2, "failed: x"), Segment("b", "h:2", "7", 2, 3, "finished")]
    lps = [[-0.1, 1, None], [-0.2, 2, None], [-0.5, 9, None]]
    out = final_output(SequenceBody.of(body), rid="caller", output_ids=[1, 2, 9], logprobs=lps,
                            finish=FinishReason.of(wire.LENGTH, length=3), engine_meta=FinalMeta.from_json(engine_meta),
                            segments=segments,
                            text=None, e2e_latency=1.23456789, index=2).to_json()
    meta = out["meta_info"]
    assert out["output_ids"] == [1, 2, 9] and out["text"] is None and out["index"] == 2
    assert meta["id"] == "caller" and meta["prompt_tokens"] == 3 and meta["completion_tokens"] == 3
    assert meta["finish_reason"] == {"type": "length", "length": 3}
    assert meta["weight_version"] == "7" and meta["segments"] == [s.to_dict() for s in segments]
    assert meta["output_token_logprobs"] == lps and meta["e2e_latency"] == 1.234568
    assert meta["cached_tokens"] == 2  # passed through from the engine
    assert engine_meta["id"] == "r" and "segments" not in engine_meta  # the engine's dict is not changed
    # Without return_logprob the engine's log-probs are dropped; without segments its version stays.
    plain = final_output(SequenceBody.of({"input_ids": [5]}), rid="x", output_ids=[], logprobs=[], finish=None,
                         engine_meta=FinalMeta.from_json(engine_meta), segments=[], text="", e2e_latency=0.0,
                         index=None).to_json()
    assert "output_token_logprobs" not in plain["meta_info"] and "index" not in plain
    assert plain["meta_info"]["weight_version"] == "7"


def test_partial_output_is_cumulative_and_unfinished() -> None:
    lps = [[-0.1, 1, None]]
    out = partial_output(SequenceBody.of({"input_ids": [5, 6], "return_logprob": True}), rid="r", output_ids=[1],
                         logprobs=lps, weight_version="3", index=None).to_json()
    assert out == output_chunk(rid="r", output_ids=[1], prompt_tokens=2, completion_tokens=1, finish=None,
                                    weight_version="3", logprobs=lps)
    no_lp = partial_output(SequenceBody.of({"input_ids": [5]}), rid="r", output_ids=[1], logprobs=lps,
                           weight_version="3", index=1).to_json()
    assert "output_token_logprobs" not in no_lp["meta_info"] and no_lp["index"] == 1


def test_per_item_keys_cover_what_split_batch_splits() -> None:
    assert set(wire.PER_ITEM_KEYS) == {"sampling_params", "return_logprob", "rid"}
    body: dict[str, Any] = {"input_ids": [[1], [2]], "return_logprob": [True, False]}
    a, b = wire.split_batch(body)
    assert a["return_logprob"] is True and b["return_logprob"] is False


# ---------------------------------------------------------------- cumulative chunks parsed by their news


def _stream(tokens: list[int], cuts: list[int], *, cumulative: bool, lps: list[list[Any]] | None,
            text: bool) -> bytes:
    """The frames an engine sends for ``tokens``, one chunk ending at each of ``cuts``."""
    frames, sent = [], 0
    for end in cuts:
        lo = 0 if cumulative else sent
        frames.append(sse_frame(output_chunk(
            rid="r", output_ids=tokens[lo:end], prompt_tokens=2, completion_tokens=end,
            finish=wire.finish_reason(wire.LENGTH, length=end) if end == len(tokens) else None,
            weight_version="1", logprobs=None if lps is None else lps[lo:end],
            text="".join(f"<{t}>" for t in tokens[lo:end]) if text else None)))
        sent = end
    return b"".join(frames) + wire.DONE_FRAME


def _fold(raw: bytes, pieces: int, *, skip_seen: bool,
          start: tuple[list[int], list[list[Any]]] = ([], [])) -> tuple[SequenceProgress, list[Any]]:
    dec: ChunkDecoder | SSEDecoder = ChunkDecoder() if skip_seen else SSEDecoder()
    progress = SequenceProgress(list(start[0]), list(start[1]))
    step = max(1, len(raw) // pieces)
    chunks = []
    for at in range(0, len(raw), step):
        for c in dec.feed(raw[at:at + step]):
            c = c if isinstance(c, GenerateChunk) else GenerateChunk.of(c)
            chunks.append(c)
            progress.apply(c)
    assert dec.done
    return progress, chunks


@given(
    tokens=st.lists(st.integers(0, 300), min_size=1, max_size=60),
    data=st.data(),
    cumulative=st.booleans(),
    with_lps=st.sampled_from(["none", "numbers", "text"]),
    pieces=st.integers(1, 40),
)
@settings(max_examples=150, deadline=None)
def test_skipping_seen_ids_folds_exactly_what_a_full_parse_does(
        tokens: list[int], data: st.DataObject, cumulative: bool, with_lps: str, pieces: int) -> None:
    n = len(tokens)
    cuts = sorted(set(data.draw(st.lists(st.integers(1, n), max_size=12)) + [n]))
    lps = None if with_lps == "none" else [
        [-(t % 7) / 8, t, f"t{t}]]," if with_lps == "text" else None] for t in tokens]
    raw = _stream(tokens, cuts, cumulative=cumulative, lps=lps, text=True)
    base = ([9, 9], [[-1.0, 9, None]] * 2 if lps is not None else [])  # an earlier segment's tokens
    fast, _ = _fold(raw, pieces, skip_seen=True, start=base)
    full, _ = _fold(raw, 1, skip_seen=False, start=base)
    assert fast.output_ids.tolist() == full.output_ids.tolist() == base[0] + tokens
    assert fast.logprobs == full.logprobs == base[1] + (lps or [])
    assert fast.text == full.text == "".join(f"<{t}>" for t in tokens)
    assert fast.finish == full.finish == FinishReason("length", length=n)


def test_a_cumulative_chunk_is_parsed_without_the_ids_already_seen() -> None:
    tokens = list(range(100, 164))
    lps = [[-0.5, t, None] for t in tokens]
    raw = _stream(tokens, [1, 16, 32, 48, 64], cumulative=True, lps=lps, text=False)
    progress, chunks = _fold(raw, 1, skip_seen=True)
    assert [len(c.ids) for c in chunks] == [1, 15, 16, 16, 16]
    assert [len(c.meta.logprobs) for c in chunks] == [1, 15, 16, 16, 16]
    assert progress.output_ids.tolist() == tokens and progress.logprobs == lps


def test_an_incremental_stream_that_repeats_a_prefix_is_not_mistaken_for_a_cumulative_one() -> None:
    # Deltas [5], [5, 6], [5, 6, 7]: each starts with the previous delta's bytes.
    tokens = [5, 5, 6, 5, 6, 7]
    raw = _stream(tokens, [1, 3, 6], cumulative=False, lps=None, text=False)
    progress, _ = _fold(raw, 3, skip_seen=True)
    assert progress.output_ids.tolist() == tokens
