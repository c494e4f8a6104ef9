"""The floor plan holds: import direction between the parts, checked by import-linter.

The contracts live in pyproject.toml (``[tool.importlinter]``): the lab over the services over the
libraries over core, the two services and the simulator independent of each other, only
``ddiloco.protocol.wire.convert`` and ``.stubs`` speaking protobuf (two contracts: one for whole
packages, one for the protocol and wire packages' own ``__init__``), and nothing a pod runs importing
plotting or progress-bar packages. Each folder's path is its import name, so a contract names folders too.
"""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _lint_imports() -> subprocess.CompletedProcess[str]:
    exe = shutil.which("lint-imports", path=str(pathlib.Path(sys.executable).parent))
    assert exe, "import-linter is a dev dependency (make install)"
    return subprocess.run([exe, "--no-cache"], capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_import_contracts_are_kept() -> None:
    proc = _lint_imports()
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "4 kept, 0 broken" in proc.stdout, proc.stdout[-2000:]


def test_a_library_importing_a_service_breaks_the_contracts() -> None:
    """The check has teeth: a library module that imports a service is reported."""
    probe = ROOT / "libs" / "algorithm" / "ddiloco" / "algorithm" / "_contract_probe.py"
    probe.write_text("from ddiloco.synchronizer import inbox  # noqa: F401\n")
    try:
        proc = _lint_imports()
    finally:
        probe.unlink()
    assert proc.returncode != 0
    assert "ddiloco.algorithm._contract_probe -> ddiloco.synchronizer.inbox" in proc.stdout, proc.stdout[-3000:]
