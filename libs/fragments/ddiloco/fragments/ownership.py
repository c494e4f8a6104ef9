"""Which synchronizer shard owns which fragment: shard ``s`` of ``S`` owns fragment ``p`` when
``p % S == s``. Computed from the fragment index alone, so every side (synchronizer, learners,
operator tools, the simulator) agrees without exchanging anything; docs/sharding.md says why
round-robin."""

from __future__ import annotations


def owner(fragment: int, shards: int) -> int:
    """The shard that owns ``fragment`` among ``shards``."""
    return fragment % shards


def owned(num_fragments: int, shard: int, shards: int) -> list[int]:
    """The fragments shard ``shard`` of ``shards`` owns, ascending."""
    return [p for p in range(num_fragments) if owner(p, shards) == shard]
