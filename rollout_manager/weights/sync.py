"""Weight versions: after each training step every remote instance gets the new weights before it serves.

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

With ``weight_activation = "staged"`` an active instance stays active on a new version: the push lands in its
receiver's buffer and is verified there (*staged*) while SGLang keeps generating with the old weights;
then the manager activates it: the receiver pauses generation, loads, records the version and continues
(:mod:`rollout_manager.weights.activation`). In-flight sequences are neither aborted nor moved; their
chunks after the swap carry the new ``weight_version``. A version superseded while it stages is
replaced by the newer one before activation. An activation that fails after the pause leaves SGLang
paused: the instance leaves service (``syncing``), its sequences continue elsewhere, and it gets a full
push and load as in "drain". ``BoxVersions`` on each instance says what it stages and activates, and the
seconds it generated nothing per version.

With ``peer_bootstrap``, an instance that joins or fell behind (never synced here, missed a version, or
its last attempt failed) first pulls the version from the nearest active instance that holds it
(:mod:`rollout_manager.weights.peers`), so the trainer's links stay free for the regular push; the
puller verifies against the trainer's checksums (recorded here from the sender's pushes; the peer's
copy of them when this manager has none). A peer that fails sends it to its sender in the same attempt.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import aiohttp

from rollout_manager.config import Config
from rollout_manager.errors import BadRequest, Conflict
from rollout_manager.instances.registry import Event, Instance, Kind, Registry, State
from rollout_manager.instances.version import WeightVersion
from rollout_manager.notify import Signal, bounded
from rollout_manager.osutil import format_endpoint
from rollout_manager.weights.agent_client import AgentClient, PushFailed, SenderUnavailable
from rollout_manager.weights.groups import Group, SenderPlan
from rollout_manager.weights.peers import choose_peer, holders
from rollout_manager.weights.protocol import (
    ActivateRequest,
    CommitRequest,
    PauseMode,
    PrepareRequest,
    PushAnswer,
    PushMode,
    PushRequest,
    ServeRequest,
    TransportName,
)
from rollout_manager.weights.push_record import WeightPush

log = logging.getLogger("rollout_manager.weights.sync")

T = TypeVar("T")
PushListener = Callable[[WeightPush], None]
EVICT_WAIT_S = 10.0  # after moving an instance's sequences off, how long their aborts may take to land
# "auto" sends a delta only when it is at most 1/this of the full bytes (larger ones save too little
# wire time to pay for encoding and applying them); "delta" sends any delta the sender has.
AUTO_DELTA_MAX_RATIO = 2


@dataclass(frozen=True)
class SyncSettings:
    transport: TransportName
    drain_timeout_s: float
    push_timeout_s: float
    retry_s: float
    max_attempts: int
    push_mode: PushMode = "full"
    peer_bootstrap: bool = False
    # "auto" sends deltas only to instances whose last full push from their sender ran below this
    # (GB/s): on a faster link encoding and applying a delta costs more than the bytes it saves.
    delta_below_gbps: float = 0.4
    # The most a peer bootstrap waits on the peer (its layout and serve calls together) before the
    # instance falls back to its sender: a peer that hangs must not cost the whole push_timeout_s.
    peer_timeout_s: float = 120.0
    activation: Literal["staged", "drain"] = "drain"  # config.weight_activation
    pause_mode: PauseMode = "retract"  # config.weight_activation_pause_mode

    @classmethod
    def from_config(cls, cfg: Config) -> SyncSettings:
        mode = cfg.weight_push_mode
        if mode == "auto" and cfg.weight_transport == "mooncake" and cfg.mooncake_transfer_protocol == "rdma":
            mode = "full"  # RDMA moves the full bytes faster than a delta is encoded and applied
        return cls(cfg.weight_transport, cfg.drain_timeout_s, cfg.weight_push_timeout_s, cfg.weight_push_retry_s,
                   cfg.weight_push_max_attempts, mode, cfg.peer_bootstrap, cfg.weight_delta_below_gbps,
                   cfg.peer_bootstrap_timeout_s, cfg.weight_activation, cfg.weight_activation_pause_mode)


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
        self.on_serving = on_serving
        self.version = version
        self.senders = senders
        self.agents = agents
        self.settings = settings
        self.load_changed = load_changed
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.pushes: list[WeightPush] = []  # recent push results, for status
        self.push_listeners: list[PushListener] = []  # every successful push (metrics)
        self._synced: set[str] = set()  # instances that got a version here (else: joining, a peer may serve)
        self._serving: dict[str, int] = {}  # peer bootstraps in flight per serving instance
        self._trainer_sums: dict[int, tuple[str, list[tuple[int, int]], list[str]]] = {}  # version -> sums
        self._full_gbps: dict[str, float] = {}  # instance -> GB/s of its last full push from its sender
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
            if min_instances is None:
                return not [i for i in self.registry if i.kind == Kind.REMOTE and not has(i)]
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
            self._synced.discard(inst.id)
            self._full_gbps.pop(inst.id, None)
            self._out_since.pop(inst.id, None)
            task = self._tasks.pop(inst.id, None)
            if task is not None and task is not asyncio.current_task():
                task.cancel()

    def _ensure_sync(self, inst: Instance) -> None:
        task = self._tasks.get(inst.id)
        if task is None or task.done():
            staged = inst.state == State.ACTIVE and self.settings.activation == "staged"
            work = self._stage_and_activate(inst) if staged else self._sync(inst)
            self._tasks[inst.id] = asyncio.get_running_loop().create_task(work, name=f"sync:{inst.id}")

    async def _sync(self, inst: Instance) -> None:
        cfg = self.settings
        failures = 0
        while self.registry.get(inst.id) is inst and inst.weight_version < self.version.current:
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
            try:
                result = await self._deliver(inst, version, group, failures)
            except SenderUnavailable as exc:
                if inst.last_error != f"weight push: {exc}":
                    log.warning("weight push of version %d to %s waits for its sender: %s", version,
                                inst.endpoint, exc)
                    self.registry.set_error(inst, f"weight push: {exc}")
                self.registry.wait_for(inst, f"its sender to stage version {version}")  # or to be back: last_error says
                await self.load_changed.wait(cfg.retry_s)
                continue
            except (PushFailed, asyncio.TimeoutError, aiohttp.ClientError) as exc:
                failures += 1
                reason = str(exc) or type(exc).__name__
                self.registry.set_error(inst, f"weight push: {reason}")
                log.warning("weight push of version %d to %s failed (%d/%d): %s", version, inst.endpoint,
                            failures, cfg.max_attempts, reason)
                if failures >= cfg.max_attempts:
                    self.registry.transition(inst, State.DEAD, f"weight push failed {failures} times; last: {reason}")
                    return
                await self.load_changed.wait(cfg.retry_s)
                continue
            except Exception as exc:  # a bug must not leave the instance syncing for good: count it as a failure
                log.exception("weight push of version %d to %s failed unexpectedly", version, inst.endpoint)
                failures += 1
                self.registry.set_error(inst, f"weight push: internal error: {exc!r}")
                if failures >= cfg.max_attempts:
                    self.registry.transition(inst, State.DEAD, f"weight push failed {failures} times; last: {exc!r}")
                    return
                await self.load_changed.wait(cfg.retry_s)
                continue
            failures = 0
            self._synced.add(inst.id)
            self.registry.set_weight_version(inst, version)
            self.registry.clear_error(inst)
            self._note_push(result)
            if version == self.version.current:
                out_since = self._out_since.pop(inst.id, None)
                if out_since is not None:  # it served before: the time it did not is the cost of this version
                    inst.versions.record_pause(version, time.monotonic() - out_since)
                self.registry.transition(inst, State.ACTIVE, f"weights at version {version} "
                                         f"({result.gbps:.2f} GB/s, {result.total_s:.2f}s)")
        self._tasks.pop(inst.id, None)

    async def _stage_and_activate(self, inst: Instance) -> None:
        """Staged activation of an active instance: push and verify into the receiver's buffer while it
        serves (retried as a push is), then activate (pause, load, continue). A version superseded while it
        stages is not activated: the newer one is staged over it. A failed activation leaves SGLang paused:
        the instance leaves service and gets a full push as in "drain" (:meth:`_sync`)."""
        cfg, bv = self.settings, inst.versions
        failures = 0
        while (self.registry.get(inst.id) is inst and inst.state == State.ACTIVE
               and inst.weight_version < self.version.current):
            version = self.version.current
            group = self.senders.group_of(inst)
            if group is None:  # no sender yet: keep serving the old version until one reports
                await self.senders.changed.wait(None)
                continue
            bv.staging = version
            try:
                result = await self._deliver(inst, version, group, failures, stage=True)
            except SenderUnavailable as exc:
                self.registry.set_error(inst, f"weight staging: {exc}")
                await self.load_changed.wait(cfg.retry_s)
                continue
            except (PushFailed, asyncio.TimeoutError, aiohttp.ClientError) as exc:
                failures += 1
                reason = str(exc) or type(exc).__name__
                self.registry.set_error(inst, f"weight staging: {reason}")
                log.warning("staging version %d on %s failed (%d/%d): %s", version, inst.endpoint, failures,
                            cfg.max_attempts, reason)
                if failures >= cfg.max_attempts:
                    self.registry.transition(inst, State.DEAD, f"weight push failed {failures} times; last: {reason}")
                    return
                await self.load_changed.wait(cfg.retry_s)
                continue
            finally:
                bv.staging = None
            bv.staged = version
            self.load_changed.notify()  # a trainer may wait for staged instances
            if version != self.version.current or self.registry.get(inst.id) is not inst:
                self._note_push(result)  # staged, never loaded
                continue  # superseded before activation (the receiver drops it when the newer one lands)
            # Chunks made by the new version arrive as soon as generation continues, before the answer: the
            # instance is named at the new version from the pause on (BoxVersions.serving says what it serves).
            before = inst.weight_version
            bv.activating, bv.serving_before = version, before
            self.registry.set_weight_version(inst, version)
            receiver_url = f"http://{format_endpoint(inst.host, inst.weight_receiver_port or 0)}"
            try:
                answer = await bounded(self.agents.activate(receiver_url, ActivateRequest(
                    version=version, mode=cfg.pause_mode)), cfg.push_timeout_s)
            except (PushFailed, asyncio.TimeoutError, aiohttp.ClientError) as exc:
                self.registry.set_weight_version(inst, before)  # not loaded (or not known to be)
                reason = str(exc) or type(exc).__name__
                if isinstance(exc, PushFailed) and exc.status == 409 and failures + 1 < cfg.max_attempts:
                    failures += 1  # not staged there (its agent restarted?): stage it again
                    self.registry.set_error(inst, f"weight activation: {reason}")
                    continue
                self._activation_failed(inst, version, reason)
                return
            finally:
                bv.activating = bv.serving_before = None
                bv.staged = None if bv.staged == version else bv.staged
            failures = 0
            self._note_push(dataclasses.replace(result, load_s=answer.load_s, reloaded=answer.reloaded,
                                                total_s=round(result.total_s + answer.paused_s, 6)))
            self._synced.add(inst.id)
            self.registry.set_weight_version(inst, version)
            bv.record_pause(version, answer.paused_s)
            self.registry.clear_error(inst)
            self.load_changed.notify()
            if self.on_serving is not None:
                self.on_serving(inst)
            log.info("instance %s activated version %d (%s): paused %.3fs, loaded %d tensors", inst.endpoint,
                     version, answer.mode, answer.paused_s, answer.reloaded)
        if self._tasks.get(inst.id) is asyncio.current_task():
            del self._tasks[inst.id]

    def _activation_failed(self, inst: Instance, version: int, reason: str) -> None:
        """SGLang was paused and the load failed (or its outcome is unknown): it stays paused, so take the
        instance out of service, move its sequences on, and give it a full push as in "drain"."""
        log.error("activation of version %d on %s failed after the pause: %s; out of service until a full push",
                  version, inst.endpoint, reason)
        self.registry.set_error(inst, f"weight activation of version {version} failed: {reason}")
        if self._tasks.get(inst.id) is asyncio.current_task():
            del self._tasks[inst.id]  # so the transition below starts the drain-mode sync
        if self.registry.transition(inst, State.SYNCING, f"activation of version {version} failed"):
            moved = self.evict(inst, "weight activation failed") if self.evict is not None else 0
            log.warning("moved %d sequence(s) off %s", moved, inst.endpoint)

    def _note_push(self, result: WeightPush) -> None:
        self.pushes.append(result)
        del self.pushes[:-100]
        for listener in self.push_listeners:
            listener(result)

    async def _deliver(self, inst: Instance, version: int, group: Group, failures: int,
                       stage: bool = False) -> WeightPush:
        """From the nearest peer holding ``version`` where one may serve, else (or when it fails) from the
        instance's sender; each bounded by ``push_timeout_s``, and the peer's own calls by ``peer_timeout_s``.
        ``stage``: the receiver verifies and holds it staged, SGLang untouched (see :meth:`_stage_and_activate`)."""
        timeout_s = self.settings.push_timeout_s
        peer = self._peer_for(inst, version, failures)
        if peer is None:
            return await bounded(self._push(inst, version, group, stage), timeout_s)
        self._serving[peer.id] = self._serving.get(peer.id, 0) + 1
        try:
            return await bounded(self._pull_from_peer(inst, peer, version, group, stage), timeout_s)
        except (PushFailed, asyncio.TimeoutError, aiohttp.ClientError) as exc:
            reason = str(exc) or type(exc).__name__
        finally:
            self._serving[peer.id] -= 1
            if not self._serving[peer.id]:
                del self._serving[peer.id]
        log.warning("peer bootstrap of version %d to %s from %s failed; falling back to its sender: %s", version,
                    inst.endpoint, peer.endpoint, reason)
        result = await bounded(self._push(inst, version, group, stage), timeout_s)
        return dataclasses.replace(result, peer_failed=f"{peer.endpoint}: {reason}")

    def _peer_for(self, inst: Instance, version: int, failures: int) -> Instance | None:
        """A peer for an instance that joins or fell behind; None for the regular push (its sender)."""
        if not self.settings.peer_bootstrap or inst.weight_receiver_port is None:
            return None
        if inst.id in self._synced and inst.weight_version == version - 1 and not failures:
            return None
        return choose_peer(inst, holders(self.registry, inst, version), self._serving)

    async def _pull_from_peer(self, inst: Instance, peer: Instance, version: int, group: Group,
                              stage: bool = False) -> WeightPush:
        """prepare (puller) -> serve (peer's receiver, its verified buffer) -> commit (puller, checked against
        the trainer's checksums of ``version``)."""
        assert inst.weight_receiver_port is not None and peer.weight_receiver_port is not None
        receiver_url = f"http://{format_endpoint(inst.host, inst.weight_receiver_port)}"
        peer_url = f"http://{format_endpoint(peer.host, peer.weight_receiver_port)}"
        transport = self.settings.transport
        t0 = time.monotonic()
        deadline = t0 + self.settings.peer_timeout_s

        async def from_peer(call: Awaitable[T]) -> T:
            """A call the peer answers, within what is left of the peer's time."""
            try:
                return await bounded(call, deadline - time.monotonic())
            except asyncio.TimeoutError:
                raise PushFailed(f"peer {peer.endpoint} did not answer within peer_bootstrap_timeout_s="
                                 f"{self.settings.peer_timeout_s:g}s") from None

        held = await from_peer(self.agents.peer_layout(peer_url))
        if held.version != version:
            raise PushFailed(f"peer {peer.endpoint} holds version {held.version}, not {version}")
        prep = await self.agents.prepare(receiver_url, PrepareRequest(version=version, layout=held.layout,
                                                                      transport=transport))
        served = await from_peer(self.agents.serve(peer_url, ServeRequest(
            version=version, fingerprint=held.fingerprint, num_engines=self.senders.engines_per_group,
            session_ids=prep.session_ids, buffer_addr=prep.buffer_addr, transport=transport)))
        trainer = self._trainer_sums.get(version)
        ours = trainer is not None and trainer[0] == served.fingerprint
        shards, sums = (trainer[1], trainer[2]) if trainer is not None and ours else (served.shards, served.checksums)
        commit = await self.agents.commit(receiver_url, CommitRequest(version=version, fingerprint=served.fingerprint,
                                                                      shards=shards, checksums=sums,
                                                                      stage=True if stage else None))
        return WeightPush(inst.id, inst.endpoint, version, group.sender, group.group, group.ip, transport, "full",
                          f"peer:{peer.endpoint}", served.bytes, held.layout.total_bytes, served.seconds,
                          served.gbps, commit.verify_s, commit.load_s, None, commit.reloaded,
                          round(time.monotonic() - t0, 6), time.time(), checksums_from="manager" if ours else "peer")

    def _record_sums(self, version: int, push: PushAnswer) -> None:
        """Keep the trainer's checksums of the last few versions, for verifying peer bootstraps."""
        self._trainer_sums[version] = (push.fingerprint, list(push.shards), list(push.checksums))
        for old in sorted(self._trainer_sums)[:-3]:
            del self._trainer_sums[old]

    async def _push(self, inst: Instance, version: int, group: Group, stage: bool = False) -> WeightPush:
        """prepare (receiver) -> push (sender, through the instance's group) -> commit (receiver)."""
        if inst.weight_receiver_port is None:
            raise PushFailed("the instance registered no weight_receiver_port")
        sender_url = self.senders.sender_url(group.sender)
        receiver_url = f"http://{format_endpoint(inst.host, inst.weight_receiver_port)}"
        transport = self.settings.transport
        mode = self.settings.push_mode
        t0 = time.monotonic()
        link = self._link_gbps(inst, group)
        slow = link is not None and link < self.settings.delta_below_gbps
        wants_delta = mode == "delta" or (mode == "auto" and slow)
        base = inst.weight_version if wants_delta and inst.weight_version < version else None
        layout = await (self.agents.layout(sender_url, group.sender) if base is None else
                        self.agents.layout(sender_url, group.sender, delta_base=base))
        if layout.version != version:  # None: the sender is restaging right now
            raise SenderUnavailable(f"sender {group.sender} has version {layout.version} staged, not {version}")
        offer = layout.delta if layout.delta is not None and layout.delta.base_version == base else None
        if offer is not None and mode == "auto" and offer.bytes * AUTO_DELTA_MAX_RATIO > layout.layout.total_bytes:
            offer = None  # a delta this large saves too little to pay for decoding it
        prep = await self.agents.prepare(receiver_url, PrepareRequest(
            version=version, layout=layout.layout, transport=transport,
            delta_base=None if offer is None else offer.base_version,
            delta_bytes=None if offer is None else offer.bytes))
        use_delta = offer is not None and prep.delta_addr is not None
        request = PushRequest(version=version, ip=group.ip, num_engines=self.senders.engines_per_group,
                              transport=transport, session_ids=prep.session_ids, buffer_addr=prep.buffer_addr)
        if offer is not None and use_delta:
            request = request.model_copy(update={"delta_base": offer.base_version, "delta_addr": prep.delta_addr})
        push = await self.agents.push(sender_url, group.sender, request)
        self._record_sums(version, push)
        sent, kind = push.bytes, "delta" if use_delta else "full"
        if not use_delta and push.gbps > 0:
            self._full_gbps[inst.id] = push.gbps
        try:
            commit = await self.agents.commit(receiver_url, self._commit_request(version, push, stage=stage))
        except PushFailed as exc:
            if not use_delta or not exc.bad_shards:
                raise
            log.warning("delta push of version %d to %s: shard(s) %s did not verify; rewriting them in full",
                        version, inst.endpoint, exc.bad_shards)
            repair = await self.agents.push(sender_url, group.sender, request.model_copy(update={
                "delta_base": None, "delta_addr": None, "only_shards": exc.bad_shards}))
            commit = await self.agents.commit(receiver_url, self._commit_request(version, repair, delta=False,
                                                                                 stage=stage))
            sent, kind = sent + repair.bytes, "delta+repair"
        return WeightPush(inst.id, inst.endpoint, version, group.sender, group.group, group.ip, transport, kind,
                          f"sender:{group.sender}", sent, layout.layout.total_bytes, push.seconds, push.gbps,
                          commit.verify_s, commit.load_s, commit.apply_s, commit.reloaded,
                          round(time.monotonic() - t0, 6), time.time())

    def _link_gbps(self, inst: Instance, group: Group) -> float | None:
        """GB/s of ``inst``'s last full push from its sender; for one that never had one (bootstrapped by
        a peer), the median over its sender group's instances; None when nothing was measured."""
        own = self._full_gbps.get(inst.id)
        if own is not None:
            return own
        rates = sorted(self._full_gbps[i.id] for i in self.registry
                       if i.id in self._full_gbps and self.senders.group_of(i) == group)
        return rates[len(rates) // 2] if rates else None

    @staticmethod
    def _commit_request(version: int, push: PushAnswer, *, delta: bool = True, stage: bool = False) -> CommitRequest:
        with_delta = delta and push.delta_base is not None
        return CommitRequest(version=version, fingerprint=push.fingerprint, shards=push.shards,
                             checksums=push.checksums, delta_base=push.delta_base if with_delta else None,
                             delta_bytes=push.bytes if with_delta else None, stage=True if stage else None)
