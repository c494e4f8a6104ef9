"""Error feedback: with it, what the receiver has summed tracks the true sum within one step.

The invariant (Seide et al. 2014, "1-bit SGD"; Karimireddy et al. 2019, "EF-SGD"): after round t,
``sum(true) - sum(sent) == residual_t``, and the residual is one rounding error of one encode,
so it stays within half a quantisation step however many rounds pass. Without feedback the
rounding errors add up like a random walk; the test shows they leave that bound, so the bound
is not vacuous.
"""

from __future__ import annotations

import pytest
import torch

from ddiloco.fragments.codec import Bf16ZstdCodec, Fp32Codec, Int8BlockCodec
from ddiloco.fragments.error_feedback import ErrorFeedback

ROUNDS = 100
N = 4096


def _bf16_step(values: torch.Tensor) -> torch.Tensor:
    """The bf16 quantisation step (one unit in the last place) at each value."""
    exponent = torch.frexp(values.abs().clamp_min(2.0**-126))[1]
    return torch.ldexp(torch.ones_like(values), exponent - 8)


def _int8_step(codec: Int8BlockCodec):  # type: ignore[no-untyped-def]
    return codec.quantization_step


CASES = [
    pytest.param(Int8BlockCodec(block_size=256), _int8_step(Int8BlockCodec(block_size=256)), id="int8_block"),
    pytest.param(Bf16ZstdCodec(threads=1), _bf16_step, id="bf16_zstd"),
]


def _deltas(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-4, -1, N)  # magnitudes across three decades, like real outer gradients
    return [torch.randn(N, generator=gen) * scale for _ in range(ROUNDS)]


def _run(codec, deltas: list[torch.Tensor], feedback: bool):  # type: ignore[no-untyped-def]
    ef = ErrorFeedback()
    true_sum = torch.zeros(N, dtype=torch.float64)
    sent_sum = torch.zeros(N, dtype=torch.float64)
    compensated = deltas[0]
    for delta in deltas:
        if feedback:
            compensated = ef.compensate(3, delta)
            payload, sent = ef.encode(3, delta, codec)
        else:
            compensated = delta
            payload = codec.encode(delta)
            sent = codec.decode(payload, N)
        assert torch.equal(codec.decode(payload, N), sent)  # what the receiver sees
        true_sum += delta.double()
        sent_sum += sent.double()
    return (true_sum - sent_sum).abs(), compensated


@pytest.mark.parametrize(("codec", "step_of"), CASES)
def test_running_sum_stays_within_one_step_with_feedback(codec, step_of) -> None:  # type: ignore[no-untyped-def]
    deltas = _deltas(0)
    error, last_compensated = _run(codec, deltas, feedback=True)
    bound = step_of(last_compensated).double()
    assert bool((error <= bound).all()), float((error / bound).max())
    # And the bound is tight enough to matter: without feedback the error leaves it.
    error_without, _ = _run(codec, deltas, feedback=False)
    bound_without = step_of(deltas[-1]).double()
    assert float((error_without / bound_without).max()) > 3.0
    assert float(error_without.mean()) > 3 * float(error.mean())


@pytest.mark.parametrize(("codec", "step_of"), CASES)
def test_residual_equals_what_encoding_dropped(codec, step_of) -> None:  # type: ignore[no-untyped-def]
    ef = ErrorFeedback()
    delta = _deltas(1)[0]
    _, sent = ef.encode(0, delta, codec)
    # The next compensation adds exactly the residual: compensate(0) == delta - sent.
    assert torch.equal(ef.compensate(0, torch.zeros(N)), delta - sent)
    assert bool(((delta - sent).abs() <= 0.5 * step_of(delta) * (1 + 1e-5)).all())


def test_lossless_codec_leaves_no_residual() -> None:
    ef = ErrorFeedback()
    delta = _deltas(2)[0]
    _, sent = ef.encode(0, delta, Fp32Codec())
    assert torch.equal(sent, delta)
    assert torch.equal(ef.compensate(0, torch.zeros(N)), torch.zeros(N))


def test_residuals_are_per_fragment_and_resettable() -> None:
    codec = Int8BlockCodec(block_size=64)
    ef = ErrorFeedback()
    a, b = _deltas(3)[:2]
    ef.encode(0, a, codec)
    ef.encode(1, b, codec)
    res0, res1 = ef.compensate(0, torch.zeros(N)), ef.compensate(1, torch.zeros(N))
    assert not torch.equal(res0, res1) and res0.abs().sum() > 0
    ef.reset(0)
    assert torch.equal(ef.compensate(0, a), a)
    assert torch.equal(ef.compensate(1, torch.zeros(N)), res1)
    ef.reset()
    assert torch.equal(ef.compensate(1, b), b)


def test_compensate_does_not_alias_its_input() -> None:
    ef = ErrorFeedback()
    delta = torch.ones(8)
    out = ef.compensate(0, delta)
    out += 1
    assert torch.equal(delta, torch.ones(8))


def test_a_new_shape_drops_the_stale_residual() -> None:
    ef = ErrorFeedback()
    ef.encode(0, torch.randn(1000) * 0.01, Int8BlockCodec())
    fresh = torch.randn(10)
    assert torch.equal(ef.compensate(0, fresh), fresh)


def _merged_error(codec, replaces: bool) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def]
    """A learner whose every other answer is superseded before its merge: the newer answer is
    measured from the same base, so it holds the older one's progress and the receiver keeps only
    it. Returns (|trained - merged| after the last merge, the last compensated values)."""
    ef = ErrorFeedback()
    deltas = _deltas(5)
    trained = torch.zeros(N, dtype=torch.float64)
    merged = torch.zeros(N, dtype=torch.float64)
    since_base = torch.zeros(N)
    compensated = deltas[0]
    for i, delta in enumerate(deltas):
        trained += delta.double()
        since_base += delta
        replacing = i % 2 == 1  # the answer of step i - 1 is still in the inbox: this one replaces it
        compensated = ef.compensate(3, since_base, replaces=replacing and replaces)
        _, sent = ef.encode(3, since_base, codec, replaces=replacing and replaces)
        if replacing:  # merged: the receiver sums only this one; the next answers start from it
            merged += sent.double()
            since_base = torch.zeros(N)
    return (trained - merged).abs(), compensated


@pytest.mark.parametrize(("codec", "step_of"), CASES)
def test_a_superseded_answer_leaves_no_residual_behind(codec, step_of) -> None:  # type: ignore[no-untyped-def]
    error, last_compensated = _merged_error(codec, replaces=True)
    assert bool((error <= step_of(last_compensated).double()).all())
    # carrying the superseded answer's residual as well puts one rounding error per replacement
    # into the model: the running error walks out of the bound
    error_carried, last = _merged_error(codec, replaces=False)
    assert float((error_carried / step_of(last).double()).max()) > 3.0
    assert float(error_carried.mean()) > 3 * float(error.mean())


def test_a_replacement_does_not_move_the_residual_it_starts_from() -> None:
    codec = Int8BlockCodec(block_size=64)
    ef = ErrorFeedback()
    a, b, c = _deltas(6)[:3]
    ef.encode(0, a, codec)
    before_b = ef.compensate(0, torch.zeros(N))  # a's residual
    ef.encode(0, b, codec)
    ef.encode(0, c, codec, replaces=True)  # c replaces b: compensated with a's residual
    ef.encode(0, c, codec, replaces=True)  # and a second replacement starts there again
    assert torch.equal(ef.compensate(0, torch.zeros(N), replaces=True), before_b)
    ef.reset(0)
    assert torch.equal(ef.compensate(0, a, replaces=True), a)
