"""A synchronizer shard labels every sample it exports ``shard="s"``; an unsharded one adds nothing.

Real servers on loopback, their metrics endpoint scraped over HTTP as Prometheus would.
"""

from __future__ import annotations

import asyncio
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from ddiloco.algorithm.policies import QuorumPolicy
from ddiloco.fragments.payload import encode_fragment
from ddiloco.protocol.shards import owner
from ddiloco.synchronizer.metrics import SynchronizerMetrics
from tests.scripted import ScriptedLearner, eventually, running_server, sync_config, toy_protocol

PROTOCOL = toy_protocol(num_fragments=4)
POLICY = QuorumPolicy(quorum=1, grace_gamma=0.0, max_grace_s=0.0)


async def _scrape(port: int, query: str = "") -> str:
    url = f"http://127.0.0.1:{port}/metrics{query}"
    return await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())


def _samples(body: str) -> list[tuple[str, dict[str, str], float]]:
    return [(s.name, s.labels, s.value) for family in text_string_to_metric_families(body) for s in family.samples]


async def _one_merge(server, shard: int, shards: int, fragment: int) -> ScriptedLearner:
    """A learner uploads the shard's fragments and gets one contribution to ``fragment`` merged."""
    learner = ScriptedLearner(server.port, "a", protocol=PROTOCOL)
    await learner.connect()
    for frag in learner.layout:
        if owner(frag.index, shards) == shard:
            await learner.stream.send_transfer(encode_fragment(
                learner.flat(frag.index), frag, codec=learner.codec, kind="genesis", version=0,
                transfer_id=next(learner.transfer_ids), layout_hash=learner.layout.fingerprint,
                sequence=next(learner.sequence), max_chunk_bytes=PROTOCOL.max_chunk_bytes))
    await eventually(lambda: server.engine.ready, what="genesis commit")
    learner.start_pump()
    await learner.heartbeat()
    seq = await learner.contribute(fragment, learner.flat(fragment) * 0 + 0.01, base_version=0)
    assert (await learner.wait_result(seq)).outcome == "merged"
    return learner


async def test_every_sample_of_a_shard_carries_its_shard_label(tmp_path):
    cfg = sync_config(tmp_path, protocol=PROTOCOL, policy=POLICY, metrics_port=0, shard_index=1, shard_count=2)
    async with running_server(cfg) as server:
        learner = await _one_merge(server, 1, 2, 3)
        body = await _scrape(server.metrics_port)
        samples = _samples(body)
        assert len(samples) > 50
        unlabelled = [(name, labels) for name, labels, _ in samples if labels.get("shard") != "1"]
        assert unlabelled == []
        assert ("ddiloco_sync_merges_total", {"fragment": "3", "shard": "1"}, 1.0) in samples
        assert ("ddiloco_sync_fragment_version", {"fragment": "3", "shard": "1"}, 1.0) in samples
        assert ("ddiloco_sync_learner_up", {"learner": "a", "shard": "1"}, 1.0) in samples
        assert ("ddiloco_sync_contributions_total", {"outcome": "merged", "reason": "", "shard": "1"}, 1.0) in samples
        assert any(name == "ddiloco_sync_merge_seconds_bucket" and labels == {"le": "+Inf", "shard": "1"}
                   and value == 1.0 for name, labels, value in samples)
        info = next(labels for name, labels, _ in samples if name == "ddiloco_build_info")
        assert info["service"] == "synchronizer" and info["shard"] == "1"
        # Prometheus' text format as written, label sets in order
        assert 'ddiloco_sync_merges_total{fragment="3",shard="1"} 1.0' in body
        # a scrape restricted by name[] still finds the labelled series
        only = _samples(await _scrape(server.metrics_port, "?name[]=ddiloco_sync_merges_total"))
        assert [(n, lb) for n, lb, _ in only if n == "ddiloco_sync_merges_total"] == [
            ("ddiloco_sync_merges_total", {"fragment": "3", "shard": "1"})]
        assert all(n.startswith("ddiloco_sync_merges_") for n, _, _ in only)
        await learner.close()


async def test_an_unsharded_synchronizer_exports_no_shard_label(tmp_path):
    cfg = sync_config(tmp_path, protocol=PROTOCOL, policy=POLICY, metrics_port=0)
    async with running_server(cfg) as server:
        learner = await _one_merge(server, 0, 1, 2)
        samples = _samples(await _scrape(server.metrics_port))
        assert ("ddiloco_sync_merges_total", {"fragment": "2"}, 1.0) in samples
        assert [labels for _, labels, _ in samples if "shard" in labels] == []
        await learner.close()


def test_the_label_follows_the_shard_layout():
    m = SynchronizerMetrics()
    m.merges.labels(fragment="5").inc()

    def merges() -> list[dict[str, str]]:
        return [s.labels for f in m.registry.collect() for s in f.samples if s.name == "ddiloco_sync_merges_total"]

    assert merges() == [{"fragment": "5"}]
    m.set_shard(2, 3)
    assert merges() == [{"fragment": "5", "shard": "2"}]
    m.set_shard(0, 1)
    assert merges() == [{"fragment": "5"}]
