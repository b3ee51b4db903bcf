"""Delivering one weight version to one instance, and the retry rule both of weight sync's paths use.

Runs in: manager.

A version comes from the nearest peer that holds it (where one may serve), else, or when that fails,
from the instance's sender: a delta where it pays, with the shards that did not verify rewritten in
full. :meth:`Delivery.attempt` is one try of that with what a failure means (a sender that is not ready
is waited for; other failures count toward ``weight_push_max_attempts``, after which the instance is
removed), for the drain path (:mod:`rollout_manager.weights.sync`) and the staged one
(:mod:`rollout_manager.weights.staged`) alike.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import aiohttp

from rollout_manager.instances.registry import Instance, Registry, State
from rollout_manager.notify import Signal, bounded
from rollout_manager.osutil import format_endpoint
from rollout_manager.weights.agent_client import AgentClient, PushFailed, SenderUnavailable
from rollout_manager.weights.groups import Group, SenderPlan
from rollout_manager.weights.peers import choose_peer, holders
from rollout_manager.weights.protocol import (
    CommitRequest,
    PrepareRequest,
    PushAnswer,
    PushRequest,
    ServeRequest,
)
from rollout_manager.weights.push_record import WeightPush
from rollout_manager.weights.sync_settings import SyncSettings

log = logging.getLogger("rollout_manager.weights.sync")

T = TypeVar("T")
PushListener = Callable[[WeightPush], None]
# "auto" sends a delta only when it is at most 1/this of the full bytes (larger ones save too little
# wire time to pay for encoding and applying them); "delta" sends any delta the sender has.
AUTO_DELTA_MAX_RATIO = 2


@dataclass
class Tries:
    """One instance's failed deliveries in a row, toward ``weight_push_max_attempts``; ``gave_up`` once the
    instance was removed for them."""

    failures: int = 0
    gave_up: bool = False


class Delivery:
    """Pushes versions to instances; keeps what later pushes choose by (who synced here, link speeds, the
    trainer's checksums for peers) and the record of recent pushes."""

    def __init__(self, registry: Registry, senders: SenderPlan, agents: AgentClient, settings: SyncSettings,
                 load_changed: Signal) -> None:
        """``load_changed``: what a retry waits on besides ``retry_s`` (the dispatcher's signal)."""
        self.registry = registry
        self.senders = senders
        self.agents = agents
        self.settings = settings
        self.load_changed = load_changed
        self.pushes: list[WeightPush] = []  # recent push results, for status
        self.push_listeners: list[PushListener] = []  # every successful push (metrics)
        self.synced: set[str] = set()  # instances that got a version here (else: joining, a peer may serve)
        self._serving: dict[str, int] = {}  # peer bootstraps in flight per serving instance
        self._trainer_sums: dict[int, tuple[str, list[tuple[int, int]], list[str]]] = {}  # version -> sums
        self._full_gbps: dict[str, float] = {}  # instance -> GB/s of its last full push from its sender

    def forget(self, inst: Instance) -> None:
        """``inst`` is gone: nothing about it chooses a later push."""
        self.synced.discard(inst.id)
        self._full_gbps.pop(inst.id, None)

    async def attempt(self, inst: Instance, version: int, group: Group, tries: Tries, *,
                      stage: bool = False) -> WeightPush | None:
        """One delivery (:meth:`deliver`); None when it failed, after waiting ``retry_s`` (or less, when load
        changes) for the caller's next try, or at once with ``tries.gave_up`` when the failure was the last
        one allowed and the instance is removed. A sender that is down or has not staged ``version`` is not
        the instance's fault: counted as no failure, it is waited for."""
        cfg = self.settings
        what = "weight staging" if stage else "weight push"
        try:
            return await self.deliver(inst, version, group, tries.failures, stage)
        except SenderUnavailable as exc:
            if inst.last_error != f"{what}: {exc}":
                log.warning("%s of version %d to %s waits for its sender: %s", what, version, inst.endpoint, exc)
                self.registry.set_error(inst, f"{what}: {exc}")
            if not stage:  # out of service meanwhile: say why (a staging instance serves the old version)
                self.registry.wait_for(inst, f"its sender to stage version {version}")  # or to be back: last_error
            await self.load_changed.wait(cfg.retry_s)
            return None
        except (PushFailed, asyncio.TimeoutError, aiohttp.ClientError) as exc:
            reason = str(exc) or type(exc).__name__
            error = f"{what}: {reason}"
        except Exception as exc:  # a bug must not leave the instance waiting for good: count it as a failure
            log.exception("%s of version %d to %s failed unexpectedly", what, version, inst.endpoint)
            reason = repr(exc)
            error = f"{what}: internal error: {reason}"
        tries.failures += 1
        self.registry.set_error(inst, error)
        log.warning("%s of version %d to %s failed (%d/%d): %s", what, version, inst.endpoint, tries.failures,
                    cfg.max_attempts, reason)
        if tries.failures >= cfg.max_attempts:
            self.registry.transition(inst, State.DEAD, f"weight push failed {tries.failures} times; last: {reason}")
            tries.gave_up = True
            return None
        await self.load_changed.wait(cfg.retry_s)
        return None

    def note_push(self, result: WeightPush) -> None:
        self.pushes.append(result)
        del self.pushes[:-100]
        for listener in self.push_listeners:
            listener(result)

    async def deliver(self, inst: Instance, version: int, group: Group, failures: int,
                       stage: bool = False) -> WeightPush:
        """From the nearest peer holding ``version`` where one may serve, else (or when it fails) from the
        instance's sender; each bounded by ``push_timeout_s``, and the peer's own calls by ``peer_timeout_s``.
        ``stage``: the receiver verifies and holds it staged, SGLang untouched (see the staged path,
        :mod:`rollout_manager.weights.staged`)."""
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
        if inst.id in self.synced and inst.weight_version == version - 1 and not failures:
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
