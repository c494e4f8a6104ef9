"""Which fragment falls due at which inner step, and when its merged version is due back.

Fragment p falls due at learner steps t (t >= 1) with ``t mod H == floor(p * H / P)``; its merged
version is expected ``tau`` steps after it was sent. With the default P = H, exactly one fragment
falls due every step, which spreads communication evenly (Streaming DiLoCo's staggering). With
P = 1 and tau = 0 this is plain DiLoCo.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class FragmentSchedule:
    num_fragments: int
    """P: number of fragments."""
    sync_every: int
    """H: inner steps between two syncs of the same fragment."""
    overlap: int = 0
    """tau: steps between sending a fragment and applying its merged version."""

    def __post_init__(self) -> None:
        if self.num_fragments < 1:
            raise ValueError(f"num_fragments (P) must be >= 1, got {self.num_fragments}")
        if self.sync_every < 1:
            raise ValueError(f"sync_every (H) must be >= 1, got {self.sync_every}")
        if not 0 <= self.overlap < self.sync_every:
            raise ValueError(
                f"overlap (tau) must satisfy 0 <= tau < H, got tau={self.overlap}, H={self.sync_every}"
            )

    def offset(self, fragment: int) -> int:
        """The step offset floor(p*H/P) of fragment p within each H-step period."""
        if not 0 <= fragment < self.num_fragments:
            raise ValueError(f"fragment {fragment} out of range 0..{self.num_fragments - 1}")
        return fragment * self.sync_every // self.num_fragments

    def due(self, step: int) -> list[int]:
        """Fragments that fall due at inner step ``step`` (steps count from 1)."""
        if step < 1:
            return []
        phase = step % self.sync_every
        return [p for p in range(self.num_fragments) if self.offset(p) == phase]

    def next_due_step(self, fragment: int, after: int) -> int:
        """The first step > ``after`` at which ``fragment`` falls due."""
        off = self.offset(fragment)
        after = max(after, 0)
        base = after - (after % self.sync_every) + off
        step = base if base > after else base + self.sync_every
        return step if step >= 1 else step + self.sync_every

    def apply_step(self, sent_step: int) -> int:
        """The step boundary at which a fragment sent at ``sent_step`` is due to be applied."""
        return sent_step + self.overlap
