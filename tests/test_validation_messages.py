"""Validation messages (issue 16, bug 5): one message per real mistake, naming the field as the caller
wrote it; a body of the wrong shape is described as what it must be. In process: no daemon needed."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import BaseModel

from rollout_manager.api import schemas
from rollout_manager.api.http import validate
from rollout_manager.errors import ManagerError
from rollout_manager.rollout.request import decode, decode_items
from rollout_manager.weights.protocol import BadBody, CommitRequest, parse_body


def GEN(data: Any) -> Any:  # a generation body, checked by msgspec as the door does
    return decode(data)


def BATCH(data: Any) -> Any:
    return decode_items(data)


def message(model: type[BaseModel] | Any, data: Any) -> str:
    with pytest.raises(ManagerError) as info:
        model(data) if model in (GEN, BATCH) else validate(data, model)
    return str(info.value)


EXACT = [
    # the issue's own examples: an int item is not "a valid list", whatever the union's other branch says
    (GEN, {"input_ids": [-1, 2]}, "field 'input_ids[0]': Input should be greater than or equal to 0"),
    (GEN, {"input_ids": [1], "sampling_params": {"max_new_tokens": "4"}},
     "field 'sampling_params.max_new_tokens': Input should be a valid integer"),
    (GEN, {"input_ids": [[1], [-2]]}, "field 'input_ids[1][0]': Input should be greater than or equal to 0"),
    (GEN, {"input_ids": [[1], [2]], "sampling_params": [{}, {"max_new_tokens": -1}]},
     "field 'sampling_params[1].max_new_tokens': Input should be greater than or equal to 0"),
    (GEN, {"input_ids": [1], "return_logprob": "yes"}, "field 'return_logprob': Input should be a valid boolean"),
    (GEN, {"input_ids": [1], "rid": 5}, "field 'rid': Input should be a valid string"),
    (GEN, {"input_ids": [1], "sampling_params": 3}, "field 'sampling_params': Input should be a JSON object"),
    # a check across fields is about the body, and says so without a made-up field name
    (GEN, {"input_ids": [[1], [2]], "rid": ["a"]}, "'rid' has 1 items for 2 sequences"),
    # bodies of the wrong JSON type
    (GEN, [], "the body must be a JSON object"),
    (schemas.RegisterRolloutInstance, [1], "the body must be a JSON object"),
    (schemas.Empty, [1], "the body must be a JSON object"),
    (BATCH, {}, "the body must be a JSON list of [id, request] pairs"),
    (schemas.RegisterLocalRolloutInstances, {}, "the body must be a JSON list of [host, port] pairs"),
    # batches: the position as written, no union branch names
    (BATCH, [["a", {"input_ids": "x"}]], "field '[0][1].input_ids': Input should be a "
                                                                   "valid list"),
    (BATCH, [[1.5, {"input_ids": [1]}]],
     "field '[0][0]': Input should be a string or an integer"),
    (schemas.UpdateWeightVersion, {"wait_for_instances": "some"}, "field 'wait_for_instances': Input should be 'all'"),
    (schemas.UpdateWeightVersion, {"wait_for_instances": -1},
     "field 'wait_for_instances': Input should be greater than or equal to 0"),
    # the batch body's own shape
    (BATCH, [], "List should have at least 1 item after validation, not 0"),
    (BATCH, [{}], "field '[0]': Input should be a valid tuple"),
    (BATCH, [["a"]], "field '[0][1]': Field required"),
    (BATCH, [["a", {"input_ids": [1]}, 3]], "field '[0]': Tuple should have at most 2 items after validation, not 3"),
    (BATCH, [["x" * 513, {"input_ids": [1]}]], "field '[0][0]': String should have at most 512 characters"),
    (BATCH, [["a", 5]], "field '[0][1]': Input should be a JSON object"),
    (BATCH, [["a", {"input_ids": [[1], [2]], "rid": ["a"]}]], "field '[0][1]': 'rid' has 1 items for 2 sequences"),
    (BATCH, [["a", {"input_ids": [1]}], ["a", {"input_ids": [2]}]], "request id 'a' appears more than once"),
    (GEN, {"input_ids": [1], "rid": ["a"]}, "'rid' is a list but input_ids is a single sequence"),
    (GEN, {"input_ids": [1], "trajectory_key": ""},
     "field 'trajectory_key': String should have at least 1 character"),
    (GEN, {"input_ids": [1], "min_weight_version": True},
     "field 'min_weight_version': Input should be a valid integer"),
    (GEN, {"input_ids": [1], "sampling_params": {"temperature": -0.5}},
     "field 'sampling_params.temperature': Input should be greater than or equal to 0"),
    (GEN, {"text": "hi"}, "'text' input is not supported: the manager continues sequences token by token, so send "
                          "'input_ids' (tokenize on the trainer side)"),
    (GEN, {}, "field 'input_ids': Field required"),
]


@pytest.mark.parametrize(("model", "data", "expected"), EXACT, ids=[f"{m.__name__} {json.dumps(d)[:50]}"
                                                                     for m, d, _ in EXACT])
def test_one_message_per_mistake_naming_the_field(model, data, expected):
    assert message(model, data) == expected


def test_two_real_mistakes_give_two_messages_and_no_label_body():
    got = message(GEN, {"input_ids": [-1, "x"], "stream": 1})
    assert got.split("; ") == ["field 'input_ids[0]': Input should be greater than or equal to 0",
                               "field 'input_ids[1]': Input should be a valid integer",
                               "field 'stream': Input should be a valid boolean"]


@pytest.mark.parametrize("data", [
    {"input_ids": [1, 2]},
    {"input_ids": [[1], [2, 3]], "sampling_params": [{"max_new_tokens": 2}, {}], "rid": ["a", "b"],
     "return_logprob": [True, False]},
    {"input_ids": [1], "sampling_params": {"max_new_tokens": 4, "top_p": 0.5}, "rid": "r", "return_logprob": True},
])
def test_valid_generate_bodies_still_pass_unchanged(data):
    request = decode(data)
    assert request.input_ids == data["input_ids"] and request.batched == isinstance(data["input_ids"][0], list)
    for i, sequence in enumerate(request.sequences):
        sent = sequence.body.to_json()
        params = data.get("sampling_params", {})
        given = params[i] if isinstance(params, list) else params
        assert {**sent["sampling_params"], **given} == sent["sampling_params"]
        for key in ("rid", "return_logprob"):
            if key in data:
                assert sent[key] == (data[key][i] if isinstance(data[key], list) else data[key])


def test_valid_wait_for_and_batch_ids_still_pass():
    assert validate({"wait_for_instances": "all"}, schemas.UpdateWeightVersion).wait_for_instances == "all"
    assert validate({"wait_for_instances": 2}, schemas.UpdateWeightVersion).wait_for_instances == 2
    batch = decode_items([["a", {"input_ids": [1]}], [7, {"input_ids": [[1]]}]])
    assert [rid for rid, _ in batch] == ["a", 7]


def test_weight_agents_name_a_cross_field_mistake_without_field_body():
    body = {"version": 1, "fingerprint": "abc", "shards": [[0, 256]], "checksums": []}
    with pytest.raises(BadBody) as info:
        parse_body(json.dumps(body), CommitRequest)
    assert "field 'body'" not in str(info.value) and "checksum" in str(info.value), info.value
