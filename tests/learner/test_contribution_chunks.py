"""How a learner's link cuts a contribution into chunks: views of its encoded payload, each copied
into its wire message only as it is written (the serializer frames it), so a send never holds a
second copy of the whole payload and the copy of one chunk overlaps the sending of the one before.
"""

from __future__ import annotations

import tracemalloc

import pytest
import torch

from ddiloco.fragments.chunking import Reassembler, digest, sealed
from ddiloco.fragments.partition import partition_tensors
from ddiloco.fragments.payload import decode_fragment, encode_fragment
from ddiloco.learner.comm import Comm
from ddiloco.learner.config import LearnerConfig
from ddiloco.learner.events import EventLog
from ddiloco.learner.mailbox import Outgoing
from ddiloco.protocol import wire
from ddiloco.protocol.config import ProtocolConfig
from tests.learner.test_decoupled_sync import _events, _train, fleet

CHUNK = 64 * 1024


def _link(codec: str, numel: int):
    values = torch.randn(numel, generator=torch.Generator().manual_seed(1)) * 0.01
    layout = partition_tensors({"w": values}, 1)
    cfg = LearnerConfig(learner_id="a", codec=codec, error_feedback=False,
                        protocol=ProtocolConfig(max_chunk_bytes=CHUNK))
    comm = Comm(cfg, layout=layout, model_fingerprint="x", incarnation=1,
                events=EventLog(None, learner_id="a", incarnation=1), held=dict, genesis_values=dict)
    return comm.lanes[0].link, layout, values


@pytest.mark.parametrize("codec", ["fp32", "bf16_zstd"])
def test_a_contribution_is_cut_into_views_of_its_payload_and_framed_as_each_is_written(codec):
    link, layout, values = _link(codec, 100_000)
    out = Outgoing(0, 1, 0, tokens=10, steps=1, learner_step=1, delta=values)
    chunks = link._chunks(out, transfer_id=3)
    assert out.payload is not None and len(chunks) == -(-len(out.payload) // CHUNK) > 1
    if codec == "fp32":  # the values lend their memory: the payload is the delta itself
        assert isinstance(out.payload, memoryview) and bytes(out.payload) == values.numpy().tobytes()
        assert out.payload.obj.__array_interface__["data"][0] == values.data_ptr()
    root = out.payload.obj if isinstance(out.payload, memoryview) else out.payload
    for c in chunks:
        assert c.frame is None, "no message is built before the chunk is written"
        assert isinstance(c.data, memoryview) and c.data.obj is root, "a view, not a copy"
    # what goes on the wire is what framing every chunk at once wrote, and it decodes to the values
    reassembler, transfer = Reassembler(max_chunk_bytes=CHUNK), None
    for c, eager in zip(chunks, wire.frame_chunks(chunks), strict=True):
        raw = wire.serialize_learner_message(c)
        assert raw == eager.framed()
        transfer = reassembler.feed(wire.learner_message_from_pb(wire.parse_learner_message(raw)))
    assert transfer is not None and transfer.header.sequence == 1
    assert torch.equal(decode_fragment(transfer, layout), link.codec.decode(out.payload, values.numel()))
    # a resend cuts the same payload again, without encoding it anew
    payload = out.payload
    again = link._chunks(out, transfer_id=4)
    assert out.payload is payload and all(c.data.obj is root for c in again)


@pytest.mark.parametrize("codec", ["fp32", "bf16_zstd"])
def test_for_a_synchronizer_that_reads_a_trailing_digest_the_chunks_are_hashed_as_they_are_written(codec):
    link, layout, values = _link(codec, 100_000)
    out = Outgoing(0, 1, 0, tokens=10, steps=1, learner_step=1, delta=values)
    cut = link._chunks(out, transfer_id=3, trailing_digest=True)
    assert cut[0].header is not None and cut[0].header.digest == b"" and len(cut) > 1
    assert all(c.digest == b"" for c in cut), "nothing is hashed before the chunks are written"
    written = list(sealed(cut))  # what the stream writes
    assert written[-1].digest == digest(out.payload) and all(c.digest == b"" for c in written[:-1])
    reassembler, transfer = Reassembler(max_chunk_bytes=CHUNK), None
    for c in written:
        transfer = reassembler.feed(wire.learner_message_from_pb(
            wire.parse_learner_message(wire.serialize_learner_message(c))))
    assert transfer is not None and transfer.header.digest == b""
    assert torch.equal(decode_fragment(transfer, layout), link.codec.decode(out.payload, values.numel()))
    with pytest.raises(ValueError, match="trailing digest"):  # framing every chunk first cannot hash as written
        encode_fragment(values, layout[0], codec=link.codec, kind="contribution", version=0, transfer_id=1,
                        frame=wire.frame_chunks, trailing_digest=True)


@pytest.mark.parametrize("codec", ["fp32", "bf16_zstd"])
def test_sending_a_contribution_holds_its_payload_and_one_message_at_a_time(codec):
    link, _, values = _link(codec, 2_000_000)  # 8 MB of fp32, 123 chunks
    out = Outgoing(0, 1, 0, tokens=10, steps=1, learner_step=1, delta=values)
    out.payload = link._encode(out)  # the codec's own working memory is not the send's
    tracemalloc.start()
    try:
        chunks = link._chunks(out, transfer_id=1)
        written = 0
        for c in chunks:  # what the stream does: one message handed to gRPC, then the next
            written += len(wire.serialize_learner_message(c))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    payload = len(out.payload or b"")
    assert written > payload > 40 * CHUNK
    # beyond the payload: one message at a time and the bookkeeping (framing every chunk first
    # held a second copy of the whole payload)
    assert peak < 4 * CHUNK, (peak, payload)


@pytest.mark.parametrize("comm", ["thread", "process"])
def test_fp32_contributions_sent_from_the_values_they_lend_all_arrive_intact(tmp_path, comm):
    # A real synchronizer and a loop with fp32 contributions: each payload is the outer gradient
    # itself (in process mode, its shared-memory slot), read when each chunk is written, and all of
    # them arrive and merge. This synchronizer reads a trailing digest, hashed as the chunks are
    # written, so values changed during a send would go out with a digest that matches them: that
    # nothing changes them until they are answered is shown in test_claimed_slots (each slot holds
    # exactly its outer gradient while the synchronizer is stopped).
    with fleet(tmp_path, comm=comm, codec="fp32") as (_, sync, model, opt, log):
        _train(sync, model, opt, steps=30, seed=3)
        events = _events(log)
    sends = {e["sequence"] for e in events if e["event"] == "send"}
    # the synchronizer asks for about 3 of 4 steps' fragments at the loop's pace: 22-23 sends here
    # (also on one CPU); the bound leaves room for a slower start of the fleet's clock
    assert {e["fragment"] for e in events if e["event"] == "send"} == {0, 1, 2}
    results = {e["sequence"]: e for e in events if e["event"] == "result"}
    assert len(sends) >= 10 and set(results) | {e["sequence"] for e in events if e["event"] == "dropped"} >= sends
    assert {r["outcome"] for r in results.values()} <= {"merged", "superseded"}, \
        [r for r in results.values() if r["outcome"] not in ("merged", "superseded")]
    merges = [e for e in _events(tmp_path / "synchronizer.jsonl") if e["event"] == "merge"]
    assert sum(len(e["contributions"]) for e in merges) >= 10
