"""Callers' connections and the fast lane in ``/metrics``: what the guard and the lane only logged.

Read at scrape time from the guard's counts and the lane's counters; registered by ``server.py`` on
the manager's Prometheus registry (``metrics.py`` knows nothing of the HTTP layer).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from rollout_manager.api.connections import ConnectionGuard
from rollout_manager.api.fast_lane import LaneStats
from rollout_manager.metrics import PREFIX

CLOSED = ("idle_closed", "slow_headers_closed", "evicted", "refused")


class ConnectionMetrics(Collector):
    def __init__(self, guard: ConnectionGuard, lane: LaneStats | None) -> None:
        self.guard, self.lane = guard, lane

    def collect(self) -> Iterator[Metric]:
        stats = self.guard.stats()
        open_ = GaugeMetricFamily(PREFIX + "client_connections",
                                  "Callers' open connections by phase: idle (between requests), partial "
                                  "(sending headers), busy (a request runs).", labels=["phase"])
        waiting = stats["idle"] + stats["partial"]
        for phase, n in (("idle", stats["idle"]), ("partial", stats["partial"]),
                         ("busy", max(stats["open"] - waiting, 0))):
            open_.add_metric([phase], n)
        yield open_
        yield GaugeMetricFamily(PREFIX + "client_connections_max",
                                "The cap on callers' open connections (max_client_connections).",
                                value=stats["max_total"])
        closed = CounterMetricFamily(PREFIX + "client_connections_closed",
                                     "Callers' connections the manager closed or refused: idle past the "
                                     "keep-alive, headers too slow, closed to make room at the cap, refused "
                                     "(503) with every connection busy.", labels=["reason"])
        for reason in CLOSED:
            closed.add_metric([reason], stats[reason])
        yield closed
        if self.lane is not None:
            yield CounterMetricFamily(PREFIX + "fast_lane_requests",
                                      "Non-streaming POST /generate requests answered on the fast lane.",
                                      value=self.lane.answered)
            yield CounterMetricFamily(PREFIX + "fast_lane_handovers",
                                      "Connections the fast lane handed to aiohttp (another route, a "
                                      "refusal, a streaming request or a head it does not take).",
                                      value=self.lane.handed_over)
