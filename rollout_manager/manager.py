"""The composition root: builds the three flows' parts, wires them together, and answers the API.

- instances: the registry (lifecycle), the health monitor, admission, the fleet's weight version;
- rollout: the dispatcher (who serves the next sequence, the local window) and the generator
  (generation with continuation);
- weights: the sender plan (groups) and weight sync (versioned pushes through the agents).

The parts talk through registry events and the dispatcher's signal, never through this class, so
this file holds only construction and the trainer's and admin's entry points. No aiohttp requests
here: the HTTP layer calls these methods with validated plain values, on the event loop, so there
are no locks.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import hmac
import logging
import secrets
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec

from rollout_manager.config import Config
from rollout_manager.errors import BadRequest, Conflict, Forbidden, NotFound
from rollout_manager.instances.admission import Admission
from rollout_manager.instances.control_link import ControlLink
from rollout_manager.instances.health import HealthMonitor, HealthSettings
from rollout_manager.instances.mismatch import BoxReport, MismatchLedger, MismatchSettings
from rollout_manager.instances.probe import ProbeMonitor, ProbeSettings
from rollout_manager.instances.quarantine import Quarantine, QuarantineSettings
from rollout_manager.instances.registry import Instance, Kind, Registry, State
from rollout_manager.instances.relay_hub import RelayHub
from rollout_manager.instances.relay_messages import RelayLoad
from rollout_manager.instances.served_ids import safe_id_limit
from rollout_manager.instances.version import WeightVersion
from rollout_manager.metrics import ManagerMetrics
from rollout_manager.osutil import open_file_limit
from rollout_manager.placement import preemptible
from rollout_manager.placement.affinity import AffinitySettings
from rollout_manager.placement.dispatch import Dispatcher
from rollout_manager.placement.fleet_signal import FleetSignal
from rollout_manager.placement.local_budget import LocalBudget
from rollout_manager.placement.policy_registry import make_policy
from rollout_manager.placement.scheduler_state import StateFile
from rollout_manager.rollout.checkpoints import Checkpoints
from rollout_manager.rollout.evacuation import EvacuationSettings, Evacuator
from rollout_manager.rollout.generation import Generator
from rollout_manager.rollout.generation_settings import GenerationSettings
from rollout_manager.rollout.trust_follower import TrustFollower
from rollout_manager.sglang import relay
from rollout_manager.sglang.auth import SGLangAuth
from rollout_manager.sglang.client import SGLangClient
from rollout_manager.sglang.logprob_probe import ID_RUNGS, probe_ids, probe_limit
from rollout_manager.sglang.relay import Relay
from rollout_manager.weights.agent_client import AgentClient
from rollout_manager.weights.groups import SenderPlan
from rollout_manager.weights.sync import WeightSync
from rollout_manager.weights.sync_settings import SyncSettings

log = logging.getLogger("rollout_manager.manager")

NOT_SERVING = (State.PENDING, State.SYNCING)


class Role(str, enum.Enum):
    """What one process of the manager does (docs/relays.md)."""

    SINGLE = "single"  # everything: the default, and the demo's embedded manager
    CONTROL = "control"  # registration, health, weights, trust; relays follow its fleet
    RELAY = "relay"  # the rollout path, on a copy of the control process's fleet


# A relay's proof to its control process when ``relay_secret`` is set (api.relay_routes.from_relay).
RELAY_SECRET_HEADER = "X-Rollout-Manager-Relay-Secret"


@dataclass(frozen=True)
class RelayPlace:
    """Where a relay stands: relay ``index`` of ``relays``, following the control process at ``control_url``,
    listening on its own ``private`` HOST:PORT too; ``front_url``: the relay that holds the OpenAI front's
    sessions (None: this one)."""

    index: int
    relays: int
    control_url: str
    private: str
    front_url: str | None = None


class Manager:
    """One rollout manager. Build it inside a running event loop; :meth:`close` it when done."""

    def __init__(self, config: Config, *, role: Role = Role.SINGLE, run_id: str | None = None,
                 place: RelayPlace | None = None) -> None:
        """``run_id``: given by a supervisor that starts this process again (boxes see a restarted manager by a new
        one, and a restarted control process is the same manager); ``place``: a relay's (required for RELAY)."""
        cfg = self.config = config
        self.role = role
        self.place = place
        self.started_at = time.time()
        self.run_id = run_id or uuid.uuid4().hex
        self.last_metrics: dict[str, Any] = {}
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=False),
            timeout=aiohttp.ClientTimeout(total=None, connect=cfg.health_check_timeout_s),
        )
        self.relay = Relay()  # /generate's own lean client, with per-instance keep-alive pools
        relay.attach(self.session, self.relay)
        self.sglang = SGLangClient(self.session, auth=SGLangAuth(cfg.sglang_api_key, cfg.sglang_admin_api_key))
        # instances
        self.registry = Registry()
        self.version = WeightVersion()
        # The registry the parts that act on boxes (health, trust, weights) watch: a relay's own follows the control
        # process, which acts for every relay, so there those parts watch an empty one and stay idle.
        acting = Registry() if role is Role.RELAY else self.registry
        self._relay_finished = 0  # sequences this relay finished (its reports say so)
        self.link = self._control_link() if role is Role.RELAY else None
        self.admission = Admission(cfg.registration_networks, cfg.registration_allowed_networks,
                                   cfg.allow_registration_host_mismatch)
        self.mismatch = MismatchLedger(MismatchSettings.from_config(cfg))  # trust figures (report only)
        self.health = HealthMonitor(acting, self.version, self.sglang.probe, HealthSettings.from_config(cfg),
                                    server_info=self.sglang.server_info)
        self.probes = ProbeMonitor(acting, self.sglang.prefill_logprobs, ProbeSettings.from_config(cfg))
        self.hub = RelayHub(self.run_id, self.registry, self.version, self.health) if role is Role.CONTROL else None
        # rollout
        self.dispatcher = self._dispatcher()
        self.health.recovery_listeners.append(self.dispatcher.recovered)
        self.local_budget = LocalBudget(cfg.local_budget_initial_s, cfg.local_budget_min_s,
                                        cfg.local_budget_max_s, cfg.local_budget_gain)
        self.generator = Generator(
            self.dispatcher, self.sglang,
            GenerationSettings.from_config(cfg),
            self.local_budget,
            on_instance_failure=self.health.report_failure if self.link is None else self.link.report_failure,
            on_instance_success=self.health.report_success if self.link is None else self.link.report_success,
        )
        # What the scheduler learned before a restart (the prompts' lengths, the boxes' speed curves), kept.
        self.scheduler_state = self._scheduler_state()
        # weights
        self.senders = SenderPlan(acting, cfg)
        self.weights = WeightSync(acting, self.version, self.senders,
                                  AgentClient(self.session, cfg.auth_token, cfg.weight_push_timeout_s),
                                  SyncSettings.from_config(cfg), self.dispatcher.changed, self.generator.evict,
                                  on_serving=self._serving_new_version)
        self.quarantine = Quarantine(acting, self.probes, self.mismatch, QuarantineSettings.from_config(cfg),
                                     self.generator.evict, self.generator.migrator.mark,
                                     self.generator.migrator.provisional)
        # Boxes with a preemption notice: their sequences finish there or move before the deadline.
        self.evacuations = Evacuator(self.registry, self.version, self.dispatcher, self.generator.migrator,
                                     self.generator.lengths, EvacuationSettings.from_config(cfg))
        self.metrics = ManagerMetrics(self.registry, self.version, self.dispatcher, self.generator, self.weights,
                                      self.local_budget, self.sglang.limits, self.started_at, self.mismatch,
                                      self.quarantine)
        self.metrics.evacuations = self.evacuations

        # The scaling signal: boxes of each kind the rest of the step needs (read at scrape and status).
        self.fleet_signal = FleetSignal(self.registry, self.dispatcher, cfg.scale_target_step_s)
        self.metrics.fleet_signal = self.fleet_signal
        self.metrics.relay_hub = self.hub

        self.probes.start()
        self.quarantine.start()
        if self.scheduler_state is not None:
            self.scheduler_state.start()
        self._wire_relays()

    def _dispatcher(self) -> Dispatcher:
        """The dispatcher the configuration asks for (a relay fills its part of each box's bound)."""
        cfg, place = self.config, self.place
        dispatcher = Dispatcher(self.registry, make_policy(cfg.scheduler_policy),
                                max_in_flight_per_instance=cfg.max_in_flight_per_instance,
                                max_in_flight_total=cfg.max_in_flight_total, gather_s=cfg.placement_gather_s,
                                share=(place.index, place.relays) if place is not None else (0, 1))
        if cfg.preemptible_long_tokens:  # the step's tail off preemptible boxes
            dispatcher.narrow_remote = lambda boxes, tokens: preemptible.steady_first(
                boxes, tokens, cfg.preemptible_long_tokens)
        if cfg.affinity:
            dispatcher.enable_affinity(AffinitySettings(cfg.affinity_capacity, cfg.affinity_block_tokens,
                                                        max_slowdown=cfg.affinity_max_slowdown))
        return dispatcher

    def _control_link(self) -> ControlLink:
        """A relay's link to its control process."""
        cfg, place = self.config, self.place
        assert place is not None, "a relay needs its place"
        link = ControlLink(place.control_url, place.index, cfg.auth_token, self.registry, self.version, self.session,
                           self._relay_load, cfg.relay_report_s)
        if cfg.relay_secret:  # the control process is reached over the network (under Ray)
            link.headers[RELAY_SECRET_HEADER] = cfg.relay_secret
        return link

    def _scheduler_state(self) -> StateFile | None:
        """The scheduler state file, read now. With relays each relay learns from its own streams and reads the
        file; relay 0 alone writes it, and the control process has none."""
        cfg = self.config
        if not cfg.scheduler_state_file or self.role is Role.CONTROL:
            return None
        state = StateFile(cfg.scheduler_state_file, self.generator.lengths, self.dispatcher.fleet.speed_curves,
                          self.dispatcher.fleet.remember_speeds, cfg.scheduler_state_save_s)
        state.load()
        return state if self.place is None or self.place.index == 0 else None

    def _wire_relays(self) -> None:
        """With relays (docs/relays.md): the control process hears the relays' trust marks and distrusted samples;
        a relay saves its sequences outside itself, shares the lengths it finished, carries out trust verdicts and
        starts following the control process."""
        cfg = self.config
        provisional = self.generator.migrator.provisional
        if self.hub is not None:  # the relays carry out trust verdicts on their sequences (rollout.trust_follower)
            self.hub.distrusting_of = provisional.distrusting_of
            self.hub.list_distrusted = provisional.list_item
            self.probes.verdict_listeners.append(self.hub.on_verdict)
            self.probes.before_send = self.hub.announce
            self.evacuations.elsewhere = self.hub.running_on  # a box goes once the relays' sequences left it
        if self.link is not None:
            if cfg.relay_checkpoint_tokens:  # running sequences saved outside this relay (rollout.checkpoints)
                saving = self.generator.checkpoints = Checkpoints(cfg.relay_checkpoint_tokens)
                self.link.collect = saving.collect
            lengths = self.generator.lengths
            if lengths is not None:  # every relay's length model learns the whole fleet's finished lengths
                lengths.shared = []
                self.link.take_lengths, self.link.learn_lengths = lengths.take_shared, lengths.finished_elsewhere
            self.generator.finished_listeners.append(self._count_finished)
            follower = TrustFollower(self.registry, self.generator.migrator, self.link.tell_marked)
            self.link.on_view, self.link.distrusted = follower.on_view, follower.distrusted
            self.link.start()

    def _count_finished(self, latency_s: float, tokens: int, ok: bool) -> None:
        self._relay_finished += ok

    def _relay_load(self) -> RelayLoad:
        """What this relay reports of itself to the control process."""
        capacity = self.dispatcher.capacity
        return RelayLoad(capacity.in_flight, capacity.requests_waiting(), self._relay_finished,
                         self.dispatcher.fleet.streamed_tokens, time.process_time(),
                         {i.id: i.load.in_flight for i in self.registry if i.load.in_flight},
                         0 if self.generator.checkpoints is None else self.generator.checkpoints.saving)

    def _serving_new_version(self, inst: Instance) -> None:
        self.dispatcher.recovered(inst)  # place requests waiting for the version
        self.probes.nudge(inst)  # its tokens at the version are provisional until the probe passes

    @property
    def weight_version(self) -> int:
        return self.version.current

    # ------------------------------------------------------------ lifecycle of the daemon
    async def drain_for_shutdown(self, grace_s: float) -> None:
        """Stop placing work, let in-flight sequences finish for up to ``grace_s``, then fail the rest
        with a clear 503 (their instances are told to abort them)."""
        self.dispatcher.close()

        def busy() -> int:
            return sum(i.load.in_flight for i in self.registry)

        if busy():
            log.info("shutting down: waiting up to %gs for %d in-flight sequence(s)", grace_s, busy())
        if not await self.dispatcher.changed.wait_for(lambda: busy() == 0, grace_s):
            log.warning("shutting down: aborting %d sequence(s) still in flight after %gs", busy(), grace_s)
        self.generator.stop()

    async def close(self) -> None:
        """Cancel every background task, write the scheduler's state, and close outgoing connections."""
        if self.scheduler_state is not None:
            await self.scheduler_state.close()
        await self.weights.close()
        await self.health.close()
        await self.probes.close()
        await self.quarantine.close()
        await self.evacuations.close()
        if self.link is not None:
            await self.link.close()
        self.relay.close()
        await self.session.close()

    # ------------------------------------------------------------ registration
    async def check_registration_source(self, source: str | None, hosts: Sequence[str]) -> None:
        """Every host named must be the caller's own (``admission``): remote boxes and local instances alike."""
        await self.admission.check(source, hosts)

    def register_remote(self, host: str, port: int, handshake_port: int | None,
                        receiver_port: int | None = None, vocab_size: int | None = None, *,
                        vocab_from_config: bool = False, preemptible: bool = False,
                        price_per_hour: float | None = None) -> dict[str, Any]:
        # The box's own credential: with it (and without the shared token) its launcher can remove
        # this instance and nothing else. Only its digest is kept; it is never shown again.
        box_token = secrets.token_urlsafe(32)
        inst = self.registry.add(host, port, Kind.REMOTE, handshake_port, receiver_port,
                                 declared_vocab_size=vocab_size, vocab_from_config=vocab_from_config,
                                 box_token_digest=token_digest(box_token), preemptible=preemptible,
                                 price_per_hour=price_per_hour)
        return {
            "id": inst.id,
            "endpoint": inst.endpoint,
            "state": inst.state.value,
            "weight_version": self.version.current,
            "weight_transfer": self.senders.assignment_of(inst),
            "box_token": box_token,
        }

    def is_box_token(self, token: str) -> bool:
        """Whether ``token`` is the box token of a registered instance."""
        digest = token_digest(token)
        return any(i.box_token_digest is not None and hmac.compare_digest(i.box_token_digest, digest)
                   for i in self.registry)

    def register_local(self, pairs: Sequence[tuple[str, int]]) -> dict[str, Any]:
        added = self.registry.add_many([(h, p, Kind.LOCAL, None) for h, p in pairs])
        return {"registered": [{"id": i.id, "endpoint": i.endpoint, "state": i.state.value} for i in added]}

    def update_weight_senders(self, sender_ips: list[list[str]], groups_per_sender: int | None = None,
                              engines_per_group: int | None = None) -> dict[str, Any]:
        self.senders.update(sender_ips, groups_per_sender, engines_per_group)
        return self.senders.status()

    # ------------------------------------------------------------ status
    def status(self) -> dict[str, Any]:
        now = self.registry.clock()
        ready = self.registry.in_state(State.ACTIVE)
        live = [i.id for i in self.registry]
        fleet = self.mismatch.fleet(live)
        pending = self.registry.in_state(*NOT_SERVING)
        # With relays, what runs on an instance is theirs: the sum of what each last reported.
        on = self.hub.in_flight() if self.hub is not None else None

        def relayed(inst: Instance) -> dict[str, Any]:
            return {} if on is None else {"in_flight": on.get(inst.id, 0)}

        return {
            "ready_instances": len(ready),
            "pending_instances": len(pending),
            "ready_instance_endpoints": [i.endpoint for i in ready],
            "pending_instance_endpoints": [i.endpoint for i in pending],
            "weight_version": self.version.current,
            "counts": self.registry.counts(),
            "instances": [{**i.to_dict(now), **relayed(i), "weight_versions": i.versions.to_dict(i.weight_version),
                           "mismatch": self.mismatch.of(i.id, fleet), "decode_step": self._step_of(i),
                           "evacuation": self.evacuations.status_of(i)}
                          for i in self.registry],
            "mismatch": self.mismatch.summary(live),
            "quarantine": self.quarantine.status(),
            "evacuations": {**self.evacuations.totals(), "placement": preemptible.rule_status(
                self.registry.in_state(State.ACTIVE, kind=Kind.REMOTE), self.config.preemptible_long_tokens,
                self.dispatcher.makespan is not None)},
            "weight_senders": self.senders.status(),
            "local": {**self.dispatcher.local.to_dict(), "budget_s": self.local_budget.budget_s,
                      "last_metrics": self.last_metrics},
            "generation": {**self.generator.stats, "streamed_tokens": self.dispatcher.fleet.streamed_tokens},
            "lengths": None if self.generator.lengths is None else msgspec.to_builtins(self.generator.lengths.status()),
            "scheduler_state": None if self.scheduler_state is None
            else msgspec.to_builtins(self.scheduler_state.status()),
            "requests_waiting_for_instance": self.dispatcher.capacity.waiting,
            "admission": self.dispatcher.capacity.admission_status(),
            "fleet_demand": self.fleet_signal.status(),
            "relays": None if self.hub is None else self.hub.status(),
            "relay_checkpoints": None if self.hub is None else {**self.hub.saved.status(),
                                                                "adopted_instances": self.hub.adopted},
            "recent_events": [e.to_dict() for e in list(self.registry.events)[-20:]],
            "recent_weight_pushes": [push.to_json() for push in self.weights.pushes[-10:]],
            "manager": {"open_file_limit": dict(zip(("soft", "hard"), open_file_limit())),
                        **self.sglang.limits.to_dict()},
        }

    def _step_of(self, inst: Instance) -> dict[str, Any] | None:
        """``inst``'s learned decode step curve (box_speed), None while no box is measured."""
        step = self.dispatcher.fleet.speeds.describe(inst.id, self.dispatcher.capacity.bound_of(inst))
        return None if step is None else msgspec.to_builtins(step)

    # ------------------------------------------------------------ local + remote balance
    def abort_local_requests(self) -> dict[str, Any]:
        """The trainer needs its GPUs: sequences on local instances continue on remote ones now."""
        moving = sum(i.load.in_flight for i in self.registry.in_state(*State, kind=Kind.LOCAL))
        closed = self.dispatcher.local.close("trainer called /abort_local_requests")
        return {"local_window_was_open": closed, "moved_sequences": moving if closed else 0}

    def update_metrics(self, step_time_s: float, bubble_s: float, throughput: float) -> dict[str, Any]:
        """A step ended: adapt the local budget from the trainer's bubble and the remote idle time."""
        self.dispatcher.local.close("step ended")
        remote_idle = self.dispatcher.fleet.take_idle_seconds(Kind.REMOTE)
        before = self.local_budget.budget_s
        after = self.local_budget.update(bubble_s, remote_idle)
        self.dispatcher.local.rearm()
        self.last_metrics = {"step_time_s": step_time_s, "trainer_bubble_time_s": bubble_s,
                             "step_throughput": throughput, "remote_idle_s": round(remote_idle, 6)}
        log.info("step metrics: %s; local budget %.3gs -> %.3gs", self.last_metrics, before, after)
        return {**self.last_metrics, "previous_local_budget_s": before, "local_budget_s": after,
                "generation": dict(self.generator.stats)}

    def update_mismatch(self, step: int, boxes: Sequence[BoxReport], unattributed_tokens: int) -> dict[str, Any]:
        """A step's trainer/rollout log-prob gap per instance: fold it into each one's trust figure.
        Instances no longer registered are left out (named in ``unknown_instances``)."""
        live = [i.id for i in self.registry]
        self.mismatch.forget(live)
        known = [b for b in boxes if self.registry.get(b.instance) is not None]
        unknown = sorted({b.instance for b in boxes} - {b.instance for b in known})
        self.mismatch.report(step, known, unattributed_tokens)
        fleet = self.mismatch.summary(live)
        if fleet["outliers"] or fleet["fleet_wide"]:
            log.warning("step %d log-prob mismatch: %s (%s)", step, fleet["note"], ", ".join(fleet["outliers"]))
        quarantined = self.quarantine.on_mismatch(live)
        return {"step": step, "recorded": len(known), "unknown_instances": unknown, "fleet": fleet,
                "quarantined": quarantined}

    def probe_prompt(self, vocab_size: int | None) -> dict[str, Any]:
        """The trust probe's prompt for ``vocab_size`` (None: the highest rung a registered box is probed at).
        Raises :class:`Conflict` when no box's safe ids are known yet and no size was given."""
        if vocab_size is None:
            vocab_size = max((safe_id_limit(i) for i in self.registry), default=0)
        limit = probe_limit(vocab_size)
        if limit is None:
            raise Conflict("no registered box has token ids known to be safe yet: pass ?vocab_size=N (the "
                           f"model's vocabulary size, at least {ID_RUNGS[0]})")
        return {"vocab_size": vocab_size, "limit": limit, "input_ids": probe_ids(limit)}

    def update_probe_reference(self, version: int, ids: list[int], logprobs: list[float]) -> dict[str, Any]:
        """The trainer's log-probs of the probe prompt at ``version``: the boxes serving it are probed again
        and judged by them."""
        try:
            self.probes.set_reference(version, ids, logprobs)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        again = [i for i in self.registry.in_state(State.ACTIVE) if i.versions.serving(i.weight_version) == version]
        for inst in again:
            self.probes.nudge(inst)
        return {"weight_version": version, "tokens": len(ids), "probed_again": len(again),
                "references": self.probes.references()}

    # ------------------------------------------------------------ weight versions
    async def update_weight_version(self, new_version: int | None, wait_for: int | str | None,
                                    timeout_s: float, staged: bool = False) -> dict[str, Any]:
        version = self.weights.bump(new_version)
        out: dict[str, Any] = {"new_weight_version": version}
        if wait_for is not None:
            out.update(await self.weights.wait(version, None if wait_for == "all" else int(wait_for), timeout_s,
                                               staged))
        return out

    # ------------------------------------------------------------ removal
    async def shutdown_instances(self, endpoints: Sequence[str], check_weight_update: bool,
                                 box_token: str | None = None) -> dict[str, Any]:
        """Drain the named instances (no new work; in-flight work finishes) and remove them.

        With ``check_weight_update`` an instance in the middle of a weight push is left alone and
        reported under ``skipped``, so a transfer is never cut short by an admin call. A caller that
        holds only a ``box_token`` may name only the instance registered with it (403 otherwise,
        before anything is drained).
        """
        if box_token is not None:
            self._own_box(box_token, endpoints, "removes")
        removed, not_found, skipped, targets = [], [], [], []
        for ep in dict.fromkeys(endpoints):
            inst = self.registry.by_endpoint(ep)
            if inst is None:
                not_found.append(ep)
            elif check_weight_update and inst.state == State.SYNCING:
                skipped.append({"endpoint": ep, "reason": "weight update in progress"})
            else:
                targets.append(inst)
        for inst in targets:
            self.registry.transition(inst, State.DRAINING, "shutdown requested")
        drained = await asyncio.gather(*(self._wait_idle(i, self.config.drain_timeout_s) for i in targets))
        for inst, idle in zip(targets, drained):
            by = "removed by request of its box (box token)" if box_token is not None else "removed by request"
            left = inst.load.in_flight if self.hub is None else self.hub.in_flight().get(inst.id, 0)
            reason = by if idle else f"{by} after drain timeout ({left} request(s) still in flight)"
            if self.registry.transition(inst, State.DEAD, reason):
                removed.append(inst.endpoint)
        return {"removed": removed, "not_found": not_found, "skipped": skipped}

    def _own_box(self, box_token: str, endpoints: Sequence[str], what: str) -> None:
        """A caller holding only a box token names only the instance it was issued for: 403 otherwise."""
        digest = token_digest(box_token)
        for ep in endpoints:
            inst = self.registry.by_endpoint(ep)
            if inst is None or inst.box_token_digest is None \
                    or not hmac.compare_digest(inst.box_token_digest, digest):
                raise Forbidden(f"a box token {what} only the instance it was issued for; {ep} is not "
                                f"that instance (the shared auth_token {what} any)")

    # ------------------------------------------------------------ preemption notices
    def evacuate_instance(self, endpoint: str, deadline_s: float, source: str, detail: str | None,
                          box_token: str | None = None) -> dict[str, Any]:
        """A preemption notice for ``endpoint`` (``rollout.evacuation``); 404 unknown, 409 not evacuable."""
        return self.evacuations.start(self._noticed_box(endpoint, box_token, "evacuates"), deadline_s, source, detail)

    def cancel_evacuation(self, endpoint: str, box_token: str | None = None) -> dict[str, Any]:
        """The notice for ``endpoint`` was cancelled: it serves again; 404 unknown, 409 not evacuating."""
        return self.evacuations.cancel(self._noticed_box(endpoint, box_token, "cancels the evacuation of"))

    def _noticed_box(self, endpoint: str, box_token: str | None, what: str) -> Instance:
        if box_token is not None:
            self._own_box(box_token, [endpoint], what)
        inst = self.registry.by_endpoint(endpoint)
        if inst is None:
            raise NotFound(f"endpoint: {endpoint} is not a registered instance")
        return inst

    async def _wait_idle(self, inst: Instance, timeout_s: float) -> bool:
        """Until nothing runs on ``inst``: here, or (the control process) in any relay, as the relays report."""
        hub = self.hub
        if hub is None:
            return await self.dispatcher.changed.wait_for(lambda: inst.load.in_flight == 0, timeout_s)
        return await hub.reported.wait_for(lambda: not hub.running_on(inst.id), timeout_s)


def token_digest(token: str) -> str:
    """What the manager keeps of a box token: enough to recognise it, useless to present."""
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).hexdigest()
