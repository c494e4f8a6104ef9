"""Models defined outside the package: ``kind: ref`` (an importable factory) and ``kind: hf`` (a
transformers causal LM from a local config, random weights, nothing downloaded)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys

import pytest
import torch

from ddiloco.core.config import ConfigError
from ddiloco.learner.config import learner_config
from ddiloco.training.model import ModelConfig, build_model, lm_forward, model_fingerprint, model_section

FACTORY = '''
import torch
from torch import nn

class Bag(nn.Module):
    def __init__(self, vocab, width):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, x):
        return self.head(self.embed(x)), "ignored"

def make(vocab=256, width=16):
    return Bag(vocab, width)

def not_a_module():
    return 42

NOT_CALLABLE = 3
'''

LLAMA = {"model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 64}


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "user_models_for_test.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "user_models_for_test"
    sys.modules.pop("user_models_for_test", None)


def test_a_factory_by_reference_builds_the_same_weights_everywhere(user_module):
    cfg = ModelConfig(kind="ref", ref=f"{user_module}:make", options={"width": 8}, context=16)
    a, b = build_model(cfg, 0), build_model(cfg, 0)
    assert a.embed.weight.shape == (256, 8)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(build_model(cfg, 1).head.weight, a.head.weight)
    state = torch.get_rng_state()
    build_model(cfg, 0)
    assert torch.equal(torch.get_rng_state(), state)  # the caller's RNG is left alone
    x = torch.randint(0, 256, (2, 16))
    logits, loss = lm_forward(a, x, x)
    assert logits.shape == (2, 16, 256) and loss is not None
    assert loss.item() == pytest.approx(torch.nn.functional.cross_entropy(logits.reshape(-1, 256), x.reshape(-1)).item())
    wider = dataclasses.replace(cfg, options={"width": 9})
    assert model_fingerprint(build_model(wider, 0), wider) != model_fingerprint(a, cfg)


@pytest.mark.parametrize("ref, message", [
    ("no_colon", r"package\.module:factory"),
    ("a:b c", r"package\.module:factory"),
])
def test_a_malformed_reference_is_refused(ref, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(kind="ref", ref=ref)


@pytest.mark.parametrize("attr, message", [
    ("missing", "has no 'missing'"),
    ("NOT_CALLABLE", "not callable"),
    ("not_a_module", "returned int, not a torch.nn.Module"),
])
def test_a_reference_that_does_not_give_a_module_is_a_clear_error(user_module, attr, message):
    with pytest.raises(ValueError, match=message):
        build_model(ModelConfig(kind="ref", ref=f"{user_module}:{attr}"), 0)


def test_an_unimportable_module_is_a_clear_error():
    with pytest.raises(ValueError, match="cannot import 'no_such_module_xyz'"):
        build_model(ModelConfig(kind="ref", ref="no_such_module_xyz:make"), 0)


def test_ref_and_options_belong_to_ref_and_hf_kinds():
    with pytest.raises(ValueError, match="not 'gpt'"):
        ModelConfig(ref="a:b")
    with pytest.raises(ValueError, match="needs ref"):
        ModelConfig(kind="hf")


def test_config_shorthands_name_a_factory_or_a_local_hf_config(user_module, tmp_path):
    assert model_section("pkg.mod:make") == {"kind": "ref", "ref": "pkg.mod:make"}
    assert model_section("hf:/x/config.json") == {"kind": "hf", "ref": "/x/config.json"}
    assert model_section({"kind": "gpt"}) == {"kind": "gpt"}
    cfg = learner_config({"model": f"{user_module}:make"})
    assert cfg.model.kind == "ref" and cfg.model.ref == f"{user_module}:make"
    with pytest.raises(ConfigError, match=r"package\.module:factory"):
        learner_config({"model": "not a reference"})


def test_the_built_in_fingerprint_is_unchanged_by_the_new_fields():
    cfg = ModelConfig()
    model = build_model(cfg, 0)
    fields = dataclasses.asdict(cfg)
    del fields["ref"], fields["options"]
    h = hashlib.sha256(json.dumps(fields, sort_keys=True).encode())
    for name, tensor in model.state_dict().items():
        h.update(f"\n{name}|{tuple(tensor.shape)}|{tensor.dtype}".encode())
    assert model_fingerprint(model, cfg) == "model-" + h.hexdigest()[:24]


def test_a_transformers_model_from_a_local_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA))
    for ref in (str(path), str(tmp_path)):  # the file, or the folder holding it
        cfg = ModelConfig(kind="hf", ref=ref, context=64)
        a, b = build_model(cfg, 0), build_model(cfg, 0)
        assert type(a).__name__ == "LlamaForCausalLM"
        assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
        x = torch.randint(0, 256, (2, 64))
        logits, loss = lm_forward(a, x, x)
        assert logits.shape == (2, 64, 256)
        assert loss.item() == pytest.approx(5.55, abs=0.3)  # ~ln(256) at a random init
    wide = ModelConfig(kind="hf", ref=str(path), options={"hidden_size": 64, "intermediate_size": 32}, context=64)
    assert build_model(wide, 0).model.embed_tokens.weight.shape == (256, 64)


@pytest.mark.parametrize("change, message", [
    ({"vocab_size": 100}, "vocab_size 100 is below model.vocab_size 256"),
    ({"max_position_embeddings": 16}, "allows 16 positions, fewer than model.context 64"),
])
def test_a_transformers_config_that_does_not_fit_the_data_is_refused(tmp_path, change, message):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA, **change}))
    with pytest.raises(ValueError, match=message):
        build_model(ModelConfig(kind="hf", ref=str(path), context=64), 0)


def test_a_missing_or_unreadable_transformers_config_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        build_model(ModelConfig(kind="hf", ref=str(tmp_path / "nope.json")), 0)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read a transformers config"):
        build_model(ModelConfig(kind="hf", ref=str(bad)), 0)
