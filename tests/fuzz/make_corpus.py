"""Write the seed corpus of ``fuzz_decode.py`` into ``tests/fuzz/corpus/decode/``.

Seeds are valid encodings of the fuzz layout's fragments by every codec (random weights, zeros,
constants that make zstd planes, wide magnitudes that make bf16 exponent escapes, signed zeros
and subnormals, an int8 block size other than the default), each as a chunked "frames" input and
as serialized ``FragmentChunk`` "wire" records, plus mutations of them that reach each refusal
(truncated and flipped payloads, reordered and corrupt chunks, wrong headers, non-finite values,
non-zero int2_block padding bits, an unknown codec). Deterministic: running it again rewrites the same files.

    python tests/fuzz/make_corpus.py [OUT_DIR]
"""

from __future__ import annotations

import os
import pathlib
import struct
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from decode_input import LAYOUT, WIRE, frames_input, run_one, wire_input

from ddiloco.fragments.chunking import sealed
from ddiloco.fragments.codec import Int8BlockCodec, make_codec
from ddiloco.fragments.payload import encode_fragment
from ddiloco.protocol import wire

OUT = pathlib.Path(__file__).resolve().parent / "corpus" / "decode"


def values(kind: str, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    if kind == "weights":
        return torch.randn(n, generator=g) * 0.02
    if kind == "zeros":
        return torch.zeros(n)
    if kind == "constant":
        return torch.full((n,), 0.125)
    if kind == "wide":  # one value per 40 far below the rest: bf16 exponent escapes
        v = torch.randn(n, generator=g)
        v[::40] = 1e-30
        return v
    if kind == "tiny":  # signed zeros and subnormals
        v = torch.zeros(n)
        v[1::3] = -0.0
        v[2::3] = 1e-40
        return v
    raise ValueError(kind)


def encode(codec_name: str, kind: str, fragment: int, block: int = 256) -> bytes:
    codec = Int8BlockCodec(block) if codec_name == "int8_block" else make_codec(codec_name, threads=1)
    return codec.encode(values(kind, LAYOUT[fragment].numel))


def seeds() -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for codec in ("fp32", "bf16_zstd", "int8_block", "int4_block", "int2_block"):
        for fragment in (0, 1):
            out[f"frames-{codec}-weights-f{fragment}"] = frames_input(encode(codec, "weights", fragment),
                                                                      codec=codec, fragment=fragment)
    for kind in ("zeros", "constant", "wide", "tiny"):
        out[f"frames-bf16_zstd-{kind}"] = frames_input(encode("bf16_zstd", kind, 0), codec="bf16_zstd")
    out["frames-int8_block-block32"] = frames_input(encode("int8_block", "weights", 1, block=32),
                                                    codec="int8_block", fragment=1, block_size=32)
    good = encode("bf16_zstd", "weights", 0)
    out["frames-bf16_zstd-truncated"] = frames_input(good[:-7], codec="bf16_zstd")
    out["frames-bf16_zstd-bitflip"] = frames_input(good, codec="bf16_zstd", chunk_op=7, chunk_target=2)
    out["frames-fp32-reordered"] = frames_input(encode("fp32", "weights", 0), codec="fp32", chunk_op=1, chunk_target=1)
    out["frames-fp32-bad-crc"] = frames_input(encode("fp32", "weights", 1), codec="fp32", fragment=1, chunk_op=4)
    out["frames-fp32-nan"] = frames_input(
        make_codec("fp32").encode(torch.tensor([float("nan")] * LAYOUT[0].numel)), codec="fp32")
    out["frames-fp32-wrong-shape"] = frames_input(encode("fp32", "weights", 0), codec="fp32", header_flags=8)
    out["frames-int8_block-digest"] = frames_input(encode("int8_block", "weights", 0), codec="int8_block", declared=1)
    padded = bytearray(encode("int2_block", "weights", 0))  # 143 values: the last byte's top 2 bits pad
    padded[-1] |= 0xC0
    out["frames-int2_block-padding"] = frames_input(bytes(padded), codec="int2_block")
    out["frames-unknown-codec"] = frames_input(encode("fp32", "zeros", 1), codec="zstd9", fragment=1)
    for codec in ("fp32", "bf16_zstd", "int8_block", "int4_block", "int2_block"):
        frag = LAYOUT[1]
        chunks = encode_fragment(values("weights", frag.numel), frag, codec=make_codec(codec, threads=1),
                                 kind="contribution", version=1, transfer_id=3, layout_hash="layout-fuzz",
                                 sequence=2, tokens=100, steps=4, max_chunk_bytes=96)
        out[f"wire-{codec}-f1"] = wire_input(chunks)
    frag = LAYOUT[0]
    first = encode_fragment(values("constant", frag.numel), frag, codec=make_codec("bf16_zstd", threads=1),
                            kind="global", version=3, transfer_id=1, max_chunk_bytes=4096)
    second = encode_fragment(values("weights", frag.numel), frag, codec=make_codec("int8_block"),
                             kind="contribution", version=3, transfer_id=2, sequence=9, tokens=1, steps=1,
                             max_chunk_bytes=4096)
    out["wire-two-transfers"] = wire_input(first + second)
    trailing = encode_fragment(values("weights", frag.numel), frag, codec=make_codec("fp32"), kind="contribution",
                               version=3, transfer_id=5, sequence=11, tokens=1, steps=1, max_chunk_bytes=200,
                               trailing_digest=True)
    out["wire-trailing-digest"] = wire_input(list(sealed(trailing)))  # the digest on the last chunk
    out["wire-trailing-digest-missing"] = wire_input(trailing)  # neither the header nor the last chunk has it
    cut = encode_fragment(values("weights", frag.numel), frag, codec=make_codec("fp32"), kind="contribution",
                          version=3, transfer_id=4, sequence=10, tokens=1, steps=1, max_chunk_bytes=200)
    out["wire-cut-short"] = wire_input(cut[:-1])  # the stream ends before the last chunk
    negative = wire.chunk_to_pb(cut[0])
    negative.header.tensors[0].shape[0] = -16  # protobuf can say it; the wire layer must refuse it
    record = negative.SerializeToString()
    out["wire-negative-dim"] = bytes([WIRE]) + struct.pack("<H", len(record)) + record
    out["frames-fp32-oversized-chunk"] = frames_input(encode("fp32", "weights", 1) * 2, codec="fp32", fragment=1,
                                                      chunk_size=2000)  # one chunk over the reassembler's limit
    out["frames-fp32-declared-huge"] = frames_input(encode("fp32", "weights", 0), codec="fp32", declared=128)
    return out


def main() -> None:
    out_dir = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else OUT
    out_dir.mkdir(parents=True, exist_ok=True)
    total = 0
    for name, data in sorted(seeds().items()):
        outcome = run_one(data)  # every seed runs clean through the target
        (out_dir / name).write_bytes(data)
        total += len(data)
        print(f"{name:34s} {len(data):6d} B  transfers={outcome.transfers} decoded={outcome.decoded} "
              f"refused={','.join(outcome.refused) or '-'}")
    print(f"{len(seeds())} seeds, {total} bytes in {out_dir}")


if __name__ == "__main__":
    main()
