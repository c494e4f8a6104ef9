"""Prometheus metrics of a learner, on a registry of its own (served when ``metrics_port`` is set)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from ddiloco.core import build_labels
from ddiloco.core import events as schema


class LearnerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        labels = build_labels("learner")
        self.build_info = Gauge("ddiloco_build_info", "Build of this process (always 1)", list(labels), registry=r)
        self.build_info.labels(**labels).set(1)
        self.steps = Counter("ddiloco_learner_steps_total", "Inner steps", registry=r)
        self.tokens = Counter("ddiloco_learner_tokens_total", "Tokens trained on", registry=r)
        self.tokens_per_s = Gauge("ddiloco_learner_tokens_per_second", "Recent throughput", registry=r)
        self.loss = Gauge("ddiloco_learner_train_loss", "Last training loss", registry=r)
        self.blocked = Counter("ddiloco_learner_blocked_seconds_total", "Seconds blocked on the network", registry=r)
        self.contributions = Counter("ddiloco_learner_contributions_total", "Contributions by outcome",
                                     ["outcome"], registry=r)
        self.applies = Counter("ddiloco_learner_applies_total", "Global fragments applied", registry=r)
        self.bytes_sent = Counter("ddiloco_learner_sent_bytes_total", "Contribution payload bytes sent", registry=r)
        self.bytes_received = Counter("ddiloco_learner_received_bytes_total", "Global payload bytes received",
                                      registry=r)
        self._bytes_seen = (0, 0)
        self.connected = Gauge("ddiloco_learner_connected",
                               "Sync streams up: 1 while connected (a sharded synchronizer: one per shard)",
                               registry=r)
        self._streams_up: set[str] = set()
        self._outcomes: dict[str, Any] = {}
        """Each outcome's child of ``contributions``, made once (``labels()`` looks it up under a lock)."""

    def _outcome(self, outcome: str) -> Any:
        child = self._outcomes.get(outcome)
        if child is None:
            child = self._outcomes[outcome] = self.contributions.labels(outcome)
        return child

    def observe(self, event: str, fields: dict) -> None:
        """An event-log observer: the counters that follow from the learner's events."""
        if event == schema.RESULT:
            self._outcome(fields.get("outcome", "")).inc()
        elif event == schema.DROPPED:
            self._outcome("dropped").inc()
        elif event == schema.SEND:
            self._outcome("sent").inc()
        elif event == schema.APPLY:
            self.applies.inc()
        elif event in (schema.CONNECT, schema.DISCONNECT):
            shard = str(fields.get("synchronizer_shard", ""))
            (self._streams_up.add if event == schema.CONNECT else self._streams_up.discard)(shard)
            self.connected.set(len(self._streams_up))

    def stepped(self, tokens: int, loss: float | None, blocked_s: float, tokens_per_s: float,
                sent_total: int, received_total: int) -> None:
        """One inner step: ``tokens`` trained on, its ``loss``, ``blocked_s`` waiting for merges,
        the recent throughput, and the communication thread's byte totals."""
        self.steps.inc()
        self.tokens.inc(tokens)
        if loss is not None:
            self.loss.set(loss)
        self.blocked.inc(blocked_s)
        self.tokens_per_s.set(tokens_per_s)
        self.count_bytes(sent_total, received_total)

    def count_bytes(self, sent_total: int, received_total: int) -> None:
        """Bring the byte counters up to the communication thread's running totals."""
        sent, received = self._bytes_seen
        self.bytes_sent.inc(max(0, sent_total - sent))
        self.bytes_received.inc(max(0, received_total - received))
        self._bytes_seen = (max(sent, sent_total), max(received, received_total))

    def serve(self, port: int, addr: str) -> int:
        server, _ = start_http_server(port, addr=addr, registry=self.registry)
        return int(server.server_address[1])
