"""The learner's send queue (its mailbox, through ``Comm``): what is kept, dropped or sent again, without a network.

A newer contribution from the same base carries the older one's progress, so the older one is
dropped (and logged). One from an older base does not (a merge without it was applied since): both
are sent and the synchronizer sums them. After a reconnect, unanswered contributions go back in
sequence order unless a newer one from their base is queued.
"""

from __future__ import annotations

import torch

from ddiloco.fragments.partition import partition_tensors
from ddiloco.learner.comm import Comm
from ddiloco.learner.config import LearnerConfig
from ddiloco.learner.events import EventLog
from ddiloco.learner.mailbox import HEAL_AFTER, Outgoing
from ddiloco.protocol import wire


def _comm() -> tuple[Comm, list[tuple[str, dict]]]:
    params = {"w": torch.zeros(8), "b": torch.zeros(4)}
    layout = partition_tensors(list(params.items()), 2)
    seen: list[tuple[str, dict]] = []
    events = EventLog(None, learner_id="a", incarnation=1)
    events.observers.append(lambda name, fields: seen.append((name, fields)))
    comm = Comm(LearnerConfig(learner_id="a"), layout=layout, model_fingerprint="x", incarnation=1, events=events,
                held=dict, genesis_values=dict)
    return comm, seen


def out(seq: int, fragment: int, base: int) -> Outgoing:
    return Outgoing(fragment, seq, base, tokens=10, steps=1, learner_step=seq, delta=torch.zeros(4))


def queued(comm: Comm) -> dict[int, list[int]]:
    return {p: [o.sequence for o in q] for p, q in comm.lanes[0].mailbox._outbound.items()}


def dropped(seen: list[tuple[str, dict]]) -> list[int]:
    return [f["sequence"] for name, f in seen if name == "dropped"]


def test_same_base_replaces_older_base_stays_queued() -> None:
    comm, seen = _comm()
    comm.submit(out(1, 0, base=0))
    comm.submit(out(2, 0, base=0))          # carries 1's progress
    comm.submit(out(3, 1, base=0))
    comm.submit(out(4, 0, base=1))          # a merge without 2 was applied: 2 must still go
    comm.submit(out(5, 0, base=1))          # carries 4's progress
    assert queued(comm) == {0: [2, 5], 1: [3]}
    assert dropped(seen) == [1, 4]
    assert comm.pending() == 3


def test_reconnect_requeues_unanswered_in_order_unless_carried() -> None:
    comm, seen = _comm()
    for o in (out(1, 0, base=0), out(2, 0, base=0), out(3, 1, base=0), out(4, 1, base=1)):
        comm.lanes[0].mailbox._unacked[o.sequence] = o       # sent, never answered: the link broke
    comm.submit(out(5, 0, base=0))          # queued meanwhile, same base as 1 and 2
    comm.lanes[0].mailbox.requeue_unacked()
    assert dropped(seen) == [2, 1]          # 5 carries both
    assert queued(comm) == {0: [5], 1: [3, 4]}  # 3 and 4 have different bases: both again, in order
    assert comm.lanes[0].mailbox._unacked == {} and comm.pending() == 3


def test_stop_reports_everything_left_as_dropped() -> None:
    comm, seen = _comm()
    comm.submit(out(1, 0, base=0))
    comm.submit(out(2, 0, base=1))
    comm.lanes[0].mailbox._unacked[3] = out(3, 1, base=0)
    comm.stop("finished")
    assert sorted(dropped(seen)) == [1, 2, 3]
    assert comm.pending() == 0


def test_content_refusals_in_a_row_ask_training_to_heal_that_fragment() -> None:
    comm, _ = _comm()
    seq = iter(range(1, 100))

    def result(fragment: int, outcome: str, reason: str = "") -> None:
        comm.lanes[0].mailbox.settle(wire.ContributionResult(sequence=next(seq), fragment_id=fragment, outcome=outcome,
                                                   reason=reason))

    for _ in range(HEAL_AFTER - 1):
        result(0, "rejected", "non_finite")
    result(0, "merged")                      # a merge in between: the count starts over
    for _ in range(HEAL_AFTER - 1):
        result(0, "rejected", "bad_shape")
    for _ in range(2 * HEAL_AFTER):
        result(0, "rejected", "stale")       # says nothing about the learner's state
        result(1, "rejected", "not_ready")
    assert comm.take_heals() == set()
    result(0, "rejected", "non_finite")      # the HEAL_AFTER-th in a row
    for _ in range(HEAL_AFTER):
        result(1, "rejected", "non_finite")
    assert comm.take_heals() == {0, 1}
    assert comm.take_heals() == set(), "taken once"
    for _ in range(HEAL_AFTER - 1):
        result(1, "rejected", "non_finite")
    assert comm.take_heals() == set(), "the count started over after the heal"
