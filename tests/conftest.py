"""Shared test fixtures, the Hypothesis profile, and the test tiers.

Tests drive real servers on 127.0.0.1:0 and real processes.

Tiers (``make test-fast`` runs the first; ``make test``, what CI runs, runs all three):

- fast (no marker): what runs in one process, plus quick calls of external checkers (helm,
  lint-imports): algorithm, fragments, protocol, simulator, training, config, in-process
  services, the chart and the chaos manifests.
- ``e2e``: starts ddiloco processes (the services, ``ddiloco run``, benchmarks, examples).
- ``system``: containers, images, packaging, fuzzing.

A test's tier is decided here, by where it lives, not by marks in each file: ``E2E`` and
``SYSTEM`` name folders, files, or single tests (``file::test``) of files that are mostly fast.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, settings

from ddiloco.lab.procs import running

# Two cores here: keep torch from oversubscribing when tests start several processes.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
os.environ.setdefault("DDILOCO_LOG_JSON", "1")
# An event that does not match its spec in ddiloco.core.events raises, here and in every process
# the tests start (a deployed service logs it and writes the line).
os.environ.setdefault("DDILOCO_STRICT_EVENTS", "1")

# Every property test draws the same examples on every run and every machine (a failure in CI
# fails again on a rerun), keeps no example database, and has no time limits (a slow machine is
# not a failure). Tests that set their own settings inherit these.
settings.register_profile("ddiloco", derandomize=True, database=None, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ddiloco")

SYSTEM = (
    "tests/containers/",
    "tests/fuzz/",
    "tests/test_packaging.py",
)
E2E = (
    "tests/lab/test_chaos.py",
    "tests/lab/test_learner_bench.py",
    "tests/lab/test_memory_bench.py",
    "tests/lab/test_procs.py",
    "tests/lab/test_run_e2e.py",
    "tests/lab/test_scale_bench.py",
    "tests/lab/test_study.py::test_the_command",
    "tests/lab/test_torchft_bench.py::test_tiny_torchft_overhead_run_leaves_nothing_running",
    "tests/lab/test_wire_bench.py",
    "tests/learner/test_comm_trust.py",
    "tests/learner/test_decoupled_sync.py",
    "tests/learner/test_eval_cmd.py",
    "tests/learner/test_join.py",
    "tests/learner/test_resume.py",
    "tests/learner/test_shard_reseed.py",
    "tests/protocol/test_status_cli.py",
    "tests/security/test_regressions.py::test_a_learner_reporting_a_tiny_step_time_does_not_stall_the_synchronizer",
    "tests/synchronizer/test_durability.py",
    "tests/synchronizer/test_export.py::test_a_refusal_through_the_installed_command",
    "tests/synchronizer/test_export.py::test_cli_export_holds_the_committed_values_bit_for_bit_with_its_metadata",
    "tests/synchronizer/test_secrets_hygiene.py",
    "tests/synchronizer/test_state_lock.py",
    "tests/test_cli_startup.py",
    "tests/test_config.py::test_services_refuse_a_bad_file_with_the_field_and_start_nothing",
    "tests/training/test_model.py::test_build_is_identical_in_another_process",
    "tests/training/test_prepare_data.py::test_bad_inputs_exit_2_and_write_nothing",
    "tests/training/test_prepare_data.py::test_cli_",
    "tests/training/test_prepare_data.py::test_refusals_and_force_leave_the_folder_untouched",
    "tests/training/test_prepare_data.py::test_sigterm_mid_write_leaves_nothing",
)


def tier(nodeid: str) -> str | None:
    """``system``, ``e2e`` or None (fast) for a test's node id."""
    if nodeid.startswith(SYSTEM):
        return "system"
    if nodeid.startswith(E2E):
        return "e2e"
    return None


CONTAINERS = "tests/containers/"
# The container tests' own engine keeps its data root (gigabytes of image layers) in ENGINE_DIR.
# When that engine stops, the data root is moved into engine_leftovers() (a rename: instant) and
# removed only when the whole session ends (pytest_sessionfinish below): removing the layers is
# gigabytes of unlinks, and while it ran beside a chaos test on another worker, that run's
# synchronizer (it fsyncs every commit before it broadcasts the merge) stalled for 64 s.
# Each session sets aside into a folder of its own, named by the pid of its controlling process
# (xdist's workers inherit it through SESSION_PID_ENV): a session that ends removes its own and
# those of sessions no longer running (killed before their end), never a running session's.
ENGINE_DIR = pathlib.Path(tempfile.gettempdir()) / "ddiloco-dockerd"
ENGINE_LEFTOVERS_ROOT = ENGINE_DIR / "removed"
SESSION_PID_ENV = "DDILOCO_TEST_SESSION_PID"


def session_pid() -> int:
    """The pid of this test session's controlling process (this one when run without xdist)."""
    return int(os.environ.get(SESSION_PID_ENV) or os.getpid())


def engine_leftovers() -> pathlib.Path:
    """Where this session's stopped engine roots are set aside until the session ends."""
    return ENGINE_LEFTOVERS_ROOT / str(session_pid())


def remove_set_aside(root: pathlib.Path, own_pid: int) -> list[pathlib.Path]:
    """Remove ``root``'s folder of session ``own_pid`` and those of sessions no longer running;
    a folder of a running session, or one not named by a pid, stays. Returns what was removed."""
    removed = []
    for folder in sorted(root.iterdir()) if root.is_dir() else []:
        if not folder.name.isdigit() or (int(folder.name) != own_pid and running(int(folder.name))):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


def pytest_configure(config) -> None:  # type: ignore[no-untyped-def]
    if not hasattr(config, "workerinput"):  # the controller (or the one process): workers inherit it
        os.environ[SESSION_PID_ENV] = str(os.getpid())


def pytest_collection_modifyitems(config, items) -> None:  # type: ignore[no-untyped-def]
    """Mark each test with its tier. In one process the container tests run last (the engine and
    its image builds never share the machine with the process tests); with workers
    (``TEST_WORKERS``) they are one unit for one worker (below), which xdist hands out first (the
    largest unit), beside the process tests on the others."""
    for item in items:
        name = tier(item.nodeid)
        if name is not None:
            item.add_marker(getattr(pytest.mark, name))
    items.sort(key=lambda item: item.nodeid.startswith(CONTAINERS))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):  # type: ignore[no-untyped-def]
    """``make test TEST_WORKERS=N`` (pytest-xdist, ``--dist loadgroup``): each test a work unit of its
    own, handed to whichever worker is free, except the container tests, one unit for one worker:
    they share one Docker engine, started by the first of them and stopped after the last.
    (xdist's own ``xdist_group`` marks are not used: with pytest 9 they are not applied.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class EngineGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return CONTAINERS if nodeid.startswith(CONTAINERS) else nodeid

    return EngineGroup(config, log)


def pytest_sessionfinish(session, exitstatus) -> None:  # type: ignore[no-untyped-def]
    """Remove the container engine's data roots set aside during the session (``engine_leftovers()``),
    once no test runs any more: in the one process, or in xdist's controller after every worker
    ended (a worker's own session end may come while another worker still runs tests). Those of
    sessions killed before their end go too; those of a session still running stay."""
    if hasattr(session.config, "workerinput"):
        return
    remove_set_aside(ENGINE_LEFTOVERS_ROOT, session_pid())
