"""Configuration refuses what it should, names the field, and applies mode presets in one place.

Each case is a mistake a user makes in a config file; the error must name the field and what it
expected, and nothing may be silently coerced or ignored. The services' command lines are driven
as a user would, with a real file.
"""

from __future__ import annotations

import dataclasses
import pathlib
import subprocess
import sys

import pytest

from ddiloco.core.config import ConfigError, build, read_document
from ddiloco.core.modes import PRESETS, apply_mode
from ddiloco.learner.config import learner_config
from ddiloco.protocol.config import ProtocolConfig
from ddiloco.synchronizer.config import SynchronizerConfig, synchronizer_config


@pytest.mark.parametrize("section, message", [
    ({"outer_lr": "fast"}, "synchronizer.outer_lr: Input should be a valid number (got 'fast')"),
    ({"max_learners": "lots"}, "synchronizer.max_learners: Input should be a valid integer (got 'lots')"),
    ({"merge_threads": 2.5}, "synchronizer.merge_threads: Input should be a valid integer (got 2.5)"),
    ({"embedding_patterns": "*embed*"}, "synchronizer.embedding_patterns: Input should be a valid array"),
    ({"merge_method": "median"}, "synchronizer.merge_method: Input should be 'rda' or 'mean'"),
    ({"policy": {"quorum": True}}, "synchronizer.policy.quorum: Input should be a valid integer"),
    ({"polcy": {"quorum": 2}}, "synchronizer.polcy: unknown key"),
    ({"outer_lr": -1.0}, "outer_lr must be > 0"),
])
def test_synchronizer_section_errors_name_the_field(section, message) -> None:
    with pytest.raises(ConfigError) as err:
        synchronizer_config({"synchronizer": section})
    assert message in str(err.value)


def test_lists_become_tuples_and_ints_are_floats() -> None:
    cfg = synchronizer_config({"synchronizer": {"embedding_patterns": ["*emb*"], "outer_lr": 1,
                                                "policy": {"max_grace_s": 3}}})
    assert cfg.embedding_patterns == ("*emb*",) and cfg.outer_lr == 1.0 and isinstance(cfg.outer_lr, float)
    assert cfg.policy.max_grace_s == 3.0


def test_a_misspelled_section_is_refused(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_text("synchroniser:\n  outer_lr: 0.5\n")
    with pytest.raises(ConfigError, match="unknown section\\(s\\) synchroniser; known: run, protocol"):
        read_document(path)
    with pytest.raises(ConfigError, match="unknown section"):
        synchronizer_config({"synchroniser": {}})


def test_code_is_checked_like_a_file() -> None:
    cfg = SynchronizerConfig()
    with pytest.raises(Exception, match="valid number"):
        dataclasses.replace(cfg, outer_lr="fast")
    with pytest.raises(Exception, match="valid tuple"):
        SynchronizerConfig(embedding_patterns=["*embed*"])  # type: ignore[arg-type]


def test_learner_sections_are_typed_too() -> None:
    with pytest.raises(ConfigError, match=r"learner\.train\.steps: Input should be a valid integer"):
        learner_config({"train": {"steps": "many"}})
    with pytest.raises(ConfigError, match=r"learner\.model\.n_layr: unknown key"):
        learner_config({"model": {"n_layr": 2}})
    with pytest.raises(ConfigError, match=r"learner\.apply_policy: Input should be 'overwrite', 'mix' or 'replay'"):
        learner_config({"learner": {"apply_policy": "merge"}})
    with pytest.raises(ConfigError, match="set it in the top-level train section"):
        learner_config({"learner": {"train": {"steps": 3}}})


def test_mode_presets_in_one_place() -> None:
    doc = apply_mode({"protocol": {"num_fragments": 24, "overlap": 2}, "synchronizer": {"policy": {"quorum": 1}}},
                     "diloco")
    assert doc["protocol"] == {"num_fragments": 1, "overlap": 0, "mode": "diloco"}
    assert doc["synchronizer"]["policy"] == {"quorum": 0, "timeout_s": 120.0}
    kept = apply_mode({"synchronizer": {"policy": {"timeout_s": 7.0}}}, "streaming")
    assert kept["synchronizer"]["policy"] == {"timeout_s": 7.0, "quorum": 0}, "a given timeout stays"
    assert apply_mode({}, None)["protocol"]["mode"] == "decoupled"
    for mode in PRESETS:  # every preset yields configs both services accept, and they agree
        doc = {"protocol": {"mode": mode}}
        assert synchronizer_config(doc).protocol == learner_config(doc).protocol


def test_a_config_contradicting_its_mode_is_refused() -> None:
    with pytest.raises(Exception, match="diloco mode has num_fragments 1, got 24"):
        ProtocolConfig(mode="diloco", num_fragments=24)
    with pytest.raises(ConfigError, match="streaming mode merges with quorum 0"):
        build(SynchronizerConfig, {"protocol": {"mode": "streaming"}, "policy": {"quorum": 1, "timeout_s": 5}})
    with pytest.raises(ConfigError, match=r"needs policy\.timeout_s"):
        build(SynchronizerConfig, {"protocol": {"mode": "streaming"}, "policy": {"quorum": 0}})


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ddiloco.core.cli", *args], capture_output=True, text=True,
                          timeout=120)


def test_services_refuse_a_bad_file_with_the_field_and_start_nothing(tmp_path: pathlib.Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("synchronizer:\n  outer_lr: fast\n")
    proc = _cli("synchronizer", "--config", str(bad), "--state-dir", str(tmp_path / "state"))
    assert proc.returncode == 2 and "synchronizer.outer_lr: Input should be a valid number" in proc.stderr
    assert not (tmp_path / "state").exists(), "a refused config creates no state dir"
    bad.write_text("model:\n  d_model: 12.5\n")
    proc = _cli("learner", "--config", str(bad), "--synchronizer", "127.0.0.1:1")
    assert proc.returncode == 2 and "learner.model.d_model: Input should be a valid integer" in proc.stderr
    proc = _cli("learner", "--synchronizer", "localhost", "--steps", "1")
    assert proc.returncode == 2 and "must be HOST:PORT" in proc.stderr, proc.stderr[-2000:]


def test_run_section_and_learner_speeds(tmp_path: pathlib.Path) -> None:
    import argparse

    from ddiloco.lab.run_config import resolve

    def args(**kw):  # type: ignore[no-untyped-def]
        base = dict(config=None, learners=4, steps=10, mode=None, seed=None, learner_speed=None)
        return argparse.Namespace(**{**base, **kw})

    run, doc = resolve(args(learner_speed=["learner-2=0.5", "learner-3=0.5"]))
    assert run.learner_speed == {"learner-2": 0.5, "learner-3": 0.5} and doc["run"]["learner_speed"]["learner-3"] == 0.5
    for bad, message in ((["learner-9=0.5"], "learner-0..learner-3"), (["learner-1=2"], r"in \(0, 1\]"),
                         (["learner-1"], "ID=FRACTION"), (["learner-1=fast"], "ID=FRACTION")):
        with pytest.raises(ValueError, match=message):
            resolve(args(learner_speed=bad))
