"""One live synchronizer for a whole test module, on its own event loop in a background thread.

Hypothesis state machines and plain-socket tests are synchronous, the server and its clients are
grpc.aio. ``LiveServer`` runs a real ``SynchronizerServer`` on 127.0.0.1:0 in a daemon thread
with its own loop; tests hand it coroutines (``run``), which execute on that loop, so every
grpc.aio object (server, channels, calls) lives on one loop and engine internals are read
between its steps, never while a coroutine of the server is half-way through.

Set-up: a well-behaved learner ``good`` uploads genesis and merges one contribution into each
fragment (so a base one version behind exists for staleness checks), then keeps its stream open,
pumping and heartbeating. The config uses quorum 1 with no grace window (a valid contribution
merges at once) and a staleness window of 0 (a contribution against an older base is refused, not
held back to merge later): between two valid contributions the global state can only stay put.

``check_serving`` is the liveness and integrity probe every test runs after each hostile input:
the health service says SERVING, a separate new learner connects and gets a READY Welcome with
the current versions, GetStatus answers, FetchState returns every fragment, and the fetched
versions and sha256 digests of the fp32 payloads equal the engine's own parameters.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import itertools
import pathlib
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ddiloco.algorithm.policies import QuorumPolicy
from ddiloco.fragments.chunking import Chunk
from ddiloco.fragments.payload import encode_fragment
from ddiloco.protocol import wire
from ddiloco.protocol.client import open_channel
from ddiloco.synchronizer import config as sync_config_module
from ddiloco.synchronizer.server import SynchronizerServer
from tests.scripted import ScriptedLearner, eventually, sync_config

T = TypeVar("T")
State = dict[int, tuple[int, str]]
"""fragment -> (version, sha256 of its fp32 parameters)."""

_probe_ids = itertools.count(1)


def generous_limits() -> dict[str, Any]:
    """Connection limits far above what these tests open (they open hundreds of streams from one
    address in a minute), where the config has such limits; nothing where it has none."""
    limits_cls = getattr(sync_config_module, "Limits", None)
    if limits_cls is None or "limits" not in {f.name for f in dataclasses.fields(sync_config_module.SynchronizerConfig)}:
        return {}
    names = {f.name for f in dataclasses.fields(limits_cls)}
    wanted = {"hello_rate_per_s": 100_000.0, "hello_burst": 100_000, "max_streams": 4096}
    return {"limits": limits_cls(**{k: v for k, v in wanted.items() if k in names})}


def digest_of(values: torch.Tensor) -> str:
    return hashlib.sha256(values.detach().to(torch.float32).contiguous().numpy().tobytes()).hexdigest()


def build_contribution(learner: ScriptedLearner, fragment: int, delta: torch.Tensor, *, base_version: int,
                       sequence: int | None = None, tokens: int = 1000, steps: int = 4,
                       max_chunk_bytes: int | None = None, **header_overrides: Any) -> tuple[int, list[Chunk]]:
    """A contribution transfer as ``learner`` would send it (header fields overridable)."""
    frag = learner.layout[fragment]
    seq = next(learner.sequence) if sequence is None else sequence
    chunks = encode_fragment(delta.float(), frag, codec=learner.codec, kind="contribution", version=base_version,
                             transfer_id=next(learner.transfer_ids), layout_hash=learner.layout.fingerprint,
                             sequence=seq, tokens=tokens, steps=steps,
                             max_chunk_bytes=max_chunk_bytes or learner.protocol.max_chunk_bytes)
    if header_overrides:
        chunks[0] = dataclasses.replace(chunks[0], header=dataclasses.replace(chunks[0].header, **header_overrides))
    return seq, chunks


class LiveServer:
    """A synchronizer serving on 127.0.0.1:0 from a background event loop (see the module doc)."""

    def __init__(self, state_dir: pathlib.Path) -> None:
        self.cfg = sync_config(state_dir, policy=QuorumPolicy(quorum=1, grace_gamma=0.0, max_grace_s=0.0),
                               staleness_window=0, **generous_limits())
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="live-synchronizer", daemon=True)
        self.thread.start()
        self.server: SynchronizerServer | None = None
        self.good: ScriptedLearner | None = None
        self.last_merged: dict[int, tuple[int, list[Chunk], int]] = {}
        """fragment -> (sequence, chunks, version) of good's newest merged contribution."""
        try:
            self.run(self._start(), timeout_s=60.0)
        except BaseException:
            self.close()
            raise

    # -- plumbing -------------------------------------------------------------------------

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 30.0) -> T:
        """Run ``coro`` on the server's loop and return its result (its exception propagates)."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout_s)
        except TimeoutError:
            future.cancel()
            raise

    @property
    def port(self) -> int:
        assert self.server is not None
        return self.server.port

    async def _start(self) -> None:
        self.server = SynchronizerServer(self.cfg)
        await self.server.start()
        good = ScriptedLearner(self.port, "good")
        welcome = await good.connect()
        assert welcome.state == "genesis_requested", welcome
        await good.upload_genesis()
        await eventually(lambda: self.server.engine.ready, what="genesis commit")
        good.step_time_s = 5.0  # a slow fleet clock: few requests while the tests run
        good.start_pump(heartbeat_s=0.2)
        await good.heartbeat(step_time_s=5.0)
        self.good = good
        for fragment in self.server.engine.fragments:
            await self.merge(fragment, seed=fragment)

    def close(self) -> None:
        if self.loop.is_running():
            with contextlib.suppress(Exception):
                self.run(self._stop(), timeout_s=30.0)
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10.0)
        if not self.thread.is_alive():
            self.loop.close()

    async def _stop(self) -> None:
        if self.good is not None:
            await self.good.close()
        if self.server is not None:
            await self.server.stop(grace=0.5)
        current = asyncio.current_task()
        leftovers = [t for t in asyncio.all_tasks() if t is not current]
        for task in leftovers:
            task.cancel()
        await asyncio.gather(*leftovers, return_exceptions=True)

    # -- state ----------------------------------------------------------------------------

    async def engine_state(self) -> State:
        assert self.server is not None
        return {p: (f.version, digest_of(f.params)) for p, f in sorted(self.server.engine.fragments.items())}

    async def merge(self, fragment: int, seed: int = 0, scale: float = 0.01) -> tuple[int, int]:
        """``good`` sends a valid contribution against the current version of ``fragment`` and
        waits for it to merge. Returns (sequence, new version)."""
        assert self.server is not None and self.good is not None
        good = self.good
        engine = self.server.engine
        version = engine.fragments[fragment].version
        # Rounds are clocked by the synchronizer: the fragment falls due now (as test_service does),
        # so the contribution merges at once instead of at the fleet clock's next due step.
        r = engine.rounds[fragment]
        r.request(engine.clock(), r.state.round + 1)
        g = torch.Generator().manual_seed(seed)
        delta = torch.randn(good.layout[fragment].numel, generator=g) * scale
        seq, chunks = build_contribution(good, fragment, delta, base_version=version)
        await good.stream.send_transfer(chunks)
        result = await good.wait_result(seq)
        assert (result.outcome, result.version) == ("merged", version + 1), result
        self.last_merged[fragment] = (seq, chunks, result.version)
        return seq, result.version

    async def check_serving(self) -> State:
        """The service is healthy and consistent; returns the state a new learner fetches."""
        assert self.server is not None and self.good is not None
        engine_before = await self.engine_state()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.port}")
        try:
            stub = health_pb2_grpc.HealthStub(channel)
            for service in ("", wire.SERVICE_NAME):
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING, (service, reply)
        finally:
            await channel.close()
        probe = ScriptedLearner(self.port, f"probe-{next(_probe_ids)}")
        try:
            welcome = await asyncio.wait_for(probe.connect(), timeout=10)
            assert welcome.state == "ready", welcome
            assert welcome.versions == {p: v for p, (v, _) in engine_before.items()}, welcome.versions
            status = await probe.stream.status(timeout_s=10)
            assert status.state == "ready" and len(status.fragments) == len(engine_before)
            fetched = await probe.stream.fetch_state(probe.learner_id, timeout_s=10)
        finally:
            await probe.close(goodbye="probe done")
        state: State = {}
        for transfer in fetched:
            values = probe.decode(transfer)
            state[transfer.header.fragment_id] = (transfer.header.version, digest_of(values))
        assert state == engine_before, (state, engine_before)
        assert await self.engine_state() == engine_before, "the state moved while nothing valid was sent"
        assert self.good.closed is None, f"the well-behaved learner's stream ended: {self.good.closed!r}"
        return state

    async def fresh_learner(self, learner_id: str, *, pump: bool = True,
                            max_message_bytes: int | None = None) -> ScriptedLearner:
        """A new learner, connected (READY) and reading its stream; no heartbeats of its own."""
        learner = ScriptedLearner(self.port, learner_id)
        if max_message_bytes is not None:
            await learner.channel.close()
            learner.channel = open_channel(f"127.0.0.1:{self.port}", max_message_bytes=max_message_bytes)
            learner.stream = type(learner.stream)(learner.channel, max_chunk_bytes=learner.protocol.max_chunk_bytes)
        welcome = await learner.connect()
        assert welcome.state == "ready", welcome
        if pump:
            learner.start_pump(heartbeat_s=0)
        return learner

