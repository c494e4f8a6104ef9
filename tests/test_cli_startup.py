"""The command line answers ``--help``, ``status`` and bad arguments without importing torch
(about 3 s on 2 cores), and the fragments library's torch-free parts stay torch-free: the
protocol, ``ddiloco status`` and every refusal reach them."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import sys
from ddiloco.core.cli import main
try:
    code = main({argv!r})
except SystemExit as exc:
    code = exc.code
print("torch" in sys.modules, code)
"""


@pytest.mark.parametrize("argv,code", [
    (["--help"], 0),
    (["status", "--bogus"], 2),
    (["status", "--help"], 0),
    (["synchronizer", "--bogus"], 2),
    (["learner", "--bogus"], 2),
    (["run", "--steps", "-3"], 2),
    (["run", "--help"], 0),
    (["eval", "--bogus"], 2),
    (["certs", "--bogus"], 2),
])
def test_a_listing_a_status_or_a_refusal_does_not_import_torch(argv: list[str], code: int) -> None:
    proc = subprocess.run([sys.executable, "-c", PROBE.format(argv=argv)], capture_output=True, text=True,
                          timeout=120)
    assert proc.stdout.split()[-2:] == ["False", str(code)], (proc.stdout[-2000:], proc.stderr[-2000:])


def test_the_fragments_package_loads_its_modules_on_first_use() -> None:
    code = ("import sys, types; import ddiloco.protocol.wire, ddiloco.fragments.chunking;"
            "import ddiloco.fragments.partition, ddiloco.fragments.outer_gradient, ddiloco.fragments as f;"
            "assert 'torch' not in sys.modules, 'torch-free parts pulled torch in';"
            "modules = [n for n in f.__all__ if isinstance(getattr(f, n), types.ModuleType)];"
            "assert not modules, f'these names give a module, not the function: {modules}';"
            "assert f.make_codec('fp32').name == 'fp32' and 'torch' in sys.modules;"
            "assert sorted(f.__all__) == sorted(f._EXPORTS) and set(f.__all__) <= set(dir(f));"
            "import ddiloco.fragments.codec as c; assert f.Fp32Codec is c.Fp32Codec;"
            "missing = [n for n in f.__all__ if getattr(f, n, None) is None]; assert not missing, missing;"
            "print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "ok", proc.stderr[-3000:]
    proc = subprocess.run([sys.executable, "-c", "import ddiloco.fragments as f; f.no_such_name"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "has no attribute 'no_such_name'" in proc.stderr
