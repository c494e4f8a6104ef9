"""Resource limits on a real server: each refuses with its status, counts in its metric, and leaves
the learners within the limits served.

Open streams, stream churn per address, Hello timeout, idle streams, slow transfers (a stream
that starts a fragment and dribbles), transfers larger than any fragment, and the metrics
endpoint bound beside the gRPC address rather than on every interface.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket

import grpc
import pytest

from ddiloco.protocol.client import StreamClosed
from ddiloco.synchronizer.config import Limits
from ddiloco.synchronizer.limits import StreamLimiter, peer_address
from tests.scripted import (
    ScriptedLearner,
    eventually,
    genesis_learner,
    running_server,
    sync_config,
    toy_protocol,
)


def _refusals(server, limit: str) -> float:
    return server.engine.metrics.limit_refusals.labels(limit=limit)._value.get()


async def _genesis(server, **kw) -> ScriptedLearner:
    return await genesis_learner(server, pump=False, **kw)


async def _closed_with(learner: ScriptedLearner, timeout_s: float = 10.0) -> grpc.StatusCode:
    with pytest.raises(StreamClosed) as info:
        async with asyncio.timeout(timeout_s):
            while True:
                await learner.stream.receive()
    return info.value.code


async def test_open_streams_are_bounded_and_a_freed_slot_is_reusable(tmp_path):
    async with running_server(sync_config(tmp_path, limits=Limits(max_streams=2))) as server:
        a, b = ScriptedLearner(server.port, "a"), ScriptedLearner(server.port, "b")
        await a.connect()
        await b.connect()
        c = ScriptedLearner(server.port, "c")
        with pytest.raises(StreamClosed) as info:
            await c.connect()
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_streams" in info.value.details
        await c.close()
        await a.close("done")
        await eventually(lambda: server.servicer.limiter.open == 1, what="a's stream released")
        c = ScriptedLearner(server.port, "c")
        assert (await c.connect()).state
        assert _refusals(server, "max_streams") == 1
        for lr in (b, c):
            await lr.close()


async def test_one_address_reconnecting_in_a_loop_is_slowed_down(tmp_path):
    limits = Limits(hello_burst=3, hello_rate_per_s=0.01)
    async with running_server(sync_config(tmp_path, limits=limits)) as server:
        for i in range(3):
            lr = ScriptedLearner(server.port, f"l{i}")
            await lr.connect()
            await lr.close()
        lr = ScriptedLearner(server.port, "l3")
        with pytest.raises(StreamClosed) as info:
            await lr.connect()
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "hello_rate" in info.value.details
        await lr.close()
        assert _refusals(server, "hello_rate") == 1


def test_rate_limiter_refills_per_address_and_parses_peers():
    now = [0.0]
    limiter = StreamLimiter(Limits(hello_burst=2, hello_rate_per_s=1.0), clock=lambda: now[0])
    assert limiter.admit("ipv4:10.0.0.1:5000") is None
    assert limiter.admit("ipv4:10.0.0.1:5001") is None
    assert limiter.admit("ipv4:10.0.0.1:5002")[0] == "hello_rate"
    assert limiter.admit("ipv6:[::1]:5003") is None  # another address has its own bucket
    now[0] = 1.0
    assert limiter.admit("ipv4:10.0.0.1:5004") is None
    assert limiter.open == 4
    assert peer_address("ipv6:[fe80::1]:7000") == "fe80::1"
    assert peer_address("unix:/tmp/sock") == "unix:/tmp/sock"


async def test_a_stream_without_hello_is_closed(tmp_path):
    async with running_server(sync_config(tmp_path, limits=Limits(hello_timeout_s=0.3))) as server:
        lr = ScriptedLearner(server.port, "a")
        call = lr.stream.stub.Sync()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call.read()
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "hello_timeout" in info.value.details()
        await lr.close()
        await eventually(lambda: server.servicer.limiter.open == 0, what="the stream slot freed")


async def test_idle_stream_is_closed_and_others_keep_going(tmp_path):
    idle_s = 1.0
    async with running_server(sync_config(tmp_path, limits=Limits(idle_stream_timeout_s=idle_s))) as server:
        idle = await _genesis(server)
        busy = ScriptedLearner(server.port, "b")
        await busy.connect()
        busy.start_pump(heartbeat_s=idle_s / 10)
        assert await _closed_with(idle) == grpc.StatusCode.DEADLINE_EXCEEDED
        assert _refusals(server, "idle_stream_timeout") == 1
        assert server.engine.ledger.rejected_by_reason.get("timeout", 0) == 0  # nothing was in flight
        await asyncio.sleep(1.2 * idle_s)  # a window longer than the timeout: the busy stream outlives it
        assert server.engine.membership.learners["b"].connected
        for lr in (idle, busy):
            await lr.close()


async def test_a_transfer_that_dribbles_is_cut_off(tmp_path):
    limits = Limits(transfer_timeout_s=0.5, idle_stream_timeout_s=5.0)
    protocol = toy_protocol(max_chunk_bytes=1024, num_fragments=1)
    async with running_server(sync_config(tmp_path, limits=limits, protocol=protocol)) as server:
        a = await _genesis(server, protocol=protocol)
        from ddiloco.fragments.payload import encode_fragment

        frag = a.layout[0]
        import torch

        chunks = encode_fragment(torch.randn(frag.numel), frag, codec=a.codec, kind="contribution", version=0,
                                 transfer_id=99, layout_hash=a.layout.fingerprint, sequence=1, tokens=10, steps=1,
                                 max_chunk_bytes=a.protocol.max_chunk_bytes)
        assert len(chunks) > 1
        await a.stream.send_transfer(chunks[:1])
        beat = asyncio.create_task(_beat(a))  # heartbeats keep the stream from being idle
        try:
            assert await _closed_with(a) == grpc.StatusCode.DEADLINE_EXCEEDED
        finally:
            beat.cancel()
        assert _refusals(server, "transfer_timeout") == 1
        assert server.engine.ledger.rejected_by_reason["timeout"] == 1  # the partial transfer, answered
        assert server.engine.fragments[0].version == 0
        await a.close()


async def _beat(learner: ScriptedLearner) -> None:
    while True:
        await asyncio.sleep(0.1)
        await learner.heartbeat()


async def test_a_transfer_larger_than_any_fragment_is_refused_before_it_is_buffered(tmp_path):
    async with running_server(sync_config(tmp_path)) as server:
        a = await _genesis(server)
        await a.close()
        b = ScriptedLearner(server.port, "b")
        await b.connect()
        import torch

        big = 4 * max(f.numel for f in b.layout) + 2 * 1024 * 1024
        await b.contribute(0, torch.zeros(b.layout[0].numel), base_version=0, encoded_bytes=big,
                           chunk_count=big // b.protocol.max_chunk_bytes + 1)
        assert await _closed_with(b) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert _refusals(server, "max_transfer_bytes") == 1
        await b.close()


async def test_metrics_bind_beside_the_grpc_address(tmp_path):
    cfg = dataclasses.replace(sync_config(tmp_path), metrics_port=0)
    async with running_server(cfg) as server:
        port = server.metrics_port
        listening = _listening_addresses(port)
        assert listening == {"127.0.0.1"}, listening


def _listening_addresses(port: int) -> set[str]:
    """Local addresses with a TCP socket listening on ``port`` (from /proc/net/tcp)."""
    found = set()
    with open("/proc/net/tcp") as f:
        for line in list(f)[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.split(":")
            if state == "0A" and int(p, 16) == port:
                found.add(socket.inet_ntoa(bytes.fromhex(addr)[::-1]))
    return found
