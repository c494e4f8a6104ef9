"""``LocalFragments.apply`` writes a merged fragment into the parameters with fewer calls into torch
than ``LearnerFragment.apply`` + ``apply_global`` + scatter: the same parameters and the same
protocol state, bit for bit, under every policy."""

from __future__ import annotations

import copy

import pytest
import torch

from ddiloco.algorithm.learner_fragment import APPLY_POLICIES
from ddiloco.fragments.outer_gradient import gather, scatter
from ddiloco.fragments.partition import partition_tensors
from ddiloco.learner.local import LocalFragments


def _model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4)).to(dtype)


def _trained(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen).to(p.dtype) * 1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("policy", APPLY_POLICIES)
@pytest.mark.parametrize("sent", [True, False])
def test_apply_matches_the_policys_expression(dtype: torch.dtype, policy: str, sent: bool) -> None:
    model = _model(dtype)
    params = dict(model.named_parameters())
    layout = partition_tensors(list(params.items()), 2)
    local = LocalFragments(params, layout, apply_policy=policy, mix_alpha=0.25)
    local.join({}, start_step=0)
    _trained(model, 1)
    local.trained(100)
    if sent:  # a contribution went, and training went on after it
        for frag in layout:
            current, _ = local.contribution(frag.index)
            local[frag.index].send(1, current, keep_values=policy == "replay")
        _trained(model, 2)
    gen = torch.Generator().manual_seed(7)
    for frag in layout:
        values = gather(frag, params) + torch.randn(frag.numel, generator=gen) * 1e-2
        twin = copy.deepcopy(local[frag.index])
        expected = twin.apply(policy, local=gather(frag, params), values=values, version=1, step=3,
                              alpha=0.25)
        assert expected is not None
        want = {name: t.detach().clone() for name, t in params.items()}
        scatter(frag, expected, want)
        assert local.apply(frag.index, values, 1, 3, resync=False) == policy
        for name, t in params.items():
            assert torch.equal(t.detach(), want[name]), (policy, name)
        state = local[frag.index]
        assert (state.version, state.counters, state.window_start, state.sent) == (
            twin.version, twin.counters, twin.window_start, twin.sent)
        assert state.base is values
        assert local.apply(frag.index, values, 1, 4, resync=False) is None  # not newer: nothing changes
        for name, t in params.items():
            assert torch.equal(t.detach(), want[name])


def test_a_resync_overwrites_and_a_wrong_size_changes_nothing() -> None:
    model = _model(torch.float32)
    params = dict(model.named_parameters())
    layout = partition_tensors(list(params.items()), 2)
    local = LocalFragments(params, layout, apply_policy="replay", mix_alpha=0.5)
    local.join({}, start_step=0)
    _trained(model, 1)
    frag = layout[0]
    values = torch.randn(frag.numel)
    assert local.apply(frag.index, values, 0, 2, resync=True) == "overwrite"  # even an older version
    assert torch.equal(gather(frag, params), values)
    before = {name: t.detach().clone() for name, t in params.items()}
    state_before = copy.deepcopy(local[frag.index])
    with pytest.raises(ValueError, match="values, got"):
        local.apply(frag.index, torch.zeros(frag.numel + 1), 5, 3, resync=False)
    assert all(torch.equal(t.detach(), before[n]) for n, t in params.items())
    state = local[frag.index]
    assert (state.version, state.counters, torch.equal(state.base, state_before.base)) == (
        state_before.version, state_before.counters, True)


@pytest.mark.parametrize("policy", APPLY_POLICIES)
def test_values_of_another_dtype_or_shape_apply_as_flat_fp32(policy: str) -> None:
    model = _model(torch.float32)
    params = dict(model.named_parameters())
    layout = partition_tensors(list(params.items()), 1)
    local = LocalFragments(params, layout, apply_policy=policy, mix_alpha=0.5)
    local.join({}, start_step=0)
    frag = layout[0]
    current, _ = local.contribution(0)
    local[0].send(1, current, keep_values=policy == "replay")
    twin = copy.deepcopy(local)
    values = (gather(frag, params) + 0.01).double()
    assert local.apply(0, values.reshape(2, -1), 1, 3, resync=False) == policy
    assert twin.apply(0, values.float(), 1, 3, resync=False) == policy
    assert torch.equal(gather(frag, params), gather(frag, twin.params))
    assert local[0].base.dtype == torch.float32 and local[0].base.dim() == 1
