"""A fragment's round runs on the parts it is given, without the engine: here stand-ins for the
learners, the pace, the store and the publisher record what the round asked of them."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import torch

from ddiloco.algorithm.outer_optimizer import OuterNesterov
from ddiloco.algorithm.policies import QuorumPolicy, Timings
from ddiloco.algorithm.round import RejoinHold, RoundRules, StartHold
from ddiloco.core.logs import get_logger
from ddiloco.fragments.partition import Fragment, TensorSpec
from ddiloco.protocol.wire import FragmentRequest
from ddiloco.synchronizer.broadcast import GlobalTransfer
from ddiloco.synchronizer.global_fragment import GlobalFragment
from ddiloco.synchronizer.inbox import Contribution
from ddiloco.synchronizer.ledger import Ledger
from ddiloco.synchronizer.membership import Membership
from ddiloco.synchronizer.metrics import SynchronizerMetrics
from ddiloco.synchronizer.rounds import FragmentRound, MergeSettings, RoundContext
from ddiloco.synchronizer.store import FragmentRecord

SPEC = Fragment(0, (TensorSpec("w", (4,)),))


class Parts:
    def __init__(self) -> None:
        self.live_ids = frozenset({"a", "b"})
        self.requests: list[FragmentRequest] = []
        self.paced: list[tuple[float, float]] = []
        self.committed: list[FragmentRecord] = []
        self.published: list[GlobalTransfer] = []

    def live(self, now: float) -> frozenset[str]:
        return self.live_ids

    def ask(self, request: FragmentRequest, now: float) -> frozenset[str]:
        self.requests.append(request)
        return self.live_ids

    def timings(self) -> Timings:
        return Timings(0.1, 0.0, 0.0)

    def merged(self, quorum_time_s: float, sync_time_s: float) -> None:
        self.paced.append((quorum_time_s, sync_time_s))

    def commit(self, record: FragmentRecord) -> None:
        self.committed.append(record)

    def encode(self, spec: Fragment, params: torch.Tensor, version: int) -> GlobalTransfer:
        return GlobalTransfer(spec.index, version, ())

    def publish(self, transfer: GlobalTransfer) -> None:
        self.published.append(transfer)


async def test_a_round_merges_commits_and_publishes_through_the_parts_it_is_given() -> None:
    parts = Parts()
    log = get_logger("test.rounds")
    ledger = Ledger(membership=Membership(heartbeat_timeout_s=10.0, max_control=8, max_learners=8),
                    metrics=SynchronizerMetrics(), log=log, event_log=None, wall=time.time)

    async def run_blocking(fn: Any, *args: Any) -> Any:
        return fn(*args)

    ctx = RoundContext(clock=time.monotonic, wall=time.time, learners=parts, pace=parts, run_blocking=run_blocking,
                       store=parts, publisher=parts, ledger=ledger, rejoin=RejoinHold(), start=StartHold(),
                       max_wait_s=0.05)
    frag = GlobalFragment(SPEC, torch.zeros(4), torch.zeros(4), 0)
    settings = MergeSettings(method="mean", embedding_patterns=(), stale_anchor="point", staleness_window=4,
                             scale_by_participation=False, outer=OuterNesterov(lr=1.0, momentum=0.0))
    r = FragmentRound(frag, rules=RoundRules(policy=QuorumPolicy(quorum=2), overlap=0), merge=settings, ctx=ctx,
                      log=log)
    r.start()
    try:
        r.request(time.monotonic(), 1)
        assert parts.requests == [FragmentRequest(fragment_id=0, round=1, version=0)]
        now = time.monotonic()
        r.add(Contribution("a", 1, 0, 0, 100, 4, now, round=1), torch.full((4,), 1.0))
        r.add(Contribution("b", 1, 0, 0, 100, 4, now, round=1), torch.full((4,), 3.0))
        for _ in range(200):
            if frag.version == 1:
                break
            await asyncio.sleep(0.01)
        assert frag.version == 1
        torch.testing.assert_close(frag.params, torch.full((4,), -2.0))  # Theta - lr * mean(Delta)
        assert [(c.fragment, c.version) for c in parts.committed] == [(0, 1)]
        assert [(t.fragment, t.version) for t in parts.published] == [(0, 1)]
        assert len(parts.paced) == 1
    finally:
        r.close()
        assert r.task is not None
        r.task.cancel()
        await asyncio.gather(r.task, return_exceptions=True)
