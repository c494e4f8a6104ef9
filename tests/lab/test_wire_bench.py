"""``ddiloco bench wire`` runs end to end (a real grpc.aio server and a real socket pair on
loopback), verifies the bytes it got back, and reports its ratio and gRPC's own (plain bytes on
the same server); bad options are refused."""

from __future__ import annotations

import json
import subprocess
import sys


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ddiloco.core.cli", "bench", "wire", *args],
                          capture_output=True, text=True, timeout=300)


def test_quick_run_reports_a_ratio_for_each_codec(tmp_path):
    out = tmp_path / "wire.json"
    proc = _bench("--quick", "--json", "--variant", "frame16m", "--rounds", "2", "--streams", "2",
                  "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    printed = json.loads(proc.stdout)
    assert printed == json.loads(out.read_text())
    assert printed["fragment_bytes"] == 4 << 20 and printed["tcp_seconds"] > 0
    rows = printed["results"]
    assert [(r["variant"], r["codec"]) for r in rows] == [("frame16m", "fp32"), ("frame16m", "bf16_zstd")]
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


def test_bad_options_are_refused(capsys):
    from ddiloco.lab.bench.wire import main

    for args in (["--variant", "turbo"], ["--chunk-mib", "abc"], ["--chunk-mib", "0"], ["--repeat", "0"], ["--rounds", "0"],
                 ["--streams", "two"], ["--streams", "0"], ["--streams", "65"]):
        try:
            code = main(args)
        except SystemExit as exc:  # argparse's own refusals
            code = exc.code
        err = capsys.readouterr().err
        assert code == 2 and "ddiloco bench wire" in err, (args, err)
