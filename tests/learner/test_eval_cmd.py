"""Getting the trained model out: ``load_exported`` and ``ddiloco eval``.

The acceptance check runs a real fleet (a synchronizer and a learner as processes, bearer tokens
on), exports the synchronizer's state with ``ddiloco export``, and evaluates the same weights
three ways: reloaded into a freshly built model here, ``ddiloco eval --model-file`` and
``ddiloco eval --synchronizer`` against the live synchronizer. With the fp32 global codec all
three must give the same held-out loss. Refusals (missing file, another model or layout, an
unreachable, silent or credential-refusing synchronizer, one without a model yet) exit 2.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import pathlib
import socket
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from ddiloco.learner.config import learner_config, load_learner_config
from ddiloco.learner.eval_cmd import EvalError, evaluate_weights
from ddiloco.learner.eval_cmd import main as eval_main
from ddiloco.training.data import eval_batches, load_corpus
from ddiloco.training.export_io import ExportLoadError, load_exported, read_export_metadata
from ddiloco.training.inner_loop import evaluate
from ddiloco.training.model import ModelConfig, build_model, model_fingerprint
from tests.procs import synchronizer

TOKEN = "eval-test-token-0123456789abcdef"
CONFIG = """
protocol: {{num_fragments: 3, sync_every: 4, overlap: 1, mode: decoupled, global_codec: fp32}}
model: {{d_model: 32, n_layer: 1, n_head: 2, context: 32}}
data: {{batch_size: 4, context: 32, max_bytes: 200000}}
train: {{steps: 40, eval_every: 0, warmup_steps: 4, eval_batches: 4}}
synchronizer: {{auth_tokens: {{learner-0: {token}}}}}
learner: {{token_file: {token_file}, min_step_s: 0.03}}
"""


def _cli(*args: str) -> list[str]:
    """The installed ``ddiloco`` console script (what a user runs), else the module."""
    script = pathlib.Path(sys.executable).with_name("ddiloco")
    return [str(script), *args] if script.exists() else [sys.executable, "-m", "ddiloco.core.cli", *args]


# -- load_exported ---------------------------------------------------------------------------------

TINY = ModelConfig(d_model=16, n_layer=1, n_head=2, context=16)


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _save(path: pathlib.Path, tensors: dict[str, torch.Tensor], **metadata: str) -> pathlib.Path:
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(path),
              metadata={"format": "ddiloco-export/1", **metadata})
    return path


def test_load_exported_fills_every_parameter_in_the_module_dtype(tmp_path):
    trained = _params(build_model(TINY, seed=1))
    path = _save(tmp_path / "m.safetensors", trained, model_fingerprint="model-abc", model='{"kind": "gpt"}')
    fresh = build_model(TINY, seed=2)
    meta = load_exported(fresh, path)
    assert meta["model_fingerprint"] == "model-abc" and meta["model"] == '{"kind": "gpt"}'
    assert meta.missing == [] and meta.unexpected == []
    assert all(torch.equal(p, trained[n]) for n, p in fresh.named_parameters())
    assert read_export_metadata(path) == dict(meta)
    half = build_model(TINY, seed=2).to(torch.bfloat16)
    load_exported(half, path)
    assert all(p.dtype == torch.bfloat16 and torch.equal(p, trained[n].to(torch.bfloat16))
               for n, p in half.named_parameters())


def test_a_file_that_does_not_fit_names_every_difference_and_changes_nothing(tmp_path):
    trained = _params(build_model(TINY, seed=1))
    del trained["ln_f.bias"]
    trained["blocks.0.extra.weight"] = torch.zeros(3)
    trained["pos_emb.weight"] = torch.zeros(8, 16)
    path = _save(tmp_path / "m.safetensors", trained, model='{"kind": "gpt", "context": 8}')
    model = build_model(TINY, seed=2)
    before = _params(model)
    with pytest.raises(ExportLoadError) as info:
        load_exported(model, path)
    message = str(info.value)
    assert "pos_emb.weight (file [8, 16], model [16, 16])" in message
    assert "missing from the file: ln_f.bias" in message and "not in the model: blocks.0.extra.weight" in message
    assert '"context": 8' in message, "the file's own model description helps to find the right config"
    assert info.value.missing == ["ln_f.bias"] and info.value.unexpected == ["blocks.0.extra.weight"]
    assert len(info.value.mismatched) == 1
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters()), "nothing was loaded"
    # not strict: names may differ, shapes still may not
    with pytest.raises(ExportLoadError, match="with other shapes"):
        load_exported(model, path, strict=False)
    trained["pos_emb.weight"] = torch.ones(16, 16)
    _save(path, trained)
    meta = load_exported(model, path, strict=False)
    assert meta.missing == ["ln_f.bias"] and meta.unexpected == ["blocks.0.extra.weight"]
    assert torch.equal(model.pos_emb.weight, torch.ones(16, 16)) and torch.equal(model.ln_f.bias, before["ln_f.bias"])


def test_tied_parameters_momentum_and_plain_files(tmp_path):
    tied_cfg = dataclasses.replace(TINY, tie_embeddings=True)
    source = build_model(tied_cfg, seed=1)
    named = _params(source)
    assert "lm_head.weight" not in named, "a tied parameter is one parameter, named once"
    momentum = {"outer_momentum." + n: torch.full_like(t, 7.0) for n, t in named.items()}
    path = _save(tmp_path / "tied.safetensors", {**named, **momentum}, momentum_prefix="outer_momentum.")
    model = build_model(tied_cfg, seed=2)
    load_exported(model, path)  # strict: the momentum tensors are not parameters and are skipped
    assert torch.equal(model.lm_head.weight, named["tok_emb.weight"]) and model.lm_head.weight is model.tok_emb.weight
    # a plain state_dict holds the tied tensor under both names: loads strictly too
    state = {n: t.clone() for n, t in source.state_dict().items()}
    plain = tmp_path / "plain.safetensors"
    save_file(state, str(plain))
    assert read_export_metadata(plain) == {}
    load_exported(build_model(tied_cfg, seed=3), plain)


def test_unreadable_missing_and_newer_files_are_refused(tmp_path):
    model = build_model(TINY, seed=0)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_exported(model, tmp_path / "none.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ExportLoadError, match="not a readable safetensors file"):
        read_export_metadata(tmp_path / "junk.safetensors")
    newer = _save(tmp_path / "new.safetensors", _params(model), format="ddiloco-export/9")
    with pytest.raises(ExportLoadError, match="ddiloco-export/9"):
        load_exported(model, newer)
    with torch.device("meta"):
        unmaterialized = type(model)(TINY)
    with pytest.raises(ExportLoadError, match="on the meta device"):
        load_exported(unmaterialized, _save(tmp_path / "ok.safetensors", _params(model)))


def test_exports_of_own_loops_are_recognised_by_their_parameter_fingerprint(tmp_path):
    from ddiloco.learner.sync import parameter_fingerprint

    document = {"model": {"d_model": 16, "n_layer": 1, "n_head": 2, "context": 16},
                "data": {"batch_size": 2, "context": 16, "max_bytes": 200000}, "train": {"eval_batches": 2}}
    cfg = learner_config(document)
    model = build_model(cfg.model, cfg.train.seed)
    ref = "mypackage.models:tiny_gpt"
    path = _save(tmp_path / "own.safetensors", _params(model), model=ref,
                 model_fingerprint=parameter_fingerprint(model, ref))
    result = evaluate_weights(cfg, model_file=str(path))
    assert result["batches"] == 2 and result["model"] == ref and result["loss"] > 0
    _save(path, _params(model), model=ref, model_fingerprint=parameter_fingerprint(model, "another:model"))
    with pytest.raises(EvalError, match="holds weights of model params-"):
        evaluate_weights(cfg, model_file=str(path))


# -- a real fleet -----------------------------------------------------------------------------------

@dataclasses.dataclass
class Fleet:
    root: pathlib.Path
    config: pathlib.Path
    state: pathlib.Path
    target: str


def _versions(state: pathlib.Path) -> dict[int, int]:
    from ddiloco.synchronizer.export import read_state  # read-only: safe next to the running synchronizer

    return read_state([state]).versions


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """A synchronizer (bearer tokens on) that one learner trained for 40 steps; still running."""
    root = tmp_path_factory.mktemp("fleet")
    (root / "token").write_text(TOKEN)
    config = root / "config.yaml"
    config.write_text(CONFIG.format(token=TOKEN, token_file=root / "token"))
    with synchronizer(root, "--config", str(config), "--quorum", "1", log=root / "sync.log") as target:
        learner = subprocess.run(_cli("learner", "--synchronizer", target, "--learner-id", "learner-0", "--config",
                                      str(config), "--threads", "1"), capture_output=True, text=True, timeout=240)
        assert learner.returncode == 0, learner.stdout[-2000:] + learner.stderr[-2000:]
        # contributions still in flight when the learner left may merge a moment later: wait for quiet
        last, since = _versions(root / "state"), time.monotonic()
        while time.monotonic() - since < 1.5:
            time.sleep(0.3)
            now = _versions(root / "state")
            if now != last:
                last, since = now, time.monotonic()
        assert min(last.values()) >= 2, f"the run merged too little to tell models apart: {last}"
        yield Fleet(root, config, root / "state", target)


def _eval_json_start(*args: str) -> subprocess.Popen:
    return subprocess.Popen(_cli("eval", "--json", "--threads", "1", *args), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen) -> str:
    try:
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    return out


def test_exported_model_reloads_with_the_eval_loss_of_the_live_global_model(fleet, tmp_path, capsys):
    out = tmp_path / "model.safetensors"
    # the commands run side by side where they do not depend on each other (each pays torch's import)
    exporting = subprocess.Popen(_cli("export", "--state-dir", str(fleet.state), "--out", str(out)),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    live_run = _eval_json_start("--synchronizer", fleet.target, "--config", str(fleet.config))
    _finish(exporting)
    file_run = _eval_json_start("--model-file", str(out), "--config", str(fleet.config))

    # meanwhile, reloaded here into a freshly built model, evaluated with the learner's own evaluate
    cfg = load_learner_config(str(fleet.config))
    meta = read_export_metadata(out)
    corpus = load_corpus(cfg.data)
    batches = eval_batches(corpus.eval, cfg.data.batch_size, cfg.data.context, cfg.train.eval_batches)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the commands run: the same reduction order
    try:
        fresh = build_model(cfg.model, cfg.train.seed)
        initial = evaluate(fresh, batches, torch.device("cpu"))
        load_exported(fresh, out)
        reloaded = evaluate(fresh, batches, torch.device("cpu"))
        plain = build_model(cfg.model, cfg.train.seed)
        result = plain.load_state_dict(load_file(out), strict=False)  # no helper: plain safetensors
        assert not result.missing_keys and not result.unexpected_keys
        plain_loss = evaluate(plain, batches, torch.device("cpu"))
    finally:
        torch.set_num_threads(threads)
    live, from_file = json.loads(_finish(live_run)), json.loads(_finish(file_run))
    with capsys.disabled():  # the measured numbers, in the log of a run with -s
        print(f"\neval loss: live synchronizer {live['loss']!r}, exported file {from_file['loss']!r}, reloaded "
              f"in-process {reloaded!r}, plain load_state_dict {plain_loss!r}, untrained {initial!r}; "
              f"versions {live['versions']}")
    assert live["versions"] == from_file["versions"] == json.loads(meta["fragment_versions"]), \
        "the export and the live synchronizer hold the same versions"
    assert live["loss"] == from_file["loss"] == reloaded == plain_loss
    assert reloaded < initial - 0.05, "the trained weights were loaded, not the initial ones"
    assert live["codec"] == "fp32" and live["source"] == f"synchronizer:{fleet.target}"
    assert from_file["source"] == f"file:{out}"
    fingerprint = model_fingerprint(build_model(cfg.model, cfg.train.seed), cfg.model)
    assert live["model_fingerprint"] == from_file["model_fingerprint"] == meta["model_fingerprint"] == fingerprint
    assert live["batches"] == from_file["batches"] == 4 and live["tokens"] == 4 * 4 * 32
    if meta.get("model") is not None:  # learners that send their model description
        assert json.loads(meta["model"])["d_model"] == 32

    # without --json: one line of text on stdout
    assert _eval_in_process("--model-file", str(out), "--config", str(fleet.config), "--batches", "2") == 0
    line = capsys.readouterr().out
    assert line.startswith("eval loss ") and " over 2 held-out batches (256 tokens of stdlib); weights from " \
        f"file:{out}, fragment versions " in line, line


def _eval_in_process(*args: str) -> int:
    """``ddiloco eval`` in this process (torch's thread count left as it is)."""
    from ddiloco.core.logs import configure

    try:
        return eval_main([*args, "--threads", str(torch.get_num_threads())])
    finally:
        # The command points the logs at sys.stderr, here the test's capture, which is closed
        # after the test: later in-process servers would fail to log. Back to the process's stderr.
        configure(file=sys.__stderr__)


def _run_main(capsys, *args: str) -> tuple[int, str, float]:
    t0 = time.monotonic()
    rc = _eval_in_process(*args)
    return rc, capsys.readouterr().err, time.monotonic() - t0


_VARIANTS = itertools.count()


def _variant(fleet: Fleet, tmp_path: pathlib.Path, old: str, new: str) -> str:
    """The fleet's config with one change."""
    path = tmp_path / f"variant-{next(_VARIANTS)}.yaml"
    text = fleet.config.read_text()
    assert old in text
    path.write_text(text.replace(old, new))
    return str(path)


def test_another_model_or_layout_is_refused_with_what_differs(fleet, tmp_path, capsys):
    out = tmp_path / "model.safetensors"
    assert subprocess.run(_cli("export", "--state-dir", str(fleet.state), "--out", str(out)),
                          capture_output=True, timeout=120).returncode == 0
    wider = _variant(fleet, tmp_path, "d_model: 32", "d_model: 16")
    rc, err, _ = _run_main(capsys, "--model-file", str(out), "--config", wider)
    assert rc == 2 and "holds weights of model" in err and "--ignore-fingerprint" in err, err
    rc, err, _ = _run_main(capsys, "--model-file", str(out), "--config", wider, "--ignore-fingerprint")
    assert rc == 2 and "tok_emb.weight (file [256, 32], model [256, 16])" in err, err
    rc, err, _ = _run_main(capsys, "--synchronizer", fleet.target, "--config", wider)
    assert rc == 2 and "another model or layout" in err and "17 shapes differ" in err, err
    assert "blocks.0.attn.proj.weight [32, 32] vs [16, 16]" in err, err
    two = _variant(fleet, tmp_path, "num_fragments: 3", "num_fragments: 2")
    rc, err, _ = _run_main(capsys, "--synchronizer", fleet.target, "--config", two)
    assert rc == 2 and "it serves fragments [0, 1, 2], the config has protocol.num_fragments 2" in err, err
    rc, err, _ = _run_main(capsys, "--model-file", str(tmp_path / "missing.safetensors"), "--config", str(fleet.config))
    assert rc == 2 and "does not exist" in err, err
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("variant-")) == ["model.safetensors"]


def test_the_synchronizer_needs_the_configs_credentials(fleet, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("DDILOCO_TOKEN", raising=False)
    anonymous = _variant(fleet, tmp_path, f"learner: {{token_file: {fleet.root / 'token'}, min_step_s: 0.03}}", "")
    rc, err, _ = _run_main(capsys, "--synchronizer", fleet.target, "--config", anonymous)
    assert rc == 2 and "refused the credentials" in err, err
    assert TOKEN not in err
    (tmp_path / "token").write_text(TOKEN)
    rc, err, _ = _run_main(capsys, "--synchronizer", fleet.target, "--config", anonymous,
                           "--token-file", str(tmp_path / "token"))
    assert rc == 0, err


def test_an_unreachable_or_silent_synchronizer_fails_within_the_timeout(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    rc, err, took = _run_main(capsys, "--synchronizer", f"127.0.0.1:{closed_port}", "--timeout", "5")
    assert rc == 2 and "cannot reach the synchronizer" in err and took < 15, (err, took)
    with socket.socket() as silent:  # accepts connections (the kernel does) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        rc, err, took = _run_main(capsys, "--synchronizer", f"127.0.0.1:{silent.getsockname()[1]}", "--timeout", "2")
    assert rc == 2 and "within 2s" in err and took < 12, (err, took)
    rc, err, _ = _run_main(capsys, "--synchronizer", "no-port-here")
    assert rc == 2 and "HOST:PORT" in err


async def test_a_synchronizer_without_a_model_yet_is_refused(tmp_path):
    from tests.scripted import running_server, sync_config

    async with running_server(sync_config(tmp_path / "state")) as server:
        cfg = learner_config({}, synchronizer=f"127.0.0.1:{server.port}")
        with pytest.raises(EvalError, match="has no global model yet"):
            await asyncio.to_thread(evaluate_weights, cfg, synchronizers=[cfg.synchronizer], timeout_s=10)


def test_a_refusal_through_the_installed_command(tmp_path):
    proc = subprocess.run(_cli("eval", "--model-file", str(tmp_path / "none.safetensors")), capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 2 and "does not exist" in proc.stderr and proc.stdout == "", proc.stderr
    helped = subprocess.run(_cli("--help"), capture_output=True, text=True, timeout=120)
    assert "held-out loss of a trained model" in helped.stdout
