"""The typed ``/generate`` request: decoded once at the door, turned into JSON once for the engine.

What an engine receives must mean what the caller asked (plus the manager's seed, budget, interval
and rid), whatever the manager does not interpret passed through as sent; and a request that runs
holds only its typed value, not the caller's dict or its validated form.
"""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_manager import jsonutil
from rollout_manager.api import routes
from rollout_manager.api.http import MAX_ADMIN_BODY, MAX_BODY
from rollout_manager.errors import InvalidField
from rollout_manager.rollout.request import BatchedBody, OneSequenceBody, Request, decode
from rollout_manager.sglang.generate_request import (
    SequenceBody,
    continuation,
    encode,
    join_key,
    joinable,
    sequences,
)
from rollout_manager.sglang.wire import DEFAULT_MAX_NEW_TOKENS


def sent(body: SequenceBody, made: list[int], **kwargs: Any) -> dict[str, Any]:
    """The JSON an engine gets for ``body`` continued after ``made``."""
    return jsonutil.loads(encode(continuation(body, made, **kwargs)))  # type: ignore[no-any-return]


def test_fields_the_manager_does_not_read_reach_the_engine_as_sent_and_its_own_do_not() -> None:
    caller = {"input_ids": [5, 6], "rid": "x", "return_logprob": True, "lora_path": "a", "top_logprobs_num": 2,
              "sampling_params": {"max_new_tokens": 10, "min_new_tokens": 4, "temperature": 0, "top_k": 5,
                                  "custom_params": {"k": [1]}},
              "trajectory_key": "t", "min_weight_version": 2}
    request = decode(caller)
    (item,) = request.sequences
    assert (item.trajectory_key, item.min_version, request.batched, request.stream) == ("t", 2, False, False)
    assert sent(item.body, [7, 8, 9], rid="x~1", stream_interval=16) == {
        "input_ids": [5, 6, 7, 8, 9], "rid": "x~1", "stream": True, "return_logprob": True, "lora_path": "a",
        "top_logprobs_num": 2,
        "sampling_params": {"max_new_tokens": 7, "min_new_tokens": 1, "temperature": 0, "top_k": 5,
                            "custom_params": {"k": [1]}, "stream_interval": 16}}
    assert caller["input_ids"] == [5, 6] and item.body.input_ids == [5, 6]  # nothing the caller sent changed
    with pytest.raises(AttributeError):
        item.body.rid = "y"  # type: ignore[misc]  # frozen: a body is shared by every attempt


def test_budgets_and_intervals_of_a_continuation() -> None:
    default = SequenceBody.of({"input_ids": [1]})
    assert sent(default, [2, 2, 2], rid="y")["sampling_params"] == {"max_new_tokens": DEFAULT_MAX_NEW_TOKENS - 3}
    assert sent(default, list(range(200)), rid="z")["sampling_params"]["max_new_tokens"] == 0  # never below 0
    unlimited = SequenceBody.of({"input_ids": [1], "sampling_params": {"max_new_tokens": None}})
    assert sent(unlimited, [2, 3], rid="c") == {"input_ids": [1, 2, 3], "rid": "c", "stream": True,
                                                 "sampling_params": {"max_new_tokens": None}}
    own = SequenceBody.of({"input_ids": [1], "sampling_params": {"stream_interval": 2}, "stream": True})
    assert sent(own, [], rid="a", stream_interval=16)["sampling_params"]["stream_interval"] == 16
    assert sent(own, [], rid="a", stream_interval=16, keep_caller_interval=True)["sampling_params"][
        "stream_interval"] == 2
    once = sent(default, [], rid="o", stream_interval=16, stream=False)
    assert once["stream"] is False and "stream_interval" not in once["sampling_params"]


def test_a_batch_is_split_as_sglang_splits_it() -> None:
    request = decode({"input_ids": [[1], [2], [3]], "rid": "r", "return_logprob": [True, False, True],
                      "sampling_params": {"temperature": 0.5}, "trajectory_key": ["a", None, "c"],
                      "logprob_start_len": 0, "min_weight_version": 1})
    assert request.batched and request.input_ids == [[1], [2], [3]]
    assert [s.trajectory_key for s in request.sequences] == ["a", None, "c"]
    assert [s.min_version for s in request.sequences] == [1, 1, 1]
    bodies = [s.body.to_json() for s in request.sequences]
    assert [(b["rid"], b["return_logprob"], b["logprob_start_len"]) for b in bodies] == [
        ("r_0", True, 0), ("r_1", False, 0), ("r_2", True, 0)]
    per_item, _ = sequences({"input_ids": [[1], [2]], "rid": ["a", "b"],
                             "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 2, "top_p": 0.9}]})
    assert [(b.rid, b.sampling.max_new_tokens, b.sampling.rest) for b in per_item] == [
        ("a", 1, {}), ("b", 2, {"top_p": 0.9})]


def test_only_bodies_that_share_everything_but_their_items_join_one_engine_batch() -> None:
    a, b, c, d = (continuation(SequenceBody.of(x), [], rid=f"r{i}", stream=False) for i, x in enumerate([
        {"input_ids": [1], "sampling_params": {"max_new_tokens": 3}, "lora_path": "l"},
        {"input_ids": [2, 3], "sampling_params": {"max_new_tokens": 5, "temperature": 1.0}, "lora_path": "l"},
        {"input_ids": [4], "lora_path": "other"},
        {"input_ids": [5], "sampling_params": {"n": 2}}]))
    assert joinable(a) and joinable(b) and joinable(c) and not joinable(d)  # n > 1 expands per batch
    assert join_key(a) == join_key(b) != join_key(c)
    assert not joinable(continuation(a, [], rid="s"))  # a stream goes alone
    joined = jsonutil.loads(encode([a, b]))
    assert joined["input_ids"] == [[1], [2, 3]] and joined["rid"] == ["r0", "r1"] and joined["lora_path"] == "l"
    # The batch is the inverse of a split: each item reads back as the body it was.
    assert [x.to_json() for x in sequences(joined)[0]] == [a.to_json(), b.to_json()]


# ------------------------------------------------------------------ the door: one decode, the API's words

SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-3, 2**40), st.floats(allow_nan=False, allow_infinity=False),
                    st.text(max_size=3))
ANY = st.one_of(SCALARS, st.lists(SCALARS, max_size=3))
PARAMS = st.dictionaries(st.sampled_from(["max_new_tokens", "min_new_tokens", "temperature", "top_k", "n"]),
                         st.one_of(SCALARS, st.integers(0, 64)), max_size=4)
BODIES = st.fixed_dictionaries({}, optional={
    "input_ids": st.one_of(st.lists(st.integers(0, 300), min_size=1, max_size=5),
                           st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=3), min_size=1, max_size=3), ANY),
    "sampling_params": st.one_of(PARAMS, st.lists(PARAMS, max_size=3), ANY),
    "return_logprob": ANY, "rid": ANY, "stream": ANY, "min_weight_version": ANY, "lora_path": ANY, "text": ANY,
    "trajectory_key": st.one_of(st.text(max_size=3), st.text(min_size=510, max_size=514), ANY)})
_OWN = {"trajectory_key", "min_weight_version"}
GOOD_PARAMS = st.fixed_dictionaries({}, optional={
    "max_new_tokens": st.none() | st.integers(0, 9), "min_new_tokens": st.none() | st.integers(0, 9),
    "temperature": st.none() | st.floats(0, 2), "top_k": st.integers(), "sampling_seed": st.integers()})


@st.composite
def valid_bodies(draw: Any) -> dict[str, Any]:
    """Bodies the API takes: one sequence or a batch, per-item fields shared or one per prompt."""
    n = draw(st.integers(1, 3))
    batched = draw(st.booleans())
    prompt = st.lists(st.integers(0, 9), min_size=1, max_size=3)
    body: dict[str, Any] = {"input_ids": [draw(prompt) for _ in range(n)] if batched else draw(prompt)}
    for key, values in (("sampling_params", GOOD_PARAMS), ("return_logprob", st.booleans()),
                        ("rid", st.text(max_size=2)), ("trajectory_key", st.text(min_size=1, max_size=2))):
        if draw(st.booleans()):
            body[key] = [draw(values) for _ in range(n)] if batched and draw(st.booleans()) else draw(values)
    for key, values in (("stream", st.booleans()), ("min_weight_version", st.none() | st.integers(0, 5)),
                        ("lora_path", st.text(max_size=2))):
        if draw(st.booleans()):
            body[key] = draw(values)
    return body


def test_any_body_is_typed_or_refused_with_a_400_and_what_is_typed_is_what_was_sent() -> None:
    """Every body either becomes a request whose engine bodies carry what the caller sent (its SGLang
    fields, not the manager's), or is refused with InvalidField naming a field: nothing else escapes."""
    accepted = []

    @settings(max_examples=400, deadline=None, database=None, derandomize=True)
    @given(BODIES | valid_bodies())
    def run(body: dict[str, Any]) -> None:
        try:
            request = decode(body)
        except InvalidField as exc:
            assert str(exc)
            return
        accepted.append(body)
        batched = isinstance(body["input_ids"][0], list)
        assert request.batched == batched and request.input_ids == body["input_ids"]
        for i, sequence in enumerate(request.sequences):
            sent = sequence.body.to_json()
            for key, value in body.items():
                if key in _OWN or key in ("sampling_params", "rid") or (key == "return_logprob" and value is None):
                    continue  # the manager's own; checked below; or null: not given
                item = value[i] if batched and key in ("return_logprob", "input_ids") and isinstance(value, list) \
                    else value
                assert sent[key] == item, (key, sent, body)
            params = body.get("sampling_params") or {}
            own = params[i] if isinstance(params, list) else params
            own = {k: v for k, v in own.items() if v is not None or k == "max_new_tokens"}  # None: not given
            assert {**sent["sampling_params"], **own} == sent["sampling_params"]
            assert not _OWN & set(sent)

    run()
    assert len(accepted) >= 100, len(accepted)  # the property said something about accepted bodies too


def test_the_bodies_trainers_send_are_taken() -> None:
    for body in ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 8, "temperature": 1, "top_p": 0.9},
                  "return_logprob": True, "rid": "a", "stream": False},
                 {"input_ids": [7], "trajectory_key": "t", "min_weight_version": 3, "lora_path": None},
                 {"input_ids": [[1], [2]], "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 2}]}):
        assert decode(body).sequences


def test_a_temperature_must_be_a_number() -> None:
    """The one body pydantic's lax float took and the decode refuses: a temperature given as a string
    (or a boolean), which went on to SGLang as sent and failed there."""
    for bad in ("0.5", True):
        with pytest.raises(InvalidField, match=r"field 'sampling_params.temperature': Input should be a valid number"):
            decode({"input_ids": [1], "sampling_params": {"temperature": bad}})


# ------------------------------------------------------------------ the door keeps only the typed value


class _Vocab:
    def check(self, ids: Any, field: str = "input_ids") -> None:
        pass


class _HeldGenerator:
    """Holds every request until released, so what the manager keeps while it runs can be looked at."""

    def __init__(self) -> None:
        self.held = asyncio.Event()
        self.release = asyncio.Event()
        self.requests: list[Any] = []
        self.vocab = _Vocab()

    async def generate(self, request: Any, *_: Any) -> dict[str, Any]:
        self.requests.append(request)
        self.held.set()
        await self.release.wait()
        return {"text": "", "output_ids": [], "meta_info": {}}


class _Manager:
    def __init__(self, generator: _HeldGenerator) -> None:
        self.generator = generator


MARKER = "held-request-marker"


def _callers_dicts() -> list[dict[str, Any]]:
    return [o for o in gc.get_objects() if type(o) is dict and o.get("trajectory_key") == MARKER]


async def test_a_running_request_holds_its_typed_value_not_the_callers_json_or_its_validated_form() -> None:
    generator = _HeldGenerator()
    app = web.Application()
    app[routes.MANAGER] = _Manager(generator)  # type: ignore[assignment]
    app[MAX_BODY] = app[MAX_ADMIN_BODY] = 1 << 20
    app.router.add_post("/generate", routes.generate)
    raw = jsonutil.dumps({"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 2, "top_k": 3},
                          "trajectory_key": MARKER})  # bytes: the test itself holds no such dict
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        task = asyncio.ensure_future(client.post("/generate", data=raw, headers={"Content-Type": "application/json"}))
        try:
            await asyncio.wait_for(generator.held.wait(), 10)
            gc.collect()
            validated = [o for o in gc.get_objects() if type(o) in (OneSequenceBody, BatchedBody)]
            assert validated == [] and _callers_dicts() == []
            (request,) = generator.requests
            assert isinstance(request, Request) and request.sequences[0].trajectory_key == MARKER
            assert request.sequences[0].body.sampling.rest == {"top_k": 3}
        finally:
            generator.release.set()
            resp = await asyncio.wait_for(task, 10)
        assert resp.status == 200
        resp.release()
