"""The trainer's log-prob mismatch attributed to the box that made each token (issue 39, item 2).

The plugin's split is pure (``trainer_plugin.mismatch``), so it is checked on hand-made batches, and on
the TensorDict shape verl's V1 trainer reads back from TransferQueue; the manager's side (the trust
figure per instance, ``POST /update_mismatch``, the status, ``/metrics`` and ``rollout-manager status``)
runs in process against a real :class:`Manager` and its aiohttp app.
"""

from __future__ import annotations

import asyncio
import importlib.util
import math
import re
from typing import Any

import pytest
import torch
from aiohttp import web
from aiohttp.test_utils import TestClient
from prometheus_client.parser import text_string_to_metric_families
from tensordict import NonTensorStack, TensorDict
from test_metrics_status import needs_chromium, render_page, syncing_instance, tbody, text_of

from rollout_manager.instances.mismatch import BoxReport, MismatchLedger, MismatchSettings
from rollout_manager.instances.registry import Kind
from rollout_manager.manager import Manager
from rollout_manager.ops import render_status
from trainer_plugin.mismatch import BoxKey, StepMismatch, tally_batch, tally_boxes


def _seg(instance: str, start: int, end: int) -> dict[str, Any]:
    return {"instance": instance, "endpoint": f"{instance}:1", "weight_version": "3", "start": start, "end": end,
            "outcome": "ok"}


def _k3(r: float) -> float:
    return math.exp(r) - r - 1


# ------------------------------------------------------------------ the pure split
def test_a_sample_spanning_two_boxes_splits_its_tokens_at_the_segment_boundary() -> None:
    # tokens 0-2 made by A (gap 0.1 each), 3-5 by B (gap 1.0, 1.0 and a masked one), then padding
    old = [-1.0, -1.0, -1.0, -2.0, -2.0, -9.0, 0.0, 0.0]
    rollout = [-1.1, -1.1, -1.1, -1.0, -1.0, -1.0, 0.0, 0.0]
    mask = [1, 1, 1, 1, 1, 0, 0, 0]
    out = tally_boxes([[_seg("A", 0, 3), _seg("B", 3, 6)]], [old], [rollout], [mask])
    a, b = out.boxes[BoxKey("A", "A:1")], out.boxes[BoxKey("B", "B:1")]
    assert (a.tokens, b.tokens) == (3, 2)  # B's masked token counts for nobody
    assert a.mean_abs_diff == pytest.approx(0.1) and b.mean_abs_diff == pytest.approx(1.0)
    assert a.k3_kl == pytest.approx(_k3(0.1)) and b.k3_kl == pytest.approx(_k3(-1.0))
    assert out.unattributed_tokens == 0


def test_tokens_no_segment_covers_are_counted_apart_and_samples_add_up_per_box() -> None:
    rows = [[-1.0] * 4, [-1.0] * 4, [-1.0] * 4]
    rollout = [[-1.5] * 4, [-1.0] * 4, [-1.0] * 4]
    segments = [[_seg("A", 0, 2)],  # the last 2 tokens: a later turn verl kept no segments for
                [_seg("A", 0, 4)],
                None]  # a sample without segments at all
    out = tally_boxes(segments, rows, rollout, [[1] * 4] * 3)
    a = out.boxes[BoxKey("A", "A:1")]
    assert a.tokens == 6 and a.mean_abs_diff == pytest.approx((2 * 0.5) / 6)
    assert out.unattributed_tokens == 2 + 4
    # a step of two micro-batches is the sum of both, means taken at the end
    step = StepMismatch()
    step.add(tally_boxes([[_seg("A", 0, 1)]], [[-1.0]], [[-3.0]], [[1]]))
    step.add(tally_boxes([[_seg("A", 0, 3)]], [[-1.0] * 3], [[-1.0] * 3], [[1] * 3]))
    body = step.body(7)
    assert body == {"step": 7, "unattributed_tokens": 0,
                    "boxes": [{"instance": "A", "endpoint": "A:1", "tokens": 4, "mean_abs_diff": pytest.approx(0.5),
                               "k3_kl": pytest.approx(_k3(2.0) / 4)}]}


def test_a_minus_infinity_log_prob_is_as_far_off_as_the_bound_not_a_nan() -> None:
    out = tally_boxes([[_seg("A", 0, 2)]], [[float("-inf"), float("-inf")]], [[-1.0, float("-inf")]], [[1, 1]])
    a = out.boxes[BoxKey("A", "A:1")]
    assert a.mean_abs_diff == pytest.approx(10.0)  # one token 20 off (clamped), one where both say impossible
    assert math.isfinite(a.k3_kl)


def test_verl_v1_batch_from_transfer_queue_jagged_rows_and_extra_fields() -> None:
    """The shape ``tq.kv_batch_get`` gives back: jagged rows per sample, ``extra_fields`` a non-tensor stack."""
    old = torch.nested.as_nested_tensor([torch.tensor([-1.0, -1.0, -1.0]), torch.tensor([-2.0, -2.0])],
                                        layout=torch.jagged)
    rollout = torch.nested.as_nested_tensor([torch.tensor([-1.2, -1.0, -1.0]), torch.tensor([-2.0, -1.0])],
                                            layout=torch.jagged)
    mask = torch.nested.as_nested_tensor([torch.ones(3, dtype=torch.int64), torch.ones(2, dtype=torch.int64)],
                                         layout=torch.jagged)
    extras = NonTensorStack({"segments": [_seg("A", 0, 1), _seg("B", 1, 3)], "global_steps": 3},
                            {"segments": [_seg("B", 0, 2)], "global_steps": 3})
    data = TensorDict({"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": mask,
                       "extra_fields": extras}, batch_size=[2])
    out = tally_batch(data)
    assert out.boxes[BoxKey("A", "A:1")].tokens == 1
    assert out.boxes[BoxKey("A", "A:1")].mean_abs_diff == pytest.approx(0.2)
    assert out.boxes[BoxKey("B", "B:1")].tokens == 4
    assert out.boxes[BoxKey("B", "B:1")].mean_abs_diff == pytest.approx(0.25)


# ------------------------------------------------------------------ the ledger
def test_one_box_far_above_the_median_is_called_out_and_all_together_is_not_theirs() -> None:
    ledger = MismatchLedger(MismatchSettings(alpha=0.5, outlier_multiple=3.0, floor=0.05))
    ledger.report(1, [BoxReport("a", 100, 0.02, 0.001), BoxReport("b", 100, 0.03, 0.001),
                      BoxReport("c", 100, 0.4, 0.1)])
    fleet = ledger.fleet()
    assert fleet.median == pytest.approx(0.03) and not fleet.fleet_wide
    c = ledger.of("c", fleet)
    assert c is not None and c["above_median_multiple"] and c["ratio_to_median"] == pytest.approx(0.4 / 0.03)
    assert "suspect this instance" in c["verdict"]
    assert ledger.summary()["outliers"] == ["c"]
    ledger.report(2, [BoxReport("c", 100, 0.02, 0.001)])  # weighted: halfway down
    t = ledger.by_instance["c"]
    assert t.mean_abs_diff == pytest.approx(0.21) and t.last_step == 2 and t.steps == 2 and t.tokens == 200
    # every box far from the trainer together: a fleet-wide disagreement, nobody called out
    every = MismatchLedger(MismatchSettings(floor=0.05))
    every.report(5, [BoxReport(i, 10, 0.5 + 0.5 * (i == "c"), 0.1) for i in "abc"])
    summary = every.summary()
    assert summary["fleet_wide"] and summary["outliers"] == [] and "not one box" in summary["note"]
    # under the floor nothing stands out, however the ratio looks
    quiet = MismatchLedger(MismatchSettings(floor=0.05))
    quiet.report(1, [BoxReport("a", 10, 0.001, 0), BoxReport("b", 10, 0.001, 0), BoxReport("c", 10, 0.04, 0)])
    assert quiet.summary()["outliers"] == []


# ------------------------------------------------------------------ the manager: endpoint, status, metrics
async def _metrics(client: TestClient) -> dict[tuple[str, str], float]:
    r = await client.get("/metrics")
    text = await r.text()
    return {(s.name, s.labels.get("endpoint", "")): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if "mismatch" in s.name}


GOOD = {"step": 4, "unattributed_tokens": 3,
        "boxes": [{"instance": "X", "endpoint": "", "tokens": 10, "mean_abs_diff": 0.01, "k3_kl": 0.0}]}

GARBAGE = [
    ({}, "'step'"),
    ({**GOOD, "step": -1}, "'step'"),
    ({**GOOD, "step": "4"}, "'step'"),
    ({**GOOD, "boxes": {"a": 1}}, "'boxes'"),
    ({**GOOD, "boxes": [{**GOOD["boxes"][0], "mean_abs_diff": -0.5}]}, "boxes[0].mean_abs_diff"),
    ({**GOOD, "boxes": [{**GOOD["boxes"][0], "k3_kl": "small"}]}, "boxes[0].k3_kl"),
    ({**GOOD, "boxes": [{**GOOD["boxes"][0], "tokens": 0}]}, "boxes[0].tokens"),
    ({**GOOD, "boxes": [{**GOOD["boxes"][0], "instance": ""}]}, "boxes[0].instance"),
    ({**GOOD, "extra": 1}, "'extra'"),
]


async def test_update_mismatch_is_shown_in_status_metrics_and_the_cli(api: tuple[Manager, TestClient]) -> None:
    manager, client = api
    insts = [manager.registry.add("127.0.0.1", port, Kind.REMOTE) for port in (9001, 9002, 9003)]
    boxes = [{"instance": i.id, "endpoint": i.endpoint, "tokens": 100, "mean_abs_diff": gap, "k3_kl": gap / 10}
             for i, gap in zip(insts, (0.02, 0.03, 0.6))]
    r = await client.post("/update_mismatch", json={"step": 12, "boxes": [*boxes, {**boxes[0], "instance": "gone"}]})
    assert r.status == 200, await r.text()
    answer = await r.json()
    assert answer["recorded"] == 3 and answer["unknown_instances"] == ["gone"]
    assert answer["fleet"]["outliers"] == [insts[2].id]

    st = (await (await client.get("/get_instances_status")).json())
    by_id = {i["id"]: i["mismatch"] for i in st["instances"]}
    bad = by_id[insts[2].id]
    assert bad["mean_abs_diff"] == pytest.approx(0.6) and bad["last_step"] == 12
    assert bad["ratio_to_median"] == pytest.approx(0.6 / 0.03) and bad["above_median_multiple"]
    assert not by_id[insts[0].id]["above_median_multiple"]
    assert st["mismatch"]["median_mean_abs_diff"] == pytest.approx(0.03) and st["mismatch"]["last_step"] == 12

    samples = await _metrics(client)
    ep = insts[2].endpoint
    assert samples[("rollout_manager_instance_mismatch_abs_logprob", ep)] == pytest.approx(0.6)
    assert samples[("rollout_manager_instance_mismatch_outlier", ep)] == 1
    assert samples[("rollout_manager_instance_mismatch_outlier", insts[0].endpoint)] == 0
    assert samples[("rollout_manager_instance_mismatch_last_step", ep)] == 12
    assert samples[("rollout_manager_mismatch_fleet_median", "")] == pytest.approx(0.03)
    assert samples[("rollout_manager_mismatch_fleet_wide", "")] == 0

    text = render_status(st, "http://m")
    assert "MISMATCH" in text and "0.6000 (20.0x) !" in text
    assert "log-prob mismatch (step 12): median 0.0300; 1 instance(s) above 3x the fleet's median" in text


@pytest.mark.parametrize("body, field", GARBAGE, ids=[f for _, f in GARBAGE])
async def test_garbage_is_refused_naming_the_field_and_changes_nothing(api: tuple[Manager, TestClient],
                                                                       body: dict[str, Any], field: str) -> None:
    manager, client = api
    inst = manager.registry.add("127.0.0.1", 9001, Kind.REMOTE)
    body = {**body, "boxes": [{**b, "instance": inst.id} if b.get("instance") else b for b in body["boxes"]]} \
        if isinstance(body.get("boxes"), list) else body
    before = await (await client.get("/get_instances_status")).json()
    r = await client.post("/update_mismatch", json=body)
    assert r.status == 400
    err = await r.json()
    assert set(err) == {"error"} and field in err["error"], err
    after = await (await client.get("/get_instances_status")).json()
    assert after["mismatch"] == before["mismatch"] and after["instances"][0]["mismatch"] is None
    assert manager.mismatch.by_instance == {}


# ------------------------------------------------------------------ the trainer mode's hook, end to end
V1_MISSING = [m for m in ("verl", "transfer_queue", "cachetools", "fastapi", "uvicorn")
              if importlib.util.find_spec(m) is None]


@pytest.mark.slow  # imports verl's V1 trainer (seconds) and starts a real manager
@pytest.mark.skipif(bool(V1_MISSING), reason=f"verl 0.9.1's V1 trainers need {', '.join(V1_MISSING)}")
async def test_trainer_mode_posts_each_boxs_mismatch_after_the_step(start_manager, stub_engine, monkeypatch):
    """verl's ``_compute_old_log_prob`` runs (stubbed: no cluster), the hook reads the micro-batch back from
    TransferQueue (stubbed with the shape it returns), and after the step the manager shows the figures."""
    import transfer_queue
    from omegaconf import OmegaConf
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    from trainer_plugin.verl_trainer import PPOTrainerSyncWithManager

    m = await start_manager()
    engines = [await stub_engine(), await stub_engine()]
    ids = []
    for e in engines:
        status, body = await m.post("/register_rollout_instance", {"host": "127.0.0.1", "port": e.port})
        assert status == 200
        ids.append(body["id"])
    seg = [{"instance": ids[0], "endpoint": engines[0].endpoint, "start": 0, "end": 2},
           {"instance": ids[1], "endpoint": engines[1].endpoint, "start": 2, "end": 4}]
    data = TensorDict({"old_log_probs": torch.tensor([[-1.0, -1.0, -1.0, -1.0]]),
                       "rollout_log_probs": torch.tensor([[-1.0, -1.0, -3.0, -3.0]]),
                       "response_mask": torch.ones(1, 4, dtype=torch.int64),
                       "extra_fields": NonTensorStack({"segments": seg})}, batch_size=[1])
    read: list[list[str]] = []

    def kv_batch_get(keys, partition_id, select_fields):
        read.append(list(select_fields))
        return data

    monkeypatch.setattr(PPOTrainerSync, "_compute_old_log_prob", lambda self, batch, metrics: batch)
    monkeypatch.setattr(transfer_queue, "kv_batch_get", kv_batch_get)

    class Checkpoints:
        def update_weights(self, step):
            pass

        def sleep_replicas(self):
            pass

    t = object.__new__(PPOTrainerSyncWithManager)  # the hooks only; verl's __init__ needs a cluster
    t.config = OmegaConf.create({"data": {"train_batch_size": 1}, "algorithm": {}, "actor_rollout_ref": {"rollout": {
        "n": 1, "calculate_log_probs": True,
        "custom": {"rollout_manager": {"host": "127.0.0.1", "port": int(m.url.rsplit(":", 1)[1])}}}}})
    t.checkpoint_manager, t.timing_raw, t.curr_step_profile, t.global_steps = Checkpoints(), {}, False, 9

    def one_step() -> dict[str, float]:
        t.on_step_begin()
        batch = type("Batch", (), {"keys": ["k0"], "partition_id": "train"})()
        t._compute_old_log_prob(batch, {})
        t.on_step_end()
        return t._consume_sync_metrics()

    logged = await asyncio.to_thread(one_step)
    assert read == [["old_log_probs", "rollout_log_probs", "response_mask", "extra_fields"]]
    assert logged[f"rollout_manager/mismatch/{ids[0]}/mean_abs_diff"] == 0.0
    assert logged[f"rollout_manager/mismatch/{ids[1]}/mean_abs_diff"] == pytest.approx(2.0)
    st = await m.status()
    figures = {i["id"]: i["mismatch"] for i in st["instances"]}
    assert figures[ids[1]]["mean_abs_diff"] == pytest.approx(2.0) and figures[ids[1]]["last_step"] == 9
    assert figures[ids[0]]["tokens"] == 2 and st["mismatch"]["last_step"] == 9


@pytest.mark.slow
@needs_chromium
async def test_status_page_shows_each_instances_mismatch_and_the_fleets(tmp_path):
    """The page renders the figure the status carries: a column per instance (marked when called out) and
    a card with the fleet's median and note."""
    ledger = MismatchLedger(MismatchSettings(alpha=1.0))
    ledger.report(12, [BoxReport("i1", 100, 0.02, 0.001), BoxReport("i2", 100, 0.03, 0.002),
                       BoxReport("i3", 100, 0.6, 0.2)])
    fleet = ledger.fleet()

    async def status(request: web.Request) -> web.Response:
        return web.json_response({
            "ready_instances": 3, "pending_instances": 0, "weight_version": 0,
            "counts": {"syncing": 3}, "generation": {}, "requests_waiting_for_instance": 0,
            "instances": [{**syncing_instance(p), "mismatch": ledger.of(f"i{p}", fleet)} for p in (1, 2, 3)],
            "mismatch": ledger.summary(),
            "local": {"open": False, "budget_s": 1.0}, "weight_senders": {"senders": []},
            "recent_events": [], "recent_weight_pushes": [],
        })

    dom = await render_page(tmp_path, status)
    assert text_of(dom, "c-mismatch") == "0.0300"
    assert text_of(dom, "c-mismatch-s").startswith("step 12 \u00b7 1 instance(s) above 3x")
    rows = tbody(dom, "instances")
    assert re.search(r'class="num lag" title="mismatch 20.0x the fleet\'s median[^"]*">0.6000 \(20.0\u00d7\)<', rows)
    assert re.search(r'class="num" title="ok [^"]*">0.0200 \(0.7\u00d7\)<', rows), rows
