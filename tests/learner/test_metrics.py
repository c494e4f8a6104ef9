"""The learner's Prometheus series follow Prometheus naming, carry a build_info, and are served."""

from __future__ import annotations

import urllib.request

from prometheus_client import generate_latest

from ddiloco.learner.metrics import LearnerMetrics


def test_learner_series_names_and_build_info():
    m = LearnerMetrics()
    m.steps.inc(3)
    m.bytes_sent.inc(100)
    body = generate_latest(m.registry).decode()
    assert "ddiloco_learner_steps_total 3.0" in body
    assert "# TYPE ddiloco_learner_sent_bytes_total counter" in body
    assert "ddiloco_learner_sent_bytes_total 100.0" in body
    info = next(line for line in body.splitlines() if line.startswith("ddiloco_build_info{"))
    assert 'service="learner"' in info and 'version="0.1.0"' in info and 'torch="' in info
    assert info.endswith(" 1.0")


def test_learner_metrics_are_served_on_the_given_host():
    m = LearnerMetrics()
    port = m.serve(0, "127.0.0.1")  # port 0: any free one; the bound one comes back
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert "ddiloco_learner_connected" in body
