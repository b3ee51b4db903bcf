"""Answers delivered before their box was caught (issue 39, item 3): what a quarantined box made after its last
passing probe and delivered is listed (``GET /distrusted_samples``), and the trainer plugin drops those samples
before the actor update. The manager's ledger is pure (``rollout.provisional``); the plugin's match is pure
(``trainer_plugin.distrust``); the end to end runs against CPU engines (``test_quarantine``) and an in-process
manager with verl's V1 trainer hooks (TransferQueue stubbed with the shape it returns)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from typing import Any

import numpy as np
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
from trainer_plugin.distrust import (
    DROPPED_UID,
    DistrustFilter,
    SegmentKey,
    distrusted_rows,
    drop_fields,
    zero_rows,
)


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


N = 4  # samples per prompt (rollout.n)
REWARDS = {"p0": [1.0, 0.0, 0.0, 1.0], "p1": [1.0, 1.0, 0.0, 0.0]}
PROMPT_LEN = 3


@pytest.fixture(scope="module")
def transfer_queue() -> Iterator[Any]:
    """verl's TransferQueue as ``TaskRunnerV1.run`` starts it (on a small local Ray), closed afterwards."""
    import os

    import ray
    import transfer_queue as tq
    from omegaconf import OmegaConf

    ray.init(address="local", num_cpus=4, num_gpus=0, include_dashboard=False, object_store_memory=100 << 20,
             logging_level="WARNING")
    try:
        cfg = OmegaConf.load(os.path.join(os.path.dirname(tq.__file__), "config.yaml"))
        cfg.backend.SimpleStorage.num_data_storage_units = 1
        tq.init(cfg)
        try:
            yield tq
        finally:
            tq.close()
    finally:
        ray.shutdown()


def _verl_config(port: int) -> Any:
    """verl's own ppo_trainer config (GRPO, n samples a prompt), the plugin's manager address in it."""
    from hydra import compose, initialize_config_module

    with initialize_config_module("verl.trainer.config", version_base=None):
        return compose("ppo_trainer", overrides=[
            "algorithm.adv_estimator=grpo", f"actor_rollout_ref.rollout.n={N}", "data.train_batch_size=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
            "actor_rollout_ref.actor.loss_agg_mode=token-mean",
            "+actor_rollout_ref.rollout.custom.rollout_manager.host=127.0.0.1",
            f"+actor_rollout_ref.rollout.custom.rollout_manager.port={port}"])


def _put_groups(tq: Any) -> Any:
    """Two GRPO groups of N samples in TransferQueue as verl's agent loop puts them (``{uid}_{session}_{i}``
    keys, a reward on each response's last token, the proxy's ``extra_fields``), each of a box of its own."""
    from verl.trainer.ppo.v1.replay_buffer import KVBatchMeta
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    keys, fields = [], []
    for uid, rewards in REWARDS.items():
        for j, reward in enumerate(rewards):
            n = 3 + j  # response lengths differ: jagged rows
            scores = torch.zeros(n)
            scores[-1] = reward
            keys.append(f"{uid}_{j}_0")
            fields.append({"prompts": torch.arange(PROMPT_LEN) + 1, "responses": torch.arange(n) + 10,
                           "response_mask": torch.ones(n, dtype=torch.int64),
                           "loss_mask": torch.ones(n, dtype=torch.int64), "rm_scores": scores,
                           "old_log_probs": torch.full((n,), -1.0), "uid": uid,
                           "extra_fields": {"request_id": f"{uid}-{j}",
                                            "segments": [_seg(f"inst-{uid}-{j}", 0, n)]}})
    tq.kv_batch_put(keys=keys, partition_id="train", fields=list_of_dict_to_tensordict(fields))
    return KVBatchMeta(partition_id="train", keys=keys, tags=[{} for _ in keys])


def _grpo(rewards: list[float]) -> torch.Tensor:
    """verl's own GRPO advantage of one group's samples (one per sample: they are constant along a row)."""
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    scores = torch.tensor(rewards).unsqueeze(-1)
    adv, _ = compute_grpo_outcome_advantage(scores, torch.ones_like(scores), np.array(["g"] * len(rewards)))
    return adv[:, 0]


class ActorStandIn:
    """The training ranks' ``update_actor`` as verl's engine runs it, less the model: the micro-batch read back
    from TransferQueue, ``batch_num_tokens`` summed over ``loss_mask`` (``FSDPEngine.forward_backward_batch``),
    and verl's own ``ppo_loss`` on log-probs that require a gradient."""

    def __init__(self, config: Any) -> None:
        from verl.utils.config import omega_conf_to_dataclass

        self.config = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
        self.seen: dict[str, Any] = {}

    def update_actor(self, batch: Any) -> dict[str, Any]:
        import transfer_queue as tq
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.losses import ppo_loss

        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=[
            "prompts", "responses", "response_mask", "loss_mask", "old_log_probs", "advantages"])
        tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=int(data["loss_mask"].sum()),
                             global_batch_size=len(batch.keys))
        total = int(data["prompts"].offsets().diff().sum() + data["responses"].offsets().diff().sum())
        log_probs = torch.full((total,), -0.9, requires_grad=True)
        loss, _ = ppo_loss(self.config, {"log_probs": log_probs}, data)
        loss.backward()
        self.seen = {"advantages": data["advantages"], "grad": log_probs.grad, "data": data,
                     "batch_num_tokens": data["batch_num_tokens"]}
        return {"metrics": {"mfu": 0.0, "pg_loss": float(loss)}}


async def test_distrusted_samples_leave_their_groups_before_verls_advantages(api: tuple[Manager, TestClient],
                                                                            transfer_queue: Any) -> None:
    """Issue 46, item 5: a sample listed as distrusted is out of its GRPO group before verl computes the
    advantages (verl's own ``_compute_advantage`` over TransferQueue), so its siblings' advantages are GRPO's
    over them alone; one listed only after the advantages were computed makes the plugin compute them again
    before verl's ``_update_actor``, whose loss (verl's ``ppo_loss``) gets no gradient and no token count from
    either. Zeroing the masks after the advantages (the plugin before) kept the dropped sample's reward in its
    siblings' baseline: their advantages would be GRPO's over all four."""
    from trainer_plugin.verl_trainer import PPOTrainerSyncWithManager

    tq = transfer_queue
    manager, client = api
    ledger = manager.generator.migrator.provisional
    batch = _put_groups(tq)
    t = object.__new__(PPOTrainerSyncWithManager)
    t.config = _verl_config(client.server.port)
    t.actor_rollout_wg = actor = ActorStandIn(t.config)
    t.global_steps = 1

    def distrust(uid: str, j: int) -> None:
        ledger.finished(finished(f"{uid}-{j}", Segment(f"inst-{uid}-{j}", "h:1", "0", 0, 3 + j, "ok")))
        ledger.distrust(f"inst-{uid}-{j}", "quarantined: test", quarantined=True)

    def advantages(uid: str) -> torch.Tensor:
        got = tq.kv_batch_get(keys=[k for k in batch.keys if k.startswith(uid)], partition_id="train",
                              select_fields=["advantages"])["advantages"]
        return torch.stack([row[0] for row in got.unbind()])

    distrust("p0", 3)  # caught before the step: out of p0's group before its advantages
    metrics: dict[str, Any] = {}
    await asyncio.to_thread(t._compute_advantage, batch, metrics)
    assert metrics["rollout_manager/distrusted_samples_dropped"] == 1.0
    p0 = advantages("p0")
    assert torch.allclose(p0[:3], _grpo(REWARDS["p0"][:3])) and p0[3] == 0
    assert not torch.allclose(p0[:3], _grpo(REWARDS["p0"])[:3])  # what keeping it in the baseline gives
    assert torch.allclose(advantages("p1"), _grpo(REWARDS["p1"]))

    distrust("p1", 0)  # caught after the advantages, before the actor update: p1's computed again
    await asyncio.to_thread(t._update_actor, batch, metrics)
    assert metrics["rollout_manager/distrusted_samples_dropped"] == 2.0
    assert metrics["rollout_manager/distrusted_advantages_recomputed"] == 1.0
    p1 = advantages("p1")
    assert p1[0] == 0 and torch.allclose(p1[1:], _grpo(REWARDS["p1"][1:]))
    assert torch.allclose(advantages("p0")[:3], _grpo(REWARDS["p0"][:3]))  # p0's as before
    # verl's loss over what the actor update read: no gradient through the dropped samples' tokens, and
    # their tokens are not in the token-mean's count
    lengths = [3 + j for j in range(N)] * 2
    dropped = {3, N + 0}
    assert actor.seen["batch_num_tokens"] == sum(n for i, n in enumerate(lengths) if i not in dropped)
    grad, at = actor.seen["grad"], 0
    for i, n in enumerate(lengths):
        response = grad[at + PROMPT_LEN - 1: at + PROMPT_LEN - 1 + n]
        at += PROMPT_LEN + n
        if i in dropped:
            assert not response.any(), i
        elif not math.isclose(float(advantages("p0" if i < N else "p1")[i % N]), 0.0, abs_tol=1e-6):
            assert response.abs().min() > 0, i
    # nothing new: nothing written, nothing computed again
    metrics = {}
    await asyncio.to_thread(t._update_actor, batch, metrics)
    assert "rollout_manager/distrusted_advantages_recomputed" not in metrics
    # a manager that cannot be reached: a warning, the step goes on, said in the metrics
    t._rm_distrust = DistrustFilter("http://127.0.0.1:9")
    metrics = {}
    await asyncio.to_thread(t._compute_advantage, batch, metrics)
    assert metrics["rollout_manager/distrust_check_failed"] == 1.0 and "advantages" in str(
        tq.kv_batch_get(keys=batch.keys[:1], partition_id="train", select_fields=["advantages"]).keys())
    tq.kv_clear(keys=batch.keys, partition_id="train")


def test_drop_fields_writes_nothing_when_nothing_matches() -> None:
    data = TensorDict({"response_mask": torch.ones(1, 2), "uid": NonTensorStack("u"), "extra_fields":
                       NonTensorStack({"request_id": "x", "segments": [_seg("a", 0, 2)]})}, batch_size=[1])
    assert drop_fields(data, ["u_0_0"], DistrustFilter("http://unused")) == ({}, [])


def test_drop_fields_gives_each_dropped_sample_a_group_of_its_own() -> None:
    data = TensorDict({"response_mask": torch.ones(2, 2), "uid": NonTensorStack("u", "u"), "extra_fields":
                       NonTensorStack({"request_id": "x", "segments": [_seg("a", 0, 2, "ok; distrusted: q")]},
                                      {"request_id": "y", "segments": [_seg("a", 0, 2)]})}, batch_size=[2])
    fields, dropped = drop_fields(data, ["u_0_0", "u_1_0"], DistrustFilter("http://unused"))
    assert dropped == ["u_0_0"] and fields["uid"] == [DROPPED_UID + "u_0_0", "u"]
    assert fields["response_mask"].tolist() == [[0, 0], [1, 1]]
    assert drop_fields(data, ["u_0_0", "u_1_0"], DistrustFilter("http://unused"), {"u_0_0"}) == ({}, [])


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
    from rollout_manager.placement.dispatch import Dispatcher
    from rollout_manager.placement.least_in_flight import LeastInFlight
    from rollout_manager.rollout.migration import Migrator

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
