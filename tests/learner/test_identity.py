"""A learner's data shard from its identity: ordinals, Kubernetes pod names, bad settings."""

from __future__ import annotations

import pytest

from ddiloco.learner.config import LearnerConfig


def _shard(learner_id: str, **kw) -> tuple[int, int]:
    return LearnerConfig(learner_id=learner_id, **kw).resolved_shard()


def test_ordinal_suffix_names_the_shard():
    assert _shard("learner-3") == (3, 8)
    assert _shard("ddiloco-learner-0", num_shards=4) == (0, 4)
    assert _shard("ddiloco-learner-9", num_shards=4) == (1, 4)  # more learners than shards: shared


def test_deployment_pod_names_hash_into_the_fleets_shard_space():
    names = ["ddiloco-learner-7d9f8c6b5-x2k94", "ddiloco-learner-7d9f8c6b5-q8m2z", "ddiloco-learner-5c4b-20x21"]
    shards = [_shard(n) for n in names]
    assert all(total == 8 and 0 <= index < 8 for index, total in shards)  # no crash, one shard space
    assert shards == [_shard(n) for n in names]  # stable across processes: sha256, not hash()
    assert _shard("ddiloco-learner-7d9f8c6b5-x2k94", num_shards=8) == shards[0]


def test_explicit_shard_wins_and_bad_ones_are_refused_at_config_time():
    assert _shard("ddiloco-learner-7d9f8c6b5-x2k94", shard_index=5) == (5, 8)
    for kw in ({"shard_index": 8}, {"num_shards": 0}):
        with pytest.raises(ValueError, match="num_shards"):
            LearnerConfig(learner_id="a", **kw)
