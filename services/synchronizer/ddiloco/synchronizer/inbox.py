"""A fragment's inbox: the contributions waiting for its next merge.

Decoded outer gradients are copied straight into rows of one [capacity, N] fp32 matrix, so the
merge reads them as one strided block (a GEMV per tensor) instead of stacking copies. At merge
time the inbox is *sealed*: its entries and matrix move to the merge, and a fresh matrix takes
new arrivals, so a contribution arriving during a merge can never touch the rows being merged.

One slot per learner. A newer contribution from the same learner process *for the same base*
replaces the older one: both are measured from that base, so the newer one carries the older
one's progress, and the replaced one is reported as superseded. When the bases differ (the
learner applied a merge that did not include its older contribution) or the newer one comes from
a new incarnation of the learner (a restart from the global state), the newer one does not hold
the older one's progress: the two deltas are summed into the slot, with their tokens and steps,
and the older one rides along in ``carried`` to be reported merged (or rejected) with it. Each part
keeps its own base version: a merge re-anchors every part against its own base (``bases``), so an
older part whose predecessor was already merged is not counted twice.
"""

from __future__ import annotations

import dataclasses
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
    round: int = 0
    """The round of the request it answers (0: unsolicited)."""
    hand_over: bool = False
    """Its learner's last progress on the fragment, handed over as it finishes or drains."""
    carried: tuple[Contribution, ...] = ()
    """Older contributions of the same learner whose deltas are summed into this one's row."""

    def parts(self) -> tuple[Contribution, ...]:
        """This contribution and every one it carries, each as sent (for results and logs)."""
        own = dataclasses.replace(self, carried=(), tokens=self.tokens - sum(k.tokens for k in self.carried),
                                  steps=self.steps - sum(k.steps for k in self.carried))
        return (own, *self.carried)

    def bases(self) -> list[int]:
        """The base version of this contribution and of every one it carries (one per part)."""
        return [self.base_version, *(k.base_version for k in self.carried)]

    def supersedes(self, older: Contribution) -> bool:
        """True when this contribution holds all of ``older``'s progress (same process, same base)."""
        return self.incarnation == older.incarnation and self.base_version == older.base_version


@dataclass
class SealedRound:
    entries: list[Contribution]
    deltas: torch.Tensor
    """[len(entries), N] view; row i belongs to entries[i]."""
    carry: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    """Row i -> the part of row i that entries[i] carries (for putting the round back)."""


class Inbox:
    def __init__(self, num_values: int, capacity: int = 4) -> None:
        self.num_values = num_values
        self._capacity = max(1, capacity)
        self._rows = torch.empty(self._capacity, num_values, dtype=torch.float32)
        self._slots: dict[str, int] = {}
        self._entries: list[Contribution] = []
        self._carry: dict[int, torch.Tensor] = {}
        """slot -> the summed deltas of the contributions its entry carries (only where it carries any)."""

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def entries(self) -> list[Contribution]:
        return list(self._entries)

    @property
    def contributors(self) -> frozenset[str]:
        return frozenset(self._slots)

    def add(self, contribution: Contribution, delta: torch.Tensor,
            carry: torch.Tensor | None = None) -> Contribution | None:
        """Store a contribution; return the one it supersedes (replaces), if any.

        A pending contribution of the same learner that ``contribution`` does not supersede is
        summed with it instead (see the module docstring); nothing is returned then. ``carry`` is
        only for putting back an entry of a sealed round that carries others: the part of
        ``delta`` that belongs to them."""
        if delta.numel() != self.num_values:
            raise ValueError(f"delta has {delta.numel()} values, inbox holds {self.num_values}")
        delta = delta.reshape(-1)
        slot = self._slots.get(contribution.learner_id)
        if slot is None:
            slot = len(self._entries)
            if slot >= self._capacity:
                self._grow()
            if contribution.carried and carry is None:
                raise ValueError("an entry that carries contributions needs their summed deltas (carry)")
            self._entries.append(contribution)
            self._slots[contribution.learner_id] = slot
            self._rows[slot].copy_(delta)
            if contribution.carried:
                self._carry[slot] = carry.reshape(-1).clone()
            return None
        older = self._entries[slot]
        row = self._rows[slot]
        if contribution.supersedes(older):
            carried = older.carried
            # a hand-over that holds an older ordinary contribution's whole period is not the
            # fraction of one that a hand-over round steps without momentum
            self._entries[slot] = dataclasses.replace(
                contribution, carried=carried, tokens=contribution.tokens + sum(k.tokens for k in carried),
                steps=contribution.steps + sum(k.steps for k in carried),
                hand_over=contribution.hand_over and older.hand_over)
            carry = self._carry.get(slot)
            if carry is None:
                row.copy_(delta)
            else:
                torch.add(carry, delta, out=row)
            return older.parts()[0]
        # Not contained in the newer one: keep the older progress (the row so far) and add. The
        # older entry's own part only: its tokens and steps already include what it carries, which
        # joins the new entry part by part (taken whole, a third summed contribution counted the
        # carried ones twice and weighed the row by tokens no learner trained).
        self._carry[slot] = row.clone()
        carried = (*older.carried, older.parts()[0])
        self._entries[slot] = dataclasses.replace(
            contribution, carried=carried, tokens=contribution.tokens + sum(k.tokens for k in carried),
            steps=contribution.steps + sum(k.steps for k in carried))
        row.add_(delta)
        return None

    def _grow(self) -> None:
        new = torch.empty(self._capacity * 2, self.num_values, dtype=torch.float32)
        new[: self._capacity].copy_(self._rows)
        self._rows, self._capacity = new, self._capacity * 2

    def seal(self) -> SealedRound:
        """Hand every entry to a merge and start empty (with a fresh matrix of the same size)."""
        sealed = SealedRound(self._entries, self._rows[: len(self._entries)], self._carry)
        self._rows = torch.empty(self._capacity, self.num_values, dtype=torch.float32)
        self._slots, self._entries, self._carry = {}, [], {}
        return sealed
