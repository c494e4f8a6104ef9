"""The training process's end of the control channel (``Channel``) against the communication
process's (``multiprocessing.connection.Connection``), over a real socket pair."""

from __future__ import annotations

import socket
import struct
import sys
import threading
import time
from multiprocessing.connection import Connection

import pytest
import torch

from ddiloco.learner.channel import Channel
from ddiloco.learner.comm_process import recv_values, send_values


@pytest.fixture
def pair():
    ours, theirs = socket.socketpair()
    channel, conn = Channel(ours), Connection(theirs.detach())
    yield channel, conn
    channel.close()
    conn.close()


def test_messages_written_apart_are_read_in_order_and_none_when_nothing_is_left(pair):
    channel, conn = pair
    assert not channel.ready(0)
    assert channel.message() is None
    sent = [b"a", b"", b"x" * 70_000, bytes(range(256))]
    for data in sent:
        conn.send_bytes(data)
    assert channel.ready(1.0)
    got = []
    while len(got) < len(sent):
        msg = channel.message()
        if msg is None:  # a long message comes in over several reads
            assert channel.ready(5.0)
            continue
        got.append(bytes(msg))
    assert got == sent
    assert channel.message() is None
    assert not channel.ready(0)


def test_a_look_reads_the_socket_once_and_buffered_never_reads_it(pair):
    channel, conn = pair
    conn.send_bytes(b"one")
    conn.send_bytes(b"two")
    assert channel.buffered() is None, "nothing was read yet, and buffered does not read"
    assert channel.ready(1.0)
    channel.fill()
    assert [bytes(channel.buffered()), bytes(channel.buffered())] == [b"one", b"two"]
    assert channel.buffered() is None
    conn.send_bytes(b"three")
    assert channel.buffered() is None, "written after the look: the next look reads it"
    assert channel.ready(1.0)
    channel.fill()
    assert bytes(channel.buffered()) == b"three"
    channel.fill()  # nothing there: a fill that finds nothing changes nothing
    assert channel.buffered() is None and not channel.partial and not channel.ready(0)


def test_partial_says_whether_the_rest_of_a_message_is_on_its_way(pair):
    channel, conn = pair
    writer = threading.Thread(target=conn.send_bytes, args=(b"y" * 600_000,))  # more than a socket holds
    writer.start()
    try:
        got, partial = None, []
        while got is None:
            assert channel.ready(5.0)
            channel.fill()
            got = channel.buffered()
            partial.append(channel.partial)
        assert len(got) == 600_000
        assert partial[0] and not partial[-1], partial
    finally:
        writer.join(10)
    conn.send_bytes(b"small")
    assert channel.ready(1.0)
    channel.fill()
    assert bytes(channel.buffered()) == b"small" and not channel.partial


def test_a_message_partly_written_stays_buffered_until_the_rest_comes(pair):
    channel, conn = pair
    raw = socket.socket(fileno=conn.fileno())  # the same socket, written byte by byte
    try:
        body = b"partial message"
        raw.sendall(struct.pack("!i", len(body)) + body[:5])
        assert channel.ready(1.0)
        assert channel.message() is None
        assert not channel.ready(0)
        raw.sendall(body[5:] + struct.pack("!i", 2) + b"ok")
        assert channel.ready(1.0)
        assert bytes(channel.message()) == body
        assert channel.ready(0)  # the second one is buffered already
        assert bytes(channel.message()) == b"ok"
    finally:
        raw.detach()


def test_the_long_header_form_is_read(pair):
    channel, conn = pair
    raw = socket.socket(fileno=conn.fileno())
    try:
        raw.sendall(struct.pack("!i", -1) + struct.pack("!Q", 3) + b"abc")
        assert channel.ready(1.0)
        assert bytes(channel.message()) == b"abc"
    finally:
        raw.detach()


def test_values_that_follow_a_message_go_into_their_tensor_whole(pair):
    channel, conn = pair
    values = torch.randn(600_000)  # 2.4 MB: more than one read, part of it buffered with the message
    writer = threading.Thread(target=lambda: (conn.send_bytes(b"head"), send_values(conn, values),
                                              conn.send_bytes(b"tail")))
    writer.start()
    try:
        assert channel.ready(5.0)
        assert bytes(channel.message()) == b"head"
        got = recv_values(channel, values.numel())
        assert torch.equal(got, values)
        assert channel.ready(5.0)
        assert bytes(channel.message()) == b"tail"
    finally:
        writer.join(10)
    empty = torch.empty(0)
    send_values(conn, empty)
    assert recv_values(channel, 0).numel() == 0


def test_values_of_the_wrong_length_are_refused(pair):
    channel, conn = pair
    conn.send_bytes(b"x" * 12)
    with pytest.raises(ValueError, match="expected a message of 8 bytes, got 12"):
        recv_values(channel, 2)


def test_what_was_written_before_the_end_is_read_then_the_end_is_an_error(pair):
    channel, conn = pair
    conn.send_bytes(b"last words")
    conn.send_bytes(b"and more")
    conn.close()
    assert channel.ready(1.0)
    assert bytes(channel.message()) == b"last words"
    assert bytes(channel.message()) == b"and more"
    with pytest.raises(EOFError):
        channel.message()
    assert channel.ready(0)  # an end reads as ready: the caller finds it out
    with pytest.raises(EOFError):
        channel.message()


def test_an_end_within_a_message_or_within_values_is_an_error():
    ours, theirs = socket.socketpair()
    channel = Channel(ours)
    try:
        theirs.sendall(struct.pack("!i", 10) + b"half")
        theirs.close()
        assert channel.ready(1.0)
        with pytest.raises(EOFError):
            while channel.message() is None:
                pass
    finally:
        channel.close()
    ours, theirs = socket.socketpair()
    channel = Channel(ours)
    try:
        theirs.sendall(struct.pack("!i", 8) + b"half")
        theirs.close()
        with pytest.raises(EOFError, match="within a message"):
            recv_values(channel, 2)
    finally:
        channel.close()


def test_what_the_channel_sends_the_connection_reads(pair):
    channel, conn = pair
    small, big = b"spec", bytes(range(256)) * 1000  # 256 KB: header and body written apart
    reader_got: list[bytes] = []
    reader = threading.Thread(target=lambda: reader_got.extend(conn.recv_bytes() for _ in range(3)))
    reader.start()
    channel.send(small)
    channel.send(big)
    send_values(channel, torch.arange(5, dtype=torch.float32))
    reader.join(10)
    assert reader_got[:2] == [small, big]
    assert torch.equal(torch.frombuffer(bytearray(reader_got[2]), dtype=torch.float32),
                       torch.arange(5, dtype=torch.float32))


def test_a_channel_on_two_sockets_reads_one_writes_the_other_and_closes_both():
    read_ours, read_theirs = socket.socketpair()
    send_ours, send_theirs = socket.socketpair()
    channel = Channel(read_ours, send=send_ours)
    child_in, child_out = Connection(send_theirs.detach()), Connection(read_theirs.detach())
    try:
        channel.send(b"to the child")
        assert child_in.recv_bytes() == b"to the child"
        assert not child_out.poll(0)  # nothing went the other way
        child_out.send_bytes(b"from the child")
        assert channel.ready(5.0)
        assert channel.message() == b"from the child"
        channel.close()
        with pytest.raises(EOFError):
            child_in.recv_bytes()
        assert child_out.poll(0)  # the read end closed too
    finally:
        channel.close()
        child_in.close()
        child_out.close()


def _sleeps(tid: int) -> int:
    """How many times thread ``tid`` of this process gave up its CPU (slept), from ``/proc``."""
    with open(f"/proc/self/task/{tid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))


def _wake_ups(sockets: str, reads: int = 20) -> int:
    """How many times a thread blocked reading the communication process's end of the channel is
    woken while the training process's end reads ``reads`` messages from it, on one socket pair
    for both directions or on a pair each way."""
    ours, theirs = socket.socketpair()
    if sockets == "one":
        channel, child_in = Channel(ours), Connection(theirs.detach())
        child_out = child_in
    else:
        back_ours, back_theirs = socket.socketpair()
        channel = Channel(back_ours, send=ours)
        child_in, child_out = Connection(theirs.detach()), Connection(back_theirs.detach())
    tid: list[int] = []
    got: list[bytes] = []
    started = threading.Event()

    def reader() -> None:  # the communication process's main thread: blocked on what training writes
        tid.append(threading.get_native_id())
        started.set()
        got.append(child_in.recv_bytes())

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        assert started.wait(10)
        time.sleep(0.1)  # blocked in its read by now
        before = _sleeps(tid[0])
        for i in range(reads):
            child_out.send_bytes(b"an event %d" % i)
            assert channel.ready(5.0)
            assert channel.message() == b"an event %d" % i
            time.sleep(0.01)  # a woken reader runs and sleeps again before the next read
        woken = _sleeps(tid[0]) - before
        channel.send(b"stop")
        thread.join(10)
        assert got == [b"stop"]
        return woken
    finally:
        channel.close()
        child_in.close()
        child_out.close()
        thread.join(10)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads thread counters from Linux's /proc")
def test_reading_the_channel_does_not_wake_a_reader_blocked_on_the_other_direction():
    """On one socket pair, every read of the training process's end wakes the communication
    process's reader blocked on the other end (the kernel tells it there is room to write); with a
    socket pair per direction it sleeps through them."""
    if _wake_ups("one") == 0:
        pytest.skip("this kernel does not wake a blocked reader when the other end reads: nothing to avoid")
    assert _wake_ups("two") == 0
