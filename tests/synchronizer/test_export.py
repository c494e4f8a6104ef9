"""``ddiloco export``: the committed global model of a state dir as a safetensors file.

State dirs are made by a real synchronizer on 127.0.0.1:0 (genesis and merges from a scripted
learner over real gRPC), or through the store API where only the layout on disk matters. The
exported tensors must be the committed fp32 values bit for bit, the metadata must say what they
are, and every refusal must exit 2 leaving both the output folder and the state dir as they were.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ddiloco.algorithm.policies import QuorumPolicy
from ddiloco.fragments.outer_gradient import segment_views
from ddiloco.fragments.partition import FragmentLayout, partition_tensors
from ddiloco.synchronizer import export as export_mod
from ddiloco.synchronizer.export import FORMAT, MOMENTUM_PREFIX, ExportError, export, read_state
from ddiloco.synchronizer.genesis import MAX_MODEL_LABEL_BYTES
from ddiloco.synchronizer.store import FragmentRecord, StateStore
from tests.scripted import (
    MODEL_FINGERPRINT,
    ScriptedLearner,
    eventually,
    running_server,
    sync_config,
    toy_params,
)

MODEL_DESCRIPTION = json.dumps({"kind": "toy", "d_model": 8, "layers": 1})


def _cli(*args: str) -> list[str]:
    """The installed ``ddiloco`` console script (what a user runs), else the module."""
    script = pathlib.Path(sys.executable).with_name("ddiloco")
    return [str(script), *args] if script.exists() else [sys.executable, "-m", "ddiloco.core.cli", *args]


def _delta(seed: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * 0.01


async def _train(state_dir: pathlib.Path, labels: dict[str, str] | None, merges: list[tuple[int, int]],
                 **server_kw) -> tuple[dict[int, tuple[int, torch.Tensor, torch.Tensor]], FragmentLayout]:
    """Genesis from a scripted learner (Hello ``labels``), then one merged contribution per
    (fragment, base version); returns each fragment's final (version, params, momentum) as the
    running synchronizer holds them, and the layout."""
    cfg = sync_config(state_dir, policy=QuorumPolicy(quorum=1, grace_gamma=0.0, max_grace_s=0.0), **server_kw)
    async with running_server(cfg) as server:
        learner = ScriptedLearner(server.port, "a")
        welcome = await learner.connect(**({"labels": labels} if labels is not None else {}))
        assert welcome.state == "genesis_requested"
        await learner.upload_genesis()
        await eventually(lambda: server.engine.ready, what="genesis commit")
        learner.start_pump()
        await learner.heartbeat()
        for i, (fragment, base) in enumerate(merges):
            seq = await learner.contribute(fragment, _delta(i, learner.layout[fragment].numel), base_version=base)
            result = await learner.wait_result(seq)
            assert (result.outcome, result.version) == ("merged", base + 1), result
        held = {p: (f.version, f.params.clone(), f.momentum.clone()) for p, f in server.engine.fragments.items()}
        await learner.close()
    return held, learner.layout


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[pathlib.Path, dict, FragmentLayout]:
    """A state dir with fragment 0 at version 2 and fragment 1 at version 1 (genesis + 3 merges)."""
    state = tmp_path_factory.mktemp("trained") / "state"
    held, layout = asyncio.run(_train(state, {"model": MODEL_DESCRIPTION, "pid": "1"}, [(0, 0), (1, 0), (0, 1)]))
    return state, held, layout


@pytest.fixture
def state(trained, tmp_path) -> pathlib.Path:
    """A private copy of the trained state dir (tests may damage it)."""
    copy = tmp_path / "state"
    shutil.copytree(trained[0], copy)
    return copy


def _listing(*folders: pathlib.Path) -> dict[str, tuple[int, int]]:
    """Every file under the folders (hidden temp files included) with its size and mtime."""
    out = {}
    for folder in folders:
        for p in sorted(folder.rglob("*")):
            if p.is_file():
                st = p.stat()
                out[str(p)] = (st.st_size, st.st_mtime_ns)
    return out


# -- the file -------------------------------------------------------------------------------------

def test_cli_export_holds_the_committed_values_bit_for_bit_with_its_metadata(trained, state, tmp_path):
    _, held, layout = trained
    out = tmp_path / "out" / "model.safetensors"
    out.parent.mkdir()
    before = _listing(state)
    proc = subprocess.run(_cli("export", "--state-dir", str(state), "--out", str(out)), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert _listing(state) == before, "export must not change the state dir"
    assert sorted(p.name for p in out.parent.iterdir()) == ["model.safetensors"], "no temp file left behind"
    # progress and summary on stderr, nothing on stdout
    assert proc.stdout == ""
    assert "fragment 0: version 2" in proc.stderr and "fragment 1: version 1" in proc.stderr
    total = sum(f.numel for f in layout)
    assert f"{len(toy_params())} tensors, {total:,} parameters, {out.stat().st_size:,} bytes" in proc.stderr

    tensors = load_file(out)
    assert set(tensors) == set(toy_params()), "the model's parameter names, and nothing else (no momentum)"
    store = StateStore(state)
    for frag in layout:
        version, params, _ = held[frag.index]
        committed, _ = store.load_latest(frag.index, frag.numel)
        assert committed is not None and committed.version == version
        assert torch.equal(committed.params, params), "what the synchronizer holds is what it committed"
        for spec, view in zip(frag.tensors, segment_views(frag, committed.params), strict=True):
            got = tensors[spec.name]
            assert got.dtype == torch.float32 and tuple(got.shape) == spec.shape
            assert torch.equal(got, view), spec.name
    with safe_open(str(out), framework="pt") as f:
        meta = f.metadata()
    assert meta["format"] == FORMAT == "ddiloco-export/1"
    assert meta["model"] == MODEL_DESCRIPTION
    assert meta["model_fingerprint"] == MODEL_FINGERPRINT
    assert meta["layout_hash"] == layout.fingerprint
    assert json.loads(meta["fragment_versions"]) == {"0": 2, "1": 1}
    assert json.loads(meta["fragment_merges"]) == {"0": 2, "1": 1}
    assert json.loads(meta["tensor_dtypes"]) == {name: "float32" for name in toy_params()}
    assert json.loads(meta["protocol"])["num_fragments"] == 2 and meta["num_fragments"] == "2"
    exported = datetime.datetime.fromisoformat(meta["exported_at"])
    assert abs((datetime.datetime.now(datetime.UTC) - exported).total_seconds()) < 120
    assert meta["software_version"] == "0.1.0"
    assert "momentum_prefix" not in meta
    assert all(isinstance(v, str) for v in meta.values())
    assert out.stat().st_mode & 0o777 == 0o666 & ~_umask(), "a new file with the user's usual permissions"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_momentum_on_request_and_pinned_versions(trained, state, tmp_path):
    _, held, layout = trained
    out = tmp_path / "m.safetensors"
    summary = export([state], out, with_momentum=True)
    tensors = load_file(out)
    assert summary.metadata["momentum_prefix"] == MOMENTUM_PREFIX
    assert set(tensors) == set(toy_params()) | {MOMENTUM_PREFIX + n for n in toy_params()}
    for frag in layout:
        _, params, momentum = held[frag.index]
        assert momentum.abs().sum() > 0, "a merged fragment has outer momentum"
        for spec, p, m in zip(frag.tensors, segment_views(frag, params), segment_views(frag, momentum), strict=True):
            assert torch.equal(tensors[spec.name], p) and torch.equal(tensors[MOMENTUM_PREFIX + spec.name], m)
    assert summary.versions == {0: 2, 1: 1} and summary.parameters == sum(f.numel for f in layout)

    # an older retained version of fragment 0, the newest of fragment 1
    pinned = tmp_path / "pinned.safetensors"
    rc = export_mod.main(["--state-dir", str(state), "--out", str(pinned), "--fragment-versions", "0=1"])
    assert rc == 0
    older = StateStore(state).read(0, 1, layout[0].numel)
    assert older is not None
    tensors = load_file(pinned)
    for spec, view in zip(layout[0].tensors, segment_views(layout[0], older.params), strict=True):
        assert torch.equal(tensors[spec.name], view)
    with safe_open(str(pinned), framework="pt") as f:
        assert json.loads(f.metadata()["fragment_versions"]) == {"0": 1, "1": 1}


def test_force_replaces_an_existing_file_and_without_it_nothing_changes(state, tmp_path, capsys):
    out = tmp_path / "model.safetensors"
    out.write_bytes(b"precious")
    assert export_mod.main(["--state-dir", str(state), "--out", str(out)]) == 2
    assert "exists; pass --force" in capsys.readouterr().err
    assert out.read_bytes() == b"precious"
    assert export_mod.main(["--state-dir", str(state), "--out", str(out), "--force"]) == 0
    assert set(load_file(out)) == set(toy_params())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors", "state"]


# -- the model description in meta.json -----------------------------------------------------------

def test_store_records_the_model_description_and_older_meta_files_still_export(tmp_path):
    params = toy_params()
    layout = partition_tensors(params, 2)
    store = StateStore(tmp_path / "s")
    for frag in layout:
        flat = torch.cat([params[n].reshape(-1) for n in frag.names])
        store.commit(FragmentRecord(frag.index, 0, flat, torch.zeros_like(flat), 0))
    store.write_meta(layout=layout, model_fingerprint="model-x", protocol={"num_fragments": 2}, owned=[0, 1],
                     model=MODEL_DESCRIPTION)
    assert store.read_meta()["model"] == MODEL_DESCRIPTION
    store.write_meta(layout=layout, model_fingerprint="model-x", protocol={"num_fragments": 2}, owned=[0, 1])
    meta = store.read_meta()
    assert "model" not in meta and meta.get("model") is None
    # a meta.json written before the field existed (and before owned_fragments): still exports
    del meta["owned_fragments"]
    (tmp_path / "s" / "meta.json").write_text(json.dumps(meta))
    summary = export([tmp_path / "s"], tmp_path / "old.safetensors")
    assert "model" not in summary.metadata and summary.metadata["model_fingerprint"] == "model-x"
    assert summary.versions == {0: 0, 1: 0}
    tensors = load_file(tmp_path / "old.safetensors")
    assert all(torch.equal(tensors[n], t) for n, t in params.items())


async def test_genesis_without_a_model_label_or_with_an_oversized_one_records_none(tmp_path):
    for name, labels in (("none", {"pid": "7"}), ("huge", {"model": "x" * (MAX_MODEL_LABEL_BYTES + 1)})):
        await _train(tmp_path / name, labels, [])
        meta = json.loads((tmp_path / name / "meta.json").read_text())
        assert "model" not in meta and meta["model_fingerprint"] == MODEL_FINGERPRINT
    await _train(tmp_path / "small", {"model": MODEL_DESCRIPTION}, [])
    assert json.loads((tmp_path / "small" / "meta.json").read_text())["model"] == MODEL_DESCRIPTION


# -- sharded synchronizers ------------------------------------------------------------------------

async def test_the_state_dirs_of_every_shard_make_one_model(tmp_path):
    shards = [tmp_path / f"shard{s}" for s in range(2)]
    for s, folder in enumerate(shards):
        await _train(folder, {"model": MODEL_DESCRIPTION}, [], shard_index=s, shard_count=2)
    summary = export(shards, tmp_path / "all.safetensors")
    tensors = load_file(tmp_path / "all.safetensors")
    assert set(tensors) == set(toy_params()) and all(torch.equal(tensors[n], t) for n, t in toy_params().items())
    assert summary.metadata["layout_hash"] == partition_tensors(toy_params(), 2).fingerprint
    with pytest.raises(ExportError, match=r"fragments \[1\] are in none"):
        export(shards[:1], tmp_path / "half.safetensors")
    with pytest.raises(ExportError, match="in both"):
        read_state([shards[0], shards[0]])
    assert not (tmp_path / "half.safetensors").exists()


# -- refusals: exit 2, nothing written, nothing changed ---------------------------------------------

def _corrupt_every_version(state: pathlib.Path, fragment: int) -> None:
    for f in (state / "fragments" / f"p{fragment:04d}").glob("v*.frag"):
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))


def _no_meta(state: pathlib.Path) -> None:
    (state / "meta.json").unlink()


def _bad_meta(state: pathlib.Path) -> None:
    (state / "meta.json").write_text("{not json")


REFUSALS = {
    "no state dir": (lambda s: shutil.rmtree(s), [], "does not exist"),
    "no meta.json": (_no_meta, [], "has no meta.json"),
    "unreadable meta.json": (_bad_meta, [], "unreadable"),
    "no verifying version": (lambda s: _corrupt_every_version(s, 1), [], "fragment 1 has no committed version"),
    "pinned version not on disk": (None, ["--fragment-versions", "0=7"], "no verifying version 7"),
    "pinned fragment unknown": (None, ["--fragment-versions", "5=1"], "names fragments [5]"),
    "bad version syntax": (None, ["--fragment-versions", "newest"], "expected 'latest'"),
    "out folder missing": (None, ["--out", "{tmp}/missing/model.safetensors"], "does not exist"),
    "out under a file": (None, ["--out", "{tmp}/afile/model.safetensors"], "is not a folder"),
    "out is a folder": (None, ["--out", "{tmp}/outdir"], "is a directory"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_every_refusal_exits_2_and_writes_nothing(case, state, tmp_path, capsys):
    damage, extra, message = REFUSALS[case]
    if damage is not None:
        damage(state)
    (tmp_path / "afile").write_text("a file, not a folder")
    (tmp_path / "outdir").mkdir()
    # a commit of a live synchronizer in flight: a reader must never remove it
    in_flight = state / "fragments" / "p0000" / ".v000000000009.frag.4242.tmp"
    if state.exists():
        in_flight.write_bytes(b"partial")
    before = _listing(tmp_path)
    args = ["--state-dir", str(state), "--out", str(tmp_path / "model.safetensors")]
    extra = [a.replace("{tmp}", str(tmp_path)) for a in extra]
    if "--out" in extra:
        args = args[:2]
    rc = export_mod.main(args + extra)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert message in err and "nothing written" in err, err
    assert _listing(tmp_path) == before, "a refused export writes, renames and removes nothing"


def test_a_refusal_through_the_installed_command(tmp_path):
    proc = subprocess.run(_cli("export", "--state-dir", str(tmp_path / "nowhere"), "--out",
                               str(tmp_path / "m.safetensors")), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "does not exist; nothing written" in proc.stderr, proc.stderr
    assert list(tmp_path.iterdir()) == []
    helped = subprocess.run(_cli("--help"), capture_output=True, text=True, timeout=120)
    assert "write the trained global model as safetensors" in helped.stdout
