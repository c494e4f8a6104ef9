"""A round made only of hand-overs (each learner's last progress on a fragment, sent as it finishes
or drains) steps without the outer momentum unless ``hand_over_momentum``; everything else keeps
it. Checked on a real synchronizer on loopback against the outer step computed here, and on the
rule itself for the rounds a scripted learner cannot arrange (mixed, carried)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from ddiloco.algorithm.outer_optimizer import OuterNesterov
from ddiloco.protocol import wire
from ddiloco.synchronizer.inbox import Contribution
from ddiloco.synchronizer.rounds import MergeSettings
from ddiloco.v1 import synchronizer_pb2 as pb
from tests.scripted import eventually, genesis_learner, running_server, sync_config

LR, MU = 0.7, 0.5


def _nesterov(params: torch.Tensor, momentum: torch.Tensor, delta: torch.Tensor, mu: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The outer step as docs/algorithm.md writes it: b = mu b + D; Theta -= lr (D + mu b)."""
    b = mu * momentum + delta if mu else momentum
    return params - LR * (delta + mu * b), b


async def _merge(server, learner, delta: torch.Tensor, **header) -> None:
    frag = server.engine.fragments[0]
    version = frag.version
    seq = await learner.contribute(0, delta, base_version=version, **header)
    assert (await learner.wait_result(seq)).outcome == "merged"
    await eventually(lambda: frag.version == version + 1, what="the merge")


def _merge_events(state_dir) -> list[dict]:
    path = state_dir / "events.jsonl"
    return [e for e in map(json.loads, path.read_text().splitlines()) if e["event"] == "merge"]


@pytest.mark.parametrize("hand_over_momentum", [False, True])
async def test_a_round_of_hand_overs_steps_without_momentum_unless_configured(tmp_path, hand_over_momentum):
    cfg = sync_config(tmp_path, outer_lr=LR, outer_momentum=MU, outer_momentum_warmup=0,
                      hand_over_momentum=hand_over_momentum, event_log=str(tmp_path / "events.jsonl"))
    async with running_server(cfg) as server:
        learner = await genesis_learner(server)
        frag = server.engine.fragments[0]
        g = torch.Generator().manual_seed(1)
        params, momentum = frag.params.clone(), frag.momentum.clone()
        for _ in range(2):  # two ordinary rounds build a momentum
            delta = torch.randn(frag.params.numel(), generator=g) * 0.01
            await _merge(server, learner, delta)
            params, momentum = _nesterov(params, momentum, delta, MU)
        assert torch.allclose(frag.params, params, atol=1e-6)
        assert momentum.abs().sum() > 0
        delta = torch.randn(frag.params.numel(), generator=g) * 0.01
        await _merge(server, learner, delta, hand_over=True)
        want, want_b = _nesterov(params, momentum, delta, MU if hand_over_momentum else 0.0)
        assert torch.allclose(frag.params, want, atol=1e-6)
        assert torch.allclose(frag.momentum, want_b, atol=1e-6)  # plain SGD leaves it as it was
        other, _ = _nesterov(params, momentum, delta, 0.0 if hand_over_momentum else MU)
        assert not torch.allclose(frag.params, other, atol=1e-4)  # the two rules differ measurably here
        await learner.close("done")
    merges = [e for e in _merge_events(tmp_path) if e["fragment"] == 0]
    assert [e["momentum"] for e in merges] == [MU, MU, MU if hand_over_momentum else 0.0]


def _c(learner: str, *, hand_over: bool, carried: tuple[Contribution, ...] = ()) -> Contribution:
    return Contribution(learner, 1, 0, 3, 100, 4, 0.0, hand_over=hand_over, carried=carried)


def test_the_rule_takes_the_momentum_unless_every_entry_is_a_hand_over_that_carries_nothing():
    settings = MergeSettings(method="rda", embedding_patterns=(), stale_anchor="point", staleness_window=4,
                             scale_by_participation=False, outer=OuterNesterov(lr=LR, momentum=MU, momentum_warmup=8))
    older = _c("a", hand_over=False)
    assert settings.outer_step(9, [_c("a", hand_over=True), _c("b", hand_over=True)]).momentum == 0.0
    assert settings.outer_step(9, [_c("a", hand_over=True), _c("b", hand_over=False)]).momentum == MU  # mixed
    assert settings.outer_step(9, [_c("a", hand_over=True, carried=(older,))]).momentum == MU  # a whole period in it
    assert settings.outer_step(9, [_c("a", hand_over=False)]).momentum == MU
    assert settings.outer_step(2, [_c("a", hand_over=False)]).momentum == pytest.approx(MU * 2 / 8)  # warm-up kept
    assert settings.outer_step(9, [_c("a", hand_over=True)]).lr == LR  # only the momentum goes
    kept = dataclasses.replace(settings, hand_over_momentum=True)
    assert kept.outer_step(9, [_c("a", hand_over=True)]).momentum == MU


def test_the_flag_crosses_the_wire_and_a_reader_without_it_parses_the_rest():
    """The previous contract had no field 18 in FragmentHeader: its parser (built here from this
    file's descriptor with the field removed) skips it and reads every other field alike; and a
    header without the flag reads as an ordinary contribution."""
    header = dataclasses.replace(_header(), hand_over=True)
    raw = wire.header_to_pb(header).SerializeToString()
    assert wire.header_from_pb(pb.FragmentHeader.FromString(raw)).hand_over is True
    assert wire.header_from_pb(pb.FragmentHeader.FromString(
        wire.header_to_pb(_header()).SerializeToString())).hand_over is False

    fd = descriptor_pb2.FileDescriptorProto()
    pb.DESCRIPTOR.CopyToProto(fd)
    msg = next(m for m in fd.message_type if m.name == "FragmentHeader")
    field = next(f for f in msg.field if f.name == "hand_over")
    assert field.number == 18
    msg.field.remove(field)
    pool = descriptor_pool.DescriptorPool()
    for dep in pb.DESCRIPTOR.dependencies:
        dep_fd = descriptor_pb2.FileDescriptorProto()
        dep.CopyToProto(dep_fd)
        pool.Add(dep_fd)
    pool.Add(fd)
    Old = message_factory.GetMessageClass(pool.FindMessageTypeByName("ddiloco.v1.FragmentHeader"))
    old = Old.FromString(raw)
    assert not hasattr(old, "hand_over")
    assert (old.fragment_id, old.version, old.sequence, old.tokens, old.steps, old.round, old.digest) == (
        header.fragment_id, header.version, header.sequence, header.tokens, header.steps, header.round, header.digest)


def _header():
    from ddiloco.fragments.chunking import TransferHeader
    from ddiloco.fragments.partition import TensorSpec
    return TransferHeader(kind="contribution", fragment_id=1, version=7, codec="fp32",
                          tensors=(TensorSpec("w", (2, 3), "float32"),), num_values=6, sequence=5, tokens=640,
                          steps=3, encoded_bytes=24, chunk_count=1, digest=bytes(range(16)), round=0)


def test_a_hand_over_that_replaces_an_ordinary_contribution_is_no_longer_a_hand_over():
    """Same learner, same base: the newer contribution holds the older one's progress. Replacing
    an ordinary one waiting to be merged (synchronizer) or waiting to be sent (learner), a
    hand-over holds a whole period: its round keeps the momentum. Replacing a hand-over, or
    summed with an older base's contribution (carried), it keeps or loses the flag as said."""
    from ddiloco.learner.events import EventLog
    from ddiloco.learner.mailbox import Mailbox, Outgoing
    from ddiloco.synchronizer.inbox import Inbox

    def contribution(seq: int, base: int, hand_over: bool) -> Contribution:
        return Contribution("a", seq, 0, base, 100, 4, float(seq), 0, 1, hand_over=hand_over)

    row = torch.ones(3)
    box = Inbox(3)
    box.add(contribution(1, 0, False), row)
    assert box.add(contribution(2, 0, True), row) is not None  # superseded
    assert [e.hand_over for e in box.seal().entries] == [False]
    box.add(contribution(3, 5, True), row)
    box.add(contribution(4, 5, True), row)  # a hand-over replacing a hand-over (a restart's resend)
    assert [e.hand_over for e in box.seal().entries] == [True]
    box.add(contribution(5, 6, False), row)
    box.add(contribution(6, 7, True), row)  # an older base: carried, so the rule keeps the momentum
    (entry,) = box.seal().entries
    assert entry.hand_over and entry.carried
    settings = MergeSettings(method="rda", embedding_patterns=(), stale_anchor="point", staleness_window=4,
                             scale_by_participation=False, outer=OuterNesterov(lr=LR, momentum=MU))
    assert settings.outer_step(9, [entry]).momentum == MU

    mailbox = Mailbox(EventLog(None, learner_id="a", incarnation=1))

    def out(seq: int, base: int, hand_over: bool) -> Outgoing:
        return Outgoing(0, seq, base, 100, 4, 10, torch.zeros(3), hand_over=hand_over)
    mailbox.submit(out(1, 0, False))
    mailbox.submit(out(2, 0, True))  # the unsent ordinary one is dropped: its period rides along
    sent = mailbox.next_outgoing()
    assert sent is not None and (sent.sequence, sent.hand_over) == (2, False)
    mailbox.submit(out(3, 1, False))
    mailbox.submit(out(4, 2, True))  # an older base stays queued: the hand-over is only its own steps
    assert [(o.sequence, o.hand_over) for o in (mailbox.next_outgoing(), mailbox.next_outgoing())] == [(3, False), (4, True)]
