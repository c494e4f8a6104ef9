"""The global model's loss curve, measured outside the learners while a run trains.

``global_eval.jsonl`` holds one line per point: ``{"t", "tokens", "loss", "min_version"}`` where
``tokens`` is what the whole fleet had processed and ``min_version`` the oldest fragment version
evaluated. An evaluation job beside a deployment would do the same: fetch the state as a joining
learner does (FetchState) and run the held-out batches, so no learner spends training time on it.

Decisions:

- **Built once, before training.** The evaluator (model, fragment layout, held-out batches) is
  built before any learner starts, never lazily in the sampling thread: built there, the first
  point came ``every_s`` plus a corpus load late, and a short run could end with two points at
  the same token count.
- **A point at genesis, one at the end.** The first point is the untrained model at 0 tokens. It
  is evaluated locally: every learner builds the same model from the same seed and the genesis
  upload is exactly that model (version 0 of every fragment), so there is nothing to wait for.
  The last point is the final evaluation (on ``final_batches``), marked ``"final": true``. In
  between, one point every ``every_s``; a point whose fetch fails (the synchronizer restarting
  under chaos) is skipped.
- **The final evaluation scores the whole held-out split; the periodic ones a sample.** The
  final loss is the number runs and modes are compared by, so it reads every window of
  ``context`` tokens of the eval split once (``HeldOut`` with 0 batches: 150 batches of 16 for the
  default corpus); the points in between read ``train.eval_batches`` evenly spaced windows, as
  the learners' own evaluations do, to spare the CPU the learners train on. Batches of the
  whole split are made as they are evaluated, so a large eval file is never held in memory.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from ddiloco.fragments.outer_gradient import scatter
from ddiloco.fragments.partition import partition_tensors
from ddiloco.fragments.payload import decode_fragment
from ddiloco.lab.event_logs import load_jsonl
from ddiloco.learner.config import load_learner_config
from ddiloco.protocol.client import fetch_state
from ddiloco.protocol.shards import synchronizer_targets
from ddiloco.training.data import eval_batches, load_corpus
from ddiloco.training.data.sequences import TokenSequence, as_token_sequence
from ddiloco.training.inner_loop import evaluate
from ddiloco.training.model import build_model

CURVE_FILE = "global_eval.jsonl"

Batches = list[tuple[torch.Tensor, torch.Tensor]]

WHOLE_SPLIT = 0
"""``batches`` of ``HeldOut`` (and ``run.final_eval_batches``) that asks for the whole split."""


class HeldOut:
    """Fixed evaluation batches of the held-out split, and a record of what they cover.

    ``batches == 0`` (``WHOLE_SPLIT``): the whole split in order, as consecutive windows of
    ``context + 1`` tokens starting every ``context`` tokens, so each target token is scored once
    (the inputs of one window end where the next one's start; windows never overlap in what
    they score). The last ``(len - 1) mod context`` targets, less than one window, are left out;
    the last batch may hold fewer than ``batch_size`` windows (the loss is a mean over tokens, so
    it weighs nothing differently). Batches are made as they are read.

    ``batches == N``: ``eval_batches``' N batches of evenly spaced windows (what the learners'
    periodic evaluations and the earlier final evaluation read), made once.

    Both are deterministic: the same split, batch size and context give the same batches.
    """

    def __init__(self, eval_tokens: np.ndarray | TokenSequence, batch_size: int, context: int,
                 batches: int = WHOLE_SPLIT) -> None:
        if batches < 0:
            raise ValueError(f"batches must be >= 0 (0: the whole split), got {batches}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.tokens_in_split = len(eval_tokens)
        self.batch_size, self.context = batch_size, context
        if batches:
            self._fixed: Batches | None = eval_batches(eval_tokens, batch_size, context, batches)
            self.windows = batches * batch_size
            self.split = "spaced"
            return
        if self.tokens_in_split < context + 1:
            raise ValueError(f"eval split has {self.tokens_in_split} tokens, fewer than context + 1 = {context + 1}")
        self._fixed = None
        self._tokens = as_token_sequence(eval_tokens)
        self.windows = (self.tokens_in_split - 1) // context
        self.split = "all"

    def __len__(self) -> int:
        return len(self._fixed) if self._fixed is not None else -(-self.windows // self.batch_size)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._fixed is not None:
            return self._fixed[i]
        if not 0 <= i < len(self):
            raise IndexError(f"batch {i} out of range for {len(self)} batches")
        first = i * self.batch_size
        starts = np.arange(first, min(first + self.batch_size, self.windows), dtype=np.int64) * self.context
        index = starts[:, None] + np.arange(self.context + 1, dtype=np.int64)
        windows = torch.from_numpy(self._tokens.take(index).astype(np.int64))
        return windows[:, :-1], windows[:, 1:]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return (self[i] for i in range(len(self)))

    @property
    def scored_tokens(self) -> int:
        """Target tokens one evaluation scores."""
        return self.windows * self.context

    def describe(self) -> dict[str, Any]:
        """What a result records of its evaluation set: ``split`` "all" (the whole held-out split
        once) or "spaced" (evenly spaced windows), batches, windows, the target tokens scored and
        the split's size."""
        return {"split": self.split, "batches": len(self), "batch_size": self.batch_size, "windows": self.windows,
                "tokens": self.scored_tokens, "split_tokens": self.tokens_in_split}


class GlobalModelEval:
    """Evaluates the global model on the held-out split: the genesis model locally, later
    versions fetched from a synchronizer."""

    def __init__(self, doc_path: pathlib.Path, *, batches: int, final_batches: int = WHOLE_SPLIT) -> None:
        self.cfg = cfg = load_learner_config(str(doc_path), learner_id="evaluator")
        self.model = build_model(cfg.model, cfg.train.seed)
        self.params = dict(self.model.named_parameters())
        self.layout = partition_tensors(list(self.params.items()), cfg.protocol.num_fragments)
        corpus = load_corpus(cfg.data)
        self.batches = eval_batches(corpus.eval, cfg.data.batch_size, cfg.data.context, batches)
        self.final_batches = HeldOut(corpus.eval, cfg.data.batch_size, cfg.data.context, final_batches)
        self._genesis = {name: p.detach().clone() for name, p in self.params.items()}

    def genesis(self) -> tuple[float, dict[int, int]]:
        """The untrained model every learner starts from (version 0 of every fragment)."""
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(self._genesis[name])
        return evaluate(self.model, self.batches, torch.device("cpu")), {f.index: 0 for f in self.layout}

    def fetch(self, target: str, *, final: bool = False, timeout_s: float = 60.0) -> tuple[float, dict[int, int]]:
        """Fetch the current global model from ``target`` (with shards, every shard's address,
        comma-separated) and evaluate it: (loss, fragment -> version)."""
        limit = self.cfg.protocol.max_chunk_bytes

        async def fetch_all() -> list[Any]:
            out = []
            for t in synchronizer_targets(target):
                out += await fetch_state(t, max_chunk_bytes=limit, learner_id="evaluator",
                                         credentials=self.cfg.credentials)
            return out

        transfers = asyncio.run(asyncio.wait_for(fetch_all(), timeout_s))
        missing = set(range(self.layout.num_fragments)) - {t.header.fragment_id for t in transfers}
        if missing:
            raise RuntimeError(f"fragments {sorted(missing)} were served by no synchronizer at {target}")
        versions = {}
        for transfer in transfers:
            scatter(self.layout[transfer.header.fragment_id], decode_fragment(transfer, self.layout), self.params)
            versions[transfer.header.fragment_id] = transfer.header.version
        batches = self.final_batches if final else self.batches
        return evaluate(self.model, batches, torch.device("cpu")), versions  # type: ignore[arg-type]


class EvalCurve:
    """Writes ``global_eval.jsonl``: the genesis point at ``start``, a point every ``every_s``
    (0: none) on a thread of its own, and the final evaluation at ``finish``."""

    def __init__(self, out: pathlib.Path, evaluator: GlobalModelEval, *, target: Callable[[], str],
                 tokens: Callable[[], int], every_s: float) -> None:
        self.path = out / CURVE_FILE
        self.evaluator, self.target, self.tokens, self.every_s = evaluator, target, tokens, every_s
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="global-eval", daemon=True)

    def start(self) -> None:
        self._write(0, *self.evaluator.genesis())
        if self.every_s > 0:
            self._thread.start()

    def finish(self, tokens: int) -> float:
        """Stop sampling, evaluate the final global model, write it as the last point."""
        self._stopping.set()
        if self._thread.ident is not None:
            self._thread.join(timeout=120)
        with self._lock:
            loss, versions = self.evaluator.fetch(self.target(), final=True)
        self._write(tokens, loss, versions, final=True)
        return loss

    def stop(self) -> None:
        self._stopping.set()
        if self._thread.ident is not None:
            self._thread.join(timeout=120)

    def _loop(self) -> None:
        while not self._stopping.wait(self.every_s):
            tokens = int(self.tokens())
            try:
                with self._lock:
                    loss, versions = self.evaluator.fetch(self.target(), timeout_s=max(5.0, self.every_s))
            except Exception:  # the synchronizer may be down (chaos) or not ready yet: no point
                continue
            self._write(tokens, loss, versions)

    def _write(self, tokens: int, loss: float, versions: dict[int, int], final: bool = False) -> None:
        write_point(self.path.parent, tokens, loss, min(versions.values(), default=0), final=final)


def write_point(out: pathlib.Path, tokens: int, loss: float, min_version: int, *, final: bool = False) -> None:
    """Append one point to a run's curve."""
    record: dict[str, Any] = {"t": time.time(), "tokens": tokens, "loss": loss, "min_version": min_version}
    if final:
        record["final"] = True
    with open(out / CURVE_FILE, "a") as f:
        f.write(json.dumps(record) + "\n")


def read_curve(out: pathlib.Path) -> list[tuple[float, float]]:
    """(tokens, loss) points of a run's ``global_eval.jsonl`` (empty when it has none)."""
    path = out / CURVE_FILE
    if not path.exists():
        return []
    return [(float(e["tokens"]), float(e["loss"])) for e in load_jsonl(path)]
