"""A learner much slower than the fleet's pace counts each trained token once.

The synchronizer asks for each fragment at the fleet's pace (its fastest learner's), so a slow
learner finds a new request for a fragment at the next step after it answered one, before the
merge holding its answer is applied (tau steps after the send). Its counters run from the last
applied merge, so answering that request would count the steps of the answer in flight a second
time, and the merge would weigh the learner as if it had trained twice as much. A learner
answers a fragment's request at most once per H of its own steps while its previous answer awaits
its merge (and says so in its event log).

Real synchronizer on 127.0.0.1:0, two ``DecoupledSync`` learners in threads: a fast one (steps
of 20 ms) that paces the fleet, and a slow one (steps of 300 ms).
"""

from __future__ import annotations

import asyncio
import json
import time

import torch
from torch import nn

from ddiloco.algorithm.policies import QuorumPolicy
from ddiloco.learner.sync import DecoupledSync
from tests.scripted import running_server, sync_config, toy_protocol


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _train(sync: DecoupledSync, model: nn.Module, steps: int, step_s: float) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1)
    assert sync.join() is not None
    for _ in range(steps):
        began = time.perf_counter()
        x = torch.randn(16, 8, generator=gen)
        loss = (model(x) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(max(0.0, began + step_s - time.perf_counter()))
        sync.step(tokens=100, loss=float(loss.detach()))
    assert sync.finish()


async def test_a_slow_learner_counts_each_token_once(tmp_path) -> None:
    protocol = toy_protocol(num_fragments=2, sync_every=4, overlap=2)
    cfg = sync_config(tmp_path, protocol=protocol, policy=QuorumPolicy(quorum=1, grace_gamma=0.5, max_grace_s=0.05))
    async with running_server(cfg) as server:
        target = f"127.0.0.1:{server.port}"
        settings = {"protocol": {"mode": "decoupled", "num_fragments": 2, "sync_every": 4, "overlap": 2,
                                 "max_chunk_bytes": 4096, "global_codec": "fp32"}}
        fast_model, slow_model = _model(), _model()
        fast = DecoupledSync(fast_model, config=settings, synchronizer=target, learner_id="fast", steps=250,
                             event_log=str(tmp_path / "fast.jsonl"))
        slow = DecoupledSync(slow_model, config=settings, synchronizer=target, learner_id="slow", steps=16,
                             event_log=str(tmp_path / "slow.jsonl"))
        await asyncio.gather(asyncio.to_thread(_train, fast, fast_model, 250, 0.02),
                             asyncio.to_thread(_train, slow, slow_model, 16, 0.3))
    events = [json.loads(line) for line in (tmp_path / "slow.jsonl").read_text().splitlines()]
    sends = [e for e in events if e["event"] == "send"]
    trained = sum(1 for e in events if e["event"] == "step") * 100
    for p in (0, 1):
        sent = sum(e["tokens"] for e in sends if e["fragment"] == p)
        assert sent <= trained, f"fragment {p}: answers claim {sent} tokens, the learner trained {trained}"
    skips = [e for e in events if e["event"] == "skip"]
    assert skips and all("awaits its merge" in e["reason"] for e in skips), "it was asked more often than it answered"
