"""What may enter the synchronizer: a learner's Hello, and each contribution it sends.

Every check that can refuse input lives here, in the order it is made, each with its reason:

- Hello: a learner id of 1..128 characters; the same protocol constants (P, H, tau, chunk size,
  mode); a global codec the learner can decode; once global state exists, the same model
  fingerprint and fragment layout. A refused Hello ends the stream with a gRPC status.
- A contribution: a contribution transfer (learners may not send globals; genesis goes to
  ``genesis``), global state ready, a fragment this shard owns, the global layout, tokens and
  steps > 0, not a contribution already merged (a re-send after a reconnect is answered, never
  merged twice), a base within the staleness window (``staleness_verdict``, the same rule the
  merge applies), steps within what the synchronizer can account for from the learner's pace and
  the time its counters cover, from its previous answer of the fragment (``ddiloco.algorithm.
  claim_guard``: a claim beyond it is merged as the bound, or refused as ``claim_outlier``),
  tokens per step within the weight guard's bound (``weight_outlier``:
  ``ddiloco.algorithm.weight_guard``; token weights grow with the square of the tokens claimed),
  and a payload that decodes to finite values of the right shapes. A learner
  whose payload is refused for its content stops counting as live (``LearnerRecord.faulty``)
  until a good one arrives, so no round waits for what it cannot give. Last, with
  ``norm_guard`` on, a norm per (admitted) step within ``factor`` times the fragment's typical
  one (``ddiloco.algorithm.norm_guard``): an outlier is refused (``norm_outlier``) or clipped.

Only a contribution that passed every check is recorded in the guards' histories (its pace, its
tokens per step, its norm), each under its learner's identity, so neither refused answers nor one
learner's many answers move the bounds the fleet is judged by (``ddiloco.algorithm.identity_median``).

A refused contribution is answered with a reason (``Ledger.reject``); the global model is never
touched by it. Framing faults (corrupt, reordered, oversized chunks) are caught earlier, by
reassembly in the server, and end the stream.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from ddiloco.algorithm.claim_guard import ClaimGuard
from ddiloco.algorithm.norm_guard import NormGuard
from ddiloco.algorithm.round import staleness_verdict
from ddiloco.algorithm.weight_guard import WeightGuard, WeightGuardPolicy
from ddiloco.fragments.chunking import Transfer
from ddiloco.fragments.errors import FragmentError
from ddiloco.fragments.payload import decode_fragment
from ddiloco.protocol.wire import Hello, ProtocolParams
from ddiloco.synchronizer.inbox import Contribution
from ddiloco.synchronizer.ledger import Ledger
from ddiloco.synchronizer.membership import LearnerRecord
from ddiloco.synchronizer.recovery import LoadedState

AGREED = ("num_fragments", "sync_every", "overlap", "max_chunk_bytes", "mode")
"""Protocol constants a learner must share with the synchronizer."""


class Refused(Exception):
    """A Hello (or a call) that is refused as a whole: the stream ends with this status."""

    def __init__(self, code: str, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.code, self.reason, self.detail = code, reason, detail


def check_hello(hello: Hello, mine: ProtocolParams, state: LoadedState | None) -> None:
    """Raise Refused unless this learner may join."""
    if not hello.learner_id or len(hello.learner_id) > 128:
        raise Refused("INVALID_ARGUMENT", "protocol", "learner_id must be 1..128 characters")
    theirs = hello.protocol
    for key in AGREED:
        if getattr(mine, key) != getattr(theirs, key):
            raise Refused("FAILED_PRECONDITION", "layout_mismatch",
                          f"protocol mismatch: learner has {key}={getattr(theirs, key)!r}, "
                          f"synchronizer has {getattr(mine, key)!r}")
    if mine.global_codec not in hello.codecs:
        raise Refused("FAILED_PRECONDITION", "unsupported_codec",
                      f"learner cannot decode the global codec {mine.global_codec}")
    if state is not None:
        if hello.model_fingerprint != state.model_fingerprint:
            raise Refused("FAILED_PRECONDITION", "model_mismatch",
                          f"model fingerprint {hello.model_fingerprint} differs from the global model's "
                          f"{state.model_fingerprint}")
        if hello.layout_hash != state.layout_hash:
            raise Refused("FAILED_PRECONDITION", "layout_mismatch",
                          f"fragment layout {hello.layout_hash} differs from the global model's {state.layout_hash}")


def contribution_of(rec: LearnerRecord, transfer: Transfer) -> Contribution:
    h = transfer.header
    return Contribution(rec.learner_id, h.sequence, h.fragment_id, h.version, h.tokens, h.steps,
                        transfer.received_at, h.learner_step, rec.incarnation, h.round,
                        hand_over=h.hand_over)


class Admission:
    """Checks each contribution against the global state; answers the refused ones."""

    def __init__(self, *, ledger: Ledger, staleness_window: int, shard: str,
                 run_blocking: Callable[..., Awaitable[Any]], codec_threads: int,
                 norm_guard: NormGuard, on_clip: Callable[[Contribution, str], None],
                 weight_guard: WeightGuard | None = None, claim_guard: ClaimGuard | None = None,
                 on_bound: Callable[[Contribution, str], None] | None = None,
                 fleet_rate: Callable[[], float | None] = lambda: None,
                 wall: Callable[[], float] = time.time) -> None:
        self.ledger = ledger
        self.window = staleness_window
        self.shard = shard
        """"s/S (P=...)" for messages about fragments this shard does not own."""
        self.run_blocking = run_blocking
        self.codec_threads = codec_threads
        self.norm_guard = norm_guard
        self.on_clip = on_clip
        self.weight_guard = weight_guard or WeightGuard(WeightGuardPolicy(action="off"))
        self.claim_guard = claim_guard
        self.on_bound = on_bound
        self.fleet_rate = fleet_rate
        """The fleet clock's steps per second (None: not paced): the claim guard's pace where no
        admitted answer gave one yet."""
        self.wall = wall

    async def admit(self, rec: LearnerRecord, transfer: Transfer, c: Contribution,
                    state: LoadedState | None) -> tuple[Contribution, torch.Tensor] | None:
        """An admissible contribution (with the steps and tokens it is merged with, which the claim
        guard may have cut) and its decoded outer gradient, or None (rejected, answered)."""
        h = transfer.header
        if h.kind != "contribution":
            return self._reject(c, "protocol", f"learners may not send {h.kind} transfers")
        if state is None:
            return self._reject(c, "not_ready", "no global state yet (genesis pending)")
        frag = state.fragments.get(h.fragment_id)
        if frag is None:
            return self._reject(c, "unknown_fragment", f"fragment {h.fragment_id} is not owned by shard {self.shard}")
        if h.layout_hash and h.layout_hash != state.layout_hash:
            return self._reject(c, "layout_mismatch", f"layout {h.layout_hash} is not {state.layout_hash}")
        if h.steps == 0 or h.tokens == 0:
            return self._reject(c, "protocol", "a contribution must carry tokens > 0 and steps > 0")
        dup = frag.duplicate_of(rec.learner_id, rec.incarnation, h.sequence)
        if dup is not None:
            kind, version = dup
            if kind == "duplicate":  # sent again after a reconnect: answer, never merge twice
                self.ledger.duplicate(rec, h.sequence, h.fragment_id, version)
                return None
            return self._reject(c, "stale", f"older than contribution merged into version {version}")
        verdict = staleness_verdict(h.version, frag.version, self.window)
        if verdict is not None:
            self.ledger.reject(c, verdict.reason, verdict.detail, resync=True)
            return None
        claim = None
        if self.claim_guard is not None:
            # Where the guard knows no earlier answer, the learner's counters run from about when the
            # version it trained from was committed (after a restart: merges since then do not move
            # it), else from the fragment's last commit, or from when its process joined.
            base_at = frag.committed.get(h.version) or frag.last_merge_unix
            starts = [c.arrived_at - max(0.0, self.wall() - base_at)] if base_at > 0 else []
            starts += [rec.joined_at] if 0 < rec.joined_at <= c.arrived_at else []
            since = min(starts, default=None)
            claim = self.claim_guard.judge(rec.learner_id, h.fragment_id, steps=h.steps, tokens=h.tokens,
                                           now=c.arrived_at, base=h.version, incarnation=rec.incarnation,
                                           fallback_since=since, fallback_rate=self.fleet_rate())
            if claim.action == "reject":
                rec.faulty = "claim_outlier"
                return self._reject(c, "claim_outlier", claim.detail)
            if claim.action == "bound":
                c = dataclasses.replace(c, steps=claim.steps, tokens=claim.tokens)
        weight = self.weight_guard.judge(c.tokens, c.steps)
        if not weight.accept:
            rec.faulty = "weight_outlier"
            return self._reject(c, "weight_outlier", weight.detail)
        if weight.tokens is not None:
            c = dataclasses.replace(c, tokens=weight.tokens)
        try:
            delta = await self.run_blocking(decode_fragment, transfer, state.layout, zstd_threads=self.codec_threads)
        except FragmentError as exc:
            # Its content is broken (non-finite values, wrong shapes): until a good one arrives the
            # learner has nothing valid to give, and rounds must not wait for it.
            rec.faulty = exc.reason.lower()
            return self._reject(c, exc.reason.lower(), str(exc))
        rec.faulty = ""
        if self.norm_guard.policy.action != "off":
            verdict = self.norm_guard.judge(h.fragment_id, float(torch.linalg.vector_norm(delta)), c.steps,
                                            rec.learner_id)
            if verdict.action == "reject":
                return self._reject(c, "norm_outlier", verdict.detail)
            if verdict.action == "clip":
                delta.mul_(verdict.scale)
                self.on_clip(c, verdict.detail)
        self.weight_guard.record(rec.learner_id, c.tokens, c.steps)
        if self.claim_guard is not None and claim is not None:
            self.claim_guard.admitted(rec.learner_id, claim, c.arrived_at)
        bounded = [d for d in ((claim.detail if claim is not None and claim.action == "bound" else ""),
                               (weight.detail if weight.tokens is not None else "")) if d]
        if bounded and self.on_bound is not None:
            self.on_bound(c, "; ".join(bounded))  # admitted, with the bounded counters
        return c, delta

    def _reject(self, c: Contribution, reason: str, detail: str) -> None:
        self.ledger.reject(c, reason, detail)
        return None
