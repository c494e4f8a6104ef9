"""The global model at the synchronizer: per fragment, fp32 parameters, outer momentum, version.

Each fragment also keeps the parameters of its last few versions, so a contribution computed
against an older base can be re-anchored to the current parameters (paper App. D.2 anchors at
the synchronizer's current copy): ``Delta' = Delta + (Theta_v - Theta_b)``, i.e. the learner's
parameters ``theta = Theta_b - Delta`` measured against ``Theta_v``.
"""

from __future__ import annotations

from collections import OrderedDict
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
    history: OrderedDict[int, torch.Tensor] = field(default_factory=OrderedDict)
    last_merge_unix: float = 0.0
    last_quorum_size: int = 0
    last_grace_s: float = 0.0

    def __post_init__(self) -> None:
        self.remember(self.version, self.params)

    def remember(self, version: int, params: torch.Tensor) -> None:
        """Keep a copy of ``params`` as ``version`` for re-anchoring; drop the oldest beyond the size."""
        self.history[version] = params.clone()
        while len(self.history) > self.history_size + 1:
            self.history.popitem(last=False)

    def params_at(self, version: int) -> torch.Tensor | None:
        return self.history.get(version)

    def staleness(self, base_version: int) -> int:
        return self.version - base_version

    def advance(self, params: torch.Tensor, momentum: torch.Tensor, version: int, when: float) -> None:
        self.params, self.momentum, self.version = params, momentum, version
        self.merges += 1
        self.last_merge_unix = when
        self.remember(version, params)
