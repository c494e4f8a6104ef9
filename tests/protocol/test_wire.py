"""The wire module: every dataclass survives protobuf, unknown enums are refused, and nothing but
``ddiloco.protocol.wire`` touches the generated code (STYLE.md practice 5).

Round trips go through serialized bytes (``SerializeToString`` / ``FromString``), exactly what
travels on a gRPC stream.
"""

from __future__ import annotations

import ast
import pathlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddiloco.fragments.chunking import PAYLOAD_KINDS, Chunk, TransferHeader
from ddiloco.fragments.codec import CODEC_NAMES
from ddiloco.fragments.errors import CodecError, HeaderError
from ddiloco.fragments.partition import TensorSpec
from ddiloco.protocol import wire
from ddiloco.protocol.wire.convert import pb  # the generated messages, reached through the wire package

ROOT = pathlib.Path(__file__).resolve().parents[2]
SETTINGS = settings(max_examples=40, deadline=None)

u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
doubles = st.floats(allow_nan=False, allow_infinity=False)
text = st.text(max_size=20)
labels = st.dictionaries(text, text, max_size=3)
versions = st.dictionaries(u32, u64, max_size=4)
codecs = st.sampled_from(CODEC_NAMES)
reasons = st.sampled_from(wire.REJECT_REASONS)

tensor_specs = st.builds(TensorSpec, name=text, shape=st.lists(st.integers(0, 2**40), max_size=4).map(tuple),
                         dtype=st.sampled_from(["float32", "bfloat16", "float16", "float64"]))
headers = st.builds(
    TransferHeader, kind=st.sampled_from(PAYLOAD_KINDS), fragment_id=u32, version=u64, codec=codecs,
    tensors=st.lists(tensor_specs, max_size=4).map(tuple), num_values=u64, sequence=u64, tokens=u64, steps=u64,
    block_size=u32, encoded_bytes=u64, chunk_count=u32, digest=st.binary(max_size=16), layout_hash=text,
    learner_step=u64, sent_at_unix=doubles)
chunks = st.builds(Chunk, transfer_id=u64, index=u32, data=st.binary(max_size=64), crc32c=u32,
                   header=st.none() | headers)
protocols = st.builds(wire.ProtocolParams, num_fragments=u32, sync_every=u32, overlap=u32, max_chunk_bytes=u32,
                      mode=st.sampled_from(["decoupled", "streaming", "diloco"]), global_codec=codecs)
hellos = st.builds(wire.Hello, learner_id=text, model_fingerprint=text, layout_hash=text, protocol=protocols,
                   codecs=st.lists(codecs, max_size=3).map(tuple), held=versions, software_version=text,
                   incarnation=u64, labels=labels)
heartbeats = st.builds(wire.Heartbeat, step=u64, tokens_total=u64, tokens_per_s=doubles, step_time_s=doubles,
                       sent_at_unix=doubles)
goodbyes = st.builds(wire.Goodbye, reason=text)
welcomes = st.builds(wire.Welcome, synchronizer_id=text, protocol=protocols,
                     state=st.sampled_from(["ready", "genesis_requested", "genesis_pending"]), versions=versions,
                     heartbeat_interval_s=doubles, shard_index=u32, shard_count=st.integers(1, 2**32 - 1))
results = st.builds(wire.ContributionResult, sequence=u64, fragment_id=u32,
                    outcome=st.sampled_from(["merged", "rejected", "superseded"]), version=u64,
                    reason=st.just("") | reasons, detail=text, weight=doubles, staleness=u32)
resyncs = st.builds(wire.Resync, fragment_ids=st.lists(u32, max_size=4).map(tuple), reason=st.just("") | reasons,
                    detail=text)
drains = st.builds(wire.Drain, reason=text, deadline_s=doubles)
fetches = st.builds(wire.FetchStateRequest, learner_id=text, fragment_ids=st.lists(u32, max_size=4).map(tuple),
                    codec=st.just("") | codecs)
learner_statuses = st.builds(wire.LearnerStatus, learner_id=text, connected=st.booleans(), live=st.booleans(),
                             last_seen_s=doubles, step=u64, tokens_per_s=doubles, merged=u64, rejected=u64,
                             superseded=u64, tokens_merged=u64, labels=labels)
fragment_statuses = st.builds(wire.FragmentStatus, fragment_id=u32, version=u64, last_quorum_size=u32,
                              last_merge_unix=doubles, pending=u32, last_grace_s=doubles, num_values=u64)
statuses = st.builds(wire.StatusReply, synchronizer_id=text, mode=text, uptime_s=doubles,
                     state=st.sampled_from(["ready", "genesis_requested", "genesis_pending"]),
                     protocol=st.none() | protocols, quorum=u32,
                     learners=st.lists(learner_statuses, max_size=3).map(tuple),
                     fragments=st.lists(fragment_statuses, max_size=3).map(tuple), merges_total=u64,
                     rejected_by_reason=st.dictionaries(reasons, u64, max_size=3), token_goodput=doubles)


def _over_the_wire(message):  # type: ignore[no-untyped-def]
    return type(message).FromString(message.SerializeToString())


def _same_chunk(a: Chunk, b: Chunk) -> bool:
    return (a.transfer_id, a.index, bytes(a.data), a.crc32c, a.header) == (
        b.transfer_id, b.index, bytes(b.data), b.crc32c, b.header)


@SETTINGS
@given(msg=st.one_of(hellos, heartbeats, goodbyes, chunks))
def test_learner_messages_round_trip(msg) -> None:  # type: ignore[no-untyped-def]
    back = wire.learner_message_from_pb(_over_the_wire(wire.learner_message_to_pb(msg)))
    assert type(back) is type(msg)
    assert _same_chunk(back, msg) if isinstance(msg, Chunk) else back == msg


@SETTINGS
@given(msg=st.one_of(welcomes, results, resyncs, drains, chunks))
def test_synchronizer_messages_round_trip(msg) -> None:  # type: ignore[no-untyped-def]
    back = wire.synchronizer_message_from_pb(_over_the_wire(wire.synchronizer_message_to_pb(msg)))
    assert type(back) is type(msg)
    assert _same_chunk(back, msg) if isinstance(msg, Chunk) else back == msg


@SETTINGS
@given(header=headers, chunk=chunks, protocol=protocols, fetch=fetches, status=statuses)
def test_standalone_messages_round_trip(header, chunk, protocol, fetch, status) -> None:  # type: ignore[no-untyped-def]
    assert wire.header_from_pb(_over_the_wire(wire.header_to_pb(header))) == header
    assert _same_chunk(wire.chunk_from_pb(_over_the_wire(wire.chunk_to_pb(chunk))), chunk)
    assert wire.protocol_from_pb(_over_the_wire(wire.protocol_to_pb(protocol))) == protocol
    assert wire.fetch_request_from_pb(_over_the_wire(wire.fetch_request_to_pb(fetch))) == fetch
    assert wire.status_from_pb(_over_the_wire(wire.status_to_pb(status))) == status


def test_every_reject_reason_and_codec_round_trips() -> None:
    assert set(wire.REJECT_REASONS) >= {"stale", "bad_shape", "bad_dtype", "non_finite", "checksum", "oversized",
                                        "protocol", "layout_mismatch", "unsupported_codec", "unknown_fragment"}
    for reason in wire.REJECT_REASONS:
        msg = wire.ContributionResult(sequence=1, fragment_id=0, outcome="rejected", reason=reason)
        assert wire.synchronizer_message_from_pb(_over_the_wire(wire.synchronizer_message_to_pb(msg))) == msg
    for name in CODEC_NAMES:
        assert wire.codec_from_pb(wire.codec_to_pb(name)) == name


def test_fragment_error_reasons_exist_on_the_wire() -> None:
    from ddiloco.fragments import errors

    for cls in vars(errors).values():
        if isinstance(cls, type) and issubclass(cls, errors.FragmentError):
            assert cls.reason.lower() in wire.REJECT_REASONS, cls


# ---------------------------------------------------------------------------------------------
# Unknown values
# ---------------------------------------------------------------------------------------------


def _header_pb() -> pb.FragmentHeader:
    return wire.header_to_pb(TransferHeader(kind="global", fragment_id=1, version=2, codec="fp32",
                                            tensors=(TensorSpec("w", (3,)),), num_values=3))


@pytest.mark.parametrize("value", [0, 6, 99])
def test_unknown_codec_raises(value: int) -> None:
    with pytest.raises(CodecError):
        wire.codec_from_pb(value)
    msg = _header_pb()
    msg.codec = value
    with pytest.raises(CodecError):
        wire.header_from_pb(_over_the_wire(msg))


@pytest.mark.parametrize("value", [0, 4, 99])
def test_unknown_payload_kind_raises(value: int) -> None:
    msg = _header_pb()
    msg.kind = value
    with pytest.raises(HeaderError):
        wire.header_from_pb(_over_the_wire(msg))


@pytest.mark.parametrize("value", [0, 5, 99])
def test_unknown_tensor_dtype_raises(value: int) -> None:
    msg = _header_pb()
    msg.tensors[0].dtype = value
    with pytest.raises(HeaderError):
        wire.header_from_pb(_over_the_wire(msg))


def test_negative_dimension_raises() -> None:
    msg = _header_pb()
    msg.tensors[0].shape[0] = -3
    with pytest.raises(HeaderError):
        wire.header_from_pb(_over_the_wire(msg))


def test_unknown_names_raise_when_sending() -> None:
    with pytest.raises(CodecError):
        wire.codec_to_pb("lz4")
    with pytest.raises(ValueError, match="reject reason"):
        wire.synchronizer_message_to_pb(wire.ContributionResult(sequence=1, fragment_id=0, outcome="rejected",
                                                                reason="tired"))
    with pytest.raises(TypeError):
        wire.learner_message_to_pb(wire.Drain())  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        wire.synchronizer_message_to_pb(wire.Goodbye())  # type: ignore[arg-type]


def test_empty_messages_raise() -> None:
    with pytest.raises(HeaderError):
        wire.learner_message_from_pb(pb.LearnerMessage())
    with pytest.raises(HeaderError):
        wire.synchronizer_message_from_pb(pb.SynchronizerMessage())


# ---------------------------------------------------------------------------------------------
# Only the wire package's convert and stubs modules import the generated code
# ---------------------------------------------------------------------------------------------

GENERATED = "ddiloco.v1"
WIRE = ROOT / "libs/protocol/ddiloco/protocol/wire"
ALLOWED = {WIRE / "convert.py", WIRE / "stubs.py"}


def _package_of(path: pathlib.Path) -> str:
    """The package a source file belongs to: its folders from the ``ddiloco`` namespace down."""
    parts = path.parent.relative_to(ROOT).parts
    return ".".join(parts[parts.index("ddiloco"):])


def _generated_imports(path: pathlib.Path, source: str | None = None) -> list[str]:
    """Every way ``path`` reaches ddiloco.v1: imports (relative ones resolved) and module-name strings."""
    tree = ast.parse(path.read_text() if source is None else source, filename=str(path))
    package = _package_of(path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            modules = [base] + [f"{base}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            modules = [node.value]
        else:
            continue
        found += [f"{path.relative_to(ROOT)}:{node.lineno}: {m}" for m in modules
                  if m == GENERATED or m.startswith(GENERATED + ".")]
    return found


def _sources() -> list[pathlib.Path]:
    generated_dir = ROOT / "libs/protocol/ddiloco/v1"
    return [p for top in ("libs", "services", "lab") for p in sorted((ROOT / top).rglob("*.py"))
            if generated_dir not in p.parents and "ddiloco" in p.parts and "build" not in p.parts]


def test_only_wire_imports_the_generated_code() -> None:
    sources = _sources()
    assert set(sources) >= ALLOWED and len(sources) > 10
    offenders = [hit for path in sources if path not in ALLOWED for hit in _generated_imports(path)]
    assert not offenders, ("only ddiloco.protocol.wire's convert and stubs may import ddiloco.v1; use the wire "
                           "package's dataclasses:\n" + "\n".join(offenders))


def test_the_import_scanner_sees_every_form() -> None:
    """The guard above has teeth: the scanner finds the wire modules' own imports and the sneaky forms."""
    for allowed in ALLOWED:
        assert len(_generated_imports(allowed)) >= 2, allowed
    probe = ROOT / "lab/ddiloco/lab/probe.py"  # parsed as if it lived there; never written
    forms = ["import ddiloco.v1.synchronizer_pb2", "from ddiloco.v1 import synchronizer_pb2",
             "from ddiloco import v1", "from ..v1 import synchronizer_pb2", "from .. import v1",
             "importlib.import_module('ddiloco.v1.synchronizer_pb2')"]
    for form in forms:
        assert _generated_imports(probe, form), form
    assert not _generated_imports(probe, "from ddiloco.protocol import wire\nimport ddiloco.v1x\nfrom . import v1")
