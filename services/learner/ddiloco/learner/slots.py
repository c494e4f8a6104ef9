"""Fragment-sized buffers shared between a learner's training process and its communication process.

A ``SlotPool`` is one block of shared memory cut into ``count`` slots of ``slot_bytes`` each. The
process that writes into the slots creates it and keeps the free list (the owner); the other
process maps the same block from its file descriptor (``SlotPool.attach``: the descriptor is
inherited when the peer is started). The owner's ``put`` copies a tensor into a free slot (the
hand-off's one copy) and returns a ``SlotRef``, a small picklable handle that travels over the
control channel; the peer reads it with ``view`` (a tensor over the shared memory, no copy) and,
when done, says so on the control channel, and the owner's ``free`` returns the slot. ``reclaim``
frees every slot at once: refs handed out before it carry an older generation and are refused
from then on, so a late release of a reclaimed slot cannot free it a second time.

The block is anonymous (``memfd_create`` on Linux; elsewhere a temporary file removed as soon as
it is open): it has no name to leak, and the kernel frees it when the last process holding it
exits, however that process ends (a SIGKILL included). Only fp32 travels here (fragments are flat
fp32 on the CPU). Nothing here blocks: a full pool makes ``put`` return None, and the caller
decides what to do instead.

``ReturnSlots`` goes the other way (merged fragments from the communication process back to
training) and needs no message back: each slot's state (free or filled) is a byte at the head of
the block. The writer fills a free slot and marks it; the reader copies the values out and marks
it free again. Either process may die at any moment: the training process creates the block (it
outlives any communication process) and, before it starts another, frees every slot (no values of
its own stay in one: a take copies them out at once).
"""

from __future__ import annotations

import mmap
import os
import struct
import tempfile
import threading
import time
from dataclasses import dataclass

import torch

_ALIGN = 64


@dataclass(frozen=True, slots=True)
class SlotRef:
    """One filled slot: where it is, how many fp32 values it holds, and the pool generation."""

    slot: int
    numel: int
    generation: int


def _anonymous_file(size: int) -> int:
    """A descriptor of ``size`` bytes of shared memory that no path names."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("ddiloco-slots", os.MFD_CLOEXEC)
    else:  # pragma: no cover - not Linux
        with tempfile.NamedTemporaryFile(delete=False) as f:
            fd = os.dup(f.fileno())
        os.unlink(f.name)
    os.ftruncate(fd, size)
    return fd


class _Mapped:
    """A shared block this process mapped from its descriptor ``fd`` (``buf``)."""

    fd: int
    buf: mmap.mmap

    def close(self) -> None:
        """Close this process's descriptor and let go of the block (a second call does nothing).
        The mapping goes with the last tensor that views it: ``torch.frombuffer`` keeps a reference
        to the mapping but no buffer export, so ``mmap.close`` would unmap it under a view still held
        somewhere (a traceback's frame, a caller's variable), whose next read would crash the process."""
        if self.fd < 0:
            return
        fd, self.fd = self.fd, -1
        del self.buf
        os.close(fd)


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class Claim:
    """A slot held for values its holder computes in place: ``values`` is the slot's memory."""

    values: torch.Tensor
    ref: SlotRef


class _Slots(_Mapped):
    """``count`` slots of ``slot_bytes`` each, from byte ``head`` of the block on."""

    count: int
    slot_bytes: int
    head: int = 0

    @property
    def max_values(self) -> int:
        return self.slot_bytes // 4

    def _tensor(self, slot: int, numel: int) -> torch.Tensor:
        if numel == 0:
            return torch.empty(0)
        return torch.frombuffer(self.buf, dtype=torch.float32, count=numel, offset=self.head + slot * self.slot_bytes)

    def _view(self, slot: int, numel: int) -> torch.Tensor:
        """``_tensor``, made once per slot and size and kept (a learner's fragments come in a few
        sizes): at a step boundary every call into torch costs tens of microseconds. ``close``
        drops them."""
        key = (slot, numel)
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = self._tensor(slot, numel)
        return view

    def close(self) -> None:
        self._views.clear()
        super().close()


class SharedValues(_Mapped):
    """A few float64 values one process writes and another reads, in shared memory, with no
    message and no lock: the writer bumps a sequence number to odd before it writes and to even
    after; a reader retries a copy that saw it odd or changed (a sequence lock). Integers are
    exact up to 2**53. Read and written with ``struct`` straight on the mapping: one C call per
    part, where torch's indexing took tens of microseconds a call (the writer runs once per inner
    step on the training thread)."""

    def __init__(self, fd: int, size: int, *, owner: bool) -> None:
        self.fd, self.size, self.owner = fd, size, owner
        self.buf = mmap.mmap(fd, 8 * (size + 1))
        # native format: each double is copied whole (memcpy)
        self._seq_at = struct.Struct("@d")
        self._values_at = struct.Struct(f"@{size}d")
        self._seq = 0

    @classmethod
    def create(cls, size: int) -> SharedValues:
        if size < 1:
            raise ValueError(f"need at least one value, got {size}")
        return cls(_anonymous_file(8 * (size + 1)), size, owner=True)

    @classmethod
    def attach(cls, fd: int, size: int) -> SharedValues:
        return cls(fd, size, owner=False)

    def write(self, values: list[float]) -> None:
        """Replace the values (the writer: the owner only)."""
        if not self.owner:
            raise RuntimeError("only the owner writes shared values")
        if len(values) != self.size:
            raise ValueError(f"{len(values)} values for {self.size}")
        try:
            packed = self._values_at.pack(*values)  # before anything in the mapping changes
        except struct.error as exc:
            raise TypeError(f"shared values are numbers: {exc}") from exc
        # The sequence number is copied in whole (a slice copy of 8 bytes). Not pack_into: it fills
        # the field with zeros before it packs, and a reader that saw that 0 (even) before and
        # after a copy of the values took a half-written copy as consistent.
        self._seq += 1
        self.buf[0:8] = self._seq_at.pack(self._seq)  # odd: being written
        self.buf[8:] = packed
        self._seq += 1
        self.buf[0:8] = self._seq_at.pack(self._seq)

    def read(self, tries: int = 1000) -> list[float]:
        """A consistent copy of the values."""
        for _ in range(tries):
            (before,) = self._seq_at.unpack_from(self.buf, 0)
            values = list(self._values_at.unpack_from(self.buf, 8))
            (after,) = self._seq_at.unpack_from(self.buf, 0)
            if before == after and int(before) % 2 == 0:
                return values
            time.sleep(0)
        raise RuntimeError("shared values kept changing while being read")


class SlotPool(_Slots):
    def __init__(self, fd: int, count: int, slot_bytes: int, *, owner: bool) -> None:
        size = os.fstat(fd).st_size
        if size < count * slot_bytes:
            raise ValueError(f"the shared block holds {size} bytes, not {count} x {slot_bytes}")
        self.fd, self.count, self.slot_bytes, self.owner = fd, count, slot_bytes, owner
        self.buf = mmap.mmap(fd, count * slot_bytes)
        self._views: dict[tuple[int, int], torch.Tensor] = {}
        self.generation = 0
        self._free = list(range(count))
        self._held: set[int] = set()

    @classmethod
    def create(cls, count: int, slot_bytes: int) -> SlotPool:
        """A new pool of ``count`` slots of at least ``slot_bytes`` each, owned by this process."""
        if count < 1 or slot_bytes < 4:
            raise ValueError(f"a slot pool needs at least one slot of 4 bytes, got {count} x {slot_bytes}")
        slot_bytes = _aligned(slot_bytes)
        return cls(_anonymous_file(count * slot_bytes), count, slot_bytes, owner=True)

    @classmethod
    def attach(cls, fd: int, count: int, slot_bytes: int) -> SlotPool:
        """The peer's side of a pool: its inherited descriptor, count and slot size."""
        return cls(fd, count, slot_bytes, owner=False)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def put(self, values: torch.Tensor) -> SlotRef | None:
        """Copy flat fp32 ``values`` into a free slot; None when every slot is held."""
        if values.dtype != torch.float32:
            raise TypeError(f"slots hold fp32 values, got {values.dtype}")
        ref = self.claim(values.numel())
        if ref is not None:
            self.view(ref).copy_(values.detach().reshape(-1))
        return ref

    def claim(self, numel: int) -> SlotRef | None:
        """Hold a free slot for ``numel`` values that the caller writes in place (``view``): the
        values are computed into shared memory instead of copied there. None when every slot is
        held; ``free`` gives it back, written or not."""
        self._owned("claim")
        if not 0 <= numel <= self.max_values:
            raise ValueError(f"{numel} values do not fit a slot of {self.max_values}")
        if not self._free:
            return None
        slot = self._free.pop()
        self._held.add(slot)
        return SlotRef(slot, numel, self.generation)

    def view(self, ref: SlotRef) -> torch.Tensor:
        """The values of a filled slot, in place (valid until the slot is released)."""
        if not 0 <= ref.slot < self.count or not 0 <= ref.numel <= self.max_values:
            raise ValueError(f"no slot {ref.slot} of {ref.numel} values in a pool of {self.count} x {self.max_values}")
        return self._view(ref.slot, ref.numel)

    def free(self, ref: SlotRef) -> bool:
        """Return a released slot to the free list; False for a ref of an older generation or a
        slot that is not held (released twice)."""
        self._owned("free")
        if ref.generation != self.generation or ref.slot not in self._held:
            return False
        self._held.discard(ref.slot)
        self._free.append(ref.slot)
        return True

    def reclaim(self) -> int:
        """Free every held slot (the peer died holding them); how many were held."""
        self._owned("reclaim")
        held = len(self._held)
        self.generation += 1
        self._free = list(range(self.count))
        self._held.clear()
        return held

    def _owned(self, what: str) -> None:
        if not self.owner:
            raise RuntimeError(f"only the pool's owner may {what}")


class ReturnSlots(_Slots):
    """Fragment-sized fp32 slots whose state lives in the shared block: one byte per slot at its
    head, set by the writing process when it claims and fills a slot (``put``) and by the reading
    process when it has copied the values out (``take``). No free list, no message back, nothing
    locked between the processes: a byte leaves the free state only in the writer and returns to
    it only in the reader, and each side changes a slot only in the state the other left it in.
    Threads of the writing process (one per synchronizer shard) claim slots under a lock of their
    own. ``take`` copies (the values outlive the slot); ``clear`` frees every slot (the reader's,
    once no writer is attached)."""

    FREE, CLAIMED, FILLED = 0, 2, 1

    def __init__(self, fd: int, count: int, slot_bytes: int) -> None:
        self.fd, self.count, self.slot_bytes = fd, count, slot_bytes
        self.head = _aligned(count)
        size = os.fstat(fd).st_size
        if size < self.head + count * slot_bytes:
            raise ValueError(f"the shared block holds {size} bytes, not {count} x {slot_bytes} and their states")
        self.buf = mmap.mmap(fd, self.head + count * slot_bytes)
        self._views: dict[tuple[int, int], torch.Tensor] = {}
        self._claiming = threading.Lock()

    @classmethod
    def create(cls, count: int, slot_bytes: int) -> ReturnSlots:
        """A new block of ``count`` free slots of at least ``slot_bytes`` each."""
        if count < 1 or slot_bytes < 4:
            raise ValueError(f"return slots need at least one slot of 4 bytes, got {count} x {slot_bytes}")
        slot_bytes = _aligned(slot_bytes)
        return cls(_anonymous_file(_aligned(count) + count * slot_bytes), count, slot_bytes)

    @classmethod
    def attach(cls, fd: int, count: int, slot_bytes: int) -> ReturnSlots:
        """The other process's side: its inherited descriptor, count and slot size."""
        return cls(fd, count, slot_bytes)

    @property
    def filled(self) -> int:
        """Slots not free (filled, or being filled)."""
        return self.count - self.buf[: self.count].count(self.FREE)

    def put(self, values: torch.Tensor) -> SlotRef | None:
        """(The writer) copy flat fp32 ``values`` into a free slot and mark it filled; None when
        none is free or the values do not fit one (the caller sends them another way)."""
        if values.dtype != torch.float32:
            raise TypeError(f"slots hold fp32 values, got {values.dtype}")
        numel = values.numel()
        if numel > self.max_values:
            return None
        with self._claiming:  # another thread of this process may be looking for a free slot too
            slot = self.buf.find(bytes([self.FREE]), 0, self.count)
            if slot < 0:
                return None
            self.buf[slot] = self.CLAIMED
        self._view(slot, numel).copy_(values.detach().reshape(-1))
        self.buf[slot] = self.FILLED  # the reader learns of the slot from a message sent after this
        return SlotRef(slot, numel, 0)

    def take(self, ref: SlotRef) -> torch.Tensor:
        """(The reader) a copy of a filled slot's values; the slot is free again."""
        if not 0 <= ref.slot < self.count or not 0 <= ref.numel <= self.max_values:
            raise ValueError(f"no slot {ref.slot} of {ref.numel} values in {self.count} x {self.max_values}")
        if self.buf[ref.slot] != self.FILLED:
            raise ValueError(f"slot {ref.slot} is not filled")
        view = self._view(ref.slot, ref.numel).detach()
        values = view.clone()
        # Freed only once the copy is complete: releasing the view (a tensor of its own over the
        # kept one, made for this; its last reference goes with torch's atomic acquire-release
        # decrement) comes between the copy's reads and this store, so neither can pass it, and the
        # writer cannot see the slot free before the copy has read it (x86 keeps that order anyway;
        # weaker CPUs, Arm, need the fence). ``detach`` makes that tensor at a third of the cost of
        # a new ``frombuffer`` view (a call into torch at a step boundary costs microseconds).
        del view
        self.buf[ref.slot] = self.FREE
        return values

    def clear(self) -> int:
        """(The reader, when no writer is attached) free every slot; how many were filled."""
        filled = self.filled
        self.buf[: self.count] = bytes([self.FREE]) * self.count
        return filled
