"""The model every learner trains: a small GPT over byte tokens, dense or mixture-of-experts.

Design decisions:

- **Small and CPU-friendly by default.** The defaults (4 layers, d_model 128, context 128) give
  about 0.88M parameters, so ``ddiloco run`` trains several learners on a laptop in minutes and
  the loss still falls well below the byte-unigram baseline. Everything scales up by config.
- **Many named tensors.** The LM head is *not* tied to the token embedding and every block keeps
  its own biases, so the fragment partitioner (``ddiloco.fragments.partition``) has enough
  tensors to pack P = 24 near-equal fragments. Embedding tensors are named ``tok_emb`` and
  ``pos_emb`` because the synchronizer's merge matches ``*tok_emb*`` / ``*pos_emb*`` to give
  them a plain weighted mean instead of radial-directional averaging.
- **Deterministic construction.** ``build_model(cfg, seed)`` builds on the meta device and then
  initialises every parameter from its own ``torch.Generator``: the same (cfg, seed) gives
  bit-identical weights in every process, whatever the global RNG state or thread count, and
  the caller's global RNG is left untouched. Learners that start from the same seed therefore
  agree with the synchronizer's initial global fragments without shipping weights.
- **Init** follows GPT-2: N(0, 0.02) for linear and embedding weights, zero biases, and the
  projections that write into the residual stream scaled by 1/sqrt(2 * n_layer).
- **MoE** (``kind="moe"``) replaces each block's MLP with ``n_experts`` GELU MLPs behind a
  linear router: softmax over experts, keep the top-k, renormalise their weights to sum to 1
  (Mixtral-style), and add the weighted expert outputs. Dispatch loops over experts, never over
  tokens. The Switch-Transformer load-balancing loss ``E * sum_e f_e * P_e`` (f_e: share of
  routed assignments that went to expert e, P_e: mean router probability of e; equals 1 when
  perfectly balanced) is averaged over layers and added to the cross-entropy with weight
  ``aux_loss_coef``.

Models defined outside this package need no registration: ``kind: ref`` with
``ref: "package.module:factory"`` imports that function and calls it with ``options`` as keyword
arguments (the config may also say just ``model: "package.module:factory"``), and ``kind: hf``
builds a Hugging Face ``transformers`` causal LM from a *local* config (``ref``: a
``config.json`` or a folder holding one; ``options`` override its fields) with random weights;
nothing is downloaded. Both are built under a fixed torch seed, so every learner starts from the
same weights (the first learner's are the genesis model anyway). They are called as
``model(inputs)`` and must return the logits ``[B, T, vocab]`` (a tensor, the first element of a
tuple, or an object with ``.logits`` as ``transformers`` returns); the loss is the cross-entropy
against the targets (``lm_forward``).

Plugging in another kind of model (e.g. a vision model): write a builder
``def build_vit(cfg: ModelConfig, seed: int) -> nn.Module`` and register it in ``MODEL_KINDS``
under a new ``kind``. The learner only relies on this contract:

- the batch is an ``(inputs, targets)`` pair of tensors, produced by the data side;
- ``model(inputs, targets)`` returns ``(outputs, loss)`` with a scalar ``loss`` to backpropagate;
- construction is deterministic for a seed (so learners agree on the initial model), and the
  parameter names are stable (the fragment layout and ``model_fingerprint`` depend on them).

Fields of ``ModelConfig`` that a kind does not use are simply ignored by its builder; a kind that
needs new fields adds them here with defaults, so existing configs keep their fingerprints only
if they are unaffected (the fingerprint hashes every field, which is the safe direction).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from pydantic.dataclasses import dataclass as pydantic_dataclass
from torch import nn

from ddiloco.core.config import STRICT

INIT_STD = 0.02


@pydantic_dataclass(frozen=True, kw_only=True, config=STRICT)
class ModelConfig:
    """Architecture of the model a run trains. Part of the model fingerprint, field by field."""

    kind: str = "gpt"
    """Which builder in ``MODEL_KINDS`` makes the model: ``"gpt"`` (dense) or ``"moe"``."""
    vocab_size: int = 256
    """Number of token ids. Byte-level data needs at least 256."""
    context: int = 128
    """Maximum sequence length T (size of the learned position embedding)."""
    d_model: int = 128
    """Width of the residual stream."""
    n_layer: int = 4
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide ``d_model``."""
    mlp_ratio: int = 4
    """Hidden width of each MLP (and each expert) as a multiple of ``d_model``."""
    dropout: float = 0.0
    """Dropout on attention weights and residual branches, in [0, 1). 0 keeps training deterministic."""
    tie_embeddings: bool = False
    """Share the token embedding with the LM head. Off by default: more tensors to fragment."""
    n_experts: int = 4
    """MoE only: experts per block."""
    top_k: int = 2
    """MoE only: experts each token is routed to, 1 <= top_k <= n_experts."""
    aux_loss_coef: float = 0.01
    """MoE only: weight of the load-balancing loss added to the cross-entropy."""
    ref: str = ""
    """kind ``ref``: ``package.module:factory``, an importable function returning an
    ``nn.Module``; kind ``hf``: a local Hugging Face config (``config.json`` or a folder with one)."""
    options: dict[str, Any] = field(default_factory=dict)
    """kind ``ref``: keyword arguments of the factory; kind ``hf``: overrides of the config's fields."""

    def __post_init__(self) -> None:
        if self.kind not in MODEL_KINDS:
            raise ValueError(f"unknown model kind {self.kind!r}; known kinds: {sorted(MODEL_KINDS)}")
        if self.kind == "ref" and not _REF.fullmatch(self.ref):
            raise ValueError(f"model kind 'ref' needs ref: 'package.module:factory', got {self.ref!r}")
        if self.kind == "hf" and not self.ref:
            raise ValueError("model kind 'hf' needs ref: a local config.json or a folder holding one")
        if self.kind not in ("ref", "hf") and (self.ref or self.options):
            raise ValueError(f"ref and options are for model kinds 'ref' and 'hf', not {self.kind!r}")
        for name in ("vocab_size", "context", "d_model", "n_layer", "n_head", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.d_model % self.n_head:
            raise ValueError(f"n_head ({self.n_head}) must divide d_model ({self.d_model})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.kind == "moe":
            if self.n_experts < 1:
                raise ValueError(f"n_experts must be >= 1, got {self.n_experts}")
            if not 1 <= self.top_k <= self.n_experts:
                raise ValueError(f"top_k must be in [1, n_experts={self.n_experts}], got {self.top_k}")
            if self.aux_loss_coef < 0 or not math.isfinite(self.aux_loss_coef):
                raise ValueError(f"aux_loss_coef must be finite and >= 0, got {self.aux_loss_coef}")

    @property
    def d_hidden(self) -> int:
        return self.mlp_ratio * self.d_model


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.d_hidden)
        self.proj = nn.Linear(cfg.d_hidden, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class MoE(nn.Module):
    """Top-k routed mixture of GELU MLP experts. ``forward`` returns (output, aux_loss)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_experts = cfg.n_experts
        self.top_k = cfg.top_k
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.experts = nn.ModuleList(MLP(cfg) for _ in range(cfg.n_experts))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Route flat tokens x [N, C]: (probs [N, E], top-k weights [N, k], top-k expert ids [N, k]).

        The top-k weights are the router probabilities of the chosen experts, renormalised to sum
        to 1 per token.
        """
        probs = F.softmax(self.router(x), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return probs, weights, experts

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs, weights, experts = self.route(flat)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token_idx, slot = (experts == e).nonzero(as_tuple=True)
            if token_idx.numel() == 0:
                continue
            y = expert(flat[token_idx]) * weights[token_idx, slot].unsqueeze(-1)
            out.index_add_(0, token_idx, y)
        # Switch Transformer load balancing: share of assignments per expert (not differentiable)
        # times mean router probability per expert (differentiable), scaled so balance == 1.
        assigned = F.one_hot(experts, self.n_experts).sum(dim=1).float()  # [N, E]
        frac = assigned.mean(dim=0) / self.top_k
        aux = self.n_experts * torch.sum(frac * probs.mean(dim=0))
        return out.view(shape), aux


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp: nn.Module = MoE(cfg) if cfg.kind == "moe" else MLP(cfg)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = x + self.attn(self.ln1(x))
        if isinstance(self.mlp, MoE):
            h, aux = self.mlp(self.ln2(x))
            return x + h, aux
        return x + self.mlp(self.ln2(x)), None


class GPT(nn.Module):
    """Decoder-only transformer over token ids; pre-LayerNorm blocks, learned positions."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.context, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.last_aux_loss: torch.Tensor | None = None
        """MoE: the (detached) load-balancing loss of the latest forward, for logging."""

    def init_weights(self, generator: torch.Generator) -> None:
        """GPT-2 init, drawn in parameter order from ``generator`` (deterministic for its seed)."""
        resid_std = INIT_STD / math.sqrt(2 * self.cfg.n_layer)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if isinstance(self._owner(name), nn.LayerNorm):
                    p.fill_(1.0 if name.endswith("weight") else 0.0)
                elif name.endswith("bias"):
                    p.zero_()
                elif name.endswith("proj.weight"):
                    p.normal_(0.0, resid_std, generator=generator)
                else:
                    p.normal_(0.0, INIT_STD, generator=generator)

    def _owner(self, param_name: str) -> nn.Module:
        return self.get_submodule(param_name.rpartition(".")[0])

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx, targets: int64 [B, T] with T <= context. Returns (logits [B, T, V], loss or None)."""
        _, t = idx.shape
        if t > self.cfg.context:
            raise ValueError(f"sequence length {t} exceeds the model context {self.cfg.context}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        aux_losses = []
        for block in self.blocks:
            x, aux = block(x)
            if aux is not None:
                aux_losses.append(aux)
        logits = self.lm_head(self.ln_f(x))
        aux_total = torch.stack(aux_losses).mean() if aux_losses else None
        self.last_aux_loss = aux_total.detach() if aux_total is not None else None
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        if aux_total is not None:
            loss = loss + self.cfg.aux_loss_coef * aux_total
        return logits, loss


def _build_gpt(cfg: ModelConfig, seed: int) -> nn.Module:
    with torch.device("meta"):
        model = GPT(cfg)
    model.to_empty(device="cpu")
    if cfg.tie_embeddings:  # to_empty makes fresh tensors, which unties shared parameters
        model.lm_head.weight = model.tok_emb.weight
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)
    model.init_weights(generator)
    return model


_REF = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


def resolve_ref(ref: str) -> Callable[..., Any]:
    """The object ``package.module:attr.path`` names, with a clear error when it does not exist."""
    module_name, _, attr = ref.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"model ref {ref!r}: cannot import {module_name!r} ({exc})") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"model ref {ref!r}: module {module_name!r} has no {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"model ref {ref!r} is not callable")
    return obj


def _seeded(seed: int, make: Callable[[], Any]) -> Any:
    """``make()`` under torch seed ``seed``, leaving the caller's global RNG state as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return make()


def _build_ref(cfg: ModelConfig, seed: int) -> nn.Module:
    factory = resolve_ref(cfg.ref)
    model = _seeded(seed, lambda: factory(**cfg.options))
    if not isinstance(model, nn.Module):
        raise ValueError(f"model ref {cfg.ref!r} returned {type(model).__name__}, not a torch.nn.Module")
    return model.float()


def hf_config(cfg: ModelConfig) -> Any:
    """The ``transformers`` config of an ``hf`` model: read from the local path, options applied."""
    try:
        transformers = importlib.import_module("transformers")
    except ImportError:
        raise ValueError("model kind 'hf' needs the transformers package: pip install 'ddiloco-training[hf]'") from None
    path = Path(cfg.ref).expanduser()
    if not path.exists():
        raise ValueError(f"model kind 'hf': {path} does not exist (a config.json or a folder holding one)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local config only: never reach for the hub
    try:
        if path.is_file():
            config = transformers.AutoConfig.for_model(**json.loads(path.read_text()))
        else:
            config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as exc:
        raise ValueError(f"model kind 'hf': cannot read a transformers config from {path}: {exc}") from None
    for key, value in cfg.options.items():
        setattr(config, key, value)
    vocab = getattr(config, "vocab_size", None)
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if vocab is not None and vocab < cfg.vocab_size:
        raise ValueError(f"model kind 'hf': the config's vocab_size {vocab} is below model.vocab_size {cfg.vocab_size}")
    if positions is not None and positions < cfg.context:
        raise ValueError(f"model kind 'hf': the config allows {positions} positions, fewer than model.context "
                         f"{cfg.context}")
    return config


def _build_hf(cfg: ModelConfig, seed: int) -> nn.Module:
    import transformers

    config = hf_config(cfg)
    config.use_cache = False  # training and evaluation only: no key/value cache
    model = _seeded(seed, lambda: transformers.AutoModelForCausalLM.from_config(config))
    return model.float()


def lm_forward(model: nn.Module, x: torch.Tensor, y: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logits, loss) of any model kind: the built-in GPT computes its own loss (with the MoE
    auxiliary loss); other modules are called as ``model(x)`` and their logits (a tensor, the
    first element of a tuple, or ``.logits``) give the cross-entropy against ``y``."""
    if isinstance(model, GPT):
        return model(x, y)
    out = model(x)
    logits = out.logits if hasattr(out, "logits") else out[0] if isinstance(out, tuple | list) else out
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        raise ValueError("the model must return logits [batch, time, vocab] (a tensor, a tuple starting with "
                         f"them, or an object with .logits), got {type(logits).__name__}")
    if y is None:
        return logits, None
    return logits, F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))


def model_section(value: Any) -> Any:
    """The ``model`` config section, accepting the shorthands ``"package.module:factory"`` and
    ``"hf:PATH"`` for ``{kind: ref, ref: ...}`` and ``{kind: hf, ref: PATH}``."""
    if isinstance(value, str):
        if value.startswith("hf:"):
            return {"kind": "hf", "ref": value[3:]}
        return {"kind": "ref", "ref": value}
    return value


MODEL_KINDS: dict[str, Callable[[ModelConfig, int], nn.Module]] = {
    "gpt": _build_gpt,
    "moe": _build_gpt,
    "ref": _build_ref,
    "hf": _build_hf,
}
"""Model builders by ``ModelConfig.kind``. Register a new kind here (see the module docstring)."""


def build_model(cfg: ModelConfig, seed: int) -> nn.Module:
    """The model for ``cfg``, on CPU in fp32, identical in every process for the same seed."""
    return MODEL_KINDS[cfg.kind](cfg, seed)


def num_params(model: nn.Module) -> int:
    """Number of distinct parameter elements (a tied tensor counts once)."""
    return sum(p.numel() for p in model.parameters())


def model_fingerprint(model: nn.Module, cfg: ModelConfig) -> str:
    """Identity of the architecture: config fields and every state-dict (name, shape, dtype).

    Two processes with equal fingerprints hold models whose state dicts line up tensor by tensor
    (the weights themselves are not hashed).
    """
    fields = dataclasses.asdict(cfg)
    for key in ("ref", "options"):  # added later: unset, they leave the built-in models' fingerprints as they were
        if not fields[key]:
            del fields[key]
    h = hashlib.sha256()
    h.update(json.dumps(fields, sort_keys=True).encode())
    for name, tensor in model.state_dict().items():
        h.update(f"\n{name}|{tuple(tensor.shape)}|{tensor.dtype}".encode())
    return "model-" + h.hexdigest()[:24]
