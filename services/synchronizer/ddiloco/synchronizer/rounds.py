"""One fragment's merge rounds: inbox -> quorum/grace -> merge -> outer step -> commit -> broadcast.

Each fragment runs its own asyncio task. It re-evaluates the pure decision function
(``policies.decide``) whenever a contribution arrives, membership changes, or the decision's own
wake-up time passes. A round *opens* with the first fresh contribution (computed against the
current version); stale contributions join the next round rather than opening one, so a late
arrival does not trigger a merge of its own. They open a round after ``stale_round_s``, or after a
whole period when every live learner has one waiting (``FragmentRound._stale_wait``).

The merge itself (re-anchoring, weighted RDA, Nesterov step, encoding, the durable commit) runs
in a thread pool so the event loop keeps serving streams; the new version becomes visible and is
broadcast only after the commit returned. If the commit fails, the round's contributions go back
into the inbox (unless a newer one from the same learner arrived meanwhile) and the round is
retried: nothing accepted is lost, nothing uncommitted is broadcast.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ddiloco.algorithm.merge import embedding_mask, merge_deltas
from ddiloco.algorithm.policies import RoundView, decide, quorum_reached, token_weights
from ddiloco.protocol.wire import ContributionResult, Resync
from ddiloco.synchronizer.broadcast import GlobalTransfer
from ddiloco.synchronizer.global_fragment import GlobalFragment
from ddiloco.synchronizer.inbox import Contribution, Inbox, SealedRound
from ddiloco.synchronizer.store import FragmentRecord

if TYPE_CHECKING:
    from ddiloco.synchronizer.engine import Engine


@dataclass
class MergeOutcome:
    params: torch.Tensor
    momentum: torch.Tensor
    transfer: GlobalTransfer
    merge_s: float
    commit_s: float
    contributors: dict[str, list[int]]


class FragmentRound:
    def __init__(self, engine: Engine, fragment: GlobalFragment) -> None:
        self.engine = engine
        self.fragment = fragment
        self.inbox = Inbox(fragment.spec.numel, capacity=2)
        self.event = asyncio.Event()
        self.opened_at: float | None = None
        self.quorum_at: float | None = None
        self.merging = False
        self.task: asyncio.Task[None] | None = None
        self._segments = [(s, e) for _, s, e in fragment.spec.segments()]
        self._embedding = embedding_mask(fragment.spec, engine.cfg.embedding_patterns)
        self.log = engine.log.bind(fragment=fragment.spec.index)

    @property
    def index(self) -> int:
        return self.fragment.spec.index

    def start(self) -> None:
        self.task = asyncio.create_task(self._run(), name=f"fragment-{self.index}")

    def poke(self) -> None:
        self.event.set()

    # -- decisions ------------------------------------------------------------------------

    def _stale_wait(self, live: frozenset[str]) -> float:
        """How long stale contributions wait before they open a round of their own.

        ``stale_round_s``; but once every live learner has one waiting and the oldest has waited
        a whole period (H steps at the fleet's step time), nothing fresher is coming: each learner
        would have sent its next contribution for this fragment by then. That is the end of every
        finite run (a learner's last contributions, sent as it stops, are often a version behind),
        where the results otherwise came 30 s late."""
        wait = self.engine.cfg.stale_round_s
        if live and live <= self.inbox.contributors:
            step_s = self.engine.timings().step_time_s
            if step_s > 0:
                wait = min(wait, self.engine.cfg.protocol.sync_every * step_s)
        return wait

    def view(self, now: float, live: frozenset[str]) -> RoundView:
        version = self.fragment.version
        if self.opened_at is None and len(self.inbox):
            fresh = [e.arrived_at for e in self.inbox.entries if e.base_version == version]
            if fresh:
                self.opened_at = min(fresh)
            else:
                oldest = self.inbox.oldest_arrival()
                if oldest is not None and now - oldest >= self._stale_wait(live):
                    self.opened_at = now
        fresh = frozenset(e.learner_id for e in self.inbox.entries if e.base_version == version)
        view = RoundView(self.opened_at, self.quorum_at, self.inbox.contributors, live, fresh)
        if self.opened_at is not None and self.quorum_at is None:
            reached, _ = quorum_reached(view, self.engine.cfg.policy)
            if reached:
                self.quorum_at = now
                view = RoundView(self.opened_at, self.quorum_at, view.contributors, live, fresh)
        return view

    async def _run(self) -> None:
        engine = self.engine
        while not engine.closing:
            now = engine.clock()
            view = self.view(now, engine.membership.live(now))
            decision = decide(now, view, engine.timings(), engine.cfg.protocol.overlap, engine.cfg.policy)
            hold = engine.rejoin_hold(now, view.fresh or frozenset()) if decision.merge else None
            if hold is not None:
                # Just restarted: the fleet is reconnecting. Merging the first learner back alone
                # would make its contribution a whole outer step and the others' stale.
                decision = dataclasses.replace(decision, merge=False, wake_at=hold)
            if decision.merge:
                try:
                    await self._merge(decision.reason, decision.grace_s, now)
                except Exception:  # a failed round must not kill the fragment's task
                    self.log.exception("merge failed; contributions kept for the next attempt")
                    await asyncio.sleep(0.5)
                continue
            timeout = engine.cfg.heartbeat_interval_s
            if decision.wake_at is not None:
                timeout = min(timeout, max(0.0, decision.wake_at - now))
            self.event.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.event.wait(), timeout=timeout)

    # -- the merge ------------------------------------------------------------------------

    async def _merge(self, reason: str, grace_s: float, now: float) -> None:
        engine = self.engine
        frag = self.fragment
        opened_at, quorum_at = self.opened_at, self.quorum_at
        sealed = self.inbox.seal()
        self.opened_at = self.quorum_at = None
        version = frag.version
        keep: list[int] = []
        staleness: list[int] = []
        point = engine.cfg.stale_anchor == "point"
        for i, c in enumerate(sealed.entries):
            s = version - c.base_version
            if s < 0:
                engine.reject(c, "future_version", f"base {c.base_version} is newer than version {version}",
                              resync=True)
            elif s > engine.cfg.staleness_window or (point and frag.params_at(c.base_version) is None):
                engine.reject(c, "stale", f"base {c.base_version} is {s} versions behind {version} "
                                          f"(window {engine.cfg.staleness_window})", resync=True)
            else:
                keep.append(i)
                staleness.append(s)
        if not keep:
            return
        entries = [sealed.entries[i] for i in keep]
        weights = token_weights([c.tokens for c in entries], [c.steps for c in entries])
        scale = 1.0
        if engine.cfg.scale_by_participation:
            live = engine.membership.live(engine.clock())
            scale = min(1.0, len(entries) / max(1, len(live)))
        self.merging = True
        started = time.perf_counter()
        try:
            outcome = await engine.run_blocking(self._compute, sealed, keep, staleness, weights, version, scale)
        except Exception:
            self._requeue(sealed, keep)
            raise
        finally:
            self.merging = False
        frag.advance(outcome.params, outcome.momentum, version + 1, engine.wall(), outcome.contributors)
        frag.last_quorum_size = len(entries)
        frag.last_grace_s = grace_s
        engine.publish(outcome.transfer)
        for c, w, s in zip(entries, weights, staleness, strict=True):
            engine.merged(c, version + 1, w, s)
        sync_s = time.perf_counter() - started
        engine.record_merge(self.index, version + 1, len(entries), grace_s, outcome.merge_s, outcome.commit_s,
                            sync_s, (quorum_at - opened_at) if quorum_at and opened_at else 0.0, staleness,
                            entries, scale=scale)
        self.log.info("merged", version=version + 1, quorum=len(entries), reason=reason, scale=round(scale, 3),
                      grace_s=round(grace_s, 4), sync_s=round(sync_s, 4),
                      learners=[c.learner_id for c in entries], staleness=staleness)

    def _requeue(self, sealed: SealedRound, keep: list[int]) -> None:
        for i in keep:
            c = sealed.entries[i]
            if c.learner_id not in self.inbox.contributors:
                self.inbox.add(c, sealed.deltas[i], sealed.carry.get(i))

    def _compute(self, sealed: SealedRound, keep: list[int], staleness: list[int], weights: list[float],
                 version: int, scale: float = 1.0) -> MergeOutcome:
        """Thread-pool side: re-anchor, merge, outer step, encode, commit."""
        engine = self.engine
        frag = self.fragment
        t0 = time.perf_counter()
        if len(keep) == len(sealed.entries):
            deltas = sealed.deltas
        else:
            deltas = sealed.deltas[torch.tensor(keep, dtype=torch.long)]
        current = frag.params
        if (any(staleness) and engine.cfg.stale_anchor == "point"
                and deltas.data_ptr() == sealed.deltas.data_ptr()):
            deltas = deltas.clone()  # keep the sealed rows intact in case the round is requeued
        for row, s in enumerate(staleness):
            if s > 0 and engine.cfg.stale_anchor == "point":
                base = frag.params_at(sealed.entries[keep[row]].base_version)
                assert base is not None
                deltas[row].add_(current).sub_(base)
        merged = merge_deltas(deltas, weights, self._segments, self._embedding, engine.cfg.merge_method)
        if scale != 1.0:
            merged = merged * scale
        params = current.clone()
        momentum = frag.momentum.clone()
        engine.outer.step(params, momentum, merged)
        merge_s = time.perf_counter() - t0
        transfer = engine.encode_global(frag.spec, params, version + 1)
        # What a restarted synchronizer must never merge twice: per learner, its newest merged
        # contribution (the ones it carries are older, so they count as merged by it).
        contributors = {sealed.entries[i].learner_id: [sealed.entries[i].incarnation, sealed.entries[i].sequence]
                        for i in keep}
        t1 = time.perf_counter()
        engine.store.commit(FragmentRecord(self.index, version + 1, params, momentum, frag.merges + 1,
                                           engine.wall(), contributors))
        commit_s = time.perf_counter() - t1
        return MergeOutcome(params, momentum, transfer, merge_s, commit_s, contributors)

    # -- arrivals -------------------------------------------------------------------------

    def add(self, contribution: Contribution, delta: torch.Tensor) -> Contribution | None:
        replaced = self.inbox.add(contribution, delta)
        self.poke()
        return replaced

    def drop_learner(self, learner_id: str) -> Contribution | None:
        return self.inbox.drop(learner_id)


def resync_message(fragment: int, reason: str, detail: str) -> Resync:
    return Resync(fragment_ids=(fragment,), reason=reason, detail=detail)


def merged_result(c: Contribution, version: int, weight: float, staleness: int) -> ContributionResult:
    return ContributionResult(sequence=c.sequence, fragment_id=c.fragment, outcome="merged", version=version,
                              weight=weight, staleness=staleness)
