"""A typical value that no single learner can move: the median of per-identity medians.

The guards (``norm_guard``, ``weight_guard``, ``claim_guard``) bound what a contribution may
carry by a multiple of what the fleet typically sends. Taken over the fleet's recent answers as
one pool, that typical value belongs to whoever answers most: one learner sending many answers
just under the bound fills the pool and drags the bound up after it (120 answers of one learner
raised a weight bound 490-fold). Here each identity keeps its own recent values, and the typical
value is the lower median of the identities' medians: one identity counts once, whatever it sends,
so a single learner moves the fleet's figure only as far as the identity next to it in rank, and
among two it is the lower of them. An identity's own median is still its own to move, which is
what a learner's own history is for.

Only what was admitted is recorded (the callers record after every check has passed), so a
refused answer never shapes the bound that judged it.

Identities are what the synchronizer can tell apart: the learner ids bound to credentials.
Where one holder can claim many ids (auth off, or ``identity_binding: prefix``) it can stand in
for several identities; the security docs say so.
"""

from __future__ import annotations

import statistics
from collections import OrderedDict, deque

MAX_IDENTITIES = 4096
"""Identities remembered at most; the longest unheard is forgotten first (a fleet that churns
through ids cannot grow the history without end)."""


class IdentityMedians:
    """Recent values per identity (``window`` each) and the fleet's robust typical value."""

    def __init__(self, window: int, max_identities: int = MAX_IDENTITIES) -> None:
        if window < 1 or max_identities < 1:
            raise ValueError(f"need window >= 1 and max_identities >= 1, got {window}, {max_identities}")
        self.window = window
        self.max_identities = max_identities
        self._values: OrderedDict[str, deque[float]] = OrderedDict()
        self._medians: dict[str, float] = {}
        self.count = 0
        """Values recorded so far, all identities together (the guards' warm-up counts these)."""

    def record(self, identity: str, value: float) -> None:
        values = self._values.pop(identity, None)
        if values is None:
            values = deque(maxlen=self.window)
            while len(self._values) >= self.max_identities:
                gone, _ = self._values.popitem(last=False)
                del self._medians[gone]
        values.append(value)
        self._values[identity] = values  # most recently heard last
        self._medians[identity] = statistics.median(values)  # once per record, not per question
        self.count += 1

    def of(self, identity: str) -> float | None:
        """``identity``'s own median (None: nothing recorded for it)."""
        return self._medians.get(identity)

    def samples(self, identity: str) -> int:
        """Values held for ``identity`` (at most ``window``)."""
        values = self._values.get(identity)
        return len(values) if values else 0

    def typical(self, *, exclude: str | None = None) -> float | None:
        """The lower median of the identities' medians, leaving out ``exclude`` (None: none known)."""
        medians = [m for k, m in self._medians.items() if k != exclude]
        return statistics.median_low(medians) if medians else None

    def identities(self) -> int:
        return len(self._medians)

    def identities_by_recency(self) -> list[str]:
        """The identities held, least recently heard first."""
        return list(self._values)
