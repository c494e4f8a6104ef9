"""Hostile protocol sequences against one live synchronizer never corrupt it or take it down.

A Hypothesis ``RuleBasedStateMachine`` drives ONE real synchronizer (``tests.security.live``:
real gRPC on 127.0.0.1:0, served from a background event loop) through random sequences of:

- content faults on an open stream (wrong shapes, dtypes or value count, NaN/inf values, stale or
  future base, unknown fragment, other layout, zero tokens/steps, genesis or global transfers from
  a learner, undecodable or oversized payloads, a bad int8 block size): each is answered with a
  REJECTED result carrying the expected reason, and the stream goes on;
- framing faults (corrupt data or a bad digest, missing/repeated header, reordered, duplicated, interleaved
  and restarted chunks, oversized chunks, inconsistent chunk counts and sizes, Hello twice,
  empty messages, unknown enum values, negative dimensions, a message over the gRPC limit): each
  ends only the offending stream, with the expected status; bytes that are not protobuf end it
  with some error status (UNKNOWN today: the servicer lets protobuf's DecodeError escape);
- broken sessions (a first message that is not Hello, a Hello with another model, layout,
  protocol or no usable codec, empty or over-long learner ids, a transfer cut short by a
  half-close, by a Goodbye or by dropping the connection), heartbeats with absurd numbers;
- a re-sent merged contribution (answered as merged at its old version, not merged twice), a
  contribution older than the merged one (refused), and valid contributions.

After every step (invariants): the health service says SERVING; a separate, new learner connects
and gets a READY Welcome with the current versions; GetStatus and FetchState work; the well-behaved
learner's stream is still open; and the global state (every fragment's version and the sha256 of
its fp32 parameters, both as fetched over FetchState and as held by the engine) equals the state
the model expects: only a valid contribution moves it, by exactly one version of its own fragment.
Every content and framing fault, and a transfer cut short by a half-close, is also counted once in
the ledger's rejections.

A second test walks every fault case above once, in a fixed order, with the same checks after
each, so every case runs on every CI run whatever the random walks pick.

Bounded for CI: 25 examples of at most 10 steps, derandomized, no example database; the module
runs in about 10-20 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import math
import struct

import grpc
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from ddiloco.fragments.chunking import Chunk, crc32c
from ddiloco.fragments.codec import CODEC_NAMES, make_codec
from ddiloco.fragments.partition import TensorSpec
from ddiloco.fragments.payload import encode_fragment
from ddiloco.protocol import wire
from ddiloco.protocol.client import StreamClosed
from tests.scripted import MODEL_FINGERPRINT, ScriptedLearner, eventually
from tests.security.live import LiveServer, State, build_contribution

SETTINGS = settings(max_examples=25, stateful_step_count=10, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck), print_blob=False)

_ids = itertools.count()
"""Every learner the machine starts gets an id never used before, so each step's outcome is its
own (reconnecting under a used id is covered by test_regressions.py)."""

SMALL_CHUNKS = 64
"""Chunk size for transfers whose framing is mangled: 13-16 chunks per fragment."""

# -- content faults: answered with a REJECTED result of this reason, the stream goes on -------

CONTENT_REASONS = {
    "bad_shape": "bad_shape",
    "wrong_value_count": "bad_shape",
    "renamed_tensor": "bad_shape",
    "missing_tensor": "bad_shape",
    "bad_dtype": "bad_dtype",
    "non_finite": "non_finite",
    "bf16_non_finite": "non_finite",
    "int8_non_finite_scale": "non_finite",
    "unknown_fragment": "unknown_fragment",
    "future_version": "future_version",
    "stale": "stale",
    "layout_mismatch": "layout_mismatch",
    "zero_tokens": "protocol",
    "zero_steps": "protocol",
    "genesis_after_ready": "protocol",
    "global_from_learner": "protocol",
    "undecodable_payload": "unsupported_codec",
    "int8_bad_block_size": "unsupported_codec",
    "oversized_payload": "oversized",
}

# -- framing faults: the stream ends with this status -----------------------------------------

FRAMING_CODES = {
    "chunk_data_corrupt": grpc.StatusCode.DATA_LOSS,
    "payload_digest_wrong": grpc.StatusCode.DATA_LOSS,
    "missing_header": grpc.StatusCode.INVALID_ARGUMENT,
    "reordered": grpc.StatusCode.INVALID_ARGUMENT,
    "duplicated": grpc.StatusCode.INVALID_ARGUMENT,
    "header_repeated": grpc.StatusCode.INVALID_ARGUMENT,
    "interleaved": grpc.StatusCode.INVALID_ARGUMENT,
    "restarted": grpc.StatusCode.INVALID_ARGUMENT,
    "zero_chunk_count": grpc.StatusCode.INVALID_ARGUMENT,
    "chunk_count_too_small": grpc.StatusCode.INVALID_ARGUMENT,
    "short_digest": grpc.StatusCode.INVALID_ARGUMENT,
    "oversized_chunk": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "more_bytes_than_declared": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "declared_huge": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "hello_twice": grpc.StatusCode.INVALID_ARGUMENT,
    "empty_message": grpc.StatusCode.INVALID_ARGUMENT,
    "unknown_dtype_enum": grpc.StatusCode.INVALID_ARGUMENT,
    "negative_dimension": grpc.StatusCode.INVALID_ARGUMENT,
    "unknown_kind_enum": grpc.StatusCode.INVALID_ARGUMENT,
    "unknown_codec_enum": grpc.StatusCode.INVALID_ARGUMENT,
}

# -- sessions refused at their first message --------------------------------------------------

HELLO_CODES = {
    "heartbeat_first": grpc.StatusCode.INVALID_ARGUMENT,
    "goodbye_first": grpc.StatusCode.INVALID_ARGUMENT,
    "chunk_first": grpc.StatusCode.INVALID_ARGUMENT,
    "empty_first": grpc.StatusCode.INVALID_ARGUMENT,
    "other_model": grpc.StatusCode.FAILED_PRECONDITION,
    "other_layout": grpc.StatusCode.FAILED_PRECONDITION,
    "other_protocol": grpc.StatusCode.FAILED_PRECONDITION,
    "no_codecs": grpc.StatusCode.FAILED_PRECONDITION,
    "empty_learner_id": grpc.StatusCode.INVALID_ARGUMENT,
    "long_learner_id": grpc.StatusCode.INVALID_ARGUMENT,
}

# Heartbeat numbers no honest learner sends. Tiny positive step times are left out on purpose:
# they make the fleet clock count ~1/step_time steps a second and stall the server (see
# test_fleet_pace.py, an expected failure).
ODD_STEP_TIMES = [0.0, -1.0, -math.inf, math.inf, math.nan, 5.0, 1e300, 1.7976931348623157e308, 1e-300, 5e-324]
ODD_RATES = [0.0, -1.0, math.inf, -math.inf, math.nan, 1e308]


def _flip(data: bytes | memoryview, at: int) -> bytes:
    raw = bytearray(bytes(data))
    raw[at % len(raw)] ^= 0x01
    return bytes(raw)


def _with_data(chunk: Chunk, data: bytes) -> Chunk:
    return dataclasses.replace(chunk, data=data, crc32c=crc32c(data))


def _header(chunks: list[Chunk], **fields) -> list[Chunk]:
    chunks[0] = dataclasses.replace(chunks[0], header=dataclasses.replace(chunks[0].header, **fields))
    return chunks


def mangle(case: str, chunks: list[Chunk], k: int) -> list[Chunk]:
    """The transfer as sent for a framing fault at chunk ``k`` (1 <= k < len(chunks)-1), ending
    at the fault: a client that writes on after the server ended the call only learns INTERNAL."""
    if case == "chunk_data_corrupt":  # found by the payload digest once the transfer is complete
        return [*chunks[:k], dataclasses.replace(chunks[k], data=_flip(chunks[k].data, k)), *chunks[k + 1:]]
    if case == "payload_digest_wrong":
        return _header(chunks, digest=_flip(chunks[0].header.digest, k))
    if case == "missing_header":
        return [chunks[k]]
    if case == "reordered":
        return [*chunks[:k], chunks[k + 1]]
    if case == "duplicated":
        return [*chunks[:k + 1], chunks[k]]
    if case == "header_repeated":
        return [*chunks[:k], dataclasses.replace(chunks[k], header=chunks[0].header)]
    if case == "interleaved":
        return [*chunks[:k], dataclasses.replace(chunks[k], transfer_id=chunks[k].transfer_id + 1000)]
    if case == "restarted":
        return [*chunks[:k], chunks[0]]
    if case == "zero_chunk_count":
        return _header(chunks, chunk_count=0)[:1]
    if case == "chunk_count_too_small":
        return _header(chunks, chunk_count=1)[:1]
    if case == "short_digest":
        return _header(chunks, digest=b"\x00" * (k % 16))[:1]
    if case == "oversized_chunk":
        return [*chunks[:k], _with_data(chunks[k], bytes(5000))]  # > 4096, < the gRPC limit
    if case == "more_bytes_than_declared":
        declared = chunks[0].header.encoded_bytes
        return [*_header(chunks, encoded_bytes=declared - 1)]
    if case == "declared_huge":
        return _header(chunks, encoded_bytes=1 << 40, chunk_count=(1 << 32) - 1)[:1]
    raise AssertionError(case)


def raw_fault(case: str, learner: ScriptedLearner, chunks: list[Chunk]) -> object:
    """A LearnerMessage protobuf the dataclasses cannot express."""
    if case == "hello_twice":
        return wire.learner_message_to_pb(learner.hello())
    if case == "empty_message":
        return wire.LearnerMessagePB()
    msg = wire.learner_message_to_pb(chunks[0])
    header = msg.chunk.header
    if case == "unknown_dtype_enum":
        header.tensors[0].dtype = 42
    elif case == "negative_dimension":
        header.tensors[0].shape[0] = -1
    elif case == "unknown_kind_enum":
        header.kind = 42
    elif case == "unknown_codec_enum":
        header.codec = 42
    else:
        raise AssertionError(case)
    return msg


def content_transfer(case: str, learner: ScriptedLearner, fragment: int, version: int,
                     draw: dict) -> tuple[int, list[Chunk]]:
    """A complete, well-framed transfer whose content the synchronizer must refuse."""
    n = learner.layout[fragment].numel
    delta = torch.full((n,), 0.01)
    spec = learner.layout[fragment].tensors
    overrides: dict = {}
    base = version
    if case == "bad_shape":
        overrides["tensors"] = (TensorSpec(spec[0].name, (spec[0].numel,), spec[0].dtype), *spec[1:])
    elif case == "wrong_value_count":
        overrides["num_values"] = n + draw["offset"]
    elif case == "renamed_tensor":
        overrides["tensors"] = (dataclasses.replace(spec[0], name=spec[0].name + ".x"), *spec[1:])
    elif case == "missing_tensor":
        overrides["tensors"] = spec[1:]
    elif case == "bad_dtype":
        overrides["tensors"] = (dataclasses.replace(spec[0], dtype=draw["dtype"]), *spec[1:])
    elif case == "non_finite":
        delta[draw["index"] % n] = draw["bad"]
    elif case == "unknown_fragment":
        overrides["fragment_id"] = draw["fragment_id"]
    elif case == "future_version":
        base = version + draw["ahead"]
    elif case == "stale":
        base = version - 1 - draw["behind"] % version
    elif case == "layout_mismatch":
        overrides["layout_hash"] = "layout-" + "0" * 24
    elif case == "zero_tokens":
        overrides["tokens"] = 0
    elif case == "zero_steps":
        overrides["steps"] = 0
    elif case == "genesis_after_ready":
        overrides["kind"] = "genesis"
    elif case == "global_from_learner":
        overrides["kind"] = "global"
    if case in ("bf16_non_finite", "undecodable_payload", "int8_non_finite_scale", "int8_bad_block_size",
                "oversized_payload"):
        frag = learner.layout[fragment]
        payload = None
        if case == "bf16_non_finite":
            codec = make_codec("bf16_zstd", threads=1)
            delta[draw["index"] % n] = draw["bad"]
        elif case == "undecodable_payload":
            codec = make_codec(draw["codec"], threads=1)
            payload = b"XX" + draw["garbage"]
        elif case == "int8_non_finite_scale":
            codec = make_codec("int8_block", int8_block=256)
            nblocks = -(-n // 256)
            scales = [0.01] * nblocks
            scales[draw["index"] % nblocks] = draw["bad"]
            payload = struct.pack("<2sI", b"I8", 256) + struct.pack(f"<{nblocks}f", *scales) + bytes(n)
        elif case == "int8_bad_block_size":
            codec = make_codec("int8_block", int8_block=256)
            overrides["block_size"] = draw["block_size"]
        else:  # oversized_payload: an fp32 payload under an int8 header (its bound is ~4x smaller)
            codec = make_codec("int8_block", int8_block=256)
            payload = make_codec("fp32").encode(delta)
        seq = next(learner.sequence)
        chunks = encode_fragment(delta, frag, codec=codec, kind="contribution", version=base,
                                 transfer_id=next(learner.transfer_ids), layout_hash=learner.layout.fingerprint,
                                 sequence=seq, tokens=1000, steps=4, max_chunk_bytes=learner.protocol.max_chunk_bytes,
                                 payload=payload)
        if overrides:
            chunks = _header(chunks, **overrides)
        return seq, chunks
    return build_contribution(learner, fragment, delta, base_version=base, **overrides)


async def _read_status(call) -> grpc.StatusCode:  # type: ignore[no-untyped-def]
    """Read a raw call to its end; its status code."""
    with contextlib.suppress(grpc.aio.AioRpcError):
        while await asyncio.wait_for(call.read(), timeout=10) is not grpc.aio.EOF:
            pass
    return await call.code()


class ProtocolMachine(RuleBasedStateMachine):
    def __init__(self, live: LiveServer) -> None:
        super().__init__()
        self.live = live
        self.expected: State = live.run(live.engine_state())
        self.attacker: ScriptedLearner | None = None

    # -- helpers (run on the server's loop) -------------------------------------------------

    def _rejections(self) -> int:
        return sum(self.live.server.engine.ledger.rejected_by_reason.values())

    async def _attacker(self) -> ScriptedLearner:
        if self.attacker is None or self.attacker.closed is not None:
            if self.attacker is not None:
                await self.attacker.close()
            self.attacker = await self.live.fresh_learner(f"attacker-{next(_ids)}")
        return self.attacker

    async def _drop_attacker(self) -> None:
        if self.attacker is not None:
            await self.attacker.close()
            self.attacker = None

    def _version(self, fragment: int) -> int:
        return self.expected[fragment][0]

    # -- content faults -------------------------------------------------------------------

    @rule(case=st.sampled_from(sorted(CONTENT_REASONS)), fragment=st.integers(0, 1),
          draw=st.fixed_dictionaries({
              "offset": st.sampled_from([-1, 1, 1 << 20]),
              "dtype": st.sampled_from(["bfloat16", "float16", "float64"]),
              "index": st.integers(0, 1 << 16),
              "bad": st.sampled_from([math.nan, math.inf, -math.inf]),
              "fragment_id": st.integers(2, (1 << 32) - 1),
              "ahead": st.integers(1, 1 << 40),
              "behind": st.integers(0, 1 << 16),
              "codec": st.sampled_from(list(CODEC_NAMES)),
              "garbage": st.binary(max_size=64),
              "block_size": st.sampled_from([1, 7, (1 << 20) + 1, (1 << 32) - 1]),
          }))
    def content_fault(self, case: str, fragment: int, draw: dict) -> None:
        async def go() -> None:
            learner = await self._attacker()
            before = self._rejections()
            seq, chunks = content_transfer(case, learner, fragment, self._version(fragment), draw)
            await learner.stream.send_transfer(chunks)
            result = await learner.wait_result(seq)
            assert (result.outcome, result.reason) == ("rejected", CONTENT_REASONS[case]), (case, result)
            assert result.detail
            assert self._rejections() == before + 1
            assert learner.closed is None, f"a content fault ({case}) ended the stream: {learner.closed!r}"

        self.live.run(go())

    # -- framing faults -------------------------------------------------------------------

    @rule(case=st.sampled_from(sorted(FRAMING_CODES)), fragment=st.integers(0, 1), k=st.integers(1, 11))
    def framing_fault(self, case: str, fragment: int, k: int) -> None:
        async def go() -> None:
            learner = await self._attacker()
            before = self._rejections()
            _, chunks = build_contribution(learner, fragment, torch.full((learner.layout[fragment].numel,), 0.01),
                                           base_version=self._version(fragment), max_chunk_bytes=SMALL_CHUNKS)
            assert len(chunks) > 12
            with contextlib.suppress(StreamClosed):
                if case in ("hello_twice", "empty_message") or case.endswith(("_enum", "_dimension")):
                    await learner.stream.send_raw(raw_fault(case, learner, chunks))
                else:
                    await learner.stream.send_transfer(mangle(case, chunks, k))
            await eventually(lambda: learner.closed is not None, what=f"stream ended after {case}")
            assert isinstance(learner.closed, StreamClosed), learner.closed
            assert learner.closed.code == FRAMING_CODES[case], (case, learner.closed)
            assert learner.closed.details
            assert self._rejections() == before + 1
            await self._drop_attacker()

        self.live.run(go())

    @rule(fragment=st.integers(0, 1))
    def message_over_grpc_limit(self, fragment: int) -> None:
        async def go() -> None:
            learner = await self.live.fresh_learner(f"big-{next(_ids)}", max_message_bytes=8 << 20)
            try:
                _, chunks = build_contribution(learner, fragment, torch.zeros(learner.layout[fragment].numel),
                                               base_version=self._version(fragment))
                with contextlib.suppress(StreamClosed):
                    await learner.stream.send_transfer([_with_data(chunks[0], bytes(2 << 20))])
                await eventually(lambda: learner.closed is not None, what="stream ended after a 2 MiB message")
                assert learner.closed.code == grpc.StatusCode.RESOURCE_EXHAUSTED, learner.closed
            finally:
                await learner.close()

        self.live.run(go())

    @rule(payload=st.sampled_from([b"\xff", b"\x0a\xff\xff\xff\xff\x0f", b"\x12\x05abc", bytes(range(256))]))
    def bytes_that_are_not_protobuf(self, payload: bytes) -> None:
        async def go() -> None:
            learner = await self.live.fresh_learner(f"raw-{next(_ids)}", pump=False)
            try:
                # the same HTTP/2 stream, written without the protobuf serializer
                call = learner.channel.stream_stream("/ddiloco.v1.Synchronizer/Sync",
                                                     request_serializer=lambda b: b,
                                                     response_deserializer=lambda b: b)()
                await call.write(wire.learner_message_to_pb(learner.hello()).SerializeToString())
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await asyncio.wait_for(call.read(), timeout=10)  # the Welcome
                with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                    await call.write(payload)
                code = await _read_status(call)
                assert code != grpc.StatusCode.OK, code
            finally:
                await learner.close()

        self.live.run(go())

    # -- broken sessions ------------------------------------------------------------------

    @rule(case=st.sampled_from(sorted(HELLO_CODES)))
    def refused_first_message(self, case: str) -> None:
        async def go() -> None:
            learner = ScriptedLearner(self.live.port, f"hello-{next(_ids)}")
            try:
                hello = learner.hello()
                if case == "heartbeat_first":
                    msg = wire.learner_message_to_pb(wire.Heartbeat(step=1, tokens_total=1, tokens_per_s=1,
                                                                    step_time_s=1))
                elif case == "goodbye_first":
                    msg = wire.learner_message_to_pb(wire.Goodbye(reason="bye"))
                elif case == "chunk_first":
                    _, chunks = build_contribution(learner, 0, torch.zeros(learner.layout[0].numel),
                                                   base_version=self._version(0))
                    msg = wire.learner_message_to_pb(chunks[0])
                elif case == "empty_first":
                    msg = wire.LearnerMessagePB()
                else:
                    changed = {
                        "other_model": dict(model_fingerprint=MODEL_FINGERPRINT + "-other"),
                        "other_layout": dict(layout_hash="layout-" + "f" * 24),
                        "other_protocol": dict(protocol=dataclasses.replace(hello.protocol, num_fragments=3)),
                        "no_codecs": dict(codecs=()),
                        "empty_learner_id": dict(learner_id=""),
                        "long_learner_id": dict(learner_id="x" * 129),
                    }[case]
                    msg = wire.learner_message_to_pb(dataclasses.replace(hello, **changed))
                call = learner.stream.stub.Sync()
                await call.write(msg)
                code = await _read_status(call)
                assert code == HELLO_CODES[case], (case, code, await call.details())
            finally:
                await learner.close()

        self.live.run(go())

    @rule(fragment=st.integers(0, 1), k=st.integers(1, 11), how=st.sampled_from(["half_close", "goodbye", "drop"]))
    def transfer_cut_short(self, fragment: int, k: int, how: str) -> None:
        async def go() -> None:
            learner = await self._attacker()
            self.attacker = None
            _, chunks = build_contribution(learner, fragment, torch.full((learner.layout[fragment].numel,), 0.01),
                                           base_version=self._version(fragment), max_chunk_bytes=SMALL_CHUNKS)
            before = self._rejections()
            await learner.stream.send_transfer(chunks[:k])
            call = learner.stream._call
            if how == "drop":  # the connection goes away mid-transfer, nothing said
                call.cancel()
                await learner.channel.close(grace=None)
            else:
                if how == "goodbye":
                    await learner.stream.send(wire.Goodbye(reason="leaving mid-transfer"))
                await call.done_writing()
                code = await asyncio.wait_for(call.code(), timeout=10)
                assert code == grpc.StatusCode.OK, (how, code, await call.details())
            engine = self.live.server.engine
            await eventually(lambda: not engine.membership.learners[learner.learner_id].connected,
                             what=f"the synchronizer saw the stream end ({how})")
            if how == "half_close":  # the cut transfer is counted as refused
                assert self._rejections() == before + 1
            await learner.close()

        self.live.run(go())

    @rule(step=st.sampled_from([0, 1, (1 << 64) - 1]), step_time=st.sampled_from(ODD_STEP_TIMES),
          rate=st.sampled_from(ODD_RATES), done=st.booleans())
    def odd_heartbeat(self, step: int, step_time: float, rate: float, done: bool) -> None:
        async def go() -> None:
            learner = await self._attacker()
            record = self.live.server.engine.membership.learners[learner.learner_id]
            before = record.heartbeat_at
            await learner.stream.send(wire.Heartbeat(step=step, tokens_total=step, tokens_per_s=rate,
                                                     step_time_s=step_time, sent_at_unix=rate, training_done=done))
            await eventually(lambda: record.heartbeat_at > before or learner.closed is not None,
                             what="the heartbeat taken")
            assert learner.closed is None, learner.closed

        self.live.run(go())

    # -- the well-behaved learner ---------------------------------------------------------

    @rule(fragment=st.integers(0, 1), seed=st.integers(0, 1 << 16))
    def valid_contribution(self, fragment: int, seed: int) -> None:
        before = self.expected
        _, version = self.live.run(self.live.merge(fragment, seed=seed))
        after = self.live.run(self.live.engine_state())
        assert version == before[fragment][0] + 1
        assert after[fragment][0] == version and after[fragment][1] != before[fragment][1]
        assert {p: s for p, s in after.items() if p != fragment} == {
            p: s for p, s in before.items() if p != fragment}, "a merge touched another fragment"
        self.expected = after

    @rule(fragment=st.integers(0, 1))
    def resend_merged_contribution(self, fragment: int) -> None:
        seq, chunks, version = self.live.last_merged[fragment]

        async def go() -> None:
            good = self.live.good
            seen = sum(r.sequence == seq for r in good.results)
            await good.stream.send_transfer(chunks)
            await eventually(lambda: sum(r.sequence == seq for r in good.results) > seen, what="duplicate answered")
            answer = [r for r in good.results if r.sequence == seq][-1]
            assert (answer.outcome, answer.version) == ("merged", version), answer
            assert "duplicate" in answer.detail

        self.live.run(go())

    @rule(fragment=st.integers(0, 1))
    def contribution_older_than_merged(self, fragment: int) -> None:
        seq = self.live.last_merged[fragment][0] - 1

        async def go() -> None:
            good = self.live.good
            seen = sum(r.sequence == seq for r in good.results)
            _, chunks = build_contribution(good, fragment, torch.full((good.layout[fragment].numel,), 0.01),
                                           base_version=self._version(fragment), sequence=seq)
            await good.stream.send_transfer(chunks)
            await eventually(lambda: sum(r.sequence == seq for r in good.results) > seen, what="older one answered")
            answer = [r for r in good.results if r.sequence == seq][-1]
            assert (answer.outcome, answer.reason) == ("rejected", "stale"), answer

        self.live.run(go())

    # -- after every step -----------------------------------------------------------------

    @invariant()
    def serving_and_untouched(self) -> None:
        state = self.live.run(self.live.check_serving())
        assert state == self.expected, f"global state moved without a valid contribution: {state} != {self.expected}"

    def teardown(self) -> None:
        self.live.run(self._drop_attacker())


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    server = LiveServer(tmp_path_factory.mktemp("state-machine"))
    try:
        yield server
    finally:
        server.close()


def test_hostile_protocol_sequences_never_corrupt_or_stop_the_synchronizer(live):
    run_state_machine_as_test(lambda: ProtocolMachine(live), settings=SETTINGS)
    # and the service still merges afterwards
    _, version = live.run(live.merge(0, seed=12345))
    assert version >= 2


DRAW = {"offset": 1, "dtype": "bfloat16", "index": 7, "bad": math.nan, "fragment_id": 7, "ahead": 3, "behind": 0,
        "codec": "bf16_zstd", "garbage": b"not a payload", "block_size": 7}

EVERY_STEP = [
    *[("content_fault", dict(case=case, fragment=i % 2, draw=DRAW)) for i, case in enumerate(sorted(CONTENT_REASONS))],
    *[("framing_fault", dict(case=case, fragment=i % 2, k=1 + i % 11)) for i, case in enumerate(sorted(FRAMING_CODES))],
    *[("refused_first_message", dict(case=case)) for case in sorted(HELLO_CODES)],
    *[("transfer_cut_short", dict(fragment=0, k=5, how=how)) for how in ("half_close", "goodbye", "drop")],
    ("odd_heartbeat", dict(step=(1 << 64) - 1, step_time=math.inf, rate=math.nan, done=False)),
    ("odd_heartbeat", dict(step=0, step_time=1.7976931348623157e308, rate=-1.0, done=True)),
    ("message_over_grpc_limit", dict(fragment=1)),
    ("bytes_that_are_not_protobuf", dict(payload=b"\x0a\xff\xff\xff\xff\x0f")),
    ("valid_contribution", dict(fragment=1, seed=1)),
    ("resend_merged_contribution", dict(fragment=1)),
    ("contribution_older_than_merged", dict(fragment=1)),
    ("valid_contribution", dict(fragment=0, seed=2)),
]


def test_every_fault_case_once_in_order(live):
    machine = ProtocolMachine(live)
    try:
        machine.serving_and_untouched()
        for name, kwargs in EVERY_STEP:
            getattr(machine, name)(**kwargs)
            machine.serving_and_untouched()
    finally:
        machine.teardown()
