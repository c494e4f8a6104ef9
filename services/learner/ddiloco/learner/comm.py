"""The learner's communication thread: the only owner of the gRPC stream.

Training never touches the network. At step boundaries it picks up the synchronizer's requests
(``Comm.take_requests``: which fragments to send now), hands contributions to ``Comm.submit``
(non-blocking; at most the newest contribution per fragment and base is held while the
synchronizer is unreachable) and picks up merged fragments with ``Comm.take_arrivals``. Modes that wait by
design (streaming, diloco) call ``Comm.wait_arrival`` with a timeout.

The thread runs its own asyncio loop: it connects, says Hello, joins (genesis upload or
FetchState), then runs a sender, a receiver and a heartbeat task until the stream breaks, and
reconnects with exponential backoff and jitter (tenacity) while training goes on. Contributions
sent but not yet answered are sent again after a reconnect, under the same sequence number;
the synchronizer answers a duplicate of an already merged contribution without merging it twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type

from ddiloco.core.logs import get_logger
from ddiloco.fragments.chunking import Transfer
from ddiloco.fragments.codec import make_codec
from ddiloco.fragments.error_feedback import ErrorFeedback
from ddiloco.fragments.partition import FragmentLayout
from ddiloco.fragments.payload import decode_fragment, encode_fragment
from ddiloco.learner.config import LearnerConfig
from ddiloco.learner.events import EventLog
from ddiloco.protocol import wire
from ddiloco.protocol.client import StreamClosed, SyncStream, message_limit, open_channel


@dataclass
class Outgoing:
    """A contribution handed over by the training loop."""

    fragment: int
    sequence: int
    base_version: int
    tokens: int
    steps: int
    learner_step: int
    delta: torch.Tensor
    round: int = 0
    """The request it answers (0: unsolicited)."""
    payload: bytes | None = None


@dataclass
class Arrival:
    fragment: int
    version: int
    values: torch.Tensor
    resync: bool = False
    """Fetched because the synchronizer said our state is unusable: apply as overwrite."""


@dataclass
class LiveStats:
    step: int = 0
    tokens_total: int = 0
    tokens_per_s: float = 0.0
    step_time_s: float = 0.0
    """Recent wall time per inner step (what paces the fleet's clock)."""
    training_done: bool = False


@dataclass
class JoinState:
    """What the training thread needs from the first successful join."""

    ready: threading.Event = field(default_factory=threading.Event)
    genesis: bool = False
    fleet_step: int = 0
    fetched: dict[int, tuple[int, torch.Tensor]] = field(default_factory=dict)
    error: str | None = None


HEAL_AFTER = 3
"""Contributions of one fragment refused for their content in a row before training heals it."""
RECOVERABLE = frozenset({"stale", "future_version", "not_ready", "protocol"})
"""Refusals that say nothing about the learner's state (the synchronizer resyncs stale ones)."""


class _Reconnect(Exception):
    pass


class ReconnectBackoff:
    """The wait before each reconnection attempt: exponential with jitter, restarted by a session.

    ``initial_s * 2**(n-1)`` capped at ``max_s``, plus uniform jitter of up to ``jitter_s``, where n
    counts the failed attempts since the last session that connected and held (tenacity counts
    attempts over the thread's whole life). Without the restart, a stream that broke after hours
    of healthy streaming waited the ceiling reached during some earlier outage: measured 5 s
    instead of ~0.1-0.6 s, while a fleet-wide merge (quorum 0) waited for that learner.
    """

    def __init__(self, *, initial_s: float = 0.1, max_s: float = 2.0, jitter_s: float = 0.5,
                 rng: random.Random | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        if initial_s <= 0 or max_s < initial_s or jitter_s < 0:
            raise ValueError("need 0 < initial_s <= max_s and jitter_s >= 0")
        self.initial_s, self.max_s, self.jitter_s = initial_s, max_s, jitter_s
        self._rng = rng or random.Random()
        self._clock = clock
        self._offset = 0
        self._connected_at: float | None = None

    def connected(self) -> None:
        """A session got through Hello and the join. If it then lasts ``max_s`` or longer, the
        next failure starts the sequence over; one that fails sooner (say, two processes with
        the same id knocking each other off) keeps backing off."""
        self._connected_at = self._clock()

    def attempt(self, state: RetryCallState) -> int:
        """Failed attempts since the last connected session (1 for the first)."""
        return state.attempt_number - self._offset

    def __call__(self, state: RetryCallState) -> float:
        if self._connected_at is not None:
            if self._clock() - self._connected_at >= self.max_s:
                self._offset = state.attempt_number - 1
            self._connected_at = None
        n = self.attempt(state)
        base = self.initial_s * 2.0 ** min(n - 1, 60)
        return min(base, self.max_s) + self._rng.uniform(0.0, self.jitter_s)


class Comm:
    def __init__(self, cfg: LearnerConfig, *, layout: FragmentLayout, model_fingerprint: str, incarnation: int,
                 events: EventLog, held: Callable[[], dict[int, int]],
                 genesis_values: Callable[[], dict[int, torch.Tensor]],
                 labels: dict[str, str] | None = None) -> None:
        self.cfg = cfg
        self.labels = dict(labels or {})
        """Sent in every Hello (the synchronizer shows them in its status; ``model`` names the model)."""
        self.layout = layout
        self.model_fingerprint = model_fingerprint
        self.incarnation = incarnation
        self.events = events
        self.held = held
        self.genesis_values = genesis_values
        self.learner_id = cfg.resolved_id
        self.log = get_logger("ddiloco.learner.comm", learner_id=self.learner_id)
        self.codec = make_codec(cfg.codec, zstd_level=cfg.zstd_level, threads=cfg.codec_threads)
        self.feedback = ErrorFeedback() if cfg.error_feedback and not self.codec.lossless else None
        self.stats = LiveStats()
        self.join = JoinState()
        self.joined = False
        self.synchronizer_id = ""
        self.draining = threading.Event()
        self.hurry = threading.Event()
        """Set by a second stop request: ``flush`` stops waiting (what is unsent or unanswered is dropped)."""
        self.connected = threading.Event()
        self.bytes_sent = 0
        self.bytes_received = 0
        self._lock = threading.Condition()
        self._outbound: dict[int, list[Outgoing]] = {}
        """fragment -> contributions waiting to be sent, oldest first, one per base version."""
        self._unacked: dict[int, Outgoing] = {}
        self._arrivals: dict[int, Arrival] = {}
        self._requests: dict[int, int] = {}
        """fragment -> the newest round the synchronizer asked for and training has not answered."""
        self._refused: dict[int, int] = {}
        """fragment -> contributions refused for their content in a row."""
        self._heals: set[int] = set()
        """Fragments refused ``HEAL_AFTER`` times in a row: training resynchronises them."""
        self._resync_wanted: set[int] = set()
        """Fragments training wants fetched again (it healed them)."""
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._beat: asyncio.Event | None = None
        self._transfer_id = 0
        self._thread = threading.Thread(target=self._thread_main, name=f"comm-{self.learner_id}", daemon=True)
        self._heartbeat_s = cfg.heartbeat_s
        self._backoff = ReconnectBackoff(max_s=cfg.reconnect_max_s)

    # -- training-thread API --------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, out: Outgoing) -> None:
        """Queue a contribution. An unsent older one of the same fragment *from the same base* is
        dropped (logged): the newer one carries its progress. One from an older base stays queued
        (a merge without it was applied since, so the newer one does not hold its progress); the
        synchronizer sums the two."""
        with self._lock:
            queue = self._outbound.setdefault(out.fragment, [])
            old = queue.pop() if queue and queue[-1].base_version == out.base_version else None
            queue.append(out)
        if old is not None:
            self.events.emit("dropped", sequence=old.sequence, fragment=old.fragment,
                             reason="replaced by a newer contribution before it could be sent")
        self._poke()

    def take_requests(self) -> dict[int, int]:
        """Fragments the synchronizer asked for since the last call: fragment -> round."""
        with self._lock:
            out, self._requests = self._requests, {}
        return out

    def take_heals(self) -> set[int]:
        """Fragments whose contributions were refused for their content too often in a row."""
        with self._lock:
            out, self._heals = self._heals, set()
        return out

    def resync(self, fragments: tuple[int, ...]) -> None:
        """Fetch the newest global version of ``fragments`` and deliver it as a resync arrival."""
        with self._lock:
            self._resync_wanted.update(fragments)
        self._poke()

    def training_done(self) -> None:
        """Training ended: tell the synchronizer at once (heartbeat), so no round waits for us."""
        self.stats.training_done = True
        self.beat_now()

    def beat_now(self) -> None:
        """Send a heartbeat now rather than at the next interval (the pace became known, training ended)."""
        loop, beat = self._loop, self._beat
        if loop is not None and beat is not None:
            with contextlib.suppress(RuntimeError):  # the loop already closed
                loop.call_soon_threadsafe(beat.set)

    def take_arrivals(self) -> dict[int, Arrival]:
        with self._lock:
            out, self._arrivals = self._arrivals, {}
        return out

    def peek_version(self, fragment: int) -> int | None:
        with self._lock:
            a = self._arrivals.get(fragment)
            return a.version if a else None

    def wait_arrival(self, fragment: int, newer_than: int, timeout_s: float) -> bool:
        """Block until a global of ``fragment`` newer than ``newer_than`` has arrived (or timeout)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                a = self._arrivals.get(fragment)
                if a is not None and a.version > newer_than:
                    return True
                left = deadline - time.monotonic()
                if left <= 0 or self._stop.is_set():
                    return False
                self._lock.wait(min(left, 0.5))

    def pending(self) -> int:
        with self._lock:
            return sum(len(q) for q in self._outbound.values()) + len(self._unacked)

    def flush(self, timeout_s: float) -> bool:
        """Wait until every submitted contribution has been answered (or timeout, or ``hurry``)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self.hurry.is_set():
            if self.pending() == 0:
                return True
            time.sleep(0.05)
        return self.pending() == 0

    def stop(self, goodbye: str = "finished") -> None:
        self._goodbye = goodbye
        self._stop.set()
        self._poke()
        if self._thread.ident is not None:  # else it never started (the learner failed first)
            self._thread.join(timeout=15)
        with self._lock:
            leftovers = [o for q in self._outbound.values() for o in q] + list(self._unacked.values())
            self._outbound.clear()
            self._unacked.clear()
        for out in leftovers:
            self.events.emit("dropped", sequence=out.sequence, fragment=out.fragment,
                             reason="learner stopped before the contribution was answered")

    def _poke(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            with contextlib.suppress(RuntimeError):  # the loop already closed
                loop.call_soon_threadsafe(wake.set)

    # -- the thread -----------------------------------------------------------------------

    def _thread_main(self) -> None:
        try:
            asyncio.run(self._main())
        except Exception as exc:  # never kill the learner from here; report and end
            self.log.exception("communication thread failed")
            self.join.error = str(exc)
            self.join.ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._beat = asyncio.Event()
        backoff = self._backoff

        def log_retry(state: Any) -> None:
            exc = state.outcome.exception() if state.outcome else None
            self.log.info("reconnecting", attempt=backoff.attempt(state), error=str(exc)[:200],
                          wait_s=round(state.next_action.sleep, 3) if state.next_action else None)

        # Any failure of a session (stream closed, RPC error, a bug in handling one message) ends
        # that session only; the thread reconnects with backoff until the learner stops.
        retry = AsyncRetrying(wait=backoff, retry=retry_if_exception_type(Exception), before_sleep=log_retry,
                              reraise=True)
        try:
            async for attempt in retry:
                with attempt:
                    if self._stop.is_set():
                        return
                    await self._session()
                    if self._stop.is_set():
                        return
                    raise _Reconnect("stream ended")
        except Exception:
            if not self._stop.is_set():
                raise

    async def _session(self) -> None:
        cfg = self.cfg
        creds = cfg.credentials
        channel = open_channel(cfg.synchronizer, max_message_bytes=message_limit(cfg.protocol.max_chunk_bytes),
                               credentials=creds)
        stream = SyncStream(channel, max_chunk_bytes=cfg.protocol.max_chunk_bytes, token=creds.token)
        tasks: list[asyncio.Task[Any]] = []
        try:
            welcome = await stream.open(self._hello())
            if welcome.state == "genesis_pending":
                raise _Reconnect("genesis pending at the synchronizer")
            restarted = bool(self.synchronizer_id) and welcome.synchronizer_id != self.synchronizer_id
            self.synchronizer_id = welcome.synchronizer_id
            self._heartbeat_s = welcome.heartbeat_interval_s or cfg.heartbeat_s
            await self._join(stream, welcome)
            self.connected.set()
            self._backoff.connected()
            self.events.emit("connect", synchronizer_id=welcome.synchronizer_id, state=welcome.state,
                             restarted=restarted)
            self._requeue_unacked()
            tasks = [asyncio.create_task(self._sender(stream)), asyncio.create_task(self._receiver(stream)),
                     asyncio.create_task(self._heartbeats(stream)), asyncio.create_task(self._stopper())]
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                exc = t.exception()
                if exc is not None:
                    raise exc
        except StreamClosed as exc:
            if exc.code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.PERMISSION_DENIED,
                            grpc.StatusCode.UNAUTHENTICATED) and not self.joined:
                # Refused at Hello (other model, layout, credentials): retrying cannot help.
                self.join.error = f"{exc.code.name}: {exc.details}"
                self.join.ready.set()
                self._stop.set()
            raise
        finally:
            self.connected.clear()
            if self._stop.is_set():
                # Say goodbye before cancelling the tasks: grpc cancels the whole call when a task
                # is cancelled in the middle of a write, and the goodbye would never arrive.
                await stream.close(getattr(self, "_goodbye", "stopping"))
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await stream.close()
            await channel.close()
            if tasks:
                self.events.emit("disconnect", synchronizer_id=self.synchronizer_id)

    def _hello(self) -> wire.Hello:
        return wire.Hello(
            learner_id=self.learner_id, model_fingerprint=self.model_fingerprint,
            layout_hash=self.layout.fingerprint, protocol=wire.ProtocolParams.from_config(self.cfg.protocol),
            held=self.held() if self.joined else {}, incarnation=self.incarnation,
            software_version=_version(), labels={**self.labels, "pid": str(os.getpid())})

    async def _join(self, stream: SyncStream, welcome: wire.Welcome) -> None:
        if welcome.state == "genesis_requested":
            if self.joined:
                raise _Reconnect("synchronizer lost its state and asks for genesis; refusing to re-seed it")
            values = self.genesis_values()
            for frag in self.layout:
                self._transfer_id += 1
                chunks = await asyncio.to_thread(
                    encode_fragment, values[frag.index], frag, codec=make_codec("fp32"), kind="genesis", version=0,
                    transfer_id=self._transfer_id, layout_hash=self.layout.fingerprint,
                    max_chunk_bytes=self.cfg.protocol.max_chunk_bytes)
                await stream.send_transfer(chunks)
            self.joined = True
            self.join.genesis = True
            self.join.ready.set()
            self.log.info("genesis uploaded", fragments=self.layout.num_fragments)
            return
        if not self.joined:
            self.join.fleet_step = welcome.fleet_step
            fetched = await self._fetch(stream, ())
            self.join.fetched = {p: (a.version, a.values) for p, a in fetched.items()}
            self.joined = True
            self.join.ready.set()
            self.log.info("state fetched", versions={p: v for p, (v, _) in self.join.fetched.items()})
            return
        held = self.held()
        behind = tuple(p for p, v in welcome.versions.items() if v > held.get(p, -1))
        if behind:  # broadcasts missed while disconnected
            for a in (await self._fetch(stream, behind)).values():
                self._deliver(a)

    async def _fetch(self, stream: SyncStream, fragments: tuple[int, ...], resync: bool = False) -> dict[int, Arrival]:
        transfers = await stream.fetch_state(self.learner_id, fragments)
        out = {}
        for t in transfers:
            values = await asyncio.to_thread(decode_fragment, t, self.layout)
            out[t.header.fragment_id] = Arrival(t.header.fragment_id, t.header.version, values, resync)
            self.bytes_received += t.header.encoded_bytes
        return out

    async def _fetch_resync(self, stream: SyncStream, fragments: tuple[int, ...], *, requeue: bool = False) -> None:
        """Fetch the newest global version of ``fragments``, deliver each as a resync arrival and
        drop its error-feedback residual. ``requeue``: if the fetch fails, the fragments are wanted
        again, to be fetched on the next session."""
        try:
            fetched = await self._fetch(stream, fragments, resync=True)
        except BaseException:
            if requeue:
                with self._lock:
                    self._resync_wanted.update(fragments)
            raise
        for a in fetched.values():
            self._deliver(a)
            if self.feedback is not None:
                self.feedback.reset(a.fragment)

    def _deliver(self, arrival: Arrival) -> None:
        with self._lock:
            cur = self._arrivals.get(arrival.fragment)
            if cur is None or arrival.version > cur.version or arrival.resync:
                self._arrivals[arrival.fragment] = arrival
            self._lock.notify_all()

    def _requeue_unacked(self) -> None:
        with self._lock:
            # newest first, so an older one finds the newer one from its base that carries it
            for seq, out in sorted(self._unacked.items(), reverse=True):
                queue = self._outbound.get(out.fragment, [])
                if any(o.sequence > seq and o.base_version == out.base_version for o in queue):
                    self.events.emit("dropped", sequence=seq, fragment=out.fragment,
                                     reason="unanswered at a reconnect; a newer contribution from the same "
                                            "base carries its progress")
                    continue
                # Nothing queued holds its progress: send it again, in sequence order (the synchronizer
                # answers a duplicate of a merged contribution without merging it twice).
                queue.append(out)
                queue.sort(key=lambda o: o.sequence)
                self._outbound[out.fragment] = queue
            self._unacked.clear()

    async def _sender(self, stream: SyncStream) -> None:
        assert self._wake is not None
        while not self._stop.is_set():
            with self._lock:
                wanted, self._resync_wanted = self._resync_wanted, set()
            if wanted:
                await self._fetch_resync(stream, tuple(sorted(wanted)), requeue=True)
                continue
            with self._lock:
                out = None
                if self._outbound:
                    p = next(iter(self._outbound))
                    queue = self._outbound[p]
                    out = queue.pop(0)
                    if not queue:
                        del self._outbound[p]
                    self._unacked[out.sequence] = out
            if out is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            if out.payload is None:
                out.payload = await asyncio.to_thread(self._encode, out)
            frag = self.layout[out.fragment]
            self._transfer_id += 1
            chunks = encode_fragment(out.delta, frag, codec=self.codec, kind="contribution",
                                     version=out.base_version, transfer_id=self._transfer_id,
                                     layout_hash=self.layout.fingerprint, sequence=out.sequence, tokens=out.tokens,
                                     steps=out.steps, learner_step=out.learner_step, round=out.round,
                                     max_chunk_bytes=self.cfg.protocol.max_chunk_bytes, payload=out.payload)
            await stream.send_transfer(chunks)
            self.bytes_sent += len(out.payload)

    def _encode(self, out: Outgoing) -> bytes:
        if self.feedback is None:
            return self.codec.encode(out.delta)
        with self._lock:
            # an earlier answer for the same fragment and base, still unanswered, is superseded by
            # this one at the synchronizer (it holds that one's progress): start from its residual
            replaces = any(o.fragment == out.fragment and o.sequence < out.sequence and
                           o.base_version == out.base_version and o.payload is not None
                           for o in self._unacked.values())
        payload, _ = self.feedback.encode(out.fragment, out.delta, self.codec, replaces=replaces)
        return payload

    def _count_result(self, msg: wire.ContributionResult) -> None:
        """Settle an answered contribution; ``HEAL_AFTER`` refusals of one fragment's contributions
        for their content in a row (a merge in between starts the count over) ask training to heal it."""
        with self._lock:
            self._unacked.pop(msg.sequence, None)
            if msg.outcome == "rejected" and msg.reason not in RECOVERABLE:
                self._refused[msg.fragment_id] = self._refused.get(msg.fragment_id, 0) + 1
                if self._refused[msg.fragment_id] >= HEAL_AFTER:
                    self._heals.add(msg.fragment_id)
                    self._refused[msg.fragment_id] = 0
            elif msg.outcome == "merged":
                self._refused[msg.fragment_id] = 0

    async def _receiver(self, stream: SyncStream) -> None:
        while True:
            msg = await stream.receive()
            if isinstance(msg, Transfer):
                self.bytes_received += msg.header.encoded_bytes
                values = await asyncio.to_thread(decode_fragment, msg, self.layout)
                self._deliver(Arrival(msg.header.fragment_id, msg.header.version, values))
            elif isinstance(msg, wire.ContributionResult):
                self._count_result(msg)
                self.events.emit("result", sequence=msg.sequence, fragment=msg.fragment_id, outcome=msg.outcome,
                                 version=msg.version, reason=msg.reason, weight=msg.weight,
                                 staleness=msg.staleness, detail=msg.detail)
                if msg.outcome == "rejected" and self.feedback is not None:
                    self.feedback.reset(msg.fragment_id)
            elif isinstance(msg, wire.Resync):
                self.log.warning("resync requested", fragments=msg.fragment_ids, reason=msg.reason)
                await self._fetch_resync(stream, msg.fragment_ids)
            elif isinstance(msg, wire.Drain):
                self.log.info("drain requested", reason=msg.reason)
                self.draining.set()
            elif isinstance(msg, wire.FragmentRequest):
                with self._lock:
                    self._requests[msg.fragment_id] = max(msg.round, self._requests.get(msg.fragment_id, 0))

    async def _heartbeats(self, stream: SyncStream) -> None:
        assert self._beat is not None
        while True:
            s = self.stats
            self._beat.clear()
            await stream.send(wire.Heartbeat(step=s.step, tokens_total=s.tokens_total, tokens_per_s=s.tokens_per_s,
                                             step_time_s=s.step_time_s, sent_at_unix=time.time(),
                                             training_done=s.training_done))
            with contextlib.suppress(TimeoutError):  # every interval, or at once when training ends
                await asyncio.wait_for(self._beat.wait(), timeout=self._heartbeat_s)

    async def _stopper(self) -> None:
        assert self._wake is not None
        while not self._stop.is_set():
            await asyncio.sleep(0.1)


def _version() -> str:
    from ddiloco.core import __version__

    return __version__
