"""The learner's model cut into fragments: parameters on one side, each fragment's protocol state
(``LearnerFragment``) on the other.

``LocalFragments`` moves values between the two (``gather``/``scatter`` of flat fp32 buffers) and
runs the learner's rules on them: the outer gradient of a contribution, a merged fragment applied
by the apply policy, a fragment healed back to its base with fresh optimizer moments. It does no
I/O and knows nothing of the stream: ``DecoupledSync`` decides when, and hands what comes out to
the communication thread.
"""

from __future__ import annotations

import time

import torch

from ddiloco.algorithm.learner_fragment import LearnerFragment, apply_global
from ddiloco.fragments.outer_gradient import BoundFragment
from ddiloco.fragments.partition import FragmentLayout


class LocalFragments:
    """``params`` (name -> tensor, any device and dtype) in the fragments of ``layout``."""

    def __init__(self, params: dict[str, torch.Tensor], layout: FragmentLayout, *, apply_policy: str,
                 mix_alpha: float, optimizer: torch.optim.Optimizer | None = None) -> None:
        self.params, self.layout = params, layout
        tied = _sharing_storage(params)
        self.bound = [BoundFragment(f, params, adopt=not any(t.name in tied for t in f.tensors)) for f in layout]
        """Each fragment's gather and scatter, bound to ``params``. The fp32 CPU parameters of each
        fragment are laid out in one buffer of their own (``BoundFragment``'s ``adopt``), so that a
        boundary reads and writes a fragment in one call into torch; not those of a fragment with a
        parameter that shares its storage with another parameter (moving it would untie them)."""
        self.apply_policy, self.mix_alpha, self.optimizer = apply_policy, mix_alpha, optimizer
        self.state: dict[int, LearnerFragment] = {}
        """Fragment -> its protocol state (from ``join`` on)."""
        self.touched: dict[int, bool] = {}
        """Fragments whose parameters the current step's boundary overwrote: fragment -> healed."""
        self.timings: dict[str, list[float]] = {}
        """Where the training thread's time goes: phase -> [calls, seconds] (``time.perf_counter``):
        per fragment ``gather`` (its parameters into one fp32 tensor), ``outer_gradient`` (base -
        current, finiteness check), ``apply`` (a merged fragment into the parameters); ``step`` and
        ``handoff`` are added by ``DecoupledSync``. Costs a few clock reads, changes nothing."""

    def __getitem__(self, p: int) -> LearnerFragment:
        return self.state[p]

    @property
    def versions(self) -> dict[int, int]:
        return {p: f.version for p, f in self.state.items()}

    def time(self, phase: str, t0: float) -> float:
        """Add the seconds since ``t0`` to ``timings[phase]``; returns the clock now."""
        now = time.perf_counter()
        entry = self.timings.setdefault(phase, [0, 0.0])
        entry[0] += 1
        entry[1] += now - t0
        return now

    def values(self) -> dict[int, torch.Tensor]:
        """Every fragment's current values (a genesis upload)."""
        return {f.index: self.bound[f.index].gather() for f in self.layout}

    def join(self, fetched: dict[int, tuple[int, torch.Tensor]], start_step: int) -> None:
        """Start from the fleet's ``fetched`` (fragment -> (version, values)) written into the
        parameters; a fragment not fetched (a genesis) starts from its own values at version 0."""
        self.state = {}
        for frag in self.layout:
            if frag.index in fetched:
                version, values = fetched[frag.index]
                self.bound[frag.index].scatter(values)
                state = LearnerFragment(frag.index, values.clone(), version)
            else:
                state = LearnerFragment(frag.index, self.bound[frag.index].gather())
            state.window_start = start_step + 1
            self.state[frag.index] = state

    def follow(self, versions: list[int]) -> None:
        """Another rank's view: the versions only (rank 0 holds the bases and sends)."""
        self.state = {f.index: LearnerFragment(f.index, torch.empty(0), v)
                      for f, v in zip(self.layout, versions, strict=True)}

    def trained(self, tokens: int) -> None:
        for state in self.state.values():
            state.trained(tokens)

    def contribution(self, p: int, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(current values, outer gradient) of fragment ``p``; the gradient is None when not finite.
        ``out``: where to compute the gradient (flat fp32, the fragment's size)."""
        t0 = time.perf_counter()
        current = self.bound[p].gather()
        t0 = self.time("gather", t0)
        delta = self.state[p].contribution(current, out)
        self.time("outer_gradient", t0)
        return current, delta

    def apply(self, p: int, values: torch.Tensor, version: int, step: int, *, resync: bool) -> str | None:
        """Apply a merged fragment at the boundary before ``step``; the policy it was applied by,
        or None when ``version`` is not newer than the one held."""
        t0 = time.perf_counter()
        bound = self.bound[p]
        if values.numel() != bound.fragment.numel:
            raise ValueError(f"fragment {p} has {bound.fragment.numel} values, got {values.numel()}")
        if values.dtype != torch.float32 or values.dim() != 1:  # the base is flat fp32, as the arithmetic below
            values = values.detach().reshape(-1).float()
        accepted = self.state[p].accept("overwrite" if resync else self.apply_policy, values=values,
                                        version=version, step=step, resync=resync)
        if accepted is None:
            return None
        policy, reference = accepted
        # ``apply_global``'s arithmetic, written into the parameters with as few calls into torch
        # as it allows (each costs tens of microseconds right after an inner step)
        if policy == "overwrite":
            bound.scatter(values)
        elif policy == "replay":
            bound.replay(reference, values)
        else:
            bound.scatter(apply_global(policy, local=bound.gather(), global_=values, reference=reference,
                                       alpha=self.mix_alpha))
        self.time("apply", t0)
        self.touched.setdefault(p, False)
        return policy

    def heal(self, fragments: list[int], step: int) -> None:
        """Put ``fragments`` back to their base, with fresh optimizer moments and counters."""
        for p in fragments:
            self.bound[p].scatter(self.state[p].heal(step))
            self.drop_moments(p)
            self.touched[p] = True

    def drop_moments(self, p: int) -> None:
        """Forget the optimizer's state of fragment ``p``'s parameters."""
        if self.optimizer is not None:
            for spec in self.layout[p].tensors:
                self.optimizer.state.pop(self.params[spec.name], None)


def _sharing_storage(params: dict[str, torch.Tensor]) -> set[str]:
    """The names of the parameters whose storage another parameter uses too."""
    by_storage: dict[tuple[str, int], list[str]] = {}
    for name, t in params.items():
        if t.numel():
            by_storage.setdefault((str(t.device), t.untyped_storage().data_ptr()), []).append(name)
    return {name for names in by_storage.values() if len(names) > 1 for name in names}


__all__ = ["LocalFragments"]
