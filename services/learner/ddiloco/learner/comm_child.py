"""The communication process of a learner in ``learner.comm: process``: ``python -P -m
ddiloco.learner.comm_child IN OUT``, started by the training process's ``ProcessComm``
(``comm_process.py``, which describes the whole arrangement) with the control channel's two
sockets as descriptors: ``IN`` what training writes, ``OUT`` what this process writes.

It puts its threads under ``SCHED_BATCH``, reads a ``ChildSpec``, attaches the training process's
slot pool, return slots and shared values, runs the learner's ``Comm`` (lanes, links, mailboxes,
codecs, reconnects) with a mailbox that forwards what training takes (merged fragments through the
return slots while one is free; otherwise the newest of each fragment waits for the writer),
writes everything back from one writer thread, and exits at once when the training process is gone.
"""

from __future__ import annotations

import os
import pickle
import queue
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import torch

from ddiloco.core import logs
from ddiloco.learner.comm_process import (
    OBSERVED,
    STATS,
    STOP_TIMEOUT_S,
    ChildSpec,
    CommProcessError,
    recv_values,
    send_values,
)
from ddiloco.learner.events import EventLog
from ddiloco.learner.mailbox import Arrival, Mailbox, Outgoing, supersedes
from ddiloco.learner.session import LiveStats
from ddiloco.learner.slots import ReturnSlots, SharedValues, SlotPool, SlotRef
from ddiloco.protocol import wire

_WAITING = "waiting"
"""A queued item that stands for the merged fragment waiting in ``_Outbox.waiting``: the writer
sends the newest there when it comes to it."""


def _arrival(arrival: Arrival, ref: SlotRef | None) -> tuple[tuple[Any, ...], torch.Tensor | None]:
    """A merged fragment's message, and its values when they follow it on the channel (no slot)."""
    msg = ("arrival", arrival.fragment, arrival.version, arrival.resync, arrival.values.numel(), ref)
    return msg, (arrival.values if ref is None else None)


class _Outbox:
    """Everything the child writes to the training process, in order, from one writer thread (so no
    communication thread ever blocks on a training process busy with a step).

    A merged fragment that finds no free return slot waits in ``waiting``, the newest of each
    fragment only (``mailbox.supersedes``, thread mode's rule), with one item in the queue at the
    place of the first: while training does not read (a long step, an evaluation; the channel is
    full and the writer blocked) a fragment merged forty times is held at most twice (the copy
    being written and the newest), not forty times. The writer tries a slot again when it comes to
    it (training may have freed one meanwhile)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.queue: queue.SimpleQueue[tuple[tuple[Any, ...], torch.Tensor | None] | None] = queue.SimpleQueue()
        self.waiting: dict[int, tuple[Arrival, ReturnSlots]] = {}
        """fragment -> its newest merged fragment not written yet, and the slots to try again."""
        self._lock = threading.Lock()
        """Over ``waiting`` and the slot a merged fragment takes, so a fragment's arrivals keep their order."""
        self.thread = threading.Thread(target=self._run, name="comm-outbox", daemon=True)
        self.thread.start()

    def put(self, msg: tuple[Any, ...], values: torch.Tensor | None = None) -> None:
        self.queue.put((msg, values))

    def arrival(self, arrival: Arrival, returns: ReturnSlots) -> None:
        """A merged fragment for training: through a free return slot, else (or when an older one of
        the fragment waits already) it waits for the writer, the newest of each fragment only."""
        with self._lock:
            held = self.waiting.get(arrival.fragment)
            if held is not None:  # its item is queued already: the writer sends the newest
                if supersedes(held[0], arrival):
                    self.waiting[arrival.fragment] = (arrival, returns)
                return
            ref = returns.put(arrival.values)
            if ref is not None:
                self.queue.put(_arrival(arrival, ref))
                return
            self.waiting[arrival.fragment] = (arrival, returns)
            self.queue.put(((_WAITING, arrival.fragment), None))

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join(STOP_TIMEOUT_S)

    def _run(self) -> None:
        while self._write_next():
            pass

    def _take(self, item: tuple[tuple[Any, ...], torch.Tensor | None]) -> tuple[tuple[Any, ...], torch.Tensor | None]:
        """The message (and values) to write for a queued item: a waiting merged fragment's newest."""
        msg, _ = item
        if msg[0] != _WAITING:
            return item
        with self._lock:
            arrival, returns = self.waiting.pop(msg[1])
            return _arrival(arrival, returns.put(arrival.values))

    def _write_next(self) -> bool:
        """Write what is queued, waiting for the first item; False once closed. What it wrote is
        let go of when it returns (a merged fragment's values are not held until the next write)."""
        item = self.queue.get()
        if item is None:
            return False
        batch = [self._take(item)]
        closing = False
        while len(batch) < 256:  # everything waiting goes in one write, read in one go
            try:
                more = self.queue.get_nowait()
            except queue.Empty:
                break
            if more is None:
                closing = True
                break
            batch.append(self._take(more))
        try:
            self.conn.send_bytes(pickle.dumps([msg for msg, _ in batch]))
            for _, values in batch:
                if values is not None:
                    send_values(self.conn, values)
        except OSError:  # the training process is gone
            os._exit(0)
        return not closing


class _ForwardingMailbox(Mailbox):
    """The child's mailbox: what training takes goes to the training process as it comes."""

    outbox: _Outbox
    returns: ReturnSlots

    def add_request(self, fragment: int, round_no: int) -> None:
        self.outbox.put(("request", fragment, round_no))

    def deliver(self, arrival: Arrival) -> None:
        self.outbox.arrival(arrival, self.returns)

    def settle(self, msg: wire.ContributionResult) -> None:
        super().settle(msg)
        heals = super().take_heals()
        if heals:
            self.outbox.put(("heals", sorted(heals)))


def _child(fd_in: int, fd_out: int, batch: bool = True) -> None:
    from ddiloco.learner.comm import Comm

    for sig in (signal.SIGINT, signal.SIGTERM):  # stopping is the training process's call
        signal.signal(sig, signal.SIG_IGN)
    conn = Connection(fd_in, writable=False)
    try:
        spec: ChildSpec = pickle.loads(conn.recv_bytes())
    except EOFError:
        return
    logs.configure(**spec.log_settings)
    # Its torch work (error feedback, finiteness checks, the copies into return slots) on
    # ``codec_threads`` threads, not torch's default of one per CPU. Above torch's grain size
    # (32Ki values) an operation is split across the team, and a team member that waits for the
    # training thread's CPU (SCHED_BATCH never preempts it) holds the whole operation up while the
    # others spin: at 60K-value fragments that made each call take milliseconds and the process
    # 2.5x dearer in CPU than at 10K-value ones for the same bytes.
    torch.set_num_threads(spec.cfg.codec_threads)
    log = logs.get_logger("ddiloco.learner.comm")
    if not batch:
        log.warning("SCHED_BATCH refused: the communication process may preempt training when it wakes")
    log.info("communication process started", pid=os.getpid(), torch_threads=torch.get_num_threads(),
             sched_batch=batch, rejoin=spec.rejoin)
    outbox = _Outbox(Connection(fd_out, readable=False))
    events = EventLog(spec.event_log, **spec.bound)  # appended to as training appends to it

    def observed(event: str, fields: dict[str, Any]) -> None:
        if event in OBSERVED:
            outbox.put(("event", event, fields))
    events.observers.append(observed)
    pool = SlotPool.attach(spec.pool_fd, spec.pool_count, spec.pool_slot_bytes)
    returns = ReturnSlots.attach(spec.returns_fd, spec.returns_count, spec.returns_slot_bytes)
    shared = SharedValues.attach(spec.shared_fd, STATS + spec.layout.num_fragments)

    def held() -> dict[int, int]:
        return {p: int(v) for p, v in enumerate(shared.read()[STATS:]) if v >= 0}
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
        box.outbox, box.returns = outbox, returns
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
                fragment, sequence, base, tokens, steps, learner_step, round_no, hand_over, ref = msg[1:10]
                delta = pool.view(SlotRef(*ref)) if ref is not None else recv_values(conn, msg[10])
                comm.submit(Outgoing(fragment, sequence, base, tokens, steps, learner_step, delta, round=round_no,
                                     hand_over=hand_over))
            elif kind == "beat":
                _pace(comm.stats, shared)
                comm.beat_now()
            elif kind == "resync":
                comm.resync(tuple(msg[1]))
            elif kind == "values":
                genesis[msg[1]] = recv_values(conn, msg[2])
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
        events.close()


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
    step, tokens_total, tokens_per_s, step_time_s, done = shared.read()[:STATS]
    stats.step, stats.tokens_total, stats.tokens_per_s = int(step), int(tokens_total), tokens_per_s
    stats.step_time_s, stats.training_done = step_time_s, bool(done)


WATCH_S = 0.05
"""How often ``_watch`` looks."""
WATCH_LOG_EVERY_S = 10.0
"""While ``_watch``'s looks keep failing, how often it says so again."""


def _watch(comm: Any, outbox: _Outbox, stop: threading.Event, rejoined: bool, shared: SharedValues) -> None:
    """Report the joins at once and the rest when it changes (byte counts at most twice a second).
    A training process that is stopped (SIGSTOP: a frozen host, the lab's ``stop`` fault) stops the
    communication with it: every lane's event loop is held (no heartbeat, no send, no receipt)
    until it runs again, as one process would be.

    A look that fails (say, a read of the shared values that never finds them whole, the training
    process frozen in the middle of writing them) is logged, and the next look tries again: the
    drains and the status are this thread's alone, and a thread that died of one failure would
    silence them for the rest of the child's life while everything else went on."""
    log = logs.get_logger("ddiloco.learner.comm", pid=os.getpid(), thread="comm-watch")
    sent = {s: rejoined for s in range(len(comm.lanes))}
    last: tuple[Any, ...] = ()
    last_at = 0.0
    parent = os.getppid()
    holding = False
    failures = 0
    failing_since = logged_at = 0.0
    while not stop.wait(WATCH_S):
        try:
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
        except Exception as exc:
            now = time.monotonic()
            if not failures:
                failing_since = logged_at = now
                log.warning("communication process: a look at the training side failed; watching on",
                            error=repr(exc), exc_info=True)
            elif now - logged_at >= WATCH_LOG_EVERY_S:
                logged_at = now
                log.warning("communication process: looks at the training side still fail", error=repr(exc),
                            failures=failures + 1, failing_s=round(now - failing_since, 1))
            failures += 1
            continue
        if failures:
            log.info("communication process: looks at the training side work again", failures=failures,
                     failing_s=round(time.monotonic() - failing_since, 1))
            failures = 0


def thread_ids(pid: int | None = None) -> set[int]:
    """The thread ids of process ``pid`` (None: this one), from ``/proc`` (Linux; none where it
    cannot be read or the process is gone)."""
    try:
        return {int(t) for t in os.listdir(f"/proc/{'self' if pid is None else pid}/task")}
    except OSError:
        return set()


def thread_policies(pid: int) -> dict[int, int]:
    """Thread id -> scheduling policy of every thread of process ``pid``, read back from the kernel
    (Linux; threads that ended meanwhile are left out, and a process that is gone has none)."""
    found = {}
    for tid in thread_ids(pid):
        try:
            found[tid] = os.sched_getscheduler(tid)
        except OSError:  # ProcessLookupError included: a thread that ended meanwhile
            continue
    return found


def batch_policy(pid: int | None = None) -> bool:
    """Put every thread of this process (``pid``: of that one), and so every thread it starts
    later, under ``SCHED_BATCH``: a woken thread of it never preempts a running task, the training
    thread included, and waits for that task's slice to end; it keeps its fair share of the CPUs.
    (The training process already set the main thread's policy as it started this one; importing
    torch starts threads of its own before this runs.) False where the policy does not exist or
    is refused: the threads it was refused for keep the normal policy, and the process works on."""
    if not hasattr(os, "SCHED_BATCH"):
        return False
    tids = thread_ids(pid) or {0 if pid is None else pid}
    for tid in tids:
        try:
            os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
        except ProcessLookupError:  # a thread that ended meanwhile
            continue
        except OSError:
            return False
    return True


if __name__ == "__main__":
    _child(int(sys.argv[1]), int(sys.argv[2]), batch_policy())
