"""The control process's side of its relays: what each relay reported, the fleet stream each one follows,
and what a new control process takes back from them.

A relay says hello when it connects (its pid and the instances it knows: after a control restart those are
the fleet), then reports every ``relay_report_s`` (the failures it saw through each box's fault, which count
towards removal here as in one process, and its own load and CPU). The fleet stream sends each relay the
instance views that changed (``mirror.ViewTracker``), woken by registry events and checked on a short tick for
what changes without one (an engine's facts, a version being activated). One scan of the views serves every
relay's stream: a tick reads each instance's view once, however many relays follow.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from rollout_manager.instances.health import HealthMonitor
from rollout_manager.instances.mirror import NO_TRUST, FleetDelta, TrustView, ViewTracker, adopt_all, views_of
from rollout_manager.instances.registry import Event, Instance, Registry, State
from rollout_manager.instances.relay_messages import (
    Claim,
    DistrustedItem,
    Marked,
    RelayHello,
    RelayLoad,
    RelayReport,
    SavedTokens,
)
from rollout_manager.instances.saved_tokens import SavedStore
from rollout_manager.instances.trust import Trust
from rollout_manager.instances.version import WeightVersion
from rollout_manager.notify import Signal

log = logging.getLogger("rollout_manager.instances.relay_hub")

TICK_S = 0.25  # how soon a change without a registry event reaches the relays
LENGTHS_KEPT = 100_000  # finished lengths kept for relays that have not been sent them (a relay started again gets all)
MARK_WAIT_S = 2.0  # how long a trust probe waits for the relays to mark what its box made before it goes
LINES_KEPT = 64  # fleet lines kept for streams that have not sent them yet; one further behind gets the whole fleet


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
                **{k: v for k, v in msgspec.to_builtins(load).items() if k != "instances"}}


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
        # The one scan every fleet stream sends from (_scan): its baseline predates every stream's whole fleet.
        self._encoder = msgspec.json.Encoder()
        self._tracker = ViewTracker()
        self._tracker.delta(run_id, registry, version)
        self._lines: deque[tuple[int, bytes]] = deque(maxlen=LINES_KEPT)  # (number, NDJSON line)
        self._made = 0  # lines made so far
        self._scanned_at = time.monotonic()
        self._dirty = False  # a registry event since the last scan
        # Trust verdicts the relays act on (rollout.trust_follower): per instance, and the probes each relay marked.
        self._trust: dict[str, TrustView] = {}
        self._marked: dict[str, dict[int, int]] = {}  # instance id -> relay -> the last probe number it marked for
        self._marks_in = Signal()
        # Finished lengths the relays reported, for the others' length models: (number, relay, prompt key, length).
        self._lengths: deque[tuple[int, int, int, int]] = deque(maxlen=LENGTHS_KEPT)
        self._lengths_made = 0
        self._length_cursor: dict[tuple[int, int], int] = {}  # (relay, pid) -> the last number it was sent
        # Set by the manager: why the control process distrusts an instance's delivered tokens now, and where the
        # relays' distrusted samples are listed (its own ledger, the one /distrusted_samples reads).
        self.distrusting_of: Callable[[str], str | None] = _nobody
        self.list_distrusted: Callable[[DistrustedItem], None] = _drop
        # When each instance stopped taking new work (draining, evacuating), on time.time(): relays' reports from
        # after that, plus a fleet tick, come from relays that saw it (running_on).
        self._closed_at: dict[str, float] = {}
        self.reported = Signal()  # a relay reported
        registry.listeners.append(self._on_event)

    def _on_event(self, inst: Instance, event: Event) -> None:
        self._dirty = True
        self._changed.notify()
        if event.new in (State.DRAINING, State.EVACUATING):
            self._closed_at[inst.id] = time.time()
        elif event.new == State.DEAD:
            self._trust.pop(inst.id, None)
            self._marked.pop(inst.id, None)
            self._closed_at.pop(inst.id, None)

    # ------------------------------------------------------------ trust, carried out by the relays
    def trust_of(self, inst: Instance) -> TrustView:
        """What the relays act on of ``inst``'s trust: the probes announced and passed, and why its delivered
        tokens are distrusted now."""
        trust = self._trust.get(inst.id, NO_TRUST)
        why = self.distrusting_of(inst.id)
        return trust if trust.distrusting == why else msgspec.structs.replace(trust, distrusting=why)

    async def announce(self, inst: Instance, version: int) -> None:
        """A trust probe of ``inst`` at ``version`` is about to go: each connected relay first marks what ``inst``
        made so far in its sequences (a pass vouches for that and no more). A relay that does not mark within
        ``MARK_WAIT_S`` gets nothing vouched by this probe (it marks later, after the probe went: never used)."""
        trust = self._trust.get(inst.id, NO_TRUST)
        sent = trust.sent + 1
        self._trust[inst.id] = msgspec.structs.replace(trust, sent=sent, version=version)
        self._dirty = True
        self._changed.notify()
        waiting = [r.relay for r in self.relays.values() if r.connected]
        deadline = time.monotonic() + MARK_WAIT_S

        def unmarked() -> bool:
            marked = self._marked.get(inst.id, {})
            return any(marked.get(r, 0) < sent for r in waiting)

        while unmarked() and (left := deadline - time.monotonic()) > 0:
            await self._marks_in.wait(left)

    def marked(self, marked: Marked) -> dict[str, Any]:
        """A relay marked what an instance made for its probe number ``sent``."""
        by_relay = self._marked.setdefault(marked.instance, {})
        by_relay[marked.relay] = max(by_relay.get(marked.relay, 0), marked.sent)
        self._marks_in.notify()
        return {}

    def on_verdict(self, probed: Instance, version: int, judged: list[tuple[Instance, Trust]]) -> None:
        """A probe was judged: a pass of ``probed`` (not quarantined) vouches, in the relays, for what they marked
        for it (the control process's own sequences are vouched for by its quarantine part, as in one process)."""
        if probed.quarantined is not None or dict((i.id, t) for i, t in judged).get(probed.id) != Trust.CHECKED:
            return
        trust = self._trust.get(probed.id)
        if trust is not None and trust.version == version and trust.passed < trust.sent:
            self._trust[probed.id] = msgspec.structs.replace(trust, passed=trust.sent)
            self._dirty = True
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
        for item in report.distrusted:
            self.list_distrusted(item)
        answer = {"unknown_instances": unknown, "missing": missing, "lengths": self._share_lengths(report)}
        self.reported.notify()
        return answer

    def _share_lengths(self, report: RelayReport) -> list[tuple[int, int]]:
        """Keep the lengths ``report``'s relay finished; answer those the other relays finished since its last
        report (a relay that just started gets every one kept): each relay's length model learns the whole
        fleet's prompts, whichever relay their samples went to."""
        for key, length in report.lengths:
            self._lengths_made += 1
            self._lengths.append((self._lengths_made, report.relay, key, length))
        since = self._length_cursor.get((report.relay, report.pid), 0)
        self._length_cursor[(report.relay, report.pid)] = self._lengths_made
        return [(key, length) for n, relay, key, length in self._lengths if n > since and relay != report.relay]

    def claim(self, claim: Claim) -> dict[str, SavedTokens]:
        """The saved tokens of sequences a caller sent again, for the relay that got them."""
        return self.saved.claim(claim.relay, claim.keys)

    def _scan(self) -> None:
        """Read every instance's view once for all streams: after a registry event, else once a tick."""
        now = time.monotonic()
        if not self._dirty and now - self._scanned_at < TICK_S - 0.01:  # timers may fire a little early
            return
        self._dirty, self._scanned_at = False, now
        delta = self._tracker.delta(self.run_id, self.registry, self.version, self.trust_of)
        if delta is not None:
            self._made += 1
            self._lines.append((self._made, self._encoder.encode(delta) + b"\n"))

    def _whole(self) -> bytes:
        fleet = FleetDelta(self.run_id, self.version.current, views_of(self.registry, self.trust_of), full=True)
        return self._encoder.encode(fleet) + b"\n"

    async def stream(self, relay: int) -> AsyncIterator[bytes]:
        """The fleet stream for ``relay``: the whole fleet, then one NDJSON line per change, from the scan
        every stream shares (a line repeating what the whole fleet already said is applied as a no-op)."""
        try:
            sent = self._made
            yield self._whole()
            while True:
                if sent == self._made:  # else lines came while this stream's reader was slow: send them now
                    await self._changed.wait(max(0.0, self._scanned_at + TICK_S - time.monotonic()))
                self._scan()
                if self._lines and self._lines[0][0] > sent + 1:  # behind the lines kept: the whole fleet again
                    sent = self._made
                    yield self._whole()
                    continue
                for number, line in list(self._lines):
                    if number > sent:
                        sent = number
                        yield line
        finally:
            record = self.relays.get(relay)
            if record is not None:
                record.connected = False

    def running_on(self, iid: str) -> bool:
        """Whether a connected relay may still run sequences on instance ``iid``, which takes no new work: until
        every connected relay has reported, from after it saw that (``TICK_S`` after the change), none there. A
        relay that is gone runs nothing: its sequences continue elsewhere."""
        since = self._closed_at.get(iid, 0.0) + TICK_S
        return any(r.connected and (r.last_report is None or r.last_report_at is None or r.last_report_at < since
                                    or r.last_report.load.instances.get(iid, 0) > 0) for r in self.relays.values())

    def in_flight(self) -> dict[str, int]:
        """Sequences on each instance over the connected relays, as they last reported."""
        out: dict[str, int] = {}
        for record in self.relays.values():
            if record.connected and record.last_report is not None:
                for iid, n in record.last_report.load.instances.items():
                    out[iid] = out.get(iid, 0) + n
        return out

    def status(self) -> list[dict[str, Any]]:
        now = time.time()
        return [r.to_dict(now) for _, r in sorted(self.relays.items())]


def _nobody(instance: str) -> str | None:
    return None


def _drop(item: DistrustedItem) -> None:
    return None
