"""The global model at the synchronizer: per fragment, fp32 parameters, outer momentum, version.

Each fragment also keeps the parameters of its last few versions, so a contribution computed
against an older base can be re-anchored to the current parameters (paper App. D.2 anchors at
the synchronizer's current copy): ``Delta' = Delta + (Theta_v - Theta_b)``, i.e. the learner's
parameters ``theta = Theta_b - Delta`` measured against ``Theta_v``.

The running synchronizer does not hold those versions: every version is committed to the state
dir before it becomes current, and the store keeps as many files as the staleness window needs,
so ``params_at`` reads an older version back from its file (``keep_on_disk``) when a merge has a
stale contribution. Held in memory they cost 4 bytes per parameter each (16 of the 8 + 16 bytes
per parameter with the default window of 4).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ddiloco.fragments.partition import Fragment


@dataclass
class GlobalFragment:
    spec: Fragment
    params: torch.Tensor
    momentum: torch.Tensor
    version: int
    merges: int = 0
    history_size: int = 4
    history: OrderedDict[int, torch.Tensor | None] = field(default_factory=OrderedDict)
    """Retained versions, oldest first: their parameters, or None when ``reader`` reads them back."""
    reader: Callable[[int], torch.Tensor | None] | None = None
    """Reads a retained version's parameters from its committed file (None: held in memory)."""
    last_merge_unix: float = 0.0
    last_quorum_size: int = 0
    last_grace_s: float = 0.0
    committed: OrderedDict[int, float] = field(default_factory=OrderedDict)
    """When each retained version was committed (unix time; loaded with the state)."""
    last_merged: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    """learner id -> (incarnation, sequence, version) of its newest merged contribution; survives
    restarts through the committed files, so a contribution sent again is never merged twice."""

    def __post_init__(self) -> None:
        self.remember(self.version, self.params)

    def remember(self, version: int, params: torch.Tensor) -> None:
        """Retain ``version`` for re-anchoring (its parameters, unless they are read back from the
        store); drop the oldest beyond the size. ``params`` is never modified in place later: a
        merge makes new tensors."""
        self.history[version] = None if self.reader is not None else params
        while len(self.history) > self.history_size + 1:
            self.history.popitem(last=False)
        while len(self.committed) > self.history_size + 1:
            self.committed.popitem(last=False)

    def note_committed(self, version: int, when: float) -> None:
        self.committed[version] = when
        self.committed.move_to_end(version)

    def keep_on_disk(self, reader: Callable[[int], torch.Tensor | None]) -> None:
        """From now on read retained versions back with ``reader`` instead of holding them."""
        self.reader = reader
        for v in self.history:
            self.history[v] = None

    def retains(self, version: int) -> bool:
        """Whether ``version`` can be re-anchored against (without reading it)."""
        return version == self.version or version in self.history

    def params_at(self, version: int) -> torch.Tensor | None:
        """The parameters of ``version`` (None when not retained, or its file no longer verifies)."""
        if version == self.version:
            return self.params
        if version not in self.history:
            return None
        held = self.history[version]
        if held is not None or self.reader is None:
            return held
        return self.reader(version)

    def advance(self, params: torch.Tensor, momentum: torch.Tensor, version: int, when: float,
                contributors: dict[str, list[int]] | None = None) -> None:
        self.params, self.momentum, self.version = params, momentum, version
        self.merges += 1
        self.last_merge_unix = when
        self.note_committed(version, when)
        self.remember(version, params)
        self.note_merged(version, contributors or {})

    def note_merged(self, version: int, contributors: dict[str, list[int]]) -> None:
        for learner_id, (incarnation, sequence) in contributors.items():
            self.last_merged[learner_id] = (incarnation, sequence, version)

    def duplicate_of(self, learner_id: str, incarnation: int, sequence: int) -> tuple[str, int] | None:
        """("duplicate", version) if this exact contribution was merged; ("older", version) if a newer
        one from the same learner process was; None otherwise."""
        known = self.last_merged.get(learner_id)
        if known is None or known[0] != incarnation:
            return None
        if sequence == known[1]:
            return "duplicate", known[2]
        if sequence < known[1]:
            return "older", known[2]
        return None
