"""A learner's side of one fragment: its state and the rules that move it, as pure code.

``RoundState`` is the synchronizer's record of a fragment round; ``LearnerFragment`` is the
learner's record of a fragment: the global version it last applied and its values (the base the
outer gradient is taken from), the counters (tokens, inner steps) the next contribution carries,
the step its window of local progress starts at, and the last contribution sent while its merge
is not yet applied. Its transitions are the learner's rules, with no I/O, thread or clock:

- ``trained`` — one inner step done: the counters grow;
- ``answer_held`` — a request finds the previous answer's merge not yet applied (answering would
  count that answer's steps twice);
- ``contribution`` / ``sent`` — the outer gradient ``base - current`` and the record of what went;
- ``hand_over`` — training is over: whether the progress since the last send still has to go;
- ``due`` — whether a merged fragment that arrived may be applied at a step boundary (``tau``
  steps after the send, never before this learner's own progress is on its way);
- ``apply`` — a merged fragment into the local values by an apply policy, counters carried over;
- ``heal`` — back to the base, counters from zero.

Three apply policies, as pure functions of flat fp32 buffers:

- ``overwrite`` (the paper's): theta = Theta. Local progress since the send is dropped; the next
  contribution's counters start from zero at the apply.
- ``mix`` (Streaming DiLoCo): theta = alpha * theta + (1 - alpha) * Theta.
- ``replay``: theta = Theta + (theta_now - theta_at_send): the global result plus exactly the local
  progress made since the fragment was sent, so no local work is discarded.

For mix and replay the counters keep the tokens and steps accumulated since the send, because the
next contribution (``base - theta`` with the new base ``Theta``) carries that progress.

``DecoupledSync`` (the learner service's sync client) and the study's in-process reference run
these rules, so the reference judges the rules the service runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddiloco.fragments.outer_gradient import all_finite, outer_gradient
from ddiloco.fragments.schedule import FragmentSchedule

APPLY_POLICIES: tuple[str, ...] = ("overwrite", "mix", "replay")


def apply_global(policy: str, *, local: torch.Tensor, global_: torch.Tensor, reference: torch.Tensor,
                 alpha: float = 0.5) -> torch.Tensor:
    """The new local values of a fragment (a new tensor; inputs are not modified).

    ``reference`` is the point up to which local progress has been handed to the synchronizer:
    the values at the last send, or the old base when nothing was sent since it (another learner's
    merge arrived first). Replay keeps exactly the progress beyond it.
    """
    if policy not in APPLY_POLICIES:
        raise ValueError(f"unknown apply policy {policy!r}")
    if local.shape != global_.shape:
        raise ValueError(f"shape mismatch: local {tuple(local.shape)} vs global {tuple(global_.shape)}")
    if policy == "overwrite":
        return global_.clone()
    if policy == "mix":
        return torch.lerp(global_, local, alpha)
    return global_ + (local - reference)


def counters_after_apply(policy: str, now: tuple[int, int], at_send: tuple[int, int] | None) -> tuple[int, int]:
    """(tokens, steps) the next contribution starts from after applying under ``policy``.

    ``at_send`` is the counters' value at the last send since the old base (None: nothing sent).
    """
    if policy == "overwrite":
        return 0, 0
    if at_send is None:
        return now
    return now[0] - at_send[0], now[1] - at_send[1]


@dataclass
class Sent:
    """The last contribution sent for a fragment, until its merge is applied."""

    step: int
    counters: tuple[int, int]
    """(tokens, steps) it carried."""
    base_version: int
    values: torch.Tensor | None
    """The local values when it was sent (kept for ``replay`` only)."""


@dataclass
class LearnerFragment:
    """One learner's protocol state for fragment ``index``."""

    index: int
    base: torch.Tensor
    """The values of the global version last applied (or joined at): the outer gradient's anchor."""
    version: int = 0
    tokens: int = 0
    steps: int = 0
    window_start: int = 1
    """The first inner step whose progress the next contribution carries."""
    sent: Sent | None = None

    @property
    def counters(self) -> tuple[int, int]:
        return self.tokens, self.steps

    def trained(self, tokens: int) -> None:
        """One inner step on ``tokens`` tokens was taken."""
        self.tokens += tokens
        self.steps += 1

    def answer_held(self, step: int, sync_every: int) -> bool:
        """Whether a request at ``step`` finds the previous answer's merge not yet applied, less
        than ``sync_every`` steps after it was sent. The counters run from the last applied merge,
        so answering would count that answer's steps again (a learner slower than the fleet's pace
        is asked again before its merge comes back). An answer whose merge never comes (lost in a
        synchronizer restart) holds the fragment back ``sync_every`` steps at most."""
        return self.sent is not None and step - self.sent.step < sync_every

    def contribution(self, current: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """The outer gradient ``base - current`` to send (computed into ``out`` when given); None
        when it is not finite (heal instead)."""
        delta = outer_gradient(self.base, current, out)
        return delta if all_finite(delta) else None

    def send(self, step: int, current: torch.Tensor, *, keep_values: bool) -> None:
        """The contribution of ``step`` (the current counters) went; ``keep_values``: remember
        ``current`` (what ``replay`` needs to keep the progress made after the send)."""
        self.sent = Sent(step, self.counters, self.version, current if keep_values else None)

    def hand_over(self, step: int) -> bool:
        """Training ended at ``step``: whether the progress since the last send must still go.
        The counters stay those since the base, as the outer gradient ``base - current`` does:
        where an answer still awaits its merge, the hand-over carries that answer's progress too
        (the synchronizer replaces the waiting answer with it, the same base's; where it was merged
        already, the merge re-anchors the hand-over to the current version, so its progress is not
        applied twice, and only its weight counts that answer's steps again). Counting only the
        steps since the send under a delta from the base made the update look up to a period's
        worth of steps larger per step, and the norm guard refused it (2.37 over 1 step, where an
        honest answer's norm was 0.08 a step)."""
        return self.sent is None or self.sent.step != step

    def due(self, step: int, schedule: FragmentSchedule, *, resync: bool, on_arrival: bool = False) -> bool:
        """Whether a merged fragment that arrived may be applied at the boundary before ``step``.
        A resync (after a heal or a rejoin) applies at once. A merge of other learners'
        contributions that arrives before this learner's own was sent waits until it is on its
        way, so no unsent local progress is thrown away; a merge of its own waits ``tau`` steps
        after the send, or, ``on_arrival``, one step at least (it applies at the first boundary
        after it arrived: the staleness is the round's real latency, not the budget ``tau``)."""
        if resync:
            return True
        if self.sent is None:
            return False
        return step > (self.sent.step + 1 if on_arrival else schedule.apply_step(self.sent.step))

    def apply(self, policy: str, *, local: torch.Tensor, values: torch.Tensor, version: int, step: int,
              resync: bool = False, alpha: float = 0.5) -> torch.Tensor | None:
        """Apply the merged ``values`` of global ``version`` at the boundary before ``step``; returns
        the new local values, or None when ``version`` is not newer than the one applied (a
        resync always applies, by ``overwrite``)."""
        applied = self._policy(policy, version, resync)
        if applied is None:
            return None
        new = apply_global(applied, local=local, global_=values, reference=self._reference(), alpha=alpha)
        self._commit(applied, values, version, step)  # after the arithmetic: bad input changes nothing
        return new

    def accept(self, policy: str, *, values: torch.Tensor, version: int, step: int,
               resync: bool = False) -> tuple[str, torch.Tensor] | None:
        """``apply``'s bookkeeping without its arithmetic, for a caller that writes the new values
        itself (and checked them first): None when ``version`` is not newer than the one applied,
        else the policy it applies by and the reference of ``apply_global``. ``values`` is the new
        base from here on."""
        applied = self._policy(policy, version, resync)
        if applied is None:
            return None
        if applied not in APPLY_POLICIES:
            raise ValueError(f"unknown apply policy {applied!r}")
        reference = self._reference()
        self._commit(applied, values, version, step)
        return applied, reference

    def _policy(self, policy: str, version: int, resync: bool) -> str | None:
        """The policy ``version`` is applied by (a resync always applies, by ``overwrite``), or None
        when it is not newer than the one applied."""
        if resync:
            return "overwrite"
        return policy if version > self.version else None

    def _reference(self) -> torch.Tensor:
        """The point up to which local progress was handed over (see ``apply_global``)."""
        sent = self.sent
        return sent.values if (sent is not None and sent.values is not None) else self.base

    def _commit(self, policy: str, values: torch.Tensor, version: int, step: int) -> None:
        sent, self.sent = self.sent, None
        self.base, self.version = values, version
        self.tokens, self.steps = counters_after_apply(policy, self.counters, sent.counters if sent else None)
        if policy == "overwrite":
            self.window_start = step
        elif sent is not None:
            self.window_start = sent.step + 1

    def heal(self, step: int) -> torch.Tensor:
        """Back to the base (returned, to be written into the parameters): counters from zero,
        the window from the next step, nothing awaiting a merge."""
        self.tokens = self.steps = 0
        self.window_start = step + 1
        self.sent = None
        return self.base


__all__ = ["APPLY_POLICIES", "LearnerFragment", "Sent", "apply_global", "counters_after_apply"]
