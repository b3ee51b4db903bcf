"""Health: one watch task per instance, from registration until it is gone.

A new instance is ``pending`` until its first successful ``/health_generate`` (a real forward pass, so
a box that answers ``/health`` while its model still loads is not sent work), within the start-up
grace period. Then it serves at once if its weights are current, or goes to ``syncing`` for weight
sync to bring it up (weight sync listens for that transition; this module never calls into it).
While it serves, a periodic probe and every request that fails through the instance's fault count
towards ``health_failure_threshold`` consecutive failures, after which it is removed. A weight load
can outlast the probe interval, so a ``syncing`` instance is not probed.

Of each instance this module alone writes the failure counts (``Instance.health``) and what the engine
said about itself (``Instance.engine``, replaced whole); errors and waits it reports to the registry.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from rollout_manager.config import Config
from rollout_manager.instances.instance import EngineFacts
from rollout_manager.instances.registry import Event, Instance, Registry, State
from rollout_manager.instances.version import WeightVersion
from rollout_manager.sglang import wire
from rollout_manager.sglang.client import Probe

log = logging.getLogger("rollout_manager.health")

ProbeFn = Callable[[str, str, float], Awaitable[Probe]]  # (base_url, path, timeout_s) -> Probe
ServerInfoFn = Callable[[str, float], Awaitable[wire.ServerInfo]]  # (base_url, timeout_s); raises when unreadable
SleepFn = Callable[[float], Awaitable[None]]


def adopt_engine(inst: Instance, facts: EngineFacts) -> None:
    """What ``inst``'s engine said, as another process's health monitor read it (``mirror.py``)."""
    if inst.engine != facts:
        inst.engine = facts


@dataclass(frozen=True)
class HealthSettings:
    startup_grace_period_s: float
    pending_poll_interval_s: float
    check_interval_s: float
    check_timeout_s: float
    check_path: str
    failure_threshold: int

    @classmethod
    def from_config(cls, cfg: Config) -> HealthSettings:
        return cls(cfg.startup_grace_period_s, cfg.pending_poll_interval_s, cfg.health_check_interval_s,
                   cfg.health_check_timeout_s, cfg.health_check_path, cfg.health_failure_threshold)


class HealthMonitor:
    def __init__(self, registry: Registry, version: WeightVersion, probe: ProbeFn, settings: HealthSettings,
                 *, sleep: SleepFn = asyncio.sleep, server_info: ServerInfoFn | None = None) -> None:
        self.registry = registry
        self.version = version
        self.probe = probe
        self.server_info = server_info  # read once, at the first ready probe
        self.settings = settings
        self.sleep = sleep  # tests pass a fake clock's
        self._watchers: dict[str, asyncio.Task[None]] = {}
        # Told when an instance with failures succeeds again (the dispatcher: requests that avoided it
        # may go there now); a recovery is not a state transition, so registry listeners never see it.
        self.recovery_listeners: list[Callable[[Instance], None]] = []
        registry.listeners.append(self._on_event)

    # ------------------------------------------------------------ failures seen while serving
    def report_failure(self, inst: Instance, reason: str) -> None:
        """A request or probe failed through ``inst``'s fault; removed at the threshold."""
        if self.registry.get(inst.id) is not inst:
            return
        health = inst.health
        health.consecutive_failures += 1
        health.failures_total += 1  # a probe that passes clears the above, not this
        self.registry.set_error(inst, reason)
        if health.consecutive_failures >= self.settings.failure_threshold:
            self.registry.transition(
                inst, State.DEAD, f"{health.consecutive_failures} consecutive failures; last: {reason}"
            )

    def report_success(self, inst: Instance) -> None:
        if inst.health.consecutive_failures:  # recovered: the error it had is history (push errors stay theirs)
            inst.health.consecutive_failures = 0
            self.registry.clear_error(inst)
            for listener in self.recovery_listeners:
                listener(inst)

    async def close(self) -> None:
        tasks = list(self._watchers.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._watchers.clear()

    # ------------------------------------------------------------ watching
    def _on_event(self, inst: Instance, event: Event) -> None:
        if event.old is None:  # registered
            self._watchers[inst.id] = asyncio.get_running_loop().create_task(
                self._watch(inst), name=f"health:{inst.id}")
        elif event.new == State.DEAD:
            task = self._watchers.pop(inst.id, None)
            if task is not None and task is not asyncio.current_task():
                task.cancel()

    async def _watch(self, inst: Instance) -> None:
        if await self._until_ready(inst):
            await self._check_periodically(inst)

    async def _until_ready(self, inst: Instance) -> bool:
        cfg = self.settings
        deadline = self.registry.clock() + cfg.startup_grace_period_s
        if inst.state == State.PENDING:
            self.registry.wait_for(inst, f"first successful {wire.HEALTH_GENERATE}")
        while inst.state == State.PENDING:
            probe = await self.probe(inst.url, wire.HEALTH_GENERATE, cfg.check_timeout_s)
            if inst.state != State.PENDING:
                break
            if probe.ready:
                refusal = await self._refusal(inst)
                if inst.state != State.PENDING:
                    break
                if refusal is not None:
                    self.registry.transition(inst, State.DEAD, refusal)
                    return False
                self.registry.clear_error(inst)  # start-up probe errors are over
                if self.version.behind(inst):
                    self.registry.transition(inst, State.SYNCING,
                                             f"bootstrap to weight version {self.version.current}")
                else:
                    self.registry.transition(inst, State.ACTIVE, "healthy")
                break
            self.registry.set_error(inst, probe.describe())
            if probe.local:  # the manager could not even ask: its own limit, not the instance's time
                deadline += cfg.pending_poll_interval_s
            elif self.registry.clock() >= deadline:
                self.registry.transition(
                    inst, State.DEAD,
                    f"not healthy within the start-up grace period ({cfg.startup_grace_period_s:g}s); "
                    f"last probe: {inst.last_error}",
                )
                return False
            await self.sleep(cfg.pending_poll_interval_s)
        return self.registry.get(inst.id) is inst

    async def _refusal(self, inst: Instance) -> str | None:
        """Why a healthy new instance can never serve here (a data-parallel SGLang cannot take weight
        pushes), or None. An unreadable ``/server_info`` is no reason: the instance stays.

        The same read records how the instance streams (a cumulative one is warned about here, once),
        its vocabulary size and the weight version it reports now, which its chunks are checked against."""
        if self.server_info is None:
            return None
        try:
            info = await self.server_info(inst.url, self.settings.check_timeout_s)
        except Exception as exc:  # whatever went wrong, it is no reason to remove the instance
            log.warning("instance %s %s: cannot read %s (%s); not checking its parallelism", inst.id,
                        inst.endpoint, wire.SERVER_INFO, exc)
            return None
        inst.engine = engine_facts(info, inst.declared_vocab_size, inst.vocab_from_config)
        if inst.engine.streaming == "cumulative":
            log.warning("instance %s %s streams cumulative chunks (every chunk repeats the whole output so far, "
                        "so relaying costs more CPU per token); start SGLang with --incremental-streaming-output "
                        "(scripts/launch_sglang.sh does)", inst.id, inst.endpoint)
        if info.dp_size > 1:
            return wire.dp_refusal(inst.endpoint, info.dp_size)
        return None

    async def _check_periodically(self, inst: Instance) -> None:
        cfg = self.settings
        while self.registry.get(inst.id) is inst:
            await self.sleep(cfg.check_interval_s)
            if _loading(inst):
                continue  # a weight load may outlast the interval; the push has its own timeout
            probe = await self.probe(inst.url, cfg.check_path, cfg.check_timeout_s)
            if _loading(inst):
                continue  # it started loading weights while the probe ran: the answer says nothing
            if not probe.failed:
                self.report_success(inst)
                continue
            log.warning("instance %s %s failed a health check (%d/%d before removal): %s", inst.id,
                        inst.endpoint, inst.health.consecutive_failures + 1, cfg.failure_threshold, probe.describe())
            self.report_failure(inst, f"health check: {probe.describe()}")


def _loading(inst: Instance) -> bool:
    """Loading weights: syncing, or activating a staged version (generation paused on purpose)."""
    return inst.state == State.SYNCING or inst.versions.activating is not None


def engine_facts(info: wire.ServerInfo, declared_vocab_size: int | None,
                 vocab_from_config: bool = False) -> EngineFacts:
    """What ``/server_info`` (and ``/model_info``) said, as one value: how it streams, what it runs at once
    (the dispatcher's bound on it), its vocabulary size (the smaller of what it says and what was declared
    at registration; checked when the server said it or its launcher read the model's config) and the weight
    version it reports before any push from here."""
    incremental = info.incremental_streaming_output
    return EngineFacts(
        streaming=None if incremental is None else "incremental" if incremental else "cumulative",
        server_stream_interval=None if incremental is None else info.stream_interval,
        max_running_requests=info.max_running_requests,
        vocab_size=min((v for v in (info.vocab_size, declared_vocab_size) if v is not None), default=None),
        vocab_checked=info.vocab_size is not None or (vocab_from_config and declared_vocab_size is not None),
        joined_version=info.weight_version,
        routed_experts=info.routed_experts,
        dtype=info.dtype,
        quantization=info.quantization,
        tp_size=info.tp_size,
        speculative_algorithm=info.speculative_algorithm,
    )
