"""``ddiloco bench memory`` runs end to end (a real synchronizer process on loopback, two synthetic
learners over the Sync stream, some of their contributions stale), reports the synchronizer's
resident bytes per parameter against the 12-byte goal, and stops the synchronizer; bad options
are refused before anything starts."""

from __future__ import annotations

import json
import os
import sys

import pytest

from ddiloco.lab.bench import memory as memory_bench
from tests.procs import run_tree


def test_small_run_reports_bytes_per_param(tmp_path):
    out, work = tmp_path / "memory.json", tmp_path / "work"
    proc = run_tree([sys.executable, "-m", "ddiloco.core.cli", "bench", "memory", "--params", "1500000",
                     "--fragments", "4", "--rounds", "3", "--settle-s", "0.3", "--json", "--out", str(out),
                     "--workdir", str(work)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout)
    assert r == json.loads(out.read_text())
    assert (r["params"], r["fragments"], r["learners"], r["rounds"]) == (1_500_000, 4, 2, 3)
    assert r["codec"] == "bf16_zstd" and r["staleness_window"] == 4
    mem = r["memory_bytes"]
    for phase in ("idle", "genesis", "steady", "peak"):
        assert mem[phase]["VmRSS"] > 0, phase
    assert mem["peak"]["VmHWM"] >= mem["steady"]["VmRSS"] >= mem["idle"]["VmRSS"]
    # fp32 parameters and momentum alone are 8 bytes per parameter
    assert r["bytes_per_param_steady"] > 8
    assert r["bytes_per_param_peak"] >= r["bytes_per_param_steady"]
    assert r["bytes_per_param_steady"] == pytest.approx((mem["steady"]["VmRSS"] - mem["idle"]["VmRSS"]) / 1_500_000)
    assert r["goal_bytes_per_param"] == 12 and r["meets_goal"] == (r["bytes_per_param_steady"] <= 12)
    c = r["contributions"]
    assert c["contributions"] == 2 * 4 * 3 and c["sent_stale"] > 0
    assert r["merges"] > 0 and c["merged"] > 0 and min(r["versions"].values()) >= 1
    assert len(r["rss_by_round_mib"]) == 3
    assert (work / "logs" / "synchronizer.log").exists() and (work / "state").is_dir()
    with pytest.raises(ProcessLookupError):  # the synchronizer was stopped (and reaped)
        os.kill(r["synchronizer_pid"], 0)


def test_synthetic_layout_has_exactly_the_parameters():
    for params, fragments in ((10_000, 1), (1_500_000, 4), (20_000_003, 24), (85_000_000, 24)):
        layout = memory_bench.synthetic_layout(params, fragments)
        assert sum(f.numel for f in layout) == params and len(layout.fragments) == fragments
        assert all(f.numel > 0 for f in layout)


def test_bad_options_are_refused_before_anything_starts(tmp_path, capsys):
    work, out = tmp_path / "work", tmp_path / "memory.json"
    for args, says in ((["--params", "0"], "--params must be"), (["--params", "-5"], "--params must be"),
                       (["--learners", "0"], "--learners >= 1"), (["--rounds", "0"], "--rounds >= 1"),
                       (["--staleness-window", "-1"], "--staleness-window >= 0"),
                       (["--codec", "gzip"], "--codec must be one of"), (["--fragments", "0"], "num_fragments"),
                       (["--params", "10000", "--fragments", "5000"], "too few")):
        with pytest.raises(SystemExit) as exit_info:
            memory_bench.main([*args, "--workdir", str(work), "--out", str(out)])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and "ddiloco bench memory: error:" in err, (args, err)
        assert says in err, (args, err)
        assert not work.exists() and not out.exists(), args  # no synchronizer, no results
