"""The trust probe: after each activation, and periodically while serving, a short fixed prefill with per-token
log-probs sent to every serving box, compared across the boxes at one weight version (``trust.py`` judges).

It replaces reading tensors back through SGLang's ``/get_weights_by_name`` inside the activation pause (Llama
only, TP 1 only, and a whole parameter converted to Python floats while nothing generates): the probe works
for every model family and TP size, costs one short prefill per box, and never runs inside the pause. A box
activating a version, or syncing, is not probed; a probe whose box changed version (or started activating)
while it ran says nothing and is dropped. Until a box's first probe at the version it serves passes, what it
makes at that version is provisional (``Instance.trust``, shown in the instance status and ``/metrics``). A
box that disagrees is reported (its status, a warning, a metric); each verdict is told to ``verdict_listeners``,
where the quarantine (``quarantine.py``) acts on it. A quarantined box, held in ``syncing`` after its reload, is
probed too (on :meth:`ProbeMonitor.check` with ``quarantined=True``): its passing probe lets it serve again.
Where the trainer posted the probe prompt's log-probs computed with its own model at a version
(:meth:`ProbeMonitor.set_reference`, ``POST /update_probe_reference``), the boxes at that version are judged by
them (``trust.judge``).

Of each instance this module alone writes ``Instance.trust`` (replaced whole).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from rollout_manager.config import Config
from rollout_manager.instances.registry import Event, Instance, Registry, State
from rollout_manager.instances.served_ids import safe_id_limit
from rollout_manager.instances.trust import Probed, Trust, judge, tolerance
from rollout_manager.sglang.logprob_probe import ID_RUNGS, PROBE_RID_PREFIX, ProbeFailed, probe_ids, probe_limit

log = logging.getLogger("rollout_manager.trust")

# (base_url, prompt ids, rid, timeout_s) -> the prompt's log-probs; raises ProbeFailed
PrefillFn = Callable[[str, list[int], str, float], Awaitable[list[float]]]
# (the box about to be probed, the version it serves): told as each probe is sent
StartListener = Callable[[Instance, int], None]
# (the box just probed, the version, each judged box's verdict there): told after each probe that was judged
VerdictListener = Callable[[Instance, int, list[tuple[Instance, Trust]]], None]
KEEP_VERSIONS = 4  # probe results kept for this many recent versions
WAITING_RECHECK_S = 2.0  # how often a box whose probe waits for safe ids is looked at again
WAITING_FOR_IDS = (f"no token id is known to be safe on this box yet (SGLang dies on one past its vocabulary): the "
                   f"probe waits until it has served ids up to {ID_RUNGS[0]}, or register it with vocab_size and "
                   f"vocab_source 'model_config' (scripts/launch_sglang.sh reads the model's config.json)")


@dataclass(frozen=True)
class ProbeSettings:
    interval_s: float  # between periodic probes of every serving box (0: only after activations)
    timeout_s: float
    tolerance: float  # 0: by each box's dtype, quantization and TP size (trust.tolerance)

    @classmethod
    def from_config(cls, cfg: Config) -> ProbeSettings:
        return cls(cfg.trust_probe_interval_s, cfg.trust_probe_timeout_s, cfg.trust_probe_tolerance)


class ProbeMonitor:
    """Probes boxes and records their trust. :meth:`start` runs the loop that probes each box after it starts
    serving a version (:meth:`nudge`, and every move to ``active``) and every box each ``interval_s``."""

    def __init__(self, registry: Registry, prefill: PrefillFn, settings: ProbeSettings, *,
                 wall: Callable[[], float] = time.time) -> None:
        self.registry = registry
        self.prefill = prefill
        self.settings = settings
        self.wall = wall
        # version -> (vocabulary limit of the prompt) -> instance id -> its probe there
        self._results: dict[tuple[int, int], dict[str, Probed]] = {}
        # (version, the prompt's ids) -> the trainer's log-probs of it (each token after the first)
        self._references: dict[tuple[int, tuple[int, ...]], tuple[float, ...]] = {}
        self._due: set[str] = set()
        self._waiting: set[str] = set()  # boxes whose probe waits for ids known to be safe on them
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.start_listeners: list[StartListener] = []
        # Awaited after the start listeners, before the probe goes (None: nothing): with relays, each marks what
        # the box made so far first (instances.relay_hub.announce).
        self.before_send: Callable[[Instance, int], Awaitable[None]] | None = None
        self.verdict_listeners: list[VerdictListener] = []
        registry.listeners.append(self._on_event)

    # ------------------------------------------------------------ when to probe
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="trust-probe")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def nudge(self, inst: Instance) -> None:
        """``inst`` serves a new version (or serves again): probe it soon, out of any pause."""
        self._due.add(inst.id)
        self._wake.set()

    def _on_event(self, inst: Instance, event: Event) -> None:
        if event.new == State.ACTIVE:
            self.nudge(inst)
        elif event.new == State.DEAD:
            self._due.discard(inst.id)
            self._waiting.discard(inst.id)
            for results in self._results.values():
                results.pop(inst.id, None)

    async def _loop(self) -> None:
        interval = self.settings.interval_s
        next_round = time.monotonic() + interval
        while True:
            timeout = next_round - time.monotonic() if interval > 0 else None
            if self._waiting:  # boxes that had no safe ids: look again soon, without sending anything
                timeout = min(timeout, WAITING_RECHECK_S) if timeout is not None else WAITING_RECHECK_S
            try:
                await asyncio.wait_for(self._wake.wait(), max(timeout, 0.0) if timeout is not None else None)
            except asyncio.TimeoutError:
                pass
            if interval > 0 and time.monotonic() >= next_round:  # the periodic round: every serving box
                self._due.update(i.id for i in self.registry)
                next_round = time.monotonic() + interval
            self._due.update(self._waiting)
            self._wake.clear()
            due, self._due = self._due, set()
            boxes = [i for i in (self.registry.get(d) for d in due) if i is not None]
            if boxes:
                await self.check_all(boxes)

    # ------------------------------------------------------------ the trainer's reference
    def set_reference(self, version: int, ids: list[int], logprobs: list[float]) -> None:
        """The trainer's log-probs of the probe prompt ``ids`` (one per token after the first) at ``version``:
        later probes at that version are judged by them. Raises ValueError when they cannot be (a length
        that does not match)."""
        if len(logprobs) != len(ids) - 1:
            raise ValueError(f"{len(logprobs)} log-probs for a prompt of {len(ids)} tokens (one per token after "
                             "the first)")
        self._references[version, tuple(ids)] = tuple(float(v) for v in logprobs)
        for old in sorted(self._references)[:-KEEP_VERSIONS]:
            del self._references[old]

    def has_reference(self, version: int) -> bool:
        return any(v == version for v, _ in self._references)

    def references(self) -> list[dict[str, int]]:
        """The references held: version and prompt length each."""
        return [{"weight_version": v, "tokens": len(ids)} for v, ids in sorted(self._references)]

    # ------------------------------------------------------------ probing
    async def check_all(self, boxes: list[Instance] | None = None) -> None:
        """Probe ``boxes`` (None: every registered one) at once; those not serving now are skipped."""
        targets = list(self.registry) if boxes is None else boxes
        await asyncio.gather(*(self.check(inst) for inst in targets))

    async def check(self, inst: Instance, quarantined: bool = False) -> Trust | None:
        """Probe one box and judge its version's boxes again; its trust, or None when it was not probed (not
        serving, or its version moved while the probe ran). ``quarantined``: probe a quarantined box held
        out of service after its reload too."""
        def probed() -> bool:
            return _serving(inst) or (quarantined and _held(inst))

        if not probed():
            return None
        version = inst.versions.serving(inst.weight_version)
        engine = inst.engine
        limit = probe_limit(safe_id_limit(inst))
        if limit is None:  # no id is known to be safe on it: wait for it to serve some (served_ids)
            self._waiting.add(inst.id)
            if inst.trust.waiting is None:
                log.info("instance %s %s: trust probe waits: %s", inst.id, inst.endpoint, WAITING_FOR_IDS)
                inst.trust = dataclasses.replace(inst.trust, waiting=WAITING_FOR_IDS)
            return None
        self._waiting.discard(inst.id)
        if inst.trust.waiting is not None:
            inst.trust = dataclasses.replace(inst.trust, waiting=None)
        ids = probe_ids(limit)
        for started in list(self.start_listeners):
            started(inst, version)
        if self.before_send is not None:
            await self.before_send(inst, version)
        try:
            values = await self.prefill(inst.url, ids, PROBE_RID_PREFIX + uuid.uuid4().hex,
                                        self.settings.timeout_s)
        except ProbeFailed as exc:
            if self.registry.get(inst.id) is inst:
                inst.trust = dataclasses.replace(inst.trust, last_probe_error=str(exc))
                log.info("instance %s %s: trust probe got no usable answer: %s", inst.id, inst.endpoint, exc)
            return None
        if not probed() or inst.versions.serving(inst.weight_version) != version:
            return None  # loading, gone, or another version since: this answer says nothing about either
        tol = self.settings.tolerance or tolerance(engine.dtype, engine.quantization, engine.tp_size)
        key = (version, max(ids) + 1)
        group = self._results.setdefault(key, {})
        before = group.get(inst.id)
        group[inst.id] = Probed(tuple(values), tol, before.baseline if before is not None else None)
        inst.trust = dataclasses.replace(inst.trust, probes=inst.trust.probes + 1, last_probe_error=None,
                                         checked_at=self.wall())
        judged = self._judge(version, group, self._references.get((version, tuple(ids))))
        for old in sorted(self._results)[:-KEEP_VERSIONS]:
            del self._results[old]
        for listener in list(self.verdict_listeners):
            listener(inst, version, judged)
        return inst.trust.state(version)

    def _judge(self, version: int, group: dict[str, Probed],
               reference: tuple[float, ...] | None) -> list[tuple[Instance, Trust]]:
        judged: list[tuple[Instance, Trust]] = []
        for box, verdict in judge(group, reference, calibrate=not self.settings.tolerance).items():
            inst = self.registry.get(box)
            if inst is None:
                continue
            probed = group[box]
            if verdict.trust == Trust.CHECKED and probed.baseline is None:
                group[box] = dataclasses.replace(probed, baseline=probed.values)
            record = inst.trust
            newly = verdict.trust == Trust.DISAGREES and record.state(version) != Trust.DISAGREES
            if newly:
                log.warning("instance %s %s serving weight version %d disagrees with the trust probe: %s", inst.id,
                            inst.endpoint, version, verdict.detail)
            elif verdict.trust == Trust.CHECKED and record.state(version) == Trust.DISAGREES:
                log.info("instance %s %s agrees again at weight version %d: %s", inst.id, inst.endpoint, version,
                         verdict.detail)
            inst.trust = dataclasses.replace(record, version=version, verdict=verdict.trust, diff=verdict.diff,
                                             detail=verdict.detail,
                                             disagreements=record.disagreements + (1 if newly else 0))
            judged.append((inst, verdict.trust))
        return judged


def _serving(inst: Instance) -> bool:
    """Serving a version and not loading one: a probe now runs out of any pause."""
    return inst.state == State.ACTIVE and inst.versions.activating is None


def _held(inst: Instance) -> bool:
    """Quarantined, held in ``syncing`` and not loading: probed so that it may serve again."""
    return inst.quarantined is not None and inst.state == State.SYNCING and inst.versions.activating is None
