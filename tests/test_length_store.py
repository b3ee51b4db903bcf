"""The prompts' lengths across restarts (``rollout.lengths`` export/restore, ``rollout.length_store``): a
restored model predicts a known prompt as the old one did; a file from another key scheme, a corrupt or an
unwritable one is reported and never stops the daemon; a real daemon stopped and started again on the
same file predicts from the lengths the first one saw.
"""

from __future__ import annotations

import math
import shutil
import signal
from collections import deque
from pathlib import Path
from typing import Any

import msgspec
import pytest

from rollout_manager.config import ConfigError, load_config
from rollout_manager.rollout.length_store import LengthStore
from rollout_manager.rollout.lengths import KEY_SCHEME, LengthHistory, LengthModel


def _epoch(model: LengthModel, prompts: dict[tuple[int, ...], list[int]], tag: str) -> None:
    """One epoch: each prompt's samples start together (group ``tag/prompt``) and finish at their lengths."""
    for prompt, lengths in prompts.items():
        tracks = [model.start(f"{tag}/{prompt}", list(prompt)) for _ in lengths]
        for track, n in zip(tracks, lengths):
            model.finish(track, n)


PROMPTS = {(1, 2, 3): [1800, 2100, 2400, 1900], (4, 5): [90, 110, 100, 95], (6,): [400, 420, 380, 410]}


def test_a_restored_model_predicts_known_prompts_as_the_one_it_came_from() -> None:
    old = LengthModel()
    _epoch(old, PROMPTS, "e0")
    saved = msgspec.msgpack.decode(msgspec.msgpack.encode(old.export()), type=LengthHistory)
    new = LengthModel()
    assert new.restore(saved) == 3
    assert new.fleet == old.fleet and new.finished == old.finished == 12
    for prompt in PROMPTS:
        a, b = old.start(f"e1/{prompt}", list(prompt)), new.start(f"e1/{prompt}", list(prompt))
        assert b.group.from_history and new.informed(b)
        assert new.predict(b) == old.predict(a)
    fresh = LengthModel()
    assert not fresh.informed(fresh.start("e1/x", [1, 2, 3]))  # what the restart would otherwise be
    long, short = new.start("e1/long", [1, 2, 3]), new.start("e1/short", [4, 5])
    assert new.predict(long).median > 10 * new.predict(short).median


def test_a_history_from_other_keys_or_with_impossible_values_is_refused_and_changes_nothing() -> None:
    old = LengthModel()
    _epoch(old, PROMPTS, "e0")
    good = old.export()
    for bad in (msgspec.structs.replace(good, keys="tuple-hash/py3.99/32"),
                msgspec.structs.replace(good, fleet_var=math.nan),
                msgspec.structs.replace(good, prompts=[(1, [0, 5])])):
        model = LengthModel()
        before = model.fleet
        with pytest.raises(ValueError):
            model.restore(bad)
        assert len(model.history) == 0 and model.fleet == before and model.finished == 0


def test_restore_keeps_the_bounds_and_what_the_model_already_knows() -> None:
    saved = LengthHistory(KEY_SCHEME, math.log(300.0), 0.5, 40, [(k, [k * 10] * 30) for k in range(1, 11)])
    model = LengthModel(history_capacity=4, history_depth=8)
    model.history[10] = deque([7], maxlen=8)
    assert model.restore(saved) == 3  # the four most recent fit; prompt 10 was known and keeps its own
    assert sorted(model.history) == [7, 8, 9, 10]
    assert list(model.history[10]) == [7] and list(model.history[9]) == [90] * 8


async def test_the_store_writes_when_something_finished_and_a_new_store_reads_it(tmp_path: Path) -> None:
    path = tmp_path / "lengths.msgpack"
    model = LengthModel()
    store = LengthStore(path, model, interval_s=3600)
    assert store.load() == 0 and store.status().error is None  # no file yet: an empty start
    _epoch(model, PROMPTS, "e0")
    assert await store.save() and path.exists()
    assert not await store.save()  # nothing finished since: nothing written
    assert store.status().saved_prompts == 3 and store.status().saved_at is not None
    assert [p.name for p in tmp_path.iterdir()] == ["lengths.msgpack"]  # no temporary file left behind
    again = LengthModel()
    assert LengthStore(path, again).load() == 3 and again.export() == model.export()


async def test_a_corrupt_file_is_reported_and_replaced_and_an_unwritable_one_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "d" / "lengths.msgpack"
    path.parent.mkdir()
    path.write_bytes(b"\x93not a history")
    model = LengthModel()
    store = LengthStore(path, model)
    assert store.load() == 0 and "not a length history" in (store.status().error or "")
    _epoch(model, PROMPTS, "e0")
    assert await store.save() and store.status().error is None
    assert LengthStore(path, LengthModel()).load() == 3  # the next write replaced it
    shutil.rmtree(path.parent)
    _epoch(model, {(9,): [5]}, "e1")
    assert not await store.save() and "cannot be written" in (store.status().error or "")
    path.parent.mkdir()
    assert await store.save() and store.status().error is None  # written once the directory is back


def test_the_config_names_a_file_whose_directory_exists(tmp_path: Path) -> None:
    assert load_config(environ={}, overrides={"length_history_file": str(tmp_path / "h")}).length_history_file \
        == str(tmp_path / "h")
    for value, why in ((tmp_path / "no" / "h", "does not exist"), (tmp_path, "is a directory")):
        with pytest.raises(ConfigError, match=f"length_history_file.*{why}"):
            load_config(environ={}, overrides={"length_history_file": str(value)})


# ------------------------------------------------------------------ a real daemon, stopped and started again
@pytest.mark.slow
async def test_a_restarted_daemon_predicts_from_the_lengths_the_last_one_saw(start_manager: Any, start_engines: Any,
                                                                             tmp_path: Path) -> None:
    path = tmp_path / "lengths.msgpack"
    (engine,) = await start_engines([])
    first = await start_manager(length_history_file=str(path), length_history_save_s=3600)
    await first.register(engine)
    prompt = [11, 12, 13]
    status, out = await first.post("/generate", {"input_ids": [prompt] * 4, "group_key": "uid-a",
                                                 "sampling_params": {"max_new_tokens": 6, "temperature": 0.0,
                                                                     "ignore_eos": True}})
    assert status == 200 and all(len(o["output_ids"]) == 6 for o in out), out
    _, before = await first.get("/get_instances_status")
    assert before["lengths"]["history_prompts"] == 1 and before["lengths"]["history_file"]["saved_at"] is None
    first.proc.signal(signal.SIGTERM)  # the daemon writes the history on its way out
    assert first.proc.wait(30) == 0 and path.exists()

    second = await start_manager(length_history_file=str(path), length_history_save_s=3600)
    await second.register(engine)
    _, st = await second.get("/get_instances_status")
    lengths = st["lengths"]
    assert lengths["history_file"]["restored_prompts"] == 1 and lengths["history_file"]["error"] is None
    assert lengths["history_prompts"] == 1 and lengths["finished"] == 4
    assert lengths["fleet_median_tokens"] == before["lengths"]["fleet_median_tokens"]
    # The same prompt, a budget of 40: predicted 6 from its history (scored 34 off), where a daemon without it
    # would predict the fleet's figure, capped at the budget.
    status, out = await second.post("/generate", {"input_ids": prompt, "group_key": "uid-b",
                                                  "sampling_params": {"max_new_tokens": 40, "temperature": 0.0,
                                                                      "ignore_eos": True}})
    assert status == 200 and len(out["output_ids"]) == 40, out
    _, st = await second.get("/get_instances_status")
    assert st["lengths"]["errors"]["0"]["mae_tokens"] == pytest.approx(34, abs=1)
