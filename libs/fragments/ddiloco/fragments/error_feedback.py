"""Error feedback for lossy codecs: what quantisation drops this round is sent the next.

The learner adds the carried residual to each new outer gradient before encoding and keeps
``residual = compensated - decode(encode(compensated))``. The running sum of what was sent then
tracks the running sum of the true outer gradients to within one quantisation step, however many
rounds pass (the error never accumulates), which is what makes int8 and other lossy codecs safe.

A newer outer gradient that *replaces* a sent one still waiting for its merge (both measured from
the same base, so the receiver keeps only the newer) must not carry the replaced one's residual:
what that one sent never counts, so the newer one is compensated with the residual from before it
(``replaces=True``), or one quantisation step too much would reach the model.
"""

from __future__ import annotations

import torch

from ddiloco.fragments.codec import Codec


class ErrorFeedback:
    """Carried quantisation residual per fragment (fp32)."""

    def __init__(self) -> None:
        self._residual: dict[int, torch.Tensor] = {}
        self._before: dict[int, torch.Tensor | None] = {}
        """fragment -> the residual from before the last encode (what a replacement starts from)."""

    def compensate(self, fragment: int, delta: torch.Tensor, replaces: bool = False) -> torch.Tensor:
        """``delta`` plus the residual carried for ``fragment`` (a new tensor); with ``replaces``,
        the residual from before the last encode (the newer outer gradient replaces that one)."""
        residual = self._before.get(fragment) if replaces else self._residual.get(fragment)
        if residual is None or residual.shape != delta.shape:
            return delta.float().clone()
        return delta.float() + residual

    def record(self, fragment: int, compensated: torch.Tensor, sent: torch.Tensor) -> None:
        """Remember what encoding dropped: ``compensated - sent``."""
        self._residual[fragment] = (compensated - sent).float()

    def encode(self, fragment: int, delta: torch.Tensor, codec: Codec,
               replaces: bool = False) -> tuple[bytes, torch.Tensor]:
        """Compensate, encode and record in one call; returns (payload, values the receiver sees).
        ``replaces``: ``delta`` supersedes the last one encoded for ``fragment``, which the receiver
        will drop unmerged (see the module docstring)."""
        if not replaces:
            self._before[fragment] = self._residual.get(fragment)
        compensated = self.compensate(fragment, delta, replaces=replaces)
        payload = codec.encode(compensated)
        sent = codec.decode(payload, compensated.numel())
        self.record(fragment, compensated, sent)
        return payload, sent

    def reset(self, fragment: int | None = None) -> None:
        """Forget residuals (all, or one fragment's), e.g. after a resync."""
        if fragment is None:
            self._residual.clear()
            self._before.clear()
        else:
            self._residual.pop(fragment, None)
            self._before.pop(fragment, None)
