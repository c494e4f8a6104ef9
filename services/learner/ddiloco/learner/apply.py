"""Applying a merged global fragment on the learner, at a step boundary.

Three policies (docs/algorithm.md, learner step 3), as pure functions of flat fp32 buffers:

- ``overwrite`` (paper default): theta = Theta. The local progress made on this fragment since it
  was sent is dropped; the next contribution's counters start from zero at the apply.
- ``mix`` (Streaming DiLoCo): theta = alpha * theta + (1 - alpha) * Theta.
- ``replay`` (ours): theta = Theta + (theta_now - theta_at_send): the global result plus exactly
  the local progress made since the fragment was sent, so no local work is discarded.

For mix and replay the counters keep the tokens/steps accumulated since the send, because the
next contribution (``base - theta`` with the new base ``Theta``) carries that progress.
"""

from __future__ import annotations

import torch

from ddiloco.learner.config import APPLY_POLICIES


def apply_global(policy: str, *, local: torch.Tensor, global_: torch.Tensor, reference: torch.Tensor,
                 alpha: float = 0.5) -> torch.Tensor:
    """The new local values of a fragment (a new tensor; inputs are not modified).

    ``reference`` is the point up to which local progress has been handed to the synchronizer:
    the values at the last send, or the old base when nothing was sent since it (another learner's
    merge arrived first). Replay keeps exactly the progress beyond it.
    """
    if policy not in APPLY_POLICIES:
        raise ValueError(f"unknown apply policy {policy!r}")
    if local.shape != global_.shape:
        raise ValueError(f"shape mismatch: local {tuple(local.shape)} vs global {tuple(global_.shape)}")
    if policy == "overwrite":
        return global_.clone()
    if policy == "mix":
        return torch.lerp(global_, local, alpha)
    return global_ + (local - reference)


def counters_after_apply(policy: str, now: tuple[int, int], at_send: tuple[int, int] | None) -> tuple[int, int]:
    """(tokens, steps) the next contribution starts from after applying under ``policy``.

    ``at_send`` is the counters' value at the last send since the old base (None: nothing sent).
    """
    if policy == "overwrite":
        return 0, 0
    if at_send is None:
        return now
    return now[0] - at_send[0], now[1] - at_send[1]
