"""FaultProxy against real sockets: an echo server on 127.0.0.1:0, the proxy in its own thread.

Each fault is checked by what a client on the far side observes (bytes, timing, errors), and a
grpc.aio health service checks that a real HTTP/2 client survives a reset by reconnecting.
Absence ("nothing arrives during the stall") can only be checked over a window; every presence is
awaited with a deadline.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ddiloco.lab.fault_proxy import FaultProxy, FaultProxyConfig

pytestmark = pytest.mark.timeout(30)

DEADLINE_S = 5.0
QUIET_S = 0.4
"""How long "nothing arrives" is watched for."""


class EchoServer:
    """Echoes every byte back; with ``greeting`` it first sends that, to tell servers apart."""

    def __init__(self, greeting: bytes = b"") -> None:
        self.greeting = greeting
        self.accepted = 0
        self.received = 0
        self.errors: list[BaseException] = []
        self.port = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> EchoServer:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        try:
            if self.greeting:
                writer.write(self.greeting)
            while data := await reader.read(1 << 16):
                self.received += len(data)
                writer.write(data)
                await writer.drain()
            writer.write_eof()
        except OSError as exc:
            self.errors.append(exc)
        finally:
            writer.close()


async def eventually(condition: Callable[[], bool], timeout_s: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met before the deadline")
        await asyncio.sleep(0.01)


async def connect(proxy: FaultProxy) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.wait_for(asyncio.open_connection("127.0.0.1", proxy.port), DEADLINE_S)


async def round_trip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, payload: bytes = b"ping") -> float:
    t0 = time.monotonic()
    writer.write(payload)
    await writer.drain()
    assert await asyncio.wait_for(reader.readexactly(len(payload)), DEADLINE_S) == payload
    return time.monotonic() - t0


async def assert_quiet(reader: asyncio.StreamReader, window_s: float = QUIET_S) -> None:
    try:
        data = await asyncio.wait_for(reader.read(1), window_s)
    except TimeoutError:
        return
    raise AssertionError(f"expected nothing, got {data!r}")


async def echo_through(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, payload: bytes) -> bytes:
    async def send() -> None:
        for i in range(0, len(payload), 1 << 16):
            writer.write(payload[i:i + (1 << 16)])
            await writer.drain()
        writer.write_eof()

    async def receive() -> bytes:
        parts = []
        while data := await reader.read(1 << 16):
            parts.append(data)
        return b"".join(parts)

    _, echoed = await asyncio.gather(send(), receive())
    return echoed


@pytest.fixture
async def echo() -> AsyncIterator[EchoServer]:
    server = await EchoServer().start()
    yield server
    await server.stop()


@pytest.fixture
def proxy(echo: EchoServer) -> Iterator[FaultProxy]:
    p = FaultProxy("127.0.0.1", echo.port, FaultProxyConfig(name="test"))
    p.start()
    yield p
    p.stop()


async def test_pass_through_is_byte_exact(proxy: FaultProxy) -> None:
    payload = os.urandom(8 * 1024 * 1024)
    reader, writer = await connect(proxy)
    echoed = await asyncio.wait_for(echo_through(reader, writer, payload), 15)
    writer.close()
    assert len(echoed) == len(payload)
    assert hashlib.sha256(echoed).digest() == hashlib.sha256(payload).digest()
    stats = proxy.stats()
    assert stats.bytes_to_target == stats.bytes_to_client == len(payload)
    assert stats.connections_accepted == 1


async def test_latency_delays_each_direction(proxy: FaultProxy) -> None:
    latency = 0.25  # far above a loopback round trip on any machine
    reader, writer = await connect(proxy)
    before = min([await round_trip(reader, writer) for _ in range(3)])
    proxy.set_latency(latency)
    after = await round_trip(reader, writer)
    assert before < 2 * latency * 0.9, f"baseline round trip already {before:.3f}s"
    assert after >= 2 * latency * 0.9, f"round trip {after:.3f}s with {latency}s each way"
    proxy.clear()
    assert await round_trip(reader, writer) < 2 * latency * 0.9
    writer.close()


async def test_latency_queue_is_bounded(echo: EchoServer) -> None:
    limit = 1024 * 1024
    p = FaultProxy("127.0.0.1", echo.port, FaultProxyConfig(max_queued_bytes=limit))
    p.start()
    try:
        p.set_latency(0.2)
        payload = os.urandom(4 * limit)
        reader, writer = await connect(p)
        echoed = await asyncio.wait_for(echo_through(reader, writer, payload), 15)
        writer.close()
        assert echoed == payload
        peak = p.stats().peak_queued_bytes
        assert limit // 2 < peak <= limit + p.config.read_chunk_bytes
    finally:
        p.stop()


async def test_bandwidth_caps_throughput(proxy: FaultProxy) -> None:
    payload = os.urandom(1024 * 1024)
    proxy.set_bandwidth(2 * 1024 * 1024)
    reader, writer = await connect(proxy)
    t0 = time.monotonic()
    echoed = await asyncio.wait_for(echo_through(reader, writer, payload), 10)
    elapsed = time.monotonic() - t0
    writer.close()
    assert echoed == payload
    assert elapsed >= 0.4, f"1 MiB at 2 MiB/s took only {elapsed:.3f}s"


async def test_stall_holds_bytes_then_delivers_them(proxy: FaultProxy) -> None:
    stall_s = 0.8
    reader, writer = await connect(proxy)
    await round_trip(reader, writer)
    t0 = time.monotonic()
    proxy.stall(stall_s)
    writer.write(b"held")
    await writer.drain()
    await assert_quiet(reader, min(QUIET_S, stall_s / 2))
    assert await asyncio.wait_for(reader.readexactly(4), DEADLINE_S) == b"held"
    assert time.monotonic() - t0 >= stall_s * 0.9
    assert proxy.stats().connections_open == 1
    writer.close()


async def test_reset_sends_rst_to_both_sides(proxy: FaultProxy, echo: EchoServer) -> None:
    reader, writer = await connect(proxy)
    await round_trip(reader, writer)
    t0 = time.monotonic()
    assert proxy.reset() == 1
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(reader.read(1), DEADLINE_S)
    assert time.monotonic() - t0 < 1.0
    await eventually(lambda: any(isinstance(e, ConnectionResetError) for e in echo.errors))
    stats = proxy.stats()
    assert (stats.resets, stats.connections_reset, stats.connections_open) == (1, 1, 0)
    writer.close()
    fresh_reader, fresh_writer = await connect(proxy)
    await round_trip(fresh_reader, fresh_writer)
    fresh_writer.close()


async def test_blackhole_silences_old_and_new_connections(proxy: FaultProxy, echo: EchoServer) -> None:
    """Bytes queued before it (held by latency), bytes sent into it, and new connections all vanish."""
    queued_reader, queued_writer = await connect(proxy)
    idle_reader, idle_writer = await connect(proxy)
    await round_trip(queued_reader, queued_writer)
    await round_trip(idle_reader, idle_writer)
    proxy.set_latency(60.0)  # held far longer than the test, so only the blackhole decides their fate
    queued_writer.write(b"q" * 1000)
    await queued_writer.drain()
    await eventually(lambda: proxy.stats().peak_queued_bytes >= 1000)
    proxy.blackhole(True)
    idle_writer.write(b"lost")
    await idle_writer.drain()
    new_reader, new_writer = await connect(proxy)
    new_writer.write(b"lost too")
    await new_writer.drain()
    await asyncio.gather(assert_quiet(queued_reader), assert_quiet(idle_reader), assert_quiet(new_reader))
    await eventually(lambda: proxy.stats().connections_accepted == 3)
    assert (echo.accepted, echo.received) == (2, 2 * len(b"ping"))
    assert proxy.stats().connections_severed == 3
    proxy.clear()
    reader, writer = await connect(proxy)
    await round_trip(reader, writer)
    for w in (queued_writer, idle_writer, new_writer, writer):
        w.close()


async def test_set_target_moves_new_connections() -> None:
    a, b = await EchoServer(b"A").start(), await EchoServer(b"B").start()
    p = FaultProxy("127.0.0.1", a.port)
    p.start()
    try:
        old_reader, old_writer = await connect(p)
        assert await asyncio.wait_for(old_reader.readexactly(1), DEADLINE_S) == b"A"
        p.set_target("127.0.0.1", b.port)
        assert p.target == ("127.0.0.1", b.port)
        new_reader, new_writer = await connect(p)
        assert await asyncio.wait_for(new_reader.readexactly(1), DEADLINE_S) == b"B"
        await round_trip(old_reader, old_writer)
        assert (a.accepted, b.accepted) == (1, 1)
        old_writer.close()
        new_writer.close()
    finally:
        p.stop()
        await a.stop()
        await b.stop()


async def test_grpc_client_recovers_after_reset() -> None:
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    p = FaultProxy("127.0.0.1", port)
    p.start()
    # A channel of its own subchannel pool: otherwise gRPC may hand the new channel the old,
    # reset connection before it has noticed the RST, and the RPC fails UNAVAILABLE.
    options = [("grpc.use_local_subchannel_pool", 1)]
    request = health_pb2.HealthCheckRequest()
    serving = health_pb2.HealthCheckResponse.SERVING
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{p.port}", options=options) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            assert (await stub.Check(request, timeout=DEADLINE_S)).status == serving
            assert p.reset() >= 1
        async with grpc.aio.insecure_channel(f"127.0.0.1:{p.port}", options=options) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            assert (await stub.Check(request, timeout=DEADLINE_S)).status == serving
        assert p.stats().connections_accepted >= 2
    finally:
        p.stop()
        await server.stop(None)
