"""Bytes that are not gRPC on the synchronizer's port do not hurt the service or its state.

Plain ``socket`` connections to one live synchronizer (``tests.security.live``) send: garbage
bytes, HTTP/1.1 requests, the HTTP/2 preface followed by a truncated frame, the preface and then
silence, malformed HTTP/2 frames (oversized, bad HPACK, zero window update, frames on the wrong
stream, ...), Sync calls written by hand with broken gRPC message framing, a burst of Sync
streams opened and reset at once (HTTP/2 "rapid reset"), and many connections opened and closed
quickly, held open together, or aborted with a TCP reset.

After each: the health service says SERVING, a separate well-behaved learner connects and gets
a READY Welcome, FetchState returns every fragment, the global state (versions and sha256 of the
fp32 parameters) equals the state before, the well-behaved learner's stream is still open, and
the server's count of open Sync streams and connected learners returns to what it was (a
hostile connection holds no stream slot once it is gone). Connections that are not HTTP/2 are
closed by the server at once; while silent or half-sent connections are held open, other
learners are served.

Every loop is bounded in count and time, and every socket is closed.
"""

from __future__ import annotations

import contextlib
import random
import socket
import struct
import time

import pytest

from tests.scripted import eventually
from tests.security.live import LiveServer

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 0, 1, 2, 3, 4, 6, 7, 8, 9
END_STREAM, END_HEADERS = 0x1, 0x4
BUDGET_S = 3.0
"""How long a test waits for the server to close a connection it must close."""


def frame(kind: int, flags: int, stream: int, payload: bytes = b"", length: int | None = None) -> bytes:
    size = len(payload) if length is None else length
    return struct.pack(">I", size)[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def _literal(name: bytes, value: bytes) -> bytes:
    """HPACK literal header field without indexing, new name, no Huffman coding."""
    assert len(name) < 127 and len(value) < 127
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


SYNC_HEADERS = b"".join(_literal(n, v) for n, v in [
    (b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/ddiloco.v1.Synchronizer/Sync"),
    (b":authority", b"127.0.0.1"), (b"content-type", b"application/grpc"), (b"te", b"trailers")])
OPEN = PREFACE + frame(SETTINGS, 0, 0)
"""A client's valid connection start: the preface and an empty SETTINGS frame."""


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def _until_closed(sock: socket.socket, budget_s: float = BUDGET_S) -> bool:
    """Read (and drop) what the server sends until it closes the connection; False if it did not
    within ``budget_s``."""
    deadline = time.monotonic() + budget_s
    sock.settimeout(0.2)
    received = 0
    while time.monotonic() < deadline and received < 1 << 20:
        try:
            data = sock.recv(65536)
        except TimeoutError:
            continue
        except (ConnectionResetError, BrokenPipeError):
            return True
        if not data:
            return True
        received += len(data)
    return False


PING_PROBE = frame(PING, 0, 0, b"probe!!!")
"""Sent after hostile frames: HTTP/2 processes a connection's frames in order, so the server's
ACK of this PING says it has read everything before it."""


def _frames_until(sock: socket.socket, done, budget_s: float = 10.0) -> str:  # type: ignore[no-untyped-def]
    """Read the server's HTTP/2 frames until ``done(kind, flags, stream, payload)`` holds
    ("frame"), the server closes the connection ("closed") or ``budget_s`` passes ("timeout")."""
    deadline = time.monotonic() + budget_s
    sock.settimeout(0.2)
    buf = b""
    while time.monotonic() < deadline:
        try:
            data = sock.recv(65536)
        except TimeoutError:
            continue
        except (ConnectionResetError, BrokenPipeError):
            return "closed"
        if not data:
            return "closed"
        buf += data
        while len(buf) >= 9:
            size = int.from_bytes(buf[:3], "big")
            if len(buf) < 9 + size:
                break
            kind, flags, stream = buf[3], buf[4], int.from_bytes(buf[5:9], "big") & 0x7FFFFFFF
            payload, buf = buf[9:9 + size], buf[9 + size:]
            if done(kind, flags, stream, payload):
                return "frame"
    return "timeout"


def _read_through_probe(sock: socket.socket) -> None:
    """Send the PING probe and wait until the server answered it or closed the connection."""
    with contextlib.suppress(ConnectionResetError, BrokenPipeError):
        sock.sendall(PING_PROBE)
    got = _frames_until(sock, lambda kind, flags, stream, payload: kind == PING and flags & 1 and payload == b"probe!!!")
    assert got in ("frame", "closed"), "the server neither answered the probe nor closed the connection"


def _send(port: int, payload: bytes, *, half_close: bool = False, budget_s: float = BUDGET_S) -> bool:
    """One connection: send ``payload`` (then shut our side if ``half_close``); whether the
    server closed it within the budget. The socket is closed either way."""
    with _connect(port) as sock:
        with contextlib.suppress(ConnectionResetError, BrokenPipeError):
            sock.sendall(payload)
            if half_close:
                sock.shutdown(socket.SHUT_WR)
        return _until_closed(sock, budget_s)


def _streams(live: LiveServer) -> tuple[int | None, int]:
    """(open Sync streams as the server's limiter counts them, if it has one; connected learners)."""
    server = live.server
    limiter = getattr(getattr(server, "servicer", None), "limiter", None)
    return getattr(limiter, "open", None), len(server.engine.membership.connected())


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    server = LiveServer(tmp_path_factory.mktemp("raw-socket"))
    try:
        server.run(server.check_serving())
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def idle_streams(live) -> tuple[int | None, int]:
    """The open streams and connected learners of the idle service: the well-behaved learner's
    one stream (a Sync stream counted by the limiter, where the server has one) and that learner."""
    has_limiter = getattr(getattr(live.server, "servicer", None), "limiter", None) is not None
    return (1 if has_limiter else None), 1


@pytest.fixture(autouse=True)
def unchanged(live, idle_streams):
    """Around every test: the service keeps serving and nothing in its state moves."""

    async def back_to_idle():
        await eventually(lambda: _streams(live) == idle_streams, timeout_s=30,
                         what=f"open streams and learners back to {idle_streams}")

    live.run(back_to_idle())
    before = live.run(live.check_serving())
    yield
    assert live.run(live.check_serving()) == before
    live.run(back_to_idle())


GARBAGE = {
    "zeros": b"\x00" * 64,
    "ones": b"\xff" * 4096,
    "all_bytes": bytes(range(256)) * 8,
    "random": random.Random(7).randbytes(16 * 1024),
    "tls_client_hello": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + random.Random(8).randbytes(500),
    "newlines": b"\r\n" * 100,
    "almost_preface": PREFACE[:-1] + b"X" + frame(SETTINGS, 0, 0),
}


@pytest.mark.parametrize("name", sorted(GARBAGE))
def test_garbage_bytes_get_the_connection_closed(live, name):
    assert _send(live.port, GARBAGE[name]), f"the server kept a connection open after {name} bytes"


HTTP1 = {
    "get": b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
    "post_to_sync": (b"POST /ddiloco.v1.Synchronizer/Sync HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/grpc\r\nTE: trailers\r\nContent-Length: 5\r\n\r\n\x00\x00\x00\x00\x00"),
    "h2c_upgrade": (b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: Upgrade, HTTP2-Settings\r\n"
                    b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n"),
    "huge_header": b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n",
}


@pytest.mark.parametrize("name", sorted(HTTP1))
def test_http1_requests_get_the_connection_closed(live, name):
    assert _send(live.port, HTTP1[name]), f"the server kept an HTTP/1.1 connection open ({name})"


def test_http2_preface_then_a_truncated_frame(live):
    truncated = OPEN + frame(SETTINGS, 0, 0, b"\x00" * 18)[:12]  # a SETTINGS frame cut after 3 of 18 bytes
    # Left hanging: the server waits for the rest, and meanwhile serves everyone else.
    with _connect(live.port) as sock:
        sock.sendall(truncated)
        live.run(live.check_serving())
    # Cut by our half-close: the server closes the connection.
    assert _send(live.port, truncated, half_close=True)
    # A HEADERS frame for Sync cut in its header block.
    assert _send(live.port, OPEN + frame(HEADERS, END_HEADERS, 1, SYNC_HEADERS)[:30], half_close=True)


def test_valid_preface_then_silence_does_not_block_others(live):
    socks = []
    try:
        for _ in range(5):
            sock = _connect(live.port)
            socks.append(sock)
            sock.sendall(OPEN)
        for sock in socks:  # the server took each connection: it sent its own SETTINGS
            assert _frames_until(sock, lambda kind, flags, stream, payload: kind == SETTINGS) == "frame"
        live.run(live.check_serving())  # a learner connects, fetches and leaves while they are silent
        # a silent client that only ever sent half the preface
        half = _connect(live.port)
        socks.append(half)
        half.sendall(PREFACE[:10])
        live.run(live.check_serving())
    finally:
        for sock in socks:
            sock.close()


MALFORMED = {
    "data_frame_over_max_size": OPEN + frame(DATA, 0, 1, length=0xFFFFFF),
    "garbage_hpack": OPEN + frame(HEADERS, END_HEADERS, 1, b"\xff" * 20),
    "zero_window_update": OPEN + frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 0)),
    "data_on_stream_zero": OPEN + frame(DATA, 0, 0, b"abc"),
    "settings_bad_length": OPEN + frame(SETTINGS, 0, 0, b"\x00\x01\x00"),
    "settings_on_a_stream": OPEN + frame(SETTINGS, 0, 1, b""),
    "ping_bad_length": OPEN + frame(PING, 0, 0, b"\x00" * 5),
    "continuation_without_headers": OPEN + frame(CONTINUATION, END_HEADERS, 1, SYNC_HEADERS),
    "priority_on_itself": OPEN + frame(PRIORITY, 0, 1, struct.pack(">IB", 1, 16)),
    "even_client_stream": OPEN + frame(HEADERS, END_HEADERS, 2, SYNC_HEADERS),
    "stream_ids_going_down": OPEN + frame(HEADERS, END_HEADERS, 5, SYNC_HEADERS)
    + frame(HEADERS, END_HEADERS, 3, SYNC_HEADERS),
    "goaway_then_headers": OPEN + frame(GOAWAY, 0, 0, struct.pack(">II", 0, 0))
    + frame(HEADERS, END_HEADERS, 1, SYNC_HEADERS),
    "window_overflow": OPEN + frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 0x7FFFFFFF)) * 2,
    "settings_flood": OPEN + frame(SETTINGS, 0, 0, struct.pack(">HI", 4, 1)) * 2000,
    "ping_flood": OPEN + frame(PING, 0, 0, b"\x00" * 8) * 2000,
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_http2_frames(live, name):
    with _connect(live.port) as sock:
        with contextlib.suppress(ConnectionResetError, BrokenPipeError):
            sock.sendall(MALFORMED[name])
        _until_closed(sock, budget_s=1.0)  # a connection error closes it; other faults only a stream
        live.run(live.check_serving())  # others are served while it is (or was) open


def grpc_message(payload: bytes, *, compressed: int = 0, length: int | None = None) -> bytes:
    return bytes([compressed]) + struct.pack(">I", len(payload) if length is None else length) + payload


SYNC_BODIES = {
    "not_protobuf": grpc_message(b"\xff\xff\xff"),
    "truncated_message": grpc_message(b"abc", length=4096),
    "declared_over_the_limit": grpc_message(b"abc", length=0x7FFFFFFF),
    "compressed_without_encoding": grpc_message(b"\x0a\x00", compressed=1),
    "bad_compressed_flag": grpc_message(b"\x0a\x00", compressed=7),
    "five_byte_prefix_cut": b"\x00\x00\x00",
    "empty_hello_then_garbage": grpc_message(b"\x0a\x00") + grpc_message(b"\xff"),
}


@pytest.mark.parametrize("name", sorted(SYNC_BODIES))
def test_hand_written_sync_calls_with_broken_grpc_framing(live, name):
    body = SYNC_BODIES[name]
    with _connect(live.port) as sock:
        sock.sendall(OPEN + frame(HEADERS, END_HEADERS, 1, SYNC_HEADERS) + frame(DATA, END_STREAM, 1, body))
        _read_through_probe(sock)
        live.run(live.check_serving())
    # ... and the same on a connection dropped mid-message, without END_STREAM
    with _connect(live.port) as sock:
        sock.sendall(OPEN + frame(HEADERS, END_HEADERS, 1, SYNC_HEADERS) + frame(DATA, 0, 1, body))


def test_rapid_reset_of_sync_streams(live):
    burst = b"".join(frame(HEADERS, END_HEADERS, 2 * i + 1, SYNC_HEADERS)
                     + frame(RST_STREAM, 0, 2 * i + 1, struct.pack(">I", 8)) for i in range(200))
    with _connect(live.port) as sock:
        with contextlib.suppress(ConnectionResetError, BrokenPipeError):
            sock.sendall(OPEN + burst)
        _read_through_probe(sock)
        live.run(live.check_serving())


def test_many_connections_opened_and_closed_quickly(live):
    deadline = time.monotonic() + 20.0
    # one after another
    for i in range(50):
        assert time.monotonic() < deadline, f"only {i} of 50 connections in 20 s"
        with _connect(live.port) as sock:
            if i % 2:
                sock.sendall(OPEN)
    # fifty open together, each having started a Sync call, then all closed
    socks = []
    try:
        for i in range(50):
            sock = _connect(live.port)
            socks.append(sock)
            sock.sendall(OPEN + frame(HEADERS, END_HEADERS, 1, SYNC_HEADERS) if i % 2 else OPEN)
        live.run(live.check_serving())
    finally:
        for sock in socks:
            sock.close()
    # twenty aborted with a TCP reset in the middle of a Sync call's first message
    for _ in range(20):
        with _connect(live.port) as sock:
            sock.sendall(OPEN + frame(HEADERS, END_HEADERS, 1, SYNC_HEADERS)
                         + frame(DATA, 0, 1, grpc_message(b"\x0a\x00", length=100)))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    assert time.monotonic() < deadline
