"""One torchft replica for ``ddiloco bench torchft``: a subprocess the benchmark starts, never
imported by ddiloco itself.

A replica group of one rank trains the built-in GPT with ddiloco's inner loop under torchft's
``Manager`` and ``DiLoCo`` (torchft's own fragment streaming), against the lighthouse in
``TORCHFT_LIGHTHOUSE``, and writes what it does as JSON lines for the benchmark to read.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
import time
from typing import Any

from ddiloco.core import events as schema


def replica_main(argv: list[str]) -> int:
    """One torchft replica group of one rank: the built-in GPT, ddiloco's inner loop, torchft's
    Manager and DiLoCo. ``--mode overhead``: off/on phases; ``--mode run``: DiLoCo until the stop
    file appears or ``--max-s`` passes. Events go to ``--events`` as JSON lines."""
    p = argparse.ArgumentParser(prog="python -m ddiloco.lab.bench.torchft_replica")
    for name in ("replica-id", "d-model", "n-layer", "n-head", "context", "batch-size", "fragments", "sync-every",
                 "overlap", "steps", "warmup", "repeats", "parent"):
        p.add_argument(f"--{name}", type=int, required=True)
    p.add_argument("--mode", choices=("overhead", "run"), required=True)
    p.add_argument("--events", required=True)
    p.add_argument("--go", required=True)
    p.add_argument("--stop", required=True)
    p.add_argument("--max-s", type=float, required=True)
    a = p.parse_args(argv)
    events = open(a.events, "a", buffering=1)  # noqa: SIM115 (open for the process's life)

    def emit(event: str, **fields: Any) -> None:  # the torchft_replica log of ddiloco.core.events
        line = schema.record(schema.TORCHFT_LOG, event, {"replica": a.replica_id, **fields}, t=time.time())
        events.write(json.dumps(line) + "\n")

    def orphan_watch() -> None:  # the benchmark went away: leave nothing running
        while True:
            if os.getppid() != a.parent:
                os._exit(3)
            time.sleep(0.5)

    threading.Thread(target=orphan_watch, daemon=True).start()
    try:
        return _replica(a, emit)
    except Exception as exc:  # recorded, then the process dies as the job would
        emit(schema.ERROR, error=f"{type(exc).__name__}: {exc}")
        events.flush()
        os._exit(1)


def _replica(a: argparse.Namespace, emit: Any) -> int:
    from datetime import timedelta

    import torch
    from torch.distributed import TCPStore
    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    from ddiloco.fragments.partition import partition_tensors
    from ddiloco.training.config import TrainConfig
    from ddiloco.training.inner_loop import InnerLoop
    from ddiloco.training.model import ModelConfig, build_model

    torch.set_num_threads(1)
    model_cfg = ModelConfig(d_model=a.d_model, n_layer=a.n_layer, n_head=a.n_head, context=a.context)
    model = build_model(model_cfg, seed=0)
    total = (a.steps + a.warmup) * a.repeats * 2 + 1_000_000
    loop = InnerLoop(model, TrainConfig(steps=total, warmup_steps=0, device="cpu"), torch.device("cpu"))
    params = dict(model.named_parameters())
    fragments = []
    for frag in partition_tensors(list(params.items()), a.fragments).fragments:  # ddiloco's own partition
        holder = torch.nn.Module()
        for spec in frag.tensors:
            holder.register_parameter(spec.name.replace(".", "__"), params[spec.name])
        fragments.append(holder)
    outer = [torch.optim.SGD(f.parameters(), lr=0.7, momentum=0.9, nesterov=True) for f in fragments]

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": loop.optimizer.state_dict()}

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        loop.optimizer.load_state_dict(sd["optim"])

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(pg=ProcessGroupGloo(), load_state_dict=load_state_dict, state_dict=state_dict,
                      min_replica_size=1, use_async_quorum=False, rank=0, world_size=1, store_addr="127.0.0.1",
                      store_port=store.port, replica_id=f"replica-{a.replica_id}", hostname="127.0.0.1",
                      timeout=timedelta(seconds=60), quorum_timeout=timedelta(seconds=60))
    counts = {"syncs": 0, "commits": 0, "min_participants": 1 << 30}
    should_commit = manager.should_commit

    def logged_commit(*args: Any, **kwargs: Any) -> bool:
        ok = bool(should_commit(*args, **kwargs))
        n = manager.num_participants()
        counts["syncs"] += 1
        counts["commits"] += int(ok)
        counts["min_participants"] = min(counts["min_participants"], n)
        emit(schema.SYNC, ok=ok, participants=n, manager_step=manager.current_step())
        return ok

    manager.should_commit = logged_commit  # type: ignore[method-assign]
    diloco = DiLoCo(manager, fragments, loop.optimizer, outer, sync_every=a.sync_every, pin_memory=False,
                    fragment_sync_delay=a.overlap)
    gen = torch.Generator().manual_seed(a.replica_id)

    def inner_step() -> None:
        window = torch.randint(0, model_cfg.vocab_size, (a.batch_size, model_cfg.context + 1), generator=gen)
        loop.step(window[:, :-1], window[:, 1:])

    emit(schema.READY, pid=os.getpid())
    deadline = time.monotonic() + a.max_s
    while not os.path.exists(a.go):
        if time.monotonic() > deadline:
            raise TimeoutError("no go from the benchmark")
        time.sleep(0.02)
    if a.mode == "overhead":
        for repeat in range(a.repeats):
            for kind in ("off", "on"):
                ctx = diloco if kind == "on" else contextlib.nullcontext()
                with ctx:
                    for _ in range(a.warmup):
                        inner_step()
                    counts.update(syncs=0, commits=0, min_participants=1 << 30)
                    t0 = time.perf_counter()
                    for _ in range(a.steps):
                        inner_step()
                    seconds = time.perf_counter() - t0
                emit(schema.PHASE, kind=kind, repeat=repeat, steps=a.steps, seconds=seconds, syncs=counts["syncs"],
                     commits=counts["commits"], min_participants=counts["min_participants"] if counts["syncs"] else 0)
    else:
        with diloco:
            for step in range(total):
                if os.path.exists(a.stop) or time.monotonic() > deadline:
                    break
                t0 = time.perf_counter()
                inner_step()
                emit(schema.STEP, step=step, step_s=time.perf_counter() - t0)
    emit(schema.END)
    sys.stdout.flush()
    os._exit(0)  # the manager's threads are not waited for


if __name__ == "__main__":
    sys.exit(replica_main(sys.argv[1:]))
