"""The learner's communication in a process of its own (``learner.comm: process``).

In thread mode (``comm.Comm``) the communication thread's Python (the event loop, gRPC, codecs,
the wake-up of each hand-off) shares the interpreter lock with the training loop. Here the same
``Comm`` runs in a child process (``comm_child.py``, ``python -P -m ddiloco.learner.comm_child``: nothing in
the learner's working directory is imported in it, ``CHILD_FLAGS``), and the training process holds
``ProcessComm``, which has ``Comm``'s methods and no event loop, no gRPC and no thread of its own:

- **Contributions** go out through shared memory: ``submit`` copies a fragment's outer gradient
  into a slot of a ``SlotPool`` (``slots.py``; the training process owns it) and writes a small
  message on the control channel (a socket pair each way: ``channel.py``). The slot comes back
  when the contribution is answered or dropped; a full pool sends the values on the channel
  instead.
- **What comes back** (the synchronizer's requests, merged fragments, heals, the join, drains,
  byte counts and the communication side's events) is written on the channel by the child as it
  happens (whatever is waiting, in one write) and read by the training process without blocking,
  once per step boundary (``collect``); ``take_requests``, ``take_arrivals``... hand out what it
  brought. A merged fragment's values come back through shared memory too (``ReturnSlots``: the child copies them
  into a free slot, training copies them out and frees it, no message back); when every slot is
  filled they follow their message on the channel, and until they are written only the newest of
  each fragment waits in the child (as thread mode's mailbox keeps it): while training is busy for
  long (a long step, an evaluation) a fragment merged many times is held there at most twice (the
  copy being written, the newest), not once per merge.
- **Events** of the communication side are written to the learner's event log by the child as they
  happen (the same file, opened for appending: one ``write`` per line, so the lines of the two
  processes never interleave), as thread mode writes them. Those the training process acts on (a
  contribution's result or drop frees its slot; connects and results feed the metrics) are also
  sent to it, and it counts them without writing them again (``EventLog.observe``).
- **The pace and the held versions** (what heartbeats and a reconnect's Hello say) are written
  into shared values (``SharedValues``) as the steps go, at most every ``SHARE_EVERY_S``, and the
  child reads them when it needs them: no message, no wake-up.
- **A dead communication process is started again** (say, killed by SIGKILL or by the OOM
  killer): the new one joins as after a reconnect (it never uploads a genesis or refetches the
  model), fetches the fragments merged meanwhile, and the contributions not answered yet and the
  fragments waiting to be fetched again are handed to it anew (the synchronizer answers a
  duplicate of a merged contribution without merging it twice). A ``comm_restart`` event records
  it. More than ``MAX_RESTARTS`` deaths within ``RESTART_WINDOW_S`` end training with an error.
- **The training process's death ends the child**: its end of the channel reads end-of-file and
  it exits at once. The child ignores SIGINT and SIGTERM: stopping is the training process's
  call (``drain``), as in thread mode.
- **The child never preempts training.** It runs under ``SCHED_BATCH`` (Linux): a woken child
  (a hand-off's write wakes it) waits for the CPU's current slice instead of preempting the
  training thread inside the write; it still gets its fair share of the CPUs. Set on the child as
  soon as it is started, and by the child on every thread it has.

Messages are pickled tuples; fragment values that do not travel in slots follow their message as
raw bytes.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import torch

from ddiloco.core import events as schema
from ddiloco.core import logs
from ddiloco.core.logs import get_logger
from ddiloco.fragments.partition import FragmentLayout
from ddiloco.learner.channel import Channel
from ddiloco.learner.config import LearnerConfig
from ddiloco.learner.events import EventLog
from ddiloco.learner.mailbox import Arrival, Mailbox, Outgoing
from ddiloco.learner.session import LiveStats
from ddiloco.learner.slots import Claim, ReturnSlots, SharedValues, SlotPool, SlotRef

MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0
"""More deaths of the communication process than this within this window end training."""
STATS = 5
"""Shared values before the held versions: step, tokens_total, tokens_per_s, step_time_s, training_done."""
RETURN_SLOTS = 4
"""Slots for merged fragments on their way back to training (about one arrives per inner step
at the defaults, and training reads them at every step; a burst, a resync of every fragment,
sends the rest on the channel)."""
SHARE_EVERY_S = 0.2
"""The pace and the held versions are written into shared values when the step changed, at most
this often (and at once when ``force``d: a restart, a heartbeat asked for, the end of training).
The heartbeats read them once a second, so what they send may be this much older than the last
step. A reconnect's Hello that names a version older than the one held fetches a fragment that is
then not applied; if the synchronizer went back to older versions meanwhile, the next contribution
of a fragment it no longer has is refused. A write costs the training thread about 30 us at a step
boundary: every step, at a step of a few milliseconds, that was tens of microseconds a step; at
0.05 s it came every third step at 0.24M parameters, now every tenth."""
STOP_TIMEOUT_S = 20.0
"""How long ``stop`` waits for the child to say goodbye before it is killed."""
CHILD_FLAGS = ("-P",)
"""The interpreter's flags for the child: ``-P`` leaves the working directory off its module
path (``python -m`` puts it first, so a ``queue.py``, ``grpc.py`` or ``torch.py`` in the directory
the learner was started in would run inside the child, with its access to the synchronizer and the
token). Only that: ``PYTHONPATH`` (a ``pip install --target`` directory included) and the site
directories are as in the training process, and the child keeps the working directory, so the
relative paths of its settings (token file, TLS files) name the same files as in thread mode."""


class CommProcessError(RuntimeError):
    """The communication process cannot be kept running."""


@dataclass
class ChildSpec:
    """What the child needs to build its ``Comm`` (sent as the channel's first message)."""

    cfg: LearnerConfig
    layout: FragmentLayout
    model_fingerprint: str
    incarnation: int
    labels: dict[str, str]
    bound: dict[str, Any]
    """The event log's envelope (learner id, incarnation)."""
    pool_fd: int
    pool_count: int
    pool_slot_bytes: int
    shared_fd: int
    """The training side's pace and held versions (``SharedValues``: ``STATS`` values, then one
    version per fragment, -1 where none is held)."""
    returns_fd: int
    returns_count: int
    returns_slot_bytes: int
    """Where merged fragments come back (``ReturnSlots``)."""
    rejoin: bool
    """A restart: joined already, so every session is a reconnect."""
    log_settings: dict[str, Any] = field(default_factory=dict)
    event_log: str | None = None
    """The learner's event log, which the child appends its own events to (None: no log)."""


OBSERVED = frozenset({schema.RESULT, schema.DROPPED, schema.CONNECT, schema.DISCONNECT})
"""The child's events that the training process acts on (slots, metrics); the child sends these
to it besides writing them, and writes the rest only."""


def send_values(conn: Connection | Channel, values: torch.Tensor) -> None:
    data = values.detach().reshape(-1).contiguous().numpy().data.cast("B")
    if isinstance(conn, Channel):
        conn.send(data)
    else:
        conn.send_bytes(data)


def recv_values(conn: Connection | Channel, numel: int) -> torch.Tensor:
    out = torch.empty(numel, dtype=torch.float32)
    view = out.numpy().data.cast("B")
    if isinstance(conn, Channel):
        conn.read_into(view)
    elif numel:
        conn.recv_bytes_into(view)
    else:
        conn.recv_bytes()
    return out


class _Join:
    """The joins of every shard as the child reports them (``comm.FleetJoin``'s interface)."""

    def __init__(self, owner: ProcessComm, shards: int) -> None:
        self._owner = owner
        self.joins: list[tuple[bool, bool, int, str | None]] = [(False, False, 0, None)] * shards
        self.fetched: dict[int, tuple[int, torch.Tensor]] = {}
        self.failure: str | None = None
        """The child died or could not start before every shard joined."""

    @property
    def error(self) -> str | None:
        errors = [e for _, _, _, e in self.joins if e]
        return "; ".join(errors) if errors else None

    @property
    def ready(self) -> bool:
        return all(r for r, _, _, _ in self.joins) or self.error is not None or self.failure is not None

    def wait(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not self.ready:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._owner.pump(min(left, 0.5))
        return self.ready

    @property
    def pending(self) -> list[int]:
        return [s for s, (r, _, _, _) in enumerate(self.joins) if not r]

    @property
    def genesis(self) -> bool:
        return all(g for _, g, _, _ in self.joins)

    @property
    def fleet_step(self) -> int:
        return max(f for _, _, f, _ in self.joins)


@dataclass
class _Sent:
    """A contribution handed to the child and not answered yet."""

    fields: tuple[Any, ...]
    """Its ``submit`` message but the values: fragment, sequence, base version, tokens, steps,
    learner step, round, hand-over."""
    delta: torch.Tensor | None
    """Its values when they went on the channel (no slot was free); None when they are in ``ref``."""
    ref: SlotRef | None

    @property
    def fragment(self) -> int:
        return int(self.fields[0])


class ProcessComm:
    """``Comm``'s interface, with the communication in a child process (see the module's doc)."""

    def __init__(self, cfg: LearnerConfig, *, layout: FragmentLayout, model_fingerprint: str, incarnation: int,
                 events: EventLog, held: Callable[[], dict[int, int]],
                 genesis_values: Callable[[], dict[int, torch.Tensor]],
                 labels: dict[str, str] | None = None) -> None:
        self.cfg, self.layout, self.model_fingerprint, self.incarnation = cfg, layout, model_fingerprint, incarnation
        self.events, self.held, self.genesis_values = events, held, genesis_values
        self.labels = dict(labels or {})
        self.shards = len(cfg.targets)
        self.stats = LiveStats()
        self.draining = threading.Event()
        self.hurry = threading.Event()
        self.join = _Join(self, self.shards)
        self.bytes_sent = self.bytes_received = 0
        self.restarts = 0
        self.returned = {"slots": 0, "channel": 0}
        """How merged fragments came back: through the return slots, or on the channel (every slot filled)."""
        self.log = get_logger("ddiloco.learner.comm", learner_id=cfg.resolved_id)
        self._box = Mailbox(events)
        """Requests, heals and arrivals as the child reports them (the training side of a mailbox)."""
        self._sent: dict[int, _Sent] = {}
        self._resync_wanted: set[int] = set()
        self._pool: SlotPool | None = None
        self._returns: ReturnSlots | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Channel | None = None
        """The control channel (``channel.py``: whatever the child wrote is read in one go)."""
        self._stopping = False
        self._deaths: list[float] = []
        self._shared: SharedValues | None = None
        self._shared_at: tuple[int, bool] | None = None
        """The (step, training_done) the shared values were last written at."""
        self._shared_t = -SHARE_EVERY_S
        """When (``time.monotonic``) they were last written."""
        self._failed = False
        """The child died before joining: nothing more to start (the join reports it)."""

    # -- the child ------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        """The communication process's pid (None before ``start``)."""
        return self._proc.pid if self._proc is not None else None

    def start(self) -> None:
        biggest = max(f.numel for f in self.layout)
        self._pool = SlotPool.create(self.layout.num_fragments + 2, 4 * biggest)
        self._returns = ReturnSlots.create(RETURN_SLOTS, 4 * biggest)
        self._shared = SharedValues.create(STATS + self.layout.num_fragments)
        self._spawn(rejoin=False)

    def _spawn(self, *, rejoin: bool) -> None:
        assert self._pool is not None and self._shared is not None and self._returns is not None
        self._returns.clear()  # no child writes them now, and training holds none
        # One socket pair per direction (``channel.py`` says why): the child reads ``to_child``
        # and writes ``from_child``.
        to_child, child_in = socket.socketpair()
        from_child, child_out = socket.socketpair()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, *CHILD_FLAGS, "-m", "ddiloco.learner.comm_child", str(child_in.fileno()),
                 str(child_out.fileno())],
                pass_fds=(child_in.fileno(), child_out.fileno(), self._pool.fd, self._shared.fd, self._returns.fd),
                stdin=subprocess.DEVNULL)
        except BaseException:
            to_child.close()
            from_child.close()
            raise
        finally:
            child_in.close()
            child_out.close()
        if hasattr(os, "SCHED_BATCH"):  # from its first instruction (its imports); the child sets the rest
            with contextlib.suppress(OSError):  # refused, or gone already: the child tries again and says so
                os.sched_setscheduler(self._proc.pid, os.SCHED_BATCH, os.sched_param(0))
        self._conn = Channel(from_child, send=to_child)
        spec = ChildSpec(self.cfg, self.layout, self.model_fingerprint, self.incarnation, self.labels,
                     dict(self.events.bound), self._pool.fd, self._pool.count, self._pool.slot_bytes,
                     self._shared.fd, self._returns.fd, self._returns.count, self._returns.slot_bytes, rejoin,
                     logs.settings(), self.events.path)
        self._conn.send(pickle.dumps(spec))

    def _died(self) -> None:
        """The child is gone: start another (joined: as after a reconnect) or report the failure."""
        assert self._proc is not None
        code = self._proc.wait()
        self._close_channel()
        if self._stopping:
            return
        now = time.monotonic()
        self._deaths = [t for t in self._deaths if now - t < RESTART_WINDOW_S] + [now]
        if not all(r for r, _, _, _ in self.join.joins):
            self.join.failure = f"the communication process exited with code {code} before joining"
            self._failed = True
            return
        if len(self._deaths) > MAX_RESTARTS:
            raise CommProcessError(f"the communication process died {len(self._deaths)} times within "
                                   f"{RESTART_WINDOW_S:g}s (last exit code {code}); giving up")
        self.restarts += 1
        self.log.warning("communication process died; starting another", exit_code=code, restarts=self.restarts)
        self._share_state(force=True)
        self._spawn(rejoin=True)
        for seq in sorted(self._sent):
            self._hand_over(self._sent[seq])
        if self._resync_wanted:
            self._send(("resync", tuple(sorted(self._resync_wanted))))
        self.events.emit(schema.COMM_RESTART, exit_code=code, restarts=self.restarts, resent=len(self._sent),
                         pid=self.pid)
        self.beat_now()

    def _send(self, msg: tuple[Any, ...], values: torch.Tensor | None = None) -> None:
        if self._conn is None:
            return
        try:
            self._conn.send(pickle.dumps(msg))
            if values is not None:
                send_values(self._conn, values)
        except OSError:  # the child died: the next pump notices and restarts it, which re-sends this
            pass

    def pump(self, timeout_s: float = 0.0) -> None:
        """Read what the child wrote (waiting up to ``timeout_s`` for the first message)."""
        conn = self._conn
        if conn is None:
            if self._proc is not None and not (self._stopping or self._failed):
                self._died()
            return
        self._share_state()
        try:
            ready = conn.ready(timeout_s)  # an end of file or an error reads as ready too
            while ready:
                conn.fill()
                while (batch := conn.buffered()) is not None:  # the child writes what it has in one go
                    for msg in pickle.loads(batch):
                        self._handle(msg, conn)  # values that follow a message are read here
                ready = conn.partial and conn.ready(0)  # the rest of a message, if it is there yet
        except (EOFError, OSError):
            self._died()

    def _close_channel(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _handle(self, msg: tuple[Any, ...], conn: Channel) -> None:
        kind = msg[0]
        if kind == "event":  # written to the log by the child
            _, event, fields = msg
            self.events.observe(event, fields)
            if event in (schema.RESULT, schema.DROPPED):
                self._release(fields["sequence"])
        elif kind == "request":
            self._box.add_request(msg[1], msg[2])
        elif kind == "heals":
            self._box.add_heals(msg[1])
        elif kind == "arrival":
            _, fragment, version, resync, numel, ref = msg
            if ref is None:
                values = recv_values(conn, numel)
                self.returned["channel"] += 1
            else:
                assert self._returns is not None
                values = self._returns.take(ref)
                self.returned["slots"] += 1
            if resync:
                self._resync_wanted.discard(fragment)
            self._box.deliver(Arrival(fragment, version, values, resync))
        elif kind == "fetched":
            _, fragment, version, numel = msg
            self.join.fetched[fragment] = (version, recv_values(conn, numel))
        elif kind == "status":
            _, draining, self.bytes_sent, self.bytes_received, joins = msg
            self.join.joins = [tuple(j) for j in joins]
            if draining:
                self.draining.set()
        elif kind == "genesis":
            model = self.genesis_values()
            for p in msg[1]:
                self._send(("values", p, model[p].numel()), model[p])

    def _release(self, sequence: int) -> None:
        sent = self._sent.pop(sequence, None)
        if sent is not None and sent.ref is not None and self._pool is not None:
            self._pool.free(sent.ref)

    def _share_state(self, *, force: bool = False) -> None:
        """Write the training side's pace and held versions where the child reads them (no message,
        no wake-up): when they changed, at most every ``SHARE_EVERY_S``, or now when ``force``."""
        s = self.stats
        key = (s.step, s.training_done)
        if self._shared is None:
            return
        now = time.monotonic()
        if not force and (key == self._shared_at or now - self._shared_t < SHARE_EVERY_S):
            return
        held = self.held()
        self._shared.write([s.step, s.tokens_total, s.tokens_per_s, s.step_time_s, float(s.training_done)]
                           + [held.get(p, -1) for p in range(self.layout.num_fragments)])
        self._shared_at, self._shared_t = key, now

    # -- Comm's interface -----------------------------------------------------------------

    def claim(self, numel: int) -> Claim | None:
        """A slot to compute a contribution's values into (``Claim.values``), then hand to
        ``submit``: the outer gradient is written into shared memory once instead of computed and
        then copied there. None when every slot is held (``submit`` sends the values on the
        channel). ``release`` gives back a claim that is not submitted."""
        assert self._pool is not None, "start() first"
        ref = self._pool.claim(numel)
        return None if ref is None else Claim(self._pool.view(ref), ref)

    def release(self, claim: Claim | None) -> None:
        """Give back a claimed slot that no contribution was submitted in."""
        if claim is not None and self._pool is not None:
            self._pool.free(claim.ref)

    def submit(self, out: Outgoing, claim: Claim | None = None) -> None:
        """Hand a contribution to the child: its values in ``claim``'s slot (computed there), else
        copied into a free slot, else sent on the channel."""
        assert self._pool is not None, "start() first"
        if claim is not None:
            if claim.values.data_ptr() != out.delta.data_ptr() or claim.ref.numel != out.delta.numel():
                raise ValueError("a claimed slot must hold the contribution's values")
            ref: SlotRef | None = claim.ref
        else:
            ref = self._pool.put(out.delta.reshape(-1))
        fields = (out.fragment, out.sequence, out.base_version, out.tokens, out.steps, out.learner_step, out.round,
                  out.hand_over)
        sent = self._sent[out.sequence] = _Sent(fields, out.delta if ref is None else None, ref)
        self._hand_over(sent)

    def _hand_over(self, sent: _Sent) -> None:
        ref = sent.ref
        if ref is not None:  # the slot as plain numbers: a dataclass pickles at several times the cost
            self._send(("submit", *sent.fields, (ref.slot, ref.numel, ref.generation)))
        else:
            assert sent.delta is not None
            self._send(("submit", *sent.fields, None, sent.delta.numel()), sent.delta)

    def collect(self) -> None:
        """Read what the child wrote since the last look, once at a step boundary; ``take_requests``,
        ``take_heals`` and ``take_arrivals`` then hand out what it brought. A look is a system call
        or two and costs tens of microseconds right after an inner step, so a boundary takes one,
        not one per ``take_*``; what comes in during the boundary is read at the next one (or by
        ``wait_arrival``, in the modes where learners wait for merges)."""
        self.pump()

    def take_requests(self) -> dict[int, int]:
        return self._box.take_requests()

    def take_heals(self) -> set[int]:
        return self._box.take_heals()

    def resync(self, fragments: tuple[int, ...]) -> None:
        self._resync_wanted.update(fragments)
        self._send(("resync", tuple(fragments)))

    def training_done(self) -> None:
        self.stats.training_done = True
        self.beat_now()

    def beat_now(self) -> None:
        self._share_state(force=True)
        self._send(("beat",))

    def take_arrivals(self) -> dict[int, Arrival]:
        return self._box.take_arrivals()

    def peek_version(self, fragment: int) -> int | None:
        return self._box.peek_version(fragment)

    def wait_arrival(self, fragment: int, newer_than: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while True:
            self.pump()
            version = self._box.peek_version(fragment)
            if version is not None and version > newer_than:
                return True
            left = deadline - time.monotonic()
            if left <= 0 or self._stopping:
                return False
            self.pump(min(left, 0.5))

    def pending(self) -> int:
        self.pump()
        return len(self._sent)

    def flush(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self.hurry.is_set():
            if self.pending() == 0:
                return True
            self.pump(min(0.05, max(0.0, deadline - time.monotonic())))
        return self.pending() == 0

    def stop(self, goodbye: str = "finished") -> None:
        proc = self._proc
        if proc is None:
            return
        self._send(("stop", goodbye))
        self._stopping = True
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while self._conn is not None and proc.poll() is None and time.monotonic() < deadline:
            self.pump(0.1)
        self.pump()  # what it wrote before exiting
        if proc.poll() is None:
            self.log.warning("communication process did not stop; killing it", pid=proc.pid)
            proc.kill()
        proc.wait()
        self._close_channel()
        for seq in sorted(self._sent):  # never handed over (the child was gone): dropped here
            self.events.emit(schema.DROPPED, sequence=seq, fragment=self._sent[seq].fragment,
                             reason="learner stopped before the contribution was answered")
        self._sent.clear()
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        if self._shared is not None:
            self._shared.close()
            self._shared = None
        if self._returns is not None:
            self._returns.close()
            self._returns = None
