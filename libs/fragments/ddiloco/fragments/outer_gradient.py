"""Flat fp32 fragment buffers and outer gradients.

Every outer-gradient computation happens in fp32, whatever the parameters' dtype: measured on
bf16 weights, subtracting two bf16 tensors rounds away about 99% of small per-step updates, so
the learner keeps its base copy in fp32 and subtracts in fp32 before any codec touches the
result. ``Delta = base - theta`` (the sign convention of DiLoCo: the outer optimizer subtracts
``lr * Delta``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from ddiloco.fragments.partition import Fragment

if TYPE_CHECKING:
    import torch


def gather(fragment: Fragment, params: Mapping[str, torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy the fragment's tensors, in order, into one flat fp32 CPU buffer."""
    import torch

    if out is None:
        out = torch.empty(fragment.numel, dtype=torch.float32)
    elif out.numel() != fragment.numel or out.dtype != torch.float32:
        raise ValueError(f"out buffer must be fp32 with {fragment.numel} values")
    for name, start, end in fragment.segments():
        src = params[name].detach()
        out[start:end].copy_(src.reshape(-1), non_blocking=False)
    return out


def scatter(fragment: Fragment, flat: torch.Tensor, params: Mapping[str, torch.Tensor]) -> None:
    """Write a flat fp32 buffer back into the fragment's parameters (in place, their dtype)."""
    import torch

    if flat.numel() != fragment.numel:
        raise ValueError(f"flat buffer has {flat.numel()} values, fragment {fragment.index} has {fragment.numel}")
    with torch.no_grad():
        for spec, (name, start, end) in zip(fragment.tensors, fragment.segments(), strict=True):
            dst = params[name]
            dst.copy_(flat[start:end].view(spec.shape).to(device=dst.device, dtype=dst.dtype))


def outer_gradient(base: torch.Tensor, current: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Delta = base - current, computed in fp32 (inputs of lower precision are upcast first)."""
    import torch

    if base.shape != current.shape:
        raise ValueError(f"shape mismatch: base {tuple(base.shape)} vs current {tuple(current.shape)}")
    b = base if base.dtype == torch.float32 else base.float()
    c = current if current.dtype == torch.float32 else current.float()
    if out is None:
        return torch.sub(b, c)
    return torch.sub(b, c, out=out)


def segment_views(fragment: Fragment, flat: torch.Tensor) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like each tensor of the fragment."""
    return [flat[s:e].view(spec.shape) for spec, (_, s, e) in zip(fragment.tensors, fragment.segments(), strict=True)]


def all_finite(values: torch.Tensor) -> bool:
    """Whether every value is finite (no NaN, no +-inf).

    IEEE arithmetic carries a NaN or an infinity into any sum it takes part in, so a finite sum
    proves every value finite: one reduction that allocates nothing, where ``isfinite().all()``
    builds a boolean tensor the size of the input first (measured on 2 cores, 16M fp32 values:
    3 ms against 42). A non-finite sum is either a non-finite value or finite values whose sum
    overflows; only then is every value checked. The sum is read as a Python float and checked by
    ``math.isfinite``, not by ``torch.isfinite``: on a learner's training thread, right after an
    inner step, a call into torch's ``isfinite`` took about 95 us where summing and reading the sum
    took 30 (a kernel training never runs is cold then; measured at 0.24M parameters).
    """
    import math

    import torch

    if values.numel() == 0:
        return True
    if math.isfinite(values.sum().item()):
        return True
    return bool(torch.isfinite(values).all())


class BoundFragment:
    """A fragment bound to a model's parameters: ``gather``, ``scatter`` and ``replay`` as above,
    in as few calls into torch as the parameters' layout allows.

    On a small model the calls are most of the cost: at 0.24M parameters (24 fragments of 1-8
    tensors) a fragment's gather took about 0.3 ms in Python, the same in one ``cat`` about 0.012 ms.
    Each call costs a few tens of microseconds more right after an inner step, which evicted its code
    and data from the caches.

    - **One flat buffer.** When the fragment's tensors lie one after another in one storage (fp32,
      on the CPU, contiguous), the fragment is that stretch of storage: a gather is one copy, a
      scatter one copy, a replay two in-place operations. ``adopt=True`` lays them out so, where
      they are not already: it copies the fragment's parameters into one new fp32 buffer and points
      each parameter at its part of it (``param.data = ...``). Their values, identities, gradients
      and optimizer state are unchanged; only where their values are stored moves. Only tensors that
      can move without breaking a sharing are moved (``_movable``: an ``nn.Parameter`` that is the
      whole of its storage, not in shared memory); the caller leaves out parameters tied to others
      by one storage. Writes through the buffer mark every tensor of the fragment as changed in
      place, as writes through their own views do (autograd's version counters). Measured with a
      30 MB buffer touched between calls, as an inner step does: a replay and the gather before it
      took 87 us on views of separate tensors and 36 us on one buffer.
    - **Views.** Otherwise, on fp32 CPU contiguous tensors: one ``torch.cat`` into the flat buffer,
      one ``_foreach_copy_`` out of it.
    - Parameters on another device, of another dtype or not contiguous take the module-level
      functions.

    The layout is found once. Every call checks that each parameter still has the storage it was
    found with (``model.to(...)`` or an assignment to ``.data`` gives it another one) and finds it
    again when one does not (adopting the new storage, with ``adopt``).
    """

    def __init__(self, fragment: Fragment, params: Mapping[str, torch.Tensor], *, adopt: bool = False) -> None:
        self.fragment, self.params, self.adopt = fragment, params, adopt
        self.sizes = [spec.numel for spec in fragment.tensors]
        self._views: list[torch.Tensor] | None = None
        self._flat: torch.Tensor | None = None
        self._others: list[torch.Tensor] = []
        self._ptrs: list[int] = []
        self._bind()

    def _bind(self) -> None:
        import torch

        live = [self.params[spec.name] for spec in self.fragment.tensors]
        fast = all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()
                   and t.numel() == spec.numel for t, spec in zip(live, self.fragment.tensors, strict=True))
        self._flat, self._others = None, []
        if fast and all(t.numel() for t in live):  # an empty tensor has no address to lay out by
            adjacent = _adjacent(live)
            if not adjacent and self.adopt and all(_movable(t) for t in live):
                flat = torch.empty(self.fragment.numel, dtype=torch.float32)
                torch.cat([t.detach().view(-1) for t in live], out=flat)
                for t, spec, (_, start, end) in zip(live, self.fragment.tensors, self.fragment.segments(), strict=True):
                    t.data = flat[start:end].view(spec.shape)
                adjacent = True
            if adjacent:
                self._flat = live[0].detach().as_strided((self.fragment.numel,), (1,))
                self._others = live[1:]
        self._views = [t.detach().view(-1) for t in live] if fast else None
        self._ptrs = [t.data_ptr() for t in live]

    def _written(self) -> None:
        """After a write through the flat buffer: it shares the first tensor's version counter
        only, so the others are marked as changed in place here, as a write through their own views
        marked them (a backward that saved one of them then fails, as it should, instead of using
        the new values)."""
        if self._others:
            import torch

            torch.autograd.graph.increment_version(self._others)

    @property
    def flat(self) -> torch.Tensor | None:
        """The fragment's values as one flat fp32 tensor over the parameters' own storage (writing
        to it writes the parameters), or None where they do not lie in one buffer."""
        self._current()
        return self._flat

    def _current(self) -> list[torch.Tensor] | None:
        """The flat views, made again if a parameter's storage changed; None: not bindable."""
        if [self.params[spec.name].data_ptr() for spec in self.fragment.tensors] != self._ptrs:
            self._bind()
        return self._views

    def gather(self, out: torch.Tensor | None = None) -> torch.Tensor:
        import torch

        views = self._current()
        if views is None:
            return gather(self.fragment, self.params, out)
        if out is not None and (out.numel() != self.fragment.numel or out.dtype != torch.float32):
            raise ValueError(f"out buffer must be fp32 with {self.fragment.numel} values")
        if self._flat is not None:
            return self._flat.clone() if out is None else out.copy_(self._flat)
        if out is None:
            out = torch.empty(self.fragment.numel, dtype=torch.float32)
        return torch.cat(views, out=out)

    def scatter(self, flat: torch.Tensor) -> None:
        import torch

        views = self._current()
        if views is None or flat.dtype != torch.float32 or flat.device.type != "cpu":
            return scatter(self.fragment, flat, self.params)
        if flat.numel() != self.fragment.numel:
            raise ValueError(f"flat buffer has {flat.numel()} values, fragment {self.fragment.index} has "
                             f"{self.fragment.numel}")
        with torch.no_grad():
            if self._flat is not None:
                self._flat.copy_(flat.reshape(-1))
                self._written()
            else:
                torch._foreach_copy_(views, flat.reshape(-1).split_with_sizes(self.sizes))

    def replay(self, reference: torch.Tensor, values: torch.Tensor) -> None:
        """The parameters become ``values + (current - reference)`` (flat fp32 buffers): the
        progress made since ``reference``, on top of ``values``. Bound, in place, without gathering:
        ``current - reference`` then ``+ values`` per tensor, the same rounding as the expression
        (one subtraction, then one addition, which commutes exactly), in two calls into torch where
        gather, subtract, add and scatter took five and three fragment-sized temporaries."""
        import torch

        for name, flat in (("reference", reference), ("values", values)):
            if flat.numel() != self.fragment.numel or flat.dtype != torch.float32:
                raise ValueError(f"{name} must be fp32 with {self.fragment.numel} values")
        views = self._current()
        if views is None or reference.device.type != "cpu" or values.device.type != "cpu":
            self.scatter(values + (self.gather() - reference))
            return
        with torch.no_grad():
            if self._flat is not None:
                self._flat.sub_(reference.reshape(-1)).add_(values.reshape(-1))
                self._written()
            else:
                torch._foreach_sub_(views, reference.reshape(-1).split_with_sizes(self.sizes))
                torch._foreach_add_(views, values.reshape(-1).split_with_sizes(self.sizes))


def _adjacent(tensors: list[torch.Tensor]) -> bool:
    """Whether contiguous fp32 ``tensors`` (none empty) lie one right after another in one storage."""
    first = tensors[0].untyped_storage()
    storage, size = first.data_ptr(), first.nbytes()
    end = tensors[0].data_ptr()
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() != storage or s.nbytes() != size or t.data_ptr() != end:
            return False
        end += 4 * t.numel()
    return end <= storage + size


def _movable(t: torch.Tensor) -> bool:
    """Whether ``t`` may be given a new storage without breaking anything that shares its present
    one: an ``nn.Parameter`` (a detached alias pointed elsewhere would leave training updating the
    storage it left) that is the whole of its storage (not a view into a buffer of the user's) and
    not in shared memory (``share_memory_()``: other processes read it there). Two parameters that
    are each the whole of one shared storage look movable here: the caller, which sees them all,
    leaves them out."""
    import torch

    return (isinstance(t, torch.nn.Parameter) and t.storage_offset() == 0 and not t.is_shared()
            and t.untyped_storage().nbytes() == t.numel() * t.element_size())
