"""The learner's Prometheus series follow Prometheus naming, carry a build_info, and are served."""

from __future__ import annotations

import urllib.request

from prometheus_client import generate_latest

from ddiloco.core import events as schema
from ddiloco.learner.metrics import LearnerMetrics


def test_learner_series_names_and_build_info():
    m = LearnerMetrics()
    assert "\nddiloco_learner_train_loss " not in generate_latest(m.registry).decode(), "no loss before a step"
    for _ in range(3):
        m.stepped(10, 2.5, 0.25, 100.0, 60, 7)
    m.stepped(10, None, 0.0, 90.0, 40, 9)  # a restarted communication side counts from zero: no step back
    for event, fields in ((schema.SEND, {}), (schema.SEND, {}), (schema.RESULT, {"outcome": "merged"}),
                          (schema.DROPPED, {}), (schema.APPLY, {}), (schema.CONNECT, {"synchronizer_shard": 0}),
                          (schema.CONNECT, {"synchronizer_shard": 1}), (schema.DISCONNECT, {"synchronizer_shard": 0})):
        m.observe(event, fields)
    body = generate_latest(m.registry).decode()
    for line in ("ddiloco_learner_steps_total 4.0", "ddiloco_learner_tokens_total 40.0",
                 "ddiloco_learner_train_loss 2.5", "ddiloco_learner_blocked_seconds_total 0.75",
                 "ddiloco_learner_tokens_per_second 90.0", "ddiloco_learner_sent_bytes_total 60.0",
                 "ddiloco_learner_received_bytes_total 9.0", 'ddiloco_learner_contributions_total{outcome="sent"} 2.0',
                 'ddiloco_learner_contributions_total{outcome="merged"} 1.0',
                 'ddiloco_learner_contributions_total{outcome="dropped"} 1.0', "ddiloco_learner_applies_total 1.0",
                 "ddiloco_learner_connected 1.0", "# TYPE ddiloco_learner_sent_bytes_total counter",
                 "# TYPE ddiloco_learner_connected gauge"):
        assert line + "\n" in body, line
    info = next(line for line in body.splitlines() if line.startswith("ddiloco_build_info{"))
    assert 'service="learner"' in info and 'version="0.1.0"' in info and 'torch="' in info
    assert info.endswith(" 1.0")


def test_learner_metrics_are_served_on_the_given_host():
    m = LearnerMetrics()
    port = m.serve(0, "127.0.0.1")  # port 0: any free one; the bound one comes back
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert "ddiloco_learner_connected" in body


def test_contributions_counted_from_several_threads_are_all_counted():
    import sys
    import threading

    m = LearnerMetrics()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch as often as they can: a lost update would show
    try:
        threads = [threading.Thread(target=lambda: [m.observe(schema.RESULT, {"outcome": "merged"})
                                                    for _ in range(20_000)]) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        sys.setswitchinterval(interval)
    assert 'ddiloco_learner_contributions_total{outcome="merged"} 60000.0' in generate_latest(m.registry).decode()
