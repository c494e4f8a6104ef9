"""The outer optimizer: Nesterov SGD on a global fragment, driven by the merged outer gradient.

DiLoCo's outer step (docs/algorithm.md, synchronizer step 6) with the merged Delta as the gradient:

    b = mu * b + D;   Theta -= lr * (D + mu * b)

which is ``torch.optim.SGD(lr, momentum=mu, nesterov=True, dampening=0)``. torch creates its
buffer as ``b = D`` on the first step; ours starts at zero, and ``mu * 0 + D`` is ``D`` exactly,
so the two agree from the first step (tests/algorithm/test_outer_optimizer.py checks against torch itself).

Why not call torch.optim.SGD: the synchronizer owns one flat fp32 (params, momentum) pair per
fragment, commits both to disk after every step and may restart from them, so an optimizer object
with its own state dict would be a second copy of the truth. And the step is memory-bound: torch's
single-tensor SGD makes four passes (``b*mu``, ``+D``, ``D + mu*b`` into a temporary, ``Theta -=``).
Here it is three fused multiply-adds, ``b = D + mu*b``, ``Theta -= lr*D``, ``Theta -= lr*mu*b``,
run over cache-sized chunks so params, momentum and D cross the memory bus about once each.
The rounding differs from torch's by an ulp or so; measured on 64 MiB fragments this is about
25% faster than the bit-identical four-op form and 15% faster than three whole-tensor ops.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from ddiloco.algorithm.merge import tensors_overlap

_CHUNK = 1 << 20
"""Values per chunk (4 MiB per fp32 operand, 12 MiB in flight: a last-level cache). Smaller chunks
measured slower: each op is a parallel region whose fixed cost dominates, worse on a busy host."""


@dataclass(frozen=True, kw_only=True)
class OuterNesterov:
    """Outer SGD with Nesterov momentum (plain SGD when ``momentum`` is 0)."""

    lr: float = 0.7
    """Outer learning rate (DiLoCo: 0.7)."""
    momentum: float = 0.9
    """Nesterov momentum mu in [0, 1) (DiLoCo: 0.9); 0 gives plain SGD and needs no buffer."""
    momentum_warmup: int = 0
    """Outer steps of a fragment over which the momentum ramps linearly up to ``momentum`` (0: none).
    The first outer gradients of a run are the largest and least alike; momentum built on them
    carries them into the steps after."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"outer lr must be a finite number > 0, got {self.lr}")
        if not (math.isfinite(self.momentum) and 0.0 <= self.momentum < 1.0):
            raise ValueError(f"outer momentum must be in [0, 1), got {self.momentum}")
        if self.momentum_warmup < 0:
            raise ValueError(f"outer momentum warm-up must be >= 0 outer steps, got {self.momentum_warmup}")

    def at(self, outer_step: int) -> OuterNesterov:
        """The optimizer of a fragment's ``outer_step``-th step (from 1): the momentum of the warm-up."""
        if not self.momentum_warmup or outer_step >= self.momentum_warmup:
            return self
        return dataclasses.replace(self, momentum=self.momentum * max(1, outer_step) / self.momentum_warmup)

    def step(self, params: torch.Tensor, momentum_buf: torch.Tensor | None, delta: torch.Tensor) -> None:
        """One outer step, in place on ``params`` and ``momentum_buf`` (flat fp32, same shape).

        ``delta`` is the merged outer gradient (base - local, so params move against it) and is
        not modified. ``momentum_buf`` starts as zeros and may be None when momentum is 0.
        """
        _check(params, delta, "delta")
        if self.momentum == 0.0:
            params.add_(delta, alpha=-self.lr)
            return
        if momentum_buf is None:
            raise ValueError("momentum_buf is required when momentum > 0")
        _check(params, momentum_buf, "momentum_buf")
        for a, b, name_a, name_b in ((params, momentum_buf, "params", "momentum_buf"),
                                     (params, delta, "params", "delta"),
                                     (momentum_buf, delta, "momentum_buf", "delta")):
            if tensors_overlap(a, b):
                raise ValueError(f"{name_a} and {name_b} must not share memory")
        p_flat, b_flat, d_flat = params.view(-1), momentum_buf.view(-1), delta.reshape(-1)
        mu, lr = self.momentum, self.lr
        n = p_flat.numel()
        for s in range(0, n, _CHUNK):
            b, d = b_flat[s:s + _CHUNK], d_flat[s:s + _CHUNK]
            torch.add(d, b, alpha=mu, out=b)
            p_flat[s:s + _CHUNK].add_(d, alpha=-lr).add_(b, alpha=-lr * mu)


def _check(params: torch.Tensor, other: torch.Tensor, name: str) -> None:
    if params.dtype != torch.float32 or other.dtype != torch.float32:
        raise ValueError(f"params and {name} must be float32, got {params.dtype} and {other.dtype}")
    if params.shape != other.shape:
        raise ValueError(f"shape mismatch: params {tuple(params.shape)} vs {name} {tuple(other.shape)}")
    if params.device != other.device:
        raise ValueError(f"params on {params.device}, {name} on {other.device}")
    if not params.is_contiguous() or (name == "momentum_buf" and not other.is_contiguous()):
        raise ValueError(f"params{' and momentum_buf' if name == 'momentum_buf' else ''} must be contiguous")
