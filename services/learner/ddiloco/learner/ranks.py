"""A learner made of several processes (``torchrun``, DDP): rank 0 speaks for them all.

Rank 0 of the process group is the learner to the synchronizer: one stream, one contribution per
fragment and round, whatever the number of ranks. Every rank calls ``join()``, ``step()`` and
``finish()`` at the same points. At each step the ranks sum their tokens (and agree that the
loss was non-finite when any rank's was); after rank 0's boundary, it tells the others whether to
drain and which fragments it overwrote (applied or healed), then broadcasts those fragments'
values, so every rank's parameters stay identical to rank 0's. One process (``torch.distributed``
not initialised) is a group of one, and nothing here is called.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ddiloco.fragments.outer_gradient import BoundFragment

JOINED, DRAINED, FAILED = 1, 2, 3
"""How rank 0's join ended, as broadcast to the other ranks."""


class Ranks:
    """The processes that make up one learner; one when ``torch.distributed`` is not used."""

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.group = group
        active = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size(group) if active else 1
        self.rank = dist.get_rank(group) if active else 0
        self.leader = self.rank == 0
        self.src = dist.get_global_rank(group, 0) if active and group is not None else 0
        nccl = active and dist.get_backend(group) == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

    def broadcast_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        moved = tensor.to(self.device)
        self.dist.broadcast(moved, src=self.src, group=self.group)
        return moved.cpu()

    def broadcast_ints(self, values: list[int]) -> list[int]:
        return [int(v) for v in self.broadcast_tensor(torch.tensor(values, dtype=torch.int64)).tolist()]

    def sum_ints(self, values: list[int]) -> list[int]:
        t = torch.tensor(values, dtype=torch.int64, device=self.device)
        self.dist.all_reduce(t, group=self.group)
        return [int(v) for v in t.cpu().tolist()]

    def agree_step(self, tokens: int, loss: float | None) -> tuple[int, float | None]:
        """Every rank's tokens summed, and the loss made NaN when any rank's was not finite."""
        finite = loss is None or math.isfinite(loss)
        total, broken = self.sum_ints([int(tokens), 0 if finite else 1])
        return total, (float("nan") if broken else loss)

    def agree_join(self, outcome: int, start: int, versions: list[int]) -> tuple[int, int, list[int]]:
        """Rank 0's join outcome, start step and fragment versions, on every rank."""
        header = self.broadcast_ints([outcome, start, *versions])
        return header[0], header[1], header[2:]

    def share_fragment(self, bound: BoundFragment) -> None:
        """Rank 0's values of a fragment (bound to this rank's parameters) into every rank's."""
        values = bound.gather() if self.leader else torch.empty(bound.fragment.numel, dtype=torch.float32)
        values = self.broadcast_tensor(values)
        if not self.leader:
            bound.scatter(values)

    def lead(self, draining: bool, step: int, touched: dict[int, bool], versions: dict[int, int],
             num_fragments: int) -> None:
        """Rank 0, after its boundary: whether to drain, its step (it moves on its own when the
        learner catches up with its fleet), and the fragments it overwrote (fragment -> healed)
        with their versions. The values follow (``share_fragment``)."""
        control = [int(draining), step, len(touched)]
        for p, healed in sorted(touched.items()):
            control += [p, int(healed), versions.get(p, 0)]
        self.broadcast_ints(control + [0] * (3 + 3 * num_fragments - len(control)))

    def follow(self, num_fragments: int) -> tuple[bool, int, list[tuple[int, bool, int]]]:
        """Any other rank: rank 0's (draining, step, [(fragment, healed, version)]) for this boundary."""
        control = self.broadcast_ints([0] * (3 + 3 * num_fragments))
        touched = [(control[3 + 3 * i], bool(control[4 + 3 * i]), control[5 + 3 * i]) for i in range(control[2])]
        return bool(control[0]), control[1], touched


__all__ = ["DRAINED", "FAILED", "JOINED", "Ranks"]
