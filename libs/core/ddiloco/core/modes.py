"""Mode presets: DiLoCo, Streaming DiLoCo and Decoupled DiLoCo as settings of one code path.

The three algorithms differ only in a few constants, so they are one table here, and the table is
applied in one place: ``apply_mode`` fills a config document with the preset of its mode before
any component validates it, and each component's validation refuses a config that contradicts
its mode's preset (say, a diloco protocol with 24 fragments) instead of silently changing it.

- ``decoupled`` (Decoupled DiLoCo): P fragments on staggered offsets, overlap tau, merges after a
  minimum quorum K plus the adaptive grace window; learners never wait. The synchronizer clocks
  the rounds: it asks every live learner for a fragment when it falls due on the fleet's clock.
- ``streaming`` (Streaming DiLoCo): the same fragments and overlap, but every merge waits for
  every live learner (bounded by a timeout), and each learner waits for the merged fragment tau
  steps after sending it.
- ``diloco`` (DiLoCo): one fragment (the whole model), no overlap, every live learner, and
  learners block until the merged model arrives.

In the two modes where learners wait for merges, each learner sends a fragment when its *own*
step count reaches the fragment's offset, as those algorithms define it: the waiting keeps the
fleet in lockstep, so the contributions of a round are aligned without a clock, and every learner
makes exactly H steps per period. Clocked by the synchronizer instead, a fleet whose steps are
faster than its heartbeats ran ahead of the clock (a 40-step diloco run finished before the first
request) and rounds covered fewer than H steps (the waiting counted in the clock's pace).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Literal, get_args

Mode = Literal["decoupled", "streaming", "diloco"]
MODES: tuple[str, ...] = get_args(Mode)


@dataclass(frozen=True)
class ModePreset:
    """What a mode fixes; None leaves the setting to the config."""

    num_fragments: int | None
    """P, when the mode fixes it."""
    overlap: int | None
    """tau, when the mode fixes it."""
    quorum: int | None
    """Merge quorum K, when the mode fixes it (0: every live learner)."""
    timeout_s: float | None
    """Merge timeout used when the config sets none (so one dead learner cannot stall a round
    that waits for every live learner forever)."""
    learners_wait: bool
    """Whether a learner blocks for a merged fragment (tau steps after sending it). These modes
    are also learner-clocked: a learner sends a fragment at its own due step, not on request."""


PRESETS: dict[str, ModePreset] = {
    "decoupled": ModePreset(num_fragments=None, overlap=None, quorum=None, timeout_s=None, learners_wait=False),
    "streaming": ModePreset(num_fragments=None, overlap=None, quorum=0, timeout_s=120.0, learners_wait=True),
    "diloco": ModePreset(num_fragments=1, overlap=0, quorum=0, timeout_s=120.0, learners_wait=True),
}


def preset(mode: str) -> ModePreset:
    try:
        return PRESETS[mode]
    except KeyError:
        raise ValueError(f"unknown mode {mode!r}; known: {', '.join(MODES)}") from None


def apply_mode(document: dict[str, Any], mode: str | None = None) -> dict[str, Any]:
    """A copy of a config document with its mode's preset applied.

    ``mode`` (a command-line choice) wins over ``protocol.mode`` in the document. The preset
    sets ``protocol.mode``, the protocol constants the mode fixes, and the synchronizer's quorum
    and (when the document sets none) merge timeout.
    """
    doc = copy.deepcopy(document)
    protocol = doc.setdefault("protocol", {})
    if not isinstance(protocol, dict):
        return doc  # validation reports the section's type
    mode = mode or protocol.get("mode") or "decoupled"
    p = preset(mode) if isinstance(mode, str) else None
    if p is None:
        return doc
    protocol["mode"] = mode
    if p.num_fragments is not None:
        protocol["num_fragments"] = p.num_fragments
    if p.overlap is not None:
        protocol["overlap"] = p.overlap
    sync = doc.setdefault("synchronizer", {})
    if isinstance(sync, dict):
        policy = sync.setdefault("policy", {})
        if isinstance(policy, dict):
            if p.quorum is not None:
                policy["quorum"] = p.quorum
            if p.timeout_s is not None and policy.get("timeout_s") is None:
                policy["timeout_s"] = p.timeout_s
    return doc
