"""Quarantine: a box that the trust probe or the trainer's mismatch singles out is taken out of service.

The probe (``probe.py``) and the mismatch ledger (``mismatch.py``) only judge; this module acts on their
verdicts. A box is quarantined when its probe disagrees with the other boxes at its version while some box
there agrees (a majority exists), or when the ledger calls its mismatch an outlier (above
``mismatch_outlier_multiple`` x the fleet's median). Then:

- it leaves service through the registry (``Registry.quarantine``: ``syncing``, flagged), so the dispatcher,
  tail migration and every placement pass it by, and its next weight push reloads it;
- the sequences running on it are evicted with a cut-back: each goes back to its last token made before the
  box's last passing probe (``SequenceState.cut_point``) and continues from there on another box, exactly;
  one between two attempts then is cut back the same way before its next attempt (a quarantine starts a new
  era of the box, ``rollout.provisional``: what it made before is never vouched for, even after it serves
  again at the same version);
- the answers already delivered with tokens it made unvouched (since its last passing probe, or at a version
  none passed) are listed as distrusted samples (``rollout.provisional``, ``GET /distrusted_samples``), by
  answer id and segment, and so is every answer it finishes until it serves again: the trainer plugin drops
  them before a step. The span (box, version, from its last passing probe to now) is listed in the status too;
- a loud log line and the ``quarantined`` counters.

It serves again only after a full reload (weight sync pushes a quarantined box again, at the current version if
no newer one is there; the registry notes the push, ``Instance.reloaded_in_quarantine``) and a passing probe
(:meth:`Quarantine.readmit`). A box whose disagreement the floor holds back keeps serving, but its unvouched
answers are distrusted all the same. Nothing is quarantined when every box
disagrees together (no probe majority, or the ledger's fleet-wide verdict): the fault is not theirs; nor when
it would leave fewer than ``quarantine_min_active`` active boxes; both are said loudly (log and status).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from rollout_manager.instances.mismatch import MismatchLedger
from rollout_manager.instances.probe import ProbeMonitor
from rollout_manager.instances.registry import Event, Instance, Kind, Registry, State
from rollout_manager.instances.trust import Trust

log = logging.getLogger("rollout_manager.trust")

KEEP_SPANS = 100  # distrusted spans kept for the status

# (instance, reason, cut back) -> sequences started moving off it
Evict = Callable[[Instance, str, bool], int]
# (instance, version), as a probe is sent -> what vouches for what it made so far there, once the probe passed
Mark = Callable[[Instance, int], Callable[[], int]]


class Delivered(Protocol):
    """The answers delivered unvouched, by box (``rollout.provisional.Provisional``)."""

    def distrust(self, instance: str, why: str, quarantined: bool = False) -> int: ...

    def trust_again(self, instance: str) -> None: ...

    def forget(self, instance: str) -> None: ...

    def status(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class QuarantineSettings:
    enabled: bool = True
    min_active: int = 1  # never leave fewer active boxes than this
    recheck_s: float = 5.0  # how often quarantined boxes are looked at for a reload to probe

    @classmethod
    def from_config(cls, cfg: Any) -> QuarantineSettings:
        return cls(cfg.quarantine, cfg.quarantine_min_active, cfg.quarantine_recheck_s)


@dataclass(frozen=True, slots=True)
class DistrustedSpan:
    """What a quarantined box made that is not vouched for: at ``version``, from ``since`` (its last passing
    probe there; None: none passed) to ``until`` (its quarantine), wall-clock times."""

    instance: str
    endpoint: str
    version: int
    since: float | None
    until: float
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"instance": self.instance, "endpoint": self.endpoint, "weight_version": self.version,
                "since": self.since, "until": self.until, "reason": self.reason}


class Quarantine:
    """Acts on the probe's and the ledger's verdicts (see the module's docstring)."""

    def __init__(self, registry: Registry, probes: ProbeMonitor, ledger: MismatchLedger, settings: QuarantineSettings,
                 evict: Evict, mark: Mark, delivered: Delivered | None = None, *,
                 wall: Callable[[], float] = time.time) -> None:
        self.registry = registry
        self.probes = probes
        self.ledger = ledger
        self.settings = settings
        self.evict = evict
        self.mark = mark
        self.delivered = delivered
        self._marks: dict[str, tuple[int, Callable[[], int]]] = {}  # instance -> its probe in flight's mark
        self.wall = wall
        self.at_version: dict[str, int] = {}  # quarantined instance -> the version it served then
        self.passed: dict[str, tuple[int, float]] = {}  # instance -> (version, wall time) of its last passing probe
        # Off the trainer's reference before any other box at its version was probed: judged again with them.
        self._waiting_for_peers: set[str] = set()
        self.spans: deque[DistrustedSpan] = deque(maxlen=KEEP_SPANS)
        self.counts = {"quarantined": 0, "lifted": 0, "held_by_floor": 0, "fleet_wide": 0}
        self.held_by_floor: str | None = None  # the last quarantine the floor kept back, in words
        self.fleet_wide: str | None = None  # the last time every box disagreed together, in words
        self._task: asyncio.Task[None] | None = None
        registry.listeners.append(self._on_event)
        probes.start_listeners.append(self.on_probe_sent)
        probes.verdict_listeners.append(self.on_probe)

    def _on_event(self, inst: Instance, event: Event) -> None:
        if event.new == State.DEAD:  # ids are never reused: what is kept of it goes (its spans stay listed)
            for kept in (self.at_version, self.passed, self._marks):
                kept.pop(inst.id, None)
            self._waiting_for_peers.discard(inst.id)
            if self.delivered is not None:
                self.delivered.forget(inst.id)

    # ------------------------------------------------------------ verdicts
    def on_probe_sent(self, inst: Instance, version: int) -> None:
        """A probe of ``inst`` goes out: a pass vouches for what it made up to now, not for what it makes while
        the probe runs."""
        self._marks[inst.id] = (version, self.mark(inst, version))

    def on_probe(self, probed: Instance, version: int, judged: list[tuple[Instance, Trust]]) -> None:
        """A probe of ``probed`` at ``version`` was judged (with every box there)."""
        verdicts = {inst.id: trust for inst, trust in judged}
        if Trust.CHECKED in verdicts.values() and self._waiting_for_peers:
            for inst, trust in judged:  # another box agrees with the trainer now: the held ones are theirs
                if inst.id in self._waiting_for_peers and inst is not probed:
                    self._waiting_for_peers.discard(inst.id)
                    if trust == Trust.DISAGREES and inst.quarantined is None:
                        self.quarantine(inst, f"its trust probe at weight version {version} is off the trainer's "
                                              "reference log-probs while another box's is not")
        mine = verdicts.get(probed.id)
        if mine == Trust.CHECKED:
            if probed.quarantined is not None:
                self._lift(probed, version)
            else:
                self.passed[probed.id] = (version, self.wall())
                if self.delivered is not None:  # found wrong earlier but kept serving by the floor: right again
                    self.delivered.trust_again(probed.id)
                marked = self._marks.pop(probed.id, None)
                if marked is not None and marked[0] == version:
                    marked[1]()
            return
        if mine != Trust.DISAGREES or probed.quarantined is not None:
            return
        if Trust.CHECKED not in verdicts.values():
            if len(judged) >= 2:
                self._fleet_wide(f"no majority among the {len(judged)} boxes' trust probes at weight version "
                                 f"{version}" + (" (judged by the trainer's reference log-probs)"
                                                 if self.probes.has_reference(version) else ""))
                return
            if self.probes.has_reference(version):  # off the trainer's reference, no other box probed there yet:
                self._waiting_for_peers.add(probed.id)  # it may be the trainer's fault; judged again with them
                return
        self.quarantine(probed, f"its trust probe at weight version {version} disagrees with the other boxes")

    def on_mismatch(self, live: list[str]) -> list[str]:
        """The ledger took a step's report: quarantine its outliers (none when the whole fleet disagrees).
        Returns the instances quarantined."""
        fleet = self.ledger.fleet(live)
        if fleet.fleet_wide:
            self._fleet_wide("every instance's log-prob mismatch with the trainer is above mismatch_floor")
            return []
        done = []
        for iid in live:
            figure = self.ledger.by_instance.get(iid)
            inst = self.registry.get(iid)
            if figure is None or inst is None or not self.ledger.is_outlier(figure, fleet):
                continue
            ratio = f"{figure.mean_abs_diff / fleet.median:.1f}x" if fleet.median else "far above"
            if self.quarantine(inst, f"its log-prob mismatch with the trainer is {ratio} the fleet's median"):
                done.append(iid)
        return done

    # ------------------------------------------------------------ acting
    def quarantine(self, inst: Instance, why: str) -> bool:
        """Take ``inst`` out of service and cut its running sequences back; False when it stays (off, not
        active, already out, or the floor)."""
        if not self.settings.enabled or inst.kind != Kind.REMOTE or inst.state != State.ACTIVE \
                or inst.quarantined is not None:
            if not self.settings.enabled and inst.state == State.ACTIVE:
                log.warning("instance %s %s would be quarantined (%s), but quarantine is off", inst.id,
                            inst.endpoint, why)
            return False
        left = len(self.registry.in_state(State.ACTIVE)) - 1
        if left < self.settings.min_active:
            self.held_by_floor = (f"{inst.id} {inst.endpoint} not quarantined ({why}): it would leave {left} active "
                                  f"instance(s), below quarantine_min_active={self.settings.min_active}; its tokens "
                                  f"are not trusted")
            self.counts["held_by_floor"] += 1
            log.error("QUARANTINE HELD BACK BY THE FLOOR: %s", self.held_by_floor)
            if self.delivered is not None:  # it keeps serving; what it delivers unvouched is not trusted
                self.delivered.distrust(inst.id, f"held back by the floor: {why}")
            return False
        version = inst.versions.serving(inst.weight_version)
        passed = self.passed.get(inst.id)
        since = passed[1] if passed is not None and passed[0] == version else None
        if not self.registry.quarantine(inst, why):
            return False
        self.at_version[inst.id] = version
        now = self.wall()
        self.spans.append(DistrustedSpan(inst.id, inst.endpoint, version, since, now, why))
        self.counts["quarantined"] += 1
        moved = self.evict(inst, f"quarantined: {why}", True)
        listed = 0 if self.delivered is None else self.delivered.distrust(inst.id, f"quarantined: {why}",
                                                                          quarantined=True)
        log.error("QUARANTINED instance %s %s at weight version %d: %s; %d running sequence(s) cut back to their "
                  "last trusted token and moved, %d delivered answer segment(s) listed as distrusted; it serves "
                  "again after a reload and a passing trust probe", inst.id, inst.endpoint, version, why, moved,
                  listed)
        return True

    def _lift(self, inst: Instance, version: int) -> None:
        if not _reloaded(inst, self.at_version.get(inst.id)):
            return  # the same weights it was quarantined with: no reload yet
        self.passed[inst.id] = (version, self.wall())
        if self.registry.lift_quarantine(inst, f"reloaded to weight version {version} and its trust probe passed"):
            self.at_version.pop(inst.id, None)
            if self.delivered is not None:
                self.delivered.trust_again(inst.id)
            self.counts["lifted"] += 1
            log.warning("instance %s %s serves again: reloaded to weight version %d and its trust probe passed",
                        inst.id, inst.endpoint, version)

    def _fleet_wide(self, what: str) -> None:
        self.fleet_wide = f"{what}: the fault is not one box's (dtype, weight sync, the trainer); nothing quarantined"
        self.counts["fleet_wide"] += 1
        log.error("EVERY BOX DISAGREES TOGETHER: %s", self.fleet_wide)

    # ------------------------------------------------------------ coming back
    def reloaded(self) -> list[Instance]:
        """Quarantined boxes held out of service after a full reload (at any version)."""
        return [i for i in self.registry.in_state(State.SYNCING) if i.quarantined is not None
                and i.versions.activating is None and _reloaded(i, self.at_version.get(i.id))]

    async def readmit(self) -> None:
        """Probe every reloaded quarantined box; a passing one serves again (:meth:`on_probe`)."""
        boxes = self.reloaded()
        if boxes:
            await asyncio.gather(*(self.probes.check(i, quarantined=True) for i in boxes))

    def start(self) -> None:
        if self._task is None and self.settings.recheck_s > 0:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="quarantine")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.recheck_s)
            await self.readmit()

    def status(self) -> dict[str, Any]:
        return {"enabled": self.settings.enabled, "min_active": self.settings.min_active, **self.counts,
                "quarantined_now": sorted(self.at_version), "held_by_floor": self.held_by_floor,
                "fleet_wide": self.fleet_wide, "distrusted_spans": [s.to_dict() for s in self.spans],
                "delivered": None if self.delivered is None else self.delivered.status()}


def _reloaded(inst: Instance, quarantined_at: int | None) -> bool:
    """A weight push completed on ``inst`` since its quarantine: at a newer version, or any push the registry
    noted (the reload at the same version)."""
    return inst.reloaded_in_quarantine or (quarantined_at is not None and inst.weight_version > quarantined_at)
