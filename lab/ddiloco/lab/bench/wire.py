"""``ddiloco bench wire``: one fragment learner -> synchronizer -> learner over the Sync stream,
against raw TCP on loopback, measured in the same run.

What is timed is the protocol's own path, not a toy: the fragment is sent as a learner sends a
contribution (its payload from ``codec.lend_or_encode``: fp32 values lend their own memory, other
codecs encode; cut into chunks by ``encode_fragment``, with ``digest_only`` peers no CRC-32C per
chunk; each chunk hashed and copied into its wire message as it is written, the payload digest on
the last chunk, as a learner sends to a synchronizer of this version; or with ``--framing eager``
every chunk framed before the first is written, the digest in the header, as learners did before
and as a synchronizer frames a global version), serialized and parsed by ``ddiloco.protocol.wire`` (chunk data is never
copied into or out of a protobuf message), sent on a ``Sync`` bidirectional stream of a ``grpc.aio``
server with the synchronizer's channel options, reassembled and verified there
(``Reassembler(relay=True)``: order, sizes and the digest, chunk by chunk; a relay does not read the
payload, so the chunks are kept as they came, as the plain-bytes echo keeps its messages), sent back as the messages it came in (a relay's zero-copy path; the synchronizer
sends a global version's messages framed once when it was encoded) and verified again, with the learner's channel
options on the client, and decoded (the clock stops there: comparing the values with those sent is
the benchmark's own check and runs after, as the plain-bytes echo's comparison does). "codec on" adds bf16_zstd encoding before the send and decoding after the
round trip (what a contribution and a merged fragment cost end to end); "codec off" sends fp32.

The baseline moves the same bytes through a plain TCP socket on the same loopback, both ways
(the server reads everything, then writes it back). Each server runs in a process of its own,
as the synchronizer does, so client and server do not share an interpreter. ``ratio`` = raw TCP time / gRPC time
for the fp32 payload (1.0: the stream costs nothing over the socket). Each figure is the best of
``--repeat`` round trips; with ``--rounds R`` every case and the TCP baseline are measured R
times, interleaved, and the medians are reported (raw TCP's own time varies by up to 2x between
runs on a shared machine). Variants of the HTTP/2 settings can be compared with ``--variant``.

A second baseline, on the same gRPC server and channel options, echoes the same encoded payload
as plain ``bytes`` messages of the same size (identity serializers, no protobuf, framing or
checks): ``bytes ms`` is what
grpc.aio itself costs, so ``vs bytes`` (its time / the Sync time) is the share of that ceiling
the protocol reaches, and ``grpc_bytes_ratio`` (raw TCP time / its time) is the most any protocol
carried by grpc.aio can reach on the machine.

Every process runs with the environment the services run with (glibc's transparent-huge-page
tunable, ``ddiloco.core.resources.with_huge_pages``): where this process was started without it,
the benchmark runs again in a child that has it. With huge pages, each fresh fragment-sized buffer
costs fewer page faults, and the fp32 round trip took about half as long in the runs in
docs/benchmarks.md; ``--huge-pages off`` measures the environment as it is.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing
import platform
import socket
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import grpc
import torch

from ddiloco.fragments.chunking import Chunk, Reassembler, Transfer, sealed
from ddiloco.fragments.codec import lend_or_encode, make_codec
from ddiloco.fragments.partition import FragmentLayout, partition_tensors
from ddiloco.fragments.payload import decode_fragment, encode_fragment
from ddiloco.lab.bench import add_huge_pages_option, memory_environment, rerun_as_deployed, save_result
from ddiloco.lab.procs import exit_on_sigterm
from ddiloco.protocol import wire
from ddiloco.protocol.client import client_options, message_limit
from ddiloco.protocol.config import ProtocolConfig
from ddiloco.synchronizer.config import SynchronizerConfig
from ddiloco.synchronizer.server import channel_options

MIB = 1 << 20

VARIANTS: dict[str, list[tuple[str, Any]]] = {
    "default": [],
    # larger HTTP/2 frames (fewer frame headers and writes per chunk)
    "frame16m": [("grpc.http2.max_frame_size", 16 * MIB - 1)],
    # no BDP probing: flow-control windows stay at their initial size
    "nobdp": [("grpc.http2.bdp_probe", 0)],
    # bigger write buffer before the transport pushes back on the application
    "wbuf": [("grpc.http2.write_buffer_size", 16 * MIB)],
}


# -- raw TCP ----------------------------------------------------------------------------------


def _recv_exactly(sock: socket.socket, buf: memoryview) -> None:
    got = 0
    while got < len(buf):
        n = sock.recv_into(buf[got:])
        if n == 0:
            raise ConnectionError("peer closed early")
        got += n


def _tcp_echo(size: int, ports: Any) -> None:
    """Child process: accept one connection per round trip, read ``size`` bytes, write them back."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        ports.put(listener.getsockname()[1])
        buf = bytearray(size)
        while True:
            conn, _ = listener.accept()
            with conn:
                try:
                    _recv_exactly(conn, memoryview(buf))
                except ConnectionError:
                    return  # the parent's "done" connection
                conn.sendall(buf)


def _stop_child(child: Any, grace_s: float) -> None:
    """Wait up to ``grace_s`` for an echo server to end, then kill it; it is reaped either way."""
    child.join(timeout=grace_s)
    if child.is_alive():
        child.kill()
        child.join()


def tcp_round_trips(payload: bytes, repeat: int) -> float:
    """Best seconds to send ``payload`` over a loopback socket to another process and back."""
    ctx = multiprocessing.get_context("spawn")
    ports = ctx.Queue()
    child = ctx.Process(target=_tcp_echo, args=(len(payload), ports), daemon=True)
    child.start()
    best, done = float("inf"), False
    try:
        port = ports.get(timeout=60)
        back = bytearray(len(payload))
        for _ in range(repeat):
            with socket.create_connection(("127.0.0.1", port)) as sock:
                start = time.perf_counter()
                sock.sendall(payload)
                _recv_exactly(sock, memoryview(back))
                best = min(best, time.perf_counter() - start)
            if back != payload:
                raise AssertionError("raw TCP returned other bytes")
        socket.create_connection(("127.0.0.1", port)).close()  # "done": the server returns
        done = True
    finally:
        _stop_child(child, grace_s=30 if done else 0)  # interrupted: the server still waits for a connection
    return best


# -- the Sync stream -------------------------------------------------------------------------


class _Echo(wire.SynchronizerServicer):
    """Reassembles and verifies each transfer like the synchronizer, then sends it back."""

    def __init__(self, max_chunk_bytes: int) -> None:
        self.max_chunk_bytes = max_chunk_bytes

    async def Sync(self, request_iterator, context):  # type: ignore[no-untyped-def]
        reassembler = Reassembler(max_chunk_bytes=self.max_chunk_bytes, max_payload_bytes=1 << 34, relay=True)
        chunks = []
        async for raw in request_iterator:
            chunk = wire.learner_message_from_pb(raw)
            chunks.append(chunk)
            if reassembler.feed(chunk) is not None:
                for c in chunks:
                    yield c
                chunks = []


_BYTES_ECHO = "/ddiloco.bench.BytesEcho/Echo"


async def _bytes_echo(request_iterator: Any, context: Any) -> Any:
    """gRPC alone: messages are plain bytes (no protobuf, framing or checks); after an empty
    message, every message received is sent back."""
    received = []
    async for message in request_iterator:
        if not message:
            break
        received.append(message)
    for message in received:
        yield message


def _identity(b: bytes) -> bytes:
    return b


def _grpc_echo(max_chunk_bytes: int, extra: list[tuple[str, Any]], ports: Any, stop: Any) -> None:
    """Child process: the echo servicer on a grpc.aio server with the synchronizer's options, and
    the plain-bytes echo beside it."""

    async def serve() -> None:
        sync_cfg = SynchronizerConfig(protocol=ProtocolConfig(max_chunk_bytes=max_chunk_bytes))
        server = grpc.aio.server(options=channel_options(sync_cfg) + extra)
        wire.add_synchronizer_servicer(_Echo(max_chunk_bytes), server)
        service, method = _BYTES_ECHO.strip("/").split("/")
        handler = grpc.stream_stream_rpc_method_handler(_bytes_echo, request_deserializer=_identity,
                                                        response_serializer=_identity)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, {method: handler}),))
        ports.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await asyncio.get_running_loop().run_in_executor(None, stop.wait)
        await server.stop(None)

    asyncio.run(serve())


async def _grpc_round_trips(port: int, make_chunks: Callable[[], list[Any]], finish: Callable[[Transfer], Any],
                            check: Callable[[Any], None], max_chunk_bytes: int, extra: list[tuple[str, Any]],
                            repeat: int) -> float:
    """Best seconds for a fragment sent (``make_chunks``), echoed and received (``finish``: decoded, as a
    learner decodes a merged fragment). ``check`` (the values came back unchanged) is the benchmark's
    own verification: it runs after the clock stops, as the plain-bytes echo's comparison does."""
    best = float("inf")
    options = client_options(message_limit(max_chunk_bytes)) + extra
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
        stub = wire.SynchronizerStub(channel)
        for _ in range(repeat):
            start = time.perf_counter()
            chunks = make_chunks()
            call = stub.Sync()

            async def send(call: Any = call, chunks: list[Any] = chunks) -> None:
                for c in sealed(chunks):  # as a learner's stream writes them (a trailing digest)
                    await call.write(c)
                await call.done_writing()

            sender = asyncio.create_task(send())
            reassembler = Reassembler(max_chunk_bytes=max_chunk_bytes, max_payload_bytes=1 << 34)
            transfer = None
            async for raw in call:
                message = wire.synchronizer_message_from_pb(raw)
                if not isinstance(message, Chunk):
                    continue
                transfer = reassembler.feed(message)
                if transfer is not None:
                    break
            await sender
            assert transfer is not None, "nothing came back"
            received = finish(transfer)
            best = min(best, time.perf_counter() - start)
            call.cancel()
            check(received)
    return best


async def _bytes_round_trips(port: int, payload: bytes, max_chunk_bytes: int, extra: list[tuple[str, Any]],
                             repeat: int, streams: int = 1) -> float:
    """Best seconds for ``payload``, in chunks of ``max_chunk_bytes``, through the plain-bytes echo;
    with ``streams`` > 1 the payload is cut into that many parts, each echoed at the same time on a
    stream of its own over a connection of its own."""
    best = float("inf")
    view = memoryview(payload)
    options = client_options(message_limit(max_chunk_bytes)) + extra + [("grpc.use_local_subchannel_pool", 1)]
    bounds = [len(view) * i // streams for i in range(streams + 1)]
    parts = [[bytes(view[i:min(i + max_chunk_bytes, end)]) for i in range(start, end, max_chunk_bytes)]
             for start, end in itertools.pairwise(bounds)]
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) for _ in range(streams)]

    async def echo_part(channel: Any, messages: list[bytes]) -> list[bytes]:
        call = channel.stream_stream(_BYTES_ECHO, request_serializer=_identity, response_deserializer=_identity)()
        for message in messages:
            await call.write(message)
        await call.write(b"")
        return [m async for m in call]

    try:
        for _ in range(repeat):
            start = time.perf_counter()
            got = await asyncio.gather(*(echo_part(c, m) for c, m in zip(channels, parts, strict=True)))
            back = bytearray().join([m for part in got for m in part])
            best = min(best, time.perf_counter() - start)
            if back != payload:
                raise AssertionError("the plain-bytes echo returned other bytes")
    finally:
        for channel in channels:
            await channel.close()
    return best


FRAMINGS = ("on-write", "eager")
"""When a contribution's chunks are copied into their wire messages: as each is written (what
learners do), or every one before the first is written (what they did before)."""


def grpc_case(values: torch.Tensor, layout: FragmentLayout, codec_name: str, max_chunk_bytes: int,
              extra: list[tuple[str, Any]], repeat: int, threads: int,
              streams: tuple[int, ...] = (1,), framing: str = "on-write") -> tuple[float, int, dict[int, float]]:
    """(best round-trip seconds, bytes on the wire one way, best seconds of the plain-bytes echo
    for the same wire bytes on each number of ``streams``) for one case."""
    frag = layout[0]
    codec = make_codec(codec_name, threads=threads)
    sizes: list[int] = []

    def make_chunks() -> list[Any]:
        # a learner's contribution: its payload (kept for a resend; fp32 values lent), cut into
        # chunks, each hashed and copied into its message when written (the digest on the last
        # one, as a learner sends to a synchronizer of this version), or all framed first with the
        # digest in the header (the path of a global version)
        eager = framing == "eager"
        chunks = encode_fragment(values, frag, codec=codec, kind="contribution", version=0, transfer_id=1,
                                 sequence=1, tokens=1, steps=1, max_chunk_bytes=max_chunk_bytes,
                                 payload=lend_or_encode(codec, values),
                                 frame=wire.frame_chunks if eager else None, trailing_digest=not eager)
        sizes.append(sum(len(c.data) for c in chunks))
        return chunks

    def finish(transfer: Transfer) -> torch.Tensor:
        return decode_fragment(transfer, layout, zstd_threads=threads)

    def check(decoded: torch.Tensor) -> None:
        if codec_name == "fp32" and not torch.equal(decoded, values):
            raise AssertionError("the stream returned other values")

    ctx = multiprocessing.get_context("spawn")
    ports, stop = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=_grpc_echo, args=(max_chunk_bytes, extra, ports, stop), daemon=True)
    child.start()
    try:
        port = ports.get(timeout=120)
        seconds = asyncio.run(_grpc_round_trips(port, make_chunks, finish, check, max_chunk_bytes, extra, repeat))
        wire_payload = bytes(codec.encode(values))
        plain = {n: asyncio.run(_bytes_round_trips(port, wire_payload, max_chunk_bytes, extra, repeat, n))
                 for n in streams}  # in the order given: the caller rotates it between rounds
    finally:
        stop.set()
        _stop_child(child, grace_s=30)
    return seconds, sizes[0], plain


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ddiloco bench wire", description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=float, default=64, help="fragment size, MiB of fp32")
    parser.add_argument("--chunk-mib", default="1,3.9375,15", help="comma-separated chunk sizes in MiB "
                        "(3.9375 is the protocol's default, 4 MiB - 64 KiB)")
    parser.add_argument("--variant", default="default", help=f"comma-separated HTTP/2 option sets: "
                        f"{', '.join(VARIANTS)}")
    parser.add_argument("--repeat", type=int, default=3, help="round trips per case (the best is kept)")
    parser.add_argument("--rounds", type=int, default=1, help="measure every case (and raw TCP) this many "
                        "times, interleaved, and report the medians (the machine's noise hits all alike)")
    parser.add_argument("--streams", default="1", help="comma-separated numbers of parallel streams (each on a "
                        "connection of its own) for the plain-bytes echo; 1 is always measured")
    parser.add_argument("--framing", default="on-write", help="comma-separated: when a contribution's chunks "
                        "are copied into their messages, 'on-write' (as each is written: what learners do) or "
                        "'eager' (all before the first is written); several are measured interleaved")
    parser.add_argument("--threads", type=int, default=2, help="codec and torch threads")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--out", default="bench-results/wire.json", help="JSON results file")
    parser.add_argument("--quick", action="store_true", help="smoke run: 4 MiB, one chunk size, 1 repeat")
    add_huge_pages_option(parser)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if args.quick:
        args.mib, args.chunk_mib, args.repeat = 4, "1", 1
    try:
        chunk_sizes = [int(float(v) * MIB) for v in args.chunk_mib.split(",") if v.strip()]
        variants = [v.strip() for v in args.variant.split(",") if v.strip()]
        streams = tuple(sorted({1} | {int(v) for v in args.streams.split(",") if v.strip()}))
        framings = [v.strip() for v in args.framing.split(",") if v.strip()]
    except ValueError:
        parser.error("--chunk-mib takes numbers, e.g. 1,3.9375; --streams whole numbers, e.g. 1,2,4")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        parser.error(f"unknown variant(s) {', '.join(unknown) or '(none given)'}; known: {', '.join(VARIANTS)}")
    if not framings or any(f not in FRAMINGS for f in framings):
        parser.error(f"--framing takes {', '.join(FRAMINGS)} (comma-separated), got {args.framing!r}")
    if args.mib <= 0 or args.repeat < 1 or args.rounds < 1 or args.threads < 1 or not chunk_sizes or not all(
            1024 <= c <= 64 * MIB for c in chunk_sizes) or not all(1 <= n <= 64 for n in streams):
        parser.error("need --mib > 0, --repeat >= 1, --rounds >= 1, --threads >= 1, chunk sizes in 1 KiB..64 MiB, "
                     "streams in 1..64")
    if args.huge_pages == "on" and (code := rerun_as_deployed("wire", argv)) is not None:
        return code
    exit_on_sigterm()  # SIGTERM unwinds, so the echo servers this process starts are stopped
    torch.set_num_threads(args.threads)
    n = int(args.mib * MIB) // 4
    values = torch.randn(n, generator=torch.Generator().manual_seed(0)) * 0.01
    layout = partition_tensors({"w": values.view(-1)}, 1)
    fp32_bytes = n * 4

    cases = [(variant, chunk, codec_name, framing) for variant in variants for chunk in chunk_sizes
             for codec_name in ("fp32", "bf16_zstd") for framing in framings]
    tcp_rounds: list[float] = []
    measured: dict[tuple[str, int, str, str], list[tuple[float, int, dict[int, float]]]] = {c: [] for c in cases}
    for round_index in range(args.rounds):  # interleaved: machine noise falls on every case alike
        tcp_rounds.append(tcp_round_trips(values.numpy().tobytes(), args.repeat))
        for case in cases:
            variant, chunk, codec_name, framing = case
            turn = round_index % len(streams)  # each stream count takes each place in the order in turn
            measured[case].append(grpc_case(values, layout, codec_name, chunk, VARIANTS[variant], args.repeat,
                                            args.threads, streams[turn:] + streams[:turn], framing))
            if not args.json:
                seconds, _, plain_by_n = measured[case][-1]
                more = "".join(f", {n} streams {plain_by_n[n] * 1e3:.1f} ms" for n in streams if n > 1)
                print(f"round {round_index + 1}/{args.rounds}: {variant} {chunk / MIB:.2f} MiB {codec_name} "
                      f"framed {framing}: "
                      f"{seconds * 1e3:.1f} ms (plain bytes {plain_by_n[1] * 1e3:.1f} ms{more}, raw TCP "
                      f"{tcp_rounds[-1] * 1e3:.1f} ms)", file=sys.stderr, flush=True)
    tcp = statistics.median(tcp_rounds)
    tcp_gbs = 2 * fp32_bytes / tcp / 1e9
    if not args.json:
        print(f"wire: {fp32_bytes / MIB:.0f} MiB fragment, round trip on loopback, best of {args.repeat}"
              f"{f', median of {args.rounds} rounds' if args.rounds > 1 else ''}; grpcio {grpc.__version__}")
        print(f"raw TCP: {tcp * 1e3:.1f} ms, {tcp_gbs:.2f} GB/s")
        print(f"{'variant':>9} {'chunk MiB':>9} {'codec':>9} {'framing':>8} {'wire MiB':>9} {'ms':>8} {'frag GB/s':>10} "
              f"{'wire GB/s':>10} {'vs TCP':>7} {'bytes ms':>8} {'vs bytes':>8}")
    rows: list[dict[str, Any]] = []
    for (variant, chunk, codec_name, framing), runs in measured.items():
        seconds = statistics.median(r[0] for r in runs)
        plain_streams = {n: statistics.median(r[2][n] for r in runs) for n in streams}
        plain = plain_streams[1]
        wire_bytes = runs[0][1]
        row: dict[str, Any] = {
            "variant": variant, "chunk_bytes": chunk, "codec": codec_name, "framing": framing,
            "wire_bytes": wire_bytes,
            "seconds": seconds, "fragment_gbs": 2 * fp32_bytes / seconds / 1e9,
            "wire_gbs": 2 * wire_bytes / seconds / 1e9, "ratio": tcp / seconds,
            "grpc_bytes_seconds": plain, "vs_grpc_bytes": plain / seconds,
            "seconds_rounds": [r[0] for r in runs], "grpc_bytes_seconds_rounds": [r[2][1] for r in runs],
            "grpc_bytes_streams_seconds": {str(n): t for n, t in plain_streams.items()},
            "grpc_bytes_streams_seconds_rounds": {str(n): [r[2][n] for r in runs] for n in streams}}
        rows.append(row)
        if not args.json:
            print(f"{variant:>9} {chunk / MIB:>9.2f} {codec_name:>9} {framing:>8} {wire_bytes / MIB:>9.1f} "
                  f"{seconds * 1e3:>8.1f} {row['fragment_gbs']:>10.2f} {row['wire_gbs']:>10.2f} "
                  f"{row['ratio']:>6.2f}x {plain * 1e3:>8.1f} {row['vs_grpc_bytes']:>6.2f}x", flush=True)
    default_chunk = ProtocolConfig().max_chunk_bytes
    fp32_rows = [r for r in rows if r["codec"] == "fp32"]
    at_default = [r for r in fp32_rows if r["variant"] == "default" and r["chunk_bytes"] == default_chunk
                  and r["framing"] == framings[0]]
    default_row = at_default[0] if at_default else max(fp32_rows, key=lambda r: r["ratio"])
    result = {
        "benchmark": "wire", "fragment_bytes": fp32_bytes, "repeat": args.repeat, "rounds": args.rounds,
        "threads": args.threads, "tcp_seconds_rounds": tcp_rounds,
        "grpcio": grpc.__version__, "machine": platform.machine(),
        "huge_pages": args.huge_pages, **memory_environment(),
        "tcp_seconds": tcp, "tcp_gbs": tcp_gbs,
        "ratio": default_row["ratio"],
        "best_ratio": max(r["ratio"] for r in fp32_rows), "goal_ratio": 0.5,
        "ratio_means": "raw TCP round-trip time / gRPC Sync round-trip time, fp32 payload, protocol default "
                       "chunk and options, the first framing given (1.0: no cost over the socket)",
        "framings": framings,
        "grpc_bytes_ratio": tcp / default_row["grpc_bytes_seconds"],
        "grpc_bytes_ratio_means": "raw TCP round-trip time / round-trip time of the same bytes in plain bytes "
                                  "messages on the same gRPC server (no protobuf, framing or checks): the most "
                                  "any protocol on grpc.aio reaches here",
        "streams": list(streams),
        "grpc_bytes_ratio_streams": {n: tcp / t for n, t in default_row["grpc_bytes_streams_seconds"].items()},
        "results": rows,
    }
    out = save_result(result, args.out)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"ratio (default chunk and options, fp32) {result['ratio']:.2f}; best {result['best_ratio']:.2f} "
              f"(goal >= 0.5); plain bytes on gRPC reach {result['grpc_bytes_ratio']:.2f}"
              + "".join(f", on {n} streams {r:.2f}" for n, r in result["grpc_bytes_ratio_streams"].items() if n != "1")
              + f"\nwrote {out}")
    return 0
