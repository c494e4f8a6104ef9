"""The one client of the synchronizer service, over grpc.aio: channels, the Sync stream, reads.

Every caller goes through here (the learner's communication thread, ``ddiloco status``, the
lab's evaluator, scripted test learners), so TLS, bearer tokens, message limits and keepalive
are set up one way. ``SyncStream`` speaks dataclasses: ``open(hello) -> Welcome``,
``send_transfer(chunks)``, ``send(heartbeat | goodbye)``, ``receive() -> Transfer |
ContributionResult | Resync | Drain`` (chunks are reassembled and verified here), and
``fetch_state()``. It holds no policy: retries, backoff and what to do with messages belong to
the caller. ``fetch_state`` and ``get_status`` are one-shot reads on a channel of their own.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from ddiloco.fragments.chunking import Chunk, Reassembler, Transfer, sealed
from ddiloco.protocol import wire
from ddiloco.protocol.credentials import Credentials, bearer_metadata

KEEPALIVE_S = 20.0


def client_options(max_message_bytes: int, keepalive_s: float = KEEPALIVE_S) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", int(keepalive_s * 1000)),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # Reconnect quickly after a synchronizer restart; backoff is handled above this layer.
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2000),
    ]


class StreamClosed(Exception):
    """The Sync stream ended; ``code`` and ``details`` say how."""

    def __init__(self, code: grpc.StatusCode | None, details: str) -> None:
        super().__init__(f"{code.name if code else 'CLOSED'}: {details}")
        self.code, self.details = code, details


def check_target(target: str) -> str:
    """``HOST:PORT`` (IPv6 as ``[::1]:PORT``), or ValueError: gRPC would dial port 443 without one."""
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or (
            ":" in host and not (host.startswith("[") and host.endswith("]"))):
        raise ValueError(f"synchronizer address must be HOST:PORT (IPv6: [ADDR]:PORT), got {target!r}")
    return target


def open_channel(target: str, *, max_message_bytes: int, credentials: Credentials | None = None) -> grpc.aio.Channel:
    options = client_options(max_message_bytes)
    creds = credentials.channel_credentials() if credentials is not None else None
    if creds is not None:
        return grpc.aio.secure_channel(check_target(target), creds, options=options)
    return grpc.aio.insecure_channel(check_target(target), options=options)


def message_limit(max_chunk_bytes: int) -> int:
    """gRPC message limit for a protocol's chunk size: one chunk plus room for its header."""
    return max_chunk_bytes + (1 << 20)


class SyncStream:
    def __init__(self, channel: grpc.aio.Channel, *, max_chunk_bytes: int, token: str | None = None) -> None:
        self.channel = channel
        self.stub = wire.SynchronizerStub(channel)
        self.max_chunk_bytes = max_chunk_bytes
        self.token = token
        self._call: Any = None
        # gRPC allows one write in flight per call: a second concurrent write fails the whole
        # call with INTERNAL (GRPC_CALL_ERROR_TOO_MANY_OPERATIONS). The sender, the heartbeats and
        # the goodbye run in separate tasks, so every write takes this lock.
        self._write_lock = asyncio.Lock()
        # Held for a whole transfer, so a goodbye never falls between two chunks of one (the
        # synchronizer stops reading at the goodbye). Heartbeats only take the write lock.
        self._transfer_lock = asyncio.Lock()
        self._reassembler = Reassembler(max_chunk_bytes=max_chunk_bytes, max_payload_bytes=1 << 34)
        self.bytes_sent = 0
        self.bytes_received = 0
        self.peer_digest_only = False
        """Whether the synchronizer said it checks transfers by digest alone (its Welcome): until
        then, and for an older one, every chunk sent carries its CRC-32C."""
        self.peer_trailing_digest = False
        """Whether the synchronizer said it reads a digest from a transfer's last chunk (its
        Welcome): contributions to it are cut with ``trailing=True`` and hashed as written."""

    async def open(self, hello: wire.Hello, timeout_s: float = 30.0) -> wire.Welcome:
        self._call = self.stub.Sync(metadata=bearer_metadata(self.token))
        await self._write(wire.learner_message_to_pb(hello))
        first = await self._read(timeout_s)
        if not isinstance(first, wire.Welcome):
            raise StreamClosed(None, f"expected Welcome, got {type(first).__name__}")
        self.peer_digest_only, self.peer_trailing_digest = first.digest_only, first.trailing_digest
        return first

    async def _write(self, msg: Any) -> None:
        try:
            async with self._write_lock:
                await self._call.write(msg)
        except grpc.aio.AioRpcError as exc:
            raise StreamClosed(exc.code(), exc.details() or "") from exc
        except (grpc.aio.UsageError, RuntimeError, asyncio.InvalidStateError) as exc:
            # InvalidStateError: the call already finished (or was half-closed) under us.
            raise await self._closed_error(str(exc)) from exc

    async def _closed_error(self, fallback: str) -> StreamClosed:
        try:
            code = await self._call.code()
            details = await self._call.details()
            return StreamClosed(code, details or fallback)
        except Exception:
            return StreamClosed(None, fallback)

    async def _read(self, timeout_s: float | None = None) -> Any:
        try:
            raw = await (asyncio.wait_for(self._call.read(), timeout_s) if timeout_s else self._call.read())
        except grpc.aio.AioRpcError as exc:
            raise StreamClosed(exc.code(), exc.details() or "") from exc
        if raw is grpc.aio.EOF:
            raise await self._closed_error("stream ended")
        return wire.synchronizer_message_from_pb(raw)

    async def send_transfer(self, chunks: list[Chunk]) -> None:
        async with self._transfer_lock:
            for chunk in sealed(chunks):  # a trailing digest: each chunk hashed as it is written
                # serialized by the stub without a protobuf copy
                await self._write(chunk if self.peer_digest_only else chunk.with_crc32c())
                self.bytes_sent += len(chunk.data)

    async def send(self, message: wire.Heartbeat | wire.Goodbye) -> None:
        await self._write(wire.learner_message_to_pb(message))

    async def send_raw(self, message: Any) -> None:
        """Write a protobuf LearnerMessage or a Chunk as it is (tests use it to send malformed input)."""
        await self._write(message)

    async def receive(self, timeout_s: float | None = None) -> Transfer | wire.SynchronizerMessage:
        """The next complete message: a verified GLOBAL transfer or a control message."""
        while True:
            msg = await self._read(timeout_s)
            if isinstance(msg, Chunk):
                self.bytes_received += len(msg.data)
                transfer = self._reassembler.feed(msg)
                if transfer is not None:
                    return transfer
                continue
            return msg

    async def close(self, goodbye: str | None = None, linger_s: float = 2.0) -> None:
        """End the stream. With ``goodbye``: let a transfer in progress finish, say goodbye and
        half-close (nothing is written after it), and let the synchronizer read everything and end
        the call itself, all within ``linger_s``; then cancel the call. A cancel overtakes messages
        the synchronizer has not read yet, the goodbye among them; the bound keeps a stalled or
        cut link from holding the learner's exit."""
        if self._call is None:
            return
        try:
            async with asyncio.timeout(linger_s):
                async with self._transfer_lock, self._write_lock:
                    if goodbye is not None:
                        await self._call.write(wire.learner_message_to_pb(wire.Goodbye(reason=goodbye)))
                    await self._call.done_writing()
                if goodbye is not None:
                    await self._call.code()
        except (grpc.aio.UsageError, RuntimeError, grpc.aio.AioRpcError, asyncio.InvalidStateError, TimeoutError):
            pass
        self._call.cancel()
        self._call = None

    async def fetch_state(self, learner_id: str, fragment_ids: tuple[int, ...] = (),
                          timeout_s: float = 120.0) -> list[Transfer]:
        """Download current global fragments (all, or ``fragment_ids``)."""
        req = wire.fetch_request_to_pb(wire.FetchStateRequest(learner_id=learner_id, fragment_ids=fragment_ids))
        reassembler = Reassembler(max_chunk_bytes=self.max_chunk_bytes, max_payload_bytes=1 << 34)
        out = []
        try:
            async for raw in self.stub.FetchState(req, timeout=timeout_s, metadata=bearer_metadata(self.token)):
                transfer = reassembler.feed(wire.chunk_from_pb(raw))
                if transfer is not None:
                    out.append(transfer)
        except grpc.aio.AioRpcError as exc:
            raise StreamClosed(exc.code(), exc.details() or "") from exc
        reassembler.finish()
        return out

    async def status(self, timeout_s: float = 5.0) -> wire.StatusReply:
        reply = await self.stub.GetStatus(wire.status_request_pb(), timeout=timeout_s,
                                          metadata=bearer_metadata(self.token))
        return wire.status_from_pb(reply)


async def fetch_state(target: str, *, max_chunk_bytes: int, learner_id: str,
                      credentials: Credentials | None = None, fragment_ids: tuple[int, ...] = (),
                      timeout_s: float = 120.0) -> list[Transfer]:
    """Download current global fragments (all, or ``fragment_ids``) on a channel of its own."""
    channel = open_channel(target, max_message_bytes=message_limit(max_chunk_bytes), credentials=credentials)
    try:
        stream = SyncStream(channel, max_chunk_bytes=max_chunk_bytes,
                            token=credentials.token if credentials else None)
        return await stream.fetch_state(learner_id, fragment_ids, timeout_s=timeout_s)
    finally:
        await channel.close()


async def get_status(target: str, *, credentials: Credentials | None = None, timeout_s: float = 5.0
                     ) -> wire.StatusReply:
    """A synchronizer's live state (GetStatus) on a channel of its own."""
    channel = open_channel(target, max_message_bytes=4 << 20, credentials=credentials)
    try:
        stream = SyncStream(channel, max_chunk_bytes=1024, token=credentials.token if credentials else None)
        return await stream.status(timeout_s)
    finally:
        await channel.close()
