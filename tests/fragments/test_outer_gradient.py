"""Outer gradients are fp32 math, and fragments gather/scatter losslessly.

The pitfall this guards against (docs/algorithm.md, learner step 2; the reason ``outer_gradient`` upcasts): a
per-step AdamW update on a weight of magnitude 0.02 is about lr = 1e-4 relative, far below
bf16's 2^-8 resolution, so ``bf16(base) - bf16(theta)`` is almost always exactly zero.
"""

from __future__ import annotations

import pytest
import torch

from ddiloco.fragments.outer_gradient import (
    BoundFragment,
    all_finite,
    gather,
    outer_gradient,
    scatter,
    segment_views,
)
from ddiloco.fragments.partition import partition_tensors


def _weights_and_small_update(n: int = 100_000, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(n, generator=gen) * 0.02
    update = torch.randn(n, generator=gen) * 2e-6  # ~ lr 1e-4 relative to the weights
    return base, base - update


def test_outer_gradient_is_base_minus_current_in_fp32() -> None:
    base, theta = _weights_and_small_update()
    delta = outer_gradient(base, theta)
    assert delta.dtype == torch.float32
    assert torch.equal(delta, base - theta)
    out = torch.empty_like(base)
    assert outer_gradient(base, theta, out=out) is out and torch.equal(out, delta)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_are_upcast_before_subtracting(dtype: torch.dtype) -> None:
    base, theta = _weights_and_small_update()
    base_lp = base.to(dtype)
    theta_lp = (base + 64 * (theta - base)).to(dtype)  # an update large enough to survive rounding
    delta = outer_gradient(base_lp, theta_lp)
    assert delta.dtype == torch.float32
    assert torch.equal(delta, base_lp.float() - theta_lp.float())
    # Mixed: fp32 base (the learner's copy) against low-precision parameters.
    mixed = outer_gradient(base, theta_lp)
    assert mixed.dtype == torch.float32 and torch.equal(mixed, base - theta_lp.float())


def test_small_updates_vanish_in_bf16_but_survive_in_fp32() -> None:
    base, theta = _weights_and_small_update()
    true_update = (base.double() - theta.double())
    ours = outer_gradient(base, theta).double()
    naive = (base.to(torch.bfloat16) - theta.to(torch.bfloat16)).double()
    vanished = float((naive == 0).float().mean())
    assert vanished > 0.9, vanished  # bf16 subtraction loses >90% of the updates outright
    naive_error = float((naive - true_update).norm() / true_update.norm())
    our_error = float((ours - true_update).norm() / true_update.norm())
    assert naive_error > 0.5 and our_error < 1e-3, (naive_error, our_error)


def test_shape_mismatch_raises() -> None:
    with pytest.raises(ValueError, match="shape"):
        outer_gradient(torch.zeros(4), torch.zeros(5))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(40, 8), torch.nn.Linear(8, 16), torch.nn.LayerNorm(16),
                                torch.nn.Linear(16, 40))
    model[2].to(torch.bfloat16)
    return model


def test_gather_scatter_round_trip() -> None:
    model, other = _model(), _model()
    with torch.no_grad():
        for p in other.parameters():
            p.uniform_(-1, 1)
    params, other_params = dict(model.named_parameters()), dict(other.named_parameters())
    layout = partition_tensors(params, 3)
    for fragment in layout:
        flat = gather(fragment, params)
        assert flat.dtype == torch.float32 and flat.shape == (fragment.numel,)
        for (name, start, end), view in zip(fragment.segments(), segment_views(fragment, flat), strict=True):
            assert torch.equal(flat[start:end], params[name].detach().float().reshape(-1))
            assert view.shape == params[name].shape
        scatter(fragment, flat, other_params)
    for name, p in model.named_parameters():
        q = other_params[name]
        assert q.dtype == p.dtype and torch.equal(q, p), name


def test_gather_into_a_given_buffer_and_scatter_rounds_to_the_parameter_dtype() -> None:
    model = _model()
    params = dict(model.named_parameters())
    layout = partition_tensors(params, 1)
    fragment = layout[0]
    out = torch.full((fragment.numel,), float("nan"))
    assert gather(fragment, params, out=out) is out
    assert bool(torch.isfinite(out).all())
    scatter(fragment, out + 1e-3, params)
    norm = params["2.weight"]
    assert norm.dtype == torch.bfloat16
    start, end = dict((n, (s, e)) for n, s, e in fragment.segments())["2.weight"]
    assert torch.equal(norm.reshape(-1), (out[start:end] + 1e-3).to(torch.bfloat16))


def test_gather_and_scatter_reject_wrong_buffers() -> None:
    model = _model()
    params = dict(model.named_parameters())
    fragment = partition_tensors(params, 2)[0]
    with pytest.raises(ValueError):
        gather(fragment, params, out=torch.empty(fragment.numel + 1))
    with pytest.raises(ValueError):
        gather(fragment, params, out=torch.empty(fragment.numel, dtype=torch.float64))
    with pytest.raises(ValueError):
        scatter(fragment, torch.zeros(fragment.numel - 1), params)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_all_finite_finds_any_nan_or_infinity(dtype: torch.dtype) -> None:
    values = torch.randn(10_001, generator=torch.Generator().manual_seed(1)).to(dtype)
    assert all_finite(values) and all_finite(values[:0])
    for bad in (float("nan"), float("inf"), float("-inf")):
        for where in (0, 5_000, 10_000):
            poisoned = values.clone()
            poisoned[where] = bad
            assert not all_finite(poisoned), (bad, where)
    both = values.clone()
    both[3], both[9] = float("inf"), float("-inf")  # their sum is NaN: still caught
    assert not all_finite(both)


def test_all_finite_accepts_finite_values_whose_sum_overflows() -> None:
    big = torch.full((8,), torch.finfo(torch.float32).max)
    assert not bool(torch.isfinite(big.sum())), "the sum overflows: the exact check must decide"
    assert all_finite(big) and all_finite(-big)
    big[5] = float("nan")
    assert not all_finite(big)


def _sequential(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_bound_fragment_gathers_and_scatters_what_the_functions_do(dtype: torch.dtype) -> None:
    model = _sequential(dtype)
    params = dict(model.named_parameters())
    layout = partition_tensors(list(params.items()), 2)
    for frag in layout:
        bound = BoundFragment(frag, params)
        assert (bound._views is not None) == (dtype == torch.float32)  # bf16 takes the functions
        assert torch.equal(bound.gather(), gather(frag, params))
        out = torch.empty(frag.numel)
        assert bound.gather(out) is out and torch.equal(out, gather(frag, params))
        new = torch.randn(frag.numel)
        bound.scatter(new)
        assert torch.equal(gather(frag, params), new.to(dtype).float())


def test_a_bound_fragment_follows_parameters_given_new_storage() -> None:
    model = _sequential()
    params = dict(model.named_parameters())
    frag = partition_tensors(list(params.items()), 1)[0]
    bound = BoundFragment(frag, params)
    model.double().float()  # every parameter's .data replaced: the views made before see old storage
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    assert torch.equal(bound.gather(), gather(frag, params))
    params["0.weight"].data = torch.zeros(16, 8)
    assert torch.equal(bound.gather(), gather(frag, params))
    values = torch.arange(frag.numel, dtype=torch.float32)
    bound.scatter(values)
    assert torch.equal(gather(frag, params), values)
    assert torch.equal(model[0].weight.reshape(-1), values[: 16 * 8])  # written into the live parameter


def test_a_bound_fragment_takes_non_contiguous_parameters_through_the_functions() -> None:
    model = _sequential()
    params = dict(model.named_parameters())
    params["0.weight"].data = torch.randn(8, 16).t()  # same shape, not contiguous
    frag = partition_tensors(list(params.items()), 1)[0]
    bound = BoundFragment(frag, params)
    assert bound._views is None
    assert torch.equal(bound.gather(), gather(frag, params))
    values = torch.randn(frag.numel)
    bound.scatter(values)
    assert torch.equal(gather(frag, params), values)


def test_a_bound_fragment_rejects_wrong_buffers_and_changes_nothing() -> None:
    model = _sequential()
    params = dict(model.named_parameters())
    frag = partition_tensors(list(params.items()), 1)[0]
    bound = BoundFragment(frag, params)
    before = gather(frag, params)
    with pytest.raises(ValueError, match="out buffer"):
        bound.gather(torch.empty(frag.numel + 1))
    with pytest.raises(ValueError, match="out buffer"):
        bound.gather(torch.empty(frag.numel, dtype=torch.float64))
    with pytest.raises(ValueError, match="flat buffer has"):
        bound.scatter(torch.zeros(frag.numel - 1))
    assert torch.equal(gather(frag, params), before)


@pytest.mark.parametrize("layout_of", ["contiguous fp32", "one buffer", "bf16", "not contiguous"])
def test_a_bound_replay_is_the_expression_bit_for_bit(layout_of: str) -> None:
    model = _sequential(torch.bfloat16 if layout_of == "bf16" else torch.float32)
    params = dict(model.named_parameters())
    if layout_of == "not contiguous":
        params["0.weight"].data = torch.randn(8, 16).t()
    gen = torch.Generator().manual_seed(3)
    for frag in partition_tensors(list(params.items()), 2):
        bound = BoundFragment(frag, params, adopt=layout_of == "one buffer")
        fast = all(params[t.name].dtype == torch.float32 and params[t.name].is_contiguous() for t in frag.tensors)
        assert (bound._views is not None) == fast and (fast or layout_of not in ("contiguous fp32", "one buffer"))
        assert (bound.flat is not None) == (layout_of == "one buffer" or (fast and len(frag.tensors) == 1))
        current = gather(frag, params)
        reference = current - torch.randn(frag.numel, generator=gen) * 1e-3
        values = reference + torch.randn(frag.numel, generator=gen) * 1e-2
        want = values + (current - reference)  # apply_global's replay
        bound.replay(reference, values)
        assert torch.equal(gather(frag, params), want.to(params[frag.tensors[0].name].dtype).float())


def test_a_bound_replay_of_wrong_buffers_is_refused_and_changes_nothing() -> None:
    model = _sequential()
    params = dict(model.named_parameters())
    frag = partition_tensors(list(params.items()), 1)[0]
    bound = BoundFragment(frag, params)
    before = gather(frag, params)
    good = torch.zeros(frag.numel)
    for reference, values in ((torch.zeros(frag.numel - 1), good), (good, torch.zeros(frag.numel + 1)),
                              (good.double(), good), (good, good.half())):
        with pytest.raises(ValueError, match="must be fp32 with"):
            bound.replay(reference, values)
    assert torch.equal(gather(frag, params), before)


def _adam_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    gen = torch.Generator().manual_seed(5)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 8, generator=gen)).square().mean().backward()
        opt.step()


def test_adopting_lays_a_fragment_out_in_one_buffer_and_training_goes_on_as_before() -> None:
    model, twin = _sequential(), _sequential()
    opt, twin_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, twin))
    _adam_steps(model, opt, 2)
    _adam_steps(twin, twin_opt, 2)
    params = dict(model.named_parameters())
    objects = {name: t for name, t in params.items()}
    layout = partition_tensors(list(params.items()), 2)
    bounds = [BoundFragment(frag, params, adopt=True) for frag in layout]
    for name, t in model.named_parameters():  # the same parameters, their values unchanged
        assert t is objects[name] and torch.equal(t, dict(twin.named_parameters())[name])
    for frag, bound in zip(layout, bounds, strict=True):
        flat = bound.flat
        assert flat is not None and flat.numel() == frag.numel
        for spec, (_, start, end) in zip(frag.tensors, frag.segments(), strict=True):
            assert params[spec.name].data_ptr() == flat[start:end].data_ptr()
    _adam_steps(model, opt, 3)  # the optimizer's state and the gradients follow the parameters
    _adam_steps(twin, twin_opt, 3)
    for name, t in twin.named_parameters():
        assert torch.equal(params[name], t), name
    for frag, bound in zip(layout, bounds, strict=True):
        assert torch.equal(bound.gather(), gather(frag, params))
        values = torch.randn(frag.numel)
        bound.scatter(values)
        assert torch.equal(gather(frag, params), values)
        assert torch.equal(bound.flat, values)  # the buffer is the parameters' storage


def test_tensors_already_in_one_buffer_are_used_where_they_lie_and_others_are_not_adopted() -> None:
    model = _sequential()
    params = dict(model.named_parameters())
    frag = partition_tensors(list(params.items()), 1)[0]
    plain = BoundFragment(frag, params)  # separate tensors, not adopted: views
    assert plain.flat is None and plain._views is not None
    storage = torch.arange(frag.numel, dtype=torch.float32)
    for spec, (_, start, end) in zip(frag.tensors, frag.segments(), strict=True):
        params[spec.name].data = storage[start:end].view(spec.shape)
    ptrs = [params[spec.name].data_ptr() for spec in frag.tensors]
    assert plain.flat is not None and plain.flat.data_ptr() == storage.data_ptr()  # found again, not copied
    assert [params[spec.name].data_ptr() for spec in frag.tensors] == ptrs
    # Tensors that are not parameters (a detached alias, say) are never pointed elsewhere: training
    # would go on updating the storage the alias left
    aliases = {name: t.detach() for name, t in _sequential().named_parameters()}
    before = {name: t.data_ptr() for name, t in aliases.items()}
    bound = BoundFragment(partition_tensors(list(aliases.items()), 1)[0], aliases, adopt=True)
    assert bound.flat is None and {name: t.data_ptr() for name, t in aliases.items()} == before


def test_an_adopted_fragment_follows_parameters_given_new_storage() -> None:
    model = _sequential()
    params = dict(model.named_parameters())
    frag = partition_tensors(list(params.items()), 1)[0]
    bound = BoundFragment(frag, params, adopt=True)
    first = bound.flat
    model.double().float()  # every parameter's .data replaced: the buffer laid out before is left
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    assert torch.equal(bound.gather(), gather(frag, params))
    assert bound.flat is not None and bound.flat.data_ptr() != first.data_ptr()  # laid out again
    values = torch.arange(frag.numel, dtype=torch.float32)
    bound.scatter(values)
    assert torch.equal(model[0].weight.reshape(-1), values[: 16 * 8])  # written into the live parameter
    model.to(torch.bfloat16)  # no longer fp32: the functions, the values rounded to bf16
    assert bound.flat is None and torch.equal(bound.gather(), gather(frag, params))


@pytest.mark.parametrize("adopt", [False, True])
@pytest.mark.parametrize("write", ["scatter", "replay"])
def test_a_write_between_forward_and_backward_is_caught_whatever_the_layout(adopt: bool, write: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    params = dict(model.named_parameters())
    frag = partition_tensors(list(params.items()), 1)[0]
    bound = BoundFragment(frag, params, adopt=adopt)
    assert (bound.flat is not None) == adopt
    before = {name: t._version for name, t in params.items()}
    loss = model(torch.randn(3, 8)).square().sum()  # saves the last layer's weight for the backward
    current = gather(frag, params)
    if write == "scatter":
        bound.scatter(current + 1.0)
    else:
        bound.replay(current - 1.0, current)
    assert all(t._version > before[name] for name, t in params.items())  # every tensor marked as written
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_parameters_that_share_their_storage_with_something_else_are_not_moved() -> None:
    import numpy as np

    from ddiloco.learner.local import LocalFragments

    # a buffer of the user's holding two parameters in the reverse order of the fragment's
    buffer = torch.zeros(8)
    owned = {"a": torch.nn.Parameter(buffer[4:]), "b": torch.nn.Parameter(buffer[:4])}
    bound = BoundFragment(partition_tensors(list(owned.items()), 1)[0], owned, adopt=True)
    assert bound.flat is None and owned["a"].data_ptr() == buffer[4:].data_ptr()
    # in shared memory (another process reads them there)
    shared = dict(_sequential().share_memory().named_parameters())
    bound = BoundFragment(partition_tensors(list(shared.items()), 1)[0], shared, adopt=True)
    assert bound.flat is None and all(t.is_shared() for t in shared.values())
    # with an empty tensor among them (it has no address): not moved, gathered all the same
    model = _sequential()
    params = dict(model.named_parameters()) | {"empty": torch.nn.Parameter(torch.zeros(0))}
    ptrs = {name: t.data_ptr() for name, t in params.items()}
    frag = partition_tensors(list(params.items()), 1)[0]
    bound = BoundFragment(frag, params, adopt=True)
    assert bound.flat is None and {name: t.data_ptr() for name, t in params.items()} == ptrs
    assert torch.equal(bound.gather(), gather(frag, params))
    # two parameters tied by one storage: the learner leaves their fragments as they are
    model = _sequential()
    model[2].weight = torch.nn.Parameter(torch.zeros(4, 16))
    tied = dict(model.named_parameters()) | {"tie": torch.nn.Parameter(torch.zeros(0))}
    tied["tie"].data = tied["2.weight"].data  # another parameter over the same storage
    local = LocalFragments(tied, partition_tensors(list(tied.items()), 2), apply_policy="replay", mix_alpha=0.5)
    assert tied["tie"].data_ptr() == tied["2.weight"].data_ptr()
    with torch.no_grad():
        tied["2.weight"].add_(1.0)
    assert torch.equal(tied["tie"], tied["2.weight"])
    for bound in local.bound:
        assert (bound.flat is not None) == all(t.name not in ("2.weight", "tie") for t in bound.fragment.tensors) \
            or len(bound.fragment.tensors) == 1
    # two storages that begin at the same address (numpy memory) are not one buffer
    arr = np.arange(5, dtype=np.float32)
    aliased = {"a": torch.nn.Parameter(torch.from_numpy(arr[:3])), "b": torch.nn.Parameter(torch.from_numpy(arr)[3:5])}
    frag = partition_tensors(list(aliased.items()), 1)[0]
    bound = BoundFragment(frag, aliased, adopt=True)
    assert bound.flat is None and torch.equal(bound.gather(), gather(frag, aliased))
