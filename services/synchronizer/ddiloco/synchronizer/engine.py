"""The synchronizer's state machine, independent of gRPC.

The gRPC layer (``server``) turns streams into calls on the engine: ``hello``, ``receive``,
``heartbeat``, ``detach``, ``fetch`` and ``status``. The engine owns the global state, the durable
store, membership, one ``FragmentRound`` per fragment, the metrics and the accounting of every
contribution: each ends merged, rejected with a reason, or superseded, and the learner is told.

Start-up: with a state dir holding ``meta.json``, the layout, fingerprints and every fragment's
newest verifiable version (plus older ones as re-anchoring history) are loaded and versions
continue from there. Without it, the first learner to say Hello is asked for the genesis upload
(every fragment's initial parameters); the state is committed, ``meta.json`` last, and then the
synchronizer is ready.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import json
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from ddiloco.algorithm.outer_optimizer import OuterNesterov
from ddiloco.algorithm.policies import RunningAverage, Timings
from ddiloco.core.config import to_dict
from ddiloco.core.logs import get_logger
from ddiloco.fragments.chunking import Transfer
from ddiloco.fragments.codec import make_codec
from ddiloco.fragments.errors import FragmentError
from ddiloco.fragments.partition import Fragment, FragmentLayout
from ddiloco.fragments.payload import check_header, decode_fragment, encode_fragment
from ddiloco.protocol.wire import (
    ContributionResult,
    FragmentStatus,
    Heartbeat,
    Hello,
    LearnerStatus,
    ProtocolParams,
    Resync,
    StatusReply,
    Welcome,
)
from ddiloco.synchronizer.broadcast import GlobalTransfer
from ddiloco.synchronizer.config import SynchronizerConfig
from ddiloco.synchronizer.global_fragment import GlobalFragment
from ddiloco.synchronizer.inbox import Contribution
from ddiloco.synchronizer.membership import LearnerRecord, Membership
from ddiloco.synchronizer.metrics import SynchronizerMetrics
from ddiloco.synchronizer.rounds import FragmentRound, merged_result
from ddiloco.synchronizer.store import FragmentRecord, StateError, StateStore, layout_from_json

R = TypeVar("R")


class Refused(Exception):
    """A Hello (or a call) that is refused as a whole: the stream ends with this status."""

    def __init__(self, code: str, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.code, self.reason, self.detail = code, reason, detail


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
        self.codec = make_codec(cfg.protocol.global_codec, threads=cfg.codec_threads)
        self.outer = OuterNesterov(lr=cfg.outer_lr, momentum=cfg.outer_momentum)
        self.owned = [p for p in range(cfg.protocol.num_fragments) if cfg.owns(p)]
        self.layout: FragmentLayout | None = None
        self.layout_hash = ""
        self.model_fingerprint = ""
        self.fragments: dict[int, GlobalFragment] = {}
        self.rounds: dict[int, FragmentRound] = {}
        self.genesis_owner: str | None = None
        self.genesis_staging: dict[int, tuple[Transfer, torch.Tensor]] = {}
        self._genesis_hello: Hello | None = None
        self.global_cache: dict[int, GlobalTransfer] = {}
        self.closing = False
        self.started_at = clock()
        self.merges_total = 0
        self.rejoin_expected: set[str] = set()
        """Learners in the last committed merges when this process loaded its state (a restart)."""
        self.rejoin_until: float | None = None
        """Merges wait for them until then (``rejoin_window_s`` after loading), see ``rejoin_hold``."""
        self.rejected_by_reason: collections.Counter[str] = collections.Counter()
        self.tokens_merged = 0
        self.tokens_rejected = 0
        self._transfer_id = 0
        self._step_time = RunningAverage(0.2)
        self._quorum_time = RunningAverage(0.2)
        self._sync_time = RunningAverage(0.2)
        self._event_log_file = open(cfg.event_log, "a", buffering=1) if cfg.event_log else None  # noqa: SIM115
        self._log_event({"event": "sync_start", "t": wall(), "synchronizer_id": self.synchronizer_id})

    # -- lifecycle ------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.layout is not None

    def load(self) -> bool:
        """Load state from the state dir; False if it holds none yet."""
        meta = self.store.read_meta()
        if meta is None:
            return False
        protocol = to_dict(self.protocol_params())
        for key in ("num_fragments", "sync_every", "overlap", "mode"):
            if meta["protocol"].get(key) != protocol[key]:
                raise StateError(
                    f"state dir {self.store.root} was created with {key}={meta['protocol'].get(key)!r}, "
                    f"config says {protocol[key]!r}; use another state dir or the original config")
        layout = layout_from_json(meta["layout"])
        for p in self.owned:
            spec = layout[p]
            latest, history = self.store.load_latest(p, spec.numel)
            if latest is None:
                raise StateError(f"state dir {self.store.root} has no verifiable version of fragment {p}")
            frag = GlobalFragment(spec, latest.params, latest.momentum, latest.version, merges=latest.merges,
                                  history_size=self.cfg.staleness_window)
            frag.history.clear()
            for rec in [*history, latest]:
                frag.remember(rec.version, rec.params)
                frag.note_merged(rec.version, rec.contributors or {})
            self.fragments[p] = frag
            self.merges_total += latest.merges
            self.rejoin_expected.update((latest.contributors or {}).keys())
            self.metrics.version.labels(str(p)).set(latest.version)
        self.layout, self.layout_hash = layout, meta["layout_hash"]
        self.model_fingerprint = meta["model_fingerprint"]
        if self.rejoin_expected and self.cfg.rejoin_window_s > 0:
            self.rejoin_until = self.clock() + self.cfg.rejoin_window_s
        self.log.info("state loaded", state_dir=str(self.store.root),
                      versions={p: f.version for p, f in self.fragments.items()},
                      rejoin_expected=sorted(self.rejoin_expected), rejoin_window_s=self.cfg.rejoin_window_s)
        return True

    def rejoin_hold(self, now: float, fresh: frozenset[str]) -> float | None:
        """After a restart: until when a fragment's merge waits for the learners of the last
        committed merges to come back (None: no hold). It ends early for a fragment once every one
        of them has contributed fresh, and for good once the window has passed."""
        if self.rejoin_until is None:
            return None
        if now >= self.rejoin_until:
            self.rejoin_until = None
            return None
        return None if self.rejoin_expected <= fresh else self.rejoin_until

    def start(self) -> None:
        for frag in self.fragments.values():
            r = FragmentRound(self, frag)
            self.rounds[frag.spec.index] = r
            r.start()

    async def stop(self) -> None:
        """Finish any merge/commit in progress, then stop the rounds."""
        self.closing = True
        deadline = self.clock() + 30.0
        while any(r.merging for r in self.rounds.values()) and self.clock() < deadline:
            await asyncio.sleep(0.01)
        for r in self.rounds.values():
            r.poke()
            if r.task is not None:
                r.task.cancel()
        await asyncio.gather(*(r.task for r in self.rounds.values() if r.task), return_exceptions=True)
        for rec in self.membership.learners.values():
            rec.closing.set()
            rec.outbox.wake()
        self.pool.shutdown(wait=True)
        if self._event_log_file is not None:
            self._event_log_file.close()
            self._event_log_file = None

    async def run_blocking(self, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        return await asyncio.get_running_loop().run_in_executor(self.pool, functools.partial(fn, *args, **kwargs))

    def encode_global(self, spec: Fragment, params: torch.Tensor, version: int) -> GlobalTransfer:
        """A committed version as one transfer, encoded once and shared by every outbox."""
        chunks = encode_fragment(params, spec, codec=self.codec, kind="global", version=version,
                                 transfer_id=self.next_transfer_id(), layout_hash=self.layout_hash,
                                 max_chunk_bytes=self.cfg.protocol.max_chunk_bytes)
        return GlobalTransfer(spec.index, version, tuple(chunks))

    def next_transfer_id(self) -> int:
        self._transfer_id += 1
        return self._transfer_id

    # -- helpers for rounds ---------------------------------------------------------------

    def timings(self) -> Timings:
        return Timings(self._step_time.get(), self._quorum_time.get(), self._sync_time.get())

    def protocol_params(self) -> ProtocolParams:
        p = self.cfg.protocol
        return ProtocolParams(num_fragments=p.num_fragments, sync_every=p.sync_every, overlap=p.overlap,
                              max_chunk_bytes=p.max_chunk_bytes, mode=p.mode, global_codec=p.global_codec)

    def publish(self, transfer: GlobalTransfer) -> None:
        """A committed version: cache it for FetchState and queue it to every connected learner."""
        self.global_cache[transfer.fragment] = transfer
        self.metrics.version.labels(str(transfer.fragment)).set(transfer.version)
        for rec in self.membership.connected():
            rec.outbox.put_global(transfer)

    def merged(self, c: Contribution, version: int, weight: float, staleness: int) -> None:
        rec = self.membership.learners.get(c.learner_id)
        self.tokens_merged += c.tokens
        self.metrics.staleness.observe(staleness)
        if rec is not None:
            rec.tokens_merged += c.tokens
        for part in c.parts():  # a contribution and the older ones summed into it
            self.metrics.contributions.labels("merged", "").inc()
            if rec is not None:
                rec.merged += 1
                self._send_result(rec, merged_result(part, version, weight, staleness))

    def reject(self, c: Contribution, reason: str, detail: str, *, resync: bool = False) -> None:
        """Reject ``c`` and every older contribution summed into it, each answered on its own."""
        rec = self.membership.learners.get(c.learner_id)
        for part in c.parts():
            self._count_rejection(reason, part.tokens)
            self._log_event({"event": "reject", "t": self.wall(), "fragment": part.fragment,
                             "learner": part.learner_id, "incarnation": part.incarnation,
                             "sequence": part.sequence, "reason": reason})
            self.log.warning("contribution rejected", learner_id=part.learner_id, fragment=part.fragment,
                             version=part.base_version, sequence=part.sequence, reason=reason, detail=detail)
            if rec is not None:
                rec.rejected += 1
                self._send_result(rec, ContributionResult(sequence=part.sequence, fragment_id=part.fragment,
                                                          outcome="rejected", reason=reason, detail=detail))
        if rec is not None and resync:
            rec.outbox.put_control(Resync(fragment_ids=(c.fragment,), reason=reason, detail=detail))

    def _count_rejection(self, reason: str, tokens: int) -> None:
        self.rejected_by_reason[reason] += 1
        self.tokens_rejected += tokens
        self.metrics.contributions.labels("rejected", reason).inc()

    def _send_result(self, rec: LearnerRecord, result: ContributionResult) -> None:
        before = rec.outbox.dropped
        rec.outbox.put_control(result)
        if rec.outbox.dropped > before:
            self.metrics.dropped_results.inc(rec.outbox.dropped - before)

    def record_merge(self, fragment: int, version: int, quorum: int, grace_s: float, merge_s: float,
                     commit_s: float, sync_s: float, quorum_time_s: float, staleness: list[int],
                     contributions: list[Contribution], scale: float = 1.0) -> None:
        self.merges_total += 1
        self._sync_time.update(sync_s)
        self._quorum_time.update(quorum_time_s)
        m = self.metrics
        m.merges.labels(str(fragment)).inc()
        m.quorum_size.observe(quorum)
        m.grace_wait.observe(grace_s)
        m.merge_seconds.observe(merge_s)
        m.commit_seconds.observe(commit_s)
        entry = {"event": "merge", "t": self.wall(), "fragment": fragment, "version": version, "quorum": quorum,
                 "learners": [c.learner_id for c in contributions], "grace_s": grace_s, "sync_s": sync_s,
                 "staleness": staleness, "scale": scale,
                 "contributions": [[p.learner_id, p.incarnation, p.sequence]
                                   for c in contributions for p in c.parts()]}
        self._log_event(entry)

    def _log_event(self, entry: dict[str, Any]) -> None:
        if self._event_log_file is not None:
            self._event_log_file.write(json.dumps(entry, separators=(",", ":")) + "\n")

    # -- sessions -------------------------------------------------------------------------

    def hello(self, hello: Hello) -> tuple[LearnerRecord, Welcome]:
        """Admit a learner's stream, or raise Refused."""
        if not hello.learner_id or len(hello.learner_id) > 128:
            raise Refused("INVALID_ARGUMENT", "protocol", "learner_id must be 1..128 characters")
        mine, theirs = self.protocol_params(), hello.protocol
        for key in ("num_fragments", "sync_every", "overlap", "max_chunk_bytes", "mode"):
            if getattr(mine, key) != getattr(theirs, key):
                raise Refused("FAILED_PRECONDITION", "layout_mismatch",
                              f"protocol mismatch: learner has {key}={getattr(theirs, key)!r}, "
                              f"synchronizer has {getattr(mine, key)!r}")
        if mine.global_codec not in hello.codecs:
            raise Refused("FAILED_PRECONDITION", "unsupported_codec",
                          f"learner cannot decode the global codec {mine.global_codec}")
        if self.ready:
            if hello.model_fingerprint != self.model_fingerprint:
                raise Refused("FAILED_PRECONDITION", "model_mismatch",
                              f"model fingerprint {hello.model_fingerprint} differs from the global model's "
                              f"{self.model_fingerprint}")
            if hello.layout_hash != self.layout_hash:
                raise Refused("FAILED_PRECONDITION", "layout_mismatch",
                              f"fragment layout {hello.layout_hash} differs from the global model's "
                              f"{self.layout_hash}")
        now = self.clock()
        try:
            rec = self.membership.attach(hello.learner_id, now, hello.incarnation, hello.labels)
        except OverflowError as exc:
            raise Refused("RESOURCE_EXHAUSTED", "protocol", str(exc)) from exc
        rec.held = dict(hello.held)
        if self.ready:
            state = "ready"
            ahead = [p for p, v in hello.held.items() if p in self.fragments and v > self.fragments[p].version]
            if ahead:
                rec.outbox.put_control(Resync(fragment_ids=tuple(ahead), reason="future_version",
                                              detail="you hold versions newer than the synchronizer's"))
        else:
            owner = self.membership.learners.get(self.genesis_owner or "")
            if owner is None or not owner.connected or owner is rec:
                if self.genesis_owner != hello.learner_id:
                    self.genesis_staging.clear()
                self.genesis_owner = hello.learner_id
                self._genesis_hello = hello
                state = "genesis_requested"
            else:
                state = "genesis_pending"
        self.metrics.connected_learners.set(len(self.membership.connected()))
        self._poke_all()
        self.log.info("learner connected", learner_id=hello.learner_id, state=state,
                      incarnation=hello.incarnation, labels=hello.labels)
        welcome = Welcome(synchronizer_id=self.synchronizer_id, protocol=mine, state=state,
                          versions={p: f.version for p, f in self.fragments.items()},
                          heartbeat_interval_s=self.cfg.heartbeat_interval_s,
                          shard_index=self.cfg.shard_index, shard_count=self.cfg.shard_count,
                          fleet_step=self.membership.fleet_step(now, exclude=hello.learner_id))
        return rec, welcome

    def touch(self, rec: LearnerRecord) -> None:
        rec.last_seen = self.clock()

    def heartbeat(self, rec: LearnerRecord, hb: Heartbeat) -> None:
        rec.last_seen = rec.heartbeat_at = self.clock()
        rec.step, rec.tokens_total, rec.tokens_per_s = hb.step, hb.tokens_total, hb.tokens_per_s
        if hb.step_time_s > 0:
            rec.step_time_s = hb.step_time_s
            self._step_time.update(hb.step_time_s)

    def detach(self, rec: LearnerRecord, stream_id: int, reason: str) -> None:
        if self.membership.detach(rec, stream_id):
            rec.left = reason
            self.metrics.connected_learners.set(len(self.membership.connected()))
            self.log.info("learner disconnected", learner_id=rec.learner_id, reason=reason)
            self._poke_all()

    def _poke_all(self) -> None:
        self.metrics.live_learners.set(len(self.membership.live(self.clock())))
        for r in self.rounds.values():
            r.poke()

    # -- contributions --------------------------------------------------------------------

    async def receive(self, rec: LearnerRecord, transfer: Transfer) -> None:
        """Handle one complete transfer from a learner. Bad content is rejected with a result."""
        h = transfer.header
        c = Contribution(rec.learner_id, h.sequence, h.fragment_id, h.version, h.tokens, h.steps,
                         transfer.received_at, h.learner_step, rec.incarnation)
        if h.kind == "genesis":
            await self._receive_genesis(rec, transfer, c)
            return
        if h.kind != "contribution":
            self.reject(c, "protocol", f"learners may not send {h.kind} transfers")
            return
        if not self.ready or self.layout is None:
            self.reject(c, "not_ready", "no global state yet (genesis pending)")
            return
        if h.fragment_id not in self.fragments:
            self.reject(c, "unknown_fragment",
                        f"fragment {h.fragment_id} is not owned by shard {self.cfg.shard_index}/"
                        f"{self.cfg.shard_count} (P={self.cfg.protocol.num_fragments})")
            return
        if h.layout_hash and h.layout_hash != self.layout_hash:
            self.reject(c, "layout_mismatch", f"layout {h.layout_hash} is not {self.layout_hash}")
            return
        if h.steps == 0 or h.tokens == 0:
            self.reject(c, "protocol", "a contribution must carry tokens > 0 and steps > 0")
            return
        frag = self.fragments[h.fragment_id]
        dup = frag.duplicate_of(rec.learner_id, rec.incarnation, h.sequence)
        if dup is not None:
            kind, version = dup
            if kind == "duplicate":  # sent again after a reconnect: answer, never merge twice
                rec.merged += 1
                self._send_result(rec, ContributionResult(sequence=h.sequence, fragment_id=h.fragment_id,
                                                          outcome="merged", version=version,
                                                          detail="duplicate of a merged contribution"))
            else:
                self.reject(c, "stale", f"older than contribution merged into version {version}")
            return
        s = frag.version - h.version
        if s < 0:
            self.reject(c, "future_version", f"base {h.version} is newer than version {frag.version}", resync=True)
            return
        if s > self.cfg.staleness_window:
            self.reject(c, "stale", f"base {h.version} is {s} versions behind {frag.version} "
                                    f"(window {self.cfg.staleness_window})", resync=True)
            return
        try:
            delta = await self.run_blocking(decode_fragment, transfer, self.layout,
                                             zstd_threads=self.cfg.codec_threads)
        except FragmentError as exc:
            self.reject(c, exc.reason.lower(), str(exc))
            return
        replaced = self.rounds[h.fragment_id].add(c, delta)
        if replaced is not None:
            rec.superseded += 1
            self.metrics.contributions.labels("superseded", "").inc()
            self._send_result(rec, ContributionResult(
                sequence=replaced.sequence, fragment_id=replaced.fragment, outcome="superseded",
                detail=f"replaced by contribution {c.sequence}"))

    async def _receive_genesis(self, rec: LearnerRecord, transfer: Transfer, c: Contribution) -> None:
        h = transfer.header
        if self.ready:
            self.reject(c, "protocol", "global state exists already; genesis refused")
            return
        if rec.learner_id != self.genesis_owner:
            self.reject(c, "protocol", f"genesis is being uploaded by {self.genesis_owner}, not {rec.learner_id}")
            return
        if h.fragment_id not in self.owned:
            self.reject(c, "unknown_fragment", f"fragment {h.fragment_id} is not owned by this shard")
            return
        spec = Fragment(h.fragment_id, h.tensors)
        single = FragmentLayout((spec,))
        single_header = dataclasses.replace(transfer.header, fragment_id=0)
        try:
            check_header(single_header, single)
            values = await self.run_blocking(decode_fragment, Transfer(single_header, transfer.payload),
                                             single, zstd_threads=self.cfg.codec_threads)
        except FragmentError as exc:
            self.reject(c, exc.reason.lower(), str(exc))
            return
        self.genesis_staging[h.fragment_id] = (transfer, values)
        if set(self.genesis_staging) >= set(self.owned):
            await self._commit_genesis(rec)

    async def _commit_genesis(self, rec: LearnerRecord) -> None:
        hello = self._genesis_hello
        assert hello is not None
        P = self.cfg.protocol.num_fragments
        specs = {p: Fragment(p, t.header.tensors) for p, (t, _) in self.genesis_staging.items()}
        if self.cfg.shard_count == 1:
            layout = FragmentLayout(tuple(specs[p] for p in range(P)))
            if layout.fingerprint != hello.layout_hash:
                self.genesis_staging.clear()
                self.reject(Contribution(rec.learner_id, 0, 0, 0, 0, 0, self.clock()), "layout_mismatch",
                            f"genesis tensors give layout {layout.fingerprint}, Hello said {hello.layout_hash}")
                return
        else:
            # A shard sees only its fragments; unknown ones get empty placeholders in the layout.
            layout = FragmentLayout(tuple(specs.get(p, Fragment(p, ())) for p in range(P)))
        staged = dict(self.genesis_staging)

        def commit() -> None:
            for p, (_, values) in staged.items():
                self.store.commit(FragmentRecord(p, 0, values, torch.zeros_like(values), 0, self.wall()))
            self.store.write_meta(layout=layout, model_fingerprint=hello.model_fingerprint,
                                  protocol=to_dict(self.protocol_params()), owned=self.owned)

        await self.run_blocking(commit)
        for p, (_, values) in staged.items():
            self.fragments[p] = GlobalFragment(layout[p], values, torch.zeros_like(values), 0,
                                               history_size=self.cfg.staleness_window)
            self.metrics.version.labels(str(p)).set(0)
        self.layout = layout
        self.layout_hash = hello.layout_hash
        self.model_fingerprint = hello.model_fingerprint
        self.genesis_staging.clear()
        self.start()
        self.log.info("genesis committed", learner_id=rec.learner_id, fragments=len(staged),
                      layout_hash=self.layout_hash, model_fingerprint=self.model_fingerprint)

    def reject_framing(self, rec: LearnerRecord, header: Any, reason: str, detail: str) -> None:
        """A transfer broke the stream's framing; it is rejected (the stream is closed by the caller)."""
        if header is None:
            self._count_rejection(reason, 0)
            self.log.warning("stream rejected", learner_id=rec.learner_id, reason=reason, detail=detail)
            return
        self.reject(Contribution(rec.learner_id, header.sequence, header.fragment_id, header.version,
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
        out = []
        for p in wanted:
            frag = self.fragments[p]
            cached = self.global_cache.get(p)
            if cached is None or cached.version != frag.version:
                version = frag.version
                cached = await self.run_blocking(self.encode_global, frag.spec, frag.params, version)
                if frag.version == version:
                    self.global_cache[p] = cached
            out.append(cached)
        return out

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
            last_grace_s=f.last_grace_s, num_values=f.spec.numel) for p, f in sorted(self.fragments.items()))
        total = self.tokens_merged + self.tokens_rejected
        return StatusReply(
            synchronizer_id=self.synchronizer_id, mode=self.cfg.protocol.mode, uptime_s=now - self.started_at,
            state="ready" if self.ready else ("genesis_requested" if self.genesis_owner else "genesis_pending"),
            protocol=self.protocol_params(), quorum=self.cfg.policy.quorum, learners=learners,
            fragments=fragments, merges_total=self.merges_total,
            rejected_by_reason=dict(self.rejected_by_reason),
            token_goodput=(self.tokens_merged / total) if total else 1.0)
