"""The training process's end of the control channel to its communication process.

The framing is ``multiprocessing.connection.Connection``'s (the child's end is one): a 4-byte
big-endian length and the bytes, or a length of -1, an 8-byte length and the bytes for a message of
2 GiB or more. This end reads through a buffer: whatever the child wrote since the last look comes
in with one ``recv`` that never waits, and is cut into messages here. ``Connection.recv_bytes``
reads each message with two system calls (its length, then its bytes) and its ``poll`` builds a
selector each time: at one small step a few milliseconds long, with three batches of the child's
messages per step, those calls were a tenth of the training thread's time in ``step()``.

A look at the channel (``ready``, ``fill``, then ``buffered`` until it has nothing) takes one
``poll`` and one ``recv`` (another of each only while a message is partly read), into a buffer
allocated once: ``recv(n)`` allocates ``n`` bytes per call, and a quarter-megabyte allocation is an
``mmap`` where glibc's large allocations are not huge pages.

The two directions may travel on two sockets (``Channel(read, send=...)``), and the learner's do: a
process blocked reading its end of a socket is woken whenever the other end reads what it had
written there (the kernel signals room to write on the socket it reads from, and a blocked read is
woken by any signal on it). On one socket pair, each look of the training process at the channel
woke the communication process's reader, which then found nothing and slept again: a wake-up per
look, paid inside the training thread's ``recv`` (measured: a ``recv`` of 300 bytes took 24 us
against 15 with the reader on a socket of its own).
"""

from __future__ import annotations

import select
import socket
import struct

_SHORT = struct.Struct("!i")
_LONG = struct.Struct("!Q")
_READ = 1 << 18
"""Bytes asked for per ``recv``: a few hundred pickled messages, or a slice of values that follow one."""


class Channel:
    """A connected stream socket (``send``: another one to write to), framed as ``Connection``
    frames. Reads: ``ready`` (wait for something to read), ``fill`` (one read that never waits)
    then ``buffered`` (the complete messages it brought, one at a time; ``partial`` after them: the
    rest of one is on its way), ``message`` (both: the next complete message, if it can be had
    without waiting), ``read_into`` (the next message, which must be exactly as long as the
    buffer, waiting for it). Raises ``EOFError`` once the other end closed and every complete
    message was taken."""

    def __init__(self, sock: socket.socket, send: socket.socket | None = None) -> None:
        self.sock = sock
        self.out = sock if send is None else send
        """Where ``send`` writes."""
        self._buf = bytearray()
        self._at = 0
        """Where the unread bytes of ``_buf`` begin."""
        self._eof = False
        self._scratch = bytearray(_READ)
        self._scratch_view = memoryview(self._scratch)
        """What ``recv_into`` reads into: allocated once."""
        self._poll = select.poll()
        self._poll.register(sock.fileno(), select.POLLIN)

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        self.sock.close()
        self.out.close()

    # -- writing ------------------------------------------------------------------------------

    def send(self, data: bytes | bytearray | memoryview) -> None:
        """One message (``Connection.send_bytes``'s framing)."""
        n = len(data) if not isinstance(data, memoryview) else data.nbytes
        head = _SHORT.pack(n) if n < 0x7FFFFFFF else _SHORT.pack(-1) + _LONG.pack(n)
        if n <= 1 << 16:
            self.out.sendall(head + bytes(data))
        else:
            self.out.sendall(head)
            self.out.sendall(data)

    # -- reading ------------------------------------------------------------------------------

    def ready(self, timeout_s: float = 0.0) -> bool:
        """Whether something is there to read (an end of file or an error counts), waiting up to
        ``timeout_s``; true at once while a complete message is buffered."""
        if self._frame_end() is not None:
            return True
        return bool(self._poll.poll(1000.0 * max(0.0, timeout_s)))

    def message(self) -> bytearray | None:
        """The next complete message, if it can be had without waiting (a message the other end has
        only partly written stays buffered). ``EOFError`` when none is left and the other end closed."""
        if self._frame_end() is None:
            self.fill()
        return self.buffered()

    def fill(self) -> None:
        """Buffer what one ``recv`` that never waits gets (after ``ready``: there is something)."""
        self._fill(wait=False)

    @property
    def partial(self) -> bool:
        """Whether part of a message is buffered (once ``buffered`` has handed out the complete
        ones): the rest is on its way."""
        return len(self._buf) > self._at

    def buffered(self) -> bytearray | None:
        """The next complete message already buffered, without reading the socket; ``EOFError``
        when none is left and the other end closed."""
        end = self._frame_end()
        if end is None:
            if self._eof:
                raise EOFError("the channel was closed")
            return None
        start, stop = end
        out = self._buf[start:stop]
        self._at = stop
        self._compact()
        return out

    def read_into(self, out: memoryview) -> None:
        """The next message into ``out``, waiting for it; it must be ``len(out)`` bytes long
        (``ValueError`` otherwise: the stream is then out of step and is not read on)."""
        while (head := self._header()) is None:
            self._fill(wait=True)
        n, skip = head
        if n != out.nbytes:
            raise ValueError(f"expected a message of {out.nbytes} bytes, got {n}")
        have = min(n, len(self._buf) - self._at - skip)
        start = self._at + skip
        out[:have] = self._buf[start:start + have]
        self._at = start + have
        self._compact()
        got = have
        while got < n:  # the rest straight into ``out``, not through the buffer
            k = self.sock.recv_into(out[got:])
            if k == 0:
                self._eof = True
                raise EOFError("the channel was closed within a message")
            got += k

    def _header(self) -> tuple[int, int] | None:
        """(length, header bytes) of the next message, if its header is buffered."""
        left = len(self._buf) - self._at
        if left < 4:
            return None
        (n,) = _SHORT.unpack_from(self._buf, self._at)
        if n != -1:
            return n, 4
        if left < 12:
            return None
        return _LONG.unpack_from(self._buf, self._at + 4)[0], 12

    def _frame_end(self) -> tuple[int, int] | None:
        """(start, end) of the next complete message in the buffer."""
        head = self._header()
        if head is None:
            return None
        n, skip = head
        start = self._at + skip
        return (start, start + n) if start + n <= len(self._buf) else None

    def _fill(self, *, wait: bool) -> None:
        """Append what one ``recv`` gets; ``wait``: block for at least one byte (or the end). One
        call only: values that follow a message go from the socket into their tensor
        (``read_into``), not through the buffer."""
        if self._eof:
            if wait:
                raise EOFError("the channel was closed")
            return
        try:
            n = self.sock.recv_into(self._scratch, _READ, 0 if wait else socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return
        if not n:
            self._eof = True
            if wait:
                raise EOFError("the channel was closed")
            return
        self._buf += self._scratch_view[:n]

    def _compact(self) -> None:
        if self._at == len(self._buf):
            self._buf.clear()
            self._at = 0
        elif self._at > 1 << 16 and self._at > len(self._buf) // 2:
            del self._buf[:self._at]
            self._at = 0


__all__ = ["Channel"]
