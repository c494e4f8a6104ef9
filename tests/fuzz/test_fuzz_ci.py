"""The decode fuzz target runs clean for a fixed budget in CI, and its seeds behave as documented.

``fuzz_decode.py`` runs in a subprocess (atheris's libFuzzer owns the process) on a COPY of the
seed corpus in a temporary folder, so the repository is never modified: 20 000 inputs or 45 s,
whichever comes first. The test asserts exit code 0 (libFuzzer exits non-zero on a crash and
writes the input to ``-artifact_prefix``, here the temporary folder, whose path the failure
message shows) and that at least 2 000 inputs ran, and prints the executions and the coverage
("cov:", libFuzzer's count of covered edges) it reported.

A second test runs every seed through the target's logic in-process, without atheris: each runs
clean, and the corpus holds both decoded and refused cases of each mode.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
TARGET = HERE / "fuzz_decode.py"
CORPUS = HERE / "corpus" / "decode"
RUNS, MAX_TIME_S, MIN_RUNS = 20_000, 45, 2_000


def _run_counts(output: str) -> int | None:
    """Executions libFuzzer reports: "Done N runs in S second(s)" (libFuzzer's final line),
    "Done N in S second(s)" (atheris's, for -atheris_runs) or its last "#N" status line."""
    done = re.findall(r"^Done (\d+)(?: runs)? in \d+ second", output, re.M)
    if done:
        return int(done[-1])
    status = re.findall(r"^#(\d+)\s", output, re.M)
    return int(status[-1]) if status else None


@pytest.mark.skipif(importlib.util.find_spec("atheris") is None,
                    reason="atheris is not importable (it needs Linux and Python < 3.13; the dev extra installs it)")
def test_decode_fuzzer_runs_clean_for_a_fixed_budget(tmp_path):
    seeds_before = {p.name: p.read_bytes() for p in CORPUS.iterdir()}
    corpus = tmp_path / "corpus"
    shutil.copytree(CORPUS, corpus)
    artifacts = tmp_path / "artifacts"
    artifacts.mkdir()
    repo = HERE.parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, str(TARGET), f"-atheris_runs={RUNS}", f"-max_total_time={MAX_TIME_S}", "-seed=1",
           f"-artifact_prefix={artifacts}/", "-print_final_stats=1", str(corpus)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=MAX_TIME_S + 120)
    output = proc.stdout + proc.stderr
    tail = "\n".join(output.splitlines()[-40:])
    assert proc.returncode == 0, f"the fuzzer failed (exit {proc.returncode}); crash inputs in {artifacts}:\n{tail}"
    assert not list(artifacts.iterdir()), f"crash inputs were written: {sorted(artifacts.iterdir())}"
    runs = _run_counts(output)
    coverage = [int(c) for c in re.findall(r"\bcov: (\d+)", output)]
    print(f"\nfuzz_decode: {runs} executions, cov: {max(coverage, default=0)} edges, "
          f"corpus {len(list(CORPUS.iterdir()))} seeds -> {len(list(corpus.iterdir()))} inputs")
    assert runs is not None and runs >= MIN_RUNS, f"only {runs} inputs ran:\n{tail}"
    assert coverage, f"no coverage reported:\n{tail}"
    assert {p.name: p.read_bytes() for p in CORPUS.iterdir()} == seeds_before, "the repository's corpus changed"


def test_every_seed_runs_clean_through_the_target_logic():
    from tests.fuzz import decode_input

    seeds = sorted(CORPUS.iterdir())
    assert 10 <= len(seeds) <= 40 and sum(p.stat().st_size for p in seeds) < 200_000
    outcomes = {p.name: decode_input.run_one(p.read_bytes()) for p in seeds}
    for mode in ("frames-", "wire-"):
        mine = {n: o for n, o in outcomes.items() if n.startswith(mode)}
        assert any(o.decoded for o in mine.values()), f"no {mode} seed decodes"
        assert any(o.refused for o in mine.values()), f"no {mode} seed is refused"
    for codec in ("fp32", "bf16_zstd", "int8_block", "int4_block", "int2_block"):
        assert any(o.decoded for n, o in outcomes.items() if codec in n), f"no {codec} seed decodes"
