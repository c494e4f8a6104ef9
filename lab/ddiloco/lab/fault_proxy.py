"""A fault-injecting TCP proxy that sits on one learner's link to the synchronizer.

Why a proxy: this kernel has no ``tc netem`` (and chaos runs must not need root), so network faults
are injected by a process we own that is placed in the path. A proxy per learner also makes the
faults per-learner and deterministic: the chaos driver breaks exactly one link, at exactly the
moment it chooses, and the test can see what the proxy did (byte and connection counters).

How each fault maps to what real networks do:

- ``set_latency(s)``: every chunk is held ``s`` after it arrived, in both directions and in order,
  like a long path or a congested queue. Round trips grow by ``2 * s``; bytes are never reordered.
  The delay is read when a chunk is due, so changing it applies to data already queued.
- ``set_bandwidth(bytes_per_s)``: a token bucket per direction (shared by the proxy's
  connections, as they share a link) with a burst of at most ``BURST_S`` of traffic: a thin or
  throttled link. TCP backpressure reaches the sender because the proxy stops reading.
- ``stall(s)``: nothing is forwarded for ``s`` seconds, connections stay open and bytes are kept,
  then everything flows again: a short outage (a flapping link, a long GC pause of a middlebox)
  that TCP retransmission rides through without anyone seeing an error.
- ``reset()``: every current connection is aborted with an RST on both sides (``SO_LINGER`` 0):
  a NAT or load balancer dropping its state, a peer host rebooting. Both ends see
  ``ECONNRESET`` at once; new connections work.
- ``blackhole(True)``: packets vanish. Connections are still accepted (the client cannot tell),
  nothing is forwarded and bytes that arrive are dropped. A connection that loses a byte can never
  deliver anything again (the stream has a hole), so it stays silent until a peer gives up on it,
  i.e. keepalive or a deadline is what notices, exactly as behind a real blackhole that outlasts
  TCP's retransmissions. A connection that stayed idle through the blackhole loses nothing and
  carries on. Connections accepted while it is on are never connected to the target.
- ``clear()`` turns all of the above off; connections already severed by a blackhole stay silent.

The proxy runs its own event loop in a daemon thread, so the chaos driver (plain threads) calls it
directly; every control is thread-safe and takes effect at once. Memory is bounded: a direction
stops reading from its source while more than ``max_queued_bytes`` wait to be forwarded.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from ddiloco.core.logs import get_logger

T = TypeVar("T")

TO_TARGET = "to_target"
TO_CLIENT = "to_client"
BURST_S = 0.05
"""The token bucket holds at most this much traffic at the configured rate (and one read chunk)."""

_LINGER_RST = struct.pack("ii", 1, 0)


@dataclass(frozen=True, kw_only=True)
class FaultProxyConfig:
    listen_host: str = "127.0.0.1"
    """Address the proxy listens on; the port is always chosen by the kernel (port 0)."""
    name: str = "fault-proxy"
    """Label bound to every log line (the chaos driver uses the learner id)."""
    max_queued_bytes: int = 8 * 1024 * 1024
    """Per connection and direction: reading from the source pauses while more than this is queued."""
    read_chunk_bytes: int = 64 * 1024
    """Largest read from a socket; also the unit that latency delays."""
    connect_timeout_s: float = 5.0
    """Giving up on the target; the client is then reset, like a refused connection."""
    control_timeout_s: float = 10.0
    """How long ``start``/``reset``/``stop`` wait for the proxy's loop to carry them out."""

    def __post_init__(self) -> None:
        if self.max_queued_bytes <= 0:
            raise ValueError(f"max_queued_bytes must be positive, got {self.max_queued_bytes}")
        if self.read_chunk_bytes <= 0:
            raise ValueError(f"read_chunk_bytes must be positive, got {self.read_chunk_bytes}")
        if self.connect_timeout_s <= 0 or self.control_timeout_s <= 0:
            raise ValueError("connect_timeout_s and control_timeout_s must be positive")


@dataclass(frozen=True, kw_only=True)
class ProxyStats:
    bytes_to_target: int
    """Bytes written to the target (client -> synchronizer)."""
    bytes_to_client: int
    """Bytes written to the client (synchronizer -> client)."""
    connections_accepted: int
    connections_open: int
    connections_reset: int
    """Connections aborted with an RST by ``reset()``."""
    resets: int
    """Calls to ``reset()``."""
    connections_severed: int
    """Connections that lost bytes to a blackhole (or were accepted into one)."""
    peak_queued_bytes: int
    """Most bytes ever waiting in one direction of one connection."""


@dataclass(frozen=True)
class _Faults:
    latency_s: float = 0.0
    bandwidth: float | None = None
    stall_until: float = 0.0
    blackhole: bool = False


class _Hangup(Exception):
    """A peer closed a connection that a blackhole had already severed."""


class _TokenBucket:
    def __init__(self) -> None:
        self.rate: float | None = None
        self.tokens = 0.0
        self.stamp = 0.0

    def take(self, rate: float, want: int, chunk: int, now: float) -> tuple[int, float]:
        """Bytes that may be sent now, or (0, seconds to wait)."""
        burst = max(1, min(chunk, int(rate * BURST_S)))
        if rate != self.rate:
            self.rate, self.tokens, self.stamp = rate, float(burst), now
        self.tokens = min(float(burst), self.tokens + (now - self.stamp) * rate)
        self.stamp = now
        n = min(want, burst)
        if self.tokens >= n:
            self.tokens -= n
            return n, 0.0
        return 0, (n - self.tokens) / rate


class _Pipe:
    """One direction of one connection: chunks read from the source, waiting to be written."""

    def __init__(self, direction: str) -> None:
        self.direction = direction
        self.queue: deque[tuple[float, bytes]] = deque()
        self.queued = 0
        self.eof = False
        self.ready = asyncio.Event()
        self.space = asyncio.Event()


class _Conn:
    def __init__(self, cid: int, client: asyncio.StreamWriter, task: asyncio.Task[Any]) -> None:
        self.cid = cid
        self.client = client
        self.upstream: asyncio.StreamWriter | None = None
        self.task = task
        self.pipes: list[_Pipe] = []
        self.severed = False
        self.reset = False


def _abort_with_rst(writer: asyncio.StreamWriter | None) -> None:
    if writer is None:
        return
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
    writer.transport.abort()


class FaultProxy:
    """Forwards TCP from ``127.0.0.1:<port>`` to ``(host, port)`` and breaks it on demand."""

    def __init__(self, host: str, port: int, config: FaultProxyConfig | None = None) -> None:
        self.config = config or FaultProxyConfig()
        self.log = get_logger("ddiloco.lab.fault_proxy", proxy=self.config.name)
        self._lock = threading.Lock()
        self._target = (host, port)
        self._faults = _Faults()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._port: int | None = None
        self._conns: set[_Conn] = set()
        self._ids = itertools.count(1)
        self._buckets = {TO_TARGET: _TokenBucket(), TO_CLIENT: _TokenBucket()}
        self._bytes = {TO_TARGET: 0, TO_CLIENT: 0}
        self._accepted = 0
        self._conns_reset = 0
        self._resets = 0
        self._severed = 0
        self._peak_queued = 0

    # -- lifecycle (any thread) -----------------------------------------------------------

    def start(self) -> int:
        """Start the proxy's loop in a daemon thread; returns the port it listens on."""
        if self._thread is not None:
            raise RuntimeError("FaultProxy already started")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name=f"fault-proxy-{self.config.name}",
                                        daemon=True)
        self._thread.start()
        self._port = self._call(self._listen())
        self.log.info("proxy started", port=self._port, target=f"{self._target[0]}:{self._target[1]}")
        return self._port

    def stop(self) -> None:
        """Close the listener and every connection, stop the loop and join its thread. Idempotent."""
        thread, loop = self._thread, self._loop
        if thread is None or loop is None or not thread.is_alive():
            return
        with contextlib.suppress(RuntimeError, TimeoutError):
            self._call(self._shutdown())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(self.config.control_timeout_s)
        self.log.info("proxy stopped", **self._counters())

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("FaultProxy not started")
        return self._port

    @property
    def target(self) -> tuple[str, int]:
        return self._target

    # -- faults (any thread, effective at once) -------------------------------------------

    def set_latency(self, seconds: float) -> None:
        """Hold every chunk ``seconds`` after it arrived, both directions (round trips grow by 2x)."""
        if seconds < 0:
            raise ValueError(f"latency must be >= 0, got {seconds}")
        self._set_faults("latency", latency_s=float(seconds))

    def set_bandwidth(self, bytes_per_s: float | None) -> None:
        """Cap each direction at ``bytes_per_s`` (None: uncapped)."""
        if bytes_per_s is not None and bytes_per_s <= 0:
            raise ValueError(f"bandwidth must be positive or None, got {bytes_per_s}")
        self._set_faults("bandwidth", bandwidth=None if bytes_per_s is None else float(bytes_per_s))

    def stall(self, seconds: float) -> None:
        """Forward nothing for ``seconds`` from now (replacing a stall in progress), then resume."""
        if seconds < 0:
            raise ValueError(f"stall must be >= 0, got {seconds}")
        self._set_faults("stall", stall_until=time.monotonic() + seconds)

    def blackhole(self, on: bool) -> None:
        """While on, accept but forward nothing and drop what arrives (see the module docstring)."""
        self._set_faults("blackhole", blackhole=bool(on))

    def clear(self) -> None:
        """All faults off. Connections a blackhole severed stay silent (``reset()`` ends them)."""
        self._set_faults("clear")

    def reset(self) -> int:
        """Abort every current connection with an RST on both sides; returns how many."""
        n = self._call(self._reset_all())
        self.log.info("fault", fault="reset", connections=n)
        return n

    def set_target(self, host: str, port: int) -> None:
        """New connections go to ``(host, port)``; open ones keep their target."""
        with self._lock:
            self._target = (host, port)
        self.log.info("retargeted", target=f"{host}:{port}")

    def stats(self) -> ProxyStats:
        return ProxyStats(**self._counters())

    def _counters(self) -> dict[str, int]:
        return {
            "bytes_to_target": self._bytes[TO_TARGET],
            "bytes_to_client": self._bytes[TO_CLIENT],
            "connections_accepted": self._accepted,
            "connections_open": len(self._conns),
            "connections_reset": self._conns_reset,
            "resets": self._resets,
            "connections_severed": self._severed,
            "peak_queued_bytes": self._peak_queued,
        }

    def _set_faults(self, fault: str, **changes: Any) -> None:
        with self._lock:
            self._faults = _Faults() if fault == "clear" else dataclasses.replace(self._faults, **changes)
            faults = self._faults
        stall_left = max(0.0, faults.stall_until - time.monotonic())
        self.log.info("fault", fault=fault, latency_s=faults.latency_s, bandwidth=faults.bandwidth,
                      stall_s=round(stall_left, 3), blackhole=faults.blackhole)
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._wake_all)

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        loop = self._loop
        if loop is None or self._thread is None:
            coro.close()
            raise RuntimeError("FaultProxy not started")
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("FaultProxy controls that wait cannot be called from its own loop")
        return asyncio.run_coroutine_threadsafe(coro, loop).result(self.config.control_timeout_s)

    # -- the loop thread ------------------------------------------------------------------

    def _run_loop(self) -> None:
        loop = self._loop
        assert loop is not None
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()

    async def _listen(self) -> int:
        self._server = await asyncio.start_server(self._serve, self.config.listen_host, 0)
        return int(self._server.sockets[0].getsockname()[1])

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        await self._abort_all()

    async def _reset_all(self) -> int:
        n = await self._abort_all()
        self._resets += 1
        self._conns_reset += n
        return n

    async def _abort_all(self) -> int:
        conns = list(self._conns)
        for conn in conns:
            conn.reset = True
            _abort_with_rst(conn.client)
            _abort_with_rst(conn.upstream)
            conn.task.cancel()
        await asyncio.gather(*(c.task for c in conns), return_exceptions=True)
        return len(conns)

    def _wake_all(self) -> None:
        for conn in self._conns:
            for pipe in conn.pipes:
                pipe.ready.set()
                pipe.space.set()

    def _sever(self, conn: _Conn) -> None:
        if conn.severed:
            return
        conn.severed = True
        self._severed += 1
        for pipe in conn.pipes:
            pipe.queue.clear()
            pipe.queued = 0
            pipe.ready.set()
            pipe.space.set()
        self.log.info("connection severed by blackhole", conn=conn.cid)

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        conn = _Conn(next(self._ids), client_writer, task)
        self._conns.add(conn)
        self._accepted += 1
        failed = False
        try:
            if self._faults.blackhole:
                conn.pipes = [_Pipe(TO_TARGET)]
                self._sever(conn)
                await self._read(conn, conn.pipes[0], client_reader)
                return
            host, port = self._target
            try:
                upstream_reader, upstream_writer = await asyncio.wait_for(
                    asyncio.open_connection(host, port), self.config.connect_timeout_s)
            except (OSError, TimeoutError) as exc:
                self.log.warning("target unreachable", conn=conn.cid, target=f"{host}:{port}", error=repr(exc))
                failed = True
                return
            conn.upstream = upstream_writer
            up, down = _Pipe(TO_TARGET), _Pipe(TO_CLIENT)
            conn.pipes = [up, down]
            self.log.debug("connection open", conn=conn.cid, target=f"{host}:{port}")
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._read(conn, up, client_reader))
                tg.create_task(self._write(conn, up, upstream_writer))
                tg.create_task(self._read(conn, down, upstream_reader))
                tg.create_task(self._write(conn, down, client_writer))
        except* _Hangup:
            pass
        except* OSError as group:
            # A peer reset or vanished: pass that on to the other side as an RST too.
            failed = True
            self.log.debug("connection failed", conn=conn.cid, error=repr(group.exceptions[0]))
        except* asyncio.CancelledError:
            if not conn.reset:
                raise
        except* Exception as group:
            failed = True
            self.log.error("proxy connection crashed", conn=conn.cid, error=repr(group.exceptions[0]))
        finally:
            self._conns.discard(conn)
            if failed or conn.reset:
                _abort_with_rst(conn.client)
                _abort_with_rst(conn.upstream)
            else:
                conn.client.close()
                if conn.upstream is not None:
                    conn.upstream.close()

    async def _read(self, conn: _Conn, pipe: _Pipe, src: asyncio.StreamReader) -> None:
        limit, chunk = self.config.max_queued_bytes, self.config.read_chunk_bytes
        while True:
            pipe.space.clear()
            if pipe.queued > limit and not conn.severed:
                await pipe.space.wait()
                continue
            data = await src.read(chunk)
            if not data:
                if conn.severed:
                    raise _Hangup
                pipe.eof = True
                pipe.ready.set()
                return
            if conn.severed or self._faults.blackhole:
                self._sever(conn)
                continue
            pipe.queue.append((time.monotonic(), data))
            pipe.queued += len(data)
            self._peak_queued = max(self._peak_queued, pipe.queued)
            if len(pipe.queue) == 1:
                pipe.ready.set()

    async def _write(self, conn: _Conn, pipe: _Pipe, dst: asyncio.StreamWriter) -> None:
        bucket, chunk = self._buckets[pipe.direction], self.config.read_chunk_bytes
        while True:
            pipe.ready.clear()
            if conn.severed:
                return
            if not pipe.queue:
                if pipe.eof:
                    if dst.can_write_eof():
                        dst.write_eof()
                    return
                await pipe.ready.wait()
                continue
            faults, now = self._faults, time.monotonic()
            if faults.blackhole:
                self._sever(conn)
                return
            arrived, data = pipe.queue[0]
            wait = max(arrived + faults.latency_s - now, faults.stall_until - now)
            n = len(data)
            if wait <= 0 and faults.bandwidth is not None:
                n, wait = bucket.take(faults.bandwidth, n, chunk, now)
            if wait > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(pipe.ready.wait(), wait)
                continue
            if n == len(data):
                pipe.queue.popleft()
            else:
                pipe.queue[0] = (arrived, data[n:])
                data = data[:n]
            pipe.queued -= n
            pipe.space.set()
            dst.write(data)
            self._bytes[pipe.direction] += n
            await dst.drain()
