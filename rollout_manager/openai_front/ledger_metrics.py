"""The session ledger's figures in ``/metrics``: the same numbers as ``GET /v1/sessions``, for Prometheus.

A collector read at scrape time (on the event loop, like the rest of ``/metrics``), so nothing is counted
twice and the ledger keeps no metric objects of its own.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from rollout_manager.metrics import PREFIX
from rollout_manager.openai_front.ledger import Ledger


class LedgerCollector(Collector):
    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    def collect(self) -> Iterator[Metric]:
        status = self.ledger.status()  # sweeps idle sessions first, as GET /v1/sessions does
        name = PREFIX + "openai_"
        yield GaugeMetricFamily(name + "sessions", "Sessions the OpenAI front's ledger holds now.",
                                value=status["sessions"])
        yield GaugeMetricFamily(name + "session_tokens", "Tokens the ledger holds now, over every session and "
                                "branch.", value=status["tokens"])
        yield GaugeMetricFamily(name + "session_token_bytes", "Bytes of the ledger's token arrays now (ids, "
                                "mask, log-probs; the messages kept beside them are not counted).",
                                value=status["token_bytes"])
        yield CounterMetricFamily(name + "divergences", "Divergences found: rewritten histories (a new branch) "
                                  "and re-tokenizations that would have changed the ledger's ids.",
                                  value=status["divergences"])
        yield CounterMetricFamily(name + "sessions_expired", "Sessions freed after openai_session_idle_s idle.",
                                  value=status["expired"])
        yield CounterMetricFamily(name + "sessions_evicted", "Idle sessions freed to make room past "
                                  "openai_max_sessions.", value=status["evicted"])
        yield GaugeMetricFamily(name + "max_sessions", "openai_max_sessions.", value=status["max_sessions"])
        yield GaugeMetricFamily(name + "session_max_tokens", "openai_session_max_tokens.",
                                value=status["max_session_tokens"])
