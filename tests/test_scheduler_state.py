"""What the scheduler learned, across restarts (``placement.lengths`` export/restore, ``placement.box_speed``
seeds, ``placement.scheduler_state``): a restored model predicts a known prompt as the old one did, a box
registering at a remembered endpoint starts from its curve; a file from another key scheme, a corrupt or
an unwritable one is reported and never stops the daemon; a real daemon stopped and started again on the
same file predicts from the lengths the first one saw and knows its box's speed before it streams.
"""

from __future__ import annotations

import math
import shutil
import signal
from pathlib import Path
from typing import Any

import msgspec
import pytest

from rollout_manager.config import Config, ConfigError, load_config
from rollout_manager.instances.registry import Kind, State
from rollout_manager.manager import Manager
from rollout_manager.placement.box_speed import BoxCurve, BoxSpeeds, StepModel
from rollout_manager.placement.lengths import KEY_SCHEME, LengthHistory, LengthModel
from rollout_manager.placement.scheduler_state import StateFile


class Boxes:
    """The dispatcher's side of the file: measured curves out, remembered ones in."""

    def __init__(self, curves: list[BoxCurve] | None = None) -> None:
        self.curves = list(curves or [])
        self.remembered: list[BoxCurve] = []

    def state_file(self, path: Path, model: LengthModel | None, interval_s: float = 3600) -> StateFile:
        return StateFile(path, model, lambda: self.curves, self.remembered.extend, interval_s)


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
    model.history[10] = [7]
    assert model.restore(saved) == 3  # the four most recent fit; prompt 10 was known and keeps its own
    assert sorted(model.history) == [7, 8, 9, 10]
    assert list(model.history[10]) == [7] and list(model.history[9]) == [90] * 8


async def test_the_file_is_written_when_the_state_changed_and_a_new_daemon_reads_it(tmp_path: Path) -> None:
    path = tmp_path / "state.msgpack"
    model, boxes = LengthModel(), Boxes()
    state = boxes.state_file(path, model)
    state.load()
    assert state.status().error is None and not await state.save()  # no file, nothing learned: nothing written
    _epoch(model, PROMPTS, "e0")
    boxes.curves.append(BoxCurve("10.0.0.7:30000", 0.006, 0.00008))
    assert await state.save() and path.exists()
    assert not await state.save()  # nothing changed since: nothing written
    assert (state.status().saved_prompts, state.status().saved_boxes) == (3, 1)
    assert [p.name for p in tmp_path.iterdir()] == ["state.msgpack"]  # no temporary file left behind
    again, other = LengthModel(), Boxes()
    restored = other.state_file(path, again)
    restored.load()
    assert again.export() == model.export() and other.remembered == boxes.curves
    assert (restored.status().restored_prompts, restored.status().restored_boxes) == (3, 1)
    # A daemon that does not predict lengths still keeps the boxes' curves.
    alone = Boxes()
    alone.state_file(path, None).load()
    assert alone.remembered == boxes.curves


def test_a_seeded_box_is_measured_at_once_and_its_own_streams_take_over() -> None:
    speeds = BoxSpeeds()
    speeds.seed("inst-1", StepModel(0.010, 0.0002))
    m = speeds.model("inst-1")
    assert speeds.measured("inst-1") and m is not None
    assert m.a == pytest.approx(0.010, rel=1e-3) and m.b == pytest.approx(0.0002, rel=1e-3)
    gap = 10 * 0.5 * (0.010 + 0.0002 * 32)  # the box is twice as fast now: 10 steps of its 32 running
    for k in range(25):  # one second of its own streams: each of its 32 sequences' chunk gaps
        for _ in range(32):
            speeds.observe_gap("inst-1", 10, 32, gap, 100.0 + k * gap)
    assert speeds.model("inst-1").step_s(32) == pytest.approx(0.5 * (0.010 + 0.0002 * 32), rel=0.15)
    speeds.seed("inst-2", StepModel(math.nan, 0.0))  # a curve no box has is not taken
    assert not speeds.measured("inst-2")


async def test_a_corrupt_file_is_reported_and_replaced_and_an_unwritable_one_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "d" / "state.msgpack"
    path.parent.mkdir()
    path.write_bytes(b"\x93not a state")
    model, boxes = LengthModel(), Boxes()
    state = boxes.state_file(path, model)
    state.load()
    assert "not a scheduler state" in (state.status().error or "") and not boxes.remembered
    _epoch(model, PROMPTS, "e0")
    assert await state.save() and state.status().error is None
    other = LengthModel()
    Boxes().state_file(path, other).load()
    assert len(other.history) == 3  # the next write replaced it
    shutil.rmtree(path.parent)
    _epoch(model, {(9,): [5]}, "e1")
    assert not await state.save() and "cannot be written" in (state.status().error or "")
    path.parent.mkdir()
    assert await state.save() and state.status().error is None  # written once the directory is back


def test_a_file_from_another_python_is_refused_whole(tmp_path: Path) -> None:
    old = LengthModel()
    _epoch(old, PROMPTS, "e0")
    path = tmp_path / "state.msgpack"
    foreign = msgspec.structs.replace(old.export(), keys="tuple-hash/py3.99/32")
    path.write_bytes(msgspec.msgpack.encode({"lengths": foreign, "boxes": [BoxCurve("h:1", 0.01, 0.0)]}))
    model, boxes = LengthModel(), Boxes()
    state = boxes.state_file(path, model)
    state.load()
    assert "py3.99" in (state.status().error or "") and len(model.history) == 0 and not boxes.remembered


def test_the_config_names_a_file_whose_directory_exists(tmp_path: Path) -> None:
    cfg = load_config(environ={}, overrides={"scheduler_state_file": str(tmp_path / "s")})
    assert cfg.scheduler_state_file == str(tmp_path / "s")
    for value, why in ((tmp_path / "no" / "s", "does not exist"), (tmp_path, "is a directory")):
        with pytest.raises(ConfigError, match=f"scheduler_state_file.*{why}"):
            load_config(environ={}, overrides={"scheduler_state_file": str(value)})


# ------------------------------------------------------------------ the manager, and a real daemon restarted
async def test_a_new_manager_on_the_file_knows_the_boxes_at_their_endpoints(tmp_path: Path) -> None:
    cfg = Config(scheduler_state_file=str(tmp_path / "state.msgpack"))
    first = Manager(cfg)
    try:
        fast = first.registry.add("127.0.0.1", 31001, Kind.REMOTE)
        for n in (4, 16, 32):  # its streams said: 6 ms + 0.08 ms a sequence
            first.dispatcher.fleet.speeds.add(fast.id, n, 0.006 + 0.00008 * n, 1.0)
    finally:
        await first.close()  # writes the state
    second = Manager(cfg)
    try:
        other = second.registry.add("127.0.0.1", 31002, Kind.REMOTE)  # registered first: ids differ now
        again = second.registry.add("127.0.0.1", 31001, Kind.REMOTE)
        assert again.id != fast.id and second.dispatcher.fleet.speeds.measured(again.id)
        m = second.dispatcher.fleet.speeds.model(again.id)
        assert m is not None and m.a == pytest.approx(0.006, rel=0.02) and m.b == pytest.approx(0.00008, rel=0.05)
        assert not second.dispatcher.fleet.speeds.measured(other.id)  # a box never measured stays so
        assert second.status()["scheduler_state"]["restored_boxes"] == 1
        assert second.registry.transition(again, State.DEAD, "test: the box left")
    finally:
        await second.close()  # its curve is written again though the box has not come back
    third = Manager(cfg)
    try:
        late = third.registry.add("127.0.0.1", 31001, Kind.REMOTE)
        assert third.dispatcher.fleet.speeds.measured(late.id)
    finally:
        await third.close()


@pytest.mark.slow
async def test_a_restarted_daemon_predicts_from_the_lengths_the_last_one_saw(
    start_manager: Any, start_engines: Any, tmp_path: Path
) -> None:
    path = tmp_path / "state.msgpack"
    (engine,) = await start_engines([])
    first = await start_manager(scheduler_state_file=str(path), scheduler_state_save_s=3600)
    await first.register(engine)
    prompt = [11, 12, 13]
    # past engine_stream_interval (64): a sequence that fits one chunk interval is not tracked
    params = {"max_new_tokens": 80, "temperature": 0.0, "ignore_eos": True}
    status, out = await first.post("/generate", {"input_ids": [prompt] * 4, "group_key": "uid-a",
                                                 "sampling_params": params})
    assert status == 200 and all(len(o["output_ids"]) == 80 for o in out), out
    _, before = await first.get("/get_instances_status")
    assert before["lengths"]["history_prompts"] == 1 and before["scheduler_state"]["saved_at"] is None
    first.proc.signal(signal.SIGTERM)  # the daemon writes its state on its way out
    assert first.proc.wait(30) == 0 and path.exists()

    second = await start_manager(scheduler_state_file=str(path), scheduler_state_save_s=3600)
    await second.register(engine)
    _, st = await second.get("/get_instances_status")
    assert st["scheduler_state"]["restored_prompts"] == 1 and st["scheduler_state"]["error"] is None
    assert st["lengths"]["history_prompts"] == 1 and st["lengths"]["finished"] == 4
    assert st["lengths"]["fleet_median_tokens"] == before["lengths"]["fleet_median_tokens"]
    # The same prompt with a budget of 200: predicted 80 from its history (scored 120 off), where a daemon
    # without it would predict the fleet's figure capped at the budget.
    status, out = await second.post("/generate", {"input_ids": prompt, "group_key": "uid-b",
                                                  "sampling_params": {**params, "max_new_tokens": 200}})
    assert status == 200 and len(out["output_ids"]) == 200, out
    _, st = await second.get("/get_instances_status")
    assert st["lengths"]["errors"]["0"]["mae_tokens"] == pytest.approx(120, abs=1)
