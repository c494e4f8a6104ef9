"""A fleet's identity at the synchronizer, and what it protects: a lost state is re-seeded only by a
learner that trained with the fleet, a sharded genesis is checked against the whole layout, and an
export never puts together shards of two fleets.

Real synchronizers on 127.0.0.1:0 (in-process servers, real gRPC) and scripted learners that say
exactly what a learner's Hello says (its fleet id, what it holds, what it was told of); export
reads real state dirs. Every wait has a deadline.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import time

import pytest
import torch
from safetensors import safe_open

from ddiloco.algorithm.policies import QuorumPolicy
from ddiloco.fragments.codec import make_codec
from ddiloco.fragments.partition import partition_tensors
from ddiloco.fragments.payload import encode_fragment
from ddiloco.learner.comm import Comm
from ddiloco.learner.config import LearnerConfig
from ddiloco.learner.events import EventLog
from ddiloco.protocol import wire
from ddiloco.protocol.client import StreamClosed
from ddiloco.synchronizer import export as export_mod
from ddiloco.synchronizer.export import ExportError, export, read_state
from ddiloco.synchronizer.recovery import FLEET, derived_fleet_id, read_fleet
from ddiloco.synchronizer.store import FragmentRecord, StateStore
from tests.scripted import (
    MODEL_FINGERPRINT,
    ScriptedLearner,
    eventually,
    running_server,
    sync_config,
    toy_params,
    toy_protocol,
)

QUORUM_1 = QuorumPolicy(quorum=1, grace_gamma=0.0, max_grace_s=0.0)
FLEET_A, FLEET_B = "fleet-00000000000000aa", "fleet-00000000000000bb"


def _cfg(state_dir: pathlib.Path, **kw):  # type: ignore[no-untyped-def]
    return sync_config(state_dir, policy=QUORUM_1, **kw)


async def _upload(learner: ScriptedLearner, fragments: list[int], *, versions: dict[int, int] | None = None,
                  params: dict[str, torch.Tensor] | None = None) -> None:
    """Upload ``fragments`` as genesis transfers (at ``versions``: a re-seed), from ``params`` (its own)."""
    source = params if params is not None else learner.params
    layout = partition_tensors(source, learner.protocol.num_fragments)
    for p in fragments:
        frag = layout[p]
        values = torch.cat([source[n].reshape(-1).float() for n in frag.names])
        chunks = encode_fragment(values, frag, codec=make_codec("fp32"), kind="genesis",
                                 version=(versions or {}).get(p, 0), transfer_id=next(learner.transfer_ids),
                                 layout_hash=learner.layout.fingerprint, sequence=next(learner.sequence),
                                 max_chunk_bytes=learner.protocol.max_chunk_bytes)
        await learner.stream.send_transfer(chunks)


async def _trained_state(state_dir: pathlib.Path, merges: int = 2) -> dict[int, tuple[int, torch.Tensor]]:
    """An unsharded fleet ``FLEET_A``: genesis by learner ``a`` and ``merges`` merges of each fragment;
    returns each fragment's (version, params) as the synchronizer holds them."""
    async with running_server(_cfg(state_dir)) as server:
        a = ScriptedLearner(server.port, "a")
        assert (await a.connect(fleet_id=FLEET_A)).state == "genesis_requested"
        await _upload(a, [0, 1])
        await eventually(lambda: server.engine.ready, what="genesis commit")
        a.start_pump()
        for base in range(merges):
            for p in (0, 1):
                delta = torch.full((a.layout[p].numel,), 0.01 * (base + 1))
                result = await a.wait_result(await a.contribute(p, delta, base_version=base))
                assert (result.outcome, result.version) == ("merged", base + 1), result
        held = {p: (f.version, f.params.clone()) for p, f in server.engine.fragments.items()}
        await a.close()
    return held


# -- the fleet id's lifecycle ----------------------------------------------------------------------

async def test_a_new_fleet_records_the_id_its_seed_names_and_keeps_it_across_restarts(tmp_path):
    state = tmp_path / "state"
    async with running_server(_cfg(state)) as server:
        a = ScriptedLearner(server.port, "a")
        welcome = await a.connect(fleet_id=FLEET_A)
        assert (welcome.state, welcome.fleet_id) == ("genesis_requested", FLEET_A)
        await _upload(a, [0, 1])
        await eventually(lambda: server.engine.ready, what="genesis commit")
        await a.close()
    assert read_fleet(state)["fleet_id"] == FLEET_A and read_fleet(state)["how"] == "genesis"
    async with running_server(_cfg(state)) as server:  # a restart on the state dir
        b = ScriptedLearner(server.port, "b")
        welcome = await b.connect()
        assert (welcome.state, welcome.fleet_id) == ("ready", FLEET_A)
        await b.close()

    # A seed older than fleet ids names none: the id is derived from what every shard shares.
    async with running_server(_cfg(tmp_path / "old-seed")) as server:
        old = ScriptedLearner(server.port, "old")
        welcome = await old.connect()
        await _upload(old, [0, 1])
        await eventually(lambda: server.engine.ready, what="genesis commit")
        await old.close()
    meta = json.loads((tmp_path / "old-seed" / "meta.json").read_text())
    assert welcome.fleet_id == read_fleet(tmp_path / "old-seed")["fleet_id"] == derived_fleet_id(meta)


def _state_from_before_fleet_ids(root: pathlib.Path, shard: int, shards: int) -> None:
    """A state dir as synchronizers before fleet ids left it: meta.json and versions, no fleet.json."""
    layout = partition_tensors(toy_params(), 2)
    owned = [p for p in range(2) if p % shards == shard]
    store = StateStore(root)
    for p in owned:
        values = torch.cat([toy_params()[n].reshape(-1) for n in layout[p].names])
        store.commit(FragmentRecord(p, 3, values, torch.zeros_like(values), 3, time.time()))
    engine_protocol = {"num_fragments": 2, "sync_every": 4, "overlap": 1, "max_chunk_bytes": 4096,
                       "mode": "decoupled", "global_codec": "fp32"}
    store.write_meta(layout=layout, model_fingerprint=MODEL_FINGERPRINT, protocol=engine_protocol, owned=owned,
                     layout_hash=layout.fingerprint, shard=(shard, shards))
    store.close()
    assert not (root / FLEET).exists()


async def test_state_dirs_from_before_fleet_ids_adopt_one_id_per_fleet_on_their_first_start(tmp_path):
    roots = [tmp_path / f"shard-{s}" for s in range(2)]
    for s, root in enumerate(roots):
        _state_from_before_fleet_ids(root, s, 2)
    ids = []
    for s, root in enumerate(roots):
        async with running_server(_cfg(root, shard_index=s, shard_count=2)) as server:
            learner = ScriptedLearner(server.port, f"l{s}")
            welcome = await learner.connect()
            assert welcome.state == "ready" and welcome.versions == {s: 3}
            ids.append(welcome.fleet_id)
            await learner.close()
        assert read_fleet(root) == {**read_fleet(root), "fleet_id": ids[-1], "how": "adopted"}
    assert ids[0] == ids[1] and ids[0].startswith("legacy-"), "the shards of one old fleet adopt the same id"
    # adopted once, then kept: a second start reads it back
    async with running_server(_cfg(roots[0], shard_index=0, shard_count=2)) as server:
        assert server.engine.state is not None and server.engine.state.fleet_id == ids[0]
    summary = export(roots, tmp_path / "model.safetensors")
    assert summary.metadata["fleet_id"] == ids[0]


async def test_a_learner_holding_another_fleets_versions_is_refused(tmp_path):
    await _trained_state(tmp_path / "state", merges=1)
    async with running_server(_cfg(tmp_path / "state")) as server:
        stranger = ScriptedLearner(server.port, "stranger")
        with pytest.raises(StreamClosed) as refused:
            await stranger.connect(fleet_id=FLEET_B, held={0: 1, 1: 1})
        assert refused.value.code.name == "FAILED_PRECONDITION"
        assert "fleet_mismatch" in refused.value.details and FLEET_A in refused.value.details
        await stranger.close()
        # A learner that holds nothing only proposes an id: it joins and learns the fleet's.
        newcomer = ScriptedLearner(server.port, "newcomer")
        welcome = await newcomer.connect(fleet_id=FLEET_B)
        assert (welcome.state, welcome.fleet_id) == ("ready", FLEET_A)
        await newcomer.close()


# -- a lost state dir ------------------------------------------------------------------------------

async def test_a_lost_state_waits_for_a_trained_learner_and_goes_on_from_its_versions(tmp_path):
    """The unsharded synchronizer: its state dir is wiped and it restarts. Once a learner of the
    fleet has said Hello (it holds versions 2), a newcomer is told to wait, and why; the trained
    learner seeds the state again with its globals, at its versions, under the fleet's id."""
    state = tmp_path / "state"
    trained = await _trained_state(state)
    shutil.rmtree(state)
    async with running_server(_cfg(state)) as server:
        a = ScriptedLearner(server.port, "a", params={n: t + 1.0 for n, t in toy_params().items()})
        held = {p: v for p, (v, _) in trained.items()}
        welcome = await a.connect(fleet_id=FLEET_A, held=held, fleet_versions=held)
        assert (welcome.state, welcome.fleet_id) == ("genesis_requested", FLEET_A)
        await a.close()  # leaves before uploading: the next learner to say Hello would be asked

        newcomer = ScriptedLearner(server.port, "newcomer", params=toy_params(seed=7))
        welcome = await newcomer.connect(fleet_id="fleet-of-the-newcomer")
        assert welcome.state == "reseed_wait", welcome
        assert "has merged versions" in welcome.detail and "restart it with --reseed" in welcome.detail
        assert welcome.fleet_id == FLEET_A
        await newcomer.close()
        assert not server.engine.ready

        # Another learner of the fleet holds the fragments: it seeds them, with its globals.
        b = ScriptedLearner(server.port, "b")
        welcome = await b.connect(fleet_id=FLEET_A, held=held, fleet_versions=held)
        assert welcome.state == "genesis_requested"
        for p, (version, params) in trained.items():
            frag = b.layout[p]
            chunks = encode_fragment(params, frag, codec=make_codec("fp32"), kind="genesis", version=version,
                                     transfer_id=next(b.transfer_ids), layout_hash=b.layout.fingerprint,
                                     sequence=next(b.sequence), max_chunk_bytes=b.protocol.max_chunk_bytes)
            await b.stream.send_transfer(chunks)
        await eventually(lambda: server.engine.ready, what="the re-seed's commit")
        for p, (version, params) in trained.items():
            frag = server.engine.fragments[p]
            assert frag.version == version and torch.equal(frag.params, params), "the fleet goes on where it was"
        assert server.engine.state.fleet_id == FLEET_A
        b.start_pump()
        result = await b.wait_result(await b.contribute(0, torch.full((b.layout[0].numel,), 0.01),
                                                        base_version=held[0]))
        assert (result.outcome, result.version) == ("merged", held[0] + 1), "the run goes on"
        await b.close()
    assert read_fleet(state)["how"] == "reseed" and read_fleet(state)["seeded_by"] == "b"


async def test_a_seed_asked_before_the_fleet_showed_its_merges_cannot_complete(tmp_path):
    """A learner asked for the genesis before any Hello showed that the fleet merged (the
    unsharded synchronizer's blind spot) loses the upload once one does."""
    state = tmp_path / "state"
    trained = await _trained_state(state, merges=1)
    shutil.rmtree(state)
    held = {p: v for p, (v, _) in trained.items()}
    async with running_server(_cfg(state)) as server:
        early = ScriptedLearner(server.port, "early", params=toy_params(seed=7))
        assert (await early.connect()).state == "genesis_requested"
        early.start_pump(heartbeat_s=0)
        newcomer = ScriptedLearner(server.port, "newcomer")
        assert (await newcomer.connect(fleet_id=FLEET_A, fleet_versions=held)).state == "reseed_wait"
        await newcomer.close()
        await _upload(early, [0, 1])
        await eventually(lambda: len(early.results) == 2, what="both uploads refused")
        assert all(r.reason == "protocol" and "merged versions" in r.detail for r in early.results), early.results
        assert not server.engine.ready
        await early.close()


async def test_an_operator_reseeds_a_lost_state_from_the_next_learner(tmp_path):
    state = tmp_path / "state"
    trained = await _trained_state(state, merges=1)
    shutil.rmtree(state)
    held = {p: v for p, (v, _) in trained.items()}
    async with running_server(_cfg(state, reseed=True)) as server:
        a = ScriptedLearner(server.port, "a")
        await a.connect(fleet_id=FLEET_A, held=held, fleet_versions=held)
        await a.close()  # the fleet's trained learners are gone
        newcomer = ScriptedLearner(server.port, "newcomer", params=toy_params(seed=7))
        welcome = await newcomer.connect(fleet_id="fleet-of-the-newcomer", fleet_versions=held)
        assert welcome.state == "genesis_requested", "the operator said: the next learner seeds it"
        await _upload(newcomer, [0, 1])
        await eventually(lambda: server.engine.ready, what="the operator's re-seed")
        assert {p: f.version for p, f in server.engine.fragments.items()} == {0: 0, 1: 0}
        assert server.engine.state.fleet_id == FLEET_A, "the fleet's id is kept, whoever re-seeds it"
        # a learner that holds the lost versions is told to resync to the re-seeded ones
        late = ScriptedLearner(server.port, "late")
        await late.connect(fleet_id=FLEET_A, held=held)
        late.start_pump(heartbeat_s=0)
        await eventually(lambda: any(isinstance(m, wire.Resync) for m in late.control), what="a resync")
        await late.close()
    assert read_fleet(state)["how"] == "operator"


# -- a sharded genesis checks the layout -----------------------------------------------------------

async def test_a_sharded_genesis_is_checked_against_the_whole_layouts_hash(tmp_path):
    """A shard sees only its own fragments, so it could not hash the layout the uploader announced:
    a fragment of another model was committed under the announced hash. The Hello now carries the
    whole layout; the shard checks that it hashes to ``layout_hash`` and that each upload is its
    fragment."""
    real = partition_tensors(toy_params(), 2)
    other_params = {**toy_params(), "head.weight": torch.zeros(16, 9)}
    other = partition_tensors(other_params, 2)
    assert real[1].tensors != other[1].tensors
    whole = tuple(f.tensors for f in real)
    async with running_server(_cfg(tmp_path / "shard-1", shard_index=1, shard_count=2)) as server:
        liar = ScriptedLearner(server.port, "liar")
        with pytest.raises(StreamClosed) as refused:
            await liar.connect(layout=tuple(f.tensors for f in other))  # announces the real hash
        assert "layout_mismatch" in refused.value.details and other.fingerprint in refused.value.details
        await liar.close()

        wrong = ScriptedLearner(server.port, "wrong")
        assert (await wrong.connect(layout=whole)).state == "genesis_requested"
        wrong.start_pump(heartbeat_s=0)
        await _upload(wrong, [1], params=other_params)  # the real layout's hash, another model's fragment
        await eventually(lambda: bool(wrong.results), what="the upload's refusal")
        assert wrong.results[0].reason == "layout_mismatch" and "not fragment 1" in wrong.results[0].detail
        assert not server.engine.ready and not (tmp_path / "shard-1" / "meta.json").exists()
        await wrong.close()

        right = ScriptedLearner(server.port, "right")
        assert (await right.connect(layout=whole)).state == "genesis_requested"
        await _upload(right, [1])
        await eventually(lambda: server.engine.ready, what="genesis commit")
        assert server.engine.state.layout_hash == real.fingerprint
        await right.close()


# -- export ----------------------------------------------------------------------------------------

async def _shard(root: pathlib.Path, shard: int, fleet_id: str) -> None:
    async with running_server(_cfg(root, shard_index=shard, shard_count=2)) as server:
        learner = ScriptedLearner(server.port, "a")
        await learner.connect(fleet_id=fleet_id, layout=tuple(f.tensors for f in learner.layout))
        await _upload(learner, [shard])
        await eventually(lambda: server.engine.ready, what=f"shard {shard}'s genesis")
        await learner.close()


async def test_export_refuses_the_shards_of_two_fleets(tmp_path, capsys):
    run_a, run_b = tmp_path / "a", tmp_path / "b"
    for s in (0, 1):
        await _shard(run_a / f"shard-{s}", s, FLEET_A)
        await _shard(run_b / f"shard-{s}", s, FLEET_B)
    mixed = [run_a / "shard-0", run_b / "shard-1"]
    with pytest.raises(ExportError, match="belong to different fleets"):
        read_state(mixed)
    out = tmp_path / "mixed.safetensors"
    assert export_mod.main(["--state-dir", str(mixed[0]), "--state-dir", str(mixed[1]), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"different fleets ({FLEET_A} vs {FLEET_B})" in err and "nothing written" in err
    assert not out.exists()
    # one fleet's shards: exported, each shard reported, the fleet in the file
    out = tmp_path / "a.safetensors"
    assert export_mod.main(["--state-dir", str(run_a / "shard-0"), "--state-dir", str(run_a / "shard-1"),
                            "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"shard 0/2 ({run_a / 'shard-0'}): fleet {FLEET_A}, last commit " in err and "versions 0=0" in err
    assert f"shard 1/2 ({run_a / 'shard-1'}): fleet {FLEET_A}, last commit " in err and "versions 1=0" in err
    with safe_open(str(out), framework="pt") as f:
        assert f.metadata()["fleet_id"] == FLEET_A


async def test_export_bounds_how_far_apart_the_shards_last_commits_are(tmp_path, capsys):
    roots = [tmp_path / f"shard-{s}" for s in (0, 1)]
    for s, root in enumerate(roots):
        await _shard(root, s, FLEET_A)
    # shard 1 stopped two hours before shard 0's last merge
    store = StateStore(roots[0])
    rec, _ = store.load_latest(0, partition_tensors(toy_params(), 2)[0].numel)
    assert rec is not None
    store.commit(FragmentRecord(0, 1, rec.params + 0.5, rec.momentum, 1, rec.committed_at + 7200.0))
    store.close()
    args = ["--state-dir", str(roots[0]), "--state-dir", str(roots[1])]
    assert export_mod.main([*args, "--out", str(tmp_path / "m.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "last commits are 7200s apart, more than --max-commit-skew-s 600" in err and "--accept-skew" in err
    assert not (tmp_path / "m.safetensors").exists()
    assert export_mod.main([*args, "--out", str(tmp_path / "m.safetensors"), "--max-commit-skew-s", "8000"]) == 0
    assert "7200s apart (at most 8000s allowed)" in capsys.readouterr().err
    assert export_mod.main([*args, "--out", str(tmp_path / "n.safetensors"), "--accept-skew"]) == 0
    err = capsys.readouterr().err
    assert "7200s apart (accepted: --accept-skew)" in err and "versions 0=1" in err


async def test_a_learner_whose_shards_are_of_two_fleets_fails_its_join_naming_both(tmp_path):
    """Addresses that mix two runs' shards: the learner's join fails with both fleet ids, instead
    of putting a model together from two runs."""
    await _shard(tmp_path / "a-0", 0, FLEET_A)
    await _shard(tmp_path / "b-1", 1, FLEET_B)
    async with running_server(_cfg(tmp_path / "a-0", shard_index=0, shard_count=2)) as first, \
            running_server(_cfg(tmp_path / "b-1", shard_index=1, shard_count=2)) as second:
        protocol = toy_protocol()
        cfg = LearnerConfig(synchronizer=f"127.0.0.1:{first.port},127.0.0.1:{second.port}", learner_id="c",
                            protocol=protocol, join_timeout_s=30.0)
        events = EventLog(None, learner_id="c", incarnation=1)
        comm = Comm(cfg, layout=partition_tensors(toy_params(), 2), model_fingerprint=MODEL_FINGERPRINT,
                    incarnation=1, events=events, held=lambda: {}, genesis_values=lambda: {})
        comm.start()
        try:
            await eventually(lambda: comm.join.ready, timeout_s=30.0, what="the join's end")
            error = comm.join.error or ""
            assert "holds the state of fleet" in error and FLEET_A in error and FLEET_B in error, error
            assert "two runs" in error
        finally:
            comm.stop("test over")


def test_the_fleet_fields_are_additive_on_the_wire():
    """New fields round-trip; a message without them (an older peer's) reads as "none"."""
    layout = tuple(f.tensors for f in partition_tensors(toy_params(), 2))
    protocol = wire.ProtocolParams.from_config(toy_protocol())
    hello = wire.Hello(learner_id="a", model_fingerprint="m", layout_hash="l", protocol=protocol, fleet_id=FLEET_A,
                       fleet_versions={0: 3, 1: 2}, layout=layout)
    assert wire.learner_message_from_pb(wire.learner_message_to_pb(hello)) == hello
    welcome = wire.Welcome(synchronizer_id="s", protocol=protocol, state="reseed_wait", fleet_id=FLEET_A, detail="why")
    assert wire.synchronizer_message_from_pb(wire.synchronizer_message_to_pb(welcome)) == welcome
    older = wire.learner_message_to_pb(wire.Hello(learner_id="a", model_fingerprint="m", layout_hash="l",
                                                  protocol=protocol))
    read = wire.learner_message_from_pb(older)
    assert (read.fleet_id, read.fleet_versions, read.layout) == ("", {}, ())
    assert "fleet_mismatch" in wire.REJECT_REASONS
