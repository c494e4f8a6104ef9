"""Decoupled DiLoCo around your own model, data and training loop.

Nothing here comes from ddiloco except ``DecoupledSync``: the model (a small GRU language model,
or any Hugging Face causal LM built from a local config with ``--hf-config``), the data (bytes of
files from Python's standard library), the optimizer and the loop are the user's. Start a
synchronizer, then one process per learner::

    ddiloco synchronizer --listen 127.0.0.1:7000 --state-dir /tmp/state --config examples/own_loop.yaml
    python examples/own_loop.py --synchronizer 127.0.0.1:7000 --learner-id learner-0 &
    python examples/own_loop.py --synchronizer 127.0.0.1:7000 --learner-id learner-1

The protocol settings (fragments, sync_every, mode) come from the same config file as the
synchronizer's, so both sides agree; the synchronizer refuses a learner that disagrees.

One learner may be several processes: under ``torchrun --nproc-per-node N`` the ranks train
with DistributedDataParallel (gloo on CPU, NCCL on GPUs) and join as one learner — rank 0
streams its fragments, every rank applies the merged ones::

    torchrun --nproc-per-node 2 examples/own_loop.py --synchronizer 127.0.0.1:7000 --learner-id learner-2

``--comm process`` runs the learner's communication in a process of its own (``comm="process"``),
with one process or with ranks.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddiloco.core.config import read_document
from ddiloco.learner.sync import DecoupledSync


class TinyGRU(nn.Module):
    """A byte-level GRU language model: returns logits [B, T, vocab]."""

    def __init__(self, vocab: int = 256, width: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.rnn = nn.GRU(width, width, batch_first=True)
        self.head = nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.embed(x))
        return self.head(h)


def make_model(vocab: int = 256, width: int = 64) -> nn.Module:
    """The factory a config can name by reference: ``model: "own_loop:make_model"``."""
    return TinyGRU(vocab, width)


def hf_model(config_path: str) -> nn.Module:
    """A Hugging Face causal LM with random weights from a local config (nothing downloaded)."""
    import transformers

    config = transformers.AutoConfig.for_model(**json.loads(Path(config_path).read_text()))
    return transformers.AutoModelForCausalLM.from_config(config)


def logits_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return out.logits if hasattr(out, "logits") else out


def corpus(shard: int, shards: int, max_bytes: int = 400_000) -> torch.Tensor:
    """This learner's slice of some standard-library source bytes (user data: any token tensor)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    data = bytearray()
    for path in sorted(root.glob("*.py")):
        data += path.read_bytes()
        if len(data) >= max_bytes:
            break
    tokens = torch.frombuffer(data[:max_bytes], dtype=torch.uint8).long()
    n = len(tokens)
    return tokens[shard * n // shards:(shard + 1) * n // shards]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--synchronizer", required=True)
    parser.add_argument("--learner-id", required=True)
    parser.add_argument("--config", default=str(Path(__file__).with_name("own_loop.yaml")),
                        help="the protocol section shared with the synchronizer")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--shard", type=int, default=0)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--hf-config", help="train a transformers causal LM built from this local config.json")
    parser.add_argument("--no-resume", action="store_true",
                        help="run every step from 1 even when the fleet is already training")
    parser.add_argument("--event-log")
    parser.add_argument("--summary-file")
    parser.add_argument("--min-step-s", type=float, default=0.0,
                        help="make every step last at least this long (a known pace, for tests)")
    parser.add_argument("--comm", choices=("thread", "process"), default="thread",
                        help="where the learner's communication runs: a thread of this process, or a "
                             "process of its own (shared memory)")
    args = parser.parse_args(argv)

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:  # started by torchrun: the ranks of this one learner
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank() if world > 1 else 0
    torch.manual_seed(0)  # every learner builds the same initial weights (the first one uploads them anyway)
    model = hf_model(args.hf_config) if args.hf_config else make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    forward = DistributedDataParallel(model) if world > 1 else model
    # each rank reads its own part of this learner's shard
    data = corpus(args.shard * world + rank, args.shards * world)
    gen = torch.Generator().manual_seed(1000 + args.shard * world + rank)
    batch, context = 8, 64

    document = read_document(args.config)
    sync = DecoupledSync(model, optimizer=opt, config={"protocol": document.get("protocol", {})},
                         synchronizer=args.synchronizer, learner_id=args.learner_id, steps=args.steps,
                         event_log=args.event_log, join_timeout_s=60.0, comm=args.comm,
                         model_ref="hf:" + args.hf_config if args.hf_config else "own_loop:make_model")
    signal.signal(signal.SIGTERM, lambda *_: sync.drain())
    start = sync.join(resume=not args.no_resume)
    if start is None:
        return 0
    loss_value = float("nan")
    for step in range(start + 1, args.steps + 1):
        began = time.perf_counter()
        starts = torch.randint(0, len(data) - context - 1, (batch,), generator=gen)
        window = data[starts.unsqueeze(1) + torch.arange(context + 1)]
        x, y = window[:, :-1], window[:, 1:]
        logits = logits_of(forward, x)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss_value = float(loss.detach())
        time.sleep(max(0.0, began + args.min_step_s - time.perf_counter()))
        sync.step(tokens=batch * context, loss=loss_value)
        if step % 50 == 0:
            print(f"{args.learner_id} step {step} loss {loss_value:.3f} versions {min(sync.versions.values())}",
                  file=sys.stderr)
        if sync.draining:
            break
    answered = sync.finish()
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    summary = {"learner_id": args.learner_id, "rank": rank, "world": world, "start_step": start,
               "steps": sync.step_count - start, "tokens": sync.tokens, "loss": loss_value,
               "all_answered": answered, "versions": sync.versions, "params_sha256": digest}
    print(json.dumps(summary))
    if args.summary_file:
        Path(args.summary_file + (f".rank{rank}" if world > 1 else "")).write_text(json.dumps(summary))
    if world > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
