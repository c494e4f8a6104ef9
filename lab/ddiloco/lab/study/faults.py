"""``ddiloco study faults``: the paper's claim under faults, on real local fleets.

The same fault plan (a learner killed and restarted, a learner stopped for 30 s, the
synchronizer killed and restarted), keyed to the wall clock so that it falls at the same second
of every run, is run on the decoupled mode and on the two modes whose learners wait for merges
(``streaming``, ``diloco``), each with ``ddiloco run`` at the default settings. The global model
is evaluated every 20 s outside the learners (``global_eval.jsonl``), so eval loss against wall
time compares the modes at equal wall-clock budgets: the decoupled run's wall time is the budget,
and each mode's loss at it is read off its curve (the last evaluation at or before it).

Each mode's run folder is kept and skipped when its ``summary.json`` exists (or, for a mode stopped
at its wall-clock cap, ``capped.json``), so the study resumes; a folder cut short is run again.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import signal
import subprocess
import sys
from typing import Any

from ddiloco.lab.chaos import FaultPlan
from ddiloco.lab.event_logs import load_jsonl

MODES = ("decoupled", "streaming", "diloco")
CAP_FACTOR = 1.5
"""The modes that wait for merges can stall for a merge timeout after each fault; each is stopped
at 1.5x the decoupled run's wall time (+60 s), well past the budget its loss is read at."""
CAPPED = "capped.json"


def fault_plan() -> FaultPlan:
    return (FaultPlan().kill("learner-1", at_s=40, restart_after_s=10)
            .stop("learner-2", at_s=90, duration_s=30)
            .kill_synchronizer(at_s=150, restart_after_s=5))


def run_modes(out: pathlib.Path, *, steps: int, seed: int, modes: tuple[str, ...] = MODES,
              config: str | None = None) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    plan = out / "plan.json"
    plan.write_text(json.dumps(fault_plan().to_dict(), indent=1))
    for mode in modes:
        folder = out / mode
        if (folder / "summary.json").exists():
            print(f"{mode}: saved ({folder})", flush=True)
            continue
        if (folder / CAPPED).exists():
            print(f"{mode}: stopped at its wall-clock cap earlier ({folder})", flush=True)
            continue
        if folder.exists():  # a run cut short (the study was stopped): start it over
            shutil.rmtree(folder)
        cap = None if mode == "decoupled" else CAP_FACTOR * curve(out / "decoupled")[-1][0] + 60.0
        print(f"{mode}: running ddiloco run --mode {mode} --chaos {plan}"
              + ("" if cap is None else f" (stopped after {cap:.0f} s at most)"), flush=True)
        proc = subprocess.Popen([sys.executable, "-m", "ddiloco.core.cli", "run", "--mode", mode, "--steps",
                                 str(steps), "--seed", str(seed), "--chaos", str(plan), "--out", str(folder),
                                 "--no-progress", *(["--config", config] if config else [])],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            _, err = proc.communicate(timeout=cap)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)  # the run stops every process it started
            try:
                proc.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
            (folder / CAPPED).write_text(json.dumps({"cap_s": cap}) + "\n")
            print(f"{mode}: stopped at its cap ({cap:.0f} s); its curve up to there is what counts", flush=True)
            continue
        if proc.returncode != 0:
            raise RuntimeError(f"ddiloco run --mode {mode} failed ({proc.returncode}): {err[-2000:]}")
    return summarise(out, modes)


def curve(folder: pathlib.Path) -> list[tuple[float, float]]:
    """(seconds since the run's first evaluation, eval loss) of a run's global-model curve."""
    points = load_jsonl(folder / "global_eval.jsonl")
    t0 = points[0]["t"]
    return [(p["t"] - t0, p["loss"]) for p in points]


def summarise(out: pathlib.Path, modes: tuple[str, ...] = MODES) -> dict[str, Any]:
    curves = {m: curve(out / m) for m in modes}
    budget = curves["decoupled"][-1][0]
    rows = {}
    for mode in modes:
        summary = out / mode / "summary.json"
        # a run stopped at its cap has no summary: its curve is what it reached
        s: dict[str, Any] = json.loads(summary.read_text()) if summary.exists() else {
            "final_eval_loss": None, "wall_s": curves[mode][-1][0], "capped": True}
        at_budget = [loss for t, loss in curves[mode] if t <= budget + 1e-6]
        rows[mode] = {"final_eval_loss": s["final_eval_loss"], "wall_s": s["wall_s"], "capped": s.get("capped", False),
                      "loss_at_budget": at_budget[-1] if at_budget else None,
                      "learner_goodput": s.get("learner_goodput"), "global_downtime_s": s.get("global_downtime_s"),
                      "max_merge_gap_s": s.get("max_merge_gap_s"),
                      "faults": [f["kind"] for f in s.get("faults_injected", [])]}
    result = {"budget_s": budget, "modes": rows, "curves": curves}
    (out / "faults.json").write_text(json.dumps(result, indent=1))
    _plot(curves, budget, out / "faults.png")
    print(f"budget (the decoupled run's wall time): {budget:.0f} s")
    print(f"{'mode':>10} {'loss at budget':>15} {'final loss':>11} {'wall s':>7} {'goodput':>8} {'downtime s':>11}")
    for mode, r in rows.items():
        at = "-" if r["loss_at_budget"] is None else f"{r['loss_at_budget']:.4f}"
        final = "(capped)" if r["final_eval_loss"] is None else f"{r['final_eval_loss']:.4f}"
        goodput = "-" if r["learner_goodput"] is None else f"{r['learner_goodput']:.3f}"
        downtime = "-" if r["global_downtime_s"] is None else f"{r['global_downtime_s']:.1f}"
        print(f"{mode:>10} {at:>15} {final:>11} {r['wall_s']:>7.0f} {goodput:>8} {downtime:>11}")
    return result


def _plot(curves: dict[str, list[tuple[float, float]]], budget: float, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for mode, points in curves.items():
        ax.plot([t for t, _ in points], [loss for _, loss in points], "o-", ms=3, label=mode)
    plan = fault_plan()
    for e in plan.events:
        if e.at_s is None:
            continue
        ax.axvline(e.at_s, color="grey", lw=0.6, ls=":")
        ax.annotate(e.kind.replace("_", " "), (e.at_s, 0.98), xycoords=("data", "axes fraction"), fontsize=7,
                    rotation=90, va="top")
    ax.axvline(budget, color="black", lw=0.8, ls="--", label="decoupled's wall time (the budget)")
    ax.set_xlabel("wall time since training started (s)")
    ax.set_ylabel("eval loss of the global model")
    ax.set_ylim(top=3.0)
    ax.set_title("Under the same faults: a kill, a 30 s stop, a synchronizer kill")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
