"""Atheris fuzz target: codec decoding and chunk reassembly refuse bad input with their own errors.

Each input (format in ``decode_input.py``) becomes a chunked transfer, either built from the
input's bytes with header, declared-size and chunk faults, or parsed from serialized
``FragmentChunk`` records as the synchronizer receives them. The chunks go through a
``Reassembler`` with the synchronizer's limits and each completed transfer through
``decode_fragment`` for a fixed two-fragment layout. A decoded tensor or a ``FragmentError``
(``ChunkError``, ``CodecError``, ...) is fine; any other exception, or a decoded tensor that breaks
the gate's promises (flat fp32 of the right size, finite, lossless fp32, bf16-exact bf16_zstd),
is a crash.

    python tests/fuzz/fuzz_decode.py -atheris_runs=20000 CORPUS_DIR [more libFuzzer flags]

Only ``ddiloco`` modules are instrumented; torch, numpy, zstandard and protobuf are imported
first so they are not. See README.md in this folder.
"""

from __future__ import annotations

import os
import sys

import atheris

# Third-party modules first, uninstrumented (instrumenting torch costs minutes and finds nothing).
import crc32c  # noqa: F401
import google.protobuf.message  # noqa: F401
import numpy  # noqa: F401
import torch
import xxhash  # noqa: F401
import zstandard  # noqa: F401

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

with atheris.instrument_imports(include=["ddiloco"]):
    import decode_input

    import ddiloco.fragments.chunking
    import ddiloco.fragments.codec
    import ddiloco.fragments.payload
    import ddiloco.protocol.wire  # noqa: F401

torch.set_num_threads(1)


def TestOneInput(data: bytes) -> None:
    decode_input.run_one(data)


def main() -> None:
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
