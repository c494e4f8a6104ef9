"""The synchronizer's gRPC face: grpc.aio server, Sync / FetchState / GetStatus, health, auth.

Each Sync stream runs two coroutines: a reader that reassembles chunks and feeds the engine, and
the response generator that drains the learner's outbox. Framing faults (corrupt, missing,
reordered, oversized chunks, messages out of protocol order) end that stream with a gRPC status
and message after the contribution is rejected; content faults (bad shape, non-finite values,
stale base, ...) are rejected with a ContributionResult and the stream goes on. Either way only
the offending stream is affected and the global model is untouched.

Message limits are set from the protocol's chunk size, and keepalive pings let both sides find
dead peers behind silent networks. SIGTERM: health goes NOT_SERVING, the commit in progress
finishes, then ``server.stop(grace)``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ddiloco.fragments.chunking import Chunk, Reassembler
from ddiloco.fragments.errors import ChunkError, FragmentError
from ddiloco.protocol import wire
from ddiloco.protocol.credentials import read_pem, token_from_metadata
from ddiloco.synchronizer.admission import Refused
from ddiloco.synchronizer.broadcast import GlobalTransfer
from ddiloco.synchronizer.config import SynchronizerConfig
from ddiloco.synchronizer.engine import Engine
from ddiloco.synchronizer.membership import LearnerRecord

_STATUS = {
    "INVALID_ARGUMENT": grpc.StatusCode.INVALID_ARGUMENT,
    "FAILED_PRECONDITION": grpc.StatusCode.FAILED_PRECONDITION,
    "RESOURCE_EXHAUSTED": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "UNAUTHENTICATED": grpc.StatusCode.UNAUTHENTICATED,
    "PERMISSION_DENIED": grpc.StatusCode.PERMISSION_DENIED,
    "DATA_LOSS": grpc.StatusCode.DATA_LOSS,
    "ABORTED": grpc.StatusCode.ABORTED,
}
HELLO_TIMEOUT_S = 30.0


def _framing_status(exc: FragmentError) -> grpc.StatusCode:
    if exc.reason == "CHECKSUM":
        return grpc.StatusCode.DATA_LOSS
    if exc.reason == "OVERSIZED":
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    return grpc.StatusCode.INVALID_ARGUMENT


def channel_options(cfg: SynchronizerConfig) -> list[tuple[str, Any]]:
    return [
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


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without a known ``authorization: Bearer <token>`` (health checks are open)."""

    def __init__(self, tokens: dict[str, str]) -> None:
        self.ids_by_token = {tok: lid for lid, tok in tokens.items()}

    async def intercept_service(self, continuation, details):  # type: ignore[no-untyped-def]
        if details.method.startswith("/grpc.health.v1.Health/"):
            return await continuation(details)
        token = token_from_metadata(details.invocation_metadata)
        if token in self.ids_by_token:
            return await continuation(details)
        return _deny_handler(details.method)


def _deny_handler(method: str) -> grpc.RpcMethodHandler:
    async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or unknown bearer token")

    if method.endswith("/Sync"):
        return grpc.stream_stream_rpc_method_handler(deny)
    if method.endswith("/FetchState"):
        return grpc.unary_stream_rpc_method_handler(deny)
    return grpc.unary_unary_rpc_method_handler(deny)


class SynchronizerServicer(wire.SynchronizerServicer):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    # -- Sync -----------------------------------------------------------------------------

    async def Sync(self, request_iterator, context):  # type: ignore[no-untyped-def]
        engine = self.engine
        reader = request_iterator.__aiter__()
        try:
            first = await asyncio.wait_for(reader.__anext__(), timeout=HELLO_TIMEOUT_S)
        except (StopAsyncIteration, TimeoutError):
            return
        try:
            hello = wire.learner_message_from_pb(first)
        except FragmentError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad first message: {exc}")
        if not isinstance(hello, wire.Hello):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first message of Sync must be Hello")
        bound = self._bound_learner(context)
        if bound is not None and bound != hello.learner_id:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"credentials belong to {bound!r}, not {hello.learner_id!r}")
        try:
            record, welcome = engine.hello(hello)
        except Refused as r:
            await context.abort(_STATUS.get(r.code, grpc.StatusCode.FAILED_PRECONDITION), f"{r.reason}: {r.detail}")
        yield wire.synchronizer_message_to_pb(welcome)
        stream_id = record.stream_id
        closing = record.closing
        read_task = asyncio.create_task(self._read(record, reader))
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
                        engine.metrics.bytes_out.inc(len(chunk.data))
                        yield wire.synchronizer_message_to_pb(chunk)
                else:
                    yield wire.synchronizer_message_to_pb(item)
        finally:
            for t in (read_task, close_task):
                t.cancel()
            engine.detach(record, stream_id, reason)

    def _bound_learner(self, context: grpc.aio.ServicerContext) -> str | None:
        tokens = self.engine.cfg.auth_tokens
        if not tokens:
            return None
        token = token_from_metadata(context.invocation_metadata())
        return {tok: lid for lid, tok in tokens.items()}.get(token, "")

    async def _read(self, record: LearnerRecord, reader: Any) -> str | None:
        """Handle the learner's messages until its stream ends; the goodbye's reason if it said one."""
        engine = self.engine
        reassembler = Reassembler(max_chunk_bytes=engine.cfg.protocol.max_chunk_bytes,
                                  max_payload_bytes=2 * engine.cfg.protocol.max_chunk_bytes * 4096)
        async for raw in reader:
            try:
                msg = wire.learner_message_from_pb(raw)
            except FragmentError as exc:
                engine.reject_framing(record, reassembler.in_progress, "protocol", str(exc))
                raise _Violation(grpc.StatusCode.INVALID_ARGUMENT, f"protocol: {exc}") from exc
            engine.touch(record)
            if isinstance(msg, Chunk):
                engine.metrics.bytes_in.inc(len(msg.data))
                header = reassembler.in_progress or msg.header
                try:
                    transfer = reassembler.feed(msg)
                except ChunkError as exc:
                    engine.reject_framing(record, header, exc.reason.lower(), str(exc))
                    raise _Violation(_framing_status(exc), f"{exc.reason.lower()}: {exc}") from exc
                if transfer is not None:
                    await engine.receive(record, transfer)
            elif isinstance(msg, wire.Heartbeat):
                engine.heartbeat(record, msg)
            elif isinstance(msg, wire.Goodbye):
                engine.log.info("learner said goodbye", learner_id=record.learner_id, reason=msg.reason)
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
                self.engine.metrics.bytes_out.inc(len(chunk.data))
                yield wire.chunk_to_pb(chunk)

    async def GetStatus(self, request, context):  # type: ignore[no-untyped-def]
        return wire.status_to_pb(self.engine.status())


class SynchronizerServer:
    """Owns the grpc.aio server, the engine and the health service."""

    def __init__(self, cfg: SynchronizerConfig, engine: Engine | None = None) -> None:
        self.cfg = cfg
        self.engine = engine or Engine(cfg)
        self.health = health.aio.HealthServicer()
        interceptors = [BearerTokenInterceptor(cfg.auth_tokens)] if cfg.auth_tokens else []
        self.server = grpc.aio.server(options=channel_options(cfg), interceptors=interceptors)
        wire.add_synchronizer_servicer(SynchronizerServicer(self.engine), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = 0
        self.metrics_port: int | None = None

    async def start(self) -> int:
        engine = self.engine
        if engine.load():
            engine.start()
        host, _, port = self.cfg.listen.rpartition(":")
        addr = f"{host}:{port}"
        if self.cfg.tls_cert:
            creds = _server_credentials(self.cfg)
            self.port = self.server.add_secure_port(addr, creds)
        else:
            self.port = self.server.add_insecure_port(addr)
        if self.port == 0:
            raise OSError(f"cannot listen on {addr}")
        await self.server.start()
        for service in ("", wire.SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        if self.cfg.metrics_port is not None:
            self.metrics_port = engine.metrics.serve(self.cfg.metrics_port)
        engine.log.info("synchronizer serving", listen=f"{host}:{self.port}", state_dir=self.cfg.state_dir,
                        ready=engine.ready, mode=self.cfg.protocol.mode, metrics_port=self.metrics_port)
        return self.port

    async def stop(self, grace: float | None = None) -> None:
        for service in ("", wire.SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.engine.stop()
        await self.server.stop(self.cfg.shutdown_grace_s if grace is None else grace)
        self.engine.log.info("synchronizer stopped")

    async def wait(self) -> None:
        await self.server.wait_for_termination()


def _server_credentials(cfg: SynchronizerConfig) -> grpc.ServerCredentials:
    assert cfg.tls_cert and cfg.tls_key
    root = read_pem(cfg.tls_client_ca) if cfg.tls_client_ca else None
    return grpc.ssl_server_credentials([(read_pem(cfg.tls_key), read_pem(cfg.tls_cert))], root_certificates=root,
                                       require_client_auth=root is not None)
