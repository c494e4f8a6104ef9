"""``TokenSequence``: token arrays (in memory or memory-mapped files) indexed as one, without
copying; and the unigram entropy of a token stream."""

from __future__ import annotations

import operator
from collections.abc import Iterable, Iterator
from typing import Any, overload

import numpy as np

from ddiloco.training.data.tokenizer import BYTE_VOCAB


class TokenSequence:
    """A read-only concatenation of 1-D token arrays, indexed as one array without copying.

    The parts are numpy arrays of one unsigned type (uint8, uint16 or uint32), typically
    ``numpy.memmap`` views of token files: slicing returns another ``TokenSequence`` of views,
    and ``take`` gathers only the requested positions, so a shard that spans several multi-GB
    files costs nothing until batches are drawn from it. ``numpy.asarray`` materialises it (for
    tests and small sequences; the training path never does).
    """

    __slots__ = ("dtype", "offsets", "parts")

    def __init__(self, parts: Iterable[np.ndarray], dtype: np.dtype | None = None) -> None:
        arrays = tuple(parts)
        for a in arrays:
            if not isinstance(a, np.ndarray) or a.ndim != 1:
                raise ValueError("token arrays must be 1-D numpy arrays")
        if dtype is None:
            if not arrays:
                raise ValueError("an empty TokenSequence needs an explicit dtype")
            dtype = arrays[0].dtype
        self.dtype = np.dtype(dtype)
        if self.dtype.kind != "u" or self.dtype.itemsize not in (1, 2, 4):
            raise ValueError(f"token arrays must be uint8, uint16 or uint32, got {self.dtype}")
        if any(a.dtype != self.dtype for a in arrays):
            raise ValueError(f"token arrays mix types: {sorted({str(a.dtype) for a in arrays})}")
        self.parts = tuple(a for a in arrays if a.size)
        self.offsets = np.cumsum([0, *(a.size for a in self.parts)], dtype=np.int64)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @property
    def size(self) -> int:
        return len(self)

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    def __repr__(self) -> str:
        return f"TokenSequence({len(self)} x {self.dtype.name} in {len(self.parts)} parts)"

    @overload
    def __getitem__(self, key: slice) -> TokenSequence: ...
    @overload
    def __getitem__(self, key: int) -> np.integer: ...

    def __getitem__(self, key: slice | int) -> TokenSequence | np.integer:
        n = len(self)
        if isinstance(key, slice):
            start, stop, step = key.indices(n)
            if step != 1:
                raise ValueError("a TokenSequence slices with step 1 only")
            return self._slice(start, max(start, stop))
        i = operator.index(key)
        if not -n <= i < n:
            raise IndexError(f"token {i} out of range for {n} tokens")
        i %= n
        part = int(np.searchsorted(self.offsets, i, side="right")) - 1
        return self.parts[part][i - int(self.offsets[part])]

    def _slice(self, start: int, stop: int) -> TokenSequence:
        kept = []
        for part, offset in zip(self.parts, self.offsets[:-1].tolist(), strict=True):
            lo, hi = max(start - offset, 0), min(stop - offset, part.size)
            if lo < hi:
                kept.append(part[lo:hi])
        return TokenSequence(kept, dtype=self.dtype)

    def take(self, index: np.ndarray) -> np.ndarray:
        """The tokens at ``index`` (any shape of int positions), as a new array of ``dtype``."""
        index = np.asarray(index, dtype=np.int64)
        if len(self.parts) == 1:
            return np.asarray(self.parts[0][index])
        if index.size and (index.min() < 0 or index.max() >= len(self)):
            raise IndexError(f"token positions out of range for {len(self)} tokens")
        out = np.empty(index.shape, dtype=self.dtype)
        owner = np.searchsorted(self.offsets, index, side="right") - 1
        for part in np.unique(owner).tolist():
            mask = owner == part
            out[mask] = self.parts[part][index[mask] - self.offsets[part]]
        return out

    def chunks(self, size: int) -> Iterator[np.ndarray]:
        """The tokens in order, as views of at most ``size`` tokens each."""
        for part in self.parts:
            for i in range(0, part.size, size):
                yield part[i : i + size]

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        whole = np.concatenate(self.parts) if self.parts else np.empty(0, self.dtype)
        return whole if dtype is None else whole.astype(dtype)


def as_token_sequence(tokens: np.ndarray | TokenSequence) -> TokenSequence:
    """``tokens`` as a ``TokenSequence`` (a 1-D uint8/uint16/uint32 array becomes its one part)."""
    if isinstance(tokens, TokenSequence):
        return tokens
    array = np.asarray(tokens)
    return TokenSequence([array], dtype=array.dtype)


def unigram_entropy(tokens: np.ndarray | TokenSequence) -> float:
    """Entropy of the token distribution in nats: the loss of the best context-free model.

    Counts are accumulated chunk by chunk, so a mapped multi-GB split is streamed, not loaded.
    """
    if isinstance(tokens, np.ndarray) and tokens.dtype == np.uint8:
        counts = np.bincount(np.asarray(tokens, dtype=np.uint8), minlength=BYTE_VOCAB).astype(np.float64)
    else:
        total = np.zeros(0, dtype=np.int64)
        for chunk in as_token_sequence(tokens).chunks(1 << 22):
            c = np.bincount(chunk)
            if c.size > total.size:
                total = np.pad(total, (0, c.size - total.size))
            total[: c.size] += c
        counts = total.astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())
