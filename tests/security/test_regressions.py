"""Two faults the security tests found, kept as regression tests.

1. A Sync stream that ends by cancellation (the learner's connection drops, or the client cancels
   the call) must not leave its outbox task running: such a task woke on the next message queued
   for the learner id and swallowed it, so a learner that reconnected never got its first result
   (or request, resync, global fragment), although results are meant to outlive a stream.
2. One learner that heartbeats a tiny positive ``step_time_s`` (1e-300 here) must not stall the
   synchronizer: it set the fleet clock's pace (quorum 1: the fastest learner's) and the clock
   counted ~1e300 fleet steps, opening rounds in an endless loop on the event loop. Now such a step
   time is ignored, and the clock opens each fragment at most once per tick. The server runs in a
   subprocess here, so a stalled loop could be killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import subprocess
import sys
import time

import torch

from ddiloco.algorithm.policies import QuorumPolicy
from ddiloco.protocol.client import get_status
from tests.scripted import ScriptedLearner, eventually, genesis_learner, running_server, sync_config

REPO = pathlib.Path(__file__).resolve().parents[2]


async def _genesis(server) -> ScriptedLearner:
    return await genesis_learner(server)


async def test_a_result_after_a_dropped_stream_reaches_the_reconnected_learner(tmp_path):
    cfg = sync_config(tmp_path, policy=QuorumPolicy(quorum=1, grace_gamma=0.0, max_grace_s=0.0))
    async with running_server(cfg) as server:
        a = await _genesis(server)
        x = ScriptedLearner(server.port, "x")
        await x.connect()
        x.start_pump(heartbeat_s=0)
        x.stream._call.cancel()  # the connection drops; nothing is said
        await eventually(lambda: not server.engine.membership.learners["x"].connected, what="x detached")
        # The same learner process reconnects and sends a contribution the synchronizer refuses.
        x2 = ScriptedLearner(server.port, "x")
        x2.incarnation = x.incarnation
        await x2.connect()
        x2.start_pump(heartbeat_s=0)
        n = x2.layout[0].numel
        seq = await x2.contribute(0, torch.full((n,), float("nan")), base_version=0)
        await eventually(lambda: server.engine.ledger.rejected_by_reason["non_finite"] == 1, what="refusal")
        try:
            result = await x2.wait_result(seq, timeout_s=3)  # lost: the dead stream's pop task took it
            assert (result.outcome, result.reason) == ("rejected", "non_finite")
        finally:
            for learner in (x, x2, a):
                await learner.close()


_SERVER = """
import asyncio, pathlib, sys
from ddiloco.algorithm.policies import QuorumPolicy
from tests.scripted import running_server, sync_config

async def main():
    cfg = sync_config(pathlib.Path(sys.argv[1]), policy=QuorumPolicy(quorum=1, grace_gamma=0.0, max_grace_s=0.0))
    async with running_server(cfg) as server:
        print(server.port, flush=True)
        await asyncio.Event().wait()

asyncio.run(main())
"""


async def test_a_learner_reporting_a_tiny_step_time_does_not_stall_the_synchronizer(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen([sys.executable, "-c", _SERVER, str(tmp_path)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    learner = None
    try:
        line = await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(None, proc.stdout.readline), 60)
        port = int(line)
        target = f"127.0.0.1:{port}"
        learner = ScriptedLearner(port, "a")
        await learner.connect()
        await learner.upload_genesis()
        deadline = time.monotonic() + 60
        while (await get_status(target, timeout_s=5)).state != "ready":
            assert time.monotonic() < deadline, "the synchronizer never became ready"
            await asyncio.sleep(0.05)
        await learner.heartbeat(step=7, step_time_s=1e-300)  # one message, from one learner
        # the synchronizer took it (the learner's step moved to 7) and still answers at once
        while True:
            status = await asyncio.wait_for(get_status(target, timeout_s=5), 10)
            if any(ls.learner_id == "a" and ls.step == 7 for ls in status.learners):
                break
            assert time.monotonic() < deadline, "the heartbeat never reached the synchronizer"
            await asyncio.sleep(0.05)
        assert status.state == "ready"
        status = await asyncio.wait_for(get_status(target, timeout_s=5), 10)
        assert status.state == "ready"
    finally:
        proc.kill()
        proc.wait(timeout=30)
        if learner is not None:
            learner.stream._call.cancel()
            with contextlib.suppress(Exception):
                await learner.channel.close(grace=None)
