"""Prometheus metrics for ``GET /metrics``.

Two kinds of figures:

* Gauges (and the generator's running counters) are read from the manager's state at scrape time by
  :class:`StateCollector`, so nothing has to be kept in sync with the registry, the dispatcher or the
  generator.
* Distributions (sequence latency, weight-push seconds) need every event, so they listen to the
  generator's finished sequences, weight sync's pushes and the registry's transitions.

Every manager gets its own :class:`CollectorRegistry` (tests run several managers in one process,
and the global registry would mix them).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from rollout_manager.instances.mismatch import MismatchLedger
from rollout_manager.instances.quarantine import Quarantine
from rollout_manager.instances.registry import Event, Instance, Kind, Registry, State
from rollout_manager.instances.relay_hub import RelayHub
from rollout_manager.instances.version import WeightVersion
from rollout_manager.placement.dispatch import Dispatcher
from rollout_manager.placement.fleet_signal import FleetSignal
from rollout_manager.placement.lengths import LengthModel
from rollout_manager.placement.local_budget import LocalBudget
from rollout_manager.rollout.counters import GENERATION_COUNTERS
from rollout_manager.rollout.evacuation import SOURCES, Evacuator
from rollout_manager.rollout.generation import Generator
from rollout_manager.sglang.local_limits import LocalLimits
from rollout_manager.weights.push_record import WeightPush
from rollout_manager.weights.sync import WeightSync

PREFIX = "rollout_manager_"
# The classic text format, which every Prometheus and scraper reads.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1200, float("inf"))
TOKEN_BUCKETS = (16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, float("inf"))
PUSH_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, float("inf"))

class EventHistogram:
    """A histogram fed on the event loop, one observation per sequence: a bisect and two additions (no
    lock: only the loop writes it, and a scrape reads it there too)."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.bounds = [b for b in buckets if b != float("inf")]
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # buckets hold values <= their bound
        self.sum += value

    def add_to(self, family: HistogramMetricFamily, labels: list[str]) -> None:
        cumulative = list(itertools.accumulate(self.counts))
        les = [*map(floatToGoString, self.bounds), "+Inf"]
        family.add_metric(labels, list(zip(les, cumulative)), sum_value=self.sum)


class EventHistograms(Collector):
    """The per-sequence distributions (:class:`EventHistogram`), in Prometheus' histogram format."""

    def __init__(self, metrics: ManagerMetrics):
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        latency = HistogramMetricFamily(
            PREFIX + "sequence_latency_seconds",
            "End-to-end seconds per sequence, across every instance it ran on; outcome ok or error.",
            labels=["outcome"])
        for ok, hist in self.metrics.latency.items():
            hist.add_to(latency, ["ok" if ok else "error"])
        yield latency
        tokens = HistogramMetricFamily(PREFIX + "sequence_completion_tokens",
                                       "Completion tokens per finished sequence.")
        self.metrics.completion_tokens.add_to(tokens, [])
        yield tokens


class EvacuationCollector(Collector):
    """Evacuations of boxes with a preemption notice (``rollout.evacuation``), and what failures without one cost."""

    def __init__(self, metrics: ManagerMetrics):
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        evacuator = self.metrics.evacuations
        if evacuator is None:
            return
        started = CounterMetricFamily(PREFIX + "evacuations", "Boxes evacuated after a preemption notice, by the "
                                      "notice's source.", labels=["source"])
        for source in SOURCES:
            started.add_metric([source], evacuator.by_source.get(source, 0))
        yield started
        yield CounterMetricFamily(PREFIX + "evacuation_sequences_moved", "Sequences moved off evacuating boxes "
                                  "(cut at their last streamed token, continued on another box).",
                                  value=evacuator.sequences_moved)
        yield CounterMetricFamily(PREFIX + "evacuation_tokens_saved", "Tokens evacuating boxes made after their "
                                  "notice that were kept (sequences that finished there, and the moved ones up to "
                                  "their cut).", value=evacuator.tokens_saved)
        yield CounterMetricFamily(PREFIX + "preemption_tokens_lost", "Tokens made again after a box failed without "
                                  "notice (estimated: half an engine_stream_interval per sequence it cut; the "
                                  "manager never saw them).", value=evacuator.preemption_tokens_lost)
        yield GaugeMetricFamily(PREFIX + "instances_evacuating", "Boxes evacuating now.", value=len(evacuator.active))


class MismatchCollector(Collector):
    """Each instance's trust figure (``instances.mismatch``): the trainer's log-prob gap on its tokens."""

    def __init__(self, metrics: ManagerMetrics):
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        ledger, instances = self.metrics.mismatch, list(self.metrics.registry)
        fleet = ledger.fleet(i.id for i in instances)
        gap = GaugeMetricFamily(PREFIX + "instance_mismatch_abs_logprob",
                                "Exponentially weighted mean |trainer - rollout| log-prob gap per token the "
                                "instance made, as the trainer reports it each step (absent: not reported).",
                                labels=["endpoint"])
        k3 = GaugeMetricFamily(PREFIX + "instance_mismatch_k3_kl",
                               "Exponentially weighted k3 estimate of KL(rollout || trainer) over its tokens.",
                               labels=["endpoint"])
        ratio = GaugeMetricFamily(PREFIX + "instance_mismatch_ratio_to_median",
                                  "The instance's weighted gap over the fleet's median.", labels=["endpoint"])
        outlier = GaugeMetricFamily(PREFIX + "instance_mismatch_outlier",
                                    "1 while the instance's gap is above mismatch_outlier_multiple x the fleet's "
                                    "median (and above mismatch_floor): quarantined when quarantine is on.",
                                    labels=["endpoint"])
        step = GaugeMetricFamily(PREFIX + "instance_mismatch_last_step",
                                 "The trainer step the instance's gap was last reported for.", labels=["endpoint"])
        for inst in instances:
            figure = ledger.of(inst.id, fleet)
            if figure is None:
                continue
            ep = [inst.endpoint]
            gap.add_metric(ep, figure["mean_abs_diff"])
            k3.add_metric(ep, figure["k3_kl"])
            if figure["ratio_to_median"] is not None:
                ratio.add_metric(ep, figure["ratio_to_median"])
            outlier.add_metric(ep, 1 if figure["above_median_multiple"] else 0)
            step.add_metric(ep, figure["last_step"])
        yield from (gap, k3, ratio, outlier, step)
        median = GaugeMetricFamily(PREFIX + "mismatch_fleet_median",
                                   "Median of the instances' weighted log-prob gaps (absent: none reported).")
        if fleet.median is not None:
            median.add_metric([], fleet.median)
        yield median
        yield GaugeMetricFamily(PREFIX + "mismatch_fleet_wide",
                                "1 while every instance that reported is above mismatch_floor: the trainer "
                                "and the whole fleet disagree, not one box.", value=1 if fleet.fleet_wide else 0)
        quarantine = self.metrics.quarantine
        if quarantine is not None:
            events = CounterMetricFamily(PREFIX + "quarantine_events",
                                         "Quarantine decisions: quarantined, lifted (reloaded and probed), "
                                         "held_by_floor (kept serving by quarantine_min_active), fleet_wide "
                                         "(every box disagreed together: nothing quarantined).", labels=["event"])
            for name, n in quarantine.counts.items():
                events.add_metric([name], n)
            yield events
            yield GaugeMetricFamily(PREFIX + "quarantined_instances", "Instances out of service as untrusted now.",
                                    value=len(quarantine.at_version))


class FleetDemandCollector(Collector):
    """The scaling signal (``placement.fleet_signal``): the boxes of each kind the rest of the step wants, what an
    autoscaler (KEDA's Prometheus scaler, a loop calling Ray's request_resources) scales on."""

    def __init__(self, metrics: ManagerMetrics):
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        signal = self.metrics.fleet_signal
        if signal is None:
            return
        demand = signal.demand()
        labels = ["kind", "preemptible"]
        wanted = GaugeMetricFamily(PREFIX + "fleet_boxes_wanted",
                                   "Boxes of the kind the rest of the step needs to end within scale_target_step_s "
                                   "(those running work and those to be given some; 0 once nothing waits or runs).",
                                   labels=labels)
        more = GaugeMetricFamily(PREFIX + "fleet_boxes_more",
                                 "Boxes of the kind wanted beyond those registered now (fleet_boxes_wanted - "
                                 "fleet_boxes).", labels=labels)
        there = GaugeMetricFamily(PREFIX + "fleet_boxes", "Boxes of the kind registered now (pending, syncing or "
                                  "active).", labels=labels)
        for k in demand.kinds:
            lab = [k.kind, "true" if k.preemptible else "false"]
            wanted.add_metric(lab, k.wanted)
            more.add_metric(lab, k.more)
            there.add_metric(lab, k.boxes)
        yield from (wanted, more, there)
        yield GaugeMetricFamily(PREFIX + "fleet_predicted_end_seconds",
                                "Seconds from now the step is predicted to end with the boxes wanted (0 while no "
                                "box's speed is measured).", value=demand.predicted_end_s)
        yield GaugeMetricFamily(PREFIX + "fleet_target_seconds", "scale_target_step_s.", value=demand.target_s)
        work = GaugeMetricFamily(PREFIX + "fleet_predicted_tokens",
                                 "Tokens the rest of the step is predicted to make: running sequences' and waiting "
                                 "ones'.", labels=["where"])
        work.add_metric(["running"], demand.running_tokens)
        work.add_metric(["waiting"], demand.waiting_tokens)
        yield work


class RelayCollector(Collector):
    """A manager with relays (docs/relays.md), seen from its control process: each relay's figures as it last
    reported them, and the tokens the control process holds for the relays' running sequences."""

    def __init__(self, metrics: ManagerMetrics):
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        hub = self.metrics.relay_hub
        if hub is None:
            return
        figures = {
            "in_flight": ("relay_sequences_in_flight", "Sequences the relay runs on instances."),
            "waiting": ("relay_requests_waiting", "Requests the relay holds for room."),
            "finished": ("relay_sequences_finished", "Sequences the relay finished since it started."),
            "streamed_tokens": ("relay_streamed_tokens", "Tokens the relay streamed since it started."),
            "cpu_s": ("relay_cpu_seconds", "The relay process's CPU time since it started."),
            "restarts": ("relay_restarts", "Times the relay was started again."),
            "connected": ("relay_connected", "1 while the relay follows this control process."),
            "saving": ("relay_sequences_saving", "Running sequences of the relay with tokens saved here."),
        }
        families = {key: GaugeMetricFamily(PREFIX + name, help_, labels=["relay"])
                    for key, (name, help_) in figures.items()}
        for relay in hub.status():
            for key, family in families.items():
                family.add_metric([str(relay["relay"])], float(relay[key]))
        yield from families.values()
        saved = hub.saved.status()
        yield GaugeMetricFamily(PREFIX + "relay_saved_tokens", "Tokens of the relays' running sequences the control "
                                "process holds (relay_checkpoint_tokens).", value=saved["tokens"])


class StateCollector(Collector):
    """Reads the manager at scrape time: instances, versions, load, local budget, generation counters."""

    def __init__(self, metrics: ManagerMetrics):
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        instances = list(self.metrics.registry)
        yield self._by_state(instances)
        yield from self._per_instance(instances, self.metrics.registry.clock())
        yield from self._manager_gauges()
        yield from self._generation()
        yield self._push_rates()

    @staticmethod
    def _by_state(instances: list[Instance]) -> GaugeMetricFamily:
        by_state = GaugeMetricFamily(PREFIX + "instances", "Registered instances by lifecycle state and kind.",
                                     labels=["state", "kind"])
        counts: dict[tuple[State, Kind], int] = {(s, k): 0 for s in State if s != State.DEAD for k in Kind}
        for inst in instances:
            counts[(inst.state, inst.kind)] += 1
        for (state, kind), n in counts.items():
            by_state.add_metric([state.value, kind.value], n)
        return by_state

    def _per_instance(self, instances: list[Instance], now: float) -> Iterator[Metric]:
        """One sample per instance of each family: identity, load, speed, versions, trust, health."""
        m = self.metrics
        info = GaugeMetricFamily(PREFIX + "instance_info", "One per instance (value 1): its id, kind, state "
                                 "and weight-transfer group.", labels=["endpoint", "id", "kind", "state", "sender",
                                                                       "group"])
        in_flight = GaugeMetricFamily(PREFIX + "instance_in_flight_requests",
                                      "Sequences the manager has in flight on the instance.", labels=["endpoint"])
        in_flight_tokens = GaugeMetricFamily(PREFIX + "instance_in_flight_tokens",
                                             "Token budget still reserved on the instance by its in-flight sequences.",
                                             labels=["endpoint"])
        version = GaugeMetricFamily(PREFIX + "instance_weight_version", "Weight version the instance serves.",
                                    labels=["endpoint"])
        lag = GaugeMetricFamily(PREFIX + "instance_weight_version_lag",
                                "Manager weight version minus the instance's weight version.", labels=["endpoint"])
        rate = GaugeMetricFamily(PREFIX + "instance_token_rate",
                                 "Tokens/s the instance delivers while busy, measured from its streams "
                                 "(absent until measured).", labels=["endpoint"])
        bound = GaugeMetricFamily(PREFIX + "instance_max_in_flight",
                                  "Most sequences the manager keeps in flight on the instance (its own "
                                  "max_running_requests, or max_in_flight_per_instance).", labels=["endpoint"])
        staged = GaugeMetricFamily(PREFIX + "instance_weight_version_staged",
                                   "Weight version held verified beside the served one, waiting for activation "
                                   "(absent: none).", labels=["endpoint"])
        activating = GaugeMetricFamily(PREFIX + "instance_weight_version_activating",
                                       "Weight version being loaded while generation is paused (absent: none).",
                                       labels=["endpoint"])
        paused = GaugeMetricFamily(PREFIX + "instance_weight_paused_seconds",
                                   "Seconds the instance generated nothing for each recent version's update (staged: "
                                   "the activation pause; drain: the whole time out of service).",
                                   labels=["endpoint", "version"])
        trust = GaugeMetricFamily(PREFIX + "instance_trust", "1 for the instance's trust state at the version it "
                                  "serves (checked, provisional: not yet checked there, disagrees: its trust probe "
                                  "disagrees with the other boxes at that version).", labels=["endpoint", "state"])
        disagreements = CounterMetricFamily(PREFIX + "instance_trust_disagreements",
                                            "Times the instance's trust probe was found to disagree.",
                                            labels=["endpoint"])
        failures = GaugeMetricFamily(PREFIX + "instance_consecutive_failures",
                                     "Consecutive failed health checks or requests of the instance.",
                                     labels=["endpoint"])
        step = GaugeMetricFamily(PREFIX + "instance_decode_step_seconds",
                                 "The instance's decode step time learned from its streams: base (part=base) plus "
                                 "per_sequence times the sequences running (absent until it is measured).",
                                 labels=["endpoint", "part"])
        models, _ = m.dispatcher.fleet.speeds.models()
        for inst in instances:
            ep = [inst.endpoint]
            own = models.get(inst.id)
            if own is not None:
                step.add_metric([inst.endpoint, "base"], own.a)
                step.add_metric([inst.endpoint, "per_sequence"], own.b)
            info.add_metric([inst.endpoint, inst.id, inst.kind.value, inst.state.value, _label(inst.sender),
                             _label(inst.group)], 1)
            in_flight.add_metric(ep, inst.load.in_flight)
            in_flight_tokens.add_metric(ep, inst.load.in_flight_tokens)
            version.add_metric(ep, inst.weight_version)
            lag.add_metric(ep, m.version.current - inst.weight_version)
            failures.add_metric(ep, inst.health.consecutive_failures)
            trust.add_metric([inst.endpoint, inst.trust.state(inst.versions.serving(inst.weight_version)).value], 1)
            disagreements.add_metric(ep, inst.trust.disagreements)
            bv = inst.versions
            if bv.staged is not None:
                staged.add_metric(ep, bv.staged)
            if bv.activating is not None:
                activating.add_metric(ep, bv.activating)
            for v, seconds in bv.paused_s.items():
                paused.add_metric([inst.endpoint, str(v)], seconds)
            bound.add_metric(ep, m.dispatcher.capacity.bound_of(inst))
            meter = m.dispatcher.fleet.meters.get(inst.id)
            measured = meter.rate(now) if meter is not None else None
            if measured is not None:
                rate.add_metric(ep, measured)
        yield from (info, in_flight, in_flight_tokens, version, lag, rate, failures, bound, staged, activating, paused,
                    trust, disagreements, step)

    def _manager_gauges(self) -> Iterator[Metric]:
        """The manager's own state: its version, the local window, what waits and what runs, its loop and limits."""
        m = self.metrics
        yield GaugeMetricFamily(PREFIX + "weight_version", "The manager's current weight version.",
                                value=m.version.current)
        yield GaugeMetricFamily(PREFIX + "local_budget_seconds",
                                "Seconds local (trainer-side) instances generate per step before the trainer "
                                "takes its GPUs back.", value=m.budget.budget_s)
        yield GaugeMetricFamily(PREFIX + "local_window_open", "1 while the local window is open.",
                                value=1 if m.dispatcher.local.is_open else 0)
        yield GaugeMetricFamily(PREFIX + "start_time_seconds", "Unix time the manager started.",
                                value=m.started_at)
        yield GaugeMetricFamily(PREFIX + "requests_waiting_for_connection",
                                "Requests waiting because the manager itself cannot open a connection now "
                                "(its open-file or memory limits); no instance is blamed for them.",
                                value=m.limits.waiting)
        yield GaugeMetricFamily(PREFIX + "requests_waiting_for_instance",
                                "Requests waiting inside the manager because no instance can take them now "
                                "(none active, or all full).", value=m.dispatcher.capacity.waiting)
        yield GaugeMetricFamily(PREFIX + "requests_held_by_batches",
                                "Requests of /batch_generate_requests batches not started yet: beyond what the "
                                "pool can run now, or behind a caller that does not read its results.",
                                value=m.dispatcher.capacity.held_by_batches)
        yield GaugeMetricFamily(PREFIX + "requests_waiting",
                                "Requests accepted and waiting in the manager for room on an instance "
                                "(requests_waiting_for_instance + requests_held_by_batches).",
                                value=m.dispatcher.capacity.requests_waiting())
        yield GaugeMetricFamily(PREFIX + "in_flight_requests", "Sequences in flight on instances, over all of them.",
                                value=m.dispatcher.capacity.in_flight)
        yield GaugeMetricFamily(PREFIX + "max_in_flight_requests",
                                "Most sequences in flight at once over all instances (max_in_flight_total).",
                                value=m.dispatcher.capacity.max_in_flight_total)
        yield CounterMetricFamily(PREFIX + "streamed_tokens",
                                  "Tokens relayed from instances as they stream, finished or not; a live "
                                  "tokens/s is rate() of this.", value=m.dispatcher.fleet.streamed_tokens)
        yield CounterMetricFamily(PREFIX + "event_loop_blocked_seconds",
                                  "Seconds the manager's event loop was blocked by its own work (a 250 ms "
                                  "timer's lateness, from 50 ms): nothing else ran, and timeouts in that time "
                                  "blame no instance.",
                                  value=m.limits.loop.total_s)
        yield GaugeMetricFamily(PREFIX + "event_loop_longest_block_seconds",
                                "The longest such block since the manager started.", value=m.limits.loop.longest_s)
        yield CounterMetricFamily(PREFIX + "local_limit_events",
                                  "Connection attempts that hit the manager's own limits (EMFILE, ENFILE, "
                                  "ENOBUFS, ENOMEM).", value=m.limits.events)

    def _generation(self) -> Iterator[Metric]:
        """The generator's counters: engine calls, outcomes, affinity fallbacks, the length model."""
        m = self.metrics
        joined = m.generator.coalescer.stats
        yield CounterMetricFamily(PREFIX + "engine_once_calls",
                                  "Non-streaming /generate calls made to instances (short sequences; several "
                                  "that start together on one instance share a call, engine_batch_max).",
                                  value=joined.engine_calls)
        yield CounterMetricFamily(PREFIX + "engine_once_sequences",
                                  "Sequences those calls carried; divided by engine_once_calls, the mean batch.",
                                  value=joined.sequences)
        for key, (name, help_text) in GENERATION_COUNTERS.items():
            yield CounterMetricFamily(PREFIX + name, help_text, value=m.generator.stats[key])
        reasons = CounterMetricFamily(PREFIX + "affinity_fallbacks_by_reason",
                                      "Affinity fallbacks by why the remembered instance was not used.",
                                      labels=["reason"])
        for reason, n in m.generator.affinity_fallbacks.items():
            reasons.add_metric([reason], n)
        yield reasons
        if m.generator.lengths is not None:
            yield from length_families(m.generator.lengths)

    def _push_rates(self) -> GaugeMetricFamily:
        """Each sender group's last push, in GB/s."""
        m = self.metrics
        gbps = GaugeMetricFamily(PREFIX + "weight_push_last_gbps",
                                 "Transfer GB/s of the last weight push through each sender group.",
                                 labels=["sender", "group"])
        for (sender, group), value in sorted(m.last_gbps.items()):
            gbps.add_metric([sender, group], value)
        return gbps


def length_families(model: LengthModel) -> Iterator[Metric]:
    """The length model (``placement.lengths``): what it holds, and its predictions' error when their
    sequences ended, by the fraction of the group finished when predicted (MAE: ``..._abs_error_*`` over
    ``..._scored``)."""
    yield GaugeMetricFamily(PREFIX + "length_groups", "Groups whose output lengths the manager estimates.",
                            value=len(model.groups))
    yield GaugeMetricFamily(PREFIX + "length_history_prompts",
                            "Prompts whose lengths of earlier epochs are remembered (bounded).",
                            value=len(model.history))
    labels = ["finished_fraction"]
    scored = CounterMetricFamily(PREFIX + "length_predictions_scored",
                                 "Length predictions scored at their sequence's end, by the percentage of the "
                                 "group finished when predicted.", labels=labels)
    tokens = CounterMetricFamily(PREFIX + "length_prediction_abs_error_tokens",
                                 "Sum of |predicted - actual| output tokens over the scored predictions.",
                                 labels=labels)
    logs = CounterMetricFamily(PREFIX + "length_prediction_abs_error_log",
                               "Sum of |log predicted - log actual| over the scored predictions.", labels=labels)
    for where, err in model.errors.items():
        scored.add_metric([where], err.n)
        tokens.add_metric([where], err.abs_tokens)
        logs.add_metric([where], err.abs_log)
    yield from (scored, tokens, logs)


class ManagerMetrics:
    """The metrics of one manager: its own Prometheus registry, the state collector and the listeners."""

    def __init__(self, registry: Registry, version: WeightVersion, dispatcher: Dispatcher, generator: Generator,
                 weights: WeightSync, budget: LocalBudget, limits: LocalLimits, started_at: float,
                 mismatch: MismatchLedger | None = None, quarantine: Quarantine | None = None) -> None:
        self.registry, self.version, self.dispatcher, self.limits = registry, version, dispatcher, limits
        self.quarantine = quarantine
        self.mismatch = mismatch or MismatchLedger()
        self.generator, self.budget, self.started_at = generator, budget, started_at
        self.prometheus = CollectorRegistry(auto_describe=False)
        self.evacuations: Evacuator | None = None  # the manager sets it (read at scrape)
        self.prometheus.register(EvacuationCollector(self))
        self.last_gbps: dict[tuple[str, str], float] = {}
        # Per sequence, so not prometheus_client's Histogram (a lock and a loop over the buckets per
        # observation: 2-3% of the manager's CPU on short requests); exported by EventHistograms.
        self.latency = {ok: EventHistogram(LATENCY_BUCKETS) for ok in (True, False)}
        self.completion_tokens = EventHistogram(TOKEN_BUCKETS)
        self.push_seconds = Histogram(
            PREFIX + "weight_push_seconds",
            "Seconds per weight push to one instance (prepare, transfer, verify and load), per sender group.",
            ["sender", "group"], buckets=PUSH_BUCKETS, registry=self.prometheus)
        self.push_bytes = Counter(
            PREFIX + "weight_push_bytes", "Bytes pushed to instances, per sender group.",
            ["sender", "group"], registry=self.prometheus)
        self.peer_bootstraps = Counter(
            PREFIX + "weight_peer_bootstraps",
            "Versions a joining or lagging instance got: ok from a peer (not counted in weight_push_*, "
            "which are the senders' pushes), fallback from its sender after the peer failed.",
            ["outcome"], registry=self.prometheus)
        self.transitions = Counter(
            PREFIX + "instance_transitions", "Instance lifecycle transitions, by the state entered.",
            ["to"], registry=self.prometheus)
        self.rejections = Counter(
            PREFIX + "rejected_requests",
            "Requests answered with a 4xx (the caller's mistake), by endpoint and reason.",
            ["endpoint", "reason"], registry=self.prometheus)
        self.slow_readers = Counter(
            PREFIX + "slow_reader_disconnects",
            "Callers' connections closed because they read nothing of a streamed answer for "
            "response_write_timeout_s (their unfinished requests were aborted), by endpoint.",
            ["endpoint"], registry=self.prometheus)
        for state in State:
            self.transitions.labels(state.value)
        for outcome in ("ok", "fallback"):
            self.peer_bootstraps.labels(outcome)
        self.prometheus.register(StateCollector(self))
        self.prometheus.register(EventHistograms(self))
        self.prometheus.register(MismatchCollector(self))
        self.fleet_signal: FleetSignal | None = None  # the manager sets it (its own part, read at scrape)
        self.prometheus.register(FleetDemandCollector(self))
        self.relay_hub: RelayHub | None = None  # a control process's, set by the manager (read at scrape)
        self.prometheus.register(RelayCollector(self))
        registry.listeners.append(self._on_event)
        weights.push_listeners.append(self._on_push)
        generator.finished_listeners.append(self._on_finished)

    # ------------------------------------------------------------ hooks
    def _on_finished(self, latency_s: float, tokens: int, ok: bool) -> None:
        self.latency[ok].observe(latency_s)
        if ok:
            self.completion_tokens.observe(tokens)

    def _on_push(self, result: WeightPush) -> None:
        if result.from_peer:
            self.peer_bootstraps.labels("ok").inc()
            return
        if result.peer_failed:
            self.peer_bootstraps.labels("fallback").inc()
        key = (str(result.sender), str(result.group))
        self.push_seconds.labels(*key).observe(result.total_s)
        self.push_bytes.labels(*key).inc(result.bytes)
        self.last_gbps[key] = result.gbps

    def _on_event(self, inst: Instance, event: Event) -> None:
        self.transitions.labels(event.new.value).inc()

    def rejected(self, endpoint: str, reason: str) -> None:
        """A request to ``endpoint`` was answered 4xx for ``reason`` (both from fixed sets)."""
        self.rejections.labels(endpoint, reason).inc()

    def slow_reader(self, endpoint: str) -> None:
        """A caller of ``endpoint`` (a route path) stopped reading its streamed answer and was disconnected."""
        self.slow_readers.labels(endpoint).inc()

    # ------------------------------------------------------------ exposition
    def render(self) -> bytes:
        """The text exposition (serve it with :data:`CONTENT_TYPE`)."""
        return bytes(generate_latest(self.prometheus))


def _label(value: Any) -> str:
    return "" if value is None else str(value)


__all__ = ["CONTENT_TYPE", "PREFIX", "ManagerMetrics", "StateCollector"]
