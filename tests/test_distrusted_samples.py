"""Answers delivered before their box was caught (issue 39, item 3): what a quarantined box made after its last
passing probe and delivered is listed (``GET /distrusted_samples``), and the trainer plugin drops those samples
before the actor update. The manager's ledger is pure (``rollout.provisional``); the plugin's match is pure
(``trainer_plugin.distrust``); the end to end runs against CPU engines (``test_quarantine``) and an in-process
manager with verl's V1 trainer hooks (TransferQueue stubbed with the shape it returns)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from aiohttp import web
from aiohttp.test_utils import TestClient
from tensordict import NonTensorStack, TensorDict
from test_metrics_status import needs_chromium, render_page, syncing_instance, tbody, text_of

from rollout_manager.manager import Manager
from rollout_manager.ops import render_status
from rollout_manager.rollout import provisional as provisional_mod
from rollout_manager.rollout.provisional import Provisional
from rollout_manager.rollout.request import decode
from rollout_manager.rollout.sequence import Segment, SequenceState
from rollout_manager.sglang.finish import FinishReason
from trainer_plugin.distrust import DistrustFilter, SegmentKey, distrusted_rows, drop_distrusted, zero_rows


def finished(rid: str, *segments: Segment) -> SequenceState:
    seq = SequenceState(decode({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 8}}).sequences[0].body,
                        rid)
    seq.segments[:] = list(segments)
    seq.finish = FinishReason.of("length", length=8)
    return seq


# ------------------------------------------------------------------ the manager's ledger
def test_unvouched_answers_wait_for_a_probe_and_are_listed_when_their_box_is_quarantined() -> None:
    p = Provisional(wall=lambda: 5.0)
    vouched = Segment("a", "a:1", "0", 0, 4, "ok", trusted=4)
    early = Segment("a", "a:1", "0", 0, 6, "ok", trusted=2)  # vouched up to token 2
    other = Segment("b", "b:1", "0", 6, 8, "ok")
    p.finished(finished("r1", vouched))
    p.finished(finished("r2", early, other))
    assert p.pending("a") == [early] and p.pending("b") == [other]
    # a probe of b was sent now and passed: it vouches for what b delivered
    for seg in p.pending("b"):
        seg.trusted = seg.end
    p.settle("b")
    assert p.pending("b") == []
    assert p.distrust("a", "quarantined: probe") == 1
    page = p.since(0)
    assert page["last"] == 1 and page["missed"] == 0
    assert [(s["request_id"], s["instance"], s["start"], s["end"], s["first"]) for s in page["samples"]] == \
        [("r2", "a", 0, 6, 2)]
    # while a is distrusted, what it finishes is listed at once; once trusted again, kept for the next probe
    r3 = finished("r3", Segment("a", "a:1", "0", 0, 3, "ok"))
    p.finished(r3)
    assert [s["request_id"] for s in p.since(1)["samples"]] == ["r3"]
    assert r3.segments[0].outcome == "ok; distrusted: quarantined: probe"  # its answer, built next, says so
    p.trust_again("a")
    p.finished(finished("r4", Segment("a", "a:1", "1", 0, 3, "ok")))
    assert p.since(2)["samples"] == [] and len(p.pending("a")) == 1
    assert p.status()["distrusted_tokens"] == 4 + 3 and p.status()["pending_segments"] == 1
    p.forget("a")  # removed: nothing will judge what it made
    assert p.status()["forgotten_tokens"] == 3 and p.status()["pending_segments"] == 0


def test_a_reader_that_fell_behind_the_kept_samples_is_told(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(provisional_mod, "KEEP_DISTRUSTED", 2)
    p = Provisional()
    p.distrusted = type(p.distrusted)(maxlen=2)
    p.distrust("a", "q")
    for i in range(4):
        p.finished(finished(f"r{i}", Segment("a", "a:1", "0", 0, 2, "ok")))
    page = p.since(0)
    assert [s["number"] for s in page["samples"]] == [3, 4] and page["missed"] == 2 and page["last"] == 4


# ------------------------------------------------------------------ the plugin's match
def _seg(instance: str, start: int, end: int, outcome: str = "ok") -> dict[str, Any]:
    return {"instance": instance, "endpoint": f"{instance}:1", "weight_version": "0", "start": start, "end": end,
            "outcome": outcome}


def test_a_sample_is_dropped_for_a_listed_segment_or_a_distrusted_outcome() -> None:
    keys = {SegmentKey("r1", "a", 0, 6)}
    extras = [{"request_id": "r1", "segments": [_seg("a", 0, 6)]},
              {"request_id": "r1", "segments": [_seg("a", 0, 5)]},  # another segment under a reused id
              {"request_id": "r2", "segments": [_seg("b", 0, 3), _seg("a", 3, 6, "ok; distrusted: quarantined")]},
              {"request_id": "r3", "segments": [_seg("b", 0, 3)]},
              None]
    assert distrusted_rows(extras, keys) == [True, False, True, False, False]


def test_the_masks_of_dropped_samples_are_zeroed_in_jagged_and_padded_rows() -> None:
    jagged = torch.nested.as_nested_tensor([torch.ones(3, dtype=torch.int64), torch.ones(2, dtype=torch.int64)],
                                           layout=torch.jagged)
    out = zero_rows(jagged, [False, True])
    assert [t.tolist() for t in out.unbind()] == [[1, 1, 1], [0, 0]]
    padded = zero_rows(torch.ones(2, 3), [True, False])
    assert padded.tolist() == [[0, 0, 0], [1, 1, 1]]


# ------------------------------------------------------------------ the manager's endpoint and verl's hook
async def test_the_endpoint_pages_by_number_and_refuses_garbage(api: tuple[Manager, TestClient]) -> None:
    manager, client = api
    ledger = manager.generator.migrator.provisional
    ledger.finished(finished("r1", Segment("inst-9", "h:1", "0", 0, 4, "ok")))
    ledger.distrust("inst-9", "quarantined: test")
    r = await client.get("/distrusted_samples")
    assert r.status == 200
    page = await r.json()
    assert page["last"] == 1 and page["samples"][0]["request_id"] == "r1"
    assert (await (await client.get("/distrusted_samples?after=1")).json())["samples"] == []
    for bad in ("-1", "x", "1" * 19):
        r = await client.get(f"/distrusted_samples?after={bad}")
        assert r.status == 400 and "after" in (await r.json())["error"]
    st = await (await client.get("/get_instances_status")).json()
    assert st["quarantine"]["delivered"]["distrusted_samples"] == 1


async def test_the_trainer_drops_distrusted_samples_before_the_actor_update(api: tuple[Manager, TestClient],
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """verl's ``_update_actor`` (stubbed: no cluster) runs after the hook zeroed the masks of the listed sample
    in TransferQueue (stubbed with the shape ``kv_batch_get`` returns)."""
    import transfer_queue
    from omegaconf import OmegaConf
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    from trainer_plugin.verl_trainer import PPOTrainerSyncWithManager

    manager, client = api
    ledger = manager.generator.migrator.provisional
    ledger.finished(finished("bad", Segment("inst-1", "h:1", "0", 2, 4, "ok")))
    ledger.distrust("inst-1", "quarantined: test")
    ones = [torch.ones(4, dtype=torch.int64), torch.ones(3, dtype=torch.int64)]
    data = TensorDict({"response_mask": torch.nested.as_nested_tensor(ones, layout=torch.jagged),
                       "loss_mask": torch.nested.as_nested_tensor(ones, layout=torch.jagged),
                       "extra_fields": NonTensorStack(
                           {"request_id": "bad", "segments": [_seg("inst-0", 0, 2), _seg("inst-1", 2, 4)]},
                           {"request_id": "good", "segments": [_seg("inst-0", 0, 3)]})}, batch_size=[2])
    written: dict[str, Any] = {}
    seen_at_update: list[dict[str, Any]] = []
    monkeypatch.setattr(transfer_queue, "kv_batch_get", lambda keys, partition_id, select_fields: data)
    monkeypatch.setattr(transfer_queue, "kv_batch_put",
                        lambda keys, partition_id, fields: written.update(fields))
    monkeypatch.setattr(PPOTrainerSync, "_update_actor",
                        lambda self, batch, metrics: seen_at_update.append(dict(written)) or batch)
    t = object.__new__(PPOTrainerSyncWithManager)
    port = client.server.port
    t.config = OmegaConf.create({"data": {"train_batch_size": 1}, "algorithm": {}, "actor_rollout_ref": {"rollout": {
        "n": 1, "custom": {"rollout_manager": {"host": "127.0.0.1", "port": port}}}}})
    batch = type("Batch", (), {"keys": ["k0", "k1"], "partition_id": "train"})()
    metrics: dict[str, Any] = {}
    await asyncio.to_thread(t._update_actor, batch, metrics)
    assert metrics["rollout_manager/distrusted_samples_dropped"] == 1.0
    assert len(seen_at_update) == 1  # verl's update ran after the masks were written back
    for name in ("response_mask", "loss_mask"):
        assert [row.tolist() for row in seen_at_update[0][name].unbind()] == [[0, 0, 0, 0], [1, 1, 1]]
    # a manager that cannot be reached: a warning, the step goes on, said in the metrics
    t._rm_distrust = DistrustFilter("http://127.0.0.1:9")
    metrics = {}
    await asyncio.to_thread(t._update_actor, batch, metrics)
    assert metrics["rollout_manager/distrust_check_failed"] == 1.0 and len(seen_at_update) == 2


def test_drop_distrusted_writes_nothing_when_nothing_matches() -> None:
    data = TensorDict({"response_mask": torch.ones(1, 2), "extra_fields": NonTensorStack(
        {"request_id": "x", "segments": [_seg("a", 0, 2)]})}, batch_size=[1])
    assert drop_distrusted(data, DistrustFilter("http://unused")) == ({}, 0)


# ------------------------------------------------------------------ shown beside the mismatch
def _trusted(port: int, verdict: str, **extra: Any) -> dict[str, Any]:
    trust = {"state": verdict, "version": 0, "diff": 0.0123 if verdict == "disagrees" else 0.0, "detail": "d",
             "checked_at": 1.0, "probes": 7, "disagreements": int(verdict == "disagrees"), "last_probe_error": None}
    return {**syncing_instance(port), "state": "active", "trust": trust, "mismatch": None, "quarantined": None,
            **extra}


QUARANTINE = {"enabled": True, "min_active": 1, "quarantined": 1, "lifted": 0, "held_by_floor": None,
              "fleet_wide": None, "quarantined_now": ["i3"], "distrusted_spans": [],
              "delivered": {"pending_segments": 2, "distrusted_samples": 4,
                            "distrusted_tokens": 52, "forgotten_tokens": 0, "distrusting": ["i3"]}}
INSTANCES = [_trusted(1, "checked"), _trusted(2, "disagrees"),
             _trusted(3, "disagrees", state="syncing", quarantined="its trust probe disagrees"),
             _trusted(4, "provisional")]


def test_the_cli_shows_each_boxs_probe_verdict_and_the_quarantine() -> None:
    st = {"weight_version": 0, "counts": {"active": 3, "syncing": 1}, "instances": INSTANCES,
          "quarantine": QUARANTINE}
    text = render_status(st, "http://m")
    header = text.splitlines()[1]
    assert header.index("TRUST") < header.index("MISMATCH")
    rows = {line.split()[0]: line for line in text.splitlines()[2:6]}
    assert "checked" in rows["127.0.0.1:1"] and "disagrees (0.0123) !" in rows["127.0.0.1:2"]
    assert "quarantined !" in rows["127.0.0.1:3"] and "provisional" in rows["127.0.0.1:4"]
    assert ("quarantine: 1 out now (i3), 1 quarantined and 0 readmitted in all; 4 delivered answer segment(s) "
            "distrusted (52 tokens: GET /distrusted_samples)") in text
    quiet = render_status({**st, "quarantine": {**QUARANTINE, "quarantined": 0, "quarantined_now": [],
                                                "delivered": {}}}, "http://m")
    assert "quarantine:" not in quiet


@pytest.mark.slow
@needs_chromium
async def test_the_status_page_shows_each_boxs_probe_verdict_and_the_quarantine(tmp_path) -> None:
    async def status(request: web.Request) -> web.Response:
        return web.json_response({
            "ready_instances": 3, "pending_instances": 1, "weight_version": 0,
            "counts": {"active": 3, "syncing": 1}, "generation": {}, "requests_waiting_for_instance": 0,
            "instances": INSTANCES, "mismatch": {}, "quarantine": QUARANTINE,
            "local": {"open": False, "budget_s": 1.0}, "weight_senders": {"senders": []},
            "recent_events": [], "recent_weight_pushes": []})

    dom = await render_page(tmp_path, status)
    assert text_of(dom, "c-trust") == "1 / 4 checked"
    assert text_of(dom, "c-trust-s") == "1 quarantined now \u00b7 4 delivered segment(s) distrusted"
    rows = tbody(dom, "instances")
    assert ">checked<" in rows and ">disagrees (0.0123)<" in rows and ">quarantined<" in rows
    assert 'class="muted" title="d' in rows  # provisional, muted


# ------------------------------------------------------------------ a probe's mark costs what its box made
def test_a_mark_looks_only_at_the_sequences_with_segments_of_its_box() -> None:
    from rollout_manager.instances.registry import Kind, Registry
    from rollout_manager.rollout.dispatch import Dispatcher
    from rollout_manager.rollout.migration import Migrator
    from rollout_manager.rollout.scheduling import LeastInFlight

    registry = Registry()
    a, b, c = (registry.add("127.0.0.1", port, Kind.REMOTE) for port in (1, 2, 3))
    migrator = Migrator(Dispatcher(registry, LeastInFlight()), None, None, 1.0, lambda seq: None, {})  # type: ignore[arg-type]
    moved = finished("moved", Segment(a.id, a.endpoint, "0", 0, 4, "migrated"), Segment(b.id, b.endpoint, "0", 4, 6))
    moved.finish = None
    on_c = finished("on-c", Segment(c.id, c.endpoint, "0", 0, 3))
    on_c.finish = None
    migrator.enter(1, moved, b, "r1")
    migrator.enter(2, on_c, c, "r2")
    assert set(migrator._by_instance) == {a.id, b.id, c.id} and list(migrator._by_instance[a.id]) == [1]
    vouch = migrator.mark(a, 0)
    assert vouch() == 1 and moved.segments[0].trusted == 4 and moved.segments[1].trusted is None
    moved.finish = FinishReason.of("length", length=8)
    migrator.leave(1, moved, moved.segments[-1])  # finished: b's unvouched segment waits for b's probe
    assert set(migrator._by_instance) == {c.id}
    assert migrator.provisional.pending(b.id) == [moved.segments[1]] and migrator.provisional.pending(a.id) == []
    assert migrator.mark(b, 0)() == 1 and migrator.provisional.pending(b.id) == []
