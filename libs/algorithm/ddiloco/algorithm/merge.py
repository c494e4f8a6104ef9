"""Merge the learners' outer gradients for one fragment: per tensor, RDA or a weighted mean.

Why two rules (paper Sec. 3.2; docs/algorithm.md, synchronizer step 5): averaging Deltas that point in different
directions shrinks the result (the mean of M unit vectors at random angles has norm ~1/sqrt(M)),
which silently lowers the effective outer learning rate as learners are added or drift apart.
Radial-directional averaging keeps the two apart,

    RDA = (sum_m w_m |D_m| / sum w) * unit(sum_m w_m unit(D_m) / sum w),  unit(0) = 0,

so the result has the learners' average step length along their consensus direction. Norms are L2
over one tensor. Embedding tensors (matched by name, ``embedding_mask``) keep the plain weighted
mean, as in the paper: a learner only moves the rows of tokens it saw, so their Deltas are sparse
and their "direction" says more about data sampling than about the loss.

Why it is written this way: the merge is a pure streaming pass over M*N fp32 values, so it is
memory-bandwidth bound, and everything here exists to touch the M contributions as few times as
possible (``ddiloco bench merge`` measures it against the bandwidth bound):

- Contributions are rows of one strided [M, N] block (the inbox matrix); a tensor is the column
  range ``X = deltas[:, s:e]``, read in place, never stacked or copied.
- RDA reads X twice: once for the M row norms, once for the combination. ``unit(sum w unit(D))``
  is invariant to positive scaling, so the combination uses coefficients ``c = w/|D|`` rescaled
  to max 1 (no overflow for tiny norms) and the result is scaled once at the end.
- The combination is written in 4 MiB chunks, small enough to stay in the last-level cache, so
  the squared norm of the result (needed for RDA's scale, and the finiteness check of either
  rule) is read from cache, not memory. One active row is a scaled copy, two are a single ``lerp`` kernel (measured ~1.5x
  faster than BLAS GEMV with two columns), more are a GEMV per chunk.

``unit`` is ill-conditioned near 0: when the weighted unit vectors cancel to within fp32 rounding
(``|sum w unit(D)| / sum w < 1e-5``), what is left is noise, and RDA would scale it up to the full
magnitude. Such a tensor is treated as unit(0) = 0 and does not move.

Contributions are checked for NaN/Inf before they reach the inbox; ``merge_deltas`` still refuses
to return a non-finite merge (ValueError), so a bad value can never reach the global model.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Sequence

import torch

from ddiloco.fragments.partition import Fragment

DEFAULT_EMBEDDING_PATTERNS: tuple[str, ...] = ("*embed*", "*wte*", "*wpe*", "*tok_emb*", "*pos_emb*")
METHODS = ("rda", "mean")

_CHUNK = 1 << 20
"""Values per cache-resident chunk of the merged output (4 MiB fp32). Smaller chunks cost more
parallel regions (each with a fixed cost, far worse on an oversubscribed host) for no measured gain."""
_TINY_NORM = 1e-15
"""Below this an fp32 norm is recomputed in float64 (its squares may have underflowed); norms of
real outer gradients are many orders of magnitude larger, so the fast path is always taken."""
_TINY_SQ = _TINY_NORM ** 2
_CANCELLED = 1e-5
"""Directions that agree less than this (|sum w unit(D)| / sum w) cancel: unit(~0) = 0. Below it
the fp32 sum is rounding noise, and scaling noise up to the full magnitude would be a random step."""


def embedding_mask(fragment: Fragment, patterns: Sequence[str] = DEFAULT_EMBEDDING_PATTERNS) -> list[bool]:
    """For each tensor of ``fragment`` (model order): does its name match an embedding pattern?

    Shell-style patterns (``fnmatch``), matched case-insensitively on every platform.
    """
    lowered = [p.lower() for p in patterns]
    return [any(fnmatch.fnmatchcase(t.name.lower(), p) for p in lowered) for t in fragment.tensors]


def reanchor(delta: torch.Tensor, current: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """Move a contribution computed against an older global version ``base`` to the current one,
    in place: ``Delta + Theta_now - Theta_base`` (paper App. D.2 anchors at the synchronizer's
    current copy). ``base - theta`` becomes ``Theta_now - theta``: the contribution pulls the
    global toward where that learner's model actually is, so progress that a merge since ``base``
    already counted is not applied twice. Returns ``delta``."""
    if not delta.shape == current.shape == base.shape:
        raise ValueError(f"shape mismatch: delta {tuple(delta.shape)}, current {tuple(current.shape)}, "
                         f"base {tuple(base.shape)}")
    return delta.add_(current).sub_(base)


def merge_deltas(
    deltas: torch.Tensor,
    weights: Sequence[float] | torch.Tensor,
    segments: Sequence[tuple[int, int]],
    embedding: Sequence[bool],
    method: str = "rda",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Merge M contributions (rows of ``deltas``, fp32 [M, N]) into one fp32 [N] outer gradient.

    ``weights``: one non-negative weight per row, normalised here (need not sum to 1).
    ``segments``: the (start, end) of each tensor in the flat fragment, in order, tiling [0, N).
    ``embedding``: per segment, True for tensors that always get the weighted mean.
    ``method``: "rda" (radial-directional averaging; embeddings still get the mean) or "mean".
    ``out``: optional fp32 [N] buffer to write into (must not overlap ``deltas``); its contents
    are unspecified if this raises.

    Raises ValueError on shape/dtype mismatches, negative, non-finite or all-zero weights, and when
    the merge would not be finite (a NaN/Inf or overflowing value in a contribution). A row with
    weight 0 contributes nothing, but a NaN/Inf in it may still raise.
    """
    if method not in METHODS:
        raise ValueError(f"unknown merge method {method!r}; expected one of {METHODS}")
    x = _check_deltas(deltas)
    m, n = x.shape
    w = _normalised_weights(weights, m)
    bounds = _check_segments(segments, embedding, n)
    out = _check_out(out, x, n)

    for (start, end), is_embedding in zip(bounds, embedding, strict=True):
        if start == end:
            continue
        seg = x[:, start:end]
        dst = out[start:end]
        if method == "mean" or is_embedding:
            sq = _combine(seg, w, dst, scale=1.0)
        else:
            sq = _rda(seg, w, dst)
        if not math.isfinite(sq):
            raise ValueError(f"merge of values [{start}, {end}) is not finite: a contribution holds NaN/Inf "
                             "or values too large for fp32")
    return out


def _rda(seg: torch.Tensor, w: list[float], dst: torch.Tensor) -> float:
    """RDA of one tensor's rows into ``dst``; returns the squared norm of the result."""
    norms = [_norm_or_exact(row, nm) for row, nm in zip(seg, torch.linalg.vector_norm(seg, dim=1).tolist(),
                                                         strict=True)]
    for wm, nm in zip(w, norms, strict=True):
        if wm > 0 and not math.isfinite(nm):
            return math.inf
    magnitude = math.fsum(wm * nm for wm, nm in zip(w, norms, strict=True) if wm > 0)
    coef = [wm / nm if wm > 0 and nm > 0 else 0.0 for wm, nm in zip(w, norms, strict=True)]
    active = [i for i, c in enumerate(coef) if c > 0]
    if not active or magnitude == 0.0:
        dst.zero_()
        return 0.0
    if len(active) == 1:
        # One direction: the result is that row scaled to the mean magnitude (exactly D when M=1).
        k = active[0]
        _combine(seg, [1.0 if i == k else 0.0 for i in range(len(w))], dst, scale=magnitude / norms[k],
                 want_sq=False)
        return magnitude * magnitude
    top = max(coef)
    scaled = [c / top for c in coef]
    sq = _combine(seg, scaled, dst, scale=1.0)
    if not math.isfinite(sq):
        return sq
    if sq < _TINY_SQ:  # the fp32 sum of squares may have underflowed: count it exactly
        sq = float(torch.linalg.vector_norm(dst, dtype=torch.float64)) ** 2
    # |sum w unit(D)| / sum w, in [0, 1]: how much the learners' directions agree.
    agreement = math.sqrt(sq) / math.fsum(c * nm for c, nm in zip(scaled, norms, strict=True))
    if agreement < _CANCELLED:
        dst.zero_()
        return 0.0
    dst.mul_(magnitude / math.sqrt(sq))
    return magnitude * magnitude


def _norm_or_exact(row: torch.Tensor, fp32_norm: float) -> float:
    """A row's L2 norm. fp32 squares of values below ~1e-19 underflow, so a small fp32 norm may
    be short or 0 (and RDA would then drop or zero the whole tensor): below ``_TINY_NORM`` it is
    recomputed with float64 accumulation. Only such rows pay for it."""
    if fp32_norm >= _TINY_NORM or not math.isfinite(fp32_norm):
        return fp32_norm
    return float(torch.linalg.vector_norm(row, dtype=torch.float64))


def _combine(seg: torch.Tensor, coef: list[float], dst: torch.Tensor, *, scale: float,
             want_sq: bool = True) -> float:
    """``dst = scale * sum_m coef_m * seg[m]``, chunk by chunk; returns the squared norm of ``dst``
    (0.0 without ``want_sq``).

    Rows with a zero coefficient are not read on the one- and two-row paths.
    """
    active = [i for i, c in enumerate(coef) if c != 0.0]
    n = dst.shape[0]
    if not active or scale == 0.0:
        dst.zero_()
        return 0.0
    if len(active) == 1:
        k = active[0]
        factor = coef[k] * scale
        row = seg[k]

        def fill(s: int, e: int) -> None:
            if factor == 1.0:
                dst[s:e].copy_(row[s:e])
            else:
                torch.mul(row[s:e], factor, out=dst[s:e])
    elif len(active) == 2:
        i, j = active
        total = coef[i] + coef[j]
        t = coef[j] / total
        factor = total * scale
        if abs(factor - 1.0) < 1e-12:  # normalised weights summing to 1 up to float64 rounding
            factor = 1.0
        a, b = seg[i], seg[j]

        def fill(s: int, e: int) -> None:
            torch.lerp(a[s:e], b[s:e], t, out=dst[s:e])
            if factor != 1.0:
                dst[s:e].mul_(factor)
    else:
        vec = torch.tensor([c * scale for c in coef], dtype=torch.float32, device=seg.device)

        def fill(s: int, e: int) -> None:
            torch.mv(seg[:, s:e].t(), vec, out=dst[s:e])

    sq = 0.0
    for s in range(0, n, _CHUNK):
        e = min(n, s + _CHUNK)
        fill(s, e)
        if want_sq:
            part = dst[s:e]
            sq += float(torch.dot(part, part))
    return sq


def _check_deltas(deltas: torch.Tensor) -> torch.Tensor:
    if not isinstance(deltas, torch.Tensor):
        raise ValueError(f"deltas must be a torch.Tensor, got {type(deltas).__name__}")
    if deltas.dtype != torch.float32:
        raise ValueError(f"deltas must be float32, got {deltas.dtype}")
    if deltas.dim() != 2 or deltas.shape[0] < 1:
        raise ValueError(f"deltas must be [M >= 1, N], got shape {tuple(deltas.shape)}")
    if deltas.stride(1) != 1 and deltas.shape[1] > 1:
        deltas = deltas.contiguous()
    return deltas


def _normalised_weights(weights: Sequence[float] | torch.Tensor, m: int) -> list[float]:
    if isinstance(weights, torch.Tensor):
        values = [float(v) for v in weights.detach().reshape(-1).cpu().tolist()]
    else:
        values = [float(v) for v in weights]
    if len(values) != m:
        raise ValueError(f"got {len(values)} weights for {m} contributions")
    for v in values:
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"weights must be finite and non-negative, got {values}")
    total = math.fsum(values)
    if total <= 0:
        raise ValueError("all weights are zero: nothing to merge")
    return [v / total for v in values]


def _check_segments(segments: Sequence[tuple[int, int]], embedding: Sequence[bool],
                    n: int) -> list[tuple[int, int]]:
    bounds = [(int(s), int(e)) for s, e in segments]
    if len(embedding) != len(bounds):
        raise ValueError(f"embedding mask has {len(embedding)} entries for {len(bounds)} segments")
    cursor = 0
    for s, e in bounds:
        if s != cursor or e < s:
            raise ValueError(f"segments must tile [0, {n}) in order; got ({s}, {e}) after offset {cursor}")
        cursor = e
    if cursor != n:
        raise ValueError(f"segments cover [0, {cursor}) but deltas have {n} values per row")
    return bounds


def _check_out(out: torch.Tensor | None, x: torch.Tensor, n: int) -> torch.Tensor:
    if out is None:
        return torch.empty(n, dtype=torch.float32, device=x.device)
    if out.dtype != torch.float32 or out.dim() != 1 or out.shape[0] != n:
        raise ValueError(f"out must be float32 [{n}], got {out.dtype} {tuple(out.shape)}")
    if out.device != x.device:
        raise ValueError(f"out is on {out.device}, deltas on {x.device}")
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    if tensors_overlap(out, x):
        raise ValueError("out must not overlap deltas")
    return out


def tensors_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' memory spans intersect (conservative for strided views)."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False

    def span(t: torch.Tensor) -> tuple[int, int]:
        last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    a0, a1 = span(a)
    b0, b1 = span(b)
    return a0 < b1 and b0 < a1
