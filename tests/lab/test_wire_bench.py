"""``ddiloco bench wire`` runs end to end (a real grpc.aio server and a real socket pair on
loopback), verifies the bytes it got back, and reports its ratio and gRPC's own (plain bytes on
the same server); bad options are refused."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

from ddiloco.core.resources import THP_TUNABLE
from tests.procs import children_of, cmdline, cpu_seconds, gone, run_tree


def _env(tunables: str | None = None) -> dict[str, str]:
    """This environment without GLIBC_TUNABLES (or with ``tunables``)."""
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    if tunables is not None:
        env["GLIBC_TUNABLES"] = tunables
    return env


def _bench(*args: str, tunables: str | None = None) -> subprocess.CompletedProcess[str]:
    return run_tree([sys.executable, "-m", "ddiloco.core.cli", "bench", "wire", *args],
                    capture_output=True, text=True, timeout=300, env=_env(tunables))


def test_quick_run_reports_a_ratio_for_each_codec(tmp_path):
    out = tmp_path / "wire.json"
    proc = _bench("--quick", "--json", "--variant", "frame16m", "--rounds", "2", "--streams", "2",
                  "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    printed = json.loads(proc.stdout)
    assert printed == json.loads(out.read_text())
    assert printed["fragment_bytes"] == 4 << 20 and printed["tcp_seconds"] > 0
    rows = printed["results"]
    assert [(r["variant"], r["codec"], r["framing"]) for r in rows] == [("frame16m", "fp32", "on-write"),
                                                                        ("frame16m", "bf16_zstd", "on-write")]
    assert printed["framings"] == ["on-write"]
    fp32, zstd = rows[0], rows[1]
    assert fp32["wire_bytes"] == 4 << 20 and zstd["wire_bytes"] < fp32["wire_bytes"] / 2  # bf16 + zstd
    assert all(r["seconds"] > 0 and r["ratio"] > 0 for r in rows)
    assert printed["ratio"] > 0 and printed["goal_ratio"] == 0.5
    # the plain-bytes baseline ran (and checked what came back) on the same server for every case
    assert all(r["grpc_bytes_seconds"] > 0 and r["vs_grpc_bytes"] == r["grpc_bytes_seconds"] / r["seconds"]
               for r in rows)
    fp32_rows = [r for r in rows if r["codec"] == "fp32"]
    # two interleaved rounds, the medians reported
    assert printed["rounds"] == 2 and len(printed["tcp_seconds_rounds"]) == 2
    assert printed["tcp_seconds"] == sum(printed["tcp_seconds_rounds"]) / 2
    assert all(len(r["seconds_rounds"]) == 2 and r["seconds"] == sum(r["seconds_rounds"]) / 2 for r in rows)
    assert printed["grpc_bytes_ratio"] in [printed["tcp_seconds"] / r["grpc_bytes_seconds"] for r in fp32_rows]
    # the plain-bytes echo also ran on two streams at once (two connections), checked the same way
    assert printed["streams"] == [1, 2]
    assert all(set(r["grpc_bytes_streams_seconds"]) == {"1", "2"} and r["grpc_bytes_streams_seconds"]["2"] > 0
               and r["grpc_bytes_streams_seconds"]["1"] == r["grpc_bytes_seconds"] for r in rows)
    assert all(len(r["grpc_bytes_streams_seconds_rounds"]["2"]) == 2 for r in rows)
    assert set(printed["grpc_bytes_ratio_streams"]) == {"1", "2"}
    assert printed["grpc_bytes_ratio_streams"]["1"] == printed["grpc_bytes_ratio"]
    # started without the services' environment, it measured in a child that has it
    assert printed["huge_pages"] == "on" and printed["glibc_tunables"] == THP_TUNABLE
    assert printed["transparent_hugepage"] in {"always", "madvise", "never", ""}
    assert printed["huge_pages_in_effect"] == (printed["transparent_hugepage"] in {"always", "madvise"})


def test_both_framings_are_measured_interleaved_and_the_first_one_gives_the_ratio(tmp_path):
    out = tmp_path / "wire.json"
    proc = _bench("--quick", "--json", "--framing", "eager,on-write", "--huge-pages", "off", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    printed = json.loads(out.read_text())
    rows = printed["results"]
    assert printed["framings"] == ["eager", "on-write"]
    assert [(r["codec"], r["framing"]) for r in rows] == [("fp32", "eager"), ("fp32", "on-write"),
                                                          ("bf16_zstd", "eager"), ("bf16_zstd", "on-write")]
    assert all(r["seconds"] > 0 for r in rows)
    assert rows[0]["wire_bytes"] == rows[1]["wire_bytes"] == 4 << 20, "the same bytes either way"
    # --quick cuts 1 MiB chunks, not the protocol's: the best fp32 row gives the ratio
    assert printed["ratio"] == max(printed["tcp_seconds"] / r["seconds"] for r in rows if r["codec"] == "fp32")


def test_huge_pages_off_measures_in_the_environment_as_it_is(tmp_path):
    out = tmp_path / "wire.json"
    proc = _bench("--quick", "--json", "--huge-pages", "off", "--out", str(out), tunables="glibc.malloc.arena_max=2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    printed = json.loads(out.read_text())
    assert printed["huge_pages"] == "off" and printed["glibc_tunables"] == "glibc.malloc.arena_max=2"
    assert printed["huge_pages_in_effect"] is False
    assert printed["ratio"] > 0


def test_rerun_as_deployed_passes_the_child_exit_code_and_respects_a_chosen_setting(monkeypatch, capfd):
    from ddiloco.lab.bench import rerun_as_deployed

    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    before = signal.getsignal(signal.SIGTERM)
    try:
        assert rerun_as_deployed("no-such-benchmark", []) == 2  # the child's refusal, passed on
    finally:
        signal.signal(signal.SIGTERM, before)  # it makes SIGTERM unwind this process
    assert "usage: ddiloco bench" in capfd.readouterr().out
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=0")  # the operator's choice: run here, as is
    assert rerun_as_deployed("no-such-benchmark", []) is None


def test_bad_options_are_refused(capsys, monkeypatch):
    from ddiloco.lab.bench.wire import main

    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)  # refused here, not by a re-run child

    for args in (["--variant", "turbo"], ["--chunk-mib", "abc"], ["--chunk-mib", "0"], ["--repeat", "0"], ["--rounds", "0"],
                 ["--streams", "two"], ["--streams", "0"], ["--streams", "65"], ["--huge-pages", "maybe"],
                 ["--framing", "lazy"], ["--framing", ","]):
        try:
            code = main(args)
        except SystemExit as exc:  # argparse's own refusals
            code = exc.code
        err = capsys.readouterr().err
        assert code == 2 and "ddiloco bench wire" in err, (args, err)


def test_sigterm_stops_the_rerun_child_and_its_echo_servers(tmp_path):
    """SIGTERM to a benchmark that re-ran itself with huge pages reaches the child, which stops the
    echo server it started at once (it would otherwise wait for a connection): nothing is left."""
    bench = subprocess.Popen([sys.executable, "-m", "ddiloco.core.cli", "bench", "wire", "--mib", "16",
                              "--chunk-mib", "1", "--repeat", "1000", "--out", str(tmp_path / "wire.json")],
                             env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    family: list[int] = []
    try:
        deadline = time.monotonic() + 120
        servers: list[int] = []
        while time.monotonic() < deadline and bench.poll() is None and not servers:
            time.sleep(0.2)
            children = children_of(bench.pid)
            family = children + [pid for child in children for pid in children_of(child)]
            servers = [pid for pid in family if b"multiprocessing" in cmdline(pid)
                       and b"resource_tracker" not in cmdline(pid)]
        assert servers, f"the benchmark did not re-run itself and start an echo server: {family}"
        # under way: an echo server has done a measurable amount of work
        while time.monotonic() < deadline and sum(cpu_seconds(pid) for pid in servers) < 0.2:
            time.sleep(0.05)
        assert sum(cpu_seconds(pid) for pid in servers) >= 0.2, "the echo servers never started working"
        children = children_of(bench.pid)
        family = sorted(set(family) | set(children) | {p for c in children for p in children_of(c)})
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=20) == 143  # well inside the 30 s an echo server was once waited for
        left = [pid for pid in family if not gone(pid, within_s=30)]
        assert not left, f"left running after SIGTERM: {left}"
    finally:
        for pid in [bench.pid, *family]:
            if not gone(pid, within_s=0):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        bench.wait()


def test_the_round_trip_is_timed_to_the_decoded_values_and_checked_after_the_clock_stops(monkeypatch):
    """The Sync case stops its clock when the fragment is decoded, as the plain-bytes echo stops its
    own when the bytes are in; comparing what came back (64 MiB: 15-20 ms of ``torch.equal`` here)
    is the benchmark's check, not the protocol's work, and runs after. A real echo server, one
    fragment, two round trips."""
    import asyncio
    import multiprocessing

    import torch

    from ddiloco.fragments.codec import make_codec
    from ddiloco.fragments.partition import partition_tensors
    from ddiloco.fragments.payload import decode_fragment, encode_fragment
    from ddiloco.lab.bench import wire as bench

    values = torch.randn(1 << 16, generator=torch.Generator().manual_seed(1))
    layout = partition_tensors({"w": values}, 1)
    codec = make_codec("fp32")
    order: list[str] = []
    real_clock = bench.time.perf_counter

    def clock() -> float:
        order.append("clock")
        return real_clock()

    def make_chunks() -> list:
        return encode_fragment(values, layout[0], codec=codec, kind="contribution", version=0, transfer_id=1,
                               sequence=1, tokens=1, steps=1, max_chunk_bytes=1 << 16)

    def finish(transfer):
        order.append("decode")
        return decode_fragment(transfer, layout)

    checked: list[torch.Tensor] = []

    def check(decoded: torch.Tensor) -> None:
        order.append("check")
        checked.append(decoded)

    ctx = multiprocessing.get_context("spawn")
    ports, stop = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=bench._grpc_echo, args=(1 << 16, [], ports, stop), daemon=True)
    child.start()
    try:
        port = ports.get(timeout=120)
        monkeypatch.setattr(bench.time, "perf_counter", clock)
        seconds = asyncio.run(bench._grpc_round_trips(port, make_chunks, finish, check, 1 << 16, [], 2))
    finally:
        monkeypatch.undo()
        stop.set()
        bench._stop_child(child, grace_s=30)
    assert seconds > 0
    assert order == ["clock", "decode", "clock", "check"] * 2
    assert len(checked) == 2 and all(torch.equal(c, values) for c in checked)
