"""The synchronizer's gRPC face: grpc.aio server, Sync / FetchState / GetStatus, health, auth.

Each Sync stream runs two coroutines: a reader that reassembles chunks and feeds the engine, and
the response generator that drains the learner's outbox. Framing faults (corrupt, missing,
reordered, oversized chunks, messages out of protocol order) end that stream with a gRPC status
and message after the contribution is rejected; content faults (bad shape, non-finite values,
stale base, ...) are rejected with a ContributionResult and the stream goes on. Either way only
the offending stream is affected and the global model is untouched.

The servicer turns streams into engine calls; what it counts, bounds and logs on its own it is
given at construction (``ServicerParts``: the metrics, the limits, the chunk size, the log and the
clock), not read through the engine.

Message limits are set from the protocol's chunk size, and keepalive pings let both sides find
dead peers behind silent networks. SIGTERM: health goes NOT_SERVING, the commit in progress
finishes, then ``server.stop(grace)``.

Who may call what is decided in ``auth`` (tokens, client certificates, identities) and what a
stream may cost in ``limits`` and ``config.Limits``: a stream is counted and rate-limited per
peer address before its Hello is read; it must send its Hello within ``hello_timeout_s``,
something at least every ``idle_stream_timeout_s``, and each transfer within
``transfer_timeout_s`` of its first chunk; a transfer may not exceed the largest fragment.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ddiloco.core.logs import get_logger
from ddiloco.fragments.chunking import Chunk, Reassembler
from ddiloco.fragments.errors import ChunkError, FragmentError
from ddiloco.protocol import wire
from ddiloco.protocol.credentials import token_from_metadata
from ddiloco.synchronizer.admission import Refused
from ddiloco.synchronizer.auth import Gate, ServerCertificates, TokenTable
from ddiloco.synchronizer.broadcast import GlobalTransfer
from ddiloco.synchronizer.config import Limits, SynchronizerConfig
from ddiloco.synchronizer.engine import Engine
from ddiloco.synchronizer.limits import StreamLimiter
from ddiloco.synchronizer.membership import LearnerRecord
from ddiloco.synchronizer.metrics import SynchronizerMetrics

_STATUS = {
    "INVALID_ARGUMENT": grpc.StatusCode.INVALID_ARGUMENT,
    "FAILED_PRECONDITION": grpc.StatusCode.FAILED_PRECONDITION,
    "RESOURCE_EXHAUSTED": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "UNAUTHENTICATED": grpc.StatusCode.UNAUTHENTICATED,
    "PERMISSION_DENIED": grpc.StatusCode.PERMISSION_DENIED,
    "DATA_LOSS": grpc.StatusCode.DATA_LOSS,
    "ABORTED": grpc.StatusCode.ABORTED,
}
FRAMING_ALLOWANCE = 1024 * 1024
"""Bytes a transfer may carry beyond its fragment in fp32 (codec headers, scales)."""


def _framing_status(exc: FragmentError) -> grpc.StatusCode:
    if exc.reason == "CHECKSUM":
        return grpc.StatusCode.DATA_LOSS
    if exc.reason == "OVERSIZED":
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    return grpc.StatusCode.INVALID_ARGUMENT


def channel_options(cfg: SynchronizerConfig) -> list[tuple[str, Any]]:
    lim = cfg.limits
    return [
        ("grpc.max_concurrent_streams", lim.max_streams_per_connection),
        ("grpc.server_handshake_timeout_ms", int(lim.handshake_timeout_s * 1000)),
        ("grpc.max_receive_message_length", cfg.max_message_bytes),
        ("grpc.max_send_message_length", cfg.max_message_bytes),
        ("grpc.keepalive_time_ms", int(cfg.keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(cfg.keepalive_timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        # Learners ping every keepalive_time_s; accept pings that often without a strike.
        ("grpc.http2.min_ping_interval_without_data_ms", int(cfg.keepalive_time_s * 500)),
        ("grpc.http2.max_pings_without_data", 0),
    ]


class _Violation(Exception):
    def __init__(self, code: grpc.StatusCode, detail: str) -> None:
        super().__init__(detail)
        self.code, self.detail = code, detail


DENY_READ_S = 2.0
"""How long a Sync stream refused for its token waits for its first message before the refusal
is sent (a learner writes its Hello at once)."""
DENY_WAITING = 64
"""How many refused Sync streams may wait for their first message at once; beyond that, a refusal
is sent at once (a peer without a token cannot hold more of the server than this)."""


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without a known ``authorization: Bearer <token>`` (health checks are open).

    A refused Sync stream is closed once its first message (the Hello) has come, not at once:
    closed at once, it can end while the client's first write is on its way, and grpcio's asyncio
    client then reports that write's failure, INTERNAL, in place of the status the server sent
    (grpc/grpc#36066), and a learner would take a refused token for a fault worth retrying. It is
    closed sooner when the client closes its side, after ``DENY_READ_S`` without a message, and at
    once while ``DENY_WAITING`` refused streams wait already. Only a client's first write is covered:
    the learner writes its Hello and then reads."""

    def __init__(self, tokens: TokenTable, on_refusal: Any) -> None:
        self.tokens = tokens
        self.on_refusal = on_refusal
        self.waiting = 0
        """Refused Sync streams waiting for their first message now."""

    async def intercept_service(self, continuation, details):  # type: ignore[no-untyped-def]
        if details.method.startswith("/grpc.health.v1.Health/"):
            return await continuation(details)
        if self.tokens.identity(token_from_metadata(details.invocation_metadata)) is not None:
            return await continuation(details)
        self.on_refusal()
        if details.method.endswith("/Sync"):
            return grpc.stream_stream_rpc_method_handler(self._deny_stream)
        if details.method.endswith("/FetchState"):
            return grpc.unary_stream_rpc_method_handler(_deny)
        return grpc.unary_unary_rpc_method_handler(_deny)

    async def _deny_stream(self, requests: Any, context: grpc.aio.ServicerContext) -> Any:
        if self.waiting < DENY_WAITING:
            self.waiting += 1
            try:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(context.read(), DENY_READ_S)
            finally:
                self.waiting -= 1
        await _deny(None, context)


async def _deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or unknown bearer token")


@dataclass(frozen=True, kw_only=True)
class ServicerParts:
    """What the servicer works with besides the engine's calls."""

    metrics: SynchronizerMetrics
    limits: Limits
    max_chunk_bytes: int
    """The protocol's chunk size: the largest chunk a stream may send."""
    log: Any
    clock: Callable[[], float]


class SynchronizerServicer(wire.SynchronizerServicer):
    def __init__(self, engine: Engine, gate: Gate, parts: ServicerParts) -> None:
        self.engine = engine
        self.gate = gate
        self.metrics, self.limits, self.log, self.clock = parts.metrics, parts.limits, parts.log, parts.clock
        self.max_chunk_bytes = parts.max_chunk_bytes
        self.limiter = StreamLimiter(parts.limits, parts.clock)

    def _identities(self, context: grpc.aio.ServicerContext) -> list[str]:
        return self.gate.identities(token_from_metadata(context.invocation_metadata()), context)

    async def _refuse(self, context: grpc.aio.ServicerContext, limit: str, detail: str) -> None:
        self.metrics.limit_refusals.labels(limit=limit).inc()
        self.log.warning("stream refused", limit=limit, peer=context.peer(), detail=detail)
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{limit}: {detail}")

    # -- Sync -----------------------------------------------------------------------------

    async def Sync(self, request_iterator, context):  # type: ignore[no-untyped-def]
        refused = self.limiter.admit(context.peer())
        if refused is not None:
            await self._refuse(context, *refused)
        try:
            async for message in self._sync(request_iterator, context):
                yield message
        finally:
            self.limiter.release()

    async def _sync(self, request_iterator, context):  # type: ignore[no-untyped-def]
        engine = self.engine
        reader = request_iterator.__aiter__()
        try:
            first = await asyncio.wait_for(reader.__anext__(), timeout=self.limits.hello_timeout_s)
        except StopAsyncIteration:
            return
        except wire.MalformedMessage:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad first message: not a LearnerMessage")
        except TimeoutError:
            await self._refuse(context, "hello_timeout", f"no Hello within {self.limits.hello_timeout_s:g}s")
        try:
            hello = wire.learner_message_from_pb(first)
        except FragmentError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad first message: {exc}")
        if not isinstance(hello, wire.Hello):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first message of Sync must be Hello")
        denied = self.gate.check_sync(self._identities(context), hello.learner_id)
        if denied is not None:
            self.metrics.auth_refusals.labels(reason="identity").inc()
            self.log.warning("stream refused", learner_id=hello.learner_id, peer=context.peer(), detail=denied)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, denied)
        try:
            record, welcome = engine.hello(hello)
        except Refused as r:
            await context.abort(_STATUS.get(r.code, grpc.StatusCode.FAILED_PRECONDITION), f"{r.reason}: {r.detail}")
        yield wire.synchronizer_message_to_pb(welcome)
        stream_id = record.stream_id
        closing = record.closing
        read_task = asyncio.create_task(self._read(record, reader))
        pop_task: asyncio.Task[Any] | None = None
        close_task = asyncio.create_task(closing.wait())
        reason = "stream ended"
        try:
            while True:
                pop_task = asyncio.create_task(record.outbox.pop())
                done, _ = await asyncio.wait({pop_task, read_task, close_task},
                                             return_when=asyncio.FIRST_COMPLETED)
                if pop_task not in done:
                    pop_task.cancel()
                    if read_task in done:
                        exc = read_task.exception()
                        if isinstance(exc, _Violation):
                            reason = exc.detail
                            await context.abort(exc.code, exc.detail)
                        if exc is not None:
                            raise exc
                        goodbye = read_task.result()
                        reason = f"said goodbye ({goodbye})" if goodbye is not None else "learner closed the stream"
                        return
                    reason = "replaced by a newer stream" if not engine.closing else "synchronizer shutting down"
                    await context.abort(grpc.StatusCode.ABORTED, reason)
                item = pop_task.result()
                if isinstance(item, GlobalTransfer):
                    for chunk in item.chunks:
                        self.metrics.sent(len(chunk.data))
                        # serialized without a protobuf copy; an older learner checks every chunk's CRC
                        yield chunk if hello.digest_only else chunk.with_crc32c()
                else:
                    yield wire.synchronizer_message_to_pb(item)
        finally:
            # The pop task too: left running after a cancelled stream it would take the next
            # message queued for this learner id from its next stream.
            for t in (read_task, close_task, pop_task):
                if t is not None and not t.done():
                    t.cancel()
            if read_task.done() and not read_task.cancelled():
                read_task.exception()  # retrieved: an abort while the stream was cancelled is no news
            engine.detach(record, stream_id, reason)

    async def _read(self, record: LearnerRecord, reader: Any) -> str | None:
        """Handle the learner's messages until its stream ends; the goodbye's reason if it said one."""
        engine, lim, clock = self.engine, self.limits, self.clock
        max_transfer = lim.max_transfer_bytes
        largest = engine.largest_fragment
        if largest is not None:
            max_transfer = min(max_transfer, 4 * largest + FRAMING_ALLOWANCE)
        reassembler = Reassembler(max_chunk_bytes=self.max_chunk_bytes, max_payload_bytes=max_transfer)
        transfer_started = 0.0
        while True:
            wait_s = lim.idle_stream_timeout_s
            if reassembler.in_progress is not None:
                wait_s = min(wait_s, transfer_started + lim.transfer_timeout_s - clock())
            try:
                raw = await asyncio.wait_for(reader.__anext__(), timeout=max(wait_s, 0.0))
            except StopAsyncIteration:
                break
            except wire.MalformedMessage as exc:
                engine.reject_framing(record, reassembler.in_progress, "protocol", "not a LearnerMessage")
                raise _Violation(grpc.StatusCode.INVALID_ARGUMENT, "protocol: not a LearnerMessage") from exc
            except TimeoutError:
                if reassembler.in_progress is not None:  # the partial transfer is answered as rejected
                    engine.reject_framing(record, reassembler.in_progress, "timeout", "stream too slow")
                if reassembler.in_progress is not None and wait_s < lim.idle_stream_timeout_s:
                    limit, detail = "transfer_timeout", f"transfer not complete within {lim.transfer_timeout_s:g}s"
                else:
                    limit, detail = "idle_stream_timeout", f"nothing received for {lim.idle_stream_timeout_s:g}s"
                self.metrics.limit_refusals.labels(limit=limit).inc()
                raise _Violation(grpc.StatusCode.DEADLINE_EXCEEDED, f"{limit}: {detail}") from None
            if reassembler.in_progress is None:
                transfer_started = clock()
            try:
                msg = wire.learner_message_from_pb(raw)
            except FragmentError as exc:
                engine.reject_framing(record, reassembler.in_progress, "protocol", str(exc))
                raise _Violation(grpc.StatusCode.INVALID_ARGUMENT, f"protocol: {exc}") from exc
            engine.touch(record)
            if isinstance(msg, Chunk):
                self.metrics.received(len(msg.data))
                header = reassembler.in_progress or msg.header
                try:
                    transfer = reassembler.feed(msg)
                except ChunkError as exc:
                    engine.reject_framing(record, header, exc.reason.lower(), str(exc))
                    if exc.reason == "OVERSIZED":
                        self.metrics.limit_refusals.labels(limit="max_transfer_bytes").inc()
                    raise _Violation(_framing_status(exc), f"{exc.reason.lower()}: {exc}") from exc
                if transfer is not None:
                    await engine.receive(record, transfer)
            elif isinstance(msg, wire.Heartbeat):
                engine.heartbeat(record, msg)
            elif isinstance(msg, wire.Goodbye):
                self.log.info("learner said goodbye", learner_id=record.learner_id, reason=msg.reason)
                return msg.reason
            else:
                engine.reject_framing(record, reassembler.in_progress, "protocol", "Hello sent twice")
                raise _Violation(grpc.StatusCode.INVALID_ARGUMENT, "protocol: Hello sent twice")
        try:
            reassembler.finish()
        except ChunkError as exc:
            engine.reject_framing(record, None, exc.reason.lower(), str(exc))

    # -- FetchState / GetStatus -----------------------------------------------------------

    async def FetchState(self, request, context):  # type: ignore[no-untyped-def]
        req = wire.fetch_request_from_pb(request)
        try:
            transfers = await self.engine.fetch(req.fragment_ids)
        except Refused as r:
            await context.abort(_STATUS.get(r.code, grpc.StatusCode.FAILED_PRECONDITION), f"{r.reason}: {r.detail}")
        for transfer in transfers:
            for chunk in transfer.chunks:
                self.metrics.sent(len(chunk.data))
                yield chunk if req.digest_only else chunk.with_crc32c()

    async def GetStatus(self, request, context):  # type: ignore[no-untyped-def]
        denied = self.gate.check_status(self._identities(context))
        if denied is not None:
            self.metrics.auth_refusals.labels(reason="not_operator").inc()
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, denied)
        return wire.status_to_pb(self.engine.status())


class SynchronizerServer:
    """Owns the grpc.aio server, the engine and the health service."""

    def __init__(self, cfg: SynchronizerConfig, engine: Engine | None = None) -> None:
        self.cfg = cfg
        # Credentials first: an unreadable tokens file or TLS file refuses the start before any
        # state is touched.
        log = get_logger("ddiloco.synchronizer")
        self.tokens = TokenTable(cfg.auth_tokens, cfg.auth_tokens_file,
                                 on_error=lambda msg: log.error("credentials", detail=msg))
        self.certificates = ServerCertificates(
            cfg, on_reload=lambda paths: log.info("TLS files reloaded", files=paths),
            on_error=lambda msg: log.error("credentials", detail=msg)) if cfg.tls_cert else None
        if cfg.auth_tokens:
            log.warning("auth_tokens are written inline in the config; deployments should use auth_tokens_file")
        self.engine = engine or Engine(cfg)
        self.engine.metrics.set_shard(cfg.shard_index, cfg.shard_count)
        self.parts = ServicerParts(metrics=self.engine.metrics, limits=cfg.limits,
                                   max_chunk_bytes=cfg.protocol.max_chunk_bytes, log=self.engine.log,
                                   clock=self.engine.clock)
        self.health = health.aio.HealthServicer()
        refusal = self.parts.metrics.auth_refusals.labels(reason="unknown_token")
        self.interceptor = BearerTokenInterceptor(self.tokens, refusal.inc) if self.tokens.enabled else None
        interceptors = [self.interceptor] if self.interceptor is not None else []
        self.server = grpc.aio.server(options=channel_options(cfg), interceptors=interceptors)
        self.servicer = SynchronizerServicer(self.engine, Gate(cfg, self.tokens), self.parts)
        wire.add_synchronizer_servicer(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = 0
        self.metrics_port: int | None = None

    async def start(self) -> int:
        engine = self.engine
        if engine.load():
            engine.start()
        host, _, port = self.cfg.listen.rpartition(":")
        addr = f"{host}:{port}"
        if self.certificates is not None:
            self.port = self.server.add_secure_port(addr, self.certificates.credentials())
        else:
            self.port = self.server.add_insecure_port(addr)
        if self.port == 0:
            raise OSError(f"cannot listen on {addr}")
        await self.server.start()
        for service in ("", wire.SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        if self.cfg.metrics_port is not None:
            self.metrics_port = self.parts.metrics.serve(self.cfg.metrics_port, self.cfg.metrics_host or host.strip("[]"))
        self.parts.log.info("synchronizer serving", listen=f"{host}:{self.port}", state_dir=self.cfg.state_dir,
                        ready=engine.ready, mode=self.cfg.protocol.mode, metrics_port=self.metrics_port)
        return self.port

    async def stop(self, grace: float | None = None) -> None:
        for service in ("", wire.SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.engine.stop()
        await self.server.stop(self.cfg.shutdown_grace_s if grace is None else grace)
        self.parts.log.info("synchronizer stopped")

    async def wait(self) -> None:
        await self.server.wait_for_termination()
