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
