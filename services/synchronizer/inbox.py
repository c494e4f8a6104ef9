"""A fragment's inbox: the contributions waiting for its next merge.

Decoded outer gradients are copied straight into rows of one [capacity, N] fp32 matrix, so the
merge reads them as one strided block (a GEMV per tensor) instead of stacking copies. At merge
time the inbox is *sealed*: its entries and matrix move to the merge, and a fresh matrix takes
new arrivals, so a contribution arriving during a merge can never touch the rows being merged.

One slot per learner: a newer contribution from the same learner replaces the older one (it
carries the older one's progress, since both are measured from the learner's base), and the
replaced one is reported as superseded, never silently lost.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Contribution:
    learner_id: str
    sequence: int
    fragment: int
    base_version: int
    tokens: int
    steps: int
    arrived_at: float
    learner_step: int = 0
    incarnation: int = 0


@dataclass
class SealedRound:
    entries: list[Contribution]
    deltas: torch.Tensor
    """[len(entries), N] view; row i belongs to entries[i]."""


class Inbox:
    def __init__(self, num_values: int, capacity: int = 4) -> None:
        self.num_values = num_values
        self._capacity = max(1, capacity)
        self._rows = torch.empty(self._capacity, num_values, dtype=torch.float32)
        self._slots: dict[str, int] = {}
        self._entries: list[Contribution] = []

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def entries(self) -> list[Contribution]:
        return list(self._entries)

    @property
    def contributors(self) -> frozenset[str]:
        return frozenset(self._slots)

    def has_fresh(self, version: int) -> bool:
        return any(e.base_version == version for e in self._entries)

    def oldest_arrival(self) -> float | None:
        return min((e.arrived_at for e in self._entries), default=None)

    def add(self, contribution: Contribution, delta: torch.Tensor) -> Contribution | None:
        """Store a contribution; return the one it supersedes, if any."""
        if delta.numel() != self.num_values:
            raise ValueError(f"delta has {delta.numel()} values, inbox holds {self.num_values}")
        slot = self._slots.get(contribution.learner_id)
        replaced = None
        if slot is None:
            slot = len(self._entries)
            if slot >= self._capacity:
                self._grow()
            self._entries.append(contribution)
            self._slots[contribution.learner_id] = slot
        else:
            replaced = self._entries[slot]
            self._entries[slot] = contribution
        self._rows[slot].copy_(delta.reshape(-1))
        return replaced

    def _grow(self) -> None:
        new = torch.empty(self._capacity * 2, self.num_values, dtype=torch.float32)
        new[: self._capacity].copy_(self._rows)
        self._rows, self._capacity = new, self._capacity * 2

    def seal(self) -> SealedRound:
        """Hand every entry to a merge and start empty (with a fresh matrix of the same size)."""
        sealed = SealedRound(self._entries, self._rows[: len(self._entries)])
        self._rows = torch.empty(self._capacity, self.num_values, dtype=torch.float32)
        self._slots, self._entries = {}, []
        return sealed

    def drop(self, learner_id: str) -> Contribution | None:
        """Remove a learner's pending contribution (e.g. it must resynchronise)."""
        slot = self._slots.pop(learner_id, None)
        if slot is None:
            return None
        gone = self._entries[slot]
        last = len(self._entries) - 1
        if slot != last:
            moved = self._entries[last]
            self._entries[slot] = moved
            self._rows[slot].copy_(self._rows[last])
            self._slots[moved.learner_id] = slot
        self._entries.pop()
        return gone
