"""The inner loop: AdamW steps on the learner's own data shard.

Warm-up then cosine decay, global-norm gradient clipping, bf16 autocast on CUDA, tokens counted.
Weight decay applies to matrices only (embeddings, biases and norms are exempt), as in GPT-2
style training. The loop knows nothing about fragments or the network.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext

import torch
from torch import nn

from ddiloco.training.config import TrainConfig
from ddiloco.training.model import lm_forward


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but torch.cuda.is_available() is False")
    return device


def lr_at(step: int, cfg: TrainConfig, resumed_at: int = 0) -> float:
    """Learning rate for 1-based ``step``: linear warm-up, then cosine to min_lr_ratio * lr.

    ``resumed_at``: the step a learner joined a training fleet at (0: it started the run). The
    schedule goes on from there, and the fresh optimizer state ramps in linearly over
    ``warmup_steps`` (Adam's first updates are as large as the rate whatever the gradient)."""
    if cfg.warmup_steps and step <= cfg.warmup_steps:
        rate = cfg.lr * step / cfg.warmup_steps
    else:
        span = max(1, cfg.steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        floor = cfg.lr * cfg.min_lr_ratio
        rate = floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    if resumed_at > 0 and cfg.warmup_steps:
        rate *= min(1.0, (step - resumed_at) / cfg.warmup_steps)
    return rate


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 and "emb" not in name else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class InnerLoop:
    def __init__(self, model: nn.Module, cfg: TrainConfig, device: torch.device) -> None:
        self.model = model.to(device)
        self.cfg = cfg
        self.device = device
        fused = device.type == "cuda"
        self.optimizer = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas,
                                           fused=fused or None)
        self.autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                         else nullcontext())
        self.step_count = 0
        self.resumed_at = 0
        """The step this learner joined a training fleet at (0: it started the run)."""

    def resume_at(self, step: int) -> None:
        """Continue the schedule from ``step`` (the next step is ``step + 1``)."""
        self.step_count = self.resumed_at = step

    def step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
        """One optimizer step; returns (loss, seconds)."""
        t0 = time.perf_counter()
        self.step_count += 1
        lr = lr_at(self.step_count, self.cfg, self.resumed_at)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.model.train()
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        with self.autocast:
            _, loss = lm_forward(self.model, x, y)
        assert loss is not None  # lm_forward gives a loss whenever it is given targets
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        value = float(loss.detach())
        return value, time.perf_counter() - t0

    @torch.no_grad()
    def evaluate(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        return evaluate(self.model, batches, self.device)


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> float:
    """Mean cross-entropy over fixed batches (MoE aux loss excluded)."""
    model.eval()
    total, count = 0.0, 0
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        logits, _ = lm_forward(model, x)
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1),
                                                 reduction="sum")
        total += float(loss)
        count += y.numel()
    model.train()
    return total / max(1, count)
