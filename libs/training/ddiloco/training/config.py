"""The inner loop's configuration: the ``train`` section of a config document, shared by every
learner, validated on construction. The ``model`` and ``data`` sections are ``model.ModelConfig``
and ``data.DataConfig``.
"""

from __future__ import annotations

from typing import Literal

from pydantic.dataclasses import dataclass

from ddiloco.core.config import STRICT


@dataclass(frozen=True, kw_only=True, config=STRICT)
class TrainConfig:
    """The inner loop."""

    steps: int = 600
    """Inner steps to run (the learner exits after them)."""
    lr: float = 4.5e-3
    """Peak AdamW learning rate. 4.5e-3 (3e-3 before): at the default budget it ends lower than
    3e-3 in every mode measured, and a higher one does not pay in decoupled mode, whose merges
    apply to a model that has moved on since the send; data-parallel training on the combined
    batch of three learners is best near 6e-3-9e-3 (docs/quality.md, sections 1, 6 and 6b)."""
    min_lr_ratio: float = 0.1
    """Cosine decay floor as a fraction of the peak."""
    warmup_steps: int = 60
    """Linear warm-up steps. 60 (a tenth of the default run) rather than 30: the first outer
    gradients of a decoupled fleet come from the warm-up's steps, and a longer one gains 1-2% of
    final eval loss at the default budget (docs/quality.md)."""
    weight_decay: float = 0.1
    """AdamW weight decay (matrices only; biases, norms and embeddings get none)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    grad_clip: float = 1.0
    """Global gradient-norm clip (0 disables)."""
    device: str = "auto"
    """"cpu", "cuda", "cuda:N" or "auto" (cuda when available)."""
    threads: int = 0
    """torch intra-op threads; 0 = the CPUs this process may use (its affinity, capped by its
    cgroup's CPU limit: a pod's `resources.limits.cpu`, rounded up)."""
    eval_every: int = 100
    """Evaluate every N steps (and at the end); 0 = only at the end."""
    eval_batches: int = 8
    """Batches per evaluation."""
    seed: int = 0
    """Model initialisation seed (must be the same on every learner: it is the genesis model)."""
    resume: Literal["fleet", "none"] = "fleet"
    """Where a learner that joins a fleet already training (a restart, a new pod, a scale-up)
    starts its step count, and so its learning-rate schedule and its place in the fragment
    schedule: "fleet" = at the fleet's progress (the fleet's step, or the fragments' versions x
    sync_every, whichever is further), running on to ``steps``; its fresh optimizer state ramps
    in over ``warmup_steps`` at the schedule's rate there. "none" = at step 1 with the full
    warm-up, for ``steps`` steps of its own. The learner that uploads the genesis model starts at 1."""

    def __post_init__(self) -> None:
        if self.steps < 1 or self.lr <= 0 or self.warmup_steps < 0 or self.grad_clip < 0:
            raise ValueError("need steps >= 1, lr > 0, warmup_steps >= 0, grad_clip >= 0")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError("min_lr_ratio must be in [0, 1]")
        if self.eval_every < 0 or self.eval_batches < 1 or self.threads < 0:
            raise ValueError("eval_every >= 0, eval_batches >= 1 and threads >= 0 required")
