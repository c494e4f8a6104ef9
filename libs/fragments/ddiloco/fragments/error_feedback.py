"""Error feedback for lossy codecs: what quantisation drops this round is sent the next.

The learner adds the carried residual to each new outer gradient before encoding and keeps
``residual = compensated - decode(encode(compensated))``. The running sum of what was sent then
tracks the running sum of the true outer gradients to within one quantisation step, however many
rounds pass (the error never accumulates), which is what makes int8 and other lossy codecs safe.
"""

from __future__ import annotations

import torch

from ddiloco.fragments.codec import Codec


class ErrorFeedback:
    """Carried quantisation residual per fragment (fp32)."""

    def __init__(self) -> None:
        self._residual: dict[int, torch.Tensor] = {}

    def compensate(self, fragment: int, delta: torch.Tensor) -> torch.Tensor:
        """``delta`` plus the residual carried for ``fragment`` (a new tensor)."""
        residual = self._residual.get(fragment)
        if residual is None or residual.shape != delta.shape:
            return delta.float().clone()
        return delta.float() + residual

    def record(self, fragment: int, compensated: torch.Tensor, sent: torch.Tensor) -> None:
        """Remember what encoding dropped: ``compensated - sent``."""
        self._residual[fragment] = (compensated - sent).float()

    def encode(self, fragment: int, delta: torch.Tensor, codec: Codec) -> tuple[bytes, torch.Tensor]:
        """Compensate, encode and record in one call; returns (payload, values the receiver sees)."""
        compensated = self.compensate(fragment, delta)
        payload = codec.encode(compensated)
        sent = codec.decode(payload, compensated.numel())
        self.record(fragment, compensated, sent)
        return payload, sent

    def reset(self, fragment: int | None = None) -> None:
        """Forget residuals (all, or one fragment's), e.g. after a resync."""
        if fragment is None:
            self._residual.clear()
        else:
            self._residual.pop(fragment, None)
