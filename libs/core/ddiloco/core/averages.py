"""The exponential moving average every part uses: the synchronizer's step, quorum and sync
times, the simulator's, and a learner's pace (``RunningAverage(0.1, clip=4.0)``)."""

from __future__ import annotations

import math


class RunningAverage:
    """Exponential moving average; the first sample initialises it, and a non-finite sample is
    ignored. With ``clip``, a sample counts at most ``clip`` times the average (one long step, a
    stop or a pause, moves it a little and it recovers within a few samples); an average of 0 is
    then taken as no average yet, since every sample would clip to it."""

    def __init__(self, alpha: float = 0.2, initial: float | None = None, *, clip: float | None = None) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if clip is not None and not clip >= 1:
            raise ValueError(f"clip must be >= 1, got {clip}")
        self.alpha, self.clip = alpha, clip
        self.value = initial

    def update(self, sample: float) -> float:
        if not math.isfinite(sample):
            return self.value or 0.0
        if self.value is None or (self.clip is not None and self.value == 0.0):
            self.value = sample
        else:
            if self.clip is not None:
                sample = min(sample, self.clip * self.value)
            self.value += self.alpha * (sample - self.value)
        return self.value

    def get(self, default: float = 0.0) -> float:
        return default if self.value is None else self.value


__all__ = ["RunningAverage"]
