"""CPUs a process may use: affinity capped by the cgroup's CPU limit (v2 and v1 files); the C
library's memory settings for service processes."""

from __future__ import annotations

import os
import pathlib
import platform
import subprocess
import sys

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


def test_huge_pages_are_asked_for_unless_the_operator_chose(monkeypatch):
    from ddiloco.core.resources import THP_TUNABLE, with_huge_pages

    base = {"PATH": "/bin"}
    assert with_huge_pages(base) == {"PATH": "/bin", "GLIBC_TUNABLES": THP_TUNABLE} and base == {"PATH": "/bin"}
    other = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}
    assert with_huge_pages(other)["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=2:{THP_TUNABLE}"
    chosen = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}
    assert with_huge_pages(chosen) == chosen, "the operator's setting wins"


THP_MODE = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str:
    try:
        return THP_MODE.read_text().split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        return ""


def _glibc_at_least(major: int, minor: int) -> bool:
    lib, version = platform.libc_ver()
    return lib == "glibc" and tuple(int(v) for v in version.split(".")[:2]) >= (major, minor)


@pytest.mark.skipif(not _glibc_at_least(2, 35) or _thp_mode() not in ("madvise", "always"),
                    reason="needs glibc >= 2.35 and a kernel with transparent huge pages (madvise or always)")
def test_a_process_started_with_the_service_environment_gets_huge_pages():
    """A fresh 64 MiB buffer in a child started with ``with_huge_pages``' environment is backed by
    huge pages; without the tunable (under ``madvise``) it is not."""
    from ddiloco.core.resources import with_huge_pages

    probe = ("b = bytearray(64 << 20)\n"
             "print(next(l.split()[1] for l in open('/proc/self/smaps_rollup') if l.startswith('AnonHugePages')))")
    plain = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}

    def huge_kib(env: dict[str, str]) -> int:
        proc = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return int(proc.stdout)

    assert huge_kib(with_huge_pages(plain)) >= 32 * 1024
    if _thp_mode() == "madvise":
        assert huge_kib(plain) < 32 * 1024
