"""The manager core: instances, their health, and weight-transfer assignment. No aiohttp requests here.

The HTTP layer calls these methods with validated plain values; everything that changes state happens
on the event loop in one place, so there are no locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import time
import uuid
from collections.abc import Sequence
from typing import Any

import aiohttp

from rollout_manager.config import Config
from rollout_manager.errors import BadRequest, Forbidden
from rollout_manager.instances.registry import Event, Instance, Kind, Registry, State, format_endpoint
from rollout_manager.rollout.dispatch import Dispatcher
from rollout_manager.rollout.generation import GenerationSettings, Generator
from rollout_manager.rollout.local_budget import LocalBudget
from rollout_manager.rollout.scheduling import make_policy
from rollout_manager.sglang import wire
from rollout_manager.sglang.client import SGLangClient
from rollout_manager.weights.groups import Group, assign, plan_groups
from rollout_manager.weights.sync import WeightSync

log = logging.getLogger("rollout_manager.manager")

NOT_SERVING = (State.PENDING, State.SYNCING)


def _plain_ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address, with IPv4-mapped IPv6 (``::ffff:1.2.3.4``) taken as the IPv4 it is."""
    addr = ipaddress.ip_address(text.split("%", 1)[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


class Manager:
    def __init__(self, config: Config):
        self.config = config
        self.registry = Registry()
        self.registry.listeners.append(self._on_event)
        self.weight_version = 0
        self.groups_per_sender = config.num_mooncake_groups_per_sender
        self.engines_per_group = config.num_mooncake_engines_per_group
        self.sender_ips: list[list[str]] = []
        self.plan: list[list[Group]] = []
        self.started_at = time.time()
        self.run_id = uuid.uuid4().hex  # new on every start: boxes see a restarted manager by it
        self._watchers: dict[str, asyncio.Task[None]] = {}
        self.dispatcher = Dispatcher(self.registry, make_policy(config.scheduler_policy))
        self._session: aiohttp.ClientSession | None = None
        self.sglang: SGLangClient | None = None
        self.generator: Generator | None = None
        self.local_budget = LocalBudget(config.local_budget_initial_s, config.local_budget_min_s,
                                        config.local_budget_max_s, config.local_budget_gain)
        self.last_metrics: dict[str, Any] = {}
        self.weights = WeightSync(self)

    # ------------------------------------------------------------ lifecycle of the daemon
    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=False),
            timeout=aiohttp.ClientTimeout(total=None, connect=self.config.health_check_timeout_s),
        )
        self.sglang = SGLangClient(self._session)
        cfg = self.config
        self.generator = Generator(
            self.dispatcher, self.sglang,
            GenerationSettings(cfg.max_attempts_per_request, cfg.no_instance_wait_timeout_s,
                               cfg.connect_timeout_s, cfg.stream_stall_timeout_s),
            self.local_budget,
            on_instance_failure=self.report_failure, on_instance_success=self.report_success,
        )

    async def drain_for_shutdown(self, grace_s: float) -> None:
        """Stop placing work, let in-flight sequences finish for up to ``grace_s``, then fail the rest
        with a clear 503 (their instances are told to abort them)."""
        self.dispatcher.closing = True
        self.dispatcher.changed.notify()  # requests waiting for an instance fail now
        busy = lambda: sum(i.in_flight for i in self.registry)  # noqa: E731
        if busy():
            log.info("shutting down: waiting up to %gs for %d in-flight sequence(s)", grace_s, busy())
        finished = await self.dispatcher.changed.wait_for(lambda: busy() == 0, grace_s)
        if not finished:
            log.warning("shutting down: aborting %d sequence(s) still in flight after %gs", busy(), grace_s)
        if self.generator is not None:
            self.generator.stop()

    async def close(self) -> None:
        """Cancel every background task and close outgoing connections."""
        await self.weights.close()
        tasks = list(self._watchers.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._watchers.clear()
        if self._session is not None:
            await self._session.close()

    # ------------------------------------------------------------ registration
    async def check_registration_source(self, source: str | None, host: str | None) -> None:
        """Only configured networks may register, and a box registers itself, not someone else.

        ``source`` is the request's peer address (None for in-process calls). With ``host``, the
        registered host must resolve to that address unless ``allow_registration_host_mismatch``.
        """
        if source is None:
            return
        addr = _plain_ip(source)
        nets = self.config.registration_networks
        if not any(addr in net for net in nets if net.version == addr.version):
            raise Forbidden(f"registration from {source} refused: not in registration_allowed_networks "
                            f"({self.config.registration_allowed_networks})")
        if host is None or self.config.allow_registration_host_mismatch:
            return
        try:
            resolved = {_plain_ip(info[4][0]) for info in
                        await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)}
        except (OSError, ValueError):
            raise BadRequest(f"host {host!r} does not resolve") from None
        if addr not in resolved:
            raise Forbidden(f"registration of host {host} refused: the request came from {source}; a box "
                            f"registers itself (set allow_registration_host_mismatch to allow this)")

    def register_remote(self, host: str, port: int, handshake_port: int | None,
                        receiver_port: int | None = None) -> dict[str, Any]:
        inst = self.registry.add(host, port, Kind.REMOTE, handshake_port)
        inst.weight_receiver_port = receiver_port
        self._reassign()
        self._watch(inst)
        return {
            "id": inst.id,
            "endpoint": inst.endpoint,
            "state": inst.state.value,
            "weight_version": self.weight_version,
            "weight_transfer": self.assignment_of(inst),
        }

    def register_local(self, pairs: Sequence[tuple[str, int]]) -> dict[str, Any]:
        added = self.registry.add_many([(h, p, Kind.LOCAL, None) for h, p in pairs])
        for inst in added:
            self._watch(inst)
        return {"registered": [{"id": i.id, "endpoint": i.endpoint, "state": i.state.value} for i in added]}

    def assignment_of(self, inst: Instance) -> dict[str, Any]:
        group = self.group_of(inst)
        return {
            "sender": inst.sender,
            "group": inst.group,
            "sender_ip": group.ip if group else None,
            "num_mooncake_engines_per_group": self.engines_per_group,
            "mooncake_transfer_protocol": self.config.mooncake_transfer_protocol,
            "mooncake_transfer_device_name": self.config.mooncake_transfer_device_name,
        }

    def group_of(self, inst: Instance) -> Group | None:
        if inst.sender is None or inst.group is None:
            return None
        return self.plan[inst.sender][inst.group]

    def sender_url(self, sender: int) -> str:
        """A sender's control API: its node's first allowed IP, on ``weight_sender_base_port``."""
        return f"http://{format_endpoint(self.plan[sender][0].ip, self.config.weight_sender_base_port)}"

    # ------------------------------------------------------------ senders and groups
    def update_weight_senders(
        self,
        sender_ips: list[list[str]],
        groups_per_sender: int | None = None,
        engines_per_group: int | None = None,
    ) -> dict[str, Any]:
        groups = groups_per_sender or self.groups_per_sender
        plan = plan_groups(sender_ips, self.config.allowed_networks, groups)  # raises before any change
        self.sender_ips, self.plan, self.groups_per_sender = sender_ips, plan, groups
        if engines_per_group:
            self.engines_per_group = engines_per_group
        self._reassign()
        self.dispatcher.changed.notify()  # pushes waiting for a sender can go
        log.info("weight senders updated: %d sender(s), %d group(s) each, %d engine(s) per group",
                 len(plan), groups, self.engines_per_group)
        return self.senders_status()

    def _reassign(self) -> None:
        remote = self.registry.in_state(*State, kind=Kind.REMOTE)
        mapping = assign([i.id for i in remote], self.plan)
        for inst in remote:
            group = mapping.get(inst.id)
            inst.sender, inst.group = (group.sender, group.group) if group else (None, None)

    def senders_status(self) -> dict[str, Any]:
        return {
            "num_mooncake_groups_per_sender": self.groups_per_sender,
            "num_mooncake_engines_per_group": self.engines_per_group,
            "weight_sender_base_port": self.config.weight_sender_base_port,
            "mooncake_transfer_protocol": self.config.mooncake_transfer_protocol,
            "mooncake_transfer_device_name": self.config.mooncake_transfer_device_name,
            "senders": [
                {
                    "sender": s,
                    "ips": self.sender_ips[s],
                    "groups": [
                        {**g.to_dict(), "instances": [
                            i.endpoint for i in self.registry if i.sender == s and i.group == g.group
                        ]}
                        for g in groups
                    ],
                }
                for s, groups in enumerate(self.plan)
            ],
        }

    # ------------------------------------------------------------ status
    def status(self) -> dict[str, Any]:
        now = self.registry.clock()
        ready = self.registry.in_state(State.ACTIVE)
        pending = self.registry.in_state(*NOT_SERVING)
        return {
            "ready_instances": len(ready),
            "pending_instances": len(pending),
            "ready_instance_endpoints": [i.endpoint for i in ready],
            "pending_instance_endpoints": [i.endpoint for i in pending],
            "weight_version": self.weight_version,
            "counts": self.registry.counts(),
            "instances": [i.to_dict(now) for i in self.registry],
            "weight_senders": self.senders_status(),
            "local": {**(self.generator.local.to_dict() if self.generator else {}),
                      "budget_s": self.local_budget.budget_s, "last_metrics": self.last_metrics},
            "generation": dict(self.generator.stats) if self.generator else {},
            "recent_events": [e.to_dict() for e in list(self.registry.events)[-20:]],
            "recent_weight_pushes": self.weights.pushes[-10:],
        }

    # ------------------------------------------------------------ local + remote balance
    def abort_local_requests(self) -> dict[str, Any]:
        """The trainer needs its GPUs: sequences on local instances continue on remote ones now."""
        assert self.generator is not None
        moving = sum(i.in_flight for i in self.registry.in_state(*State, kind=Kind.LOCAL))
        closed = self.generator.local.close("trainer called /abort_local_requests")
        return {"local_window_was_open": closed, "moved_sequences": moving if closed else 0}

    def update_metrics(self, step_time_s: float, bubble_s: float, throughput: float) -> dict[str, Any]:
        """A step ended: adapt the local budget from the trainer's bubble and the remote idle time."""
        assert self.generator is not None
        self.generator.local.close("step ended")
        remote_idle = self.dispatcher.take_idle_seconds(Kind.REMOTE)
        before = self.local_budget.budget_s
        after = self.local_budget.update(bubble_s, remote_idle)
        self.generator.local.rearm()
        self.last_metrics = {"step_time_s": step_time_s, "trainer_bubble_time_s": bubble_s,
                             "step_throughput": throughput, "remote_idle_s": round(remote_idle, 6)}
        log.info("step metrics: %s; local budget %.3gs -> %.3gs", self.last_metrics, before, after)
        return {**self.last_metrics, "previous_local_budget_s": before, "local_budget_s": after,
                "generation": dict(self.generator.stats)}

    # ------------------------------------------------------------ weight versions
    async def update_weight_version(self, new_version: int | None, wait_for: int | str | None,
                                    timeout_s: float) -> dict[str, Any]:
        version = self.weights.bump(new_version)
        out: dict[str, Any] = {"new_weight_version": version}
        if wait_for is not None:
            out.update(await self.weights.wait(version, None if wait_for == "all" else int(wait_for), timeout_s))
        return out

    # ------------------------------------------------------------ removal
    async def shutdown_instances(self, endpoints: Sequence[str], check_weight_update: bool) -> dict[str, Any]:
        """Drain the named instances (no new work; in-flight work finishes) and remove them.

        With ``check_weight_update`` an instance in the middle of a weight push is left alone and
        reported under ``skipped``, so a transfer is never cut short by an admin call.
        """
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
            reason = "removed by request" if idle else (
                f"removed by request after drain timeout ({inst.in_flight} request(s) still in flight)"
            )
            if self.registry.transition(inst, State.DEAD, reason):
                removed.append(inst.endpoint)
        return {"removed": removed, "not_found": not_found, "skipped": skipped}

    async def _wait_idle(self, inst: Instance, timeout_s: float) -> bool:
        return await self.dispatcher.changed.wait_for(lambda: inst.in_flight == 0, timeout_s)

    # ------------------------------------------------------------ failures seen while serving
    def report_failure(self, inst: Instance, reason: str) -> None:
        """A request failed on ``inst`` through the instance's fault; same threshold as health checks."""
        if self.registry.get(inst.id) is not inst:
            return
        inst.consecutive_failures += 1
        inst.last_error = reason
        if inst.consecutive_failures >= self.config.health_failure_threshold:
            self.registry.transition(
                inst, State.DEAD, f"{inst.consecutive_failures} consecutive failures; last: {reason}"
            )

    def report_success(self, inst: Instance) -> None:
        inst.consecutive_failures = 0

    # ------------------------------------------------------------ health
    def _watch(self, inst: Instance) -> None:
        self._watchers[inst.id] = asyncio.get_running_loop().create_task(
            self._watch_loop(inst), name=f"health:{inst.id}"
        )

    def _on_event(self, inst: Instance, event: Event) -> None:
        if event.new == State.DEAD:
            self.weights.forget(inst)
            if inst.kind == Kind.REMOTE:
                self._reassign()  # keep the groups even as instances leave
            task = self._watchers.pop(inst.id, None)
            if task is not None and task is not asyncio.current_task():
                task.cancel()

    def _on_ready(self, inst: Instance) -> None:
        """First successful /health_generate: serve at once if its weights are current."""
        if inst.kind == Kind.LOCAL or inst.weight_version >= self.weight_version:
            self.registry.transition(inst, State.ACTIVE, "healthy")
        else:
            self.registry.transition(inst, State.SYNCING, f"bootstrap to weight version {self.weight_version}")
            self.weights.ensure_sync(inst)

    async def _watch_loop(self, inst: Instance) -> None:
        cfg = self.config
        assert self.sglang is not None
        deadline = self.registry.clock() + cfg.startup_grace_period_s
        while inst.state == State.PENDING:
            probe = await self.sglang.probe(inst.url, wire.HEALTH_GENERATE, cfg.health_check_timeout_s)
            if inst.state != State.PENDING:
                break
            if probe.ready:
                self._on_ready(inst)
                break
            inst.last_error = probe.describe()
            if self.registry.clock() >= deadline:
                self.registry.transition(
                    inst, State.DEAD,
                    f"not healthy within the start-up grace period ({cfg.startup_grace_period_s:g}s); "
                    f"last probe: {inst.last_error}",
                )
                return
            await asyncio.sleep(cfg.pending_poll_interval_s)
        while self.registry.get(inst.id) is inst:
            await asyncio.sleep(cfg.health_check_interval_s)
            if inst.state == State.SYNCING:
                continue  # a weight load may outlast the interval; the push has its own timeout
            probe = await self.sglang.probe(inst.url, cfg.health_check_path, cfg.health_check_timeout_s)
            if inst.state == State.SYNCING:
                continue  # it started loading weights while the probe ran: the answer says nothing
            if not probe.failed:
                inst.consecutive_failures = 0
                continue
            log.warning("instance %s %s failed a health check (%d/%d before removal): %s", inst.id,
                        inst.endpoint, inst.consecutive_failures + 1, cfg.health_failure_threshold,
                        probe.describe())
            self.report_failure(inst, f"health check: {probe.describe()}")


@contextlib.asynccontextmanager
async def running_manager(config: Config):
    manager = Manager(config)
    await manager.start()
    try:
        yield manager
    finally:
        await manager.close()
