"""The learner's model: shapes, GPT-2 init, causality, determinism, fingerprint, MoE routing.

References: nanoGPT (GPT-2 init, loss at init ~ ln(vocab)), Switch Transformer (load-balancing
loss equals 1 for a balanced router and grows as routing collapses).
"""

from __future__ import annotations

import hashlib
import math
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from ddiloco.training.model import (
    GPT,
    MODEL_KINDS,
    ModelConfig,
    MoE,
    build_model,
    model_fingerprint,
    num_params,
)

SMALL = {"context": 32, "d_model": 32, "n_layer": 2, "n_head": 2}


def _batch(cfg: ModelConfig, b: int = 4, t: int | None = None, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    t = t or cfg.context
    return (
        torch.randint(0, cfg.vocab_size, (b, t), generator=g),
        torch.randint(0, cfg.vocab_size, (b, t), generator=g),
    )


def _param_digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        h.update(name.encode())
        h.update(tensor.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("kind", ["gpt", "moe"])
def test_forward_backward_shapes(kind: str) -> None:
    cfg = ModelConfig(kind=kind, **SMALL)
    model = build_model(cfg, seed=0)
    x, y = _batch(cfg, b=3, t=20)
    logits, loss = model(x, y)
    assert logits.shape == (3, 20, cfg.vocab_size)
    assert loss is not None and loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert missing == []
    logits2, none = model(x)
    assert none is None and torch.allclose(logits2, logits.detach())


def test_default_size_and_embedding_names() -> None:
    cfg = ModelConfig()
    model = build_model(cfg, seed=0)
    assert 800_000 <= num_params(model) <= 1_000_000
    names = list(model.state_dict())
    assert any("tok_emb" in n for n in names) and any("pos_emb" in n for n in names)
    assert "lm_head.weight" in names
    assert model.lm_head.weight.data_ptr() != model.tok_emb.weight.data_ptr()


def test_loss_at_init_is_about_ln_vocab() -> None:
    cfg = ModelConfig()
    model = build_model(cfg, seed=1)
    with torch.no_grad():
        _, loss = model(*_batch(cfg, b=8))
    assert abs(loss.item() - math.log(256)) < 0.1


def test_gpt2_init_statistics() -> None:
    cfg = ModelConfig(n_layer=8)
    sd = build_model(cfg, seed=0).state_dict()
    assert sd["blocks.0.attn.qkv.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    assert sd["blocks.0.mlp.proj.weight"].std().item() == pytest.approx(0.02 / 4.0, rel=0.05)
    assert sd["blocks.3.attn.proj.weight"].std().item() == pytest.approx(0.02 / 4.0, rel=0.05)
    assert torch.all(sd["blocks.0.attn.qkv.bias"] == 0)
    assert torch.all(sd["blocks.0.ln1.weight"] == 1) and torch.all(sd["ln_f.bias"] == 0)


def test_attention_is_causal() -> None:
    cfg = ModelConfig(**SMALL)
    model = build_model(cfg, seed=0).eval()
    x, _ = _batch(cfg, b=2)
    x2 = x.clone()
    x2[:, 10] = (x2[:, 10] + 1) % cfg.vocab_size
    with torch.no_grad():
        a, _ = model(x)
        b, _ = model(x2)
    assert torch.allclose(a[:, :10], b[:, :10], atol=1e-6)
    assert not torch.allclose(a[:, 10:], b[:, 10:], atol=1e-4)


def test_sequence_longer_than_context_is_rejected() -> None:
    cfg = ModelConfig(**SMALL)
    with pytest.raises(ValueError, match="context"):
        build_model(cfg, seed=0)(torch.zeros(1, cfg.context + 1, dtype=torch.long))


@pytest.mark.parametrize("kind", ["gpt", "moe"])
def test_adamw_overfits_a_fixed_batch(kind: str) -> None:
    cfg = ModelConfig(kind=kind, **SMALL)
    torch.manual_seed(0)
    model = build_model(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x, y = _batch(cfg, b=4)
    losses = []
    for _ in range(40):
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.5, losses


def test_build_is_deterministic_and_leaves_global_rng_alone() -> None:
    cfg = ModelConfig(**SMALL)
    torch.manual_seed(123)
    a = build_model(cfg, seed=7)
    after = torch.rand(3)
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(999)
    b = build_model(cfg, seed=7)
    assert torch.equal(after, expected)
    assert _param_digest(a) == _param_digest(b)
    assert _param_digest(build_model(cfg, seed=8)) != _param_digest(a)


def test_build_is_identical_in_another_process() -> None:
    cfg = ModelConfig(kind="moe", **SMALL)
    model = build_model(cfg, seed=42)
    script = textwrap.dedent(
        """
        import hashlib, torch
        torch.set_num_threads(1)
        torch.manual_seed(5)
        from ddiloco.training.model import ModelConfig, build_model, model_fingerprint
        cfg = ModelConfig(kind="moe", context=32, d_model=32, n_layer=2, n_head=2)
        m = build_model(cfg, seed=42)
        h = hashlib.sha256()
        for name, t in m.state_dict().items():
            h.update(name.encode()); h.update(t.contiguous().numpy().tobytes())
        print(model_fingerprint(m, cfg), h.hexdigest())
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    fingerprint, digest = out.stdout.split()
    assert fingerprint == model_fingerprint(model, cfg)
    assert digest == _param_digest(model)


def test_fingerprint_tracks_config_not_weights() -> None:
    cfg = ModelConfig(**SMALL)
    fp = model_fingerprint(build_model(cfg, seed=0), cfg)
    assert fp.startswith("model-") and len(fp) == len("model-") + 24
    assert model_fingerprint(build_model(cfg, seed=1), cfg) == fp
    for change in ({"n_layer": 3}, {"dropout": 0.1}, {"kind": "moe"}, {"tie_embeddings": True}):
        other = ModelConfig(**{**SMALL, **change})
        assert model_fingerprint(build_model(other, seed=0), other) != fp, change


def test_tied_embeddings_share_one_tensor() -> None:
    cfg = ModelConfig(tie_embeddings=True, **SMALL)
    model = build_model(cfg, seed=0)
    assert model.lm_head.weight is model.tok_emb.weight
    assert num_params(model) == num_params(build_model(ModelConfig(**SMALL), seed=0)) - 256 * 32


@pytest.mark.parametrize(
    "bad",
    [
        {"kind": "vit"},
        {"n_head": 3},
        {"d_model": 0},
        {"dropout": 1.0},
        {"kind": "moe", "top_k": 5},
        {"kind": "moe", "top_k": 0},
        {"kind": "moe", "aux_loss_coef": -1.0},
    ],
)
def test_config_validation(bad: dict) -> None:
    with pytest.raises(ValueError):
        ModelConfig(**bad)


def test_a_new_kind_plugs_into_the_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    class Linear(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(4, 2)

        def forward(self, x, targets=None):
            out = self.head(x)
            return out, None if targets is None else nn.functional.cross_entropy(out, targets)

    monkeypatch.setitem(MODEL_KINDS, "toy", lambda cfg, seed: Linear())
    model = build_model(ModelConfig(kind="toy"), seed=0)
    _, loss = model(torch.zeros(3, 4), torch.zeros(3, dtype=torch.long))
    assert loss.ndim == 0


def _moe_layer(cfg: ModelConfig) -> MoE:
    model = build_model(cfg, seed=3)
    assert isinstance(model, GPT)
    layer = model.blocks[0].mlp
    assert isinstance(layer, MoE)
    return layer


def test_moe_routes_each_token_to_top_k_experts() -> None:
    cfg = ModelConfig(kind="moe", n_experts=4, top_k=2, **SMALL)
    layer = _moe_layer(cfg)
    x = torch.randn(50, cfg.d_model, generator=torch.Generator().manual_seed(0))
    probs, weights, experts = layer.route(x)
    assert experts.shape == (50, 2) and weights.shape == (50, 2)
    assert all(len(set(row.tolist())) == 2 for row in experts)
    assert torch.allclose(weights.sum(-1), torch.ones(50))
    chosen = probs.gather(1, experts)
    others = probs.masked_fill(torch.zeros_like(probs, dtype=torch.bool).scatter(1, experts, True), -1.0)
    assert torch.all(chosen.min(-1).values >= others.max(-1).values)


def test_moe_matches_per_token_reference() -> None:
    cfg = ModelConfig(kind="moe", n_experts=4, top_k=2, **SMALL)
    layer = _moe_layer(cfg)
    with torch.no_grad():
        layer.router.weight.normal_(0, 1.0, generator=torch.Generator().manual_seed(1))
        x = torch.randn(2, 7, cfg.d_model, generator=torch.Generator().manual_seed(2))
        out, _ = layer(x)
        _, weights, experts = layer.route(x.reshape(-1, cfg.d_model))
        flat = x.reshape(-1, cfg.d_model)
        ref = torch.stack(
            [
                sum(w * layer.experts[int(e)](flat[i]) for w, e in zip(weights[i], experts[i], strict=True))
                for i in range(flat.shape[0])
            ]
        )
    assert torch.allclose(out.reshape(-1, cfg.d_model), ref, atol=1e-5)


def test_moe_aux_loss_positive_and_penalises_collapse() -> None:
    cfg = ModelConfig(kind="moe", n_experts=4, top_k=1, **SMALL)
    layer = _moe_layer(cfg)
    x = torch.randn(64, cfg.d_model, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, balanced = layer(x)
        v = x[0]
        layer.router.weight.zero_()
        layer.router.weight[0] = 10.0 * v / v.norm() ** 2  # logit 10 for expert 0, 0 for the rest
        _, collapsed = layer(v.expand(64, -1))
    assert 0.0 < balanced.item() < 1.5
    assert collapsed.item() > 3.5  # E * f_0 * P_0 -> 4 when everything goes to expert 0


def test_gpt_loss_includes_moe_aux_loss() -> None:
    cfg = ModelConfig(kind="moe", aux_loss_coef=0.5, **SMALL)
    model = build_model(cfg, seed=0)
    x, y = _batch(cfg)
    with torch.no_grad():
        logits, loss = model(x, y)
    ce = torch.nn.functional.cross_entropy(logits.view(-1, cfg.vocab_size), y.view(-1))
    assert model.last_aux_loss is not None and model.last_aux_loss.item() > 0
    assert loss.item() == pytest.approx(ce.item() + 0.5 * model.last_aux_loss.item(), rel=1e-5)
    dense = build_model(ModelConfig(**SMALL), seed=0)
    dense(x, y)
    assert dense.last_aux_loss is None
