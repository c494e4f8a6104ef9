"""``ddiloco bench torchft``: bad options are refused before anything starts (exit 2), a missing
torchft says how to install the extra, results and ratios come out right from given numbers, and
torchft is never imported by ddiloco itself. The one test that runs torchft's replicas needs torchft
(the ``dev`` extra installs it) and is skipped only where it is not installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from ddiloco.core import events as schema
from ddiloco.lab.bench import cli
from ddiloco.lab.bench import torchft as tft
from tests.procs import run_tree

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("args, says", [
    (["--scenarios", "bogus"], "--scenarios"),
    (["--systems", "torchft,other"], "--systems"),
    (["--steps", "0"], ">= 1"),
    (["--fragments", "3", "--sync-every", "16"], "multiple of --fragments"),
    (["--overlap", "4", "--fragments", "4", "--sync-every", "16"], "fragment_sync_delay"),
    (["--d-model", "30", "--n-head", "4"], "multiple of --n-head"),
    (["--outage-s", "10", "--observe-s", "5"], "--observe-s > --outage-s"),
    (["--fault-step", "50", "--run-steps", "50"], "--fault-step"),
])
def test_bad_options_exit_2_with_a_clear_message_before_anything_starts(tmp_path, capsys, args, says):
    work, out = tmp_path / "work", tmp_path / "r.json"
    with pytest.raises(SystemExit) as info:
        tft.main([*args, "--workdir", str(work), "--out", str(out)])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "ddiloco bench torchft: error:" in err and says in err, err
    assert not work.exists() and not out.exists()


def test_missing_torchft_names_the_extra(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchft", None)  # import torchft now raises ImportError
    with pytest.raises(tft.BenchError, match=r"pip install -e 'lab\[peers\]'"):
        tft.require_torchft()
    out = tmp_path / "r.json"
    assert tft.main(["--systems", "torchft", "--out", str(out)]) == 1
    assert "lab[peers]" in capsys.readouterr().err and not out.exists()


def test_torchft_is_imported_only_by_the_benchmark_and_is_an_optional_extra():
    code = "import sys, ddiloco.lab.bench.torchft, ddiloco.lab.bench.cli; assert 'torchft' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert cli.BENCHMARKS["torchft"] == "ddiloco.lab.bench.torchft"
    project = tomllib.loads((ROOT / "lab" / "pyproject.toml").read_text())["project"]
    assert project["optional-dependencies"]["peers"] == ["torchft==0.2.0"]
    assert not any(d.startswith("torchft") for d in project["dependencies"])


def test_overhead_ratios_and_gaps_from_given_numbers():
    o = tft.overhead(0.050, 0.055)
    assert o["overhead"] == pytest.approx(0.10) and o["sync_s_per_step"] == pytest.approx(0.005)
    with pytest.raises(ValueError):
        tft.overhead(0.0, 0.1)
    torchft = {"overhead": tft.overhead(0.05, 0.06), "restart": {"kill_to_contribution_s": 6.0, "survivor_stall_s": 4.8},
               "outage": {"max_stall_s": 60.0}}
    ddiloco = {"overhead": tft.overhead(0.05, 0.0505), "restart": {"kill_to_contribution_s": 3.0,
                                                                   "survivor_stall_s": 0.0},
               "outage": {"max_stall_s": 0.2}}
    r = tft.ratios(torchft, ddiloco)
    assert r["overhead.overhead"] == pytest.approx(0.2 / 0.01)
    assert r["overhead.sync_s_per_step"] == pytest.approx(0.01 / 0.0005)
    assert r["restart.kill_to_contribution_s"] == pytest.approx(2.0)
    assert r["restart.survivor_stall_s"] is None  # divided by 0: no ratio, not infinity
    assert tft.ratio(0.2, -0.01) is None  # an overhead lost in the noise: no ratio either
    assert r["outage.max_stall_s"] == pytest.approx(300.0)
    assert tft.ratios({"overhead": torchft["overhead"]}, {}) == {"overhead.overhead": None,
                                                                  "overhead.sync_s_per_step": None}
    g = tft.step_gaps([0.0, 0.1, 0.2, 5.2, 5.3, 5.4], start=1.0)
    assert g["max_gap_s"] == pytest.approx(5.0) and g["median_gap_s"] == pytest.approx(0.1)
    assert g["stall_s"] == pytest.approx(4.9)
    assert tft.step_gaps([1.0]) == {"max_gap_s": 0.0, "median_gap_s": 0.0, "stall_s": 0.0}
    lines = tft.table({"torchft": torchft, "ddiloco": ddiloco, "ratios": r})
    assert lines[0].split() == ["figure", "torchft", "ddiloco", "ratio"]
    row = next(line for line in lines if line.startswith("restart.kill_to_contribution_s"))
    assert row.split()[1:] == ["6s", "3s", "2"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]


def test_tiny_torchft_overhead_run_leaves_nothing_running(tmp_path):
    """Needs torchft 0.2.0 (the lab's ``peers`` extra, also in the ``dev`` extra that ``make test``
    installs); skipped only in an environment without it."""
    pytest.importorskip("torchft", exc_type=ImportError)
    out, work = tmp_path / "r.json", tmp_path / "work"
    proc = run_tree([sys.executable, "-m", "ddiloco.core.cli", "bench", "torchft", "--json", "--out", str(out),
                     "--workdir", str(work), "--scenarios", "overhead", "--systems", "torchft",
                     "--d-model", "32", "--n-layer", "2", "--context", "32", "--batch-size", "4",
                     "--steps", "8", "--warmup", "2", "--repeats", "1", "--max-s", "60"],
                    capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result == json.loads(proc.stdout) and result["errors"] == {}
    o = result["torchft"]["overhead"]
    assert o["off_s_per_step"] > 0 and o["on_s_per_step"] > 0
    for replica in o["per_replica"].values():
        assert replica["syncs"] == 2 and replica["commits"] == 2 and replica["min_participants"] == 2
    pids = [e["pid"] for f in (work / "torchft" / "overhead").glob("replica-*.jsonl")
            for e in tft.replica_events(f) if e["event"] == schema.READY]
    assert len(pids) == 2 and not any(_alive(p) for p in pids)


def test_waiting_on_a_job_whose_lighthouse_exited_fails_at_once(tmp_path):
    """A real process stands in the lighthouse's place and exits: waiting for replicas that can
    then never sync ends with a clear error, not after the whole timeout."""
    job = tft.TorchftJob(tft.build_parser().parse_args([]), tmp_path, "overhead")
    try:
        job.procs.start("lighthouse", [sys.executable, "-c", "raise SystemExit(3)"])
        job.procs.procs["lighthouse"].wait(timeout=30)
        with pytest.raises(tft.BenchError, match=r"lighthouse exited \(code 3\)"):
            job.wait_for("both replicas ready", lambda: False, timeout_s=60)
    finally:
        job.procs.stop_all()
