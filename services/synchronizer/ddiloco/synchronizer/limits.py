"""Admission of streams: how many may be open, and how fast one address may open them.

Memory per learner is bounded elsewhere by construction: one inbox slot per learner and fragment
(a newer contribution replaces or is summed into the older one), one transfer in reassembly per
stream (bounded by ``limits.max_transfer_bytes`` and by the global layout), and a bounded queue
of control messages. What is left to bound is the number of streams and their churn: a flood of
connections, or one address reconnecting in a loop, would otherwise cost a Hello check, a record
and a stream task each time. Both are refused here with RESOURCE_EXHAUSTED before the Hello is
read. The peer address is the one gRPC reports (behind a proxy or NAT, every learner there
shares one bucket: size ``hello_burst`` for that).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ddiloco.synchronizer.config import Limits

MAX_TRACKED_ADDRESSES = 65536
"""Per-address buckets kept at most; full (idle) buckets are forgotten first."""


def peer_address(peer: str) -> str:
    """The host part of a gRPC peer string: ``ipv4:1.2.3.4:5678`` -> ``1.2.3.4``, ``ipv6:[::1]:5`` -> ``::1``."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        host = rest.rpartition(":")[0]
        return host.strip("[]") or rest
    return peer


@dataclass
class _Bucket:
    level: float
    at: float


class StreamLimiter:
    """Counts open streams and rate-limits new ones per peer address (a token bucket each)."""

    def __init__(self, limits: Limits, clock: Callable[[], float]) -> None:
        self.limits = limits
        self.clock = clock
        self.open = 0
        self._buckets: dict[str, _Bucket] = {}

    def admit(self, peer: str) -> tuple[str, str] | None:
        """Open a stream for ``peer``; or (limit name, reason) if it is refused."""
        lim = self.limits
        if self.open >= lim.max_streams:
            return "max_streams", f"{self.open} Sync streams are open (limits.max_streams {lim.max_streams})"
        address = peer_address(peer)
        now = self.clock()
        bucket = self._buckets.get(address)
        if bucket is None:
            self._forget_idle(now)
            bucket = self._buckets[address] = _Bucket(float(lim.hello_burst), now)
        bucket.level = min(float(lim.hello_burst), bucket.level + (now - bucket.at) * lim.hello_rate_per_s)
        bucket.at = now
        if bucket.level < 1.0:
            return "hello_rate", (f"{address} opens Sync streams faster than limits.hello_rate_per_s "
                                  f"{lim.hello_rate_per_s:g}/s (burst {lim.hello_burst}); retry later")
        bucket.level -= 1.0
        self.open += 1
        return None

    def release(self) -> None:
        self.open -= 1

    def _forget_idle(self, now: float) -> None:
        if len(self._buckets) < MAX_TRACKED_ADDRESSES:
            return
        lim = self.limits
        refill_s = lim.hello_burst / lim.hello_rate_per_s
        for address in [a for a, b in self._buckets.items() if now - b.at >= refill_s]:
            del self._buckets[address]
        if len(self._buckets) >= MAX_TRACKED_ADDRESSES:  # all busy: forget the longest idle
            del self._buckets[min(self._buckets, key=lambda a: self._buckets[a].at)]
