"""Prometheus metrics of a learner, on a registry of its own (served when ``metrics_port`` is set).

The values are plain numbers the learner updates as it goes, and the registry reads them when it
is scraped (``_Series.collect``). ``prometheus_client``'s own ``Counter.inc`` takes a lock and
checks its labels on every call: at a step boundary right after an inner step, its seven updates a
step and the event observers' took about 30 us of the training thread's time (0.24M parameters),
where adding to a number takes under one. The step's values have one writer, the training thread.
The contributions by outcome are counted under a lock of their own: in thread mode their events
come from the training thread (a send, a contribution replaced before it went), and from every
shard's communication thread (results, drops after a reconnect).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ddiloco.core import build_labels
from ddiloco.core import events as schema


class LearnerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.labels = build_labels("learner")
        self.steps = 0
        """Inner steps."""
        self.tokens = 0
        """Tokens trained on."""
        self.tokens_per_s = 0.0
        self.loss: float | None = None
        """The last training loss (None: none reported yet, no series)."""
        self.blocked_s = 0.0
        """Seconds blocked waiting for merges."""
        self.applies = 0
        self.contributions: dict[str, int] = {}
        """Outcome (``sent``, a result's outcome, ``dropped``) -> contributions (under ``_lock``)."""
        self._lock = threading.Lock()
        self.bytes_sent = 0
        self.bytes_received = 0
        self.streams_up: set[str] = set()
        """The synchronizer shards whose Sync stream is up."""
        self.registry.register(_Series(self))

    def observe(self, event: str, fields: dict) -> None:
        """An event-log observer: the counters that follow from the learner's events."""
        if event == schema.RESULT:
            self._count(fields.get("outcome", ""))
        elif event == schema.DROPPED:
            self._count("dropped")
        elif event == schema.SEND:
            self._count("sent")
        elif event == schema.APPLY:
            self.applies += 1
        elif event in (schema.CONNECT, schema.DISCONNECT):
            shard = str(fields.get("synchronizer_shard", ""))
            (self.streams_up.add if event == schema.CONNECT else self.streams_up.discard)(shard)

    def _count(self, outcome: str) -> None:
        with self._lock:
            self.contributions[outcome] = self.contributions.get(outcome, 0) + 1

    def outcomes(self) -> list[tuple[str, int]]:
        """(outcome, contributions), in order of outcome: a copy taken under the lock."""
        with self._lock:
            return sorted(self.contributions.items())

    def stepped(self, tokens: int, loss: float | None, blocked_s: float, tokens_per_s: float,
                sent_total: int, received_total: int) -> None:
        """One inner step: ``tokens`` trained on, its ``loss``, ``blocked_s`` waiting for merges,
        the recent throughput, and the communication side's byte totals."""
        self.steps += 1
        self.tokens += tokens
        if loss is not None:
            self.loss = loss
        self.blocked_s += blocked_s
        self.tokens_per_s = tokens_per_s
        self.count_bytes(sent_total, received_total)

    def count_bytes(self, sent_total: int, received_total: int) -> None:
        """Bring the byte counters up to the communication side's running totals (they never go
        back: a restarted communication process counts from zero again)."""
        self.bytes_sent = max(self.bytes_sent, sent_total)
        self.bytes_received = max(self.bytes_received, received_total)

    def serve(self, port: int, addr: str) -> int:
        server, _ = start_http_server(port, addr=addr, registry=self.registry)
        return int(server.server_address[1])


class _Series(Collector):
    """The learner's series, read from ``LearnerMetrics`` at each scrape."""

    def __init__(self, m: LearnerMetrics) -> None:
        self.m = m

    def collect(self) -> Iterator[Metric]:
        m = self.m
        info = GaugeMetricFamily("ddiloco_build_info", "Build of this process (always 1)", labels=list(m.labels))
        info.add_metric(list(m.labels.values()), 1)
        yield info
        yield CounterMetricFamily("ddiloco_learner_steps_total", "Inner steps", value=m.steps)
        yield CounterMetricFamily("ddiloco_learner_tokens_total", "Tokens trained on", value=m.tokens)
        yield GaugeMetricFamily("ddiloco_learner_tokens_per_second", "Recent throughput", value=m.tokens_per_s)
        loss = GaugeMetricFamily("ddiloco_learner_train_loss", "Last training loss")
        if m.loss is not None:
            loss.add_metric([], m.loss)
        yield loss
        yield CounterMetricFamily("ddiloco_learner_blocked_seconds_total", "Seconds blocked on the network",
                                  value=m.blocked_s)
        outcomes = CounterMetricFamily("ddiloco_learner_contributions_total", "Contributions by outcome",
                                       labels=["outcome"])
        for outcome, count in m.outcomes():
            outcomes.add_metric([outcome], count)
        yield outcomes
        yield CounterMetricFamily("ddiloco_learner_applies_total", "Global fragments applied", value=m.applies)
        yield CounterMetricFamily("ddiloco_learner_sent_bytes_total", "Contribution payload bytes sent",
                                  value=m.bytes_sent)
        yield CounterMetricFamily("ddiloco_learner_received_bytes_total", "Global payload bytes received",
                                  value=m.bytes_received)
        yield GaugeMetricFamily("ddiloco_learner_connected",
                                "Sync streams up: 1 while connected (a sharded synchronizer: one per shard)",
                                value=len(m.streams_up))


__all__ = ["LearnerMetrics"]
