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
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from ddiloco.fragments.outer_gradient import scatter
from ddiloco.fragments.partition import partition_tensors
from ddiloco.fragments.payload import decode_fragment
from ddiloco.lab.event_logs import load_jsonl
from ddiloco.learner.config import load_learner_config
from ddiloco.protocol.client import fetch_state
from ddiloco.protocol.shards import synchronizer_targets
from ddiloco.training.data import eval_batches, load_corpus
from ddiloco.training.inner_loop import evaluate
from ddiloco.training.model import build_model

CURVE_FILE = "global_eval.jsonl"

Batches = list[tuple[torch.Tensor, torch.Tensor]]


class GlobalModelEval:
    """Evaluates the global model on the held-out split: the genesis model locally, later
    versions fetched from a synchronizer."""

    def __init__(self, doc_path: pathlib.Path, *, batches: int, final_batches: int) -> None:
        self.cfg = cfg = load_learner_config(str(doc_path), learner_id="evaluator")
        self.model = build_model(cfg.model, cfg.train.seed)
        self.params = dict(self.model.named_parameters())
        self.layout = partition_tensors(list(self.params.items()), cfg.protocol.num_fragments)
        corpus = load_corpus(cfg.data)
        self.batches = eval_batches(corpus.eval, cfg.data.batch_size, cfg.data.context, batches)
        self.final_batches = eval_batches(corpus.eval, cfg.data.batch_size, cfg.data.context, final_batches)
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
        return evaluate(self.model, batches, torch.device("cpu")), versions


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
