"""Staged activation of an active instance (``weight_activation = "staged"``): the new version is pushed and
verified into the receiver's buffer while the instance keeps serving the old one, then the receiver pauses
generation only to load it (:mod:`rollout_manager.weights.activation`).

Runs in: manager.

A version superseded while it stages is not activated: the newer one is staged over it. A failed activation
leaves SGLang paused: the instance leaves service (``syncing``) and gets a full push as in "drain"
(:mod:`rollout_manager.weights.sync`). ``Instance.versions`` (:class:`BoxVersions`) is written here: what
the instance stages and activates, and the seconds each activation paused it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable

import aiohttp

from rollout_manager.instances.registry import Instance, Registry, State
from rollout_manager.instances.version import WeightVersion
from rollout_manager.notify import bounded
from rollout_manager.osutil import format_endpoint
from rollout_manager.weights.agent_client import PushFailed
from rollout_manager.weights.delivery import Delivery, Tries
from rollout_manager.weights.protocol import ActivateRequest

log = logging.getLogger("rollout_manager.weights.sync")


class StagedActivation:
    """Brings an active instance to the current version without taking it out of service.

    ``release(inst)`` forgets the calling task as ``inst``'s sync task (weight sync's bookkeeping), so that a
    failed activation's move to ``syncing`` starts the drain-mode sync; ``evict`` and ``on_serving`` are
    :class:`~rollout_manager.weights.sync.WeightSync`'s.
    """

    def __init__(self, registry: Registry, version: WeightVersion, delivery: Delivery,
                 release: Callable[[Instance], None], evict: Callable[[Instance, str], int] | None = None,
                 on_serving: Callable[[Instance], None] | None = None) -> None:
        self.registry = registry
        self.version = version
        self.delivery = delivery
        self.settings = delivery.settings
        self.load_changed = delivery.load_changed
        self.release = release
        self.evict = evict
        self.on_serving = on_serving

    async def run(self, inst: Instance) -> None:
        """Stage (retried as a push is), then activate (pause, load, continue), until ``inst`` serves the
        current version, leaves service, or is gone."""
        cfg, bv, senders = self.settings, inst.versions, self.delivery.senders
        tries = Tries()
        while (self.registry.get(inst.id) is inst and inst.state == State.ACTIVE
               and inst.weight_version < self.version.current):
            version = self.version.current
            group = senders.group_of(inst)
            if group is None:  # no sender yet: keep serving the old version until one reports
                await senders.changed.wait(None)
                continue
            bv.staging = version
            try:
                result = await self.delivery.attempt(inst, version, group, tries, stage=True)
            finally:
                bv.staging = None
            if result is None:
                if tries.gave_up:
                    return
                continue
            bv.staged = version
            self.load_changed.notify()  # a trainer may wait for staged instances
            if version != self.version.current or self.registry.get(inst.id) is not inst:
                self.delivery.note_push(result)  # staged, never loaded
                continue  # superseded before activation (the receiver drops it when the newer one lands)
            # Chunks made by the new version arrive as soon as generation continues, before the answer: the
            # instance is named at the new version from the pause on (BoxVersions.serving says what it serves).
            before = inst.weight_version
            bv.activating, bv.serving_before = version, before
            self.registry.set_weight_version(inst, version)
            receiver_url = f"http://{format_endpoint(inst.host, inst.weight_receiver_port or 0)}"
            try:
                answer = await bounded(self.delivery.agents.activate(receiver_url, ActivateRequest(
                    version=version, mode=cfg.pause_mode)), cfg.push_timeout_s)
            except (PushFailed, asyncio.TimeoutError, aiohttp.ClientError) as exc:
                self.registry.set_weight_version(inst, before)  # not loaded (or not known to be)
                reason = str(exc) or type(exc).__name__
                if isinstance(exc, PushFailed) and exc.status == 409 and tries.failures + 1 < cfg.max_attempts:
                    tries.failures += 1  # not staged there (its agent restarted?): stage it again
                    self.registry.set_error(inst, f"weight activation: {reason}")
                    continue
                self._failed(inst, version, reason)
                return
            finally:
                bv.activating = bv.serving_before = None
                bv.staged = None if bv.staged == version else bv.staged
            tries.failures = 0
            self.delivery.note_push(dataclasses.replace(result, load_s=answer.load_s, reloaded=answer.reloaded,
                                                        total_s=round(result.total_s + answer.paused_s, 6)))
            self.delivery.synced.add(inst.id)
            self.registry.set_weight_version(inst, version)
            bv.record_pause(version, answer.paused_s)
            self.registry.clear_error(inst)
            self.load_changed.notify()
            if self.on_serving is not None:
                self.on_serving(inst)
            log.info("instance %s activated version %d (%s): paused %.3fs, loaded %d tensors", inst.endpoint,
                     version, answer.mode, answer.paused_s, answer.reloaded)
        self.release(inst)

    def _failed(self, inst: Instance, version: int, reason: str) -> None:
        """SGLang was paused and the load failed (or its outcome is unknown): it stays paused, so take the
        instance out of service, move its sequences on, and give it a full push as in "drain"."""
        log.error("activation of version %d on %s failed after the pause: %s; out of service until a full push",
                  version, inst.endpoint, reason)
        self.registry.set_error(inst, f"weight activation of version {version} failed: {reason}")
        self.release(inst)  # so the transition below starts the drain-mode sync
        if self.registry.transition(inst, State.SYNCING, f"activation of version {version} failed"):
            moved = self.evict(inst, "weight activation failed") if self.evict is not None else 0
            log.warning("moved %d sequence(s) off %s", moved, inst.endpoint)
