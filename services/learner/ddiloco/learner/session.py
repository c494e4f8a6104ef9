"""The communication thread's side: the only owner of the gRPC stream.

``Link.run`` is the thread's body. It runs its own asyncio loop: it connects, says Hello, joins
(genesis upload or FetchState), then runs a sender, a receiver and a heartbeat task until the
stream breaks (one session), and reconnects with exponential backoff and jitter (tenacity) while
training goes on. Contributions sent but not yet answered are sent again after a reconnect,
under the same sequence number; the synchronizer answers a duplicate of an already merged
contribution without merging it twice. Everything it exchanges with training goes through the
``Mailbox``.

**The fleet.** The links to every shard share a ``FleetView`` (what this learner knows of its
fleet: each shard's last Welcome, the fleet id of the shards holding state). Every Hello names that
fleet id and the versions of every fragment the learner holds or was told of
(``fleet_versions``), so a shard that lost its state can tell a learner that trained with the
fleet from a newcomer, and asks only the former to seed it again. Two rules follow:

- A link uploads a genesis only once every shard has answered it (until then a newcomer would not
  know that the fleet merged elsewhere, and a new fleet's shards would not agree on an id), and
  only under the fleet id its Hello named: the id of the shards holding state, else the one the
  lowest shard that answered was asked to record, else (nothing heard yet) this process's own
  fresh proposal; to a shard other than 0, only once shard 0 holds state, under its id. Otherwise
  it says Hello again: a new fleet's shards all record shard 0's id, whichever learners seed them.
- A joined link asked for a genesis (its synchronizer lost its state and it holds that shard's
  fragments) re-seeds it: with the newest global version of each fragment it received (or
  uploaded as its genesis), at that version, so the fleet goes on where it was. In thread mode
  those globals are the learner's own bases, so keeping them costs nothing (a genesis upload's
  values are kept beside the bases until the fragment's first merge). The communication process
  (``learner.comm: process``) keeps none: it re-seeds from the learner's current parameters at the
  versions held (its progress since those versions goes in with them), and only if it never read
  the genesis values before (it reads them once, and would upload the initialization kept from
  then); otherwise it declines, and another learner or the operator re-seeds.

A shard whose state names another fleet than the one the learner's other shards hold is refused
before the first join (the addresses mix two runs) and retried after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type

from ddiloco.core import events as schema
from ddiloco.core.logs import get_logger
from ddiloco.fragments.chunking import Chunk, Transfer
from ddiloco.fragments.codec import lend_or_encode, make_codec
from ddiloco.fragments.error_feedback import ErrorFeedback
from ddiloco.fragments.partition import FragmentLayout
from ddiloco.fragments.payload import decode_fragment, encode_fragment
from ddiloco.learner.config import LearnerConfig
from ddiloco.learner.events import EventLog
from ddiloco.learner.mailbox import Arrival, Mailbox, Outgoing
from ddiloco.protocol import wire
from ddiloco.protocol.client import StreamClosed, SyncStream, message_limit, open_channel

INLINE_VALUES = 1 << 16
"""Fragments of at most this many values (256 KB of fp32) are encoded and decoded on the link's
event loop itself; larger ones in a worker thread. A hop to a worker and back wakes two threads
(the worker, then the loop): for a 40 KB fragment that cost more CPU than its codec (about 60 us
each way for bf16_zstd), and the loop is held no longer than a heartbeat's write."""


async def off_loop(numel: int, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` for a fragment of ``numel`` values: at once when it is small
    (``INLINE_VALUES``), else in a worker thread so the event loop goes on meanwhile."""
    if numel <= INLINE_VALUES:
        return fn(*args, **kwargs)
    return await asyncio.to_thread(fn, *args, **kwargs)


class FleetView:
    """What one learner process knows of its fleet, shared by its links to every shard: each
    shard's last Welcome and the fleet id of the shards that hold state. Thread-safe (each link
    runs its own event loop)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._welcomes: dict[int, wire.Welcome] = {}
        self.candidate = "fleet-" + secrets.token_hex(8)
        """The id this learner proposes for a new fleet before any shard has answered it."""
        self.fleet_id = ""
        """The fleet of the shards holding state (from the first such Welcome); "" before one did."""
        self.source = -1
        """The shard ``fleet_id`` was first heard from."""
        self.own: dict[int, str] = {}
        """The fleet id each shard holds by its own word (a ready Welcome, or the genesis this
        learner uploaded to it): what a Hello to that shard names, so a shard restarted on its state
        always meets the id it recorded."""
        self.genesis_read = False
        """Whether a link of this process read ``genesis_values`` (the communication process's
        reads them once and returns those ever after: the initialization, not current values)."""

    def heard(self, shard: int, welcome: wire.Welcome) -> str | None:
        """Record ``shard``'s Welcome; when it holds state of another fleet than the one adopted,
        the id it names (the Welcome is not recorded then)."""
        with self._lock:
            if welcome.state == "ready" and welcome.fleet_id:
                if not self.fleet_id:
                    self.fleet_id, self.source = welcome.fleet_id, shard
                elif welcome.fleet_id != self.fleet_id and welcome.fleet_id != self.own.get(shard):
                    return welcome.fleet_id
                self.own[shard] = welcome.fleet_id
            self._welcomes[shard] = welcome
            return None

    def complete(self, shards: int) -> bool:
        """Whether every one of ``shards`` shards has answered."""
        with self._lock:
            return all(s in self._welcomes for s in range(shards))

    def proposal(self) -> str:
        """The fleet id this learner names: its fleet's; before any shard holds state, the one the
        lowest shard that answered will record; before any answered, its own candidate ("" once
        only synchronizers older than fleet ids answered)."""
        with self._lock:
            if self.fleet_id:
                return self.fleet_id
            if not self._welcomes:
                return self.candidate
            return next((self._welcomes[s].fleet_id for s in sorted(self._welcomes) if self._welcomes[s].fleet_id), "")

    def versions(self, held: dict[int, int]) -> dict[int, int]:
        """The newest version of every fragment the learner holds (``held``) or was told of by a
        Welcome of its fleet."""
        out = dict(held)
        with self._lock:
            for w in self._welcomes.values():
                if w.state == "ready" and w.fleet_id == self.fleet_id:
                    for p, v in w.versions.items():
                        out[p] = max(out.get(p, v), v)
        return out


@dataclass
class LiveStats:
    step: int = 0
    tokens_total: int = 0
    tokens_per_s: float = 0.0
    step_time_s: float = 0.0
    """Recent wall time per inner step (what paces the fleet's clock)."""
    training_done: bool = False
    fleet: FleetView = field(default_factory=FleetView)
    """What the learner knows of its fleet: every lane's link shares this object (so this view)."""


@dataclass
class JoinState:
    """What the training thread needs from the first successful join."""

    ready: threading.Event = field(default_factory=threading.Event)
    genesis: bool = False
    fleet_step: int = 0
    fetched: dict[int, tuple[int, torch.Tensor]] = field(default_factory=dict)
    error: str | None = None


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


class Link:
    """The learner's link to the synchronizer: one session after another until ``stop`` is set."""

    def __init__(self, cfg: LearnerConfig, *, mailbox: Mailbox, stop: threading.Event, layout: FragmentLayout,
                 model_fingerprint: str, incarnation: int, events: EventLog, held: Callable[[], dict[int, int]],
                 genesis_values: Callable[[], dict[int, torch.Tensor]],
                 labels: dict[str, str] | None = None, target: str | None = None, shard: int = 0, shards: int = 1,
                 fragments: tuple[int, ...] | None = None, stats: LiveStats | None = None,
                 draining: threading.Event | None = None) -> None:
        self.cfg = cfg
        self.target = target or cfg.targets[0]
        """The address of this link's synchronizer (shard ``shard`` of ``shards``)."""
        self.shard, self.shards = shard, shards
        self.fragments = tuple(f.index for f in layout) if fragments is None else fragments
        """The fragments this shard owns: the only ones this link uploads, holds and sends."""
        self.mailbox = mailbox
        self.stop = stop
        self.labels = dict(labels or {})
        """Sent in every Hello (the synchronizer shows them in its status; ``model`` names the model)."""
        self.layout = layout
        self.model_fingerprint = model_fingerprint
        self.incarnation = incarnation
        self.events = events
        self.held = held
        self.genesis_values = genesis_values
        self.learner_id = cfg.resolved_id
        self.log = get_logger("ddiloco.learner.comm", learner_id=self.learner_id,
                              **({"shard": f"{shard}/{shards}"} if shards > 1 else {}))
        self.codec = make_codec(cfg.codec, zstd_level=cfg.zstd_level, threads=cfg.codec_threads)
        self.feedback = ErrorFeedback() if cfg.error_feedback and not self.codec.lossless else None
        self.stats = stats if stats is not None else LiveStats()
        self.join = JoinState()
        self.joined = False
        self.synchronizer_id = ""
        self.draining = draining if draining is not None else threading.Event()
        self.connected = threading.Event()
        self.goodbye = "stopping"
        """The reason sent in the Goodbye when ``stop`` ends the session."""
        self.bytes_sent = 0
        self.bytes_received = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._beat: asyncio.Event | None = None
        self._transfer_id = 0
        self._heartbeat_s = cfg.heartbeat_s
        self._backoff = ReconnectBackoff(max_s=cfg.reconnect_max_s)
        self.fleet = self.stats.fleet
        self._layout = tuple(f.tensors for f in layout) if shards > 1 else ()
        """The whole layout, sent in a sharded learner's Hello (a shard checks a genesis with it)."""
        self._globals: dict[int, tuple[int, torch.Tensor]] | None = {} if cfg.comm != "process" else None
        """This shard's fragments: the newest global received (or uploaded as genesis) of each
        (version, values), what a re-seed uploads. Thread mode only: the values are the learner's
        own bases, kept at no cost."""
        self._waiting = ""

    # -- from the training thread ---------------------------------------------------------

    def poke(self) -> None:
        """Wake the sender (something to send or fetch, or ``stop``)."""
        self._set_soon(self._wake)

    def beat_now(self) -> None:
        """Send a heartbeat now rather than at the next interval (the pace became known, training ended)."""
        self._set_soon(self._beat)

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on this link's event loop (everything the link does waits while it runs)."""
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop already closed
                loop.call_soon_threadsafe(fn)

    def _set_soon(self, event: asyncio.Event | None) -> None:
        if event is not None:
            self.call_soon(event.set)

    # -- the thread -----------------------------------------------------------------------

    def run(self) -> None:
        """The communication thread's body."""
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
                    if self.stop.is_set():
                        return
                    await self._session()
                    if self.stop.is_set():
                        return
                    raise _Reconnect("stream ended")
        except Exception:
            if not self.stop.is_set():
                raise

    async def _session(self) -> None:
        cfg = self.cfg
        creds = cfg.credentials
        channel = open_channel(self.target, max_message_bytes=message_limit(cfg.protocol.max_chunk_bytes),
                               credentials=creds)
        stream = SyncStream(channel, max_chunk_bytes=cfg.protocol.max_chunk_bytes, token=creds.token)
        tasks: list[asyncio.Task[Any]] = []
        try:
            welcome = await stream.open(self._hello())
            self._check_shard(welcome)
            self._check_fleet(welcome)
            if welcome.state == "reseed_wait":
                if welcome.detail != self._waiting:
                    self.log.warning("the synchronizer lost its state and waits for a learner that can re-seed it",
                                     detail=welcome.detail, fleet_id=welcome.fleet_id)
                self._waiting = welcome.detail
                raise _Reconnect(f"waiting for a re-seed: {welcome.detail}")
            if welcome.state == "genesis_pending":
                raise _Reconnect("genesis pending at the synchronizer")
            self._waiting = ""
            restarted = bool(self.synchronizer_id) and welcome.synchronizer_id != self.synchronizer_id
            self.synchronizer_id = welcome.synchronizer_id
            self._heartbeat_s = welcome.heartbeat_interval_s or cfg.heartbeat_s
            await self._join(stream, welcome)
            self.connected.set()
            self._backoff.connected()
            self.events.emit(schema.CONNECT, synchronizer_id=welcome.synchronizer_id, state=welcome.state,
                             restarted=restarted, **self._shard_field())
            self.mailbox.requeue_unacked()
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
                self.stop.set()
            raise
        finally:
            self.connected.clear()
            if self.stop.is_set():
                # Say goodbye before cancelling the tasks: grpc cancels the whole call when a task
                # is cancelled in the middle of a write, and the goodbye would never arrive.
                await stream.close(self.goodbye)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await stream.close()
            await channel.close()
            if tasks:
                self.events.emit(schema.DISCONNECT, synchronizer_id=self.synchronizer_id, **self._shard_field())

    def _shard_field(self) -> dict[str, str]:
        """The events' ``synchronizer_shard``, when the synchronizer is sharded."""
        return {"synchronizer_shard": f"{self.shard}/{self.shards}"} if self.shards > 1 else {}

    def _check_shard(self, welcome: wire.Welcome) -> None:
        """The synchronizer at this address must be the shard this link expects: another shard (or
        an unsharded synchronizer) holds other fragments, and streaming ours to it would be refused
        fragment by fragment. Before the first join it is a refusal (the addresses are wrong);
        after, a retry (a shard being replaced)."""
        theirs = (welcome.shard_index, max(1, welcome.shard_count))
        if theirs == (self.shard, self.shards):
            return
        why = (f"the synchronizer at {self.target} serves shard {theirs[0]}/{theirs[1]}, this learner expects shard "
               f"{self.shard}/{self.shards} there (learner.synchronizer lists shards in order; "
               "learner.synchronizer_shards must equal the synchronizers' shard count)")
        if not self.joined:
            self.join.error = why
            self.join.ready.set()
            self.stop.set()
        raise _Reconnect(why)

    def _check_fleet(self, welcome: wire.Welcome) -> None:
        """A shard holding state must be of the fleet the learner's other shards hold: before the
        first join, another fleet's shard is a refusal (the addresses mix two runs); after, a retry."""
        theirs = self.fleet.heard(self.shard, welcome)
        if theirs is None:
            return
        why = (f"the synchronizer at {self.target} (shard {self.shard}/{self.shards}) holds the state of fleet "
               f"{theirs}, shard {self.fleet.source} of fleet {self.fleet.fleet_id}: the addresses name shards of "
               "two runs")
        if not self.joined:
            self.join.error = why
            self.join.ready.set()
            self.stop.set()
        raise _Reconnect(why)

    def _hello(self) -> wire.Hello:
        held = self.held() if self.joined else {}
        known = dict(held)
        for p, (v, _) in (self._globals or {}).items():
            known[p] = max(known.get(p, v), v)
        return wire.Hello(
            learner_id=self.learner_id, model_fingerprint=self.model_fingerprint,
            layout_hash=self.layout.fingerprint, protocol=wire.ProtocolParams.from_config(self.cfg.protocol),
            held={p: v for p, v in held.items() if p in self.fragments}, incarnation=self.incarnation,
            software_version=_version(), labels={**self.labels, "pid": str(os.getpid())},
            fleet_id=self._fleet_named(held), fleet_versions=self.fleet.versions(known), layout=self._layout)

    def _fleet_named(self, held: dict[int, int]) -> str:
        """The fleet id this Hello names: the one this shard holds by its own word, where known.
        A learner that holds merged versions but has heard no fleet id in this process (its
        communication process was started again) does not know its fleet: it names none rather
        than a fresh proposal, which a synchronizer holding state would take for another fleet's
        learner and refuse."""
        own = self.fleet.own.get(self.shard) or (self.fleet.own.get(0) if self.shards > 1 else None)
        if own:  # this shard's own word, else shard 0's: the id a new fleet's shards are seeded under
            return own
        if not self.fleet.fleet_id and any(v > 0 for v in held.values()):
            return ""
        return self.fleet.proposal()

    def _keep(self, fragment: int, version: int, values: torch.Tensor, *, resync: bool = False) -> None:
        """Remember the newest global of one of this shard's fragments (a resync's, whatever its version)."""
        if self._globals is None or fragment not in self.fragments:
            return
        kept = self._globals.get(fragment)
        if resync or kept is None or version >= kept[0]:
            self._globals[fragment] = (version, values)

    async def _join(self, stream: SyncStream, welcome: wire.Welcome) -> None:
        if welcome.state == "genesis_requested":
            if self.shards > 1 and not self.fleet.complete(self.shards):
                raise _Reconnect("genesis requested: waiting for every shard's Welcome first (the fleet's id and "
                                 "versions)")
            named = self.fleet.proposal()
            if self.shards > 1 and self.shard > 0 and not self.joined:
                # A new fleet's id is the one shard 0 records: the other shards are seeded under it
                # once it holds state (by its own word: its ready Welcome, or this learner's upload
                # to it). Named from every shard's last Welcome instead, a learner whose own request
                # to shard 0 had lapsed (another learner took it over) seeded shard 1 under its own
                # id and shard 0 under the other's: one fleet, two ids.
                first = self.fleet.own.get(0)
                if not first:
                    raise _Reconnect("genesis requested: waiting for shard 0 to hold state first (the fleet's id)")
                named = first
            if welcome.fleet_id != named:
                raise _Reconnect(f"genesis requested under fleet {welcome.fleet_id!r}, this learner's fleet is "
                                 f"{named!r}: saying Hello again")
            if self.joined:
                await self._reseed(stream, welcome)
                return
            self.fleet.genesis_read = True
            values = self.genesis_values()
            for p in self.fragments:
                self._keep(p, 0, values[p])
                frag = self.layout[p]
                self._transfer_id += 1
                chunks = await off_loop(
                    frag.numel, encode_fragment, values[frag.index], frag, codec=make_codec("fp32"), kind="genesis",
                    version=0,
                    transfer_id=self._transfer_id, layout_hash=self.layout.fingerprint,
                    max_chunk_bytes=self.cfg.protocol.max_chunk_bytes, frame=wire.frame_chunks)
                await stream.send_transfer(chunks)
            self.fleet.own[self.shard] = welcome.fleet_id
            self.joined = True
            self.join.genesis = True
            self.join.ready.set()
            self.log.info("genesis uploaded", fragments=len(self.fragments))
            return
        if not self.joined:
            self.join.fleet_step = welcome.fleet_step
            fetched = await self._fetch(stream, ())
            self.join.fetched = {p: (a.version, a.values) for p, a in fetched.items()}
            for p, a in fetched.items():
                self._keep(p, a.version, a.values)
            self.joined = True
            self.join.ready.set()
            self.log.info("state fetched", versions={p: v for p, (v, _) in self.join.fetched.items()})
            return
        held = self.held()
        behind = tuple(p for p, v in welcome.versions.items() if v > held.get(p, -1))
        if behind:  # broadcasts missed while disconnected
            await self._fetch_deliver(stream, behind)

    async def _reseed(self, stream: SyncStream, welcome: wire.Welcome) -> None:
        """The synchronizer lost its state and asks this learner, which holds its fragments, to seed
        it again: the newest global of each fragment, at its version (in the communication process,
        which keeps none: the current parameters, at the versions held)."""
        kept = self._globals or {}
        if not all(p in kept for p in self.fragments) and self.fleet.genesis_read:
            raise _Reconnect("the synchronizer lost its state and asks this learner to re-seed it; this communication "
                             "process read the genesis values already and would upload the initialization: declining")
        current: dict[int, torch.Tensor] = {}
        if not all(p in kept for p in self.fragments):
            self.fleet.genesis_read = True
            current = self.genesis_values()
        # after the values: the communication process's held versions are written where it reads
        # them at the training side's next boundary, the one that answers for the values
        held = self.held()
        versions = {}
        for p in self.fragments:
            frag = self.layout[p]
            version, values = kept[p] if p in kept else (held.get(p, 0), current[p])
            versions[p] = version
            self._transfer_id += 1
            chunks = await off_loop(
                frag.numel, encode_fragment, values, frag, codec=make_codec("fp32"), kind="genesis", version=version,
                transfer_id=self._transfer_id, layout_hash=self.layout.fingerprint,
                max_chunk_bytes=self.cfg.protocol.max_chunk_bytes, frame=wire.frame_chunks)
            await stream.send_transfer(chunks)
        self.fleet.own[self.shard] = welcome.fleet_id
        self.log.warning("re-seeded a synchronizer that lost its state", fleet_id=welcome.fleet_id, versions=versions,
                         synchronizer_id=welcome.synchronizer_id)

    async def _fetch(self, stream: SyncStream, fragments: tuple[int, ...], resync: bool = False) -> dict[int, Arrival]:
        transfers = await stream.fetch_state(self.learner_id, fragments)
        out = {}
        for t in transfers:
            values = await off_loop(t.header.num_values, decode_fragment, t, self.layout)
            out[t.header.fragment_id] = Arrival(t.header.fragment_id, t.header.version, values, resync)
            self.bytes_received += t.header.encoded_bytes
        return out

    async def _fetch_deliver(self, stream: SyncStream, fragments: tuple[int, ...], *, resync: bool = False,
                             requeue: bool = False) -> None:
        """Fetch the newest global version of ``fragments`` and deliver each. ``resync``: as a resync
        arrival (applied as overwrite), with its error-feedback residual dropped. ``requeue``: if the
        fetch fails, the fragments are wanted again, to be fetched on the next session."""
        try:
            fetched = await self._fetch(stream, fragments, resync=resync)
        except BaseException:
            if requeue:
                self.mailbox.want_resync(fragments)
            raise
        for a in fetched.values():
            self._keep(a.fragment, a.version, a.values, resync=resync)
            self.mailbox.deliver(a)
            if resync and self.feedback is not None:
                self.feedback.reset(a.fragment)

    async def _sender(self, stream: SyncStream) -> None:
        assert self._wake is not None
        while not self.stop.is_set():
            wanted = self.mailbox.take_resync_wanted()
            if wanted:
                await self._fetch_deliver(stream, tuple(sorted(wanted)), resync=True, requeue=True)
                continue
            out = self.mailbox.next_outgoing()
            if out is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            self._transfer_id += 1
            # the codec (off the event loop for a large fragment), and the digest unless the
            # synchronizer reads it from the last chunk; each chunk is hashed then (just before it
            # is written) and copied into its wire message as it is written, so the copy of the
            # next one overlaps the transport's sending of this one
            chunks = await off_loop(out.delta.numel(), self._chunks, out, self._transfer_id, stream.peer_trailing_digest)
            await stream.send_transfer(chunks)
            self.bytes_sent += len(out.payload or b"")

    def _chunks(self, out: Outgoing, transfer_id: int, trailing_digest: bool = False) -> list[Chunk]:
        """``out`` encoded (once: a resend keeps its payload) and cut into chunks, views of the
        payload, each framed when it is written (``send_transfer``); ``trailing_digest`` (the
        synchronizer reads one): hashed as they are written, the digest on the last chunk."""
        if out.payload is None:
            out.payload = self._encode(out)
        return encode_fragment(
            out.delta, self.layout[out.fragment], codec=self.codec, kind="contribution", version=out.base_version,
            transfer_id=transfer_id, layout_hash=self.layout.fingerprint, sequence=out.sequence, tokens=out.tokens,
            steps=out.steps, learner_step=out.learner_step, round=out.round, hand_over=out.hand_over,
            max_chunk_bytes=self.cfg.protocol.max_chunk_bytes, payload=out.payload, trailing_digest=trailing_digest)

    def _encode(self, out: Outgoing) -> bytes | memoryview:
        if self.feedback is None:  # fp32 values lend their memory: each byte is copied once, as written
            return lend_or_encode(self.codec, out.delta)
        # an earlier answer for the same fragment and base, still unanswered, is superseded by
        # this one at the synchronizer (it holds that one's progress): start from its residual
        replaces = self.mailbox.replaces(out)
        payload, _ = self.feedback.encode(out.fragment, out.delta, self.codec, replaces=replaces)
        return payload

    async def _receiver(self, stream: SyncStream) -> None:
        while True:
            msg = await stream.receive()
            if isinstance(msg, Transfer):
                self.bytes_received += msg.header.encoded_bytes
                values = await off_loop(msg.header.num_values, decode_fragment, msg, self.layout)
                self._keep(msg.header.fragment_id, msg.header.version, values)
                self.mailbox.deliver(Arrival(msg.header.fragment_id, msg.header.version, values))
            elif isinstance(msg, wire.ContributionResult):
                self.mailbox.settle(msg)
                self.events.emit(schema.RESULT, sequence=msg.sequence, fragment=msg.fragment_id, outcome=msg.outcome,
                                 version=msg.version, reason=msg.reason, weight=msg.weight,
                                 staleness=msg.staleness, detail=msg.detail)
                if msg.outcome == "rejected" and self.feedback is not None:
                    self.feedback.reset(msg.fragment_id)
            elif isinstance(msg, wire.Resync):
                self.log.warning("resync requested", fragments=msg.fragment_ids, reason=msg.reason)
                await self._fetch_deliver(stream, msg.fragment_ids, resync=True)
            elif isinstance(msg, wire.Drain):
                self.log.info("drain requested", reason=msg.reason)
                self.draining.set()
            elif isinstance(msg, wire.FragmentRequest):
                self.mailbox.add_request(msg.fragment_id, msg.round)

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
        while not self.stop.is_set():
            await asyncio.sleep(0.1)


def _version() -> str:
    from ddiloco.core import __version__

    return __version__
