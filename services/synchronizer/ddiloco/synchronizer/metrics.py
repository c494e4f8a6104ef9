"""Prometheus metrics of the synchronizer, on a registry of its own (several may share a process).

A shard of a sharded synchronizer (``shard_count`` > 1) labels every sample it exports with
``shard="s"``: the metrics are registered on an inner registry, and the registry that is served
(``registry``) adds the label to each sample as it is collected (prometheus_client has no constant
labels). An unsharded synchronizer exports exactly what it did before sharding existed, no label.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from ddiloco.core import build_labels

_TIME_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class _LearnerUp(Collector):
    """``ddiloco_sync_learner_up{learner}``, read from the membership at each scrape, so a learner
    the synchronizer has forgotten leaves no stale series behind."""

    def __init__(self) -> None:
        self.source: Callable[[], Iterable[tuple[str, bool]]] = lambda: ()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("ddiloco_sync_learner_up", "1 while a known learner counts as live, else 0",
                                   labels=["learner"])
        for learner_id, live in self.source():
            family.add_metric([learner_id], 1.0 if live else 0.0)
        yield family


class _ShardLabel(Collector):
    """Everything ``inner`` collects, each sample labelled ``shard`` while ``shard`` is set."""

    def __init__(self, inner: CollectorRegistry) -> None:
        self.inner = inner
        self.shard: str | None = None

    def collect(self) -> Iterator[Metric]:
        shard = self.shard
        for family in self.inner.collect():
            if shard is not None:
                family = copy.copy(family)
                family.samples = [s._replace(labels={**s.labels, "shard": shard}) for s in family.samples]
            yield family

    def describe(self) -> list[Metric]:
        """The inner families (their names are what a scrape restricted by ``name[]`` looks up)."""
        return list(self.inner.collect())


class SynchronizerMetrics:
    def __init__(self) -> None:
        r = CollectorRegistry()
        labels = build_labels("synchronizer")
        self.build_info = Gauge("ddiloco_build_info", "Build of this process (always 1)", list(labels), registry=r)
        self.build_info.labels(**labels).set(1)
        self._learner_up = _LearnerUp()
        r.register(self._learner_up)
        self.merges = Counter("ddiloco_sync_merges_total", "Merges committed", ["fragment"], registry=r)
        self.quorum_size = Histogram("ddiloco_sync_quorum_size", "Contributions per merge",
                                     buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64), registry=r)
        self.grace_wait = Histogram("ddiloco_sync_grace_wait_seconds", "Grace window used per merge",
                                    buckets=_TIME_BUCKETS, registry=r)
        self.merge_seconds = Histogram("ddiloco_sync_merge_seconds", "Merge + outer step time",
                                       buckets=_TIME_BUCKETS, registry=r)
        self.commit_seconds = Histogram("ddiloco_sync_commit_seconds", "Durable commit time",
                                        buckets=_TIME_BUCKETS, registry=r)
        self.contributions = Counter("ddiloco_sync_contributions_total", "Contributions by outcome and reason",
                                     ["outcome", "reason"], registry=r)
        self.staleness = Histogram("ddiloco_sync_staleness_versions", "Versions behind at merge",
                                   buckets=(0, 1, 2, 3, 4, 8, 16), registry=r)
        self.bytes_in = Counter("ddiloco_sync_received_bytes_total", "Chunk payload bytes received", registry=r)
        self.bytes_out = Counter("ddiloco_sync_sent_bytes_total", "Chunk payload bytes sent", registry=r)
        self.received_bytes = 0
        """Chunk payload bytes received so far (``bytes_in``'s value, readable without the registry)."""
        self.sent_bytes = 0
        """Chunk payload bytes sent so far (``bytes_out``'s value)."""
        self.version = Gauge("ddiloco_sync_fragment_version", "Current version per fragment", ["fragment"],
                             registry=r)
        self.live_learners = Gauge("ddiloco_sync_live_learners", "Learners counting for quorums", registry=r)
        self.connected_learners = Gauge("ddiloco_sync_connected_learners", "Open Sync streams", registry=r)
        self.norm_clipped = Counter("ddiloco_sync_norm_clipped_total",
                                    "Contributions scaled down by the norm guard", registry=r)
        self.claims_bounded = Counter("ddiloco_sync_claims_bounded_total",
                                      "Contributions merged with fewer steps or tokens than they claimed (the claim guard; the "
                                      "weight guard with action bound)",
                                      registry=r)
        self.limit_refusals = Counter("ddiloco_sync_limit_refusals_total",
                                      "Streams and transfers refused by a resource limit", ["limit"], registry=r)
        self.auth_refusals = Counter("ddiloco_sync_auth_refusals_total",
                                     "Calls refused for their credentials", ["reason"], registry=r)
        self.dropped_results = Counter("ddiloco_sync_dropped_control_messages_total",
                                       "Control messages dropped from full learner queues", registry=r)
        self._shard_label = _ShardLabel(r)
        self.registry = CollectorRegistry()
        """What is exported: every metric above, labelled by shard once ``set_shard`` made it a shard."""
        self.registry.register(self._shard_label)

    def received(self, n: int) -> None:
        """``n`` chunk payload bytes came in."""
        self.bytes_in.inc(n)
        self.received_bytes += n

    def sent(self, n: int) -> None:
        """``n`` chunk payload bytes went out."""
        self.bytes_out.inc(n)
        self.sent_bytes += n

    def set_shard(self, shard_index: int, shard_count: int) -> None:
        """Label every sample ``shard="<shard_index>"`` when the synchronizer is one of
        ``shard_count`` > 1 shards; no label when it is the only one."""
        self._shard_label.shard = str(shard_index) if shard_count > 1 else None

    def watch_learners(self, source: Callable[[], Iterable[tuple[str, bool]]]) -> None:
        """``source()`` -> (learner id, live) of every known learner, called at each scrape."""
        self._learner_up.source = source

    def serve(self, port: int, addr: str) -> int:
        server, _ = start_http_server(port, addr=addr, registry=self.registry)
        return int(server.server_address[1])
