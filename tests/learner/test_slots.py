"""Shared memory slots between two real processes: values cross with one copy, slots come back,
and a peer killed while holding slots costs nothing but a reclaim. Return slots (merged fragments
on their way back to training) are freed by their reader through the block itself, with no message."""

from __future__ import annotations

import contextlib
import os
import signal
import struct
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import pytest
import torch

from ddiloco.learner.slots import ReturnSlots, SharedValues, SlotPool, SlotRef

_READER = textwrap.dedent("""
    import sys, signal, os
    from ddiloco.learner.slots import SharedValues, SlotPool, SlotRef
    fd, count, slot_bytes = map(int, sys.argv[1:4])
    pool = SlotPool.attach(fd, count, slot_bytes)
    for line in sys.stdin:
        if line.strip() == "hold":
            print(os.getpid(), flush=True)
            signal.pause()  # killed here, holding whatever it was given
        ref = SlotRef(*map(int, line.split()))
        values = pool.view(ref)
        print(ref.slot, ref.numel, ref.generation, float(values.sum()), flush=True)
        del values
    pool.close()
""")


@pytest.fixture
def reader():
    started = []

    def start(pool: SlotPool) -> subprocess.Popen[str]:
        proc = subprocess.Popen([sys.executable, "-c", _READER, str(pool.fd), str(pool.count), str(pool.slot_bytes)],
                                pass_fds=(pool.fd,), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def _ask(proc: subprocess.Popen[str], line: str) -> str:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()
    return proc.stdout.readline()


def test_values_cross_to_another_process_and_slots_come_back(reader) -> None:
    pool = SlotPool.create(2, 4 * 1000)
    proc = reader(pool)
    try:
        for round_no in range(5):  # more hand-offs than slots: each comes back before the next
            values = torch.arange(1000, dtype=torch.float32) * (round_no + 1)
            ref = pool.put(values)
            assert ref is not None
            values.zero_()  # the slot holds its own copy
            slot, numel, generation, total = _ask(proc, f"{ref.slot} {ref.numel} {ref.generation}").split()
            got = SlotRef(int(slot), int(numel), int(generation))
            assert (got, got.numel) == (ref, 1000)
            assert float(total) == float((torch.arange(1000, dtype=torch.float32) * (round_no + 1)).sum())
            assert pool.free(got)
            assert not pool.free(got), "a slot released twice is refused"
        assert pool.free_slots == 2
        assert proc.stdin is not None
        proc.stdin.close()
        assert proc.wait(60) == 0
    finally:
        pool.close()


def test_a_full_pool_says_so_and_bad_input_changes_nothing() -> None:
    pool = SlotPool.create(1, 16)
    try:
        assert pool.max_values == 16  # slots are rounded up to 64 bytes
        with pytest.raises(ValueError, match="do not fit"):
            pool.put(torch.zeros(17))
        with pytest.raises(TypeError, match="fp32"):
            pool.put(torch.zeros(2, dtype=torch.float64))
        assert pool.free_slots == 1
        ref = pool.put(torch.ones(4))
        assert ref is not None and pool.put(torch.ones(1)) is None
        with pytest.raises(ValueError, match="no slot"):
            pool.view(SlotRef(3, 1, 0))
        view = pool.view(ref)
        assert torch.equal(view, torch.ones(4))
        del view  # a view must be gone before the pool closes
        assert pool.put(torch.zeros(0)) is None
    finally:
        pool.close()


def test_a_peer_killed_holding_slots_is_reclaimed_and_its_late_refs_are_refused(reader) -> None:
    pool = SlotPool.create(3, 64)
    proc = reader(pool)
    try:
        held = [pool.put(torch.full((16,), float(i))) for i in range(3)]
        assert all(held) and pool.put(torch.zeros(1)) is None
        pid = int(_ask(proc, "hold"))
        os.kill(pid, signal.SIGKILL)
        assert proc.wait(60) == -signal.SIGKILL
        assert pool.reclaim() == 3
        assert pool.free_slots == 3
        assert not any(pool.free(ref) for ref in held if ref is not None)  # older generation
        assert pool.free_slots == 3
        fresh = pool.put(torch.full((16,), 9.0))
        assert fresh is not None and torch.equal(pool.view(fresh), torch.full((16,), 9.0))
    finally:
        pool.close()


def test_only_the_owner_hands_out_slots_and_an_attached_pool_must_fit() -> None:
    pool = SlotPool.create(2, 64)
    try:
        peer = SlotPool.attach(os.dup(pool.fd), 2, 64)
        with pytest.raises(RuntimeError, match="owner"):
            peer.put(torch.zeros(1))
        with pytest.raises(RuntimeError, match="owner"):
            peer.reclaim()
        peer.close()
        fd = os.dup(pool.fd)
        with pytest.raises(ValueError, match="holds"):
            SlotPool.attach(fd, 200, 64)
        os.close(fd)
    finally:
        pool.close()


def test_shared_values_cross_to_another_process_without_a_message() -> None:
    shared = SharedValues.create(3)
    try:
        shared.write([1.0, 2.5, 2.0**53])
        script = ("import sys; from ddiloco.learner.slots import SharedValues; "
                  "print(SharedValues.attach(int(sys.argv[1]), 3).read())")
        out = subprocess.run([sys.executable, "-c", script, str(shared.fd)], pass_fds=(shared.fd,),
                             capture_output=True, text=True, timeout=60, check=True).stdout
        assert out.strip() == str([1.0, 2.5, 2.0**53])
        with pytest.raises(ValueError, match="2 values for 3"):
            shared.write([1.0, 2.0])
        with pytest.raises(TypeError, match="numbers"):
            shared.write([1.0, "2", 3.0])
        assert shared.read() == [1.0, 2.5, 2.0**53], "a refused write changes nothing"
        peer = SharedValues.attach(os.dup(shared.fd), 3)
        with pytest.raises(RuntimeError, match="only the owner"):
            peer.write([0.0, 0.0, 0.0])
        peer.close()
        with pytest.raises(ValueError, match="at least one"):
            SharedValues.create(0)
    finally:
        shared.close()


@contextlib.contextmanager
def _reader(script: str, shared: SharedValues, *args: str) -> Iterator[subprocess.Popen[str]]:
    """``script`` reading ``shared`` in another process (its fd, then ``args``), once it printed
    "ready"; killed if it still runs at the end, and ``shared`` closed."""
    proc = subprocess.Popen([sys.executable, "-c", script, str(shared.fd), *args], pass_fds=(shared.fd,),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shared.close()


def _counts(proc: subprocess.Popen[str]) -> list[int]:
    """The numbers a reader printed when it ended (it must end cleanly)."""
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    return [int(x) for x in out.split()]


_VALUES_READER = textwrap.dedent("""
    import sys, time
    from ddiloco.learner.slots import SharedValues
    shared = SharedValues.attach(int(sys.argv[1]), int(sys.argv[2]))
    print("ready", flush=True)
    reads = torn = busy = 0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            values = shared.read()
        except RuntimeError:  # every try overlapped a write (a writer much faster than this reader)
            busy += 1
            continue
        reads += 1
        torn += len(set(values)) != 1
        if values[0] == -1.0:
            break
    print(reads, torn, busy, flush=True)
""")


def test_a_reader_in_another_process_never_sees_half_a_write() -> None:
    size, writes = 64, 20_000
    shared = SharedValues.create(size)
    shared.write([0.0] * size)
    with _reader(_VALUES_READER, shared, str(size)) as reader:
        for k in range(1, writes + 1):
            shared.write([float(k)] * size)
        shared.write([-1.0] * size)
        reads, torn, _busy = _counts(reader)
        assert reads >= 1 and torn == 0, f"{torn} of {reads} reads mixed two writes"


_SEQUENCE_READER = textwrap.dedent("""
    import mmap, struct, sys, time
    buf = mmap.mmap(int(sys.argv[1]), 8)  # the sequence number: the first double of the mapping
    at = struct.Struct("@d")
    print("ready", flush=True)
    reads = backwards = 0
    last = at.unpack_from(buf, 0)[0]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and last >= 0:
        for _ in range(1000):
            seq = at.unpack_from(buf, 0)[0]
            reads += 1
            backwards += 0 <= seq < last
            last = seq
    print(reads, backwards, flush=True)
""")


def test_a_reader_never_sees_the_sequence_number_go_back():
    """The sequence lock's number only grows: a reader that saw it go back (a half-stored number,
    such as the zeros struct.pack_into writes before it packs) could take a torn copy as whole."""
    shared = SharedValues.create(4)
    with _reader(_SEQUENCE_READER, shared) as reader:
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            for _ in range(1000):
                shared.write([1.0, 2.0, 3.0, 4.0])
        shared.buf[0:8] = struct.pack("@d", -1.0)  # tells the reader to stop
        reads, backwards = _counts(reader)
        assert reads >= 1000 and backwards == 0, f"the sequence number went back {backwards} times in {reads} reads"


_RETURN_WRITER = textwrap.dedent("""
    import sys, signal, os, torch
    from ddiloco.learner.slots import ReturnSlots
    fd, count, slot_bytes = map(int, sys.argv[1:4])
    slots = ReturnSlots.attach(fd, count, slot_bytes)
    for line in sys.stdin:
        if line.strip() == "die":
            os.kill(os.getpid(), signal.SIGKILL)  # dies with whatever it filled
        value, numel = line.split()
        ref = slots.put(torch.full((int(numel),), float(value)))
        print(-1 if ref is None else ref.slot, flush=True)
""")


@pytest.fixture
def return_writer():
    """Start ``_RETURN_WRITER`` on a block of return slots; killed if it still runs at the end, and
    the block closed."""
    started: list[tuple[subprocess.Popen[str], ReturnSlots]] = []

    def start(slots: ReturnSlots) -> subprocess.Popen[str]:
        proc = subprocess.Popen([sys.executable, "-c", _RETURN_WRITER, str(slots.fd), str(slots.count),
                                 str(slots.slot_bytes)], pass_fds=(slots.fd,), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        started.append((proc, slots))
        return proc

    yield start
    for proc, slots in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        slots.close()


def test_return_slots_come_back_to_their_writer_through_the_block_itself(return_writer) -> None:
    """Another process fills slots; this one copies each out, which frees it for the writer with no
    message; a full block makes the writer's put return None until the reader takes one."""
    slots = ReturnSlots.create(2, 4 * 100)
    proc = return_writer(slots)
    first = SlotRef(int(_ask(proc, "1.5 100")), 100, 0)
    second = SlotRef(int(_ask(proc, "2.5 7")), 7, 0)
    assert {first.slot, second.slot} == {0, 1} and slots.filled == 2
    assert _ask(proc, "3.5 10").strip() == "-1", "every slot filled: the writer sends another way"
    assert _ask(proc, "1 101").strip() == "-1", "values larger than a slot never go in one"
    values = slots.take(first)
    assert torch.equal(values, torch.full((100,), 1.5)) and slots.filled == 1
    with pytest.raises(ValueError, match="not filled"):
        slots.take(first)
    again = SlotRef(int(_ask(proc, "4.5 3")), 3, 0)
    assert again.slot == first.slot, "the slot the reader freed is the writer's again"
    assert torch.equal(values, torch.full((100,), 1.5)), "what was taken is a copy: refilling leaves it"
    assert torch.equal(slots.take(again), torch.full((3,), 4.5))
    assert torch.equal(slots.take(second), torch.full((7,), 2.5)) and slots.filled == 0
    assert proc.stdin is not None
    proc.stdin.close()
    assert proc.wait(60) == 0


def test_return_slots_filled_by_a_writer_killed_are_cleared_and_bad_input_changes_nothing(return_writer) -> None:
    slots = ReturnSlots.create(3, 64)
    proc = return_writer(slots)
    for value in (1, 2):
        assert int(_ask(proc, f"{value} 16")) >= 0
    assert proc.stdin is not None
    proc.stdin.write("die\n")
    proc.stdin.flush()
    assert proc.wait(60) == -signal.SIGKILL
    assert slots.filled == 2
    assert slots.clear() == 2 and slots.filled == 0
    with pytest.raises(TypeError, match="fp32"):
        slots.put(torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="no slot"):
        slots.take(SlotRef(3, 1, 0))
    with pytest.raises(ValueError, match="no slot"):
        slots.take(SlotRef(0, 17, 0))
    assert slots.filled == 0
    ref = slots.put(torch.ones(0))
    assert ref is not None and slots.take(ref).numel() == 0
    with pytest.raises(ValueError, match="at least one slot"):
        ReturnSlots.create(0, 64)
    fd = os.dup(slots.fd)
    with pytest.raises(ValueError, match="holds"):
        ReturnSlots.attach(fd, 200, 64)
    os.close(fd)


def test_return_slots_claimed_by_threads_at_once_are_never_the_same_slot() -> None:
    """The communication process writes from one thread per synchronizer shard: two threads
    putting at once each get a slot of their own, and each slot holds what was put in it."""
    import threading

    slots = ReturnSlots.create(8, 4 * 65536)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads take turns between almost any two bytecodes
    try:
        for round_no in range(50):
            start = threading.Barrier(2)
            refs: dict[int, list[tuple[SlotRef | None, float]]] = {0: [], 1: []}

            def put_four(writer: int, round_no: int = round_no, start: threading.Barrier = start,
                         refs: dict = refs) -> None:
                start.wait()
                for i in range(4):
                    value = float(1000 * round_no + 10 * writer + i)
                    refs[writer].append((slots.put(torch.full((65536,), value)), value))

            threads = [threading.Thread(target=put_four, args=(w,)) for w in (0, 1)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            got = refs[0] + refs[1]
            assert all(ref is not None for ref, _ in got), "8 puts fit 8 slots"
            assert len({ref.slot for ref, _ in got if ref is not None}) == 8, f"a slot given twice: {got}"
            for ref, value in got:
                assert ref is not None and torch.equal(slots.take(ref), torch.full((65536,), value))
            assert slots.filled == 0
    finally:
        sys.setswitchinterval(interval)
        slots.close()


def test_a_claimed_slot_is_written_in_place_and_read_by_the_peer(reader) -> None:
    pool = SlotPool.create(2, 4 * 1000)
    proc = reader(pool)
    try:
        ref = pool.claim(1000)
        assert ref is not None and pool.free_slots == 1
        torch.sub(torch.arange(1000, dtype=torch.float32), 0.5, out=pool.view(ref))  # computed into the slot
        slot, numel, generation, total = _ask(proc, f"{ref.slot} {ref.numel} {ref.generation}").split()
        assert SlotRef(int(slot), int(numel), int(generation)) == ref
        assert float(total) == float((torch.arange(1000, dtype=torch.float32) - 0.5).sum())
        assert pool.free(ref) and pool.free_slots == 2
        with pytest.raises(ValueError, match="do not fit"):
            pool.claim(pool.max_values + 1)
        with pytest.raises(ValueError, match="do not fit"):
            pool.claim(-1)
        assert pool.free_slots == 2
        held = [pool.claim(10), pool.claim(10)]
        assert all(held) and pool.claim(10) is None
        peer = SlotPool.attach(os.dup(pool.fd), 2, 4 * 1000)
        with pytest.raises(RuntimeError, match="owner"):
            peer.claim(1)
        peer.close()
        assert proc.stdin is not None
        proc.stdin.close()
        assert proc.wait(60) == 0
    finally:
        pool.close()


def test_a_view_kept_past_close_stays_readable_and_a_second_close_does_nothing() -> None:
    # In a process of its own: were the block unmapped under the view, reading it would crash.
    script = textwrap.dedent("""
        import torch
        from ddiloco.learner.slots import ReturnSlots, SlotPool
        pool = SlotPool.create(2, 64)
        ref = pool.put(torch.full((16,), 7.0))
        kept = pool.view(ref)
        pool.close()
        pool.close()
        returns = ReturnSlots.create(1, 64)
        kept_back = returns._view(0, 16)
        returns.close()
        kept_back.fill_(2.0)
        print(float(kept.sum()), float(kept_back.sum()))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["112.0", "32.0"]
