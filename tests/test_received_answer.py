"""The manager's answer as the trainer plugin reads it (``sglang.answer.ReceivedAnswer``): decoded from the JSON
the manager encodes (``rollout.answers``), field for field, and a malformed answer refused naming its field."""

from __future__ import annotations

from typing import Any

import pytest

from rollout_manager import jsonutil
from rollout_manager.rollout.answers import final_output
from rollout_manager.rollout.batch import BatchLine, _ndjson_line
from rollout_manager.rollout.sequence import Segment
from rollout_manager.sglang.answer import ReceivedAnswer, ReceivedSegment
from rollout_manager.sglang.finish import NO_META, FinalMeta, FinishReason
from rollout_manager.sglang.generate_request import SequenceBody
from rollout_manager.sglang.routed_experts import encode

SEGMENTS = [Segment("a", "h:1", "6", 0, 1, "failed: reset"), Segment("b", "h:2", None, 1, 2, "finished")]


def encoded(**overrides: Any) -> dict[str, Any]:
    """A final answer as callers get it: built by the manager, encoded and decoded as JSON."""
    kwargs: dict[str, Any] = dict(rid="q", output_ids=[1, 2], logprobs=[[-0.1, 1, None], [None, 2, None]],
                                  finish=FinishReason.of("stop", matched=2), engine_meta=NO_META, segments=SEGMENTS,
                                  text="ab", e2e_latency=0.5, index=None)
    body = overrides.pop("body", {"input_ids": [5], "return_logprob": True})
    kwargs.update(overrides)
    return jsonutil.loads(jsonutil.dumps(final_output(SequenceBody.of(body), **kwargs)))


def test_the_managers_answer_decodes_field_for_field() -> None:
    out = ReceivedAnswer.from_json(encoded(experts=encode(bytes(8))))
    assert out.rid == "q" and out.output_ids == (1, 2) and out.text == "ab" and out.index is None
    assert out.finish == FinishReason.of("stop", matched=2) and out.finish_type == "stop"
    assert out.prompt_tokens == 1 and out.completion_tokens == 2 and out.e2e_latency == 0.5
    assert out.token_logprobs == (-0.1, None)
    assert out.segments == (ReceivedSegment("a", "h:1", "6", 0, 1, "failed: reset"),
                            ReceivedSegment("b", "h:2", None, 1, 2, "finished"))
    assert [s.to_json() for s in out.segments] == [s.to_dict() for s in SEGMENTS]  # verl gets the manager's dicts
    assert out.weight_version is None and out.weight_versions == ["6", None]
    assert out.routed_experts == "AAAAAAAAAAA="


def test_an_answer_without_segments_or_log_probs_reads_the_engines_version() -> None:
    out = ReceivedAnswer.from_json(encoded(body={"input_ids": [5]}, segments=[], index=3,
                                           engine_meta=FinalMeta(weight_version=7)))
    assert out.token_logprobs == () and out.segments == () and out.routed_experts is None
    assert out.weight_version == "7" and out.weight_versions == ["7"] and out.index == 3


def test_a_batch_lines_data_decodes_like_a_generate_answer() -> None:
    answer = final_output(SequenceBody.of({"input_ids": [5]}), rid="q", output_ids=[4], logprobs=[],
                          finish=FinishReason.of("length"), engine_meta=NO_META, segments=SEGMENTS[:1], text=None,
                          e2e_latency=0.25, index=None)
    line = jsonutil.loads(_ndjson_line(BatchLine("req-1", True, answer)))
    out = ReceivedAnswer.from_json(line["data"])
    assert out.output_ids == (4,) and out.finish_type == "length" and out.weight_versions == ["6"]


def test_fields_left_out_read_as_none() -> None:
    out = ReceivedAnswer.from_json({"output_ids": [1], "meta_info": {"id": "r"}})
    assert out.rid == "r" and out.finish is None and out.finish_type is None and out.weight_versions == [None]
    assert ReceivedAnswer.from_json({"output_ids": None, "meta_info": None}).output_ids == ()


@pytest.mark.parametrize(("answer", "field"), [
    ([], "the answer is list"),
    ({"meta_info": []}, "meta_info is list"),
    ({"output_ids": "12"}, "output_ids is str"),
    ({"output_ids": [1, "2"]}, "output_ids holds"),
    ({"output_ids": [True]}, "output_ids holds"),
    ({"meta_info": {"prompt_tokens": "3"}}, "meta_info.prompt_tokens is str"),
    ({"meta_info": {"completion_tokens": 2.0}}, "meta_info.completion_tokens is float"),
    ({"meta_info": {"output_token_logprobs": [["x", 1, None]]}}, r"output_token_logprobs\[0\]\[0\] is str"),
    ({"meta_info": {"output_token_logprobs": [-0.1]}}, r"output_token_logprobs\[0\] is not"),
    ({"meta_info": {"segments": [{"start": 0}]}}, r"meta_info.segments\[0\] has no start or no end"),
    ({"meta_info": {"segments": [{"start": 0, "end": 1, "endpoint": 5}]}}, r"segments\[0\].endpoint is int"),
    ({"meta_info": {"finish_reason": "stop"}}, "not an object"),
    ({"meta_info": {"routed_experts": [[1]]}}, "meta_info.routed_experts is list, not base64 text"),
])
def test_a_malformed_answer_is_refused_naming_its_field(answer: Any, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ReceivedAnswer.from_json(answer)
