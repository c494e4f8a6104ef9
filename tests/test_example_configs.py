"""The config files under examples/ load as they are, on the synchronizer's side and a learner's, and
say what they promise (a file a user copies must not fail at start)."""

from __future__ import annotations

import pathlib

import yaml

from ddiloco.learner.config import load_learner_config
from ddiloco.synchronizer.config import synchronizer_config

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def test_the_shorter_sync_period_loads_on_both_sides_with_the_same_protocol():
    path = EXAMPLES / "sync_every_12.yaml"
    learner = load_learner_config(str(path))
    sync = synchronizer_config(yaml.safe_load(path.read_text()))
    assert learner.protocol == sync.protocol
    assert (sync.protocol.num_fragments, sync.protocol.sync_every, sync.protocol.global_codec) == (12, 12, "int8_block")
    assert learner.codec == "int2_block" and learner.error_feedback
    assert learner.applies_on_arrival and learner.train.lr == 4.5e-3, "the other defaults stay"
