"""The learner's communication sends a contribution's digest where its synchronizer reads it.

A synchronizer of this version says ``trailing_digest`` in its welcome: the learner's link cuts a
contribution with the header's digest empty and its stream puts the digest on the last chunk. One
of the previous contract (its welcome leaves the field unset) refuses a header without a digest,
so the link must keep it in the header there, or every contribution would end the stream. Played
here by the real synchronizer with that welcome and the previous version's rule in its reassembler.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from ddiloco.fragments.chunking import Chunk, Reassembler, Transfer
from ddiloco.fragments.errors import HeaderError
from ddiloco.learner.events import EventLog
from ddiloco.learner.mailbox import Outgoing
from ddiloco.synchronizer import server as server_module
from tests.scripted import (
    eventually,
    learner_comm,
    older_welcome,
    running_server,
    seed_genesis,
    sync_config,
)


@pytest.mark.parametrize("older", [False, True], ids=["this version", "previous contract"])
async def test_a_learners_contributions_carry_their_digest_where_the_synchronizer_reads_it(tmp_path, monkeypatch,
                                                                                         older):
    seen: list[tuple[str, bytes, bytes]] = []  # each transfer received: (kind, header's digest, last chunk's)

    class Receiver(Reassembler):
        def feed(self, chunk: Chunk) -> Transfer | None:
            if older:  # the previous version: a header must carry the digest; a chunk's is unknown to it
                if chunk.header is not None and len(chunk.header.digest) != 16:
                    raise self._fail(HeaderError(f"transfer {chunk.transfer_id} has no 16-byte digest"))
                chunk = dataclasses.replace(chunk, digest=b"", frame=None)
            transfer = super().feed(chunk)
            if transfer is not None:
                seen.append((transfer.header.kind, transfer.header.digest, chunk.digest))
            return transfer

    monkeypatch.setattr(server_module, "Reassembler", Receiver)
    async with running_server(sync_config(tmp_path)) as server:
        if older:
            older_welcome(monkeypatch, server, trailing_digest=False)
        protocol = await seed_genesis(server)
        events: list[tuple[str, dict]] = []
        log = EventLog(None, learner_id="b", incarnation=7)
        log.observers.append(lambda name, fields: events.append((name, fields)))
        comm = learner_comm(server, protocol, log)
        comm.stats.step, comm.stats.step_time_s = 2, 0.1  # a pace, as a training loop reports one
        comm.start()
        try:
            assert await asyncio.to_thread(comm.join.wait, 30), "the learner did not join"
            version = server.engine.fragments[0].version
            comm.submit(Outgoing(0, 1, version, tokens=100, steps=2, learner_step=2,
                                 delta=torch.full((comm.lanes[0].link.layout[0].numel,), 0.01)))
            await eventually(lambda: any(name == "result" for name, _ in events), timeout_s=30,
                             what="the contribution's result")
        finally:
            await asyncio.to_thread(comm.stop, "finished")
        assert server.engine.fragments[0].version == version + 1
    result = next(fields for name, fields in events if name == "result")
    assert result["outcome"] == "merged", result
    contributions = [(header, last) for kind, header, last in seen if kind == "contribution"]
    assert len(contributions) == 1
    header, last = contributions[0]
    if older:
        assert len(header) == 16 and last == b""
    else:
        assert header == b"" and len(last) == 16
