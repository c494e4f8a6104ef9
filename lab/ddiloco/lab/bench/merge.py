"""``ddiloco bench merge``: the synchronizer's merge + outer step against the memory-bandwidth bound.

For each learner count M it fills an [M, N] fp32 contribution block laid out like a real fragment
(an embedding, a handful of large matrices, many small norms and biases), then times
``merge_deltas`` (RDA) followed by ``OuterNesterov.step``. In the same run, on buffers of the
same size, it measures what the memory system can do (a copy and a read-only reduction), so the
bound and the measurement share the machine's state. The bound is the least traffic any
implementation needs: read the M contributions once, read and write params and momentum once,
``4 * N * (M + 4)`` bytes, at the better of the two measured bandwidths. The goal is
time / bound <= 3. Every figure is the minimum over ``--repeat`` runs (the least disturbed).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import time
from collections.abc import Callable

import torch

from ddiloco.algorithm.merge import merge_deltas
from ddiloco.algorithm.outer_optimizer import OuterNesterov

GB = 1e9


def fragment_segments(n: int) -> tuple[list[tuple[int, int]], list[bool]]:
    """A fragment-like split of n values: embedding 12%, six matrices, 40 small tensors."""
    small = [max(1, min(4096, n // 4000))] * 40
    rest = n - sum(small)
    large = [int(rest * f) for f in (0.12, 0.22, 0.18, 0.16, 0.12, 0.12)]
    large.append(rest - sum(large))  # seventh matrix takes the remainder (~8%)
    sizes = large[:1] + [v for pair in zip(large[1:], small[:6], strict=True) for v in pair] + small[6:]
    segments, offset = [], 0
    for size in sizes:
        segments.append((offset, offset + size))
        offset += size
    assert offset == n
    embedding = [i == 0 for i in range(len(sizes))]
    return segments, embedding


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_one(m: int, n: int, repeat: int) -> dict[str, float | int]:
    segments, embedding = fragment_segments(n)
    gen = torch.Generator().manual_seed(m)
    a = torch.randn(n, generator=gen)
    b = torch.randn(n, generator=gen)
    deltas = torch.empty(m, n)
    for row in range(m):  # distinct directions and magnitudes per learner, without m*n random draws
        torch.add(a, b, alpha=(row + 1) / m, out=deltas[row]).mul_(1e-3 * (1 + row % 3))
    weights = [float(1 + row % 4) for row in range(m)]
    params = torch.randn(n, generator=gen)
    momentum = torch.zeros(n)
    merged = torch.empty(n)
    copy_dst = torch.empty(m * n)
    flat = deltas.view(-1)
    outer = OuterNesterov()

    def merge() -> None:
        merge_deltas(deltas, weights, segments, embedding, "rda", out=merged)

    def step() -> None:
        outer.step(params, momentum, merged)

    best = {"copy": float("inf"), "read": float("inf"), "merge": float("inf"), "step": float("inf")}
    merge()  # warm-up: first touch of out, allocator
    for _ in range(repeat):
        best["copy"] = min(best["copy"], _timed(lambda: copy_dst.copy_(flat)))
        best["read"] = min(best["read"], _timed(flat.sum))
        best["merge"] = min(best["merge"], _timed(merge))
        best["step"] = min(best["step"], _timed(step))

    contrib_bytes = 4 * m * n
    copy_bw = 2 * contrib_bytes / best["copy"]
    read_bw = contrib_bytes / best["read"]
    bandwidth = max(copy_bw, read_bw)
    min_bytes = 4 * n * (m + 4)
    total = best["merge"] + best["step"]
    bound = min_bytes / bandwidth
    return {
        "learners": m,
        "values": n,
        "tensors": len(segments),
        "min_bytes": min_bytes,
        "copy_gbs": copy_bw / GB,
        "read_gbs": read_bw / GB,
        "merge_s": best["merge"],
        "step_s": best["step"],
        "total_s": total,
        "bound_s": bound,
        "ratio": total / bound,
        "effective_gbs": min_bytes / total / GB,
        "merge_gbs": (contrib_bytes + 4 * n) / best["merge"] / GB,
        "step_gbs": 4 * 5 * n / best["step"] / GB,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ddiloco bench merge", description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=float, default=64, help="fragment size per contribution, MiB of fp32")
    parser.add_argument("--learners", default="2,8,16", help="comma-separated contribution counts M")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per case (the minimum is kept)")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--out", default="bench-results/merge.json", help="JSON results file")
    parser.add_argument("--quick", action="store_true", help="smoke run: 4 MiB, M=2,4, 2 repeats")
    args = parser.parse_args(argv)
    if args.quick:
        args.mib, args.learners, args.repeat = 4, "2,4", 2
    learners = [int(v) for v in args.learners.split(",") if v.strip()]
    if not learners or min(learners) < 1 or args.mib <= 0 or args.repeat < 1 or args.threads < 1:
        parser.error("need --learners >= 1, --mib > 0, --repeat >= 1, --threads >= 1")
    torch.set_num_threads(args.threads)
    n = int(args.mib * 2**18)

    rows = []
    header = (f"{'M':>3} {'MiB/row':>8} {'copy GB/s':>10} {'read GB/s':>10} {'merge ms':>9} {'step ms':>8} "
              f"{'total ms':>9} {'bound ms':>9} {'eff GB/s':>9} {'ratio':>6}")
    print(f"merge + outer step, fp32, {args.threads} threads, torch {torch.__version__}")
    print(header)
    for m in learners:
        r = bench_one(m, n, args.repeat)
        rows.append(r)
        print(f"{m:>3} {n * 4 / 2**20:>8.1f} {r['copy_gbs']:>10.1f} {r['read_gbs']:>10.1f} "
              f"{r['merge_s'] * 1e3:>9.1f} {r['step_s'] * 1e3:>8.1f} {r['total_s'] * 1e3:>9.1f} "
              f"{r['bound_s'] * 1e3:>9.1f} {r['effective_gbs']:>9.1f} {r['ratio']:>5.2f}x", flush=True)
    worst = max(r["ratio"] for r in rows)
    print(f"worst time/bound {worst:.2f}x (goal <= 3x)")

    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "merge",
        "method": "rda",
        "threads": args.threads,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "processor": platform.processor(),
        "bound": "4*N*(M+4) bytes (read M rows, read+write params and momentum) / max(copy, read) bandwidth",
        "goal_ratio": 3.0,
        "worst_ratio": worst,
        "results": rows,
    }, indent=2) + "\n")
    print(f"wrote {out}")
    return 0
