"""What ``ddiloco run`` resolves before anything trains: dp's own tuned learning rate and warm-up
(a config file's ``train.lr`` / ``train.warmup_steps`` winning), and the final evaluation's set,
the whole held-out split once, deterministic."""

from __future__ import annotations

import argparse
import pathlib

import numpy as np
import pytest
import torch

from ddiloco.core.config import ConfigError
from ddiloco.lab.global_eval import WHOLE_SPLIT, HeldOut
from ddiloco.lab.run_config import DP_TUNED, FROM_CONFIG, TUNED, resolve, train_sources, validate
from ddiloco.learner.config import learner_config
from ddiloco.training.config import TrainConfig
from ddiloco.training.data import eval_batches


def _resolve(mode: str | None, file_doc: dict) -> dict:
    args = argparse.Namespace(config=None, learners=None, steps=None, mode=mode, seed=None, shards=None,
                              learner_speed=None)
    _, doc = resolve(args, file_doc)
    validate(doc)
    return doc


def _train(doc: dict) -> TrainConfig:
    return learner_config(doc, synchronizer="127.0.0.1:1", learner_id="learner-0").train


def test_dp_ships_with_its_own_tuned_lr_and_warm_up() -> None:
    train = _train(_resolve("dp", {}))
    assert (train.lr, train.warmup_steps) == (DP_TUNED.lr, DP_TUNED.warmup_steps) == (6e-3, 60)
    assert train_sources({}, "dp") == {"lr": TUNED, "warmup_steps": TUNED}
    # the learners' modes keep the learners' default, which is not dp's
    for mode in (None, "decoupled", "streaming", "diloco"):
        assert _train(_resolve(mode, {})).lr == TrainConfig().lr != DP_TUNED.lr


def test_an_explicit_lr_or_warm_up_in_the_config_file_wins_over_dps_tuned_one() -> None:
    train = _train(_resolve("dp", {"train": {"lr": 1e-3}}))
    assert (train.lr, train.warmup_steps) == (1e-3, DP_TUNED.warmup_steps)
    assert train_sources({"train": {"lr": 1e-3}}, "dp") == {"lr": FROM_CONFIG, "warmup_steps": TUNED}
    # set to the learners' default, it is still the user's choice
    train = _train(_resolve("dp", {"train": {"lr": TrainConfig().lr, "warmup_steps": 5}}))
    assert (train.lr, train.warmup_steps) == (TrainConfig().lr, 5)
    # the file's mode is the run section's, as a flag's
    assert _train(_resolve(None, {"run": {"mode": "dp"}})).lr == DP_TUNED.lr


def test_final_eval_batches_zero_is_the_whole_split_and_negative_is_refused() -> None:
    assert _resolve(None, {})["run"]["final_eval_batches"] == WHOLE_SPLIT == 0
    with pytest.raises(ConfigError, match="final_eval_batches"):
        _resolve(None, {"run": {"final_eval_batches": -1}})


def test_the_whole_split_is_scored_once_in_order_and_the_same_every_time() -> None:
    tokens = (np.arange(1001) % 65_000).astype(np.uint16)
    whole = HeldOut(tokens, 3, 10)
    assert len(whole) == 34 and whole.describe() == {"split": "all", "batches": 34, "batch_size": 3, "windows": 100,
                                                     "tokens": 1000, "split_tokens": 1001}
    batches = list(whole)
    assert [x.shape[0] for x, _ in batches] == [3] * 33 + [1]
    inputs = torch.cat([x.reshape(-1) for x, _ in batches])
    targets = torch.cat([y.reshape(-1) for _, y in batches])
    # every target token once, in order: the windows tile the split without overlap
    assert torch.equal(targets, torch.from_numpy(tokens[1:].astype(np.int64)))
    assert torch.equal(inputs, torch.from_numpy(tokens[:-1].astype(np.int64)))
    again = list(HeldOut(tokens, 3, 10))
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(batches, again, strict=True))
    # less than a window left at the end is not scored (1001 tokens, context 10: 999 of 1000 targets)
    assert HeldOut(tokens[:1000], 3, 10).describe()["tokens"] == 990
    with pytest.raises(IndexError):
        whole[34]


def test_n_batches_are_the_learners_evenly_spaced_ones() -> None:
    tokens = (np.arange(5000) % 251).astype(np.uint8)
    spaced = HeldOut(tokens, 4, 16, 5)
    reference = eval_batches(tokens, 4, 16, 5)
    assert len(spaced) == 5 and all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                                    for a, b in zip(spaced, reference, strict=True))
    assert spaced.describe()["split"] == "spaced" and spaced.describe()["tokens"] == 5 * 4 * 16
    with pytest.raises(ValueError, match="fewer than context"):
        HeldOut(tokens[:10], 4, 16)


def test_a_summary_from_before_the_eval_set_was_recorded_is_no_baseline(tmp_path: pathlib.Path) -> None:
    import json

    from ddiloco.lab.run import load_baseline

    doc = _resolve(None, {})
    summary = {"mode": "decoupled", "learners": 3, "steps_per_learner": 600, "seed": 0, "final_eval_loss": 1.7}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(ValueError, match="not comparable"):
        load_baseline(str(tmp_path), doc)
    summary["final_eval"] = {"split": "all", "batches": 150}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    assert load_baseline(str(tmp_path), doc)["final_eval_loss"] == 1.7
