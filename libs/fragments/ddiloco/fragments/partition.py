"""Partition a model's named tensors into P fragments of near-equal byte size.

Greedy bin packing, largest tensor first, each into the currently lightest fragment; ties are
broken by tensor name and then by the lowest fragment index, so the layout is a pure function of
(names, shapes, dtypes, P) and two processes on different machines always agree. Within a
fragment, tensors keep model (state-dict) order, which makes each fragment's flat fp32 buffer
layout predictable. The layout fingerprint hashes everything that decides the layout, so a
learner and the synchronizer can verify they agree before any bytes move.
"""

from __future__ import annotations

import functools
import hashlib
import heapq
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ddiloco.fragments.errors import LayoutMismatchError

if TYPE_CHECKING:
    import torch

_DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
"""Parameter dtypes a layout may hold, by name, and their bytes per value. Names, not torch
dtypes, so that reading a layout (the protocol, ``ddiloco status``) does not import torch."""


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPE_SIZES:
        raise ValueError(f"unsupported parameter dtype {dtype}; supported: {sorted(_DTYPE_SIZES)}")
    return name


def dtype_size(name: str) -> int:
    """Bytes per value of the dtype called ``name``; ValueError for a name a layout cannot hold."""
    try:
        return _DTYPE_SIZES[name]
    except KeyError:
        raise ValueError(f"unknown dtype name {name!r}; supported: {sorted(_DTYPE_SIZES)}") from None


def dtype_from_name(name: str) -> torch.dtype:
    dtype_size(name)  # refuses an unknown name
    import torch

    dtype: torch.dtype = getattr(torch, name)
    return dtype


@dataclass(frozen=True)
class TensorSpec:
    """A named tensor as the model holds it."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_size(self.dtype)

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorSpec:
        return cls(name, tuple(int(s) for s in tensor.shape), dtype_name(tensor.dtype))


@dataclass(frozen=True)
class Fragment:
    """One fragment: its tensors in model order and their offsets in the flat fp32 buffer."""

    index: int
    tensors: tuple[TensorSpec, ...]
    offsets: tuple[int, ...] = field(init=False)
    numel: int = field(init=False)

    def __post_init__(self) -> None:
        offsets, total = [], 0
        for spec in self.tensors:
            offsets.append(total)
            total += spec.numel
        object.__setattr__(self, "offsets", tuple(offsets))
        object.__setattr__(self, "numel", total)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tensors)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def segments(self) -> list[tuple[str, int, int]]:
        """(name, start, end) of each tensor in the flat buffer."""
        return [(t.name, o, o + t.numel) for t, o in zip(self.tensors, self.offsets, strict=True)]


@dataclass(frozen=True)
class FragmentLayout:
    """The assignment of every model tensor to one of ``num_fragments`` fragments."""

    fragments: tuple[Fragment, ...]

    @property
    def num_fragments(self) -> int:
        return len(self.fragments)

    def __getitem__(self, index: int) -> Fragment:
        return self.fragments[index]

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.fragments)

    @functools.cached_property
    def fingerprint(self) -> str:
        """A hash of every fragment's tensor names, shapes and dtypes, in order (computed once: the
        layout is immutable, and the learner stamps it on every transfer)."""
        doc = [
            [[t.name, list(t.shape), t.dtype] for t in frag.tensors] for frag in self.fragments
        ]
        return "layout-" + hashlib.sha256(json.dumps(doc, separators=(",", ":")).encode()).hexdigest()[:24]

    def fragment_of(self, name: str) -> int:
        for frag in self.fragments:
            if name in frag.names:
                return frag.index
        raise KeyError(name)

    def check_same(self, other_fingerprint: str, *, who: str = "peer") -> None:
        """Raise LayoutMismatchError unless ``other_fingerprint`` equals ours."""
        if other_fingerprint != self.fingerprint:
            raise LayoutMismatchError(
                f"fragment layout mismatch: {who} has {other_fingerprint}, expected {self.fingerprint} "
                "(different model, parameter dtypes or number of fragments)"
            )


def partition(specs: Iterable[TensorSpec], num_fragments: int) -> FragmentLayout:
    """Greedy balanced bin packing of tensors into ``num_fragments`` fragments."""
    specs = list(specs)
    if num_fragments < 1:
        raise ValueError(f"num_fragments must be >= 1, got {num_fragments}")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError("tensor names must be unique")
    if num_fragments > len(specs):
        raise ValueError(
            f"cannot split {len(specs)} tensors into {num_fragments} non-empty fragments; "
            "use fewer fragments"
        )
    order = {s.name: i for i, s in enumerate(specs)}
    # (load, tensors, index): equal loads go to the bin with fewer tensors, so even zero-size tensors spread.
    heap: list[tuple[int, int, int]] = [(0, 0, p) for p in range(num_fragments)]
    bins: list[list[TensorSpec]] = [[] for _ in range(num_fragments)]
    # Largest first; ties by name so the result never depends on input order of equal sizes.
    for spec in sorted(specs, key=lambda s: (-s.nbytes, s.name)):
        load, count, p = heapq.heappop(heap)
        bins[p].append(spec)
        heapq.heappush(heap, (load + spec.nbytes, count + 1, p))
    return FragmentLayout(
        tuple(
            Fragment(p, tuple(sorted(b, key=lambda s: order[s.name]))) for p, b in enumerate(bins)
        )
    )


def partition_tensors(named: Mapping[str, torch.Tensor] | Sequence[tuple[str, torch.Tensor]],
                      num_fragments: int) -> FragmentLayout:
    """Partition a state dict (or ``named_parameters()`` list) of tensors."""
    items = named.items() if isinstance(named, Mapping) else named
    return partition([TensorSpec.of(n, t) for n, t in items], num_fragments)
