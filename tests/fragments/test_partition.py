"""Fragment partition: balanced, complete, ordered, and identical in every process.

The balance bound is the classic one for greedy list scheduling (each tensor into the currently
lightest bin): the heaviest fragment exceeds the lightest by at most the largest tensor.
Determinism is checked in fresh interpreters with different hash seeds, so neither set nor dict
iteration order nor anything process-local can leak into the layout.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddiloco.fragments.errors import LayoutMismatchError
from ddiloco.fragments.partition import (
    FragmentLayout,
    TensorSpec,
    dtype_from_name,
    dtype_name,
    partition,
    partition_tensors,
)

SETTINGS = settings(max_examples=80, deadline=None)


@st.composite
def specs(draw, min_size: int = 1, max_size: int = 40):  # type: ignore[no-untyped-def]
    n = draw(st.integers(min_size, max_size))
    shapes = draw(st.lists(st.lists(st.integers(0, 64), max_size=3), min_size=n, max_size=n))
    dtypes = draw(st.lists(st.sampled_from(["float32", "bfloat16", "float16", "float64"]), min_size=n, max_size=n))
    return [TensorSpec(f"layers.{i}.p", tuple(s), d) for i, (s, d) in enumerate(zip(shapes, dtypes, strict=True))]


def _gpt_like() -> list[TensorSpec]:
    out = [TensorSpec("tok_emb.weight", (512, 64)), TensorSpec("pos_emb.weight", (128, 64))]
    for i in range(6):
        out += [TensorSpec(f"blocks.{i}.ln1.weight", (64,)), TensorSpec(f"blocks.{i}.attn.qkv.weight", (192, 64)),
                TensorSpec(f"blocks.{i}.attn.proj.weight", (64, 64)), TensorSpec(f"blocks.{i}.ln2.weight", (64,)),
                TensorSpec(f"blocks.{i}.mlp.fc.weight", (256, 64)), TensorSpec(f"blocks.{i}.mlp.proj.weight", (64, 256))]
    return [*out, TensorSpec("ln_f.weight", (64,)), TensorSpec("head.weight", (512, 64), "bfloat16")]


@SETTINGS
@given(tensors=specs(), data=st.data())
def test_every_tensor_in_exactly_one_fragment_in_model_order(tensors: list[TensorSpec], data) -> None:  # type: ignore[no-untyped-def]
    p = data.draw(st.integers(1, len(tensors)), label="P")
    layout = partition(tensors, p)
    assert layout.num_fragments == p
    assert [f.index for f in layout] == list(range(p))
    placed = [t for f in layout for t in f.tensors]
    assert sorted(placed, key=lambda t: t.name) == sorted(tensors, key=lambda t: t.name)
    model_order = {t.name: i for i, t in enumerate(tensors)}
    for frag in layout:
        assert frag.tensors, "no fragment is empty"
        positions = [model_order[t.name] for t in frag.tensors]
        assert positions == sorted(positions)
        # Flat buffer layout: contiguous segments in order, numel adds up.
        assert [s for _, s, _ in frag.segments()] == list(frag.offsets)
        assert frag.numel == sum(t.numel for t in frag.tensors)
        assert all(e - s == t.numel for t, (_, s, e) in zip(frag.tensors, frag.segments(), strict=True))
        for t in frag.tensors:
            assert layout.fragment_of(t.name) == frag.index


@SETTINGS
@given(tensors=specs(), data=st.data())
def test_balanced_within_the_largest_tensor(tensors: list[TensorSpec], data) -> None:  # type: ignore[no-untyped-def]
    p = data.draw(st.integers(1, len(tensors)), label="P")
    loads = [f.nbytes for f in partition(tensors, p)]
    assert max(loads) <= min(loads) + max(t.nbytes for t in tensors)


def test_balance_on_a_real_model_shape() -> None:
    tensors = _gpt_like()
    loads = [f.nbytes for f in partition(tensors, 8)]
    assert sum(loads) == sum(t.nbytes for t in tensors)
    assert max(loads) <= min(loads) + max(t.nbytes for t in tensors)
    assert max(loads) / (sum(loads) / 8) < 1.5


@SETTINGS
@given(tensors=specs(min_size=2), seed=st.integers(0, 2**32 - 1))
def test_assignment_does_not_depend_on_input_order(tensors: list[TensorSpec], seed: int) -> None:
    p = max(1, len(tensors) // 3)
    shuffled = list(tensors)
    random.Random(seed).shuffle(shuffled)
    a, b = partition(tensors, p), partition(shuffled, p)
    assert [set(f.names) for f in a] == [set(f.names) for f in b]
    # Within a fragment the order is the caller's (model) order.
    order_b = {t.name: i for i, t in enumerate(shuffled)}
    for frag in b:
        assert [order_b[n] for n in frag.names] == sorted(order_b[n] for n in frag.names)


_CHILD = """
import json, random, sys
from ddiloco.fragments.partition import TensorSpec, partition
specs = [TensorSpec(n, tuple(s), d) for n, s, d in json.loads(sys.argv[1])]
random.Random(int(sys.argv[3])).shuffle(specs)
layout = partition(specs, int(sys.argv[2]))
print(json.dumps({"fingerprint": layout.fingerprint, "names": [sorted(f.names) for f in layout]}))
"""


def _in_fresh_processes(tensors: list[TensorSpec], p: int, runs: list[tuple[int, str]]) -> list[dict]:
    """Partition in one fresh interpreter per (shuffle seed, PYTHONHASHSEED), run side by side."""
    doc = json.dumps([[t.name, list(t.shape), t.dtype] for t in tensors])
    procs = [subprocess.Popen([sys.executable, "-c", _CHILD, doc, str(p), str(seed)], text=True,
                              env={**os.environ, "PYTHONHASHSEED": hash_seed},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for seed, hash_seed in runs]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        results.append(json.loads(out))
    return results


def test_deterministic_across_processes() -> None:
    # Many equal sizes, so that tie-breaking decides most placements.
    tensors = _gpt_like() + [TensorSpec(f"extra.{i}", (64,)) for i in range(10)]
    random.Random(0).shuffle(tensors)
    model = list(tensors)
    random.Random(123).shuffle(model)  # what the first child does: the same model order
    child, other = _in_fresh_processes(tensors, 7, [(123, "1"), (999, "2")])
    assert child["fingerprint"] == partition(model, 7).fingerprint
    # Another process, another hash seed, another input order: the same assignment.
    assert other["names"] == child["names"] == [sorted(f.names) for f in partition(tensors, 7)]


def test_fingerprint_pins_names_shapes_dtypes_order_and_p() -> None:
    base = _gpt_like()
    layout = partition(base, 4)
    assert layout.fingerprint.startswith("layout-")
    assert partition(list(base), 4).fingerprint == layout.fingerprint
    variants = [
        partition(base, 5),
        partition([TensorSpec("x" + t.name, t.shape, t.dtype) for t in base], 4),
        partition([*base[:-1], TensorSpec(base[-1].name, (64, 512), base[-1].dtype)], 4),
        partition([*base[:-1], TensorSpec(base[-1].name, base[-1].shape, "float32")], 4),
        partition([base[1], base[0], *base[2:]], 4),  # model order within a fragment changed
    ]
    for other in variants:
        assert other.fingerprint != layout.fingerprint
        with pytest.raises(LayoutMismatchError, match="mismatch") as info:
            layout.check_same(other.fingerprint, who="learner-3")
        assert "learner-3" in str(info.value) and info.value.reason == "LAYOUT_MISMATCH"
    layout.check_same(partition(base, 4).fingerprint)


def test_fingerprint_is_computed_once_and_survives_pickling() -> None:
    import pickle

    layout = partition(_gpt_like(), 4)
    first = layout.fingerprint
    assert layout.fingerprint is first  # cached: the learner stamps it on every transfer
    copy = pickle.loads(pickle.dumps(layout))
    assert copy == layout and copy.fingerprint == first and hash(copy) == hash(layout)


def test_partition_tensors_of_a_real_module() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(100, 16), torch.nn.Linear(16, 32), torch.nn.LayerNorm(32),
                                torch.nn.Linear(32, 100)).to(torch.float32)
    model[2].to(torch.bfloat16)
    named = dict(model.named_parameters())
    a = partition_tensors(named, 3)
    b = partition_tensors(list(model.named_parameters()), 3)
    assert a == b and isinstance(a, FragmentLayout)
    assert {t.name: t.dtype for f in a for t in f.tensors}["2.weight"] == "bfloat16"
    assert sum(f.numel for f in a) == sum(p.numel() for p in model.parameters())


def test_zero_size_tensors_do_not_leave_a_fragment_empty() -> None:
    tensors = [TensorSpec("a", (4,)), TensorSpec("b", (0,)), TensorSpec("c", (0,))]
    assert all(f.tensors for f in partition(tensors, 3))


@pytest.mark.parametrize("p", [0, -1, 4])
def test_bad_number_of_fragments_raises(p: int) -> None:
    with pytest.raises(ValueError):
        partition([TensorSpec("a", (2,)), TensorSpec("b", (3,)), TensorSpec("c", (1,))], p)


def test_duplicate_names_raise() -> None:
    with pytest.raises(ValueError, match="unique"):
        partition([TensorSpec("a", (2,)), TensorSpec("a", (3,))], 1)


def test_unsupported_dtypes_raise() -> None:
    with pytest.raises(ValueError):
        TensorSpec.of("steps", torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError):
        dtype_from_name("int8")
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        assert dtype_from_name(dtype_name(dtype)) is dtype


def test_tensor_spec_sizes() -> None:
    assert TensorSpec("s", ()).numel == 1
    assert TensorSpec("e", (0, 5)).nbytes == 0
    assert TensorSpec("h", (3, 4), "bfloat16").nbytes == 24
    assert TensorSpec("d", (3,), "float64").nbytes == 24
