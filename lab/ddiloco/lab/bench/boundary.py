"""The floor of a learner's step boundary (``ddiloco bench learner --floor``): the arithmetic a
boundary does on the training thread, with nothing that carries fragments."""

from __future__ import annotations

import time
from typing import Any

import torch


class LocalBoundary:
    """What a step boundary computes on the training thread, alone: the learner's own
    ``LocalFragments`` (``ddiloco.learner.local``) driven as ``DecoupledSync.step()`` drives them.
    Every step its counters; at each fragment's due step its outer gradient, computed into a
    buffer (a shared-memory slot in process mode); and at the boundary its merge is due at (after
    ``overlap`` steps, or the next one where merges apply on arrival), a merged fragment copied
    (as out of a return slot) and applied by the learner's policy. The "merged" values are the
    values the fragment was sent at, so training goes on as without synchronisation. No
    communication, no events, no metrics, no synchronizer: the part of ``step()`` that no way of
    carrying fragments removes. ``seconds`` adds up the time spent here."""

    def __init__(self, model: torch.nn.Module, protocol: dict[str, Any]) -> None:
        from ddiloco.fragments.partition import partition_tensors
        from ddiloco.fragments.schedule import FragmentSchedule
        from ddiloco.learner.local import LocalFragments
        from ddiloco.learner.settings import sync_config

        cfg = sync_config({"protocol": protocol})
        p = cfg.protocol
        params: dict[str, torch.Tensor] = dict(model.named_parameters())
        self.layout = partition_tensors(list(params.items()), p.num_fragments)
        self.schedule = FragmentSchedule(num_fragments=p.num_fragments, sync_every=p.sync_every, overlap=p.overlap)
        self.on_arrival = cfg.applies_on_arrival
        self.keep_values = cfg.apply_policy == "replay"
        self.local = LocalFragments(params, self.layout, apply_policy=cfg.apply_policy, mix_alpha=cfg.mix_alpha)
        self.local.join({}, 0)
        biggest = max(f.numel for f in self.layout)
        self.slot = torch.empty(biggest)
        self.step_count = 0
        self.seconds = 0.0

    def step(self, tokens: int) -> None:
        t0 = time.perf_counter()
        self.step_count += 1
        step, local = self.step_count, self.local
        local.trained(tokens)
        for p in self.schedule.due(step):
            current, delta = local.contribution(p, self.slot[:self.layout[p].numel])
            if delta is not None:
                local[p].send(step, current, keep_values=self.keep_values)
        for p, frag in local.state.items():
            sent = frag.sent
            if sent is not None and frag.due(step + 1, self.schedule, resync=False, on_arrival=self.on_arrival):
                values = (sent.values if sent.values is not None else frag.base).clone()  # as out of a return slot
                local.apply(p, values, frag.version + 1, step + 1, resync=False)
        self.seconds += time.perf_counter() - t0


__all__ = ["LocalBoundary"]
