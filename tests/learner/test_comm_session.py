"""The communication thread against a real synchronizer on 127.0.0.1:0: how a session ends."""

from __future__ import annotations

import asyncio
import dataclasses

from ddiloco.learner.events import EventLog
from tests.scripted import (
    eventually,
    learner_comm,
    running_server,
    seed_genesis,
    sync_config,
)


async def test_stop_says_goodbye_even_with_heartbeats_in_flight(tmp_path):
    # Heartbeats every 10 ms: when the learner stops, a heartbeat write is often in flight. Cancelling that task first cancelled the whole gRPC call (grpc does that when a write
    # is interrupted), the goodbye never arrived and the close raised "RPC already finished".
    cfg = dataclasses.replace(sync_config(tmp_path), heartbeat_interval_s=0.01)
    async with running_server(cfg) as server:
        protocol = await seed_genesis(server)
        seen: list[str] = []
        events = EventLog(None, learner_id="b", incarnation=7)
        events.observers.append(lambda name, fields: seen.append(name))
        comm = learner_comm(server, protocol, events)
        comm.start()
        try:
            await eventually(lambda: "b" in server.engine.membership.learners
                             and server.engine.membership.learners["b"].heartbeat_at > 0, what="b heartbeating")
            # a stream of heartbeats under way: twenty of them seen by the synchronizer
            record = server.engine.membership.learners["b"]
            beats: list[float] = []

            def twenty() -> bool:
                if not beats or record.heartbeat_at != beats[-1]:
                    beats.append(record.heartbeat_at)
                return len(beats) >= 20

            await eventually(twenty, timeout_s=30, what="twenty heartbeats")
        finally:
            await asyncio.to_thread(comm.stop, "finished")
        assert not comm.lanes[0].thread.is_alive(), "stop() returned before the communication thread ended"
        record = server.engine.membership.learners["b"]
        await eventually(lambda: not record.connected, what="b detached")
        assert record.left == "said goodbye (finished)"
        assert seen.count("connect") == 1 and seen.count("disconnect") == 1, seen
