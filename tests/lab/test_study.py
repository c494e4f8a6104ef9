"""``ddiloco study``: the quality study's reference fleet, its results folder and its report, at a
smoke size (a few steps of the default model)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from ddiloco.fragments.partition import partition_tensors
from ddiloco.lab.study.case import Case, parse_case
from ddiloco.lab.study.cli import main
from ddiloco.lab.study.reference import MODELS, run_case
from ddiloco.lab.study.store import Results, ResultsError
from ddiloco.training.model import ModelConfig, build_model

SMALL = {"steps": 4, "eval_batches": 2, "curve_points": 1}


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _sizes(case: Case) -> list[int]:
    model = build_model(ModelConfig(context=128, **MODELS[case.model]), case.seed)
    return [f.numel for f in partition_tensors(list(model.named_parameters()), case.fragments)]


def test_cases_run_are_saved_and_a_rerun_skips_them(tmp_path, capsys) -> None:
    small = ":eval_batches=2:curve_points=1"
    cases = f"dp{small},decoupled:sync_every=2:fragments=2:overlap=1{small},diloco:sync_every=2{small}"
    args = ["quality", "--cases", cases, "--steps", "4", "--threads", "1", "--out", str(tmp_path)]
    assert main(args) == 0
    out = capsys.readouterr().out
    tail = "-eval_batches_2-curve_points_1"
    ids = [f"dp-steps_4{tail}", f"decoupled-steps_4-fragments_2-sync_every_2-overlap_1{tail}",
           f"diloco-steps_4-sync_every_2{tail}"]
    for case_id in ids:
        assert f"{case_id}: eval" in out
        saved = json.loads((tmp_path / f"{case_id}.json").read_text())
        assert saved["id"] == case_id and math.isfinite(saved["final_eval_loss"])
        assert saved["final_eval_loss"] < math.log(256) + 0.5
        assert saved["curve"][0][0] == 0 and saved["curve"][-1][0] == saved["tokens"] == 3 * 4 * 16 * 128
    before = {p.name: p.read_text() for p in tmp_path.glob("*.json")}
    assert main(args) == 0
    out = capsys.readouterr().out
    assert all(f"{case_id}: saved" in out for case_id in ids)
    assert {p.name: p.read_text() for p in tmp_path.glob("*.json")} == before
    assert not list(tmp_path.glob("*.lock")) and not list(tmp_path.glob("*.tmp.*"))

    assert main(["report", "--out", str(tmp_path), "--docs", str(tmp_path / "img")]) == 0
    report = (tmp_path / "report.md").read_text()
    assert "| 3 | 4 | default | 0 |" in report  # the dp row of this budget
    decoupled = json.loads((tmp_path / f"{ids[1]}.json").read_text())
    dp = json.loads((tmp_path / f"{ids[0]}.json").read_text())
    assert f"{decoupled['final_eval_loss'] / dp['final_eval_loss'] - 1:+.1%}" in report
    for name in ("frontier.png", "trends.png", "curves.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert (tmp_path / "img" / f"quality_{name}").exists()


def test_the_reference_is_deterministic_and_stragglers_change_it() -> None:
    base = parse_case("decoupled:sync_every=2:fragments=2:overlap=1", **SMALL)
    a, b = run_case(base), run_case(base)
    assert a["final_eval_loss"] == b["final_eval_loss"] and a["stale_rows"] == b["stale_rows"]
    point = run_case(parse_case("decoupled:sync_every=2:fragments=2:overlap=1:late=1", **SMALL))
    delta = run_case(parse_case("decoupled:sync_every=2:fragments=2:overlap=1:late=1:anchor=delta", **SMALL))
    assert point["stale_rows"] > a["stale_rows"]  # the late learner's rows join a round late
    assert point["final_eval_loss"] != delta["final_eval_loss"] != a["final_eval_loss"]


def test_the_last_merge_of_hand_overs_takes_no_momentum_unless_asked() -> None:
    """The synchronizer's rule for a round of hand-overs only: training is the same to the last
    step (the learners' mean model, bytes and merges are equal), only the last merge of each
    fragment differs. A result saved before the setting existed ran with the momentum."""
    with_momentum = parse_case("decoupled:sync_every=2:fragments=2:overlap=1:hand_over_momentum=on", **SMALL)
    without = parse_case("decoupled:sync_every=2:fragments=2:overlap=1", **SMALL)
    assert "-hand_over_momentum_on" in with_momentum.id and "hand_over" not in without.id  # off: the product's
    a, b = run_case(with_momentum), run_case(without)
    assert (a["learner_mean_eval_loss"], a["bytes_up"], a["merges"]) == (b["learner_mean_eval_loss"], b["bytes_up"], b["merges"])
    assert a["final_eval_loss"] != b["final_eval_loss"]
    saved_before = {k: v for k, v in with_momentum.settings().items() if k != "hand_over_momentum"}
    assert with_momentum.matches(saved_before) and not without.matches(saved_before)


def test_results_saved_before_a_setting_existed_are_reported_and_reindexed(tmp_path) -> None:
    """A result without ``hand_over_momentum`` (saved before it existed) ran with the momentum:
    the report reads it as that case, and reindexing leaves it under its name."""
    dp, decoupled = parse_case("dp", **SMALL), parse_case("decoupled:hand_over_momentum=on", **SMALL)
    for case, loss in ((dp, 2.0), (decoupled, 2.2)):
        saved = {k: v for k, v in case.settings().items() if k != "hand_over_momentum"}
        (tmp_path / f"{case.id}.json").write_text(json.dumps({
            **saved, "id": case.id, "final_eval_loss": loss, "learner_mean_eval_loss": None, "params": 1,
            "tokens": case.tokens, "bytes_up": 1, "bytes_down": 1, "bytes_per_token": 1.0, "merges": 1,
            "stale_rows": 0, "curve": [[0, 3.0], [case.tokens, loss]], "wall_s": 1.0}))
    assert Results(tmp_path).reindex() == []
    assert main(["report", "--out", str(tmp_path), "--docs", str(tmp_path / "img")]) == 0
    assert "+10.0%" in (tmp_path / "report.md").read_text()  # 2.2 against dp's 2.0


def test_bytes_are_counted_as_sent() -> None:
    """fp32 both ways, P = H = 2, tau = 1, 4 steps, 2 learners: fragment 0 falls due at steps 2 and
    4, fragment 1 at 1 and 3. Each learner sends each due fragment, then at the end what it trained
    since its last send (fragment 1, sent at 3); every merge but the final ones is sent back to
    both learners. dp sends what a ring all-reduce of fp32 gradients would: 2 (M-1) N * 4 a step."""
    case = parse_case("decoupled:sync_every=2:fragments=2:overlap=1:codec=fp32:global_codec=fp32:learners=2", **SMALL)
    r = run_case(case)
    n0, n1 = _sizes(case)
    assert r["bytes_up"] == 2 * 4 * (2 * n0 + 3 * n1)
    assert r["bytes_down"] == 2 * 4 * (2 * n0 + 2 * n1)
    assert r["merges"] == 4 + 1
    dp = run_case(parse_case("dp:learners=2", **SMALL))
    assert dp["bytes_per_token"] == 2 * (2 - 1) * dp["params"] * 4 / (2 * 16 * 128)


def test_a_claimed_case_is_skipped_and_a_dead_workers_claim_is_taken_over(tmp_path) -> None:
    results = Results(tmp_path)
    case = parse_case("dp", **SMALL)
    with results.claim(case) as mine:
        assert mine
        with results.claim(case) as again:  # a live worker (this process) holds it
            assert not again
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / f"{case.id}.lock").write_text(dead.stdout.strip())
    with results.claim(case) as mine:
        assert mine
        assert (tmp_path / f"{case.id}.lock").read_text() == str(os.getpid())
    assert not (tmp_path / f"{case.id}.lock").exists()


def test_a_result_of_other_settings_is_refused_and_kept(tmp_path, capsys) -> None:
    case = parse_case("dp", steps=4)
    path = tmp_path / f"{case.id}.json"
    # settings that no longer make a case (a setting since removed): refused, left where it is
    saved = {**case.settings(), "inner_lr": 1.0, "final_eval_loss": 9.0}
    del saved["warmup_steps"]
    path.write_text(json.dumps(saved))
    with pytest.raises(ResultsError, match="other settings"):
        Results(tmp_path).get(case)
    assert main(["quality", "--cases", "dp", "--steps", "4", "--out", str(tmp_path)]) == 1
    assert "other settings" in capsys.readouterr().err
    assert json.loads(path.read_text())["final_eval_loss"] == 9.0
    path.write_text("{not json")
    with pytest.raises(ResultsError, match="unreadable"):
        Results(tmp_path).get(case)


@pytest.mark.parametrize("argv,message", [
    (["--cases", "teleport"], "unknown mode"),
    (["--cases", "decoupled:speed=2"], "unknown case setting 'speed'"),
    (["--cases", "decoupled:late=3"], "late must be"),
    (["--cases", "decoupled:overlap=24"], "overlap must satisfy"),
    (["--cases", "diloco:fragments=4"], "diloco mode has one fragment"),
    (["--cases", "decoupled:codec=gzip"], "codec must be one of"),
    (["--cases", "decoupled:error_feedback=maybe"], "error_feedback takes on/off"),
    (["--sweep", "everything"], "unknown sweep"),
    (["--cases", "dp", "--seeds", "one"], "--seeds takes"),
    ([], "nothing to run"),
])
def test_bad_input_is_refused_and_runs_nothing(tmp_path, capsys, argv, message) -> None:
    with pytest.raises(SystemExit) as info:
        main(["quality", *argv, "--out", str(tmp_path / "out")])
    assert info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_sweeps_are_valid_cases() -> None:
    from ddiloco.lab.study.sweeps import SWEEPS

    for name, specs in SWEEPS.items():
        cases = [parse_case(spec) for spec in specs]
        assert len({c.id for c in cases}) == len(cases), f"sweep {name} repeats a case"


def test_the_command(tmp_path) -> None:
    proc = subprocess.run([sys.executable, "-m", "ddiloco.core.cli", "study", "quality", "--sweep", "frontier",
                           "--list", "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    # the first stages' cases name the defaults they ran around (sweeps.BEFORE, STAGE1)
    assert ("decoupled-data_order_contiguous-inner_lr_0.003-warmup_steps_30-fragments_6-sync_every_6-apply_at_tau-"
            "codec_int2_block-momentum_warmup_0-hand_over_momentum_on ") in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "ddiloco.core.cli", "study", "quality", "--cases", "dp:inner_lr=x"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "inner_lr takes a float" in proc.stderr


def test_results_are_renamed_to_the_ids_their_settings_have_under_todays_defaults(tmp_path) -> None:
    """A default changed: the old default's result is named by what now differs, and its old name
    is free for the new default's result."""
    old_default = parse_case("decoupled", warmup_steps=45, **SMALL)
    misnamed = tmp_path / f"{parse_case('decoupled', **SMALL).id}.json"
    misnamed.write_text(json.dumps({**old_default.settings(), "final_eval_loss": 2.5}))
    taken = parse_case("dp", inner_lr=2e-3, **SMALL)
    (tmp_path / f"{taken.id}.json").write_text(json.dumps({**taken.settings(), "final_eval_loss": 2.0}))
    (tmp_path / "dp-elsewhere.json").write_text(json.dumps({**taken.settings(), "final_eval_loss": 2.1}))
    # and the new default's result, saved under the name it had before the change, waits for
    # the old default's name to be freed
    new_default = parse_case("decoupled", **SMALL)
    waiting = tmp_path / "decoupled-zz-before-the-change.json"
    waiting.write_text(json.dumps({**new_default.settings(), "final_eval_loss": 2.4}))
    moved = Results(tmp_path).reindex()
    assert moved == [(misnamed, tmp_path / f"{old_default.id}.json"), (waiting, misnamed)]
    assert "warmup_steps_45" in old_default.id
    assert Results(tmp_path).get(old_default)["final_eval_loss"] == 2.5
    assert Results(tmp_path).get(new_default)["final_eval_loss"] == 2.4
    assert (tmp_path / "dp-elsewhere.json").exists(), "a name already taken is left alone"


# -- the product's defaults, and what a case's identity holds ---------------------------------------


def test_the_cases_defaults_are_what_ddiloco_run_ships() -> None:
    """``decoupled`` / ``diloco`` / ``dp`` with no settings are the product's defaults, read from the
    learner's, the synchronizer's and the run's own config classes (dp at its tuned lr and warm-up):
    a default changed in one place and not the other fails here."""
    from ddiloco.lab.run_config import DP_TUNED
    from ddiloco.lab.study.case import CONTEXT, DEFAULTS, product_settings
    from ddiloco.lab.study.reference import STALENESS_WINDOW
    from ddiloco.synchronizer.config import SynchronizerConfig
    from ddiloco.training.data import DataConfig

    assert Case() == DEFAULTS["decoupled"]
    for mode, case in DEFAULTS.items():
        product = product_settings(mode)
        drift = {k: (getattr(case, k), product[k]) for k in case.used() if getattr(case, k) != product[k]}
        assert not drift, f"{mode}: the study's default (left) is not the product's (right): {drift}"
    assert (DEFAULTS["dp"].inner_lr, DEFAULTS["dp"].warmup_steps) == (DP_TUNED.lr, DP_TUNED.warmup_steps)
    assert DEFAULTS["decoupled"].inner_lr != DP_TUNED.lr  # dp's own, not the learners'
    assert Case().eval_batches == 0, "the final evaluation reads the whole held-out split"
    assert Case().data_order == getattr(DataConfig(), "order", "contiguous")
    assert SynchronizerConfig().staleness_window == STALENESS_WINDOW and DataConfig().context == CONTEXT


def test_data_order_eval_set_and_python_version_are_part_of_a_cases_identity() -> None:
    base = parse_case("decoupled", **SMALL)
    assert base.python == f"{sys.version_info.major}.{sys.version_info.minor}"
    other_order = "contiguous" if base.data_order == "shuffled" else "shuffled"
    variants = [base.settings() | {"data_order": other_order}, base.settings() | {"eval_batches": 32},
                base.settings() | {"eval_batches": 0}, base.settings() | {"python": "3.12"}]
    cases = [base, *(Case(**v) for v in variants)]
    assert len({c.id for c in cases}) == len(cases)
    for a in cases:
        for b in cases:
            assert a.matches(b.settings()) == (a == b)
    assert f"-data_order_{other_order}" in cases[1].id and "-python_3.12" in cases[4].id
    # dp's id names only what dp uses: the fleet's settings are no part of it
    assert parse_case("dp:overlap=1:codec=fp32:hand_over_momentum=on").id == "dp"
    # a case for another interpreter is refused, not run on this one's corpus
    with pytest.raises(ValueError, match=r"Python 3\.12"):
        run_case(cases[4])


def test_a_result_saved_before_the_identity_was_recorded_is_never_reused(tmp_path, capsys) -> None:
    """The study's own results (docs/results/quality) hold no data order, eval set record or Python
    version. Laid where today's case of the same training settings would be, one is refused, not
    taken for it; reindexing names it by what it was (Python unknown), leaving its content, and
    today's case is then due to run."""
    import pathlib
    import shutil

    legacy = pathlib.Path(__file__).parents[2] / "docs/results/quality/decoupled-inner_lr_0.0045-overlap_1.json"
    saved = json.loads(legacy.read_text())
    assert not {"data_order", "python", "apply_at", "final_eval"} & set(saved) and saved["eval_batches"] == 32
    # today's case of exactly the settings it holds
    same = parse_case("decoupled:inner_lr=4.5e-3:overlap=1:apply_at=tau:hand_over_momentum=on:"
                      "data_order=contiguous:eval_batches=32")
    assert not same.matches(saved)
    for case in (same, parse_case("decoupled")):
        target = tmp_path / f"{case.id}.json"
        shutil.copy(legacy, target)
        with pytest.raises(ResultsError, match="other settings"):
            Results(tmp_path).get(case)
        moved = Results(tmp_path).reindex()
        assert len(moved) == 1 and moved[0][0] == target and "python_unknown" in moved[0][1].name
        assert moved[0][1].read_bytes() == legacy.read_bytes()
        assert Results(tmp_path).get(case) is None
        assert main(["quality", "--cases", "decoupled", "--list", "--out", str(tmp_path)]) == 0
        assert f"{parse_case('decoupled').id} " in capsys.readouterr().out
        moved[0][1].unlink()


def test_the_final_evaluation_reads_the_whole_held_out_split() -> None:
    """A case's final loss is over every window of the eval split once (by default), and the
    result says so; its curve points read the periodic evaluations' 8 spaced batches."""
    from ddiloco.training.data import DataConfig, load_corpus

    eval_tokens = len(load_corpus(DataConfig()).eval)
    windows = (eval_tokens - 1) // 128
    r = run_case(parse_case("dp", steps=2, curve_points=0))
    assert r["final_eval"] == {"split": "all", "batches": -(-windows // 16), "batch_size": 16, "windows": windows,
                               "tokens": windows * 128, "split_tokens": eval_tokens}
    assert r["eval_batches"] == 0 and r["python"] == f"{sys.version_info.major}.{sys.version_info.minor}"
    assert r["python_version"].startswith(r["python"]) and r["data_order"] in ("shuffled", "contiguous")
    assert r["curve_eval"] == {"split": "spaced", "batches": 8}
    assert math.isfinite(r["final_eval_loss"])
