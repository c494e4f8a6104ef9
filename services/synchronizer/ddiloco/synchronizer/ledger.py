"""The synchronizer's ledger: every contribution's outcome, told to its learner, counted, logged.

Every contribution ends merged, rejected with a reason, or superseded by a newer one from the
same learner and base; this is the one place that records which. Each outcome goes to the
learner (a ``ContributionResult`` in its outbox; a contribution that carries older ones summed
into it answers each of them), to the Prometheus metrics, to the structured log, and to the event
log (one JSON line per start, merge and rejection: what the accounting of a run reads; the
learner's own log may be lost with its process). The event log's events and their fields are
defined in ``ddiloco.core.events`` (the synchronizer log); ``event`` checks each line against them.

A result goes only to the process that sent the contribution. Sequence numbers are per process:
a restarted learner (a new incarnation under the same id) numbers its contributions from 1 again,
so an outcome of its previous process decided after the restart (the contribution waited in an
inbox, was in a merge, or rides in the new process's summed slot) would read to the new process
as the outcome of its own contribution of that number. Such an outcome is counted, logged and
written to the event log (with its incarnation) like any other, and not sent.
"""

from __future__ import annotations

import collections
import json
import time
from collections.abc import Callable
from typing import Any

from ddiloco.core import events as schema
from ddiloco.protocol.wire import ContributionResult, Resync
from ddiloco.synchronizer.inbox import Contribution
from ddiloco.synchronizer.membership import LearnerRecord, Membership
from ddiloco.synchronizer.metrics import SynchronizerMetrics


class Ledger:
    def __init__(self, *, membership: Membership, metrics: SynchronizerMetrics, log: Any,
                 event_log: str | None, wall: Callable[[], float]) -> None:
        self.membership, self.metrics, self.log, self.wall = membership, metrics, log, wall
        self.rejected_by_reason: collections.Counter[str] = collections.Counter()
        self.tokens_merged = 0
        self.tokens_rejected = 0
        self.merges_total = 0
        """Merges since the state was created (loaded state adds its count)."""
        self._file = open(event_log, "a", buffering=1) if event_log else None  # noqa: SIM115 (closed in close)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    @property
    def token_goodput(self) -> float:
        """Share of the received contributions' tokens that were merged."""
        total = self.tokens_merged + self.tokens_rejected
        return self.tokens_merged / total if total else 1.0

    # -- outcomes ----------------------------------------------------------------------------

    def merged(self, c: Contribution, version: int, weight: float, *, merged_onto: int) -> None:
        """``c`` (and every part it carries) merged into ``version``, computed on ``merged_onto``;
        each part's staleness is ``merged_onto`` minus its own base."""
        rec = self.membership.learners.get(c.learner_id)
        self.tokens_merged += c.tokens
        if rec is not None:
            rec.tokens_merged += c.tokens
        for part in c.parts():  # a contribution and the older ones summed into it
            staleness = merged_onto - part.base_version
            self.metrics.staleness.observe(staleness)
            self.metrics.contributions.labels("merged", "").inc()
            if rec is not None:
                rec.merged += 1
                self._answer(rec, part, ContributionResult(sequence=part.sequence, fragment_id=part.fragment,
                                                           outcome="merged", version=version, weight=weight,
                                                           staleness=staleness))

    def duplicate(self, rec: LearnerRecord, sequence: int, fragment: int, version: int) -> None:
        """A contribution sent again after a reconnect: answered merged, never merged twice."""
        rec.merged += 1
        self.send_result(rec, ContributionResult(sequence=sequence, fragment_id=fragment, outcome="merged",
                                                 version=version, detail="duplicate of a merged contribution"))

    def superseded(self, rec: LearnerRecord | None, replaced: Contribution, by: int) -> None:
        """``replaced`` holds nothing the same learner's contribution ``by`` does not; ``rec``: its
        learner's record (None: looked up by id; a learner forgotten since is only counted)."""
        self.metrics.contributions.labels("superseded", "").inc()
        rec = rec if rec is not None else self.membership.learners.get(replaced.learner_id)
        if rec is None:
            return
        rec.superseded += 1
        self._answer(rec, replaced, ContributionResult(sequence=replaced.sequence, fragment_id=replaced.fragment,
                                                       outcome="superseded", detail=f"replaced by contribution {by}"))

    def reject(self, c: Contribution, reason: str, detail: str, *, resync: bool = False) -> None:
        """Reject ``c`` and every older contribution summed into it, each answered on its own;
        with ``resync`` the learner is also told to fetch the fragment again."""
        rec = self.membership.learners.get(c.learner_id)
        for part in c.parts():
            self._count_rejection(reason, part.tokens)
            self.event({"event": schema.REJECT, "fragment": part.fragment, "learner": part.learner_id,
                        "incarnation": part.incarnation, "sequence": part.sequence, "reason": reason})
            self.log.warning("contribution rejected", learner_id=part.learner_id, fragment=part.fragment,
                             version=part.base_version, sequence=part.sequence, reason=reason, detail=detail)
            if rec is not None:
                rec.rejected += 1
                self._answer(rec, part, ContributionResult(sequence=part.sequence, fragment_id=part.fragment,
                                                           outcome="rejected", reason=reason, detail=detail))
        if rec is not None and resync and c.incarnation == rec.incarnation:
            rec.outbox.put_control(Resync(fragment_ids=(c.fragment,), reason=reason, detail=detail))

    def reject_stream(self, rec: LearnerRecord, reason: str, detail: str) -> None:
        """A stream broke the protocol before any contribution could be named."""
        self._count_rejection(reason, 0)
        self.log.warning("stream rejected", learner_id=rec.learner_id, reason=reason, detail=detail)

    def _count_rejection(self, reason: str, tokens: int) -> None:
        self.rejected_by_reason[reason] += 1
        self.tokens_rejected += tokens
        self.metrics.contributions.labels("rejected", reason).inc()

    def _answer(self, rec: LearnerRecord, part: Contribution, result: ContributionResult) -> None:
        """Send ``part``'s result to its learner unless the process that sent it was replaced by
        a new incarnation (see the module docstring)."""
        if part.incarnation != rec.incarnation:
            self.log.info("result withheld: the learner process that sent the contribution was replaced",
                          learner_id=part.learner_id, fragment=part.fragment, sequence=part.sequence,
                          incarnation=part.incarnation, current_incarnation=rec.incarnation,
                          outcome=result.outcome)
            return
        self.send_result(rec, result)

    def send_result(self, rec: LearnerRecord, result: ContributionResult) -> None:
        before = rec.outbox.dropped
        rec.outbox.put_control(result)
        if rec.outbox.dropped > before:
            self.metrics.dropped_results.inc(rec.outbox.dropped - before)

    # -- merges and events -------------------------------------------------------------------

    def record_merge(self, *, fragment: int, version: int, grace_s: float, merge_s: float, commit_s: float,
                     sync_s: float, staleness: list[int], contributions: list[Contribution],
                     scale: float, momentum: float, round_no: int = 0, wait_s: float = 0.0) -> None:
        """``wait_s``: from the round's request to the merge (its longest wait)."""
        self.merges_total += 1
        m = self.metrics
        m.merges.labels(str(fragment)).inc()
        m.quorum_size.observe(len(contributions))
        m.grace_wait.observe(grace_s)
        m.merge_seconds.observe(merge_s)
        m.commit_seconds.observe(commit_s)
        self.event({"event": schema.MERGE, "fragment": fragment, "version": version, "round": round_no,
                    "wait_s": wait_s, "quorum": len(contributions),
                    "learners": [c.learner_id for c in contributions], "grace_s": grace_s, "sync_s": sync_s,
                    "staleness": staleness, "scale": scale, "merge_s": merge_s, "commit_s": commit_s,
                    # this process's CPU seconds so far: CPU per merge is the difference between merges
                    "cpu_s": time.process_time(),
                    # and its payload bytes so far: bytes per second between two merges likewise
                    "rx_bytes": m.received_bytes, "tx_bytes": m.sent_bytes,
                    "momentum": momentum,
                    "contributions": [[p.learner_id, p.incarnation, p.sequence]
                                      for c in contributions for p in c.parts()]})

    def event(self, entry: dict[str, Any], *, t: float | None = None) -> None:
        """Append one line to the event log (``t``: wall time, now when omitted). The line is
        checked against its spec in ``ddiloco.core.events`` whether or not a log is written."""
        schema.validate(schema.SYNCHRONIZER_LOG, entry["event"], entry.keys() - {"event"})
        if self._file is not None:
            line = {"event": entry["event"], "t": self.wall() if t is None else t,
                    **{k: v for k, v in entry.items() if k != "event"}}
            self._file.write(json.dumps(line, separators=(",", ":")) + "\n")
