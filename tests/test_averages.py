"""One moving average (``ddiloco.core.averages.RunningAverage``) serves the synchronizer, the
simulator and a learner's pace."""

from __future__ import annotations

import pytest

from ddiloco.algorithm.policies import RunningAverage as FromPolicies
from ddiloco.core.averages import RunningAverage


def test_the_policies_average_is_the_core_one():
    assert FromPolicies is RunningAverage


def test_a_clipped_average_counts_a_long_sample_at_most_clip_times_the_average():
    pace = RunningAverage(0.1, clip=4.0)
    assert pace.update(1.0) == 1.0
    assert pace.update(100.0) == pytest.approx(1.0 + 0.1 * (4.0 - 1.0))  # a pause counts as 4x
    assert pace.update(float("nan")) == pytest.approx(1.3)
    with pytest.raises(ValueError):
        RunningAverage(0.1, clip=0.5)


def test_a_clipped_average_is_the_learners_step_pace():
    from ddiloco.learner import sync

    StepPace = getattr(sync, "StepPace", None)
    if StepPace is None:
        pytest.skip("the learner paces itself with RunningAverage directly")
    samples = [0.0, 0.02, 0.02, 0.5, 30.0, 0.02, 0.0, 0.03, 1e-6, 2.0, 0.02]
    for first in (samples, samples[1:]):
        pace, average = StepPace(), RunningAverage(0.1, clip=4.0)
        for s in first:
            assert average.update(s) == pytest.approx(pace.update(s), rel=1e-12, abs=0)
