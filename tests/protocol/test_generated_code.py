"""The checked-in generated code is exactly what ``scripts/gen_protos.py`` produces from protos/.

Regenerates into a temporary folder with the pinned grpcio-tools and compares byte for byte, so
an edited .proto without regenerated code (or hand-edited generated code) fails here.
"""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHECKED_IN = ROOT / "libs" / "protocol" / "ddiloco" / "v1"
FIX = "run `python scripts/gen_protos.py` and commit libs/protocol/ddiloco/v1"


def _gen_protos():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tools_version() -> str:
    from importlib.metadata import version

    return version("grpcio-tools")


def test_generated_code_matches_protos(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools is a dev dependency")
    generated = _gen_protos().generate(tmp_path)
    fresh = {p.name: p.read_bytes() for p in generated}
    checked_in = {p.name: p.read_bytes() for p in sorted(CHECKED_IN.iterdir()) if p.suffix in {".py", ".pyi"}}
    assert {"synchronizer_pb2.py", "synchronizer_pb2.pyi", "synchronizer_pb2_grpc.py", "__init__.py"} <= set(fresh)
    context = f"(grpcio-tools {_tools_version()} here; pyproject pins the version the files were made with)"
    missing, extra = sorted(set(fresh) - set(checked_in)), sorted(set(checked_in) - set(fresh))
    assert not missing and not extra, f"generated files differ: missing {missing}, stale {extra}; {FIX} {context}"
    drifted = [name for name in sorted(fresh) if fresh[name] != checked_in[name]]
    assert not drifted, f"libs/protocol/ddiloco/v1/{{{', '.join(drifted)}}} differ from protos/: {FIX} {context}"


def test_generation_covers_every_proto() -> None:
    gen = _gen_protos()
    protos = gen.proto_files()
    assert protos and all(p.suffix == ".proto" for p in protos)
    for proto in protos:
        assert (CHECKED_IN / f"{proto.stem}_pb2.py").exists(), f"{proto.name} has no generated module; {FIX}"


def test_generated_descriptor_matches_the_proto_source() -> None:
    """Cheap second line of defence that needs no grpcio-tools: every message and enum named in the
    .proto file exists in the loaded descriptor."""
    import re

    from ddiloco.protocol.wire.convert import pb

    source = (ROOT / "protos" / "ddiloco" / "v1" / "synchronizer.proto").read_text()
    messages = set(re.findall(r"^message (\w+)", source, re.M))
    enums = set(re.findall(r"^enum (\w+)", source, re.M))
    descriptor = pb.DESCRIPTOR
    assert messages == set(descriptor.message_types_by_name), FIX
    assert enums == set(descriptor.enum_types_by_name), FIX
