"""Scripted learners for synchronizer tests: real gRPC streams, hand-made contributions.

A ``ScriptedLearner`` speaks the real protocol through ``ddiloco.protocol.client.SyncStream``
against a real server on 127.0.0.1:0; the test decides exactly what each learner sends and when.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import pathlib
import time
from collections.abc import AsyncIterator, Callable

import torch

from ddiloco.algorithm.policies import QuorumPolicy
from ddiloco.fragments.chunking import Transfer
from ddiloco.fragments.codec import make_codec
from ddiloco.fragments.partition import FragmentLayout, partition_tensors
from ddiloco.fragments.payload import decode_fragment, encode_fragment
from ddiloco.learner.comm import Comm
from ddiloco.learner.config import LearnerConfig
from ddiloco.learner.events import EventLog
from ddiloco.protocol import wire
from ddiloco.protocol.client import SyncStream, message_limit, open_channel
from ddiloco.protocol.config import ProtocolConfig
from ddiloco.protocol.credentials import Credentials
from ddiloco.synchronizer.config import SynchronizerConfig
from ddiloco.synchronizer.server import SynchronizerServer

MODEL_FINGERPRINT = "model-test"


def toy_params(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "tok_emb.weight": torch.randn(16, 8, generator=g) * 0.02,
        "blocks.0.attn.weight": torch.randn(8, 8, generator=g) * 0.02,
        "blocks.0.mlp.weight": torch.randn(8, 16, generator=g) * 0.02,
        "blocks.0.mlp.bias": torch.zeros(16),
        "head.weight": torch.randn(16, 8, generator=g) * 0.02,
    }


def toy_protocol(**kw) -> ProtocolConfig:
    base = dict(mode="decoupled", num_fragments=2, sync_every=4, overlap=1, max_chunk_bytes=4096,
                global_codec="fp32")
    base.update(kw)
    return ProtocolConfig(**base)


def sync_config(state_dir: pathlib.Path, **kw) -> SynchronizerConfig:
    policy = kw.pop("policy", QuorumPolicy(quorum=1, grace_gamma=0.5, max_grace_s=0.5))
    protocol = kw.pop("protocol", toy_protocol())
    return SynchronizerConfig(listen="127.0.0.1:0", state_dir=str(state_dir), protocol=protocol, policy=policy,
                              heartbeat_interval_s=0.2, heartbeat_timeout_s=2.0, **kw)


@contextlib.asynccontextmanager
async def running_server(cfg: SynchronizerConfig) -> AsyncIterator[SynchronizerServer]:
    server = SynchronizerServer(cfg)
    await server.start()
    try:
        yield server
    finally:
        await server.stop(grace=0.5)


def older_welcome(monkeypatch, server: SynchronizerServer, **fields) -> None:  # type: ignore[no-untyped-def]
    """From now on every Welcome ``server`` sends has ``fields`` replaced: a synchronizer of an
    earlier contract, whose welcome leaves them unset (``digest_only=False``...)."""
    real_hello = server.engine.hello

    def hello(message):  # type: ignore[no-untyped-def]
        record, welcome = real_hello(message)
        return record, dataclasses.replace(welcome, **fields)

    monkeypatch.setattr(server.engine, "hello", hello)


async def eventually(predicate: Callable[[], bool], timeout_s: float = 10.0, what: str = "condition") -> None:
    """Wait until ``predicate()`` holds, polling; fail with ``what`` after the deadline."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.01)


async def seed_genesis(server: SynchronizerServer) -> ProtocolConfig:
    """Genesis uploaded by a scripted learner ``seed`` that then leaves: the server is ready and no
    learner is on it. Returns the protocol the seed spoke."""
    seed = ScriptedLearner(server.port, "seed")
    await seed.connect()
    await seed.upload_genesis()
    await eventually(lambda: server.engine.ready, what="genesis commit")
    await seed.close("seeded")
    return seed.protocol


def learner_comm(server: SynchronizerServer, protocol: ProtocolConfig, events: EventLog, learner_id: str = "b",
                 **settings) -> Comm:
    """The learner's communication (thread mode, not started) for ``toy_params`` on ``server``."""
    cfg = LearnerConfig(synchronizer=f"127.0.0.1:{server.port}", learner_id=learner_id, protocol=protocol, **settings)
    return Comm(cfg, layout=partition_tensors(toy_params(), protocol.num_fragments), model_fingerprint=MODEL_FINGERPRINT,
                incarnation=events.bound["incarnation"], events=events, held=lambda: {}, genesis_values=lambda: {})


async def genesis_learner(server: SynchronizerServer, learner_id: str = "a", *, pump: bool = True,
                          **kw) -> ScriptedLearner:
    """Connect a learner, upload genesis from it, wait for the commit; pumping its stream unless not."""
    learner = ScriptedLearner(server.port, learner_id, **kw)
    await learner.connect()
    await learner.upload_genesis()
    await eventually(lambda: server.engine.ready, what="genesis commit")
    if pump:
        learner.start_pump()
    return learner


class ScriptedLearner:
    _incarnations = itertools.count(1)

    def __init__(self, port: int, learner_id: str, *, params: dict[str, torch.Tensor] | None = None,
                 protocol: ProtocolConfig | None = None, token: str | None = None,
                 credentials: Credentials | None = None) -> None:
        self.learner_id = learner_id
        self.protocol = protocol or toy_protocol()
        self.params = params if params is not None else toy_params()
        self.layout: FragmentLayout = partition_tensors(self.params, self.protocol.num_fragments)
        self.channel = open_channel(f"127.0.0.1:{port}", max_message_bytes=message_limit(self.protocol.max_chunk_bytes),
                                    credentials=credentials)
        token = token if credentials is None else credentials.token
        self.stream = SyncStream(self.channel, max_chunk_bytes=self.protocol.max_chunk_bytes, token=token)
        self.codec = make_codec("fp32")
        self.sequence = itertools.count(1)
        self.transfer_ids = itertools.count(1)
        self.incarnation = next(self._incarnations)
        self.welcome: wire.Welcome | None = None
        self.results: list[wire.ContributionResult] = []
        self.globals: list[Transfer] = []
        self.control: list[object] = []
        self.requests: list[wire.FragmentRequest] = []
        self._pump: asyncio.Task[None] | None = None
        self._beat: asyncio.Task[None] | None = None
        self.step_time_s = 0.1
        """What its heartbeats report (the fleet's clock runs at this pace)."""
        self.training_done = False
        """What its heartbeats say about training (set by ``heartbeat(training_done=...)``)."""
        self.closed: Exception | None = None

    def hello(self, **overrides) -> wire.Hello:
        p = self.protocol
        fields = dict(
            learner_id=self.learner_id, model_fingerprint=MODEL_FINGERPRINT, layout_hash=self.layout.fingerprint,
            protocol=wire.ProtocolParams.from_config(p),
            incarnation=self.incarnation)
        fields.update(overrides)
        return wire.Hello(**fields)

    async def connect(self, **hello_overrides) -> wire.Welcome:
        self.welcome = await self.stream.open(self.hello(**hello_overrides))
        return self.welcome

    def start_pump(self, heartbeat_s: float = 0.2) -> None:
        """Read the stream on a task, and heartbeat every ``heartbeat_s`` like a real learner (0: not)."""
        self._pump = asyncio.create_task(self._pump_loop())
        if heartbeat_s > 0:
            self._beat = asyncio.create_task(self._beat_loop(heartbeat_s))

    async def _beat_loop(self, every_s: float) -> None:
        with contextlib.suppress(Exception):
            while True:
                await asyncio.sleep(every_s)
                await self.heartbeat(step_time_s=self.step_time_s)

    async def _pump_loop(self) -> None:
        try:
            while True:
                msg = await self.stream.receive()
                if isinstance(msg, Transfer):
                    self.globals.append(msg)
                elif isinstance(msg, wire.ContributionResult):
                    self.results.append(msg)
                elif isinstance(msg, wire.FragmentRequest):
                    self.requests.append(msg)
                else:
                    self.control.append(msg)
        except Exception as exc:
            self.closed = exc

    def flat(self, fragment: int) -> torch.Tensor:
        frag = self.layout[fragment]
        return torch.cat([self.params[name].reshape(-1).float() for name in frag.names])

    async def upload_genesis(self) -> None:
        for frag in self.layout:
            chunks = encode_fragment(self.flat(frag.index), frag, codec=self.codec, kind="genesis", version=0,
                                     transfer_id=next(self.transfer_ids), layout_hash=self.layout.fingerprint,
                                     sequence=next(self.sequence), max_chunk_bytes=self.protocol.max_chunk_bytes)
            await self.stream.send_transfer(chunks)

    async def contribute(self, fragment: int, delta: torch.Tensor, *, base_version: int, tokens: int = 1000,
                         steps: int = 4, trailing_digest: bool | None = None, **header_overrides) -> int:
        """``trailing_digest``: None does what a learner does (a trailing digest to a synchronizer
        that reads one)."""
        frag = self.layout[fragment]
        seq = next(self.sequence)
        trailing = self.stream.peer_trailing_digest if trailing_digest is None else trailing_digest
        chunks = encode_fragment(delta.float(), frag, codec=self.codec, kind="contribution", version=base_version,
                                 transfer_id=next(self.transfer_ids), layout_hash=self.layout.fingerprint,
                                 sequence=seq, tokens=tokens, steps=steps,
                                 max_chunk_bytes=self.protocol.max_chunk_bytes, trailing_digest=trailing)
        if header_overrides:
            chunks[0] = dataclasses.replace(chunks[0], header=dataclasses.replace(chunks[0].header, **header_overrides))
        await self.stream.send_transfer(chunks)
        return seq

    async def heartbeat(self, step: int = 1, step_time_s: float | None = None,
                        training_done: bool | None = None) -> None:
        """One heartbeat; ``training_done`` is kept for the ones after (the pump's too), as a real
        learner that finished says so in every heartbeat from then on."""
        if step_time_s is not None:
            self.step_time_s = step_time_s
        if training_done is not None:
            self.training_done = training_done
        await self.stream.send(wire.Heartbeat(step=step, tokens_total=step * 100, tokens_per_s=1000.0,
                                              step_time_s=self.step_time_s, training_done=self.training_done))

    async def wait_request(self, fragment: int, after_round: int = 0, timeout_s: float = 10.0) -> wire.FragmentRequest:
        """The synchronizer's next request for ``fragment`` (a round after ``after_round``)."""
        def found() -> wire.FragmentRequest | None:
            return next((r for r in self.requests if r.fragment_id == fragment and r.round > after_round), None)

        await eventually(lambda: found() is not None, timeout_s, f"a request for fragment {fragment}")
        request = found()
        assert request is not None
        return request

    def result_for(self, sequence: int) -> wire.ContributionResult | None:
        return next((r for r in self.results if r.sequence == sequence), None)

    async def wait_result(self, sequence: int, timeout_s: float = 10.0) -> wire.ContributionResult:
        await eventually(lambda: self.result_for(sequence) is not None, timeout_s,
                         f"result of contribution {sequence} at {self.learner_id}")
        result = self.result_for(sequence)
        assert result is not None
        return result

    def latest_global(self, fragment: int) -> Transfer | None:
        mine = [t for t in self.globals if t.header.fragment_id == fragment]
        return max(mine, key=lambda t: t.header.version) if mine else None

    def decode(self, transfer: Transfer) -> torch.Tensor:
        return decode_fragment(transfer, self.layout)

    async def close(self, goodbye: str | None = None) -> None:
        if self._beat is not None:
            self._beat.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._beat
        await self.stream.close(goodbye)
        if self._pump is not None:
            self._pump.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._pump
        await self.channel.close()
