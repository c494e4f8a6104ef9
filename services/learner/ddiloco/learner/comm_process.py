"""The learner's communication in a process of its own (``learner.comm: process``).

In thread mode (``comm.Comm``) the communication thread's Python (the event loop, gRPC, codecs,
the wake-up of each hand-off) shares the interpreter lock with the training loop. Here the same
``Comm`` runs in a child process, ``python -m ddiloco.learner.comm_process``, and the training
process holds ``ProcessComm``, which has ``Comm``'s methods and no event loop, no gRPC and no
thread of its own:

- **Contributions** go out through shared memory: ``submit`` copies a fragment's outer gradient
  into a slot of a ``SlotPool`` (``slots.py``; the training process owns it) and writes a small
  message on the control channel (a socket pair). The slot comes back when the contribution is
  answered or dropped; a full pool sends the values on the channel instead.
- **What comes back** (the synchronizer's requests, merged fragments, heals, the join, drains,
  byte counts and the communication side's events) is written on the channel by the child as it
  happens (whatever is waiting, in one write) and read by the training process without blocking
  when it asks (``take_requests``, ``take_arrivals``...), at its step boundaries. Events are
  written to the learner's log with the time they happened in the child; a learner killed between
  two boundaries loses the events of that interval that it had not read (thread mode writes them
  at once).
- **The pace and the held versions** (what heartbeats and a reconnect's Hello say) are written
  once a step into shared values (``SharedValues``) that the child reads when it needs them: no
  message, no wake-up.
- **A dead communication process is started again** (say, killed by SIGKILL or by the OOM
  killer): the new one joins as after a reconnect (it never uploads a genesis or refetches the
  model), fetches the fragments merged meanwhile, and the contributions not answered yet and the
  fragments waiting to be fetched again are handed to it anew (the synchronizer answers a
  duplicate of a merged contribution without merging it twice). A ``comm_restart`` event records
  it. More than ``MAX_RESTARTS`` deaths within ``RESTART_WINDOW_S`` end training with an error.
- **The training process's death ends the child**: its end of the channel reads end-of-file and
  it exits at once. The child ignores SIGINT and SIGTERM: stopping is the training process's
  call (``drain``), as in thread mode.

Messages are pickled tuples; fragment values travel as raw bytes right after their message.
"""

from __future__ import annotations

import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from typing import Any

import torch

from ddiloco.core import events as schema
from ddiloco.core import logs
from ddiloco.core.logs import get_logger
from ddiloco.fragments.partition import FragmentLayout
from ddiloco.learner.config import LearnerConfig
from ddiloco.learner.events import EventLog
from ddiloco.learner.mailbox import Arrival, Mailbox, Outgoing
from ddiloco.learner.session import LiveStats
from ddiloco.learner.slots import SharedValues, SlotPool, SlotRef
from ddiloco.protocol import wire

MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0
"""More deaths of the communication process than this within this window end training."""
_STATS = 5
"""Shared values before the held versions: step, tokens_total, tokens_per_s, step_time_s, training_done."""
STOP_TIMEOUT_S = 20.0
"""How long ``stop`` waits for the child to say goodbye before it is killed."""


class CommProcessError(RuntimeError):
    """The communication process cannot be kept running."""


@dataclass
class _Spec:
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
    """The training side's pace and held versions (``SharedValues``: ``_STATS`` values, then one
    version per fragment, -1 where none is held)."""
    rejoin: bool
    """A restart: joined already, so every session is a reconnect."""
    log_settings: dict[str, Any] = field(default_factory=dict)


def _send_values(conn: Connection, values: torch.Tensor) -> None:
    conn.send_bytes(values.detach().reshape(-1).contiguous().numpy().data.cast("B"))


def _recv_values(conn: Connection, numel: int) -> torch.Tensor:
    out = torch.empty(numel, dtype=torch.float32)
    if numel:
        conn.recv_bytes_into(out.numpy().data.cast("B"))
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

    out: Outgoing
    """Its fields; ``delta`` only when it went on the channel (no slot was free)."""
    ref: SlotRef | None


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
        self.log = get_logger("ddiloco.learner.comm", learner_id=cfg.resolved_id)
        self._box = Mailbox(events)
        """Requests, heals and arrivals as the child reports them (the training side of a mailbox)."""
        self._sent: dict[int, _Sent] = {}
        self._resync_wanted: set[int] = set()
        self._pool: SlotPool | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._stopping = False
        self._deaths: list[float] = []
        self._shared: SharedValues | None = None
        self._shared_at: tuple[int, bool] | None = None
        """The (step, training_done) the shared values were last written at."""
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
        self._shared = SharedValues.create(_STATS + self.layout.num_fragments)
        self._spawn(rejoin=False)

    def _spawn(self, *, rejoin: bool) -> None:
        assert self._pool is not None and self._shared is not None
        ours, theirs = socket.socketpair()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "ddiloco.learner.comm_process", str(theirs.fileno())],
                pass_fds=(theirs.fileno(), self._pool.fd, self._shared.fd), stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        self._conn = Connection(ours.detach())
        spec = _Spec(self.cfg, self.layout, self.model_fingerprint, self.incarnation, self.labels,
                     dict(self.events.bound), self._pool.fd, self._pool.count, self._pool.slot_bytes,
                     self._shared.fd, rejoin, logs.settings())
        self._conn.send_bytes(pickle.dumps(spec))

    def _died(self) -> None:
        """The child is gone: start another (joined: as after a reconnect) or report the failure."""
        assert self._proc is not None
        code = self._proc.wait()
        if self._conn is not None:
            self._conn.close()
            self._conn = None
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
            self._conn.send_bytes(pickle.dumps(msg))
            if values is not None:
                _send_values(self._conn, values)
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
            ready = conn.poll(timeout_s)
            while ready:
                for msg in pickle.loads(conn.recv_bytes()):  # the child writes what it has in one go
                    self._handle(msg, conn)
                ready = conn.poll(0)
        except (EOFError, OSError):
            self._died()

    def _handle(self, msg: tuple[Any, ...], conn: Connection) -> None:
        kind = msg[0]
        if kind == "event":
            _, t, event, fields = msg
            self.events.emit_at(t, event, **fields)
            if event in (schema.RESULT, schema.DROPPED):
                self._release(fields["sequence"])
        elif kind == "request":
            self._box.add_request(wire.FragmentRequest(fragment_id=msg[1], round=msg[2]))
        elif kind == "heals":
            self._box.add_heals(msg[1])
        elif kind == "arrival":
            _, fragment, version, resync, numel = msg
            values = _recv_values(conn, numel)
            if resync:
                self._resync_wanted.discard(fragment)
            self._box.deliver(Arrival(fragment, version, values, resync))
        elif kind == "fetched":
            _, fragment, version, numel = msg
            self.join.fetched[fragment] = (version, _recv_values(conn, numel))
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
        """Write the training side's pace and held versions where the child reads them (once a
        step: no message, no wake-up; the heartbeats read the pace once a second)."""
        s = self.stats
        key = (s.step, s.training_done)
        if self._shared is None or (key == self._shared_at and not force):
            return
        held = self.held()
        self._shared.write([s.step, s.tokens_total, s.tokens_per_s, s.step_time_s, float(s.training_done)]
                           + [held.get(p, -1) for p in range(self.layout.num_fragments)])
        self._shared_at = key

    # -- Comm's interface -----------------------------------------------------------------

    def submit(self, out: Outgoing) -> None:
        assert self._pool is not None, "start() first"
        ref = self._pool.put(out.delta.reshape(-1))
        sent = _Sent(out if ref is None else replace(out, delta=torch.empty(0)), ref)
        self._sent[out.sequence] = sent
        self._hand_over(sent)

    def _hand_over(self, sent: _Sent) -> None:
        o = sent.out
        fields = (o.fragment, o.sequence, o.base_version, o.tokens, o.steps, o.learner_step, o.round)
        if sent.ref is not None:
            self._send(("submit", *fields, sent.ref))
        else:
            self._send(("submit", *fields, None, o.delta.numel()), o.delta)

    def take_requests(self) -> dict[int, int]:
        self.pump()
        return self._box.take_requests()

    def take_heals(self) -> set[int]:
        self.pump()
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
        self.pump()
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
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        for seq in sorted(self._sent):  # never handed over (the child was gone): dropped here
            self.events.emit(schema.DROPPED, sequence=seq, fragment=self._sent[seq].out.fragment,
                             reason="learner stopped before the contribution was answered")
        self._sent.clear()
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        if self._shared is not None:
            self._shared.close()
            self._shared = None


# -- the child process ---------------------------------------------------------------------


class _Outbox:
    """Everything the child writes to the training process, in order, from one writer thread (so no
    communication thread ever blocks on a training process busy with a step)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.queue: queue.SimpleQueue[tuple[tuple[Any, ...], torch.Tensor | None] | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="comm-outbox", daemon=True)
        self.thread.start()

    def put(self, msg: tuple[Any, ...], values: torch.Tensor | None = None) -> None:
        self.queue.put((msg, values))

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join(STOP_TIMEOUT_S)

    def _run(self) -> None:
        closing = False
        while not closing and (item := self.queue.get()) is not None:
            batch = [item]
            while len(batch) < 256:  # everything waiting goes in one write, read in one go
                try:
                    more = self.queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    closing = True
                    break
                batch.append(more)
            try:
                self.conn.send_bytes(pickle.dumps([msg for msg, _ in batch]))
                for _, values in batch:
                    if values is not None:
                        _send_values(self.conn, values)
            except OSError:  # the training process is gone
                os._exit(0)


class _ForwardingMailbox(Mailbox):
    """The child's mailbox: what training takes goes to the training process as it comes."""

    outbox: _Outbox

    def add_request(self, msg: wire.FragmentRequest) -> None:
        self.outbox.put(("request", msg.fragment_id, msg.round))

    def deliver(self, arrival: Arrival) -> None:
        self.outbox.put(("arrival", arrival.fragment, arrival.version, arrival.resync, arrival.values.numel()),
                        arrival.values)

    def settle(self, msg: wire.ContributionResult) -> None:
        super().settle(msg)
        heals = super().take_heals()
        if heals:
            self.outbox.put(("heals", sorted(heals)))


def _child(fd: int) -> None:
    from ddiloco.learner.comm import Comm

    for sig in (signal.SIGINT, signal.SIGTERM):  # stopping is the training process's call
        signal.signal(sig, signal.SIG_IGN)
    conn = Connection(fd)
    try:
        spec: _Spec = pickle.loads(conn.recv_bytes())
    except EOFError:
        return
    logs.configure(**spec.log_settings)
    outbox = _Outbox(conn)
    events = EventLog(None, **spec.bound)
    events.observers.append(lambda event, fields: outbox.put(("event", time.time(), event, fields)))
    pool = SlotPool.attach(spec.pool_fd, spec.pool_count, spec.pool_slot_bytes)
    shared = SharedValues.attach(spec.shared_fd, _STATS + spec.layout.num_fragments)

    def held() -> dict[int, int]:
        return {p: int(v) for p, v in enumerate(shared.read()[_STATS:]) if v >= 0}
    genesis: dict[int, torch.Tensor] = {}
    genesis_ready = threading.Event()
    stop = threading.Event()

    asked = threading.Lock()

    def genesis_values() -> dict[int, torch.Tensor]:
        if asked.acquire(blocking=False):  # once, for every shard's lane
            outbox.put(("genesis", [f.index for f in spec.layout]))
        while not genesis_ready.wait(0.5):
            if stop.is_set():
                raise CommProcessError("stopped while waiting for the genesis values")
        return genesis

    def mailbox(ev: EventLog) -> Mailbox:
        box = _ForwardingMailbox(ev)
        box.outbox = outbox
        return box

    comm = Comm(spec.cfg, layout=spec.layout, model_fingerprint=spec.model_fingerprint,
                incarnation=spec.incarnation, events=events, held=held,
                genesis_values=genesis_values, labels=spec.labels, mailbox=mailbox)
    if spec.rejoin:  # a restart: joined already, so this is a reconnect
        for lane in comm.lanes:
            lane.link.joined = True
            lane.link.join.ready.set()
    watcher = threading.Thread(target=_watch, args=(comm, outbox, stop, spec.rejoin, shared),
                               name="comm-watch", daemon=True)
    comm.start()
    watcher.start()
    try:
        while True:
            try:
                msg = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):  # the training process is gone: so is its learner
                os._exit(0)
            kind = msg[0]
            if kind == "submit":
                fragment, sequence, base, tokens, steps, learner_step, round_no, ref = msg[1:9]
                delta = pool.view(ref) if ref is not None else _recv_values(conn, msg[9])
                comm.submit(Outgoing(fragment, sequence, base, tokens, steps, learner_step, delta, round=round_no))
            elif kind == "beat":
                _pace(comm.stats, shared)
                comm.beat_now()
            elif kind == "resync":
                comm.resync(tuple(msg[1]))
            elif kind == "values":
                genesis[msg[1]] = _recv_values(conn, msg[2])
                if len(genesis) == spec.layout.num_fragments:
                    genesis_ready.set()
            elif kind == "stop":
                stop.set()
                comm.stop(msg[1])
                break
    finally:
        stop.set()
        watcher.join(5)
        _report(comm, outbox, {})
        outbox.close()


def _report(comm: Any, outbox: _Outbox, sent: dict[int, bool]) -> tuple[Any, ...]:
    """Send the join of every shard (its fetched fragments first, once), drains and byte counts."""
    joins = []
    for s, lane in enumerate(comm.lanes):
        j = lane.link.join
        ready = j.ready.is_set()
        if ready and not sent.get(s):
            sent[s] = True
            for p, (version, values) in sorted(j.fetched.items()):
                outbox.put(("fetched", p, version, values.numel()), values)
            j.fetched = {}  # handed over; the child keeps no copy
        joins.append((ready, j.genesis, j.fleet_step, j.error))
    status = ("status", comm.draining.is_set(), comm.bytes_sent, comm.bytes_received, joins)
    outbox.put(status)
    return status


def stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP, or a debugger); False where /proc cannot tell."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def hold_while_stopped(pid: int, poll_s: float = 0.02) -> None:
    """Block the calling thread while process ``pid`` is stopped."""
    while stopped(pid):
        time.sleep(poll_s)


def _pace(stats: LiveStats, shared: SharedValues) -> None:
    """The training side's pace, as it last wrote it, into what the heartbeats send."""
    step, tokens_total, tokens_per_s, step_time_s, done = shared.read()[:_STATS]
    stats.step, stats.tokens_total, stats.tokens_per_s = int(step), int(tokens_total), tokens_per_s
    stats.step_time_s, stats.training_done = step_time_s, bool(done)


def _watch(comm: Any, outbox: _Outbox, stop: threading.Event, rejoined: bool, shared: SharedValues) -> None:
    """Report the joins at once and the rest when it changes (byte counts at most twice a second).
    A training process that is stopped (SIGSTOP: a frozen host, the lab's ``stop`` fault) stops the
    communication with it: every lane's event loop is held (no heartbeat, no send, no receipt)
    until it runs again, as one process would be."""
    sent = {s: rejoined for s in range(len(comm.lanes))}
    last: tuple[Any, ...] = ()
    last_at = 0.0
    parent = os.getppid()
    holding = False
    while not stop.wait(0.05):
        if stopped(parent):
            if not holding:
                for lane in comm.lanes:
                    lane.link.call_soon(lambda: hold_while_stopped(parent))
                holding = True
            continue
        holding = False
        _pace(comm.stats, shared)
        joins = [(lane.link.join.ready.is_set(), lane.link.join.error) for lane in comm.lanes]
        key = (comm.draining.is_set(), joins)
        now = time.monotonic()
        if key != last or now - last_at >= 0.5:
            _report(comm, outbox, sent)
            last, last_at = key, now


if __name__ == "__main__":
    _child(int(sys.argv[1]))
