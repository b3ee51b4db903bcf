"""verl V1 trainer mode ``rollout_manager_sync``: verl's sync trainer plus per-step manager metrics.

verl 0.9.1's V1 trainer (``trainer.use_v1=true``, the default) takes its class from
``TRAINER_REGISTRY[trainer.v1.trainer_mode]`` and calls hooks around each step
(``on_step_begin``, ``on_sample_begin``/``on_sample_end`` around the wait for finished rollout
groups, ``on_step_end`` where weights are synced); whatever ``on_step_end`` leaves in
``_pending_sync_metrics`` is logged with that step's metrics. That is the smallest place to hook
the metrics the manager needs: :class:`ManagerMetricsMixin` times the step and the trainer's wait
for rollouts (its bubble), posts ``step_time_s``, ``trainer_bubble_time_s`` and ``step_throughput``
(samples per second) to ``/update_metrics`` after the weight sync, and logs the manager's answer
(local budget, remote idle time, generation counters) under ``rollout_manager/``. Before verl computes a
micro-batch's advantages, and again before the actor update, it drops the samples a quarantined box made
unvouched (:mod:`trainer_plugin.distrust`). Everything else is verl's ``PPOTrainerSync``. A manager that
cannot be reached costs a warning, never the step.

Importing this module imports verl's V1 trainer (TransferQueue included, seconds), so the plugin
registers it only when verl itself imports ``verl.trainer.ppo.v1`` (see
:func:`trainer_plugin.verl_registration.register_trainer_when_loaded`). Importing this module first
registers the mode too (at its end): then verl's V1 package is loaded from here, before
:func:`register` exists, and the post-import hook leaves the registration to this module.
"""

from __future__ import annotations

import logging
from typing import Any

from omegaconf import open_dict
from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY, register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

from .distrust import READ_FIELDS, DistrustFilter, drop_fields
from .metrics import StepTimer, as_log_metrics, post_mismatch_sync, post_step_metrics_sync
from .mismatch import FIELDS, StepMismatch, tally_batch
from .settings import PluginSettings, from_rollout_config

log = logging.getLogger("trainer_plugin.trainer")
TRAINER_MODE = "rollout_manager_sync"


class ManagerMetricsMixin:
    """Step and bubble timing posted to the manager; mix in before a verl V1 ``PPOTrainer``."""

    config: Any
    global_steps: int
    _rm_timer: StepTimer | None = None
    _rm_mismatch: StepMismatch | None = None
    _rm_distrust: DistrustFilter | None = None
    _rm_dropped: set[str] | None = None  # the micro-batch's samples dropped so far (their TransferQueue keys)

    @property
    def _rm_settings(self) -> PluginSettings:
        return from_rollout_config(self.config.actor_rollout_ref.rollout)

    def _rm_samples_per_step(self) -> int:
        return int(self.config.data.train_batch_size) * int(self.config.actor_rollout_ref.rollout.n)

    def _build_replay_buffer(self) -> Any:
        # verl's buffer sleeps poll_interval (2 s) between looks at TransferQueue: up to 2 s of idle
        # trainer per sampled micro-batch once its last group is done
        buffer = super()._build_replay_buffer()  # type: ignore[misc]
        if hasattr(buffer, "poll_interval"):
            buffer.poll_interval = self._rm_settings.replay_poll_interval_s
        return buffer

    def on_train_begin(self) -> None:
        super().on_train_begin()  # type: ignore[misc]
        try:
            log.info(stream_granularity_note(self.config, getattr(self, "parameter_sync_step", 1)))
        except Exception:
            pass

    def on_step_begin(self) -> None:
        super().on_step_begin()  # type: ignore[misc]
        if self._rm_timer is None:
            self._rm_timer = StepTimer()
        self._rm_timer.start_step()

    def on_sample_begin(self) -> None:
        super().on_sample_begin()  # type: ignore[misc]
        if self._rm_timer is not None:
            self._rm_timer.begin_wait()

    def on_sample_end(self) -> None:
        if self._rm_timer is not None:
            self._rm_timer.end_wait()
        super().on_sample_end()  # type: ignore[misc]

    def _compute_old_log_prob(self, batch: Any, metrics: dict[str, Any]) -> Any:
        batch = super()._compute_old_log_prob(batch, metrics)  # type: ignore[misc]
        try:
            self._rm_tally_mismatch(batch)
        except Exception as exc:  # attribution is a report: it never costs the step
            log.warning("per-box log-prob mismatch not computed: %s", exc)
        return batch

    def _compute_advantage(self, batch: Any, metrics: dict[str, Any]) -> Any:
        # Distrusted samples leave before the advantages: a dropped sample must not set its siblings' baseline.
        self._rm_dropped = set()
        self._rm_check_distrusted(batch, metrics)
        return super()._compute_advantage(batch, metrics)  # type: ignore[misc]

    def _update_actor(self, batch: Any, metrics: dict[str, Any]) -> Any:
        # As late as can be: a box quarantined since the advantages were computed is caught too, and the
        # advantages are computed again without its samples (cheap: no model runs for them).
        if self._rm_check_distrusted(batch, metrics):
            batch = super()._compute_advantage(batch, metrics)  # type: ignore[misc]
            metrics["rollout_manager/distrusted_advantages_recomputed"] = 1.0
        return super()._update_actor(batch, metrics)  # type: ignore[misc]

    def _rm_check_distrusted(self, batch: Any, metrics: dict[str, Any]) -> int:
        """Drop the batch's samples a quarantined box made unvouched (:mod:`trainer_plugin.distrust`); how many
        were dropped now. A manager that cannot be reached costs a warning, never the step."""
        try:
            dropped = self._rm_drop_distrusted(batch)
        except Exception as exc:  # unprotected, but the step goes on: said in the log and the metrics
            log.warning("distrusted samples not checked: %s", exc)
            metrics["rollout_manager/distrust_check_failed"] = 1.0
            return 0
        done = self._rm_dropped if self._rm_dropped is not None else set()
        metrics["rollout_manager/distrusted_samples_dropped"] = float(len(done))
        metrics["rollout_manager/distrusted_samples_missed"] = float(self._rm_distrust.missed
                                                                     if self._rm_distrust is not None else 0)
        return dropped

    def _rm_drop_distrusted(self, batch: Any) -> int:
        """Zero the masks of the samples a quarantined box made unvouched and give each a ``uid`` of its own, in
        TransferQueue, as verl's padding samples have; how many were dropped now."""
        if self._rm_distrust is None:
            self._rm_distrust = DistrustFilter(self._rm_settings.manager_url)
        self._rm_distrust.refresh()
        import transfer_queue as tq
        from tensordict import NonTensorStack, TensorDict

        keys = list(batch.keys)
        data = tq.kv_batch_get(keys=keys, partition_id=batch.partition_id, select_fields=list(READ_FIELDS))
        if self._rm_dropped is None:
            self._rm_dropped = set()
        fields, dropped = drop_fields(data, keys, self._rm_distrust, self._rm_dropped)
        if not dropped:
            return 0
        log.warning("%d sample(s) made by a quarantined box before it was caught: dropped from this step (masks "
                    "zeroed, each its own GRPO group)", len(dropped))
        uids = fields.pop("uid")
        tq.kv_batch_put(keys=keys, partition_id=batch.partition_id,
                        fields=TensorDict({**fields, "uid": NonTensorStack(*uids)}, batch_size=[len(keys)]))
        self._rm_dropped.update(dropped)
        return len(dropped)

    def _rm_tally_mismatch(self, batch: Any) -> None:
        """The trainer's log-probs of the micro-batch against the rollout's, split by box (see
        :mod:`trainer_plugin.mismatch`); nothing to split in bypass mode (old = rollout) or without
        the rollout's log-probs."""
        corr = self.config.algorithm.get("rollout_correction", None)
        if (corr and corr.get("bypass_mode", False)) \
                or not self.config.actor_rollout_ref.rollout.get("calculate_log_probs", False):
            return
        import transfer_queue as tq

        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=list(FIELDS))
        if self._rm_mismatch is None:
            self._rm_mismatch = StepMismatch()
        self._rm_mismatch.add(tally_batch(data))

    def _rm_post_mismatch(self) -> dict[str, float]:
        step, self._rm_mismatch = self._rm_mismatch, None
        if not step:
            return {}
        body = step.body(int(getattr(self, "global_steps", 0) or 0))
        logged = {f"rollout_manager/mismatch/{b['instance']}/{k}": float(b[k])
                  for b in body["boxes"] for k in ("mean_abs_diff", "k3_kl")}
        try:
            answer = post_mismatch_sync(self._rm_settings.manager_url, body)
            logged.update(as_log_metrics(answer.get("fleet") or {}, "rollout_manager/mismatch/fleet/"))
        except Exception as exc:
            log.warning("per-box log-prob mismatch not posted: %s", exc)
        return logged

    def on_step_end(self) -> None:
        super().on_step_end()  # type: ignore[misc]
        mismatch = self._rm_post_mismatch()
        if mismatch:
            pending = getattr(self, "_pending_sync_metrics", None) or {}
            self._pending_sync_metrics = {**pending, **mismatch}
        if self._rm_timer is None or not self._rm_timer.in_step:
            return
        figures = self._rm_timer.end_step(self._rm_samples_per_step())
        logged = {f"rollout_manager/{k}": v for k, v in figures.items()}
        try:
            logged.update(as_log_metrics(post_step_metrics_sync(self._rm_settings.manager_url, **figures)))
        except Exception as exc:
            log.warning("rollout manager metrics not posted: %s", exc)
        pending = getattr(self, "_pending_sync_metrics", None) or {}
        self._pending_sync_metrics = {**pending, **logged}


def stream_granularity_note(config: Any, parameter_sync_step: int) -> str:
    """How verl V1 streams (whole groups, ``train_batch_size / parameter_sync_step`` at a time) next to
    the plugin's ``min_stream_batch_size``, with the ``parameter_sync_step`` that would match it."""
    prompts = int(config.data.train_batch_size)
    n = int(config.actor_rollout_ref.rollout.n)
    groups = prompts // max(1, int(parameter_sync_step))
    note = (f"verl V1 trains on {groups} whole prompt groups ({groups * n} samples) at a time, as they finish "
            f"(trainer.v1.sync.parameter_sync_step={parameter_sync_step})")
    wanted = from_rollout_config(config.actor_rollout_ref.rollout).min_stream_batch_size
    if wanted > 1:
        fits = [d for d in range(1, prompts + 1) if prompts % d == 0 and (prompts // d) * n >= wanted]
        note += (f"; custom.min_stream_batch_size={wanted} is the plugin's RolloutStream setting, which "
                 f"trainer.v1.sync.parameter_sync_step={max(fits) if fits else 1} would match here")
    return note


class PPOTrainerSyncWithManager(ManagerMetricsMixin, PPOTrainerSync):
    """verl's sync trainer; each step's timings go to the rollout manager."""

    def __init__(self, config: Any):
        # verl picks sync behaviour by comparing trainer.v1.trainer_mode with "sync" (replay buffer
        # class, refills, in-flight prompt handling, the trainer.v1.sync settings): once this class
        # has been chosen by its own name, the trainer is the sync one in every other respect.
        with open_dict(config):
            config.trainer.v1.trainer_mode = "sync"
        super().__init__(config)


def register() -> type:
    """Register ``rollout_manager_sync`` (idempotent)."""
    return TRAINER_REGISTRY.get(TRAINER_MODE) or register_trainer(TRAINER_MODE)(PPOTrainerSyncWithManager)


register()  # whichever of verl and this module is imported first
