"""``learner.comm: process`` computes each outer gradient straight into the shared-memory slot the
communication process reads it from (``ProcessComm.claim``), instead of computing it and copying
it there. Against a real synchronizer process: the slot holds exactly ``base - current`` (scaled
when the learner's outer gradients are made hostile, its own model untouched), a non-finite outer
gradient heals its fragment and gives its slot back, and a claim that does not hold the values it
is submitted with is refused without a trace."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time

import pytest
import torch
from torch import nn

from ddiloco.learner.comm_process import ProcessComm
from ddiloco.learner.mailbox import Outgoing
from ddiloco.learner.sync import DecoupledSync
from tests.learner.test_comm_process import _loss
from tests.learner.test_decoupled_sync import PROTOCOL, _events
from tests.procs import synchronizer


class _WithSpare(nn.Module):
    """A small regressor with a parameter its loss never reads: values written into it (an
    infinity) make that fragment's outer gradient non-finite while the loss stays finite."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.spare = nn.Parameter(torch.zeros(40))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _held(comm: ProcessComm) -> int:
    return sum(1 for sent in comm._sent.values() if sent.ref is not None)


def test_outer_gradients_are_computed_in_their_slots_and_a_non_finite_one_gives_its_slot_back(tmp_path):
    cfg = tmp_path / "config.yaml"
    cfg.write_text(PROTOCOL)
    started: list[subprocess.Popen[bytes]] = []
    with synchronizer(tmp_path, "--config", str(cfg), "--quorum", "1", started=started) as target:
        server = started[0]
        model = _WithSpare()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        log = tmp_path / "a.jsonl"
        sync = DecoupledSync(model, optimizer=opt, synchronizer=target, learner_id="slots", fragments=3,
                             sync_every=4, steps=1000, event_log=str(log), join_timeout_s=60.0, comm="process")
        comm = sync.comm
        assert isinstance(comm, ProcessComm)
        stopped = False
        try:
            assert sync.join() == 0
            gen = torch.Generator().manual_seed(3)
            for _ in range(6):
                sync.step(tokens=32, loss=_loss(model, opt, gen))
                pool = comm._pool
                assert pool is not None and pool.free_slots == pool.count - _held(comm), "no slot leaks"
            # A step that sent nothing: every fragment has progress to hand over. How many steps it
            # takes depends on how the synchronizer's requests fall (on one CPU, about three).
            deadline = time.monotonic() + 120.0
            while True:
                assert comm.flush(timeout_s=60.0), "every contribution so far answered"
                sync.step(tokens=32, loss=_loss(model, opt, gen))
                if not any(e["event"] == "send" and e["step"] == sync.step_count for e in _events(log)):
                    break
                if time.monotonic() > deadline:
                    pytest.fail("every step for 120 s sent something")

            # The synchronizer stopped: what is handed over stays in its slots, to be read here.
            os.kill(server.pid, signal.SIGSTOP)
            stopped = True
            spare = next(f.index for f in sync.layout if any(t.name == "spare" for t in f.tensors))
            with torch.no_grad():
                model.spare[3] = float("inf")
            sync.corrupted.set()
            expected = {f.index: (sync.local[f.index].base - sync.local.bound[f.index].gather()) * sync.cfg.corrupt_factor
                        for f in sync.layout if f.index != spare}
            params_before = {n: p.detach().clone() for n, p in model.named_parameters() if n != "spare"}
            sync.end_training()

            pool = comm._pool
            assert pool is not None
            sent = {s.fragment: s for s in comm._sent.values()}
            assert sorted(sent) == sorted(expected), "every sound fragment handed over, the poisoned one healed"
            for p, s in sent.items():
                assert s.ref is not None and s.delta is None, "the values went in a slot, not on the channel"
                assert torch.equal(pool.view(s.ref), expected[p]), f"fragment {p}: the slot holds base - current, scaled"
            assert pool.free_slots == pool.count - len(sent), "the healed fragment's slot was given back"
            for n, p in model.named_parameters():  # scaling the contribution left the model alone
                if n != "spare":
                    assert torch.equal(p.detach(), params_before[n]), n
            assert torch.isfinite(model.spare).all(), "healed back to its base"
            heal = next(e for e in _events(log) if e["event"] == "heal")
            assert heal["fragments"] == [spare] and "non-finite outer gradient" in heal["reason"]
        finally:
            if stopped:
                os.kill(server.pid, signal.SIGCONT)
            sync.close(flush_timeout_s=60.0)
        events = _events(log)
        sends = {e["sequence"] for e in events if e["event"] == "send"}
        assert sends == {e["sequence"] for e in events if e["event"] in ("result", "dropped")}


def test_a_claim_that_does_not_hold_the_submitted_values_is_refused_and_changes_nothing(tmp_path):
    cfg = tmp_path / "config.yaml"
    cfg.write_text(PROTOCOL)
    with synchronizer(tmp_path, "--config", str(cfg), "--quorum", "1") as target:
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        sync = DecoupledSync(model, synchronizer=target, learner_id="claims", fragments=3, sync_every=4, steps=4,
                             join_timeout_s=60.0, comm="process")
        comm = sync.comm
        assert isinstance(comm, ProcessComm)
        try:
            assert sync.join() == 0
            pool = comm._pool
            assert pool is not None
            free = pool.free_slots
            numel = sync.layout[0].numel
            claim = comm.claim(numel)
            assert claim is not None and pool.free_slots == free - 1
            out = Outgoing(0, 1, 0, 32, 1, 1, torch.zeros(numel))
            with pytest.raises(ValueError, match="claimed slot"):
                comm.submit(out, claim)
            assert not comm._sent and pool.free_slots == free - 1, "nothing handed over, the claim still held"
            comm.release(claim)
            assert pool.free_slots == free
            comm.release(claim)  # twice: nothing more comes back
            assert pool.free_slots == free
            held = [comm.claim(numel) for _ in range(pool.count)]
            assert all(held) and comm.claim(numel) is None, "every slot held: no claim (the values go on the channel)"
            for c in held:
                comm.release(c)
            with pytest.raises(ValueError, match="do not fit"):
                comm.claim(pool.max_values + 1)
            assert pool.free_slots == free
        finally:
            with contextlib.suppress(Exception):
                sync.close()
