"""``ddiloco bench codec``: speed and compression ratio of the payload codecs.

Two inputs, both flat fp32 as the codecs see them: (a) weights drawn from N(0, 0.02), and (b) a
real outer gradient, the difference of two AdamW-trained states of a small transformer (trained
for ``--train-steps`` steps, then ``--train-steps`` more from there; Delta = before - after, in
fp32), tiled to the requested size. Speeds are MB of fp32 input per second (4 bytes a value,
MB = 10^6 bytes), best of ``--repeat`` runs, and each is also given as a fraction of
``np.copyto`` on the same bytes measured in the same run, so numbers from different machines
compare, and per CPU-second (process CPU time of all threads), which shared, busy cores distort
less than wall-clock time. ``bf16_ratio`` is the lossless stage alone: bf16 bytes over encoded bytes.

The brief's target for the default codec (bf16_zstd, level 1): ``bf16_ratio >= 1.4`` at an encode
speed of at least 1 GB/s with 2 threads.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import torch
import zstandard

from ddiloco.fragments.codec import (
    Bf16ZstdCodec,
    Codec,
    Fp32Codec,
    Int2BlockCodec,
    Int4BlockCodec,
    Int8BlockCodec,
)
from ddiloco.lab.bench import save_result

TARGET_BF16_RATIO = 1.4
TARGET_ENCODE_MBPS = 1000.0


def _best_seconds(fn: Callable[[], object], repeat: int) -> tuple[float, float]:
    """(best wall seconds, least process CPU seconds) over ``repeat`` runs."""
    wall = cpu = float("inf")
    for _ in range(repeat):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        wall = min(wall, time.perf_counter() - start)
        cpu = min(cpu, time.process_time() - start_cpu)
    return wall, cpu


def _weights(num_values: int, seed: int) -> torch.Tensor:
    return torch.randn(num_values, generator=torch.Generator().manual_seed(seed)) * 0.02


class _TinyLM(torch.nn.Module):
    """Embedding, two pre-norm transformer layers, untied head: a few million parameters."""

    def __init__(self, vocab: int, width: int, layers: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.blocks = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=4 * width, dropout=0.0,
                                             batch_first=True, norm_first=True) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        mask = torch.nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        return self.head(self.norm(x))


def _outer_gradient(steps: int, seed: int, *, vocab: int, width: int, layers: int) -> tuple[torch.Tensor, dict]:
    """Delta = theta_before - theta_after for ``steps`` AdamW steps from an AdamW-trained state."""
    torch.manual_seed(seed)
    model = _TinyLM(vocab, width, layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    gen = torch.Generator().manual_seed(seed + 1)
    # Random tokens with a learnable rule (next token = a fixed permutation of this one), so the
    # gradients have structure, as with real text.
    perm = torch.randperm(vocab, generator=gen)

    def train(n: int) -> float:
        loss = torch.zeros(())
        for _ in range(n):
            tokens = torch.randint(0, vocab, (8, 65), generator=gen)
            tokens[:, 1::2] = perm[tokens[:, 0::2][:, : tokens[:, 1::2].shape[1]]]
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        return float(loss.detach())

    train(steps)
    before = torch.cat([p.detach().reshape(-1).float().clone() for p in model.parameters()])
    loss = train(steps)
    after = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
    delta = before - after  # fp32, the learner's outer gradient
    info = {"model": f"{layers}-layer transformer, width {width}, vocab {vocab}", "parameters": delta.numel(),
            "optimizer": "AdamW(lr=1e-3, weight_decay=0.1)", "steps_before": steps, "steps_between": steps,
            "final_loss": round(loss, 4), "delta_rms": float(delta.pow(2).mean().sqrt()),
            "delta_exact_zeros": int((delta == 0).sum())}
    return delta, info


def _tile(values: torch.Tensor, num_values: int) -> torch.Tensor:
    reps = -(-num_values // values.numel())
    return values.repeat(reps)[:num_values].contiguous()


def _codecs(threads: int) -> list[tuple[str, Codec]]:
    return [
        ("fp32", Fp32Codec()),
        ("bf16_zstd level 1", Bf16ZstdCodec(level=1, threads=threads)),
        ("bf16_zstd level 3", Bf16ZstdCodec(level=3, threads=threads)),
        ("int8_block", Int8BlockCodec()),
        ("int4_block", Int4BlockCodec()),
        ("int2_block", Int2BlockCodec()),
    ]


def _measure(values: torch.Tensor, threads: int, repeat: int) -> dict[str, Any]:
    n = values.numel()
    fp32_bytes = 4 * n
    src = values.numpy()
    dst = np.empty_like(src)
    memcpy_s, _ = _best_seconds(lambda: np.copyto(dst, src), repeat)
    memcpy_mbps = fp32_bytes / memcpy_s / 1e6
    reference_bf16 = values.to(torch.bfloat16).float()
    rows = []
    for label, codec in _codecs(threads):
        codec.encode(values[: min(n, 1 << 16)])  # warm up pools and contexts
        payload = codec.encode(values)
        encode_s, encode_cpu_s = _best_seconds(partial(codec.encode, values), repeat)
        decoded = codec.decode(payload, n)
        decode_s, decode_cpu_s = _best_seconds(partial(codec.decode, payload, n), repeat)
        if codec.name == "fp32" and not torch.equal(decoded, values):
            raise AssertionError("fp32 round trip is not exact")
        if codec.name == "bf16_zstd" and not torch.equal(decoded, reference_bf16):
            raise AssertionError(f"{label} does not reproduce torch's bf16 rounding")
        row: dict[str, Any] = {
            "codec": label, "name": codec.name, "encoded_bytes": len(payload),
            "ratio_vs_fp32": fp32_bytes / len(payload),
            "encode_MBps": fp32_bytes / encode_s / 1e6, "decode_MBps": fp32_bytes / decode_s / 1e6,
            # Per CPU-second (all threads together): what one otherwise idle core would sustain.
            "encode_MBps_per_cpu": fp32_bytes / max(encode_cpu_s, 1e-9) / 1e6,
            "decode_MBps_per_cpu": fp32_bytes / max(decode_cpu_s, 1e-9) / 1e6,
            "max_abs_error": float((decoded - values).abs().max()) if n else 0.0,
        }
        if codec.name == "bf16_zstd":
            row["bf16_ratio"] = 2 * n / len(payload)
        row["encode_vs_memcpy"] = row["encode_MBps"] / memcpy_mbps
        row["decode_vs_memcpy"] = row["decode_MBps"] / memcpy_mbps
        rows.append(row)
    return {"values": n, "fp32_MiB": fp32_bytes / 2**20, "memcpy_MBps": memcpy_mbps, "codecs": rows}


def _machine(threads: int) -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "threads": threads, "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "numpy": np.__version__, "zstandard": zstandard.__version__,
            "zstd": ".".join(map(str, zstandard.ZSTD_VERSION)), "python": platform.python_version(),
            "platform": platform.platform(),
            "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None}


def _table(name: str, result: dict[str, Any]) -> str:
    lines = [f"{name}: {result['values']:,} values ({result['fp32_MiB']:.0f} MiB fp32); "
             f"np.copyto {result['memcpy_MBps']:,.0f} MB/s",
             f"  {'codec':<18} {'encode MB/s':>11} {'x memcpy':>8} {'per CPU-s':>9} {'decode MB/s':>11} "
             f"{'x memcpy':>8} {'per CPU-s':>9} {'ratio/fp32':>10} {'ratio/bf16':>10}"]
    for r in result["codecs"]:
        bf16 = f"{r['bf16_ratio']:.3f}" if "bf16_ratio" in r else "-"
        lines.append(f"  {r['codec']:<18} {r['encode_MBps']:>11,.0f} {r['encode_vs_memcpy']:>8.3f} "
                     f"{r['encode_MBps_per_cpu']:>9,.0f} {r['decode_MBps']:>11,.0f} {r['decode_vs_memcpy']:>8.3f} "
                     f"{r['decode_MBps_per_cpu']:>9,.0f} {r['ratio_vs_fp32']:>10.3f} {bf16:>10}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ddiloco bench codec", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench-results/codec.json"),
                        help="JSON results file (default: %(default)s)")
    parser.add_argument("--mib", type=float, default=64, help="fp32 MiB per input (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="codec and torch threads (default: %(default)s)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement; best counts (default: %(default)s)")
    parser.add_argument("--train-steps", type=int, default=20, help="AdamW steps per phase (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for smoke tests")
    args = parser.parse_args(argv)
    if args.threads < 1 or args.repeat < 1 or args.mib <= 0 or args.train_steps < 1:
        parser.error("--threads, --repeat, --train-steps and --mib must be positive")
    if args.quick:
        args.mib, args.repeat, args.train_steps = min(args.mib, 1.0), 1, min(args.train_steps, 2)
    torch.set_num_threads(args.threads)
    num_values = max(1, int(args.mib * 2**20) // 4)
    model_size = {"vocab": 512, "width": 64, "layers": 1} if args.quick else {"vocab": 4096, "width": 256, "layers": 2}

    started = time.perf_counter()
    delta, source = _outer_gradient(args.train_steps, args.seed, **model_size)
    results = {
        "weights_N(0,0.02)": _measure(_weights(num_values, args.seed), args.threads, args.repeat),
        "outer_gradient_AdamW": {**_measure(_tile(delta, num_values), args.threads, args.repeat), "source": source},
    }
    default = {name: next(r for r in res["codecs"] if r["codec"] == "bf16_zstd level 1")
               for name, res in results.items()}
    target = {
        "bf16_ratio_min": TARGET_BF16_RATIO, "encode_MBps_min": TARGET_ENCODE_MBPS, "threads": args.threads,
        "met": {name: r["bf16_ratio"] >= TARGET_BF16_RATIO and r["encode_MBps"] >= TARGET_ENCODE_MBPS
                for name, r in default.items()},
    }
    doc: dict[str, Any] = {"benchmark": "codec", "machine": _machine(args.threads),
           "config": {"mib": args.mib, "repeat": args.repeat, "threads": args.threads, "quick": args.quick,
                      "seed": args.seed, "train_steps": args.train_steps},
           "results": results, "target": target, "wall_s": round(time.perf_counter() - started, 2)}
    for name, res in results.items():
        print(_table(name, res))
        print()
    src = results["outer_gradient_AdamW"]["source"]
    print(f"outer gradient: {src['model']}, {src['parameters']:,} parameters, {src['optimizer']}, "
          f"{src['steps_before']}+{src['steps_between']} steps, tiled to the input size")
    for name, r in default.items():
        print(f"target (bf16_zstd level 1, {args.threads} threads: ratio/bf16 >= {TARGET_BF16_RATIO}, encode >= "
              f"{TARGET_ENCODE_MBPS:,.0f} MB/s) on {name}: {'met' if target['met'][name] else 'NOT met'} "
              f"({r['bf16_ratio']:.3f}x, {r['encode_MBps']:,.0f} MB/s)")
    load = doc["machine"]["load_average"]
    if load and load[0] > 0.5 * (os.cpu_count() or 1):
        print(f"note: load average {load[0]:.1f} on {os.cpu_count()} CPUs: other work shared the cores, so wall-clock "
              "speeds are low; the per-CPU-second columns are less affected")
    save_result(doc, args.out)
    print(f"wrote {args.out}")
    return 0
