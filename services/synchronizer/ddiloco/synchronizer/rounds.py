"""One fragment's merge rounds: inbox -> quorum/grace -> merge -> outer step -> commit -> broadcast.

Each fragment runs its own asyncio task around a pure ``RoundState`` (``ddiloco.algorithm.round``,
the same state machine the fleet simulator runs). A round opens when the fleet's clock says the
fragment is due (``request``): every live learner is asked for it and answers at its next
inner-step boundary. The task asks the state machine for a decision whenever a contribution
arrives, membership changes, a request goes out, or the decision's own wake-up time passes; there
is no polling tick beyond the heartbeat interval.

The merge itself (re-anchoring, weighted RDA, Nesterov step, encoding, the durable commit) runs
in a thread pool so the event loop keeps serving streams; the new version becomes visible and is
broadcast only after the commit returned. If the merge or the commit fails, the round's
contributions go back into the inbox and the round is retried: nothing accepted is lost, nothing
uncommitted is broadcast. A learner whose newer contribution arrived during the failed attempt
gets one slot again, as if the two had arrived in order: the newer one supersedes the one put back
when it holds its progress (same process, same base; the learner is told it was superseded), and
carries it otherwise (it is answered with the newer one's merge). So every contribution still ends
merged, rejected or superseded, and is answered.

A round gets what it needs from the synchronizer as a ``RoundContext`` of the parts it works with,
each seen through a narrow interface: the learners (who is live, asking them), the pace (the
timings the grace is sized from), the store (commit) and the publisher (encode once, broadcast),
never the synchronizer itself. A round stops deciding once it is closed (``close``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ddiloco.algorithm.merge import embedding_mask, merge_deltas, reanchor
from ddiloco.algorithm.outer_optimizer import OuterNesterov
from ddiloco.algorithm.policies import Decision, Timings, token_weights
from ddiloco.algorithm.round import (
    RejoinHold,
    RoundRules,
    RoundState,
    StartHold,
    Waiting,
    participation_scale,
    staleness_verdict,
)
from ddiloco.fragments.partition import Fragment
from ddiloco.protocol.wire import FragmentRequest
from ddiloco.synchronizer.broadcast import GlobalTransfer
from ddiloco.synchronizer.global_fragment import GlobalFragment
from ddiloco.synchronizer.inbox import Contribution, Inbox, SealedRound
from ddiloco.synchronizer.ledger import Ledger
from ddiloco.synchronizer.store import FragmentRecord, StateError


@dataclass(frozen=True, kw_only=True)
class MergeSettings:
    """How a round turns contributions into a new version."""

    method: str
    """"rda" or "mean"."""
    embedding_patterns: tuple[str, ...]
    """Tensors that always get the weighted mean."""
    stale_anchor: str
    """"point" (re-anchor to the learner's model) or "delta" (apply as is)."""
    staleness_window: int
    scale_by_participation: bool
    outer: OuterNesterov
    hand_over_momentum: bool = False
    """Whether a round of hand-overs only takes the outer momentum (``SynchronizerConfig``)."""

    def outer_step(self, outer_step: int, entries: list[Contribution]) -> OuterNesterov:
        """The outer optimizer of a fragment's ``outer_step``-th step (from 1) merging ``entries``:
        plain SGD when every entry is a hand-over that carries nothing older (a learner's last
        progress, less than a sync period) and hand-overs take no momentum."""
        outer = self.outer.at(outer_step)
        if (not self.hand_over_momentum and outer.momentum and entries
                and all(c.hand_over and not c.carried for c in entries)):
            return dataclasses.replace(outer, momentum=0.0)
        return outer


class Learners(Protocol):
    """Who a round counts and asks (``membership.Membership``)."""

    def live(self, now: float) -> frozenset[str]: ...

    def ask(self, request: FragmentRequest, now: float) -> frozenset[str]:
        """Send a request to every learner still training; the live ones among them."""
        ...


class Pacing(Protocol):
    """The running averages the grace is sized from (``pace.Pace``)."""

    def timings(self) -> Timings: ...

    def merged(self, quorum_time_s: float, sync_time_s: float) -> None:
        """A committed merge: (quorum time, sync time)."""
        ...


def _sum(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    """``a + b`` where either may be absent (None: both are)."""
    if a is None or b is None:
        return b if a is None else a
    return a + b


class Committer(Protocol):
    """Where a merged version becomes durable (``store.StateStore``)."""

    def commit(self, record: FragmentRecord) -> Any: ...


class Publishing(Protocol):
    """How a committed version reaches the learners (``publisher.Publisher``)."""

    def encode(self, spec: Fragment, params: torch.Tensor, version: int) -> GlobalTransfer: ...

    def publish(self, transfer: GlobalTransfer) -> None: ...


@dataclass(frozen=True, kw_only=True)
class RoundContext:
    """What a round needs from the synchronizer."""

    clock: Callable[[], float]
    wall: Callable[[], float]
    learners: Learners
    pace: Pacing
    run_blocking: Callable[..., Awaitable[Any]]
    store: Committer
    publisher: Publishing
    ledger: Ledger
    rejoin: RejoinHold
    start: StartHold
    max_wait_s: float
    """Longest sleep between two decisions (liveness is re-read at least this often)."""
    asked: Callable[[int, float], None] = lambda fragment, now: None
    """Told of each request (fragment, when): the claim guard times answers from them."""
    paces: Callable[[], dict[str, float]] = dict
    """The learners' paces as the claim guard measured them, for each commit to carry."""


@dataclass
class MergeOutcome:
    params: torch.Tensor
    momentum: torch.Tensor
    transfer: GlobalTransfer
    merge_s: float
    commit_s: float


class FragmentRound:
    def __init__(self, fragment: GlobalFragment, *, rules: RoundRules, merge: MergeSettings, ctx: RoundContext,
                 log: Any) -> None:
        self.fragment = fragment
        self.rules, self.settings, self.ctx = rules, merge, ctx
        self.inbox = Inbox(fragment.spec.numel, capacity=2)
        self.state = RoundState()
        self.last_decision: Decision | None = None
        """The round's latest decision and its reason (for status, logs and tests)."""
        self.event = asyncio.Event()
        self.merging = False
        self.closing = False
        self.task: asyncio.Task[None] | None = None
        self._segments = [(s, e) for _, s, e in fragment.spec.segments()]
        self._embedding = embedding_mask(fragment.spec, merge.embedding_patterns)
        self.log = log.bind(fragment=fragment.spec.index)

    @property
    def index(self) -> int:
        return self.fragment.spec.index

    def start(self) -> None:
        self.task = asyncio.create_task(self._run(), name=f"fragment-{self.index}")

    def close(self) -> None:
        """Decide no more (a merge in progress finishes; the task then ends)."""
        self.closing = True

    def poke(self) -> None:
        self.event.set()

    def add(self, contribution: Contribution, delta: torch.Tensor) -> Contribution | None:
        """Put a contribution in the inbox; the one it supersedes, if any."""
        replaced = self.inbox.add(contribution, delta)
        self.poke()
        return replaced

    def request(self, now: float, round_no: int) -> None:
        """The fragment fell due: open its round and ask every live learner for it."""
        request = FragmentRequest(fragment_id=self.index, round=round_no, version=self.fragment.version)
        at = self.ctx.clock()
        asked = self.ctx.learners.ask(request, at)
        self.ctx.asked(self.index, at)
        self.state.open(now, round_no, waiting=len(self.inbox) > 0, asked=asked)
        self.log.debug("requested", round=round_no, version=self.fragment.version, learners=len(asked))
        self.poke()

    def waiting(self) -> list[Waiting]:
        return [Waiting(c.learner_id, c.base_version, c.arrived_at, c.round) for c in self.inbox.entries]

    async def _run(self) -> None:
        ctx = self.ctx
        while not self.closing:
            now = ctx.clock()
            decision = self.state.decide(now, self.waiting(), self.fragment.version, ctx.learners.live(now),
                                         ctx.pace.timings(), self.rules, ctx.rejoin, ctx.start)
            self.last_decision = decision
            if decision.merge:
                try:
                    await self._merge(decision.reason, decision.grace_s)
                except Exception:  # a failed round must not kill the fragment's task
                    self.log.exception("merge failed; contributions kept for the next attempt")
                    await asyncio.sleep(0.5)
                continue
            timeout = ctx.max_wait_s
            if decision.wake_at is not None:
                timeout = min(timeout, max(0.0, decision.wake_at - now))
            self.event.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.event.wait(), timeout=timeout)

    # -- the merge ------------------------------------------------------------------------

    async def _merge(self, reason: str, grace_s: float) -> None:
        ctx, settings, frag = self.ctx, self.settings, self.fragment
        quorum_time_s, round_no = self.state.quorum_time_s, self.state.round
        opened_at, _ = self.state.close()
        wait_s = ctx.clock() - opened_at if opened_at is not None else 0.0
        sealed = self.inbox.seal()
        version = frag.version
        point = settings.stale_anchor == "point"
        keep: list[int] = []
        staleness: list[int] = []
        for i, c in enumerate(sealed.entries):
            # An entry may carry older parts with older bases: the oldest decides (each part is
            # re-anchored against its own base in _compute).
            bases = c.bases()
            retained = not point or all(frag.retains(b) for b in bases)
            verdict = staleness_verdict(min(bases), version, settings.staleness_window, retained=retained)
            if verdict is not None:
                ctx.ledger.reject(c, verdict.reason, verdict.detail, resync=True)
            else:
                keep.append(i)
                staleness.append(version - min(bases))
        if not keep:
            return
        entries = [sealed.entries[i] for i in keep]
        self.merging = True
        try:  # from here on a failure puts the sealed contributions back
            weights = token_weights([c.tokens for c in entries], [c.steps for c in entries])
            scale = 1.0
            if settings.scale_by_participation:
                scale = participation_scale(len(entries), len(ctx.learners.live(ctx.clock())))
            started = time.perf_counter()
            outer = settings.outer_step(frag.merges + 1, entries)
            outcome = await ctx.run_blocking(self._compute, sealed, keep, staleness, weights, version, outer, scale)
        except Exception:
            self._requeue(sealed, keep)
            raise
        finally:
            self.merging = False
        contributors = self._contributors(sealed, keep)
        frag.advance(outcome.params, outcome.momentum, version + 1, ctx.wall(), contributors)
        frag.last_quorum_size = len(entries)
        frag.last_grace_s = grace_s
        ctx.publisher.publish(outcome.transfer)
        for c, w in zip(entries, weights, strict=True):
            ctx.ledger.merged(c, version + 1, w, merged_onto=version)
        sync_s = time.perf_counter() - started
        ctx.pace.merged(quorum_time_s, sync_s)
        ctx.ledger.record_merge(fragment=self.index, version=version + 1, grace_s=grace_s, merge_s=outcome.merge_s,
                                commit_s=outcome.commit_s, sync_s=sync_s, staleness=staleness,
                                contributions=entries, scale=scale, round_no=round_no, wait_s=wait_s,
                                momentum=outer.momentum)
        self.log.info("merged", version=version + 1, round=round_no, quorum=len(entries), reason=reason,
                      wait_s=round(wait_s, 4), scale=round(scale, 3),
                      grace_s=round(grace_s, 4), sync_s=round(sync_s, 4),
                      learners=[c.learner_id for c in entries], staleness=staleness)

    @staticmethod
    def _contributors(sealed: SealedRound, keep: list[int]) -> dict[str, list[int]]:
        """What a restarted synchronizer must never merge twice: per learner, its newest merged
        contribution (the ones it carries are older, so they count as merged by it)."""
        return {sealed.entries[i].learner_id: [sealed.entries[i].incarnation, sealed.entries[i].sequence]
                for i in keep}

    def _requeue(self, sealed: SealedRound, keep: list[int]) -> None:
        """Put the entries ``keep`` of a failed round back, before what arrived since (module docstring)."""
        if not any(sealed.entries[i].learner_id in self.inbox.contributors for i in keep):
            for i in keep:
                self.inbox.add(sealed.entries[i], sealed.deltas[i], sealed.carry.get(i))
            return
        later = self.inbox.seal()  # what arrived since: taken out, and put back after the older entries
        newer = {c.learner_id: j for j, c in enumerate(later.entries)}
        for i in keep:
            c = sealed.entries[i]
            j = newer.pop(c.learner_id, None)
            if j is None:
                self.inbox.add(c, sealed.deltas[i], sealed.carry.get(i))
            else:
                self._put_back_before(c, sealed.deltas[i], sealed.carry.get(i),
                                      later.entries[j], later.deltas[j], later.carry.get(j))
        for j in newer.values():
            self.inbox.add(later.entries[j], later.deltas[j], later.carry.get(j))

    def _put_back_before(self, older: Contribution, older_row: torch.Tensor, older_carry: torch.Tensor | None,
                         newer: Contribution, newer_row: torch.Tensor, newer_carry: torch.Tensor | None) -> None:
        """One slot for a learner's put-back ``older`` entry and its ``newer`` one, as
        ``inbox.Inbox.add`` would have made it had they arrived in that order; each entry's row is
        the sum of its parts' deltas, its carry the sum of the parts it carries."""
        own = older.parts()[0]  # older's own part, its tokens and steps without those it carries
        if newer.supersedes(older):  # the newer one holds older's own progress, not what older carries
            tokens, steps = (sum(k.tokens for k in older.carried), sum(k.steps for k in older.carried))
            entry = dataclasses.replace(newer, carried=(*older.carried, *newer.carried), tokens=newer.tokens + tokens,
                                        steps=newer.steps + steps, hand_over=newer.hand_over and older.hand_over)
            row = newer_row if older_carry is None else newer_row + older_carry
            carry = _sum(older_carry, newer_carry)
            self.inbox.add(entry, row, carry)
            self.ctx.ledger.superseded(None, own, by=newer.sequence)
            return
        entry = dataclasses.replace(newer, carried=(*older.carried, own, *newer.carried),
                                    tokens=newer.tokens + older.tokens, steps=newer.steps + older.steps)
        self.inbox.add(entry, newer_row + older_row, _sum(older_row, newer_carry))

    def _compute(self, sealed: SealedRound, keep: list[int], staleness: list[int], weights: list[float],
                 version: int, outer: OuterNesterov, scale: float = 1.0) -> MergeOutcome:
        """Thread-pool side: re-anchor, merge, outer step, encode, commit."""
        frag, settings = self.fragment, self.settings
        t0 = time.perf_counter()
        if len(keep) == len(sealed.entries):
            deltas = sealed.deltas
        else:
            deltas = sealed.deltas[torch.tensor(keep, dtype=torch.long)]
        current = frag.params
        point = settings.stale_anchor == "point"
        if any(staleness) and point and deltas.data_ptr() == sealed.deltas.data_ptr():
            deltas = deltas.clone()  # keep the sealed rows intact in case the round is requeued
        bases: dict[int, torch.Tensor] = {}  # read back from the store once per merge
        for row, s in enumerate(staleness):
            if s == 0 or not point:
                continue
            # Re-anchor each part against its own base: a part summed into a newer one (its
            # learner applied a merge meanwhile) may hold progress that merge already counted.
            for b in sealed.entries[keep[row]].bases():
                if b != version:
                    if b not in bases:
                        base = frag.params_at(b)
                        if base is None:  # its file went bad: forget it, so the retry rejects what needs it
                            frag.history.pop(b, None)
                            raise StateError(f"fragment {self.index}: retained version {b} no longer verifies")
                        bases[b] = base
                    reanchor(deltas[row], current, bases[b])
        merged = merge_deltas(deltas, weights, self._segments, self._embedding, settings.method)
        if scale != 1.0:
            merged = merged * scale
        params = current.clone()
        momentum = frag.momentum.clone()
        outer.step(params, momentum, merged)
        merge_s = time.perf_counter() - t0
        transfer = self.ctx.publisher.encode(frag.spec, params, version + 1)
        t1 = time.perf_counter()
        self.ctx.store.commit(FragmentRecord(self.index, version + 1, params, momentum, frag.merges + 1,
                                             self.ctx.wall(), self._contributors(sealed, keep), self.ctx.paces()))
        commit_s = time.perf_counter() - t1
        return MergeOutcome(params, momentum, transfer, merge_s, commit_s)
