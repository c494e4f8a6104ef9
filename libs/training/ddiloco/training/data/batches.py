"""Shards and batches: a learner's disjoint slice of the train tokens, its sampling generator,
and the fixed eval batches.

The batch format is what any model kind consumes: an ``(inputs, targets)`` pair of int64 tensors
``[B, T]`` with targets = inputs shifted by one token. Batches are gathered from the stored token
type (uint8, uint16 or uint32) and widened only for the ``B x (T+1)`` window, so the byte corpora
give exactly the numbers they always did. Shards are disjoint contiguous slices and batches come
from an explicit ``torch.Generator``, so (corpus, seed, shard) fixes the data.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import numpy as np

from ddiloco.training.data.sequences import TokenSequence, as_token_sequence

if TYPE_CHECKING:
    import torch
# torch itself is imported where batches are made: configs, corpora and ``ddiloco prepare-data``
# do not pay its start-up time (seconds) for data that never becomes a tensor there.


def shard_generator(seed: int, shard_index: int | str) -> torch.Generator:
    """The batch-sampling generator of one shard: independent streams per (seed, shard).
    ``shard_index`` may be any key naming the stream (a learner whose shard came from its id
    passes the shard and the id: ``LearnerConfig.batch_stream``)."""
    import torch

    digest = hashlib.sha256(f"ddiloco-data:{seed}:{shard_index}".encode()).digest()
    generator = torch.Generator(device="cpu")
    generator.manual_seed(int.from_bytes(digest[:8], "big") & ((1 << 63) - 1))
    return generator


def _windows(tokens: TokenSequence, starts: torch.Tensor, context: int) -> torch.Tensor:
    """int64 ``[len(starts), context + 1]``: the tokens from each start, gathered in the stored
    type and widened only here (the values, and so every batch, match the former uint8 path)."""
    import torch

    index = starts.numpy()[:, None] + np.arange(context + 1, dtype=np.int64)
    return torch.from_numpy(tokens.take(index).astype(np.int64))


class TokenShard:
    """Shard ``shard_index`` of ``num_shards``: train tokens [s*L//n, (s+1)*L//n).

    A contiguous slice is a sample of the whole corpus only if the layout is: text corpora lay
    their train files out shuffled by default (``DataConfig.order``); ``tokens:`` files are cut as
    written, so their documents should be shuffled before they are written (``docs/data.md``).

    ``tokens`` may be an in-memory array or a ``TokenSequence`` of mapped files; the shard keeps a
    view (``sequence``), never a copy, so a learner of a multi-GB corpus holds only its batches.
    """

    def __init__(self, tokens: np.ndarray | TokenSequence, shard_index: int, num_shards: int) -> None:
        if num_shards < 1 or not 0 <= shard_index < num_shards:
            raise ValueError(f"shard_index {shard_index} out of range for {num_shards} shards")
        whole = as_token_sequence(tokens)
        length = len(whole)
        self.shard_index, self.num_shards = shard_index, num_shards
        self.start = shard_index * length // num_shards
        self.stop = (shard_index + 1) * length // num_shards
        self.sequence = whole[self.start : self.stop]

    def __len__(self) -> int:
        return len(self.sequence)

    @property
    def tokens(self) -> torch.Tensor:
        """The shard as one tensor of its stored type: a view when the shard is one in-memory
        array (the byte corpora), else a copy. Sampling never uses it; avoid it on file shards."""
        import torch

        parts = self.sequence.parts
        if len(parts) == 1 and parts[0].flags.writeable and not isinstance(parts[0], np.memmap):
            return torch.from_numpy(parts[0])
        native = self.sequence.dtype.newbyteorder("=")
        return torch.from_numpy(np.asarray(self.sequence).astype(native, copy=False))

    def sample_batch(
        self, generator: torch.Generator, batch_size: int, context: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch_size`` random windows: (x, y) int64 [B, T], y = x shifted by one token."""
        if len(self) < context + 1:
            raise ValueError(
                f"shard {self.shard_index}/{self.num_shards} has {len(self)} tokens, "
                f"fewer than context + 1 = {context + 1}: use a larger corpus or fewer learners"
            )
        import torch

        starts = torch.randint(0, len(self) - context, (batch_size,), generator=generator)
        windows = _windows(self.sequence, starts, context)
        return windows[:, :-1], windows[:, 1:]


def eval_batches(
    eval_tokens: np.ndarray | TokenSequence, batch_size: int, context: int, max_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``max_batches`` fixed batches of evenly spaced windows over the eval tokens (only the
    windows are read: a mapped eval file is never loaded whole)."""
    if len(eval_tokens) < context + 1:
        raise ValueError(f"eval split has {len(eval_tokens)} tokens, fewer than context + 1 = {context + 1}")
    if batch_size < 1 or max_batches < 1:
        raise ValueError("batch_size and max_batches must be >= 1")
    import torch

    tokens = as_token_sequence(eval_tokens)
    starts = torch.from_numpy(np.linspace(0, len(eval_tokens) - context - 1, batch_size * max_batches))
    windows = _windows(tokens, starts.long(), context)
    return [(w[:, :-1], w[:, 1:]) for w in windows.split(batch_size)]
