"""The typed answer (``rollout.answers.Answer``) encodes to what the dict builders it replaced produced, key for key."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from rollout_manager import jsonutil
from rollout_manager.rollout.answers import final_answer, final_output, partial_answer
from rollout_manager.rollout.batch import BatchLine, _ndjson_line
from rollout_manager.rollout.progress import SequenceProgress, as_list, token_array
from rollout_manager.rollout.sequence import Segment, SequenceState
from rollout_manager.sglang.finish import FinalMeta, FinishReason
from rollout_manager.sglang.generate_request import SequenceBody
from rollout_manager.sglang.wire import GenerateChunk

# ---- the dict builders as they were before answers were typed (the reference; not product code)


def old_partial_answer(seq: SequenceState, index: int | None) -> dict[str, Any]:
    body, output_ids = seq.body, seq.output_ids
    meta: dict[str, Any] = {"id": seq.rid, "finish_reason": None, "prompt_tokens": len(body.input_ids),
                            "weight_version": str(seq.segments[-1].weight_version) if seq.segments else "",
                            "completion_tokens": len(output_ids), "cached_tokens": 0}
    if body.wants_logprobs:
        meta["output_token_logprobs"] = list(seq.logprobs)
    meta.update({k: list(v) for k, v in seq.per_token.items()})  # as SGLang's own chunks carry them
    out: dict[str, Any] = {"text": seq.known_text(seq.live_text), "output_ids": as_list(output_ids), "meta_info": meta}
    if index is not None:
        out["index"] = index
    return out


def old_final_output(body: SequenceBody, *, rid: str, output_ids: Sequence[int], logprobs: list[list[Any]],
                     finish: dict[str, Any] | None, engine_meta: dict[str, Any], segments: Sequence[Segment],
                     text: str | None, e2e_latency: float, index: int | None,
                     per_token: dict[str, list[Any]] | None = None, seed: Any = None) -> dict[str, Any]:
    meta = dict(engine_meta)
    spans = [s.to_dict() for s in segments]
    meta.update({
        "id": rid, "finish_reason": finish, "prompt_tokens": len(body.input_ids), "completion_tokens": len(output_ids),
        "weight_version": segments[-1].weight_version if segments else meta.get("weight_version"),
        "e2e_latency": round(e2e_latency, 6), "segments": spans,
    })
    if "weight_versions" in meta:
        vs: list[dict[str, Any]] = []
        for s in spans:
            if vs and vs[-1]["version"] == s["weight_version"] and vs[-1]["end"] == s["start"]:
                vs[-1]["end"] = s["end"]
            else:
                vs.append({"version": s["weight_version"], "start": s["start"], "end": s["end"]})
        meta["weight_versions"] = vs
    if body.wants_logprobs:
        meta["output_token_logprobs"] = logprobs
    else:
        meta.pop("output_token_logprobs", None)
    meta.update(per_token or {})
    if seed is None:
        seed = body.sampling.sampling_seed
    if seed is not None:
        meta["sampling_seed"] = seed
    out: dict[str, Any] = {"text": text, "output_ids": as_list(output_ids), "meta_info": meta}
    if index is not None:
        out["index"] = index
    return out


def old_rebase(finish: dict[str, Any] | None, start: int) -> dict[str, Any] | None:
    if isinstance(finish, dict) and finish.get("type") == "length" and isinstance(finish.get("length"), int):
        return {**finish, "length": finish["length"] + start}
    return finish


def old_final_answer(seq: SequenceState, index: int | None, latency: float, engine_meta: dict[str, Any],
                     start: int) -> dict[str, Any]:
    """``engine_meta``: the final chunk's meta_info as the engine sent it, of a request ``start`` tokens in."""
    texts = [t for t in seq.texts if t is not None]
    text = "".join(texts) if seq.texts and len(texts) == len(seq.texts) else None
    out = old_final_output(seq.body, rid=seq.rid, output_ids=seq.output_ids, logprobs=seq.logprobs,
                           finish=old_rebase(engine_meta["finish_reason"], start), engine_meta=engine_meta,
                           segments=seq.segments, text=text, e2e_latency=latency, index=index,
                           per_token=seq.per_token, seed=seq.seed)
    if seq.discarded:
        out["meta_info"]["discarded_segments"] = [s.to_dict() for s in seq.discarded]
    return out


# ---- a sequence that uses every field the manager sets


STOP_9 = {"type": "stop", "matched": 9}
START = 3  # the finishing request continued the sequence 3 tokens in (its segment is 3..5)
# finish_reasons as SGLang 0.5.23 sends them (BaseFinishReason.to_json; the tokenizer manager's abort), and
# ones of shapes it does not send: each is said back key for key (a length one counted over the sequence).
FINISHES: list[dict[str, Any]] = [
    STOP_9, {"type": "stop", "matched": "</s>"}, {"type": "stop", "matched": [9, 10]},
    {"type": "stop", "matched": None}, {"type": "length", "length": 2},
    {"type": "abort", "message": "Abort in waiting queue"},
    {"type": "abort", "message": "too long", "status_code": 400, "err_type": "BadRequestError"},
    {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None},  # (the first 8: SGLang's)
    {"type": "length", "length": "2"}, {"type": "length"},
    {"err_type": 5, "type": "stop", "matched": [9, "x"], "other": {"a": 1}, "new": None},
    {"type": "evicted", "message": 7},
]


SGLANG_SHAPES = 8


def engine_meta(finish: dict[str, Any]) -> dict[str, Any]:
    """The finishing engine's meta_info: its own fields, and some the manager overrides."""
    return {
        "id": "rm-7~2", "finish_reason": finish, "prompt_tokens": 10, "completion_tokens": 2,
        "weight_version": "7", "weight_versions": [{"version": "7", "start": 0, "end": 2}], "cached_tokens": 8,
        "e2e_latency": 0.5, "output_token_logprobs": [[-0.1, 4, None], [-0.1, 9, None]], "spec_verify_ct": 0,
        "output_top_logprobs": [[[-0.1, 4, None]], [[-0.1, 9, None]]], "sampling_seed": 11, "hidden_states": None,
        "queue_time": 0.01,
    }


def finish_from(seq: SequenceState, meta: dict[str, Any]) -> None:
    """Fold the final chunk in and keep what the generator keeps of it (``Generator._carry_out``)."""
    progress = SequenceProgress()
    progress.apply(GenerateChunk.of({"output_ids": [4, 9], "meta_info": meta}))
    assert progress.finish is not None
    seq.finish, seq.meta = progress.finish.rebased(START), progress.final


def finished_sequence(wants_logprobs: bool = True, meta: dict[str, Any] | None = None) -> SequenceState:
    body = SequenceBody.of({"input_ids": [5, 6, 7], "return_logprob": wants_logprobs, "top_logprobs_num": 1,
                            "sampling_params": {"max_new_tokens": 5, "stop_token_ids": [9]}})
    seq = SequenceState(body=body, rid="rm-7")
    seq.output_ids.extend(token_array([1, 2, 3, 4, 9]))
    seq.logprobs.extend([[-0.1, t, None] for t in (1, 2, 3, 4, 9)])
    seq.per_token["output_top_logprobs"] = [[[-0.1, t, None]] for t in (1, 2, 3, 4, 9)]
    seq.texts.extend(["ab", "c", "d!"])
    seq.segments.extend([Segment("a", "h:1", "6", 0, 2, "failed: cut"), Segment("b", "h:2", "6", 2, 3, "migrated"),
                         Segment("b", "h:2", "7", 3, 5, "finished")])
    seq.discarded = (Segment("c", "h:3", "3", 0, 4, "discarded: stale"),)
    finish_from(seq, engine_meta(STOP_9) if meta is None else meta)
    return seq


@pytest.mark.parametrize("wants_logprobs", [True, False])
@pytest.mark.parametrize("index", [None, 0, 3])
def test_a_final_answer_encodes_as_the_dict_builder_did(wants_logprobs: bool, index: int | None) -> None:
    meta = engine_meta(STOP_9)
    seq = finished_sequence(wants_logprobs, meta)
    want = old_final_answer(seq, index, 1.23456789, meta, START)
    kept = seq.meta
    got = jsonutil.loads(jsonutil.dumps(final_answer(seq, index, 1.23456789)))
    assert got == want
    assert got["meta_info"]["finish_reason"] == {"type": "stop", "matched": 9}
    assert got["meta_info"]["weight_versions"] == [{"version": "6", "start": 0, "end": 3},
                                                   {"version": "7", "start": 3, "end": 5}]
    assert ("index" in got) == (index is not None) and got["meta_info"]["spec_verify_ct"] == 0
    assert ("output_token_logprobs" in got["meta_info"]) == wants_logprobs
    # Neither the engine's dict nor what the sequence keeps of it is changed by an answer.
    assert meta == engine_meta(STOP_9) and seq.meta is kept and kept == FinalMeta.from_json(meta)
    assert "segments" not in kept.other and "sampling_seed" in kept.other


@pytest.mark.parametrize("finish", FINISHES)
def test_each_finish_reason_encodes_as_the_engine_said_it(finish: dict[str, Any]) -> None:
    meta = engine_meta(finish)
    seq = finished_sequence(True, meta)
    got = jsonutil.loads(jsonutil.dumps(final_answer(seq, None, 0.5)))
    assert got == old_final_answer(seq, None, 0.5, meta, START)
    rebased = finish["type"] == "length" and type(finish.get("length")) is int
    want = {**finish, "length": finish["length"] + START} if rebased else finish
    assert got["meta_info"]["finish_reason"] == want
    if FINISHES.index(finish) < SGLANG_SHAPES:  # SGLang's own shapes come back in SGLang's key order too
        assert list(got["meta_info"]["finish_reason"]) == list(want)
    assert FinishReason.from_json(finish).to_json() == finish  # decoded and said back, key for key


def test_a_batch_line_and_a_stream_chunk_encode_as_before() -> None:
    seq = finished_sequence()
    line = _ndjson_line(BatchLine("req-1", True, [final_answer(seq, 0, 0.5), final_answer(seq, 1, 0.5)]))
    olds = [old_final_answer(seq, i, 0.5, engine_meta(STOP_9), START) for i in (0, 1)]
    assert line.endswith(b"\n") and jsonutil.loads(line) == {"id": "req-1", "success": True, "data": olds}
    failed = _ndjson_line(BatchLine.failed(["x", 2], 503, "no instance"))
    assert jsonutil.loads(failed) == {"id": ["x", 2], "success": False, "status_code": 503, "error": "no instance"}
    seq.finish, seq.live_text = None, "e"
    for index in (None, 2):
        chunk, want = partial_answer(seq, index), old_partial_answer(seq, index)
        seq.output_ids.append(11)  # the sequence goes on: a chunk already built does not change
        seq.logprobs.append([-0.2, 11, None])
        assert jsonutil.loads(jsonutil.dumps(chunk)) == want
        assert want["meta_info"]["output_token_logprobs"] and want["text"] == "abcd!e"
        assert want["meta_info"]["output_top_logprobs"]  # the per-token lists, as SGLang's own chunks carry them


def test_engine_fields_pass_through_where_the_manager_sets_nothing() -> None:
    """Without segments, a seed or per-token lists the engine's version, seed and lists are what callers get."""
    body = SequenceBody.of({"input_ids": [1], "return_logprob": False})
    engine = {"weight_version": 4, "sampling_seed": 3, "output_top_logprobs": [1], "output_token_logprobs": [[0]],
              "cached_tokens": 1}
    finish = {"type": "length", "length": 1}
    kwargs: dict[str, Any] = {"rid": "r", "output_ids": [2], "logprobs": [], "segments": [], "text": None,
                              "e2e_latency": 0.0, "index": None}
    got = jsonutil.loads(jsonutil.dumps(final_output(body, finish=FinishReason.from_json(finish),
                                                     engine_meta=FinalMeta.from_json(engine), **kwargs)))
    assert got == old_final_output(body, finish=finish, engine_meta=engine, **kwargs)
    assert got["meta_info"]["weight_version"] == 4 and got["meta_info"]["sampling_seed"] == 3
    assert "output_token_logprobs" not in got["meta_info"]
