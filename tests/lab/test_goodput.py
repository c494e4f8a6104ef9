"""Goodput, downtime, merge gaps and contribution accounting on hand-built event logs.

Every expected number is computed by hand from the definitions in docs/goodput.md.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from ddiloco.lab.event_logs import load_jsonl, load_run_dir
from ddiloco.lab.goodput import KILLED_IN_FLIGHT, fleet_summary, learner_goodput

Event = dict[str, Any]


def start(t: float = 0.0, lid: str = "a", inc: int = 0, sizes: tuple[int, ...] = (1,)) -> Event:
    return {"event": "start", "t": t, "learner_id": lid, "incarnation": inc,
            "num_fragments": len(sizes), "fragment_sizes": list(sizes)}


def steps(n: int, *, t0: float = 0.0, dt: float = 1.0, step_s: float = 1.0, first: int = 0,
          blocked: dict[int, float] | None = None) -> list[Event]:
    """n steps; step i ends at t0 + (i + 1) * dt after computing step_s seconds."""
    blocked = blocked or {}
    return [{"event": "step", "t": t0 + (i + 1) * dt, "step": first + i, "step_s": step_s,
             "blocked_s": blocked.get(first + i, 0.0), "loss": 5.0 - 0.1 * i, "tokens": 100 * (i + 1)}
            for i in range(n)]


def send(t: float, fragment: int, seq: int, lo: int, hi: int, base: int = 0) -> Event:
    return {"event": "send", "t": t, "step": hi, "fragment": fragment, "sequence": seq,
            "base_version": base, "tokens": 100 * (hi - lo + 1), "steps": hi - lo + 1,
            "from_step": lo, "to_step": hi}


def result(t: float, fragment: int, seq: int, outcome: str, reason: str | None = None) -> Event:
    return {"event": "result", "t": t, "sequence": seq, "fragment": fragment, "outcome": outcome,
            "version": 1, "reason": reason, "weight": 1.0, "staleness": 0}


def dropped(t: float, fragment: int, seq: int, reason: str) -> Event:
    return {"event": "dropped", "t": t, "sequence": seq, "fragment": fragment, "reason": reason}


def end(t: float, step: int) -> Event:
    return {"event": "end", "t": t, "step": step, "tokens": 100 * (step + 1)}


def merge(t: float, fragment: int = 0) -> Event:
    return {"event": "merge", "t": t, "fragment": fragment, "version": 1, "quorum": 1,
            "learners": ["a"], "grace_s": 0.0, "sync_s": 0.01}


def all_merged(n: int, *, lid: str = "a", t0: float = 0.0, dt: float = 1.0, step_s: float = 1.0,
               sizes: tuple[int, ...] = (1,)) -> list[Event]:
    """A learner whose every step of every fragment is merged; it ends at its last step."""
    log = [start(t0, lid, sizes=sizes), *steps(n, t0=t0, dt=dt, step_s=step_s)]
    log += [send(t0 + n * dt, p, p, 0, n - 1) for p in range(len(sizes))]
    log += [result(t0 + n * dt, p, p, "merged") for p in range(len(sizes))]
    return [*log, end(t0 + n * dt, n - 1)]


# ------------------------------------------------------------------------------ learner goodput


def test_full_coverage_goodput_equals_compute_share() -> None:
    # 10 steps of 1.0 s compute, one every 1.25 s; end at 13.0 -> wall 13.0, compute 10.0.
    log = [start(0.0), *steps(10, dt=1.25), send(6.3, 0, 0, 0, 4), send(12.6, 0, 1, 5, 9),
           result(7.0, 0, 0, "merged"), result(12.9, 0, 1, "merged"), end(13.0, 9)]
    g = learner_goodput(log)
    assert g["wall_s"] == pytest.approx(13.0)
    assert g["compute_s"] == pytest.approx(10.0)
    assert g["good_s"] == pytest.approx(10.0)
    assert g["goodput"] == pytest.approx(10.0 / 13.0)
    assert g["goodput"] == pytest.approx(g["compute_share"])
    assert g["contributions"]["merged"] == 2 and g["contributions"]["unaccounted"] == 0


def test_rejected_contribution_window_is_not_counted() -> None:
    log = [start(0.0), *steps(10, dt=1.25), send(6.3, 0, 0, 0, 4), send(12.6, 0, 1, 5, 9),
           result(7.0, 0, 0, "merged"), result(12.9, 0, 1, "rejected", "stale"), end(13.0, 9)]
    g = learner_goodput(log)
    assert g["good_s"] == pytest.approx(5.0)
    assert g["goodput"] == pytest.approx(5.0 / 13.0)
    assert g["compute_share"] == pytest.approx(10.0 / 13.0)
    c = g["contributions"]
    assert (c["sent"], c["merged"], c["rejected"]) == (2, 1, 1)
    assert c["rejected_by_reason"] == {"stale": 1}


def test_superseded_window_covered_by_newer_merged_contribution() -> None:
    # seq 0 (steps 0..3) is replaced at the synchronizer by seq 1 (steps 0..5) from the same base.
    log = [start(0.0), *steps(10), send(4.0, 0, 0, 0, 3), send(6.0, 0, 1, 0, 5),
           send(10.0, 0, 2, 6, 9), result(6.5, 0, 0, "superseded"), result(7.0, 0, 1, "merged"),
           result(10.5, 0, 2, "rejected", "non_finite"), end(11.0, 9)]
    g = learner_goodput(log)
    assert g["good_s"] == pytest.approx(6.0)
    assert g["wall_s"] == pytest.approx(11.0)
    c = g["contributions"]
    assert (c["merged"], c["superseded"], c["rejected"], c["unaccounted"]) == (1, 1, 1, 0)


def test_superseded_alone_earns_nothing() -> None:
    log = [start(0.0), *steps(4), send(4.0, 0, 0, 0, 3), result(4.5, 0, 0, "superseded"), end(5.0, 3)]
    assert learner_goodput(log)["good_s"] == 0.0


def test_fragment_size_weighting() -> None:
    # Sizes 3:1. Fragment 0 merged for steps 0..9, fragment 1 merged for 0..4, rejected for 5..9:
    # steps 0..4 are fully good (5 x 1.0), steps 5..9 are 3/4 good (5 x 0.75) -> 8.75 s.
    log = [start(0.0, sizes=(3, 1)), *steps(10), send(10.0, 0, 0, 0, 9), send(5.0, 1, 1, 0, 4),
           send(10.0, 1, 2, 5, 9), result(10.5, 0, 0, "merged"), result(5.5, 1, 1, "merged"),
           result(10.5, 1, 2, "rejected", "bad_shape"), end(10.0, 9)]
    g = learner_goodput(log)
    assert g["good_s"] == pytest.approx(8.75)
    assert g["goodput"] == pytest.approx(0.875)
    # tokens: 100 per step; good tokens weigh the same way.
    assert g["good_tokens"] == pytest.approx(875.0)


def test_results_match_by_fragment_and_sequence() -> None:
    # Sequence numbers repeat across fragments: the fragment picks the right send.
    log = [start(0.0, sizes=(1, 1)), *steps(4), send(4.0, 0, 7, 0, 3), send(4.0, 1, 7, 0, 3),
           result(4.5, 1, 7, "merged"), result(4.5, 0, 7, "rejected", "stale"), end(4.0, 3)]
    g = learner_goodput(log)
    assert g["good_s"] == pytest.approx(2.0)
    assert g["contributions"]["rejected_by_reason"] == {"stale": 1}


def test_killed_incarnation_ends_at_last_event_and_restart_adds_wall() -> None:
    # Incarnation 0: start 0, steps end 1..5, killed (no end) -> wall 5.
    # Incarnation 1: start 20, steps end 21..23, end 23.5 -> wall 3.5.
    log = [start(0.0), *steps(5), send(5.0, 0, 0, 0, 4), result(5.0, 0, 0, "merged"),
           start(20.0, inc=1), *steps(3, t0=20.0), send(23.0, 0, 0, 0, 2),
           result(23.2, 0, 0, "merged"), end(23.5, 2)]
    g = learner_goodput(log)
    a, b = g["incarnations"]
    assert (a["incarnation"], a["killed"], a["wall_s"]) == (0, True, pytest.approx(5.0))
    assert (b["incarnation"], b["killed"], b["wall_s"]) == (1, False, pytest.approx(3.5))
    assert g["restarts"] == 1
    assert g["wall_s"] == pytest.approx(8.5)
    assert g["good_s"] == pytest.approx(8.0)
    assert g["tokens"] == pytest.approx(500 + 300)


def test_events_before_start_belong_to_their_own_incarnation() -> None:
    # A process logs "connect" before "start"; a restart does the same with its new incarnation.
    def connect(t: float, inc: int) -> Event:
        return {"event": "connect", "t": t, "learner_id": "a", "incarnation": inc}

    log = [connect(-0.1, 7), start(0.0, inc=7), *steps(5), send(5.0, 0, 0, 0, 4), result(5.0, 0, 0, "merged"),
           connect(19.9, 9), start(20.0, inc=9), *steps(3, t0=20.0), send(23.0, 0, 0, 0, 2),
           result(23.2, 0, 0, "merged"), end(23.5, 2)]
    g = learner_goodput(log)
    assert [(i["incarnation"], i["killed"]) for i in g["incarnations"]] == [(7, True), (9, False)]
    assert g["restarts"] == 1
    assert g["wall_s"] == pytest.approx(8.5)


def test_merged_result_of_one_incarnation_does_not_credit_another() -> None:
    # Both incarnations send sequence 0 for steps 0..2; only the second's is merged.
    log = [start(0.0), *steps(3), send(3.0, 0, 0, 0, 2),
           start(10.0, inc=1), *steps(3, t0=10.0), send(13.0, 0, 0, 0, 2),
           result(13.5, 0, 0, "merged"), end(14.0, 2)]
    a, b = learner_goodput(log)["incarnations"]
    assert a["good_s"] == 0.0 and a["contributions"]["unaccounted"] == 1
    assert b["good_s"] == pytest.approx(3.0)


# ---------------------------------------------------------------------------------- fleet-wide


def test_fleet_goodput_is_sum_good_over_sum_wall() -> None:
    a = all_merged(10, lid="a")  # wall 10, good 10
    b = [start(0.0, "b"), *steps(10, dt=2.0), send(20.0, 0, 0, 0, 9),
         result(20.0, 0, 0, "rejected", "stale"), end(20.0, 9)]  # wall 20, good 0, compute 10
    s = fleet_summary({"a": a, "b": b}, [])
    assert s["learner_goodput"] == pytest.approx(10.0 / 30.0)
    assert s["compute_share"] == pytest.approx(20.0 / 30.0)
    assert s["per_learner"]["a"]["goodput"] == pytest.approx(1.0)
    assert s["per_learner"]["b"]["goodput"] == 0.0
    assert s["rejected_contributions"] == 1


def test_downtime_equals_a_gap_where_all_learners_stall() -> None:
    # Both learners step over [0, 10], nobody steps in [10, 15], both step again over [15, 20].
    def learner(lid: str) -> list[Event]:
        return [start(0.0, lid), *steps(10), *steps(5, t0=15.0, first=10, blocked={10: 5.0}),
                send(20.0, 0, 0, 0, 14), result(20.0, 0, 0, "merged"), end(20.0, 14)]

    s = fleet_summary({"a": learner("a"), "b": learner("b")}, [])
    assert s["training_window"] == [0.0, 20.0]
    assert s["global_downtime_s"] == pytest.approx(5.0)
    assert s["downtime_intervals"] == [[10.0, 15.0]]
    assert s["learner_goodput"] == pytest.approx(15.0 / 20.0)
    assert s["blocked_share"] == pytest.approx(5.0 / 20.0)


def _alternating(lid: str, t0: float, outcome: str) -> list[Event]:
    # Steps of 1 s every 2 s: this learner alone leaves half of [0, 10] idle.
    return [start(0.0, lid), *steps(5, t0=t0, dt=2.0), send(10.0, 0, 0, 0, 4),
            result(10.0, 0, 0, outcome, None if outcome == "merged" else "stale"), end(10.0, 4)]


def test_downtime_zero_when_learners_overlap() -> None:
    # a computes over [1,2], [3,4], ..., [9,10]; b over [0,1], [2,3], ..., [8,9]: together all of [0,10].
    a = _alternating("a", t0=0.0, outcome="merged")
    b = _alternating("b", t0=-1.0, outcome="merged")
    s = fleet_summary({"a": a, "b": b}, [])
    assert s["training_window"] == [0.0, 10.0]
    assert s["global_downtime_s"] == pytest.approx(0.0)
    assert s["downtime_intervals"] == []


def test_steps_that_never_reach_the_model_do_not_cover_downtime() -> None:
    a = _alternating("a", t0=0.0, outcome="merged")
    b = _alternating("b", t0=-1.0, outcome="rejected")
    s = fleet_summary({"a": a, "b": b}, [])
    assert s["global_downtime_s"] == pytest.approx(5.0)
    assert len(s["downtime_intervals"]) == 5


def test_a_refused_learner_training_on_after_the_others_adds_no_downtime() -> None:
    # a's steps over [0, 10] all reach the model; b's never do, and b trains on until 12.
    a = all_merged(10)
    b = [start(0.0, "b"), *steps(12), send(12.0, 0, 0, 0, 11), result(12.0, 0, 0, "rejected", "weight_outlier"),
         end(12.0, 11)]
    s = fleet_summary({"a": a, "b": b}, [])
    assert s["training_window"] == [0.0, 10.0]
    assert s["global_downtime_s"] == pytest.approx(0.0)


def test_merge_gap_and_restart_to_first_merge() -> None:
    a = all_merged(20)  # steps over [0, 20]
    log = [{"event": "sync_start", "t": 0.0, "synchronizer_id": "s0"},
           merge(2.0), merge(4.0, 1), merge(6.0),
           {"event": "sync_stop", "t": 7.0},
           {"event": "sync_start", "t": 10.0, "synchronizer_id": "s0"},
           merge(12.5, 1), merge(14.0), merge(16.0), merge(18.0),
           {"event": "sync_stop", "t": 19.0},
           {"event": "sync_start", "t": 19.5, "synchronizer_id": "s0"}]
    s = fleet_summary({"a": a}, log)
    assert s["merges"] == 7
    assert s["merges_per_fragment"] == {"0": 5, "1": 2}
    assert s["max_merge_gap_s"] == pytest.approx(6.5)
    assert s["max_merge_gap_at"] == [6.0, 12.5]
    assert s["restart_to_first_merge_s"] == [pytest.approx(2.5), None]
    first = s["sync_restarts"][0]
    assert first["down_s"] == pytest.approx(3.0)
    assert first["stop_to_first_merge_s"] == pytest.approx(5.5)


def test_merge_gap_counts_window_start_to_first_merge() -> None:
    s = fleet_summary({"a": all_merged(8)}, [merge(5.0), merge(6.0), merge(7.5)])
    assert s["max_merge_gap_s"] == pytest.approx(5.0)
    assert s["max_merge_gap_at"] == [0.0, 5.0]
    assert s["restart_to_first_merge_s"] == []


def test_merge_gap_without_merges_is_the_whole_window() -> None:
    s = fleet_summary({"a": all_merged(8)}, [])
    assert s["max_merge_gap_s"] == pytest.approx(8.0)


def test_unaccounted_contributions_are_listed() -> None:
    a = [start(0.0), *steps(8), send(2.0, 0, 0, 0, 1), send(4.0, 0, 1, 2, 3), send(6.0, 0, 2, 4, 5),
         send(8.0, 0, 3, 6, 7), result(2.5, 0, 0, "merged"), dropped(4.1, 0, 1, "replaced"),
         result(8.5, 0, 3, "rejected", "bad_shape"),
         start(20.0, inc=1), *steps(2, t0=20.0), send(22.0, 0, 0, 0, 1), end(22.5, 1)]
    b = all_merged(3, lid="b")
    s = fleet_summary({"a": a, "b": b}, [])
    ca = s["contributions"]["per_learner"]["a"]
    # incarnation 0 was killed (no end): its unanswered sequence 2 was lost in flight with it
    assert (ca["sent"], ca["merged"], ca["rejected"], ca["dropped"], ca["unaccounted"]) == (5, 1, 1, 2, 1)
    assert ca["dropped_by_reason"] == {"replaced": 1, KILLED_IN_FLIGHT: 1}
    assert ca["sent"] == ca["merged"] + ca["rejected"] + ca["superseded"] + ca["dropped"] + ca["unaccounted"]
    assert [(u["incarnation"], u["sequence"]) for u in ca["unaccounted_sequences"]] == [(1, 0)]
    totals = s["contributions"]["totals"]
    assert (totals["sent"], totals["merged"], totals["unaccounted"]) == (6, 2, 1)
    assert [(u["learner"], u["incarnation"], u["sequence"]) for u in totals["unaccounted_sequences"]] == [
        ("a", 1, 0)]
    # the synchronizer's log settles what the killed process never heard back about
    merge_log = [{"event": "merge", "t": 7.0, "fragment": 0, "version": 3, "contributions": [["a", 0, 2]]},
                 {"event": "reject", "t": 23.0, "fragment": 0, "learner": "a", "incarnation": 1, "sequence": 0,
                  "reason": "stale"}]
    ca = fleet_summary({"a": a, "b": b}, merge_log)["contributions"]["per_learner"]["a"]
    assert (ca["merged"], ca["rejected"], ca["dropped"], ca["unaccounted"]) == (2, 2, 1, 0)
    assert ca["rejected_by_reason"] == {"bad_shape": 1, "stale": 1}


def test_result_wins_over_drop_and_merged_wins_over_later_results() -> None:
    log = [start(0.0), *steps(2), send(2.0, 0, 0, 0, 1), dropped(2.1, 0, 0, "sync_restart"),
           result(2.2, 0, 0, "merged"), result(2.3, 0, 0, "superseded"), end(3.0, 1)]
    c = learner_goodput(log)["contributions"]
    assert (c["merged"], c["dropped"], c["superseded"]) == (1, 0, 0)


def _long_log(n: int, frags: int = 24) -> list[Event]:
    log: list[Event] = [start(0.0, sizes=tuple(range(1, frags + 1))), *steps(n, dt=0.01, step_s=0.008)]
    seq = 0
    for p in range(frags):  # every fragment falls due every 24 steps, each send covers its last 24 steps
        for hi in range(p, n + frags, frags):
            log.append(send(hi * 0.01, p, seq, hi - frags + 1, hi))
            log.append(result(hi * 0.01 + 0.02, p, seq, "merged"))
            seq += 1
    log.append(end(n * 0.01, n - 1))
    return log


def test_the_accounting_grows_linearly_with_the_log() -> None:
    """Tens of thousands of steps are accounted in time proportional to the log (a regression to a
    quadratic scan once made a long run's summary take minutes). Ten times the log must take far
    less than a hundred times as long, whatever the machine's speed: the bound is relative."""
    timings = {}
    for n in (4_000, 40_000):
        log = _long_log(n)
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            s = fleet_summary({"a": log}, [merge(1.0)])
            best = min(best, time.perf_counter() - t0)
        timings[n] = best
        assert s["learner_goodput"] == pytest.approx(s["compute_share"])
        assert s["compute_share"] == pytest.approx(0.8)
    assert timings[40_000] < 30 * timings[4_000], timings


# ------------------------------------------------------------------------------------------- I/O


def _write(path: Path, events: list[Event], tail: str = "") -> None:
    path.write_text("".join(json.dumps(e) + "\n" for e in events) + tail)


def test_truncated_last_line_is_tolerated(tmp_path: Path) -> None:
    path = tmp_path / "learner-a.jsonl"
    _write(path, [start(0.0), *steps(2)], tail='{"event": "step", "t": 3.0, "st')
    events = load_jsonl(path)
    assert [e["event"] for e in events] == ["start", "step", "step"]


def test_spliced_record_after_restart_is_recovered(tmp_path: Path) -> None:
    path = tmp_path / "learner-a.jsonl"
    text = json.dumps(start(0.0)) + "\n" + '{"event": "step", "t": 1.0, "lo' + json.dumps(start(5.0, inc=1))
    path.write_text(text + "\n" + json.dumps(end(6.0, 0)) + "\n")
    events = load_jsonl(path)
    assert [(e["event"], e.get("incarnation")) for e in events] == [
        ("start", 0), ("start", 1), ("end", None)]


def test_garbage_in_the_middle_raises(tmp_path: Path) -> None:
    path = tmp_path / "learner-a.jsonl"
    path.write_text(json.dumps(start(0.0)) + "\nnot json\n" + json.dumps(end(1.0, 0)) + "\n")
    with pytest.raises(ValueError, match=r"learner-a.jsonl:2"):
        load_jsonl(path)


def test_load_run_dir_sorts_logs_by_content(tmp_path: Path) -> None:
    (tmp_path / "learners").mkdir()
    _write(tmp_path / "learners" / "0.jsonl", all_merged(3, lid="l0"))
    _write(tmp_path / "learners" / "1.jsonl", [*steps(2)])
    _write(tmp_path / "synchronizer.jsonl", [merge(3.0), {"event": "sync_start", "t": 0.0}])
    _write(tmp_path / "other.jsonl", [{"event": "metric", "t": 0.0}])
    nested = tmp_path / "baseline"  # another run's folder inside this one (ddiloco run --baseline auto)
    (nested / "learners").mkdir(parents=True)
    (nested / "config.yaml").write_text("run: {}\n")
    _write(nested / "learners" / "0.jsonl", all_merged(3, lid="l0"))
    _write(nested / "synchronizer.jsonl", [merge(9.0)])
    logs = load_run_dir(tmp_path)
    assert sorted(logs.learners) == ["1", "l0"] and len(logs.learners["l0"]) == len(all_merged(3, lid="l0"))
    assert [e["event"] for e in logs.merges] == ["sync_start", "merge"]
    assert len(load_run_dir(nested).merges) == 1


def test_short_loop_gaps_of_one_learner_are_progress_but_stalls_are_not() -> None:
    from ddiloco.lab.goodput import fleet_summary

    def log(gaps: list[float]) -> list[dict]:
        events = [{"event": "start", "t": 0.0, "learner_id": "a", "incarnation": 1, "num_fragments": 1,
                   "fragment_sizes": [10]}]
        t = 0.0
        for step, gap in enumerate(gaps, start=1):
            t += gap + 1.0
            events.append({"event": "step", "t": t, "learner_id": "a", "incarnation": 1, "step": step,
                           "step_s": 1.0, "blocked_s": 0.0, "loss": 1.0, "tokens": step})
        events += [{"event": "send", "t": t, "learner_id": "a", "incarnation": 1, "step": len(gaps), "fragment": 0,
                    "sequence": 1, "base_version": 0, "tokens": 1, "steps": 1, "from_step": 1, "to_step": len(gaps)},
                   {"event": "result", "t": t, "learner_id": "a", "incarnation": 1, "sequence": 1, "fragment": 0,
                    "outcome": "merged", "version": 1},
                   {"event": "end", "t": t, "learner_id": "a", "incarnation": 1, "step": len(gaps)}]
        return events

    assert fleet_summary({"a": log([0.0, 0.1, 0.2, 0.1])}, [])["global_downtime_s"] == 0.0
    # a 3 s stall between steps 2 and 3 is real downtime
    assert abs(fleet_summary({"a": log([0.0, 0.1, 3.0, 0.1])}, [])["global_downtime_s"] - 3.0) < 1e-9


def test_round_summary_reports_participation_staleness_and_the_longest_wait() -> None:
    from ddiloco.lab.goodput import round_summary

    log = [{"event": "sync_start", "t": 0.0},
           {"event": "merge", "t": 1.0, "fragment": 0, "quorum": 3, "staleness": [0, 0, 1], "wait_s": 0.4},
           {"event": "merge", "t": 2.0, "fragment": 0, "quorum": 1, "staleness": [0], "wait_s": 0.1},
           {"event": "merge", "t": 3.0, "fragment": 1, "quorum": 2, "staleness": [0, 0], "wait_s": 0.9}]
    s = round_summary(log)
    assert (s["merges"], s["participation_mean"], s["participation_min"]) == (3, 2.0, 1)
    assert s["stale_share"] == pytest.approx(1 / 6) and s["max_merge_wait_s"] == 0.9
    assert s["per_fragment"]["0"]["max_merge_wait_s"] == 0.4 and s["per_fragment"]["1"]["participation_min"] == 2
    assert round_summary([])["participation_mean"] is None
