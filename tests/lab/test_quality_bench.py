"""``ddiloco bench quality``: the single-process reference runs, at a smoke size."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from ddiloco.lab.bench.quality import Case, run_case


def test_cases_run_and_are_saved(tmp_path) -> None:
    out = tmp_path / "quality.json"
    proc = subprocess.run([sys.executable, "-m", "ddiloco.core.cli", "bench", "quality", "--steps", "6", "--threads", "1",
                           "--cases", "dp:eval_batches=2,diloco:sync_every=2:eval_batches=2,"
                                      "diloco:sync_every=2:late=1:anchor=delta:eval_batches=2",
                           "--out", str(out)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(out.read_text())["results"]
    assert [(r["mode"], r["late"], r["anchor"]) for r in results] == [
        ("dp", 0, "point"), ("diloco", 0, "point"), ("diloco", 1, "delta")]
    assert all(math.isfinite(r["final_eval_loss"]) and r["final_eval_loss"] < math.log(256) + 0.5 for r in results)
    assert results[0]["vs_dp"] == 0.0
    # 6 steps, a merge every 2: the late replica's rows join the merges at steps 4 and 6 (its last
    # round arrives together with its held one, so it is summed, not a separate row)
    assert results[2]["stale_rows"] == 1 and results[1]["stale_rows"] == 0


def test_late_anchor_changes_the_result_and_no_late_is_deterministic() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        base = Case(steps=6, sync_every=2, eval_batches=2)
        a, b = run_case(base), run_case(base)
        point = run_case(Case(steps=6, sync_every=2, eval_batches=2, late=1, anchor="point"))
        delta = run_case(Case(steps=6, sync_every=2, eval_batches=2, late=1, anchor="delta"))
    finally:
        torch.set_num_threads(threads)
    assert a["final_eval_loss"] == b["final_eval_loss"]
    assert point["final_eval_loss"] != delta["final_eval_loss"] != a["final_eval_loss"]


@pytest.mark.parametrize("spec,message", [("teleport", "mode must be one of"), ("diloco:late=3", "late must be"),
                                          ("diloco:speed=2", "unknown case setting"),
                                          ("diloco:anchor=nowhere", "anchor must be")])
def test_bad_cases_are_refused(spec, message) -> None:
    proc = subprocess.run([sys.executable, "-m", "ddiloco.core.cli", "bench", "quality", "--cases", spec],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
