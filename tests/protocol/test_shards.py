"""Shard ownership, shard addresses and shard specs: the rules every side computes alike."""

from __future__ import annotations

import pytest

from ddiloco.protocol.shards import owned, owner, parse_shard, synchronizer_targets


def test_every_fragment_has_exactly_one_owner_and_shards_split_evenly():
    for shards in (1, 2, 3, 4):
        parts = [owned(10, s, shards) for s in range(shards)]
        assert sorted(p for part in parts for p in part) == list(range(10))
        assert max(map(len, parts)) - min(map(len, parts)) <= 1
        assert all(owner(p, shards) == s for s, part in enumerate(parts) for p in part)


def test_addresses_from_one_a_list_or_a_pattern():
    assert synchronizer_targets("sync:7000") == ["sync:7000"]
    assert synchronizer_targets(" a:1 , b:2 ") == ["a:1", "b:2"]
    assert synchronizer_targets("a:1,b:2", 2) == ["a:1", "b:2"]
    assert synchronizer_targets("sync-{shard}.shards.ns.svc:7000", 3) == [
        "sync-0.shards.ns.svc:7000", "sync-1.shards.ns.svc:7000", "sync-2.shards.ns.svc:7000"]
    assert synchronizer_targets("[::1]:7000") == ["[::1]:7000"]


@pytest.mark.parametrize("spec, shards, why", [
    ("a:1,b:2", 3, "2 synchronizer address"),
    ("a:1,,b:2", None, "empty address"),
    ("a:1,a:1", None, "given for two shards"),
    ("sync-{shard}:7000,b:1", 2, "not both"),
    ("sync:{shard}", 2, "HOST:PORT"),
    ("sync", None, "HOST:PORT"),
    ("a:1", 0, "shards must be in"),
])
def test_bad_addresses_say_what_is_wrong(spec, shards, why):
    with pytest.raises(ValueError, match=why):
        synchronizer_targets(spec, shards)


def test_shard_specs():
    assert parse_shard("1/4") == (1, 4)
    assert parse_shard("ordinal/4", hostname="ddiloco-synchronizer-3") == (3, 4)
    assert parse_shard("ordinal/4", hostname="ddiloco-synchronizer-0.shards.ns.svc.cluster.local") == (0, 4)
    for spec, host, why in [("4/4", None, "outside 0..3"), ("ordinal/4", "ddiloco-synchronizer-7", "outside 0..3"),
                            ("ordinal/2", "box", "ending in -N"), ("1", None, "s/S"), ("a/2", None, "s/S"),
                            ("0/0", None, "must be in 1.."), ("0/x", None, "s/S")]:
        with pytest.raises(ValueError, match=why):
            parse_shard(spec, hostname=host)
