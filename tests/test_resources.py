"""CPUs a process may use: affinity capped by the cgroup's CPU limit (v2 and v1 files)."""

from __future__ import annotations

import os

import pytest

from ddiloco.core.resources import available_cpus, cgroup_cpu_limit


@pytest.mark.parametrize("content, limit", [("max 100000\n", None), ("150000 100000\n", 1.5),
                                            ("400000 100000", 4.0), ("garbage", None)])
def test_cgroup_v2_cpu_max(tmp_path, content, limit):
    (tmp_path / "cpu.max").write_text(content)
    assert cgroup_cpu_limit(tmp_path) == limit


def test_cgroup_v1_quota_and_no_limit(tmp_path):
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("50000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_limit(tmp_path) == 0.5
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")  # unlimited
    assert cgroup_cpu_limit(tmp_path) is None
    assert cgroup_cpu_limit(tmp_path / "nowhere") is None


def test_a_fractional_limit_rounds_up_and_never_exceeds_affinity(tmp_path):
    affinity = len(os.sched_getaffinity(0))
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert available_cpus(tmp_path) == min(affinity, 2)
    (tmp_path / "cpu.max").write_text(f"{(affinity + 8) * 100000} 100000\n")
    assert available_cpus(tmp_path) == affinity
    (tmp_path / "cpu.max").write_text("1000 100000\n")  # 0.01 CPU: still one thread
    assert available_cpus(tmp_path) == 1


def test_this_machine():
    assert 1 <= available_cpus() <= (os.cpu_count() or 1)


def test_the_mmap_threshold_is_fixed_on_glibc_unless_the_operator_set_it(monkeypatch):
    import ctypes.util
    import platform

    from ddiloco.core.resources import fix_mmap_threshold

    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    glibc = platform.libc_ver()[0] == "glibc" and ctypes.util.find_library("c") is not None
    assert fix_mmap_threshold() is glibc
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "4194304")
    assert fix_mmap_threshold() is False, "the operator's setting wins"
