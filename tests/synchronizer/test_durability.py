"""Durability: SIGKILL at any moment never loses a committed version or loads a partial file.

Two levels: the state store killed in the middle of writing large version files, and the whole
synchronizer service (a real subprocess) killed while learners stream contributions, then
restarted on the same state dir: versions continue monotonically and every version any learner
was sent is still known.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import textwrap
import time
import zlib

import pytest
import torch

from ddiloco.lab.cluster import wait_ready
from ddiloco.synchronizer.store import FragmentRecord, StateStore
from tests.scripted import ScriptedLearner, eventually, toy_protocol

WRITER = textwrap.dedent("""
    import sys, torch
    from ddiloco.synchronizer.store import StateStore, FragmentRecord
    store = StateStore(sys.argv[1], keep_versions=3)
    n = int(sys.argv[2])
    v = 0
    while True:
        v += 1
        x = torch.full((n,), float(v))
        store.commit(FragmentRecord(0, v, x, -x, v))
        print(v, flush=True)
""")


@pytest.mark.parametrize("trial", range(4))
def test_store_killed_mid_write_loads_last_complete_version(tmp_path, trial):
    n = 1 << 20  # 8 MiB per version file: writes take long enough to be interrupted
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), str(n)], stdout=subprocess.PIPE,
                            text=True)
    try:
        committed = 0
        target = random.Random(trial).randint(3, 12)
        deadline = time.monotonic() + 60
        while committed < target and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            committed = int(line)
        time.sleep(random.Random(trial).random() * 0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        for line in proc.stdout.read().split():  # reports still in the pipe at the kill
            committed = int(line)
    finally:
        proc.kill()
        proc.wait()
    assert committed >= 3, "writer made no progress"
    store = StateStore(tmp_path, keep_versions=3)
    assert not list(tmp_path.rglob("*.tmp")), "temp files must be cleaned at start-up"
    latest, history = store.load_latest(0, n)
    assert latest is not None
    # every version reported as committed is durable; at most one more finished before the kill
    assert committed <= latest.version <= committed + 1
    assert torch.all(latest.params == float(latest.version)) and torch.all(latest.momentum == -latest.version)
    assert [h.version for h in history] == list(range(latest.version - len(history), latest.version))


def test_torn_or_corrupt_newest_file_is_never_loaded(tmp_path):
    store = StateStore(tmp_path, keep_versions=5)
    for v in (1, 2, 3):
        store.commit(FragmentRecord(0, v, torch.full((1000,), float(v)), torch.zeros(1000), v))
    newest = tmp_path / "fragments" / "p0000" / "v000000000003.frag"
    blob = newest.read_bytes()
    newest.write_bytes(blob[: len(blob) // 2])  # torn
    latest, _ = store.load_latest(0, 1000)
    assert latest is not None and latest.version == 2
    mid = tmp_path / "fragments" / "p0000" / "v000000000002.frag"
    data = bytearray(mid.read_bytes())
    data[100] ^= 1  # one flipped bit
    mid.write_bytes(bytes(data))
    latest, _ = store.load_latest(0, 1000)
    assert latest is not None and latest.version == 1
    # wrong size for this fragment: refused
    assert store.load_latest(0, 999)[0] is None


def _start_synchronizer(state_dir: pathlib.Path, config: pathlib.Path, ready: pathlib.Path) -> subprocess.Popen:
    ready.unlink(missing_ok=True)
    env = dict(os.environ, DDILOCO_LOG_JSON="1")
    return subprocess.Popen(
        [sys.executable, "-m", "ddiloco.core.cli", "synchronizer", "--listen", "127.0.0.1:0", "--state-dir",
         str(state_dir), "--config", str(config), "--ready-file", str(ready)],
        stdout=subprocess.DEVNULL, stderr=open(state_dir.parent / "sync.log", "ab"), env=env)


async def _stream_contributions(learner: ScriptedLearner, versions: dict[int, int], stop: asyncio.Event) -> None:
    """Contribute to every fragment against the newest version this learner has seen."""
    from ddiloco.protocol.client import StreamClosed

    rng = torch.Generator().manual_seed(zlib.crc32(learner.learner_id.encode()))  # the same in every process
    try:
        while not stop.is_set():
            for p in range(learner.protocol.num_fragments):
                for t in learner.globals:
                    versions[p] = max(versions.get(p, 0), t.header.version if t.header.fragment_id == p else 0)
                delta = torch.randn(learner.layout[p].numel, generator=rng) * 0.01
                await learner.contribute(p, delta, base_version=versions.get(p, 0))
            await asyncio.sleep(0.01)
    except StreamClosed:
        pass


async def test_synchronizer_sigkill_mid_run_resumes_with_monotonic_versions(tmp_path):
    state_dir = tmp_path / "state"
    config = tmp_path / "sync.json"
    protocol = toy_protocol()
    config.write_text(json.dumps({
        "protocol": {k: getattr(protocol, k) for k in ("mode", "num_fragments", "sync_every", "overlap",
                                                       "max_chunk_bytes", "global_codec")},
        "synchronizer": {"policy": {"quorum": 1, "grace_gamma": 0.0, "max_grace_s": 0.0},
                         "heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 2.0},
    }))
    ready = tmp_path / "ready.json"
    proc = _start_synchronizer(state_dir, config, ready)
    learners: list[ScriptedLearner] = []
    try:
        port = wait_ready(proc, ready, timeout_s=60)
        a, b = ScriptedLearner(port, "a"), ScriptedLearner(port, "b")
        await a.connect()
        await a.upload_genesis()
        for lr in (a, b):
            lr.start_pump()
        await eventually(lambda: (state_dir / "meta.json").exists(), what="genesis committed")
        assert (await b.connect()).state == "ready"
        b.start_pump()
        learners = [a, b]
        seen: dict[str, dict[int, int]] = {"a": {}, "b": {}}
        stop = asyncio.Event()
        tasks = [asyncio.create_task(_stream_contributions(lr, seen[lr.learner_id], stop)) for lr in learners]
        await eventually(lambda: sum(1 for r in a.results if r.outcome == "merged") >= 10, timeout_s=30,
                         what="merges before the kill")
        proc.send_signal(signal.SIGKILL)  # mid-run: contributions and commits in flight
        proc.wait()
        stop.set()
        await asyncio.gather(*tasks)
        # every version any learner was told about (broadcast or merged result)
        held = {}
        for lr in learners:
            for t in lr.globals:
                held[t.header.fragment_id] = max(held.get(t.header.fragment_id, 0), t.header.version)
            for r in lr.results:
                if r.outcome == "merged":
                    held[r.fragment_id] = max(held.get(r.fragment_id, 0), r.version)
            await lr.close()
        assert held, "learners saw no versions before the kill"

        proc = _start_synchronizer(state_dir, config, ready)
        port = wait_ready(proc, ready, timeout_s=60)
        a2 = ScriptedLearner(port, "a")
        welcome = await a2.connect()
        learners = [a2]
        assert welcome.state == "ready"
        for p, v in held.items():
            assert welcome.versions[p] >= v, f"fragment {p}: restarted at {welcome.versions[p]}, a learner held {v}"
        a2.start_pump()
        resumed = dict(welcome.versions)
        s = await a2.contribute(0, torch.full((a2.layout[0].numel,), 0.01), base_version=resumed[0])
        r = await a2.wait_result(s, timeout_s=20)
        assert r.outcome == "merged" and r.version == resumed[0] + 1
        fetched = await a2.stream.fetch_state("a")
        assert {t.header.fragment_id: t.header.version for t in fetched}[0] == resumed[0] + 1
    finally:
        for lr in learners:
            await lr.close()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    assert proc.returncode in (0, -signal.SIGKILL), f"graceful shutdown returned {proc.returncode}"
