"""Bad input gets a clear error and changes nothing.

Every reject reason is provoked over real gRPC: content faults are answered with a REJECTED
result (the stream goes on), framing faults end the offending stream with a gRPC status. After
each, the global parameters are bit-identical to before, and a healthy learner still merges.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket

import grpc
import pytest
import torch

from ddiloco.algorithm.policies import QuorumPolicy
from ddiloco.fragments.chunking import Chunk, crc32c, sealed
from ddiloco.fragments.partition import TensorSpec
from ddiloco.protocol import wire
from ddiloco.protocol.client import StreamClosed
from tests.scripted import ScriptedLearner, eventually, genesis_learner, running_server, sync_config


async def _genesis(server) -> ScriptedLearner:
    return await genesis_learner(server)


def _snapshot(server) -> dict[int, torch.Tensor]:
    return {p: (f.params.clone(), f.version) for p, f in server.engine.fragments.items()}


def _unchanged(server, before) -> None:
    for p, (params, version) in before.items():
        frag = server.engine.fragments[p]
        assert frag.version == version
        assert torch.equal(frag.params, params)


@pytest.fixture
def cfg(tmp_path):
    return sync_config(tmp_path, policy=QuorumPolicy(quorum=1, grace_gamma=0.0, max_grace_s=0.0),
                       staleness_window=1)


CONTENT_CASES = {
    "non_finite": dict(delta=lambda n: torch.tensor([float("inf")] + [0.0] * (n - 1))),
    "bad_shape": dict(header=lambda h: dataclasses.replace(
        h, tensors=(TensorSpec(h.tensors[0].name, (h.tensors[0].numel,), h.tensors[0].dtype), *h.tensors[1:]))),
    "bad_dtype": dict(header=lambda h: dataclasses.replace(
        h, tensors=(dataclasses.replace(h.tensors[0], dtype="bfloat16"), *h.tensors[1:]))),
    "unknown_fragment": dict(header=lambda h: dataclasses.replace(h, fragment_id=7)),
    "future_version": dict(base_version=5),
    "layout_mismatch": dict(header=lambda h: dataclasses.replace(h, layout_hash="layout-other")),
    "protocol": dict(header=lambda h: dataclasses.replace(h, steps=0)),
    "oversized": dict(header=lambda h: dataclasses.replace(h, codec="int8_block")),  # fp32 bytes > int8 bound
    "unsupported_codec": dict(codec="bf16_zstd", payload=b"not a bf16_zstd payload"),
}


@pytest.mark.parametrize("reason", sorted(CONTENT_CASES))
async def test_content_fault_is_rejected_with_reason_and_changes_nothing(cfg, reason):
    case = CONTENT_CASES[reason]
    async with running_server(cfg) as server:
        a = await _genesis(server)
        before = _snapshot(server)
        n = a.layout[0].numel
        delta = case.get("delta", lambda n: torch.full((n,), 0.01))(n)
        frag = a.layout[0]
        from ddiloco.fragments.codec import make_codec
        from ddiloco.fragments.payload import encode_fragment

        seq = next(a.sequence)
        codec = make_codec(case.get("codec", "fp32"))
        chunks = encode_fragment(delta, frag, codec=codec, kind="contribution", payload=case.get("payload"),
                                 version=case.get("base_version", 0), transfer_id=next(a.transfer_ids),
                                 layout_hash=a.layout.fingerprint, sequence=seq, tokens=100, steps=4,
                                 max_chunk_bytes=a.protocol.max_chunk_bytes)
        if "header" in case:
            chunks[0] = dataclasses.replace(chunks[0], header=case["header"](chunks[0].header))
        await a.stream.send_transfer(chunks)
        result = await a.wait_result(seq)
        assert result.outcome == "rejected"
        assert result.reason == reason, result.detail
        assert result.detail
        _unchanged(server, before)
        assert server.engine.ledger.rejected_by_reason[reason] == 1
        # the stream survived and a good contribution still merges
        ok = await a.contribute(0, torch.full((n,), 0.01), base_version=0)
        assert (await a.wait_result(ok)).outcome == "merged"
        await a.close()


async def test_stale_beyond_window_is_rejected_and_learner_told_to_resync(cfg):
    async with running_server(cfg) as server:
        a = await _genesis(server)
        n = a.layout[0].numel
        for v in range(2):  # advance fragment 0 to version 2; window is 1
            s = await a.contribute(0, torch.full((n,), 0.01), base_version=v)
            assert (await a.wait_result(s)).version == v + 1
        before = _snapshot(server)
        s = await a.contribute(0, torch.full((n,), 0.01), base_version=0)
        r = await a.wait_result(s)
        assert (r.outcome, r.reason) == ("rejected", "stale")
        await eventually(lambda: any(isinstance(m, wire.Resync) and m.fragment_ids == (0,) for m in a.control),
                         what="resync instruction")
        _unchanged(server, before)
        await a.close()


def _corrupt(chunks: list[Chunk]) -> list[Chunk]:
    data = bytearray(chunks[-1].data)
    data[len(data) // 2] ^= 0x40
    chunks[-1] = dataclasses.replace(chunks[-1], data=bytes(data))
    return chunks


# Each mangled stream ends at its fault: a client that keeps writing after the server has ended the
# call only learns "INTERNAL" from grpc, so the precise status is checked on a quiet client.
def _missing_header(chunks: list[Chunk]) -> list[Chunk]:
    return chunks[1:2]


def _reordered(chunks: list[Chunk]) -> list[Chunk]:
    return [chunks[0], chunks[2]]


def _duplicated(chunks: list[Chunk]) -> list[Chunk]:
    return [chunks[0], chunks[1], chunks[1]]


def _oversized(chunks: list[Chunk]) -> list[Chunk]:
    big = bytes(5000)  # > max_chunk_bytes (4096) but < the gRPC message limit
    return [chunks[0], dataclasses.replace(chunks[1], data=big, crc32c=crc32c(big))]


def _trailing_wrong(chunks: list[Chunk]) -> list[Chunk]:
    return [*chunks[:-1], dataclasses.replace(chunks[-1], digest=bytes(16), frame=None)]


def _trailing_missing(chunks: list[Chunk]) -> list[Chunk]:
    return [*chunks[:-1], dataclasses.replace(chunks[-1], digest=b"", frame=None)]


def _trailing_misplaced(chunks: list[Chunk]) -> list[Chunk]:
    return [chunks[0], dataclasses.replace(chunks[1], digest=chunks[-1].digest, frame=None)]  # ends at the fault


FRAMING_CASES = {
    "checksum": (_corrupt, grpc.StatusCode.DATA_LOSS),
    "missing_header": (_missing_header, grpc.StatusCode.INVALID_ARGUMENT),
    "reordered": (_reordered, grpc.StatusCode.INVALID_ARGUMENT),
    "duplicated": (_duplicated, grpc.StatusCode.INVALID_ARGUMENT),
    "oversized": (_oversized, grpc.StatusCode.RESOURCE_EXHAUSTED),
    # a trailing digest (the header leaves it to the last chunk): another one, none, or on another chunk
    "trailing_checksum": (_trailing_wrong, grpc.StatusCode.DATA_LOSS),
    "trailing_missing": (_trailing_missing, grpc.StatusCode.INVALID_ARGUMENT),
    "trailing_misplaced": (_trailing_misplaced, grpc.StatusCode.INVALID_ARGUMENT),
}


@pytest.mark.parametrize("case", sorted(FRAMING_CASES))
async def test_framing_fault_ends_only_that_stream(cfg, case):
    mangle, code = FRAMING_CASES[case]
    async with running_server(cfg) as server:
        a = await _genesis(server)
        b = ScriptedLearner(server.port, "b")
        await b.connect()
        b.start_pump()
        before = _snapshot(server)
        n = a.layout[1].numel
        from ddiloco.fragments.payload import encode_fragment

        # small chunks so the transfer has several
        trailing = case.startswith("trailing")
        chunks = encode_fragment(torch.full((n,), 0.01), a.layout[1], codec=a.codec, kind="contribution",
                                 version=0, transfer_id=99, layout_hash=a.layout.fingerprint, sequence=42,
                                 tokens=100, steps=4, max_chunk_bytes=64, trailing_digest=trailing)
        assert len(chunks) >= 4
        with contextlib.suppress(StreamClosed):
            if trailing:  # sealed as a learner's stream seals them, then damaged and written as they are
                for chunk in mangle(list(sealed(chunks))):
                    await b.stream.send_raw(chunk)
            else:
                await b.stream.send_transfer(mangle(chunks))
        await eventually(lambda: b.closed is not None, what="offending stream closed")
        assert isinstance(b.closed, StreamClosed) and b.closed.code == code, b.closed
        assert b.closed.details
        _unchanged(server, before)
        assert sum(server.engine.ledger.rejected_by_reason.values()) == 1
        # the healthy learner is unaffected
        s = await a.contribute(0, torch.full((a.layout[0].numel,), 0.01), base_version=0)
        assert (await a.wait_result(s)).outcome == "merged"
        # b learns the fate of its contribution (when its header got through): on the failing stream
        # if the result beat the status, else on its next stream
        b2 = ScriptedLearner(server.port, "b")
        b2.incarnation = b.incarnation
        await b2.connect()
        b2.start_pump()
        if case != "missing_header":
            await eventually(lambda: (b.result_for(42) or b2.result_for(42)) is not None, what="result of 42")
            r = b.result_for(42) or b2.result_for(42)
            assert r.outcome == "rejected" and r.reason == {"checksum": "checksum", "oversized": "oversized",
                                                            "trailing_checksum": "checksum"}.get(case, "protocol"), r
        for lr in (a, b, b2):
            await lr.close()


async def test_first_message_must_be_hello_and_hello_only_once(cfg):
    async with running_server(cfg) as server:
        a = ScriptedLearner(server.port, "a")
        call = a.stream.stub.Sync()
        await call.write(wire.learner_message_to_pb(wire.Heartbeat(step=1, tokens_total=1, tokens_per_s=1,
                                                                   step_time_s=1)))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call.read()
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "Hello" in info.value.details()
        b = ScriptedLearner(server.port, "b")
        await b.connect()
        b.start_pump()
        await b.stream.send_raw(wire.learner_message_to_pb(b.hello()))
        await eventually(lambda: b.closed is not None, what="stream closed")
        assert b.closed.code == grpc.StatusCode.INVALID_ARGUMENT
        await a.close()
        await b.close()


@pytest.mark.parametrize("field,value,reason", [
    ("model_fingerprint", "model-other", "model_mismatch"),
    ("layout_hash", "layout-other", "layout_mismatch"),
])
async def test_hello_with_other_model_or_layout_is_refused(cfg, field, value, reason):
    async with running_server(cfg) as server:
        a = await _genesis(server)
        intruder = ScriptedLearner(server.port, "x")
        with pytest.raises(StreamClosed) as info:
            await intruder.connect(**{field: value})
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION and reason in info.value.details
        await intruder.close()
        await a.close()


async def test_hello_with_other_protocol_is_refused(cfg):
    async with running_server(cfg) as server:
        x = ScriptedLearner(server.port, "x")
        hello = x.hello()
        bad = dataclasses.replace(hello, protocol=dataclasses.replace(hello.protocol, sync_every=99))
        x.hello = lambda **_: bad  # type: ignore[method-assign]
        with pytest.raises(StreamClosed) as info:
            await x.connect()
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION and "sync_every" in info.value.details
        await x.close()


async def test_garbage_bytes_on_the_port_do_not_hurt_the_service(cfg):
    async with running_server(cfg) as server:
        for payload in (b"\x00" * 64, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", bytes(range(256)) * 8):
            with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
                s.sendall(payload)
                s.settimeout(2)
                with contextlib.suppress(TimeoutError, ConnectionResetError):
                    s.recv(1024)
        a = await _genesis(server)
        s = await a.contribute(0, torch.full((a.layout[0].numel,), 0.01), base_version=0)
        assert (await a.wait_result(s)).outcome == "merged"
        await a.close()


async def test_bearer_token_required_and_bound_to_learner_id(tmp_path):
    cfg = sync_config(tmp_path, auth_tokens={"a": "secret-token-of-a", "b": "secret-token-of-b"})
    async with running_server(cfg) as server:
        anon = ScriptedLearner(server.port, "a")
        with pytest.raises(StreamClosed) as info:
            await anon.connect()
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
        await anon.close()
        thief = ScriptedLearner(server.port, "a", token="secret-token-of-b")
        with pytest.raises(StreamClosed) as info:
            await thief.connect()
        assert info.value.code == grpc.StatusCode.PERMISSION_DENIED
        await thief.close()
        good = ScriptedLearner(server.port, "a", token="secret-token-of-a")
        assert (await good.connect()).state == "genesis_requested"
        await good.close()
        await asyncio.sleep(0)


@pytest.mark.parametrize("action", ["reject", "clip"])
async def test_norm_guard_stops_a_learner_sending_a_huge_update(tmp_path, action):
    from ddiloco.algorithm.norm_guard import NormGuardPolicy

    guard = NormGuardPolicy(action=action, factor=10.0, min_history=3)
    async with running_server(sync_config(tmp_path, norm_guard=guard)) as server:
        a = await _genesis(server)
        numel = a.layout[0].numel
        for v in range(3):  # three ordinary merges build the fragment's history
            seq = await a.contribute(0, torch.full((numel,), 0.01), base_version=v, steps=4)
            assert (await a.wait_result(seq)).outcome == "merged"
        before = _snapshot(server)
        hostile = torch.full((numel,), 0.01 * 1000)
        seq = await a.contribute(0, hostile, base_version=3, steps=4)
        result = await a.wait_result(seq)
        if action == "reject":
            assert result.outcome == "rejected" and result.reason == "norm_outlier"
            _unchanged(server, before)
            assert server.engine.metrics.contributions.labels(outcome="rejected", reason="norm_outlier")._value.get() == 1
        else:
            assert result.outcome == "merged"
            moved = (server.engine.fragments[0].params - before[0][0]).norm()
            # The update was cut to 10x the typical one, not 1000x: the global moved by at most
            # outer_lr x ((1 + momentum) x 10 + the earlier momentum, under 1) x the typical norm.
            typical = torch.full((numel,), 0.01).norm()
            assert moved <= 0.7 * (1.5 * 10 + 1) * typical
            assert server.engine.metrics.norm_clipped._value.get() == 1
        await a.close()


async def test_weight_guard_refuses_an_answer_claiming_far_more_tokens_than_the_fleet(tmp_path):
    """A learner claiming 100x its tokens per step would take ~99.99% of a merge's weight
    (w = tokens^2/steps); the guard refuses it with a reason that says what was expected, the
    global model does not move, and honest answers around it still merge."""
    from ddiloco.algorithm.weight_guard import WeightGuardPolicy

    guard = WeightGuardPolicy(action="reject", factor=4.0, min_history=3)
    async with running_server(sync_config(tmp_path, weight_guard=guard)) as server:
        a = await _genesis(server)
        numel = a.layout[0].numel
        for v in range(3):  # three honest answers: 1000 tokens over 4 steps
            seq = await a.contribute(0, torch.full((numel,), 0.01), base_version=v, tokens=1000, steps=4)
            assert (await a.wait_result(seq)).outcome == "merged"
        before = _snapshot(server)
        seq = await a.contribute(0, torch.full((numel,), 0.01), base_version=3, tokens=100_000, steps=4)
        result = await a.wait_result(seq)
        assert result.outcome == "rejected" and result.reason == "weight_outlier"
        assert "25000 per step" in result.detail and "median 250 per step" in result.detail
        _unchanged(server, before)
        assert server.engine.metrics.contributions.labels(outcome="rejected", reason="weight_outlier")._value.get() == 1
        seq = await a.contribute(0, torch.full((numel,), 0.01), base_version=3, tokens=2000, steps=4)  # 2x: passes
        assert (await a.wait_result(seq)).outcome == "merged"
        await a.close()
