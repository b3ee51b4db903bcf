"""Output lengths known early (``placement.lengths``): the censored per-group estimate, the per-prompt history
across epochs, its bound; the ``group_key`` field at the door (typed, refused with 400 naming it, never sent
to an engine); and the predictions' error in ``/get_instances_status`` and ``/metrics``.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from fakes import FakeSGLang, register_active, start_fakes
from prometheus_client.parser import text_string_to_metric_families

from rollout_manager.config import Config
from rollout_manager.errors import InvalidField
from rollout_manager.instances.registry import Registry
from rollout_manager.placement.dispatch import Dispatcher
from rollout_manager.placement.least_in_flight import LeastInFlight
from rollout_manager.placement.lengths import BUCKETS, LengthModel, Prior, Track, bucket, censored_fit
from rollout_manager.placement.local_budget import LocalBudget
from rollout_manager.rollout.generation import GenerationSettings, Generator
from rollout_manager.rollout.request import decode, decode_items
from rollout_manager.sglang.client import SGLangClient


class Running:
    """A sequence being made, as the manager shows it to the model: a running length read on demand."""

    def __init__(self, model: LengthModel, group: str | None, prompt: list[int], name: str = "",
                 budget: int | None = None):
        self.made = 0
        self.model = model
        self.track: Track = model.start(group, prompt, name, lambda: self.made, budget)

    def finish(self, length: int) -> None:
        self.made = length
        self.model.finish(self.track, length)


# ------------------------------------------------------------------ the estimator, without processes
def test_the_censored_fit_recovers_a_lognormal_whose_long_samples_are_unfinished() -> None:
    rng = random.Random(7)
    mu, sigma = math.log(800.0), 0.6
    exact, censored = [], []
    for _ in range(4000):
        x = rng.gauss(mu, sigma)
        seen = math.log(900.0) + rng.random() * 0.3  # what a running sequence has made so far
        (exact if x <= seen else censored).append(x if x <= seen else seen)
    assert len(censored) > 1000  # a large share of the lengths is known only as a lower bound
    fit_mu, fit_sigma = censored_fit(exact, censored, Prior(0.0, 1.0, 0.0))
    assert abs(fit_mu - mu) < 0.05 and abs(fit_sigma - sigma) < 0.05, (fit_mu, fit_sigma)
    naive_mu = sum(exact + censored) / 4000  # the lower bounds taken as lengths
    assert naive_mu < mu - 0.1


def test_a_group_whose_long_samples_are_still_running_predicts_long() -> None:
    model = LengthModel()
    prompt = [3, 1, 4]
    group = [Running(model, "uid-1", prompt, f"s{i}") for i in range(8)]
    first = model.predict(group[0].track)
    for short, length in zip(group[:4], (300, 320, 340, 360)):
        short.finish(length)
    for long in group[4:]:
        long.made = 1200  # still decoding, four times past the finished ones
    status = model.status()  # reads every running length
    assert status.running == 4 and status.groups == 1
    for long in group[4:]:
        p = model.predict(long.track)
        assert p.median > 1200 and p.quantile > p.median and p.finished_fraction == 0.5
    # ignoring the running ones, the four finished would say ~330 tokens
    finished_only = censored_fit([math.log(n) for n in (300, 320, 340, 360)], [], group[0].track.group.prior)
    assert math.exp(finished_only[0]) < 600
    assert math.exp(group[4].track.group.fitted()[0]) > 600  # the censored fit believes the long ones
    assert first.median != model.predict(group[4].track, made=0).median  # each finish sharpened the group


def test_a_budget_caps_the_prediction_and_a_made_length_floors_it() -> None:
    model = LengthModel()
    seq = Running(model, None, [9, 9], budget=100)
    assert model.predict(seq.track).quantile <= 100
    assert model.predict(seq.track, made=90).median >= 90


def test_history_across_epochs_improves_the_first_prediction() -> None:
    rng = random.Random(1)
    model = LengthModel()
    others = [[100 + i, 7] for i in range(40)]
    long_prompt = [5, 5, 5]
    for epoch in range(2):
        for prompt in others:  # the fleet's lengths: about 100 tokens
            for s in [Running(model, f"e{epoch}-{prompt[0]}", prompt) for _ in range(4)]:
                s.finish(int(100 * math.exp(rng.gauss(0, 0.2))))
        group = [Running(model, f"e{epoch}-long", long_prompt) for _ in range(8)]
        first = model.predict(group[0].track)  # before any sibling finished
        if epoch == 0:
            assert first.median < 500, first  # nothing known of this prompt: the fleet's figure
        else:
            assert abs(math.log(first.median / 3000)) < 0.3, first  # last epoch's lengths
        for s in group:
            s.finish(int(3000 * math.exp(rng.gauss(0, 0.1))))
    assert model.errors["0"].n > 0 and len(model.history) == 41


def test_the_upper_quantile_is_given_only_where_evidence_informs_it() -> None:
    """``high`` is for placement's longest term: None while a group rests on the fleet's figure alone (every
    sequence alike), an upper quantile above the median once the prompt has history or a sibling finished."""
    model = LengthModel()
    first = [Running(model, "e0", [9, 9]) for _ in range(4)]
    assert model.high(first[0].track, 0) is None  # nothing known of this prompt, nothing finished
    first[0].finish(2000)
    high = model.high(first[1].track, 0)
    assert high is not None and high > model.left(first[1].track, 0)
    for s in first[1:]:
        s.finish(2000)
    again = Running(model, "e1", [9, 9], budget=4096)  # next epoch: the prompt's history informs it at once
    high = model.high(again.track, 0)
    assert high is not None and model.left(again.track, 0) < high <= 4096
    assert model.high(again.track, 4000) == pytest.approx(96)  # never past the budget


def test_samples_of_one_prompt_form_a_group_when_no_key_is_given() -> None:
    model = LengthModel()
    a = [Running(model, None, [1, 2, 3]) for _ in range(3)]
    b = Running(model, None, [1, 2, 4])
    assert a[0].track.group is a[2].track.group is not b.track.group
    for s in a:
        s.finish(50)
    again = Running(model, None, [1, 2, 3])  # all of them ended: the prompt's next samples, next epoch
    assert again.track.group is not a[0].track.group
    assert abs(model.predict(again.track).median - 50) < 10  # what the last epoch made


def test_the_tables_are_bounded_and_keep_the_most_recent() -> None:
    model = LengthModel(history_capacity=4, group_capacity=3)
    for i in range(10):
        Running(model, f"g{i}", [i]).finish(10 + i)
    assert len(model.history) == 4 and len(model.groups) == 3
    assert model.history.get(hash((9,))) is not None and model.history.get(hash((0,))) is None
    assert model.status().history_capacity == 4


def test_a_failed_sequence_leaves_no_observation_and_predictions_are_scored_by_bucket() -> None:
    model = LengthModel()
    group = [Running(model, "g", [1]) for _ in range(4)]
    model.drop(group[3].track)
    assert group[3].track.group.started == 3 and not group[3].track.open
    for i, s in enumerate(group[:3]):
        s.made = 10 * (i + 1)
    group[0].finish(100)
    group[1].finish(110)
    group[2].finish(120)
    model.finish(group[2].track, 999)  # a second end is ignored
    assert model.errors["0"].n == 3  # each one's prediction at its start
    assert model.errors["25-50"].n == 2 and model.errors["50-75"].n == 1  # re-predicted at each sibling's end
    assert sum(e.n for e in model.errors.values()) == model.finished + 3 == 6
    assert set(model.status().errors) <= set(BUCKETS)
    assert [bucket(f) for f in (0.0, 0.1, 0.25, 0.26, 0.5, 0.75, 0.9, 1.0)] == \
        ["0", "0-25", "0-25", "25-50", "25-50", "50-75", "75-100", "75-100"]


# ------------------------------------------------------------------ the field at the door
def test_group_key_is_a_string_or_one_per_item_and_anything_else_is_refused_naming_it() -> None:
    assert decode({"input_ids": [1], "group_key": "uid-7"}).sequences[0].group_key == "uid-7"
    assert decode({"input_ids": [1]}).sequences[0].group_key is None
    batch = decode({"input_ids": [[1], [2]], "group_key": ["a", None]})
    assert [s.group_key for s in batch.sequences] == ["a", None]
    shared = decode({"input_ids": [[1], [2]], "group_key": "g"})
    assert [s.group_key for s in shared.sequences] == ["g", "g"]
    (_, item), = decode_items([["r", {"input_ids": [1], "group_key": "x"}]])
    assert item.sequences[0].group_key == "x"
    for bad in (7, "", "x" * 513, ["a"], {"a": 1}):
        with pytest.raises(InvalidField, match="group_key"):
            decode({"input_ids": [1], "group_key": bad})
    with pytest.raises(InvalidField, match="group_key"):
        decode({"input_ids": [[1], [2]], "group_key": ["a"]})
    for s in (*batch.sequences, *shared.sequences):
        assert "group_key" not in s.body.to_json()


@pytest.fixture
async def fleet() -> AsyncIterator[tuple[Generator, list[FakeSGLang]]]:
    fakes = await start_fakes(2)
    try:
        async with aiohttp.ClientSession() as session:
            registry = Registry()
            dispatcher = Dispatcher(registry, LeastInFlight())
            settings = GenerationSettings(max_attempts=2, wait_timeout_s=2.0, connect_timeout_s=2.0,
                                          stall_timeout_s=2.0, engine_stream_interval=1, length_prediction=True)
            generator = Generator(dispatcher, SGLangClient(session), settings, LocalBudget(0.0, 0.0, 1.0),
                                  on_instance_failure=lambda i, r: None, on_instance_success=lambda i: None)
            register_active(registry, fakes)
            yield generator, fakes
    finally:
        for f in fakes:
            await f.close()


async def test_the_generator_records_each_sequence_of_a_group_and_never_forwards_the_key(fleet: Any) -> None:
    generator, fakes = fleet
    bodies = [{"input_ids": [4, 5, 6], "group_key": "uid-9", "sampling_params": {"temperature": 0, "max_new_tokens": n}}
              for n in (3, 4, 5, 6)]
    await asyncio.gather(*(generator.generate(decode(b)) for b in bodies))
    sent = [r for f in fakes for r in f.requests]
    assert len(sent) >= 4 and all("group_key" not in r for r in sent)
    status = generator.lengths.status()
    assert status.running == 0 and status.finished == 4 and status.groups == 1
    assert status.errors["0"].n == 4  # every sequence's start prediction, scored at its end
    assert sorted(math.exp(x) for x in generator.lengths.groups["uid-9"].finished) == pytest.approx([3, 4, 5, 6])


# ------------------------------------------------------------------ through a real manager and a CPU engine
@pytest.mark.slow
async def test_through_the_manager_status_and_metrics(start_manager: Any, start_engines: Any) -> None:
    m = await start_manager(length_prediction="true")
    (engine,) = await start_engines([])
    await m.register(engine)
    params = {"max_new_tokens": 100, "temperature": 0.0}  # past engine_stream_interval (64): a length to predict
    status, out = await m.post("/generate", {"input_ids": [1, 2], "sampling_params": params, "group_key": 3})
    assert status == 400 and "group_key" in out["error"], out
    # the CPU engine refuses fields it does not know: a 200 is a body without group_key
    status, out = await m.post("/generate", {"input_ids": [[1, 2]] * 3, "sampling_params": params,
                                             "group_key": "uid-1"})
    assert status == 200, out
    # a sequence that fits one chunk interval is not tracked: it cannot set a step's tail, and the model's
    # work would cost it more than placement gains (issue 46, item 6)
    status, out = await m.post("/generate", {"input_ids": [[1, 2]] * 2, "group_key": "uid-2",
                                             "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}})
    assert status == 200, out
    status, st = await m.get("/get_instances_status")
    assert status == 200
    lengths = st["lengths"]
    assert lengths["groups"] == 1 and lengths["finished"] == 3 and lengths["running"] == 0
    assert lengths["errors"]["0"]["n"] == 3 and lengths["errors"]["0"]["mae_tokens"] >= 0
    async with m.session.get(m.url + "/metrics") as r:
        text = await r.text()
    samples = {(s.name, s.labels.get("finished_fraction")): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("rollout_manager_length_groups", None)] == 1
    assert samples[("rollout_manager_length_predictions_scored_total", "0")] == 3
    assert ("rollout_manager_length_prediction_abs_error_tokens_total", "0") in samples


# ------------------------------------------------------------------ the plugin passes verl's group key
def test_the_plugin_sends_verls_uid_as_the_group_key() -> None:
    np = pytest.importorskip("numpy")
    from trainer_plugin.proxy import build_generate_body, group_key_of
    from trainer_plugin.streaming import RolloutStream

    assert group_key_of({"uid": "3f2a"}) == "3f2a" and group_key_of({"uid": np.array(["u"], dtype=object)[0]}) == "u"
    assert group_key_of({}) is None and group_key_of({"uid": ""}) is None
    body = build_generate_body([1, 2], {}, "r", prompt_length=8, response_length=6, group_key="3f2a")
    assert decode(body).sequences[0].group_key == "3f2a"
    assert "group_key" not in build_generate_body([1, 2], {}, "r", prompt_length=8, response_length=6)
    stream = RolloutStream(None, [[1, 2], [3]], n=2, uids=["ua", "ub"])  # type: ignore[arg-type]
    assert [decode(b).sequences[0].group_key for _, b in stream.requests()] == ["ua", "ua", "ub", "ub"]


def test_on_where_placement_uses_it_and_off_elsewhere() -> None:
    """The makespan policy (the default) places by the predictions, so it turns the model on; under another
    policy nothing reads them, so the model costs nothing unless configured."""
    assert Config().scheduler_policy == "makespan"
    assert GenerationSettings.from_config(Config()).length_prediction is True
    other = Config(scheduler_policy="throughput_aware")
    assert GenerationSettings.from_config(other).length_prediction is False
    assert GenerationSettings.from_config(Config(scheduler_policy="throughput_aware",
                                                 length_prediction=True)).length_prediction is True
    # tail migration reads them too: only the predicted tail moves (tail_migration_tail_share)
    settings = GenerationSettings.from_config(Config())
    assert settings.migration is not None and settings.migration.tail_share == 1.0
