"""Generate the checked-in protobuf/gRPC Python code from protos/.

The generated modules live in ``libs/protocol/ddiloco/v1`` (import name ``ddiloco.v1``, matching the
protobuf package) and are committed, so installing ddiloco never needs grpcio-tools.
Only ``ddiloco.protocol.wire.convert`` and ``ddiloco.protocol.wire.stubs`` import them. ``tests/protocol/test_generated_code.py``
regenerates into a temporary folder and fails when the checked-in files drift.

Usage: ``python scripts/gen_protos.py [--out DIR]``
"""

from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROTO_ROOT = ROOT / "protos"
DEFAULT_OUT = ROOT / "libs" / "protocol"
GENERATED_DIR = ("ddiloco", "v1")


def proto_files() -> list[pathlib.Path]:
    return sorted((PROTO_ROOT / pathlib.Path(*GENERATED_DIR)).glob("*.proto"))


def generate(out_root: pathlib.Path) -> list[pathlib.Path]:
    """Run protoc into ``out_root``; return the generated files (under out_root/ddiloco/v1)."""
    import grpc_tools
    from grpc_tools import protoc  # dev dependency only

    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    out_root.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *[str(p.relative_to(PROTO_ROOT)) for p in proto_files()],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    target = out_root.joinpath(*GENERATED_DIR)
    init = target / "__init__.py"
    init.write_text('"""Generated protobuf and gRPC code (do not edit; see scripts/gen_protos.py)."""\n')
    return sorted(p for p in target.iterdir() if p.suffix in {".py", ".pyi"})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    # protoc writes out/ddiloco/v1/*; with the default out that is libs/protocol/ddiloco/v1.
    for path in generate(args.out):
        print(path.relative_to(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
