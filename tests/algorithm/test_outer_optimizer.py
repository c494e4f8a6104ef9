"""OuterNesterov against torch.optim.SGD(nesterov=True, dampening=0), the reference DiLoCo uses.

The merged Delta plays the gradient: torch's step with ``p.grad = delta`` must give the same
params and momentum, to fp32 rounding (ours fuses the update into three multiply-adds, so the
last bit may differ). Golden numerics live
in tests/algorithm/golden/outer_nesterov.json; regenerate them (after a deliberate numerical change, and
review the diff) with ``DDILOCO_REWRITE_GOLDEN=1 pytest tests/algorithm/test_outer_optimizer.py``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib

import pytest
import torch

from ddiloco.algorithm import outer_optimizer as outer_mod
from ddiloco.algorithm.outer_optimizer import OuterNesterov

GOLDEN = pathlib.Path(__file__).parent / "golden" / "outer_nesterov.json"
REWRITE = os.environ.get("DDILOCO_REWRITE_GOLDEN") == "1"


def torch_reference(theta0: torch.Tensor, deltas: list[torch.Tensor], lr: float, momentum: float):
    p = torch.nn.Parameter(theta0.clone())
    opt = torch.optim.SGD([p], lr=lr, momentum=momentum, nesterov=momentum > 0, dampening=0.0)
    history = []
    for d in deltas:
        p.grad = d.clone()
        opt.step()
        buf = opt.state[p].get("momentum_buffer")
        history.append((p.detach().clone(), None if buf is None else buf.clone()))
    return history


@pytest.mark.parametrize("n", [1, 1000, outer_mod._CHUNK + 17])
@pytest.mark.parametrize("lr, momentum", [(0.7, 0.9), (0.5, 0.5), (1.0, 0.99)])
def test_matches_torch_sgd_nesterov(n, lr, momentum):
    gen = torch.Generator().manual_seed(n)
    theta0 = torch.randn(n, generator=gen)
    deltas = [torch.randn(n, generator=gen) * 10.0 ** -k for k in range(6)]
    want = torch_reference(theta0, deltas, lr, momentum)
    opt = OuterNesterov(lr=lr, momentum=momentum)
    params, buf = theta0.clone(), torch.zeros(n)
    for k, d in enumerate(deltas):
        opt.step(params, buf, d)
        torch.testing.assert_close(params, want[k][0], rtol=1e-6, atol=1e-6, msg=f"params at step {k}")
        torch.testing.assert_close(buf, want[k][1], rtol=1e-6, atol=1e-6, msg=f"momentum at step {k}")


def test_first_step_buffer_equals_delta():
    # torch initialises the buffer to the gradient; ours starts at zero and mu*0 + D == D exactly.
    d = torch.randn(100)
    params, buf = torch.zeros(100), torch.zeros(100)
    OuterNesterov().step(params, buf, d)
    assert torch.equal(buf, d)
    torch.testing.assert_close(params, -0.7 * (d + 0.9 * d))


def test_hand_computed_scalar_steps():
    params, buf = torch.tensor([1.0]), torch.zeros(1)
    opt = OuterNesterov(lr=0.7, momentum=0.9)
    opt.step(params, buf, torch.tensor([1.0]))
    # b = 1; theta = 1 - 0.7 * (1 + 0.9 * 1) = -0.33
    assert buf.item() == pytest.approx(1.0)
    assert params.item() == pytest.approx(-0.33, abs=1e-6)
    opt.step(params, buf, torch.tensor([1.0]))
    # b = 0.9 + 1 = 1.9; theta = -0.33 - 0.7 * (1 + 1.71) = -2.227
    assert buf.item() == pytest.approx(1.9, abs=1e-6)
    assert params.item() == pytest.approx(-2.227, abs=1e-6)


def test_plain_sgd_when_momentum_is_zero():
    gen = torch.Generator().manual_seed(3)
    theta0 = torch.randn(500, generator=gen)
    deltas = [torch.randn(500, generator=gen) for _ in range(3)]
    want = torch_reference(theta0, deltas, 0.7, 0.0)
    params = theta0.clone()
    for k, d in enumerate(deltas):
        OuterNesterov(momentum=0.0).step(params, None, d)
        assert torch.equal(params, want[k][0])
    buf = torch.zeros(500)
    OuterNesterov(momentum=0.0).step(params, buf, deltas[0])
    assert torch.count_nonzero(buf) == 0  # untouched


def test_shaped_params_and_delta_is_not_modified():
    params, buf = torch.randn(8, 16), torch.zeros(8, 16)
    d = torch.randn(8, 16)
    d_before = d.clone()
    want = torch_reference(params, [d], 0.7, 0.9)[0]
    OuterNesterov().step(params, buf, d)
    assert torch.equal(d, d_before)
    torch.testing.assert_close(params, want[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(buf, want[1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kwargs", [
    {"lr": 0.0}, {"lr": -0.1}, {"lr": float("nan")}, {"lr": float("inf")},
    {"momentum": -0.1}, {"momentum": 1.0}, {"momentum": float("nan")},
])
def test_config_validation(kwargs):
    with pytest.raises(ValueError):
        OuterNesterov(**kwargs)


def test_config_is_frozen_and_keyword_only():
    with pytest.raises(dataclasses.FrozenInstanceError):
        OuterNesterov().lr = 1.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        OuterNesterov(0.7, 0.9)  # type: ignore[misc]
    assert OuterNesterov() == OuterNesterov(lr=0.7, momentum=0.9)


def test_bad_step_inputs_raise_and_change_nothing():
    opt = OuterNesterov()
    params, buf = torch.ones(10), torch.zeros(10)
    cases = [
        (params, buf, torch.ones(11)),                          # shape
        (params, buf, torch.ones(10, dtype=torch.float64)),     # dtype
        (params, torch.zeros(10, dtype=torch.bfloat16), torch.ones(10)),
        (params, None, torch.ones(10)),                         # momentum needs a buffer
        (params, params, torch.ones(10)),                       # aliasing
        (params, buf, buf),
        (params, buf, params[:]),
    ]
    for p, b, d in cases:
        with pytest.raises(ValueError):
            opt.step(p, b, d)
    with pytest.raises(ValueError, match="contiguous"):
        opt.step(torch.ones(10, 2).t(), torch.zeros(2, 10), torch.ones(2, 10))
    assert torch.equal(params, torch.ones(10)) and torch.equal(buf, torch.zeros(10))


def test_golden_fixture():
    if REWRITE or not GOLDEN.exists():
        if not REWRITE:
            pytest.fail(f"{GOLDEN} is missing; create it with DDILOCO_REWRITE_GOLDEN=1")
        gen = torch.Generator().manual_seed(2026)
        theta0 = torch.randn(12, generator=gen)
        deltas = [torch.randn(12, generator=gen) * 0.1 for _ in range(3)]
        params, buf = theta0.clone(), torch.zeros(12)
        steps = []
        for d in deltas:
            OuterNesterov().step(params, buf, d)
            steps.append({"delta": d.tolist(), "params": params.tolist(), "momentum": buf.tolist()})
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(json.dumps({
            "about": "OuterNesterov(lr=0.7, momentum=0.9) golden numerics; rewrite with "
                     "DDILOCO_REWRITE_GOLDEN=1 pytest tests/algorithm/test_outer_optimizer.py",
            "lr": 0.7, "momentum": 0.9, "params0": theta0.tolist(), "steps": steps}, indent=1) + "\n")
        pytest.skip(f"rewrote {GOLDEN}")
    doc = json.loads(GOLDEN.read_text())
    opt = OuterNesterov(lr=doc["lr"], momentum=doc["momentum"])
    params = torch.tensor(doc["params0"], dtype=torch.float32)
    buf = torch.zeros_like(params)
    deltas = [torch.tensor(s["delta"], dtype=torch.float32) for s in doc["steps"]]
    want = torch_reference(params, deltas, doc["lr"], doc["momentum"])
    assert len(doc["steps"]) == 3
    for k, (s, d) in enumerate(zip(doc["steps"], deltas, strict=True)):
        opt.step(params, buf, d)
        torch.testing.assert_close(params, torch.tensor(s["params"]), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(buf, torch.tensor(s["momentum"]), rtol=1e-6, atol=1e-6)
        # The fixture itself agrees with torch, so a bad rewrite cannot pin a bug.
        torch.testing.assert_close(torch.tensor(s["params"]), want[k][0], rtol=1e-6, atol=1e-6)


def test_momentum_warmup_ramps_the_momentum_over_a_fragments_first_outer_steps() -> None:
    outer = OuterNesterov(lr=0.7, momentum=0.5, momentum_warmup=4)
    assert [outer.at(k).momentum for k in (1, 2, 3, 4, 5, 100)] == [0.125, 0.25, 0.375, 0.5, 0.5, 0.5]
    assert outer.at(1).lr == 0.7 and OuterNesterov(momentum=0.9).at(1).momentum == 0.9
    # the first step with the ramp is the step of an optimizer with that momentum
    params, buf, delta = torch.ones(8), torch.zeros(8), torch.full((8,), 0.1)
    outer.at(1).step(params, buf, delta)
    ref_params, ref_buf = torch.ones(8), torch.zeros(8)
    OuterNesterov(lr=0.7, momentum=0.125).step(ref_params, ref_buf, delta)
    assert torch.equal(params, ref_params) and torch.equal(buf, ref_buf)
    with pytest.raises(ValueError, match="warm-up"):
        OuterNesterov(momentum_warmup=-1)
