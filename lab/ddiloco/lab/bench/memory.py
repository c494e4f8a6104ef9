"""``ddiloco bench memory``: the synchronizer's resident bytes per parameter, idle, after genesis,
at steady state and at its peak, of a real synchronizer process driven over the real Sync stream.

A synchronizer is started as ``ddiloco run`` starts it (``LocalCluster.start_synchronizer``: its
own config file, state dir and ready file, on 127.0.0.1) with a synthetic GPT-like layout of
``--params`` fp32 parameters in ``--fragments`` fragments. ``--learners`` synthetic learners speak
the protocol through ``ddiloco.protocol.client.SyncStream`` as a learner does: the first uploads
genesis (fp32), all heartbeat (which paces the synchronizer's fleet clock), and for ``--rounds``
rounds per fragment each answers the synchronizer's request for a fragment with a random outer
gradient in ``--codec`` (the learner's default, bf16_zstd). Learner 1 sends every other round
against the version before the current one, so stale contributions are re-anchored against the
versions the synchronizer retains (``--staleness-window``). Fragments are driven one after the
other, as the fleet's staggered schedule does; each contribution names the request it answers,
the quorum is the whole fleet, and the next round of a fragment starts once every learner's
contribution to it has been answered (a learner asked again before its answer made a quorum
answers again, superseding the waiting one, as the learner service does).

Memory is read from ``/proc/PID/status`` of the synchronizer process (VmRSS, VmHWM, RssAnon,
RssFile), and sampled every 20 ms throughout for the peak of anonymous memory: ``idle`` (serving,
before genesis), ``genesis`` (global state committed, no contributions yet), after each round,
and ``steady`` (after the last round, once nothing is pending: the median of a few samples).
``bytes_per_param_steady`` = (steady VmRSS - idle VmRSS) / params, ``bytes_per_param_peak`` =
(VmHWM - idle VmRSS) / params, against the project's goal of at most 12 (fp32 parameters and
fp32 momentum alone are 8).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import pathlib
import platform
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import yaml

from ddiloco.core.resources import available_cpus
from ddiloco.fragments.chunking import Transfer
from ddiloco.fragments.codec import CODEC_NAMES, make_codec
from ddiloco.fragments.partition import FragmentLayout, TensorSpec, partition
from ddiloco.fragments.payload import encode_fragment
from ddiloco.lab.bench import save_result
from ddiloco.lab.procs import exit_on_sigterm
from ddiloco.protocol import wire
from ddiloco.protocol.client import SyncStream, get_status, message_limit, open_channel
from ddiloco.protocol.config import ProtocolConfig
from ddiloco.protocol.shards import owned, parse_shard

GOAL_BYTES_PER_PARAM = 12.0
MIB = 1 << 20
MIN_PARAMS = 10_000
STATUS_FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")
MODEL_FINGERPRINT = "bench-memory"


# -- /proc ------------------------------------------------------------------------------------


STATUS_TIMEOUT_S = 60.0
"""Longest wait for the synchronizer's status: busy merging a large model on a loaded machine it
answered after more than gRPC's 5 s (the run failed on DEADLINE_EXCEEDED at 85M parameters)."""


def read_memory(pid: int) -> dict[str, int]:
    """Bytes of ``STATUS_FIELDS`` from /proc/PID/status (fields the kernel lacks are left out; an
    RssAnon missing there is taken from /proc/PID/smaps_rollup's Anonymous)."""
    out: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in STATUS_FIELDS:
                out[key] = int(value.split()[0]) * 1024
    if "RssAnon" not in out:
        with contextlib.suppress(OSError):
            for line in pathlib.Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                key, _, value = line.partition(":")
                if key == "Anonymous":
                    out["RssAnon"] = int(value.split()[0]) * 1024
                    if "VmRSS" in out:
                        out.setdefault("RssFile", out["VmRSS"] - out["RssAnon"])
    return out


class Sampler:
    """Polls the memory of ``pid`` every ``every_s`` on a thread; keeps the maxima."""

    def __init__(self, pid: int, every_s: float = 0.02) -> None:
        self.pid, self.every_s = pid, every_s
        self.max: dict[str, int] = {}
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.take()
            self._stop.wait(self.every_s)

    def take(self) -> dict[str, int]:
        now = read_memory(self.pid)
        for key, value in now.items():
            self.max[key] = max(self.max.get(key, 0), value)
        self.samples += 1
        return now

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


# -- the synthetic model ----------------------------------------------------------------------


def synthetic_layout(params: int, fragments: int) -> FragmentLayout:
    """A GPT-like layout of exactly ``params`` fp32 values: an embedding (12%), then blocks of an
    attention matrix, an MLP matrix and a small norm each; enough blocks that every fragment gets
    tensors of its own. ValueError if ``fragments`` cannot be filled."""
    blocks = max(12, fragments)
    emb = params * 12 // 100
    norm = min(1024, (params - emb) // (100 * blocks))
    per_block = (params - emb - norm * blocks) // blocks
    attn = per_block // 3
    if attn < 1:
        raise ValueError(f"{params} parameters are too few for {fragments} fragments (each block needs >= 3)")
    extra = params - emb - norm * blocks - per_block * blocks  # the last MLP takes the remainder
    specs = [TensorSpec("tok_emb.weight", (emb,))]
    for i in range(blocks):
        mlp = per_block - attn + (extra if i == blocks - 1 else 0)
        specs += [TensorSpec(f"blocks.{i}.attn.weight", (attn,)), TensorSpec(f"blocks.{i}.mlp.weight", (mlp,))]
        if norm:
            specs.append(TensorSpec(f"blocks.{i}.norm.weight", (norm,)))
    assert sum(s.numel for s in specs) == params
    layout = partition(specs, fragments)
    if any(f.numel == 0 for f in layout):
        raise ValueError(f"{params} parameters are too few for {fragments} fragments")
    return layout


# -- a synthetic learner ----------------------------------------------------------------------


class SyntheticLearner:
    """A learner without a model: Hello, genesis upload, heartbeats, contributions on request,
    over the real client (``SyncStream``)."""

    def __init__(self, target: str, learner_id: str, layout: FragmentLayout, protocol: ProtocolConfig,
                 codec: str, threads: int, step_time_s: float, fragments: list[int] | None = None) -> None:
        self.learner_id, self.layout, self.protocol = learner_id, layout, protocol
        self.fragments = [f.index for f in layout] if fragments is None else fragments
        """The fragments the synchronizer owns (a shard: its share)."""
        self.channel = open_channel(target, max_message_bytes=message_limit(protocol.max_chunk_bytes))
        self.stream = SyncStream(self.channel, max_chunk_bytes=protocol.max_chunk_bytes)
        self.codec = make_codec(codec, threads=threads)
        self.step_time_s = step_time_s
        self.sequence = itertools.count(1)
        self.transfer_ids = itertools.count(1)
        self.results: dict[int, wire.ContributionResult] = {}
        self.requested: dict[int, int] = {}
        """fragment -> the latest round the synchronizer asked for."""
        self.answered: dict[int, int] = {}
        self.globals_received = 0
        self.closed: Exception | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def connect(self) -> wire.Welcome:
        hello = wire.Hello(
            learner_id=self.learner_id, model_fingerprint=MODEL_FINGERPRINT, layout_hash=self.layout.fingerprint,
            protocol=wire.ProtocolParams.from_config(self.protocol),
            incarnation=1, software_version="bench-memory")
        welcome = await self.stream.open(hello)
        self._tasks = [asyncio.create_task(self._pump()), asyncio.create_task(self._beat())]
        return welcome

    async def _beat(self) -> None:
        with contextlib.suppress(Exception):
            for step in itertools.count(1):
                await self.stream.send(wire.Heartbeat(step=step, tokens_total=step * 1000, tokens_per_s=1000.0,
                                                      step_time_s=self.step_time_s, sent_at_unix=time.time()))
                await asyncio.sleep(0.2)

    async def _pump(self) -> None:
        try:
            while True:
                msg = await self.stream.receive()
                if isinstance(msg, Transfer):
                    self.globals_received += 1
                elif isinstance(msg, wire.ContributionResult):
                    self.results[msg.sequence] = msg
                elif isinstance(msg, wire.FragmentRequest):
                    self.requested[msg.fragment_id] = max(self.requested.get(msg.fragment_id, 0), msg.round)
        except Exception as exc:  # recorded: the driver reports it
            self.closed = exc

    async def upload_genesis(self, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        fp32 = make_codec("fp32")
        for p in self.fragments:
            frag = self.layout[p]
            values = torch.randn(frag.numel, generator=gen).mul_(0.02)
            chunks = await asyncio.to_thread(
                encode_fragment, values, frag, codec=fp32, kind="genesis", version=0,
                transfer_id=next(self.transfer_ids), layout_hash=self.layout.fingerprint,
                sequence=next(self.sequence), max_chunk_bytes=self.protocol.max_chunk_bytes)
            del values
            await self.stream.send_transfer(chunks)

    async def contribute(self, fragment: int, delta: torch.Tensor, base_version: int, round: int) -> int:
        """Send an outer gradient answering the synchronizer's request ``round`` for ``fragment``."""
        seq = next(self.sequence)
        chunks = await asyncio.to_thread(
            encode_fragment, delta, self.layout[fragment], codec=self.codec, kind="contribution",
            version=base_version, transfer_id=next(self.transfer_ids), layout_hash=self.layout.fingerprint,
            sequence=seq, tokens=4096, steps=self.protocol.sync_every, round=round,
            max_chunk_bytes=self.protocol.max_chunk_bytes)
        await self.stream.send_transfer(chunks)
        return seq

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.stream.close(goodbye="benchmark done", linger_s=1.0)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.channel.close()


async def _until(predicate: Callable[[], bool], alive: Callable[[], None], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        alive()
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s:g}s waiting for {what}")
        await asyncio.sleep(0.005)


# -- the run ----------------------------------------------------------------------------------


def synchronizer_source() -> dict[str, Any]:
    """Which synchronizer code the process runs (it inherits this environment, PYTHONPATH included):
    the package folder and, where it is in a git checkout, the commit and whether it differs from it."""
    import importlib.util
    import subprocess

    spec = importlib.util.find_spec("ddiloco.synchronizer")
    folder = str(pathlib.Path(spec.origin).parent) if spec is not None and spec.origin else None
    out: dict[str, Any] = {"package": folder, "commit": None, "modified": None}
    if folder is not None:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            head = subprocess.run(["git", "-C", folder, "rev-parse", "--short", "HEAD"], capture_output=True,
                                  text=True, timeout=10)
            if head.returncode == 0:
                changes = subprocess.run(["git", "-C", folder, "status", "--porcelain", "--", "."],
                                         capture_output=True, text=True, timeout=10)
                out["commit"], out["modified"] = head.stdout.strip(), bool(changes.stdout.strip())
    return out


def _mib(b: float) -> float:
    return b / MIB


async def drive(args: argparse.Namespace, target: str, layout: FragmentLayout, protocol: ProtocolConfig,
                sampler: Sampler, alive: Callable[[], None], say: Callable[[str], None]) -> dict[str, Any]:
    """Genesis, then ``args.rounds`` rounds per fragment; the memory at each phase."""
    threads = max(1, min(2, available_cpus()))
    phases: dict[str, dict[str, int]] = {}
    await asyncio.sleep(args.settle_s)
    phases["idle"] = sampler.take()
    say(f"  idle: VmRSS {_mib(phases['idle'].get('VmRSS', 0)):.0f} MiB")
    shard, shards = args.shard_of
    mine = [layout[p] for p in owned(layout.num_fragments, shard, shards)]
    learners = [SyntheticLearner(target, f"bench-{i}", layout, protocol, args.codec, threads, args.step_time_s,
                                 [f.index for f in mine]) for i in range(args.learners)]
    timeout_s = 120.0 + 60.0 * args.params / 1e8

    def check(learner: SyntheticLearner) -> Callable[[], None]:
        def ok() -> None:
            alive()
            if learner.closed is not None:
                raise RuntimeError(f"{learner.learner_id}: stream closed: {learner.closed}")
        return ok

    counts = {"contributions": 0, "sent_stale": 0, "merged": 0, "merged_stale": 0, "rejected": 0, "superseded": 0,
              "resent": 0}
    rss_by_round: list[float] = []
    try:
        first = learners[0]
        welcome = await first.connect()
        if welcome.state != "genesis_requested":
            raise RuntimeError(f"expected to be asked for genesis, the synchronizer says {welcome.state!r}")
        t0 = time.perf_counter()
        await first.upload_genesis()
        deadline = time.monotonic() + timeout_s
        while (await get_status(target, timeout_s=STATUS_TIMEOUT_S)).state != "ready":
            check(first)()
            if time.monotonic() > deadline:
                raise RuntimeError("genesis was not committed in time")
            await asyncio.sleep(0.05)
        genesis_s = time.perf_counter() - t0
        for learner in learners[1:]:
            await learner.connect()
        await asyncio.sleep(args.settle_s)
        phases["genesis"] = sampler.take()
        say(f"  genesis: VmRSS {_mib(phases['genesis'].get('VmRSS', 0)):.0f} MiB ({genesis_s:.1f} s)")

        gen = torch.Generator().manual_seed(1)
        noise = {frag.index: torch.randn(frag.numel, generator=gen) for frag in mine}
        versions = {frag.index: 0 for frag in mine}
        t0 = time.perf_counter()
        for r in range(args.rounds):
            for frag in mine:
                p = frag.index
                for learner in learners:  # answer the synchronizer's request, as a learner does
                    def asked(lr: SyntheticLearner = learner, p: int = p) -> bool:
                        return lr.requested.get(p, 0) > lr.answered.get(p, 0)

                    await _until(asked, check(learner), timeout_s, f"a request for fragment {p}")
                    learner.answered[p] = learner.requested[p]

                async def answer(i: int, learner: SyntheticLearner, p: int = p,
                                 r: int = r) -> wire.ContributionResult:
                    stale = i == 1 and r % 2 == 1 and versions[p] > 0
                    counts["sent_stale"] += int(stale)
                    delta = noise[p].roll(97 * (r * len(learners) + i)).mul_(1e-3 * (1 + 0.25 * i))
                    base = versions[p] - 1 if stale else versions[p]
                    seqs = [await learner.contribute(p, delta, base, learner.answered[p])]
                    deadline = time.monotonic() + timeout_s
                    while True:
                        done = [learner.results[s] for s in seqs if s in learner.results
                                and learner.results[s].outcome != "superseded"]
                        if done:
                            return done[0]
                        check(learner)()
                        if learner.requested.get(p, 0) > learner.answered[p] and len(seqs) < 4:
                            # a newer round opened before this answer made its quorum (the fleet's
                            # clock ran ahead of a slow machine): answer it again, as a learner
                            # does; the newer answer supersedes the waiting one
                            learner.answered[p] = learner.requested[p]
                            counts["resent"] += 1
                            seqs.append(await learner.contribute(p, delta, base, learner.answered[p]))
                        if time.monotonic() > deadline:
                            raise RuntimeError(f"timed out after {timeout_s:g}s waiting for the result of "
                                               f"{learner.learner_id}'s contribution to fragment {p}")
                        await asyncio.sleep(0.005)

                results = await asyncio.gather(*(answer(i, lr) for i, lr in enumerate(learners)))
                for result in results:
                    counts["contributions"] += 1
                    if result.outcome == "merged":
                        counts["merged"] += 1
                        counts["merged_stale"] += int(result.staleness > 0)
                        versions[p] = max(versions[p], result.version)
                    elif result.outcome in counts:
                        counts[result.outcome] += 1
            rss_by_round.append(_mib(sampler.take().get("VmRSS", 0)))
            say(f"  round {r + 1}/{args.rounds}: VmRSS {rss_by_round[-1]:.0f} MiB, "
                f"versions {min(versions.values())}..{max(versions.values())}")
        rounds_s = time.perf_counter() - t0

        deadline = time.monotonic() + timeout_s
        while True:
            status = await get_status(target, timeout_s=STATUS_TIMEOUT_S)
            if not any(f.pending for f in status.fragments):
                break
            alive()
            if time.monotonic() > deadline:
                raise RuntimeError("contributions still pending at the end")
            await asyncio.sleep(0.05)
        await asyncio.sleep(args.settle_s)
        samples = []
        for _ in range(5):
            samples.append(sampler.take())
            await asyncio.sleep(0.1)
        phases["steady"] = {k: int(statistics.median(s.get(k, 0) for s in samples)) for k in samples[-1]}
        status = await get_status(target, timeout_s=STATUS_TIMEOUT_S)
    finally:
        for learner in learners:
            await learner.close()
    return {"phases": phases, "counts": counts, "shard_params": sum(f.numel for f in mine), "rss_by_round_mib": rss_by_round, "genesis_s": genesis_s,
            "rounds_s": rounds_s, "merges": status.merges_total,
            "versions": {f.fragment_id: f.version for f in status.fragments},
            "rejected_by_reason": dict(status.rejected_by_reason),
            "globals_received": sum(lr.globals_received for lr in learners)}


def _check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[FragmentLayout, ProtocolConfig,
                                                                               dict[str, Any]]:
    """The layout, protocol and config document, or a usage error (exit 2) before anything starts."""
    from ddiloco.synchronizer.config import synchronizer_config

    if args.params < MIN_PARAMS:
        parser.error(f"--params must be >= {MIN_PARAMS}, got {args.params}")
    if args.learners < 1 or args.rounds < 1 or args.staleness_window < 0 or args.settle_s < 0 or not (
            args.step_time_s > 0):
        parser.error("need --learners >= 1, --rounds >= 1, --staleness-window >= 0, --settle-s >= 0, "
                     "--step-time-s > 0")
    if args.codec not in CODEC_NAMES:
        parser.error(f"--codec must be one of {', '.join(CODEC_NAMES)}, got {args.codec!r}")
    try:
        args.shard_of = parse_shard(args.shard) if args.shard else (0, 1)
    except ValueError as exc:
        parser.error(f"--shard: {exc}")
    protocol_section = {"num_fragments": args.fragments} if args.fragments is not None else {}
    document = {
        "protocol": protocol_section,
        # the quorum is the whole fleet: every round merges every learner's answer, so each round's
        # results arrive whatever the relative speeds of the learners and the synchronizer
        # (what a quorum cannot gather, such as an answer sent again, merges after the timeout)
        "synchronizer": {"policy": {"quorum": args.learners, "grace_gamma": 0.5, "max_grace_s": 0.2,
                                    "timeout_s": 2.0},
                         "staleness_window": args.staleness_window,
                         "heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 30.0},
    }
    try:
        protocol = ProtocolConfig(**protocol_section)
        synchronizer_config(document, shard_index=args.shard_of[0], shard_count=args.shard_of[1])
        layout = synthetic_layout(args.params, protocol.num_fragments)
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
    return layout, protocol, document


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ddiloco bench memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=int, default=20_000_000, help="parameters of the synthetic model")
    parser.add_argument("--fragments", type=int, help="protocol.num_fragments (default: the protocol's)")
    parser.add_argument("--learners", type=int, default=2, help="synthetic learners")
    parser.add_argument("--rounds", type=int, default=8, help="merge rounds per fragment (>= staleness window "
                        "+ 2 fills the retained versions)")
    parser.add_argument("--codec", default="bf16_zstd", help=f"codec of the contributions ({', '.join(CODEC_NAMES)})")
    parser.add_argument("--staleness-window", type=int, default=4, help="synchronizer.staleness_window")
    parser.add_argument("--step-time-s", type=float, default=0.01, help="step time the learners report "
                        "(paces the synchronizer's requests)")
    parser.add_argument("--shard", metavar="s/S", help="run shard s of S synchronizer shards (its share of the "
                        "fragments; the others are not started: each shard is a process of its own)")
    parser.add_argument("--settle-s", type=float, default=1.0, help="wait before each idle/genesis/steady reading")
    parser.add_argument("--workdir", help="folder for the synchronizer's config, state and log (default: a "
                        "temporary one, removed at the end)")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    parser.add_argument("--out", help="also write the JSON results to this file")
    args = parser.parse_args(argv)
    layout, protocol, document = _check(args, parser)
    exit_on_sigterm()  # SIGTERM unwinds, so the processes this one started are stopped
    if args.workdir:
        pathlib.Path(args.workdir).mkdir(parents=True, exist_ok=True)
        return _run(args, layout, protocol, document, pathlib.Path(args.workdir))
    with tempfile.TemporaryDirectory(prefix="ddiloco-bench-memory-") as tmp:
        return _run(args, layout, protocol, document, pathlib.Path(tmp))


def _run(args: argparse.Namespace, layout: FragmentLayout, protocol: ProtocolConfig, document: dict[str, Any],
         work: pathlib.Path) -> int:
    from ddiloco.lab.cluster import LocalCluster

    cfg_path = work / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(document))
    shard, shards = args.shard_of
    cluster = LocalCluster(work, cfg_path, learners=1, steps=1,
                           synchronizer_args=("--shard", f"{shard}/{shards}") if shards > 1 else ())
    quiet = args.json

    def say(line: str) -> None:
        if not quiet:
            print(line, flush=True)

    t0 = time.perf_counter()
    try:
        cluster.start_synchronizer()
        proc = cluster.procs["synchronizer"]

        def alive() -> None:
            if proc.poll() is not None:
                raise RuntimeError(f"the synchronizer exited with code {proc.returncode}")

        say(f"memory: synchronizer pid {proc.pid} at {cluster.target}; {args.params / 1e6:.2f}M params in "
            f"{protocol.num_fragments} fragments, {args.learners} learners, {args.rounds} rounds, codec {args.codec}, "
            f"staleness window {args.staleness_window}")
        with Sampler(proc.pid) as sampler:
            run = asyncio.run(drive(args, cluster.target, layout, protocol, sampler, alive, say))
            sampler.take()
        peak = dict(sampler.max)
    except Exception as exc:  # the synchronizer died, a stream closed, a timeout: said, and stopped below
        print(f"ddiloco bench memory: {type(exc).__name__}: {exc} (synchronizer log: {work / 'logs' / 'synchronizer.log'})",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("ddiloco bench memory: interrupted", file=sys.stderr)
        return 130
    finally:
        cluster.stop_all()
    result = _result(args, protocol, run, peak, time.perf_counter() - t0)
    result["synchronizer_pid"] = proc.pid
    if args.out:
        save_result(result, args.out)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_table(result)
        if args.out:
            print(f"wrote {args.out}")
    return 0


def _result(args: argparse.Namespace, protocol: ProtocolConfig, run: dict[str, Any], peak: dict[str, int],
            seconds: float) -> dict[str, Any]:
    phases = run["phases"]
    idle, steady, genesis = phases["idle"], phases["steady"], phases["genesis"]
    n = args.params

    def per_param(a: dict[str, int], key: str) -> float | None:
        return (a[key] - idle[key]) / n if key in a and key in idle else None

    hwm = max(peak.get("VmHWM", 0), peak.get("VmRSS", 0))
    steady_bpp = (steady["VmRSS"] - idle["VmRSS"]) / n
    return {
        "benchmark": "memory", "machine": platform.machine(), "cpus": available_cpus(), "torch": torch.__version__,
        "params": n, "fragments": protocol.num_fragments, "learners": args.learners, "rounds": args.rounds,
        "shard": f"{args.shard_of[0]}/{args.shard_of[1]}",
        "shard_params": run["shard_params"],
        "bytes_per_shard_param_steady": steady_bpp * n / run["shard_params"],
        "codec": args.codec, "global_codec": protocol.global_codec, "staleness_window": args.staleness_window,
        "memory_bytes": {**phases, "peak": peak},
        "bytes_per_param_genesis": (genesis["VmRSS"] - idle["VmRSS"]) / n,
        "bytes_per_param_steady": steady_bpp,
        "bytes_per_param_steady_anon": per_param(steady, "RssAnon"),
        "bytes_per_param_steady_file": per_param(steady, "RssFile"),
        "bytes_per_param_peak": (hwm - idle["VmRSS"]) / n,
        "bytes_per_param_peak_anon": per_param(peak, "RssAnon"),
        "goal_bytes_per_param": GOAL_BYTES_PER_PARAM, "meets_goal": steady_bpp <= GOAL_BYTES_PER_PARAM,
        "bytes_per_param_means": "(synchronizer VmRSS at steady state - VmRSS idle before genesis) / params "
                                 "(of the whole model, also for one shard); peak: (VmHWM - idle VmRSS) / params; "
                                 "bytes_per_shard_param: the same over the parameters the shard owns",
        "synchronizer": synchronizer_source(),
        "rss_by_round_mib": run["rss_by_round_mib"],
        "bytes_per_param_by_round": [(mib * MIB - idle["VmRSS"]) / n for mib in run["rss_by_round_mib"]],
        "merges": run["merges"], "versions": run["versions"], "contributions": run["counts"],
        "rejected_by_reason": run["rejected_by_reason"], "globals_received": run["globals_received"],
        "genesis_s": run["genesis_s"], "rounds_s": run["rounds_s"], "seconds": seconds,
    }


def _print_table(r: dict[str, Any]) -> None:
    mem = r["memory_bytes"]
    idle = mem["idle"]
    print(f"{'phase':>8} {'VmRSS MiB':>10} {'RssAnon MiB':>12} {'RssFile MiB':>12} {'B/param':>8}")
    for name in ("idle", "genesis", "steady", "peak"):
        m = mem[name]
        rss = max(m.get("VmHWM", 0), m.get("VmRSS", 0)) if name == "peak" else m.get("VmRSS", 0)
        bpp = (rss - idle["VmRSS"]) / r["params"]
        print(f"{name:>8} {_mib(rss):>10.1f} {_mib(m.get('RssAnon', 0)):>12.1f} {_mib(m.get('RssFile', 0)):>12.1f} "
              f"{bpp:>8.2f}")
    anon, file = r["bytes_per_param_steady_anon"], r["bytes_per_param_steady_file"]
    split = f" (anon {anon:.2f}, file {file:.2f})" if anon is not None and file is not None else ""
    print(f"bytes/param at steady state {r['bytes_per_param_steady']:.2f}{split}; peak "
          f"{r['bytes_per_param_peak']:.2f}; goal <= {r['goal_bytes_per_param']:g}: "
          f"{'met' if r['meets_goal'] else 'MISSED'}")
    c = r["contributions"]
    print(f"merges {r['merges']}; contributions {c['contributions']}: merged {c['merged']} ({c['merged_stale']} "
          f"stale, re-anchored), superseded {c['superseded']}, rejected {c['rejected']}; "
          f"VmRSS by round (MiB) {', '.join(f'{v:.0f}' for v in r['rss_by_round_mib'])}; {r['seconds']:.1f} s")
    src = r["synchronizer"]
    print(f"synchronizer code: {src['package']} (commit {src['commit'] or '?'}"
          f"{', modified' if src['modified'] else ''})")


__all__ = ["main", "read_memory", "synthetic_layout"]
