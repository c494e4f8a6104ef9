"""A learner's data shard from its identity: ordinals, Kubernetes pod names, bad settings."""

from __future__ import annotations

import pytest
import torch

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


def test_learners_sharing_a_shard_draw_different_batches_unless_it_was_given():
    """Two ids that land in one shard (an ordinal beyond num_shards, pods hashed into it) draw
    different windows of it; a shard given with --shard keeps the stream of its index."""
    from ddiloco.training.data import shard_generator

    def first_draws(cfg: LearnerConfig) -> list[int]:
        return torch.randint(0, 10**9, (4,), generator=shard_generator(7, cfg.batch_stream())).tolist()

    a, b = LearnerConfig(learner_id="learner-1", num_shards=4), LearnerConfig(learner_id="learner-9", num_shards=4)
    assert a.resolved_shard() == b.resolved_shard() == (1, 4)
    assert first_draws(a) != first_draws(b)
    given = [LearnerConfig(learner_id=n, shard_index=1, num_shards=4) for n in ("x", "y")]
    assert given[0].batch_stream() == given[1].batch_stream() == 1
    assert first_draws(given[0]) == torch.randint(0, 10**9, (4,), generator=shard_generator(7, 1)).tolist()
