"""The control process's side of its relays: what each relay reported, the fleet stream each one follows,
and what a new control process takes back from them.

A relay says hello when it connects (its pid and the instances it knows: after a control restart those are
the fleet), then reports every ``relay_report_s`` (the failures it saw through each box's fault, which count
towards removal here as in one process, and its own load and CPU). The fleet stream sends each relay the
instance views that changed (``mirror.ViewTracker``), woken by registry events and checked on a short tick for
what changes without one (an engine's facts, a version being activated).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec

from rollout_manager.instances.health import HealthMonitor
from rollout_manager.instances.mirror import FleetDelta, ViewTracker, adopt_all
from rollout_manager.instances.registry import Event, Instance, Registry
from rollout_manager.instances.relay_messages import Claim, RelayHello, RelayLoad, RelayReport, SavedTokens
from rollout_manager.instances.saved_tokens import SavedStore
from rollout_manager.instances.version import WeightVersion
from rollout_manager.notify import Signal

log = logging.getLogger("rollout_manager.instances.relay_hub")

TICK_S = 0.25  # how soon a change without a registry event reaches the relays


@dataclass
class RelayRecord:
    """One relay as the control process knows it (status, ``/metrics``)."""

    relay: int
    pid: int
    connected_at: float
    starts: int = 1  # hellos from a new pid: 1 + the times it was started again
    last_report: RelayReport | None = None
    last_report_at: float | None = None
    connected: bool = True

    def to_dict(self, now: float) -> dict[str, Any]:
        load = self.last_report.load if self.last_report is not None else RelayLoad()
        return {"relay": self.relay, "pid": self.pid, "connected": self.connected, "restarts": self.starts - 1,
                "report_age_s": None if self.last_report_at is None else round(now - self.last_report_at, 3),
                **msgspec.to_builtins(load)}


class RelayHub:
    def __init__(self, run_id: str, registry: Registry, version: WeightVersion, health: HealthMonitor) -> None:
        self.run_id = run_id
        self.registry = registry
        self.version = version
        self.health = health
        self.relays: dict[int, RelayRecord] = {}
        self.adopted = 0  # instances taken from relays after a start
        self.saved = SavedStore()  # the relays' running sequences' tokens (rollout.checkpoints)
        self._changed = Signal()
        registry.listeners.append(self._on_event)

    def _on_event(self, inst: Instance, event: Event) -> None:
        self._changed.notify()

    def hello(self, hello: RelayHello) -> dict[str, Any]:
        """A relay connects. Instances it knows and this process does not are adopted as they were (this
        process started again: the relays kept the fleet), and the weight version with them."""
        now = time.time()
        known = self.relays.get(hello.relay)
        starts = 1 if known is None else known.starts + (known.pid != hello.pid)
        self.relays[hello.relay] = RelayRecord(hello.relay, hello.pid, now, starts)
        if hello.weight_version > self.version.current:
            self.version.current = hello.weight_version
        adopted = adopt_all(self.registry, hello.instances, f"adopted from relay {hello.relay} (control restarted)")
        self.adopted += len(adopted)
        if adopted:
            log.warning("adopted %d instance(s) relay %d still serves: %s", len(adopted), hello.relay,
                        ", ".join(i.endpoint for i in adopted))
        return {"run_id": self.run_id, "adopted": [i.id for i in adopted]}

    def report(self, report: RelayReport) -> dict[str, Any]:
        """A relay's report: its failures count here as the control process's own requests' would."""
        record = self.relays.get(report.relay)
        if record is None or record.pid != report.pid:
            record = self.relays[report.relay] = RelayRecord(report.relay, report.pid, time.time())
        record.last_report, record.last_report_at, record.connected = report, time.time(), True
        unknown = 0
        for iid, reason in report.failures:
            inst = self.registry.get(iid)
            if inst is None:
                unknown += 1
            else:
                self.health.report_failure(inst, f"{reason} (through relay {report.relay})")
        for iid in report.successes:
            inst = self.registry.get(iid)
            if inst is not None:
                self.health.report_success(inst)
        missing = self.saved.apply(report.relay, report.saved, report.done)
        return {"unknown_instances": unknown, "missing": missing}

    def claim(self, claim: Claim) -> dict[str, SavedTokens]:
        """The saved tokens of sequences a caller sent again, for the relay that got them."""
        return self.saved.claim(claim.relay, claim.keys)

    async def stream(self, relay: int) -> AsyncIterator[bytes]:
        """The fleet stream for ``relay``: one NDJSON line per change, the whole fleet first."""
        tracker = ViewTracker()
        encoder = msgspec.json.Encoder()
        try:
            while True:
                delta: FleetDelta | None = tracker.delta(self.run_id, self.registry, self.version)
                if delta is not None:
                    yield encoder.encode(delta) + b"\n"
                await self._changed.wait(TICK_S)
        finally:
            record = self.relays.get(relay)
            if record is not None:
                record.connected = False

    def status(self) -> list[dict[str, Any]]:
        now = time.time()
        return [r.to_dict(now) for _, r in sorted(self.relays.items())]
