"""merge_deltas against a direct float64 numpy implementation of docs/algorithm.md, synchronizer step 5.

The reference below is written from the formula, not from the optimised code:
``RDA = (sum w|D|/sum w) * unit(sum w unit(D) / sum w)`` per tensor, weighted mean for
embeddings. Golden numerics live in tests/algorithm/golden/merge.json; regenerate them (after a deliberate
numerical change, and review the diff) with ``DDILOCO_REWRITE_GOLDEN=1 pytest tests/algorithm/test_merge.py``.
"""

from __future__ import annotations

import json
import math
import os
import pathlib

import numpy as np
import pytest
import torch

from ddiloco.algorithm import merge as merge_mod
from ddiloco.algorithm.merge import DEFAULT_EMBEDDING_PATTERNS, embedding_mask, merge_deltas
from ddiloco.fragments.partition import Fragment, TensorSpec

GOLDEN = pathlib.Path(__file__).parent / "golden" / "merge.json"
REWRITE = os.environ.get("DDILOCO_REWRITE_GOLDEN") == "1"


def reference_merge(deltas: np.ndarray, weights, segments, embedding, method: str) -> np.ndarray:
    """The spec, literally, in float64."""
    d = np.asarray(deltas, dtype=np.float64)
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    out = np.zeros(d.shape[1])
    for (s, e), emb in zip(segments, embedding, strict=True):
        x = d[:, s:e]
        if method == "mean" or emb:
            out[s:e] = (w[:, None] * x).sum(axis=0)
            continue
        units = []
        for row in x:
            norm = np.linalg.norm(row)
            units.append(row / norm if norm > 0 else np.zeros_like(row))
        magnitude = sum(wm * np.linalg.norm(row) for wm, row in zip(w, x, strict=True))
        direction = (w[:, None] * np.array(units)).sum(axis=0)
        dn = np.linalg.norm(direction)
        out[s:e] = magnitude * direction / dn if dn > 0 else 0.0
    return out


def bounds(sizes):
    out, o = [], 0
    for n in sizes:
        out.append((o, o + n))
        o += n
    return out


def run(deltas, weights, segments, embedding, method="rda", **kw):
    return merge_deltas(torch.as_tensor(np.asarray(deltas, dtype=np.float32)), weights, segments, embedding,
                        method, **kw).numpy()


def assert_matches_reference(x: np.ndarray, w, segments, embedding, method, rtol=2e-5):
    got = run(x, w, segments, embedding, method)
    want = reference_merge(x.astype(np.float32), w, segments, embedding, method)
    scale = max(1e-30, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale)


# -- hand-computed cases --------------------------------------------------------------------------

def test_orthogonal_unit_vectors_rda_keeps_unit_length_and_bisects():
    got = run([[1.0, 0.0], [0.0, 1.0]], [1, 1], [(0, 2)], [False])
    np.testing.assert_allclose(got, [1 / math.sqrt(2), 1 / math.sqrt(2)], rtol=1e-6)
    assert np.linalg.norm(got) == pytest.approx(1.0, rel=1e-6)


def test_orthogonal_unit_vectors_mean_shrinks():
    got = run([[1.0, 0.0], [0.0, 1.0]], [1, 1], [(0, 2)], [False], method="mean")
    np.testing.assert_allclose(got, [0.5, 0.5], rtol=1e-7)


def test_weighted_rda_hand_computed():
    # |D1| = 2 (weight 3), |D2| = 1 (weight 1): magnitude (3*2 + 1*1)/4 = 7/4,
    # direction unit(3/4 e1 + 1/4 e2) = (3, 1)/sqrt(10).
    got = run([[2.0, 0.0], [0.0, 1.0]], [3, 1], [(0, 2)], [False])
    np.testing.assert_allclose(got, [7 / 4 * 3 / math.sqrt(10), 7 / 4 * 1 / math.sqrt(10)], rtol=1e-6)


def test_parallel_vectors_rda_equals_mean():
    x = [[1.0, 2.0, 2.0], [3.0, 6.0, 6.0], [0.5, 1.0, 1.0]]
    rda = run(x, [1, 2, 1], [(0, 3)], [False])
    mean = run(x, [1, 2, 1], [(0, 3)], [False], method="mean")
    np.testing.assert_allclose(rda, mean, rtol=1e-6)
    np.testing.assert_allclose(mean, [(1 + 6 + 0.5) / 4, (2 + 12 + 1) / 4, (2 + 12 + 1) / 4], rtol=1e-6)


@pytest.mark.parametrize("m", [2, 3])
def test_unit_vectors_that_cancel_give_zero(m):
    # unit(0) = 0: opposite directions with equal weight leave no direction to move in.
    x = np.zeros((m, 4), dtype=np.float32)
    x[0] = [1, 2, 3, 4]
    x[1] = [-2, -4, -6, -8]
    w = [1.0, 1.0] + [0.0] * (m - 2)
    np.testing.assert_array_equal(run(x, w, [(0, 4)], [False]), np.zeros(4))


def test_near_cancellation_below_rounding_is_zero_and_above_it_is_kept():
    rng = np.random.default_rng(4)
    u = rng.standard_normal(1000)
    v = rng.standard_normal(1000)
    v -= u * (u @ v) / (u @ u)  # v orthogonal to u
    u /= np.linalg.norm(u)
    v /= np.linalg.norm(v)
    for eps, expect_zero in ((1e-7, True), (1e-3, False)):
        # Two unit vectors that agree by eps: |(a + b)/2| = eps.
        x = np.stack([-u + eps * v, u + eps * v]).astype(np.float32)
        got = run(x, [1, 1], [(0, 1000)], [False])
        if expect_zero:
            np.testing.assert_array_equal(got, np.zeros(1000))
        else:
            want = reference_merge(x, [1, 1], [(0, 1000)], [False], "rda")
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-2 * np.abs(want).max())
            assert abs(float(got @ v) / np.linalg.norm(got)) > 0.99  # along v, full magnitude
            assert np.linalg.norm(got) == pytest.approx(1.0, rel=1e-3)


def test_rda_magnitude_is_weighted_mean_of_norms_per_tensor():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 300)).astype(np.float32) * np.array([[1e-3], [1], [10], [0.1], [3]],
                                                                       dtype=np.float32)
    w = [0.1, 0.3, 0.2, 0.25, 0.15]
    segs = [(0, 100), (100, 300)]
    got = run(x, w, segs, [False, False])
    for s, e in segs:
        want = sum(wm * np.linalg.norm(x[i, s:e].astype(np.float64)) for i, wm in enumerate(w))
        assert np.linalg.norm(got[s:e]) == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("scale", [1e-21, 1e-23, 1e-30, 1e-36])
def test_tiny_updates_are_merged_not_zeroed(scale):
    """Values so small that their fp32 squares underflow (below ~1e-19): the norms are counted in
    float64, so the tensor's update keeps its size and direction instead of becoming 0."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((3, 500)) * scale).astype(np.float32)
    x[1] = np.abs(x[1])
    segments, embedding = [(0, 200), (200, 500)], [False, False]
    got = run(x, [0.2, 0.3, 0.5], segments, embedding, "rda")
    want = reference_merge(x, [0.2, 0.3, 0.5], segments, embedding, "rda")
    assert np.abs(got).max() > 0
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))


def test_single_contribution_is_returned_exactly():
    x = torch.randn(1, 1000)
    for method in ("rda", "mean"):
        out = merge_deltas(x, [0.37], [(0, 10), (10, 1000)], [True, False], method)
        assert torch.equal(out, x[0])


def test_single_weighted_contribution_among_zero_weights_is_returned_exactly():
    x = torch.randn(4, 500)
    out = merge_deltas(x, [0.0, 5.0, 0.0, 0.0], [(0, 500)], [False])
    assert torch.equal(out, x[1])


def test_zero_weight_rows_are_ignored():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 64)).astype(np.float32)
    for method in ("rda", "mean"):
        got = run(x, [1.0, 0.0, 2.0, 0.0], [(0, 64)], [False], method)
        only = run(x[[0, 2]], [1.0, 2.0], [(0, 64)], [False], method)
        np.testing.assert_allclose(got, only, rtol=1e-6, atol=1e-7)


def test_weights_are_normalised():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 50)).astype(np.float32)
    for method in ("rda", "mean"):
        a = run(x, [1.0, 2.0, 3.0], [(0, 20), (20, 50)], [True, False], method)
        b = run(x, [1000.0, 2000.0, 3000.0], [(0, 20), (20, 50)], [True, False], method)
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_zero_deltas():
    x = np.zeros((3, 10), dtype=np.float32)
    for method in ("rda", "mean"):
        np.testing.assert_array_equal(run(x, [1, 1, 1], [(0, 10)], [False], method), np.zeros(10))
    # One zero row: it counts with magnitude 0, and has no direction.
    x[0] = np.arange(10)
    got = run(x, [1, 1, 2], [(0, 10)], [False])
    np.testing.assert_allclose(got, 0.25 * np.arange(10), rtol=1e-6)


def test_embedding_segments_get_the_mean_under_rda():
    x = np.array([[1.0, 0.0, 1.0, 0.0], [0.0, 1.0, 0.0, 1.0]], dtype=np.float32)
    got = run(x, [1, 1], [(0, 2), (2, 4)], [True, False])
    np.testing.assert_allclose(got, [0.5, 0.5, 1 / math.sqrt(2), 1 / math.sqrt(2)], rtol=1e-6)


# -- against the reference on random cases --------------------------------------------------------

def random_case(seed: int, m: int, sizes, scale_spread: float = 1.0):
    rng = np.random.default_rng(seed)
    n = sum(sizes)
    x = rng.standard_normal((m, n)).astype(np.float32)
    # Different magnitudes per contribution and per tensor, correlated directions.
    common = rng.standard_normal(n).astype(np.float32)
    mix = rng.uniform(0, 1, size=(m, 1)).astype(np.float32)
    x = mix * common + (1 - mix) * x
    x *= (10.0 ** rng.uniform(-scale_spread, scale_spread, size=(m, 1))).astype(np.float32)
    w = rng.uniform(0.1, 2.0, size=m)
    segs = bounds(sizes)
    emb = [bool(rng.integers(0, 2)) for _ in sizes]
    return x, w, segs, emb


@pytest.mark.parametrize("method", ["rda", "mean"])
@pytest.mark.parametrize("m", [1, 2, 3, 8])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_cases_match_reference(method, m, seed):
    x, w, segs, emb = random_case(seed * 100 + m, m, [1, 7, 64, 0, 129, 1000, 3])
    assert_matches_reference(x, w, segs, emb, method)


@pytest.mark.parametrize("m", [2, 3])
def test_segments_longer_than_a_chunk_match_reference(m):
    # Crosses merge._CHUNK so the chunked combination and norm accumulation are exercised.
    n = merge_mod._CHUNK + merge_mod._CHUNK // 3 + 5
    x, w, segs, _ = random_case(7, m, [n, 11], scale_spread=0.5)
    assert_matches_reference(x, w, segs, [False, True], "rda", rtol=1e-4)


def test_random_zero_rows_match_reference():
    x, w, segs, _ = random_case(5, 6, [40, 40, 40])
    x[2] = 0.0
    x[4, 40:80] = 0.0
    assert_matches_reference(x, w, segs, [False, False, False], "rda")


def test_row_slice_of_a_larger_buffer_and_out_buffer():
    # The inbox hands over buf[:M]; the rows past M hold garbage and must never be read.
    x, w, segs, emb = random_case(9, 3, [30, 50])
    buf = torch.full((5, 80), float("nan"))
    buf[:3] = torch.from_numpy(x)
    out = torch.empty(80)
    result = merge_deltas(buf[:3], list(w), segs, emb, "rda", out=out)
    assert result is out
    want = reference_merge(x, w, segs, emb, "rda")
    np.testing.assert_allclose(out.numpy(), want, rtol=2e-5, atol=2e-6)
    # Weights may also come as a tensor.
    again = merge_deltas(buf[:3], torch.tensor(w), segs, emb, "rda")
    torch.testing.assert_close(again, out, rtol=0, atol=0)


def test_inputs_are_not_modified():
    x = torch.randn(3, 100)
    before = x.clone()
    merge_deltas(x, [1, 2, 3], [(0, 100)], [False])
    assert torch.equal(x, before)


# -- invalid inputs -------------------------------------------------------------------------------

@pytest.mark.parametrize("weights, match", [
    ([0.0, 0.0], "all weights are zero"),
    ([1.0, -0.5], "non-negative"),
    ([1.0, float("nan")], "finite"),
    ([1.0, float("inf")], "finite"),
    ([1.0], "2 contributions"),
    ([1.0, 1.0, 1.0], "2 contributions"),
])
def test_bad_weights_raise(weights, match):
    with pytest.raises(ValueError, match=match):
        merge_deltas(torch.ones(2, 4), weights, [(0, 4)], [False])


@pytest.mark.parametrize("segments, embedding", [
    ([(0, 3)], [False]),                  # does not cover N
    ([(0, 2), (3, 4)], [False, False]),   # gap
    ([(0, 3), (2, 4)], [False, False]),   # overlap
    ([(0, 5)], [False]),                  # past N
    ([(2, 4), (0, 2)], [False, False]),   # out of order
    ([(0, 4)], [False, True]),            # mask length
])
def test_bad_segments_raise(segments, embedding):
    with pytest.raises(ValueError):
        merge_deltas(torch.ones(2, 4), [1, 1], segments, embedding)


def test_bad_tensors_raise():
    with pytest.raises(ValueError, match="float32"):
        merge_deltas(torch.ones(2, 4, dtype=torch.float64), [1, 1], [(0, 4)], [False])
    with pytest.raises(ValueError, match=r"\[M >= 1, N\]"):
        merge_deltas(torch.ones(4), [1], [(0, 4)], [False])
    with pytest.raises(ValueError, match=r"\[M >= 1, N\]"):
        merge_deltas(torch.ones(0, 4), [], [(0, 4)], [False])
    with pytest.raises(ValueError, match="unknown merge method"):
        merge_deltas(torch.ones(2, 4), [1, 1], [(0, 4)], [False], method="median")
    with pytest.raises(ValueError, match="out must be float32"):
        merge_deltas(torch.ones(2, 4), [1, 1], [(0, 4)], [False], out=torch.empty(5))
    buf = torch.ones(3, 4)
    with pytest.raises(ValueError, match="overlap"):
        merge_deltas(buf[:2], [1, 1], [(0, 4)], [False], out=buf[1])
    # A free row of the same buffer is a legal destination.
    merge_deltas(buf[:2], [1, 1], [(0, 4)], [False], out=buf[2])
    torch.testing.assert_close(buf[2], torch.ones(4))


@pytest.mark.parametrize("method", ["rda", "mean"])
@pytest.mark.parametrize("m", [1, 2, 3])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_contribution_raises(method, m, bad):
    x = torch.randn(m, 20)
    x[m - 1, 7] = bad
    with pytest.raises(ValueError, match="not finite"):
        merge_deltas(x, [1.0] * m, [(0, 10), (10, 20)], [False, False], method)


# -- embedding mask -------------------------------------------------------------------------------

def test_embedding_mask_matches_names_in_fragment_order():
    frag = Fragment(0, (
        TensorSpec("tok_emb.weight", (10, 4)),
        TensorSpec("blocks.0.attn.qkv.weight", (4, 12)),
        TensorSpec("transformer.wte.weight", (10, 4)),
        TensorSpec("transformer.wpe.weight", (8, 4)),
        TensorSpec("model.Embed_tokens.weight", (10, 4)),
        TensorSpec("pos_emb", (8, 4)),
        TensorSpec("lm_head.weight", (4, 10)),
    ))
    assert embedding_mask(frag) == [True, False, True, True, True, True, False]
    assert embedding_mask(frag, ("lm_head.*",)) == [False] * 6 + [True]
    assert embedding_mask(frag, ()) == [False] * 7
    assert DEFAULT_EMBEDDING_PATTERNS == ("*embed*", "*wte*", "*wpe*", "*tok_emb*", "*pos_emb*")


# -- golden numerics ------------------------------------------------------------------------------

def golden_cases():
    """Inputs are stored in the fixture (not regenerated), so an RNG change cannot move them."""
    cases = []
    for name, seed, m, sizes, emb in [
        ("m1", 11, 1, [5, 12, 3], [False, True, False]),
        ("m2", 12, 2, [9, 16, 4], [True, False, False]),
        ("m4_zero_row", 13, 4, [8, 20], [False, True]),
    ]:
        x, w, segs, _ = random_case(seed, m, sizes)
        if name == "m4_zero_row":
            x[1, :8] = 0.0
        cases.append({"name": name, "deltas": x.tolist(), "weights": [float(v) for v in w],
                      "segments": segs, "embedding": emb})
    return cases


def test_golden_fixture():
    if REWRITE or not GOLDEN.exists():
        if not REWRITE:
            pytest.fail(f"{GOLDEN} is missing; create it with DDILOCO_REWRITE_GOLDEN=1")
        cases = golden_cases()
        for case in cases:
            for method in ("rda", "mean"):
                case[f"expected_{method}"] = run(case["deltas"], case["weights"], case["segments"],
                                                 case["embedding"], method).tolist()
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(json.dumps({"about": "merge_deltas golden numerics; rewrite with "
                                               "DDILOCO_REWRITE_GOLDEN=1 pytest tests/algorithm/test_merge.py",
                                      "cases": cases}, indent=1) + "\n")
        pytest.skip(f"rewrote {GOLDEN}")
    doc = json.loads(GOLDEN.read_text())
    assert len(doc["cases"]) == 3
    for case in doc["cases"]:
        segs = [tuple(s) for s in case["segments"]]
        for method in ("rda", "mean"):
            got = run(case["deltas"], case["weights"], segs, case["embedding"], method)
            np.testing.assert_allclose(got, case[f"expected_{method}"], rtol=1e-6, atol=1e-6,
                                       err_msg=f"{case['name']} {method}")
            # The fixture itself must agree with the spec, so a bad rewrite cannot pin a bug.
            want = reference_merge(np.asarray(case["deltas"], dtype=np.float32), case["weights"], segs,
                                   case["embedding"], method)
            np.testing.assert_allclose(case[f"expected_{method}"], want, rtol=2e-5, atol=1e-6)
