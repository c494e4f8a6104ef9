"""Synchronizer shards: which fragments a shard owns, and how every side finds every shard.

A synchronizer may be split into ``S`` shards; shard ``s`` owns fragment ``p`` when
``p % S == s`` (``ddiloco.fragments.ownership``). The assignment is computed from the fragment index alone, so the synchronizer, the
learners, ``ddiloco status``, ``ddiloco eval`` and ``ddiloco export`` agree on it without
exchanging anything. Round-robin rather than a balance by bytes: the partition already makes
fragments of near-equal size (a fragment is a run of whole tensors cut at about numel / P), so
round-robin gives each shard within one fragment's bytes of 1/S of the model, and it stays
meaningful when P changes, where a balance by bytes would hinge on every tensor's shape.

Addresses (``synchronizer_targets``): one ``HOST:PORT`` (one shard), a comma-separated list (shard
``s`` is the ``s``-th entry), or a pattern holding ``{shard}`` that is expanded for ``s`` in
``0..S-1`` with ``S`` given separately, as a Kubernetes headless Service names a StatefulSet's pods
(``ddiloco-synchronizer-{shard}.ddiloco-synchronizer-shards:7000``).

A shard's index (``parse_shard``): ``s/S``, or ``ordinal/S`` for a StatefulSet pod, which takes
``s`` from the trailing ``-N`` of the host name (``ddiloco-synchronizer-2`` is shard 2).
"""

from __future__ import annotations

import re
import socket

from ddiloco.fragments.ownership import owned, owner
from ddiloco.protocol.client import check_target

__all__ = ["MAX_SHARDS", "PATTERN", "owned", "owner", "parse_shard", "synchronizer_targets"]

PATTERN = "{shard}"
MAX_SHARDS = 1024
"""More shards than this is a typo, not a fleet (each is a process and a stream per learner)."""

_ORDINAL = re.compile(r"-(\d+)$")


def synchronizer_targets(spec: str, shards: int | None = None) -> list[str]:
    """The address of every shard, shard 0 first (see the module's doc). ``shards``: the number of
    shards a ``{shard}`` pattern expands to; for a list it must equal the list's length when
    given. ValueError, saying what is wrong, for anything else."""
    if shards is not None and not 1 <= shards <= MAX_SHARDS:
        raise ValueError(f"synchronizer shards must be in 1..{MAX_SHARDS}, got {shards}")
    spec = spec.strip()
    if PATTERN in spec:
        if "," in spec:
            raise ValueError(f"give either a list of addresses or one {PATTERN} pattern, not both: {spec!r}")
        count = shards or 1
        targets = [spec.replace(PATTERN, str(s)) for s in range(count)]
    else:
        targets = [t.strip() for t in spec.split(",")]
        if any(not t for t in targets):
            raise ValueError(f"empty address in the synchronizer list {spec!r}")
        if shards is not None and shards != len(targets):
            raise ValueError(f"{len(targets)} synchronizer address(es) given for {shards} shards: give one per "
                             f"shard, or a pattern holding {PATTERN}")
    for t in targets:
        check_target(t)
    seen: set[str] = set()
    for t in targets:
        if t in seen:
            raise ValueError(f"synchronizer address {t!r} is given for two shards")
        seen.add(t)
    return targets


def parse_shard(spec: str, hostname: str | None = None) -> tuple[int, int]:
    """``s/S`` -> (s, S); ``ordinal/S`` takes s from the host name's trailing ``-N``. ValueError
    for anything else, or for s outside 0..S-1."""
    index, sep, count = spec.strip().partition("/")
    if not sep or not count.strip().isdigit():
        raise ValueError(f"a shard is s/S (or ordinal/S in a StatefulSet), got {spec!r}")
    shards = int(count)
    if not 1 <= shards <= MAX_SHARDS:
        raise ValueError(f"the number of shards must be in 1..{MAX_SHARDS}, got {shards}")
    index = index.strip()
    if index == "ordinal":
        name = hostname if hostname is not None else socket.gethostname()
        m = _ORDINAL.search(name.split(".")[0])
        if m is None:
            raise ValueError(f"shard 'ordinal/{shards}' needs a host name ending in -N (a StatefulSet pod), "
                             f"got {name!r}")
        s = int(m.group(1))
    elif index.isdigit():
        s = int(index)
    else:
        raise ValueError(f"a shard is s/S (or ordinal/S in a StatefulSet), got {spec!r}")
    if not 0 <= s < shards:
        raise ValueError(f"shard index {s} is outside 0..{shards - 1}")
    return s, shards
