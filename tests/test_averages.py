"""One moving average (``ddiloco.core.averages.RunningAverage``) serves the synchronizer, the
simulator and a learner's pace."""

from __future__ import annotations

import pytest

from ddiloco.core.averages import RunningAverage


def test_a_clipped_average_counts_a_long_sample_at_most_clip_times_the_average():
    pace = RunningAverage(0.1, clip=4.0)
    assert pace.update(1.0) == 1.0
    assert pace.update(100.0) == pytest.approx(1.0 + 0.1 * (4.0 - 1.0))  # a pause counts as 4x
    assert pace.update(float("nan")) == pytest.approx(1.3)
    with pytest.raises(ValueError):
        RunningAverage(0.1, clip=0.5)
