"""Weight versions: after each training step every remote instance gets the new weights before it serves.

Runs in: manager.

On ``/update_weight_version`` remote instances below the new version go to ``syncing`` (no new
requests; in-flight ones finish, SGLang is never told to abort them). Every instance that enters
``syncing``, this way or at registration, gets one sync task: wait until it has drained, then prepare
the receiver (layout sent ahead), have the instance's sender push through its transfer group, and have
the receiver verify and load. Only then is the instance ``active`` again, at the new version. A failed
push is retried; after ``weight_push_max_attempts`` the instance is removed. Instances never wait on
each other. A sender that is down or has not staged the version is not the instance's fault: the
instance waits, out of service, until it is back.

With ``weight_push_mode`` "delta" or "auto", an instance one version behind, whose receiver still holds
that version's bytes, gets only what changed (:mod:`rollout_manager.weights.delta`); any other gets the
full bytes. A delta whose result does not match the full version's checksums is repaired at once by
rewriting the failing shards in full, then verified again; nothing unverified is ever loaded.

With ``weight_activation = "staged"`` an active instance stays active on a new version
(:mod:`rollout_manager.weights.staged`): the push lands in its receiver's buffer and is verified there
(*staged*) while SGLang keeps generating with the old weights; then the manager activates it: the receiver
pauses generation, loads, records the version and continues (:mod:`rollout_manager.weights.activation`).
In-flight sequences are neither aborted nor moved; their chunks after the swap carry the new
``weight_version``. A version superseded while it stages is replaced by the newer one before activation.
An activation that fails after the pause leaves SGLang paused: the instance leaves service (``syncing``),
its sequences continue elsewhere, and it gets a full push and load as in "drain". ``BoxVersions`` on each
instance says what it stages and activates, and the seconds it generated nothing per version.

With ``peer_bootstrap``, an instance that joins or fell behind (never synced here, missed a version, or
its last attempt failed) first pulls the version from the nearest active instance that holds it
(:mod:`rollout_manager.weights.peers`), so the trainer's links stay free for the regular push; the
puller verifies against the trainer's checksums (recorded here from the sender's pushes; the peer's
copy of them when this manager has none). A peer that fails sends it to its sender in the same attempt.
How one version reaches one instance, and how a failed try is retried, is :mod:`rollout_manager.weights.delivery`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from rollout_manager.errors import BadRequest, Conflict
from rollout_manager.instances.registry import Event, Instance, Kind, Registry, State
from rollout_manager.instances.version import WeightVersion
from rollout_manager.notify import Signal
from rollout_manager.weights.agent_client import AgentClient
from rollout_manager.weights.delivery import Delivery, PushListener, Tries
from rollout_manager.weights.groups import SenderPlan
from rollout_manager.weights.push_record import WeightPush
from rollout_manager.weights.staged import StagedActivation
from rollout_manager.weights.sync_settings import SyncSettings

log = logging.getLogger("rollout_manager.weights.sync")

EVICT_WAIT_S = 10.0  # after moving an instance's sequences off, how long their aborts may take to land


class WeightSync:
    """Owns the fleet's weight version and brings every remote instance to it.

    ``load_changed`` is the dispatcher's signal (load and lifecycle changes): a sync waits on it for
    its instance to drain, and :meth:`wait` for instances to reach a version.
    """

    def __init__(self, registry: Registry, version: WeightVersion, senders: SenderPlan, agents: AgentClient,
                 settings: SyncSettings, load_changed: Signal,
                 evict: Callable[[Instance, str], int] | None = None,
                 on_serving: Callable[[Instance], None] | None = None) -> None:
        """``evict(inst, reason)`` moves the sequences still running on ``inst`` elsewhere (the rollout
        side's; this package does not import it). ``on_serving(inst)``: ``inst`` serves a newer version
        without a state change (staged activation), so requests queued for that version (``min_weight_version``)
        may be placed there now; nothing else would tell the dispatcher's queue."""
        self.registry = registry
        self.evict = evict
        self.version = version
        self.senders = senders
        self.settings = settings
        self.load_changed = load_changed
        self.delivery = Delivery(registry, senders, agents, settings, load_changed)
        self.staged = StagedActivation(registry, version, self.delivery, self._release, evict, on_serving)
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.pushes: list[WeightPush] = self.delivery.pushes  # recent push results, for status
        self.push_listeners: list[PushListener] = self.delivery.push_listeners  # every successful push (metrics)
        self._out_since: dict[str, float] = {}  # instance -> when it left service (active -> syncing)
        registry.listeners.append(self._on_event)

    # ------------------------------------------------------------ trainer-facing
    def bump(self, new_version: int | None) -> int:
        """Set the new version and start syncing every remote instance that is behind.

        The current version again is a no-op success: a trainer restarted from the checkpoint of the
        step the fleet already serves publishes that step once more (verl's ``on_init_end``), and its
        weights are the ones the instances hold. A lower version would roll the fleet back to weights no
        sender keeps, so it is refused. So is a new version while remote instances exist and no sender
        has been reported: nobody could deliver it, and the whole pool would wait out of service.
        """
        current = self.version.current
        version = current + 1 if new_version is None else new_version
        if version < current:
            raise BadRequest(f"new_version {version} is below the current version {current}: weight versions only "
                             f"move forward (a trainer resumed from an older checkpoint than the instances serve?); "
                             f"resume from step {current} or later, or restart the manager and its instances")
        if version == current:
            log.info("weight version %d published again: the instances have it or are syncing to it", version)
            return version
        remote = self.registry.in_state(State.PENDING, State.SYNCING, State.ACTIVE, kind=Kind.REMOTE)
        if remote and not self.senders.plan:
            raise Conflict(f"cannot move to weight version {version}: no weight sender has been reported, so the "
                           f"{len(remote)} remote instance(s) could not receive it and would stop serving; "
                           f"report the trainer's senders first (PUT /update_weight_senders)")
        self.version.current = version
        for inst in self.registry:
            if inst.kind == Kind.LOCAL:
                self.registry.set_weight_version(inst, version)  # the trainer updates its own instances
            elif inst.state == State.ACTIVE and self.settings.activation == "staged":
                self._ensure_sync(inst)  # stays active: stages, then pauses only to load
            elif inst.state == State.ACTIVE:
                self.registry.transition(inst, State.SYNCING, f"needs weight version {version}")
            elif inst.state == State.SYNCING:
                self._ensure_sync(inst)
        log.info("weight version %d -> %d", current, version)
        return version

    def at_version(self, version: int) -> list[Instance]:
        return [i for i in self.registry.in_state(State.ACTIVE) if i.weight_version >= version]

    async def wait(self, version: int, min_instances: int | None, timeout_s: float,
                   staged: bool = False) -> dict[str, Any]:
        """Wait until ``min_instances`` (None: every remote instance) serve ``version`` (``staged``: hold it
        verified, staged beside the served version or serving it), bounded."""
        def has(i: Instance) -> bool:
            v = i.versions
            return v.serving(i.weight_version) >= version or (staged and max(v.staged or -1, v.activating or -1)
                                                               >= version)

        def remote_ready() -> int:
            return len([i for i in self.registry.in_state(State.ACTIVE) if i.kind == Kind.REMOTE and has(i)])

        def enough() -> bool:
            if min_instances is None:  # an evacuating box gets no push: it is not waited for
                return not [i for i in self.registry if i.kind == Kind.REMOTE and i.state != State.EVACUATING
                            and not has(i)]
            return remote_ready() >= min_instances

        t0 = time.monotonic()
        ok = await self.load_changed.wait_for(enough, timeout_s)
        return {"timed_out": not ok, "waited_s": round(time.monotonic() - t0, 6),
                "instances_at_version": remote_ready()}

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------ per instance
    def _on_event(self, inst: Instance, event: Event) -> None:
        if event.new == State.SYNCING and event.old == State.ACTIVE:
            self._out_since[inst.id] = time.monotonic()
        if event.new == State.SYNCING:
            self._ensure_sync(inst)
        elif event.new == State.DEAD:
            self.delivery.forget(inst)
            self._out_since.pop(inst.id, None)
            task = self._tasks.pop(inst.id, None)
            if task is not None and task is not asyncio.current_task():
                task.cancel()

    def _ensure_sync(self, inst: Instance) -> None:
        task = self._tasks.get(inst.id)
        if task is None or task.done():
            staged = inst.state == State.ACTIVE and self.settings.activation == "staged"
            work = self.staged.run(inst) if staged else self._sync(inst)
            self._tasks[inst.id] = asyncio.get_running_loop().create_task(work, name=f"sync:{inst.id}")

    async def _sync(self, inst: Instance) -> None:
        cfg = self.settings
        tries = Tries()
        while self.registry.get(inst.id) is inst and inst.state != State.EVACUATING and (
                inst.weight_version < self.version.current or (
                inst.quarantined is not None and not inst.reloaded_in_quarantine)):  # quarantined: reload in full
            version = self.version.current
            if inst.load.in_flight:
                self.registry.wait_for(inst, f"in-flight requests to drain ({inst.load.in_flight} left)")
            drained = await self.load_changed.wait_for(lambda: inst.load.in_flight == 0, cfg.drain_timeout_s)
            if not drained:
                # SGLang >= 0.5.21 refuses to flush its prefix cache while requests run, and serving from
                # the old weights' cache would mix versions: move them on (they continue elsewhere from
                # the tokens made), then push.
                moved = self.evict(inst, "weight push") if self.evict is not None else 0
                log.warning("instance %s still has %d request(s) in flight after %gs; moved %d to other "
                            "instances before the push", inst.endpoint, inst.load.in_flight, cfg.drain_timeout_s, moved)
                if not await self.load_changed.wait_for(lambda: inst.load.in_flight == 0, EVICT_WAIT_S):
                    log.warning("instance %s: %d request(s) still in flight; pushing anyway (the receiver waits "
                                "for SGLang to go idle before it flushes the cache)", inst.endpoint,
                                inst.load.in_flight)
            group = self.senders.group_of(inst)
            if group is None:  # no sender has reported yet: wait for one, out of service but not failing
                self.registry.wait_for(inst, "the trainer's weight senders (PUT /update_weight_senders)")
                await self.senders.changed.wait(None)
                continue
            self.registry.wait_for(inst, f"weight push of version {version}")
            result = await self.delivery.attempt(inst, version, group, tries)
            if result is None:
                if tries.gave_up:
                    return
                continue
            tries.failures = 0
            self.delivery.synced.add(inst.id)
            self.registry.set_weight_version(inst, version)
            self.registry.clear_error(inst)
            self.delivery.note_push(result)
            if version == self.version.current:
                out_since = self._out_since.pop(inst.id, None)
                if out_since is not None:  # it served before: the time it did not is the cost of this version
                    inst.versions.record_pause(version, time.monotonic() - out_since)
                self.registry.transition(inst, State.ACTIVE, f"weights at version {version} "
                                         f"({result.gbps:.2f} GB/s, {result.total_s:.2f}s)")
        self._tasks.pop(inst.id, None)

    def _release(self, inst: Instance) -> None:
        """The calling task is no longer ``inst``'s sync task: a later move to ``syncing`` starts a new one."""
        if self._tasks.get(inst.id) is asyncio.current_task():
            del self._tasks[inst.id]
