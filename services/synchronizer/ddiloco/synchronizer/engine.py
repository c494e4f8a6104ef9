"""The synchronizer's state machine, independent of gRPC: who is connected, what the global model
is, and where each message goes.

The gRPC layer (``server``) turns streams into calls here: ``hello``, ``receive``, ``heartbeat``,
``detach``, ``fetch`` and ``status``. The engine wires the parts and owns nothing else:

- ``recovery`` loads existing state at start-up, ``genesis`` makes the first state otherwise;
- ``admission`` decides what may enter (Hello checks, every contribution check);
- the fleet's clock (``ddiloco.algorithm.fleet_clock``), counted here at the pace of the K-th
  fastest live learner, says when each fragment falls due; its round then asks every live
  learner for it;
- one ``rounds.FragmentRound`` per owned fragment merges, commits (``store``) and hands the new
  version to the ``publisher`` (encoded once, cached for fetches, queued to every outbox of
  ``broadcast``), deciding with the pure round state machine of ``ddiloco.algorithm.round`` at the
  fleet's ``pace``;
- ``ledger`` answers and counts every contribution's outcome, ``membership`` tracks liveness.

The engine is where these parts are built and handed to each other; a round sees them through
``rounds.RoundContext``, never the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import statistics
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from ddiloco.algorithm.claim_guard import ClaimGuard
from ddiloco.algorithm.fleet_clock import FleetClock, fleet_pace
from ddiloco.algorithm.norm_guard import NormGuard
from ddiloco.algorithm.outer_optimizer import OuterNesterov
from ddiloco.algorithm.round import RejoinHold, RoundRules, StartHold
from ddiloco.algorithm.weight_guard import WeightGuard
from ddiloco.core import events as schema
from ddiloco.core.config import to_dict
from ddiloco.core.logs import get_logger
from ddiloco.core.modes import preset
from ddiloco.fragments.chunking import Transfer
from ddiloco.fragments.codec import make_codec
from ddiloco.fragments.schedule import FragmentSchedule
from ddiloco.protocol.wire import (
    FragmentStatus,
    Heartbeat,
    Hello,
    LearnerStatus,
    ProtocolParams,
    Resync,
    StatusReply,
    Welcome,
)
from ddiloco.synchronizer.admission import Admission, Refused, check_hello, contribution_of
from ddiloco.synchronizer.broadcast import GlobalTransfer
from ddiloco.synchronizer.config import SynchronizerConfig
from ddiloco.synchronizer.genesis import Genesis
from ddiloco.synchronizer.global_fragment import GlobalFragment
from ddiloco.synchronizer.inbox import Contribution
from ddiloco.synchronizer.ledger import Ledger
from ddiloco.synchronizer.membership import LearnerRecord, Membership
from ddiloco.synchronizer.metrics import SynchronizerMetrics
from ddiloco.synchronizer.pace import Pace
from ddiloco.synchronizer.publisher import Publisher
from ddiloco.synchronizer.recovery import LoadedState, load_state
from ddiloco.synchronizer.rounds import FragmentRound, MergeSettings, RoundContext
from ddiloco.synchronizer.store import StateStore

R = TypeVar("R")

MIN_STEP_TIME_S, MAX_STEP_TIME_S = 1e-4, 3600.0
"""Step times a heartbeat may report and still pace the fleet's clock (others are ignored, so one
learner cannot make the clock open rounds without end, nor stop it)."""

__all__ = ["Engine", "Refused"]


class Engine:
    def __init__(self, cfg: SynchronizerConfig, *, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, metrics: SynchronizerMetrics | None = None) -> None:
        self.cfg = cfg
        self.clock, self.wall = clock, wall
        self.metrics = metrics or SynchronizerMetrics()
        self.synchronizer_id = f"sync-{uuid.uuid4().hex[:12]}"
        self.log = get_logger("ddiloco.synchronizer", synchronizer_id=self.synchronizer_id)
        self.store = StateStore(cfg.state_dir, keep_versions=cfg.staleness_window + 1)
        self.membership = Membership(heartbeat_timeout_s=cfg.heartbeat_timeout_s,
                                     max_control=cfg.send_queue_messages, max_learners=cfg.max_learners)
        self.pool = ThreadPoolExecutor(cfg.merge_threads, thread_name_prefix="ddiloco-merge")
        self.publisher = Publisher(codec=make_codec(cfg.protocol.global_codec, threads=cfg.codec_threads),
                                   max_chunk_bytes=cfg.protocol.max_chunk_bytes, membership=self.membership,
                                   metrics=self.metrics, run_blocking=self.run_blocking)
        self.pace = Pace()
        self.owned = [p for p in range(cfg.protocol.num_fragments) if cfg.owns(p)]
        self.metrics.watch_learners(
            lambda: [(lid, self.membership.is_live(r, self.clock())) for lid, r in list(self.membership.learners.items())])
        self.ledger = Ledger(membership=self.membership, metrics=self.metrics, log=self.log,
                             event_log=cfg.event_log, wall=wall)
        self.claims = ClaimGuard(cfg.claim_guard, period_steps=cfg.protocol.sync_every)
        self.admission = Admission(ledger=self.ledger, staleness_window=cfg.staleness_window,
                                   shard=f"{cfg.shard_index}/{cfg.shard_count} (P={cfg.protocol.num_fragments})",
                                   run_blocking=self.run_blocking, codec_threads=cfg.codec_threads,
                                   norm_guard=NormGuard(cfg.norm_guard), on_clip=self._clipped,
                                   weight_guard=WeightGuard(cfg.weight_guard),
                                   claim_guard=self.claims,
                                   on_bound=self._bounded, fleet_rate=self._fleet_rate, wall=wall)
        self.genesis = Genesis(store=self.store, ledger=self.ledger, num_fragments=cfg.protocol.num_fragments,
                               owned=self.owned, shard=(cfg.shard_index, cfg.shard_count),
                               protocol=to_dict(self.protocol_params()), history=cfg.staleness_window,
                               run_blocking=self.run_blocking, codec_threads=cfg.codec_threads, wall=wall)
        self.state: LoadedState | None = None
        self.rounds: dict[int, FragmentRound] = {}
        self.rejoin = RejoinHold()
        self.start_hold = StartHold(cfg.start_learners, cfg.start_window_s)
        """A new fleet's first merges wait for ``start_learners`` (none after a restart on state)."""
        p = cfg.protocol
        self.fleet = FleetClock(FragmentSchedule(num_fragments=p.num_fragments, sync_every=p.sync_every,
                                                 overlap=p.overlap), now=clock())
        self._clock_task: asyncio.Task[None] | None = None
        self._clock_event: asyncio.Event | None = None
        self.closing = False
        self.started_at = clock()
        self.ledger.event({"event": schema.SYNC_START, "synchronizer_id": self.synchronizer_id})

    # -- lifecycle ------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.state is not None

    @property
    def fragments(self) -> dict[int, GlobalFragment]:
        return self.state.fragments if self.state is not None else {}

    @property
    def largest_fragment(self) -> int | None:
        """Values in the largest fragment of the global state (None before it exists)."""
        return max(f.numel for f in self.state.layout.fragments) if self.state is not None else None

    def load(self) -> bool:
        """Load state from the state dir; False if it holds none yet."""
        state = load_state(self.store, protocol=to_dict(self.protocol_params()), owned=self.owned,
                           history=self.cfg.staleness_window)
        if state is None:
            return False
        self._install(state)
        self.claims.restore(state.paces)
        self.start_hold = StartHold()  # a fleet that merged before assembled once already
        if state.last_contributors and self.cfg.rejoin_window_s > 0:
            self.rejoin = RejoinHold(state.last_contributors, self.clock() + self.cfg.rejoin_window_s)
        self.log.info("state loaded", state_dir=str(self.store.root),
                      versions={p: f.version for p, f in state.fragments.items()},
                      rejoin_expected=sorted(self.rejoin.expected), rejoin_window_s=self.cfg.rejoin_window_s)
        return True

    def _install(self, state: LoadedState) -> None:
        self.state = state
        self.publisher.layout_hash = state.layout_hash
        for p, frag in state.fragments.items():  # every version is committed before it is current
            frag.keep_on_disk(functools.partial(self.store.read_params, p, num_values=frag.spec.numel))
        self.ledger.merges_total = state.merges
        for p, frag in state.fragments.items():
            self.metrics.version.labels(str(p)).set(frag.version)

    def start(self) -> None:
        cfg = self.cfg
        learner_clocked = preset(cfg.protocol.mode).learners_wait
        rules = RoundRules(policy=cfg.policy, overlap=cfg.protocol.overlap, learner_clocked=learner_clocked)
        settings = MergeSettings(method=cfg.merge_method, embedding_patterns=cfg.embedding_patterns,
                                 stale_anchor=cfg.stale_anchor, staleness_window=cfg.staleness_window,
                                 scale_by_participation=cfg.scale_by_participation,
                                 hand_over_momentum=cfg.hand_over_momentum,
                                 outer=OuterNesterov(lr=cfg.outer_lr, momentum=cfg.outer_momentum,
                                                     momentum_warmup=cfg.outer_momentum_warmup))
        ctx = RoundContext(clock=self.clock, wall=self.wall, learners=self.membership, pace=self.pace,
                           run_blocking=self.run_blocking, store=self.store, publisher=self.publisher,
                           ledger=self.ledger, rejoin=self.rejoin, start=self.start_hold,
                           max_wait_s=cfg.heartbeat_interval_s,
                           asked=self.claims.asked, paces=self.claims.paces)
        for frag in self.fragments.values():
            r = FragmentRound(frag, rules=rules, merge=settings, ctx=ctx, log=self.log)
            self.rounds[frag.spec.index] = r
            if self.closing:  # state committed while shutting down: the round never decides
                r.close()
            r.start()
        if not learner_clocked:
            self._clock_event = asyncio.Event()
            self._clock_task = asyncio.create_task(self._run_clock(), name="fleet-clock")

    async def _run_clock(self) -> None:
        """Count the fleet's steps and open each fragment's round when it falls due."""
        assert self._clock_event is not None
        while not self.closing:
            now = self.clock()
            self.fleet.set_pace(now, fleet_pace((r.step_time_s for r in self.membership.live_records(now)),
                                                self.cfg.policy.quorum))
            for p, round_no in self.fleet.due(now):
                if p in self.rounds:
                    self.rounds[p].request(now, round_no)
            wake = self.fleet.next_due_at(now)
            timeout = self.cfg.heartbeat_interval_s if wake is None else min(self.cfg.heartbeat_interval_s,
                                                                              max(0.0, wake - now))
            self._clock_event.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._clock_event.wait(), timeout=timeout)

    async def stop(self) -> None:
        """Finish any merge/commit in progress, then stop the rounds."""
        self.closing = True
        for r in self.rounds.values():
            r.close()
        deadline = self.clock() + 30.0
        while any(r.merging for r in self.rounds.values()) and self.clock() < deadline:
            await asyncio.sleep(0.01)
        tasks = [r.task for r in self.rounds.values() if r.task is not None]
        if self._clock_task is not None:
            tasks.append(self._clock_task)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for rec in self.membership.learners.values():
            rec.closing.set()
            rec.outbox.wake()
        self.pool.shutdown(wait=True)
        self.ledger.close()
        self.store.close()  # the state dir's lock: another synchronizer may take it from now on

    async def run_blocking(self, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        return await asyncio.get_running_loop().run_in_executor(self.pool, functools.partial(fn, *args, **kwargs))

    def protocol_params(self) -> ProtocolParams:
        return ProtocolParams.from_config(self.cfg.protocol)

    # -- sessions -------------------------------------------------------------------------

    def hello(self, hello: Hello) -> tuple[LearnerRecord, Welcome]:
        """Admit a learner's stream, or raise Refused. Without state, ``genesis`` decides who seeds
        it (and refuses a learner that cannot seed a lost state: ``reseed_wait``)."""
        mine = self.protocol_params()
        check_hello(hello, mine, self.state)
        if self.state is not None and hello.held and hello.fleet_id and hello.fleet_id != self.state.fleet_id:
            # a learner holding another fleet's versions (one that holds none only proposes an id)
            raise Refused("FAILED_PRECONDITION", "fleet_mismatch",
                          f"this synchronizer (shard {self.cfg.shard_index}/{self.cfg.shard_count}) holds the state of "
                          f"fleet {self.state.fleet_id}, the learner holds versions of fleet {hello.fleet_id}: a "
                          "shard or a learner of another run")
        if self.state is None:
            self.genesis.check(hello)
        now = self.clock()
        try:
            rec = self.membership.attach(hello.learner_id, now, hello.incarnation, hello.labels)
        except OverflowError as exc:
            raise Refused("RESOURCE_EXHAUSTED", "protocol", str(exc)) from exc
        rec.held = dict(hello.held)
        detail = ""
        if self.state is not None:
            state, fleet_id = "ready", self.state.fleet_id
            ahead = [p for p, v in hello.held.items() if p in self.fragments and v > self.fragments[p].version]
            if ahead:
                rec.outbox.put_control(Resync(fragment_ids=tuple(ahead), reason="future_version",
                                              detail="you hold versions newer than the synchronizer's"))
        else:
            state, detail = self.genesis.on_hello(hello, rec, self.membership, operator_reseed=self.cfg.reseed)
            fleet_id = self.genesis.welcome_fleet(state, hello)
        self.metrics.connected_learners.set(len(self.membership.connected()))
        self._poke_all()
        self.log.info("learner connected", learner_id=hello.learner_id, state=state,
                      incarnation=hello.incarnation, labels=hello.labels, fleet_id=fleet_id)
        welcome = Welcome(synchronizer_id=self.synchronizer_id, protocol=mine, state=state,
                          versions={p: f.version for p, f in self.fragments.items()},
                          heartbeat_interval_s=self.cfg.heartbeat_interval_s,
                          shard_index=self.cfg.shard_index, shard_count=self.cfg.shard_count,
                          fleet_step=int(self.fleet.steps), fleet_id=fleet_id, detail=detail)
        return rec, welcome

    def touch(self, rec: LearnerRecord) -> None:
        rec.last_seen = self.clock()

    def heartbeat(self, rec: LearnerRecord, hb: Heartbeat) -> None:
        rec.last_seen = rec.heartbeat_at = self.clock()
        rec.step, rec.tokens_total, rec.tokens_per_s = hb.step, hb.tokens_total, hb.tokens_per_s
        done_changed = hb.training_done != rec.training_done
        rec.training_done = hb.training_done
        if not MIN_STEP_TIME_S <= hb.step_time_s <= MAX_STEP_TIME_S:
            if hb.step_time_s != 0:  # 0: not measured yet
                self.metrics.limit_refusals.labels(limit="step_time").inc()
        elif not hb.training_done:
            rec.step_time_s = hb.step_time_s
            self.pace.stepped(hb.step_time_s)
            if self._clock_event is not None:  # the fleet's pace may have changed
                self._clock_event.set()
        if done_changed:  # liveness changed: every round decides again
            self._poke_all()

    def detach(self, rec: LearnerRecord, stream_id: int, reason: str) -> None:
        if self.membership.detach(rec, stream_id):
            rec.left = reason
            self.metrics.connected_learners.set(len(self.membership.connected()))
            self.log.info("learner disconnected", learner_id=rec.learner_id, reason=reason)
            self._poke_all()

    def _poke_all(self) -> None:
        """Liveness or a pace changed: every round and the clock decide again."""
        self.metrics.live_learners.set(len(self.membership.live(self.clock())))
        for r in self.rounds.values():
            r.poke()
        if self._clock_event is not None:
            self._clock_event.set()

    # -- contributions --------------------------------------------------------------------

    async def receive(self, rec: LearnerRecord, transfer: Transfer) -> None:
        """Handle one complete transfer from a learner. Bad content is rejected with a result."""
        c = contribution_of(rec, transfer)
        if transfer.header.kind == "genesis":
            if self.ready:
                self.ledger.reject(c, "protocol", "global state exists already; genesis refused")
                return
            state = await self.genesis.receive(rec, transfer, c)
            if state is not None:
                self._install(state)
                self.start()
                self.log.info("genesis committed", learner_id=rec.learner_id, fragments=len(state.fragments),
                              layout_hash=state.layout_hash, model_fingerprint=state.model_fingerprint)
            return
        admitted = await self.admission.admit(rec, transfer, c, self.state)
        if admitted is None:
            return
        c, delta = admitted
        replaced = self.rounds[c.fragment].add(c, delta)
        if replaced is not None:
            self.ledger.superseded(rec, replaced, by=c.sequence)

    def _clipped(self, c: Contribution, detail: str) -> None:
        self.metrics.norm_clipped.inc()
        self.log.warning("contribution clipped by the norm guard", learner_id=c.learner_id,
                         fragment=c.fragment, sequence=c.sequence, detail=detail)
        self.ledger.event({"event": schema.NORM_CLIP, "learner_id": c.learner_id, "fragment": c.fragment,
                           "sequence": c.sequence, "detail": detail})

    def _fleet_rate(self) -> float | None:
        """Steps per second at the median step time the live learners report (None: none reported).
        The median, so one learner reporting a tiny step time cannot raise it."""
        times = [t for r in self.membership.live_records(self.clock()) if (t := r.step_time_s) > 0]
        return 1.0 / statistics.median(times) if times else None

    def _bounded(self, c: Contribution, detail: str) -> None:
        self.metrics.claims_bounded.inc()
        self.log.warning("contribution's claimed steps bounded by the claim guard", learner_id=c.learner_id,
                         fragment=c.fragment, version=c.base_version, sequence=c.sequence, steps=c.steps,
                         tokens=c.tokens, detail=detail)
        self.ledger.event({"event": schema.CLAIM_BOUND, "learner_id": c.learner_id, "fragment": c.fragment,
                           "sequence": c.sequence, "steps": c.steps, "tokens": c.tokens, "detail": detail})

    def reject_framing(self, rec: LearnerRecord, header: Any, reason: str, detail: str) -> None:
        """A transfer broke the stream's framing; it is rejected (the stream is closed by the caller)."""
        if header is None:
            self.ledger.reject_stream(rec, reason, detail)
            return
        self.ledger.reject(Contribution(rec.learner_id, header.sequence, header.fragment_id, header.version,
                                        header.tokens, header.steps, self.clock(), incarnation=rec.incarnation),
                           reason, detail)

    # -- reads ----------------------------------------------------------------------------

    async def fetch(self, fragment_ids: tuple[int, ...]) -> list[GlobalTransfer]:
        if not self.ready:
            raise Refused("FAILED_PRECONDITION", "not_ready", "no global state yet (genesis pending)")
        wanted = list(fragment_ids) or sorted(self.fragments)
        unknown = [p for p in wanted if p not in self.fragments]
        if unknown:
            raise Refused("INVALID_ARGUMENT", "unknown_fragment", f"fragments {unknown} are not owned here")
        return [await self.publisher.current(self.fragments[p]) for p in wanted]

    def status(self) -> StatusReply:
        now = self.clock()
        learners = tuple(LearnerStatus(
            learner_id=r.learner_id, connected=r.connected, live=self.membership.is_live(r, now),
            last_seen_s=now - r.last_seen, step=r.step, tokens_per_s=r.tokens_per_s, merged=r.merged,
            rejected=r.rejected, superseded=r.superseded, tokens_merged=r.tokens_merged, labels=r.labels)
            for r in sorted(self.membership.learners.values(), key=lambda r: r.learner_id))
        fragments = tuple(FragmentStatus(
            fragment_id=p, version=f.version, last_quorum_size=f.last_quorum_size,
            last_merge_unix=f.last_merge_unix, pending=len(self.rounds[p].inbox) if p in self.rounds else 0,
            last_grace_s=f.last_grace_s, num_values=f.spec.numel,
            round=self.rounds[p].state.round if p in self.rounds else 0) for p, f in sorted(self.fragments.items()))
        return StatusReply(
            synchronizer_id=self.synchronizer_id, mode=self.cfg.protocol.mode, uptime_s=now - self.started_at,
            state="ready" if self.ready else ("genesis_requested" if self.genesis.owner else "genesis_pending"),
            protocol=self.protocol_params(), quorum=self.cfg.policy.quorum, learners=learners,
            fragments=fragments, merges_total=self.ledger.merges_total,
            rejected_by_reason=dict(self.ledger.rejected_by_reason), token_goodput=self.ledger.token_goodput,
            fleet_step=self.fleet.steps)
