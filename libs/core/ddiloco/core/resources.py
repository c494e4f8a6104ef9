"""How many CPUs this process may really use: the smaller of its CPU affinity and its cgroup's
CPU limit.

``os.cpu_count()`` is the machine's core count. In a container with a CPU limit (a Kubernetes
pod with ``resources.limits.cpu: 4`` on a 64-core node) that many torch threads contend for 4
cores' worth of time, and every step is throttled. The limit lives in the cgroup: ``cpu.max``
("QUOTA PERIOD" or "max PERIOD") under cgroup v2, ``cpu.cfs_quota_us`` and
``cpu.cfs_period_us`` under v1; a fractional limit rounds up (1.5 CPUs: 2 threads).
"""

from __future__ import annotations

import math
import os
import pathlib
from collections.abc import Mapping

CGROUP_ROOT = pathlib.Path("/sys/fs/cgroup")


def cgroup_cpu_limit(root: pathlib.Path = CGROUP_ROOT) -> float | None:
    """CPUs the cgroup at ``root`` may use (None: no limit, or no cgroup files to read)."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        if quota == "max":
            return None
        return int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def available_cpus(root: pathlib.Path = CGROUP_ROOT) -> int:
    """CPUs this process may use: affinity, capped by the cgroup's CPU limit (rounded up), >= 1."""
    try:
        count = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        count = os.cpu_count() or 1
    limit = cgroup_cpu_limit(root)
    if limit is not None and limit > 0:
        count = min(count, math.ceil(limit))
    return max(1, count)


M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameter number for the mmap threshold."""


def fix_mmap_threshold(threshold_bytes: int = 1 << 20) -> bool:
    """Make glibc serve every allocation of ``threshold_bytes`` or more with its own mapping, so
    that freeing it returns the memory to the system at once. True when it was set.

    glibc raises its mmap threshold whenever a mapped block is freed, up to 32 MiB: after the
    first fragment-sized tensors come and go, later ones are carved from the heap, whose freed
    blocks stay resident and fragment. A process that allocates and frees tensors of a few MB at
    every merge then grows to several times what it holds (measured in the synchronizer: 33 bytes
    per parameter at steady state against 12 with the threshold fixed). Fixing the threshold
    turns the adjustment off. Not applied when ``MALLOC_MMAP_THRESHOLD_`` is set (the operator's
    choice wins) or when the C library is not glibc.
    """
    if os.environ.get("MALLOC_MMAP_THRESHOLD_"):
        return False
    try:
        import ctypes
        import ctypes.util

        name = ctypes.util.find_library("c")
        if name is None:
            return False
        libc = ctypes.CDLL(name)
        if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
            return False
        return bool(libc.mallopt(M_MMAP_THRESHOLD, int(threshold_bytes)))
    except OSError:
        return False


THP_TUNABLE = "glibc.malloc.hugetlb=1"
"""glibc (2.35+) tunable: back the memory malloc maps with transparent huge pages where the
kernel allows them (``madvise`` or ``always`` in /sys/kernel/mm/transparent_hugepage/enabled)."""


def with_huge_pages(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` for a service process, with ``GLIBC_TUNABLES`` asking glibc for transparent huge
    pages, unless the operator already chose a ``glibc.malloc.hugetlb`` value.

    Every fragment a service receives or decodes lands in a fresh buffer of fragment size, and
    a fresh 64 MiB buffer costs about 16,000 page faults: measured on 2 cores, joining 16 chunks
    into 64 MiB took 35-44 ms with 4 KiB pages and 17-20 ms with huge pages, and a 64 MiB fp32
    fragment's round trip over the Sync stream 530 ms against 408 ms (medians of 3 runs; numbers in
    docs/benchmarks.md). The synchronizer's resident bytes per parameter were unchanged (12.7
    against 12.9, within the run-to-run spread).
    glibc reads the tunable when a process starts, so it is set for the processes started here
    (and in the service images); a C library other than glibc ignores it.
    """
    out = dict(env)
    current = out.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb" in current:
        return out
    out["GLIBC_TUNABLES"] = f"{current}:{THP_TUNABLE}" if current else THP_TUNABLE
    return out
