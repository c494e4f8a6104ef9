"""What the learner's communication side can be trusted with, against real processes and sockets.

The communication process imports nothing from the learner's working directory (a ``queue.py``
there would run inside it) while ``PYTHONPATH`` and relative paths keep working; merged fragments
that training does not read for a while wait in it as the newest per fragment, not one copy per
merge; a contribution requeued at a reconnect that carries a whole period is no hand-over; and a
failed look at the training side's shared values does not silence the child's status for good.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import socket
import struct
import textwrap
import time
import weakref
from multiprocessing.connection import Connection

import torch

from ddiloco.fragments.partition import partition_tensors
from ddiloco.learner.channel import Channel
from ddiloco.learner.comm_process import RETURN_SLOTS, ProcessComm
from ddiloco.learner.events import EventLog
from ddiloco.learner.mailbox import Arrival, Outgoing
from ddiloco.learner.settings import sync_config
from ddiloco.learner.slots import ReturnSlots
from ddiloco.learner.sync import DecoupledSync
from ddiloco.protocol import certs
from tests.learner.test_comm_queue import _comm, dropped, queued
from tests.learner.test_decoupled_sync import PROTOCOL, _events, _mlp, fleet
from tests.procs import synchronizer

TOKEN = "trust-test-token-0123456789abcdef"

_SHIM = textwrap.dedent('''
    """Stands in for the module of its name: records which process imported it from this
    directory, then hands over to the module it shadows, so the process goes on as it would."""
    import importlib
    import os
    import sys

    _here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(_here, "imported.txt"), "a") as _f:
        _f.write(f"{__name__} {os.getpid()}\\n")
    _path = sys.path[:]
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
    del sys.modules[__name__]
    try:
        sys.modules[__name__] = importlib.import_module(__name__)
    finally:
        sys.path[:] = _path
''')


def _imports(folder: pathlib.Path) -> list[tuple[str, int]]:
    """(module, pid) of every import of a shim in ``folder``."""
    marker = folder / "imported.txt"
    if not marker.exists():
        return []
    return [(name, int(pid)) for name, pid in (line.split() for line in marker.read_text().splitlines())]


def test_the_communication_process_imports_nothing_from_the_learners_working_directory(tmp_path, monkeypatch):
    """A learner started in a directory that holds a ``queue.py``, a ``grpc.py`` and a ``torch.py``:
    its communication process imports none of them, yet imports from ``PYTHONPATH`` (a ``--target``
    install's way in), reads its token and TLS files (mutual TLS) by paths relative to that
    directory, and its events go to the event log named relative to it."""
    work, extra = tmp_path / "work", tmp_path / "extra"
    work.mkdir()
    extra.mkdir()
    for name in ("queue", "grpc", "torch"):
        (work / f"{name}.py").write_text(_SHIM)
    (extra / "queue.py").write_text(_SHIM)
    (work / "learner.token").write_text(TOKEN + "\n")
    ca = certs.init_ca(tmp_path / "ca")
    server = certs.issue(tmp_path / "ca", tmp_path / "certs", "server", kind="server", hosts=("127.0.0.1",))
    certs.issue(tmp_path / "ca", work, "loop-a", kind="client")
    shutil.copy(ca.cert, work / "ca.pem")
    cfg = tmp_path / "config.yaml"
    cfg.write_text(PROTOCOL + f"synchronizer: {{auth_tokens: {{loop-a: {TOKEN}}}, tls_cert: {server.cert}, "
                   f"tls_key: {server.key}, tls_client_ca: {ca.cert}}}\n")
    with synchronizer(tmp_path, "--config", str(cfg), "--quorum", "1") as target:  # started from elsewhere
        monkeypatch.chdir(work)
        monkeypatch.delenv("DDILOCO_TOKEN", raising=False)
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(extra), os.environ.get("PYTHONPATH")])))
        model = _mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sync = DecoupledSync(model, optimizer=opt, synchronizer=target, learner_id="loop-a", fragments=3,
                             sync_every=4, event_log="events.jsonl", token_file="learner.token", tls_ca="ca.pem",
                             tls_cert="loop-a.pem", tls_key="loop-a.key", join_timeout_s=60.0, comm="process")
        child = None
        try:
            assert sync.join() == 0, "joined with the token and TLS files read through their relative paths"
            child = sync.comm.pid
            assert child is not None
            gen = torch.Generator().manual_seed(1)
            deadline = time.monotonic() + 120
            while min(sync.versions.values()) < 1 and time.monotonic() < deadline:
                x = torch.randn(32, 8, generator=gen)
                loss = ((model(x).squeeze(1) - x.sum(1)) ** 2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                time.sleep(0.05)  # a step of a real model takes time: the synchronizer paces its rounds on it
                sync.step(tokens=32, loss=float(loss.detach()))
            assert min(sync.versions.values()) >= 1, "no merge within the deadline"
            assert sync.finish()
        finally:
            sync.close()
    from_work = _imports(work)
    assert not from_work, f"the learner's working directory was imported from: {from_work} (child pid {child})"
    assert ("queue", child) in _imports(extra), "the communication process imports from PYTHONPATH"
    events = _events(work / "events.jsonl")
    assert any(e["event"] == "connect" for e in events), "the child's events go to the relative event log"
    assert any(e["event"] == "result" and e["outcome"] == "merged" for e in events)


def _training_side(numel: int) -> ProcessComm:
    """A ``ProcessComm`` with the return slots ``start`` makes for fragments of ``numel`` values,
    and no child: the test connects its channel."""
    cfg = sync_config(None, synchronizer="127.0.0.1:1", learner_id="a", fragments=3, comm="process")
    layout = partition_tensors(list(_mlp().named_parameters()), 3)
    comm = ProcessComm(cfg, layout=layout, model_fingerprint="f", incarnation=1,
                       events=EventLog(None, learner_id="a", incarnation=1), held=dict, genesis_values=dict)
    comm._returns = ReturnSlots.create(RETURN_SLOTS, 4 * numel)
    return comm


def test_merged_fragments_training_does_not_read_wait_in_the_communication_process_newest_per_fragment():
    """Training busy (it reads nothing) while 40 merges of two 1 MiB fragments reach the child's
    mailbox: once the return slots are filled and the channel is full, the child holds at most two
    copies per fragment (the one being written, the newest), not one per merge; training then reads
    the newest version of each, and no more than a few of the older ones."""
    from ddiloco.learner.comm_child import _ForwardingMailbox, _Outbox

    numel = 1 << 18  # 1 MiB of fp32: more than the channel's socket buffer holds
    fragments, merges = (0, 1), 20
    comm = _training_side(numel)
    assert comm._returns is not None
    training, child = socket.socketpair()
    comm._conn = Channel(training)
    outbox = _Outbox(Connection(child.detach(), readable=False))
    box = _ForwardingMailbox(EventLog(None, learner_id="a", incarnation=1))
    box.outbox = outbox
    box.returns = ReturnSlots.attach(os.dup(comm._returns.fd), comm._returns.count, comm._returns.slot_bytes)
    alive: list[weakref.ref[torch.Tensor]] = []
    try:
        for version in range(1, merges + 1):
            for p in fragments:
                values = torch.full((numel,), float(100 * p + version))
                alive.append(weakref.ref(values))
                box.deliver(Arrival(p, version, values))
                del values
        bound = 2 * len(fragments)
        deadline = time.monotonic() + 10
        while sum(r() is not None for r in alive) > bound and time.monotonic() < deadline:
            time.sleep(0.05)
        held = sum(r() is not None for r in alive)
        assert held <= bound, f"{held} of {len(alive)} merged fragments held in the communication process"

        got: dict[int, Arrival] = {}
        deadline = time.monotonic() + 30
        while any(p not in got or got[p].version < merges for p in fragments) and time.monotonic() < deadline:
            comm.pump(0.2)
            for p, a in comm.take_arrivals().items():
                if p not in got or a.version > got[p].version:
                    got[p] = a
        assert {p: got[p].version for p in got} == {p: merges for p in fragments}, "the newest of each fragment"
        for p in fragments:
            assert torch.equal(got[p].values, torch.full((numel,), float(100 * p + merges)))
        delivered = comm.returned["slots"] + comm.returned["channel"]
        assert delivered <= RETURN_SLOTS + bound, f"{delivered} merged fragments written for {len(alive)}"
    finally:
        outbox.queue.put(None)
        deadline = time.monotonic() + 60
        while outbox.thread.is_alive() and time.monotonic() < deadline:  # read whatever it still writes
            comm.pump(0.1)
            comm.take_arrivals()
        if not outbox.thread.is_alive():  # a writer whose channel closes under it ends the process
            comm._close_channel()
        box.returns.close()
        comm._returns.close()


def _out(seq: int, fragment: int, base: int, *, hand_over: bool) -> Outgoing:
    return Outgoing(fragment, seq, base, tokens=10, steps=1, learner_step=seq, delta=torch.zeros(4),
                    hand_over=hand_over)


def test_a_contribution_requeued_at_a_reconnect_is_a_hand_over_only_if_what_it_carries_is_one():
    """A hand-over that takes the place of an unanswered contribution from its base at a reconnect
    holds that one's whole period: sent as a hand-over, it would be merged without momentum. The
    rule ``submit`` applies when it replaces a queued one, applied at the reconnect too."""
    # The hand-over was sent too: both unanswered, the hand-over requeued, the other dropped.
    comm, seen = _comm()
    box = comm.lanes[0].mailbox
    for o in (_out(1, 0, 0, hand_over=False), _out(2, 0, 0, hand_over=True)):
        box._unacked[o.sequence] = o
    box.requeue_unacked()
    assert dropped(seen) == [1] and queued(comm) == {0: [2]}
    assert box._outbound[0][0].hand_over is False, "a requeued hand-over carrying a whole period"

    # The hand-over was queued when the link broke: it carries the unanswered one.
    comm, seen = _comm()
    box = comm.lanes[0].mailbox
    box._unacked[1] = _out(1, 0, 0, hand_over=False)
    comm.submit(_out(2, 0, 0, hand_over=True))
    box.requeue_unacked()
    assert dropped(seen) == [1] and queued(comm) == {0: [2]}
    assert box._outbound[0][0].hand_over is False, "a queued hand-over carrying a whole period"

    # A hand-over carrying a hand-over, and one from another base (carrying nothing): hand-overs still.
    comm, seen = _comm()
    box = comm.lanes[0].mailbox
    for o in (_out(1, 0, 0, hand_over=True), _out(2, 0, 0, hand_over=True), _out(3, 1, 0, hand_over=False),
              _out(4, 1, 1, hand_over=True)):
        box._unacked[o.sequence] = o
    box.requeue_unacked()
    assert dropped(seen) == [1] and queued(comm) == {0: [2], 1: [3, 4]}
    assert {o.sequence: o.hand_over for q in box._outbound.values() for o in q} == {2: True, 3: False, 4: True}

    # The same rule in ``submit``: a hand-over that replaces a queued contribution from its base.
    comm, seen = _comm()
    comm.submit(_out(1, 0, 0, hand_over=False))
    comm.submit(_out(2, 0, 0, hand_over=True))
    assert dropped(seen) == [1] and comm.lanes[0].mailbox._outbound[0][0].hand_over is False


def _logged(text: str, message: str) -> list[dict]:
    lines = (line for line in text.splitlines() if message in line)
    return [json.loads(line) for line in lines if line.startswith("{")]


def test_a_failed_look_at_the_training_sides_shared_values_does_not_silence_the_communication_process(
        tmp_path, capfd):
    """The training process frozen half-way through writing the shared values (its sequence number
    left odd): the child's watch cannot read them and says so, and once they are whole again its
    status (byte counts, drains) reaches training as before."""
    with fleet(tmp_path, comm="process") as (_, sync, model, opt, _log):
        assert sync.join() == 0
        comm = sync.comm
        assert isinstance(comm, ProcessComm) and comm._shared is not None
        gen = torch.Generator().manual_seed(2)

        def step() -> None:
            x = torch.randn(32, 8, generator=gen)
            loss = ((model(x).squeeze(1) - x.sum(1)) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            time.sleep(0.05)
            sync.step(tokens=32, loss=float(loss.detach()))

        reported = comm.bytes_sent
        deadline = time.monotonic() + 60
        while comm.bytes_sent == reported and time.monotonic() < deadline:
            step()
        assert comm.bytes_sent > reported, "no status from the communication process within the deadline"

        # frozen mid-write: no call into the learner (which would write them whole) until the child saw it
        buf = comm._shared.buf
        (seq,) = struct.unpack_from("@d", buf, 0)
        buf[0:8] = struct.pack("@d", seq + 1)
        err = ""
        deadline = time.monotonic() + 30
        while "shared values kept changing while being read" not in err and time.monotonic() < deadline:
            time.sleep(0.05)
            err += capfd.readouterr().err
        assert "shared values kept changing while being read" in err, "the child never read the shared values"
        comm._share_state(force=True)  # whole again

        reported = comm.bytes_sent
        deadline = time.monotonic() + 60
        while comm.bytes_sent == reported and time.monotonic() < deadline:
            step()
        assert comm.bytes_sent > reported, \
            f"no status from the communication process since a failed read of the shared values ({reported} bytes)"
        assert sync.finish()
    err += capfd.readouterr().err
    failed = _logged(err, "a look at the training side failed")
    assert len(failed) == 1 and failed[0]["pid"] == comm.pid and "shared values" in failed[0]["error"], failed
    assert failed[0]["level"] == "warning" and "Traceback" in failed[0]["exception"]
    again = _logged(err, "looks at the training side work again")
    assert len(again) == 1 and again[0]["failures"] >= 1, again
