"""A non-editable install carries every package, the generated code, and the console script.

``pip install --no-deps --target DIR .`` builds the wheel the way ``pip install .`` does and
unpacks it into DIR; imports are then checked from an unrelated folder with only DIR (and the
already installed dependencies) on the path, so nothing is picked up from the source tree.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODULES = [
    "ddiloco.cli", "ddiloco.v1.synchronizer_pb2_grpc", "ddiloco.fragments.wire", "ddiloco.fragments.codec",
    "ddiloco.synchronizer.server", "ddiloco.synchronizer.main", "ddiloco.learner.service", "ddiloco.learner.run",
    "ddiloco.simulator.cli", "ddiloco.benchmarks.codec", "ddiloco.benchmarks.merge", "ddiloco.benchmarks.quality",
]


def test_wheel_install_has_every_module_and_the_cli(tmp_path):
    target = tmp_path / "site"
    build = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                            "--target", str(target), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-2000:]
    assert not list(target.glob("__editable__*")), "must be a real (non-editable) install"
    code = "import importlib, sys\n" + "".join(f"importlib.import_module({m!r})\n" for m in MODULES) + \
           "import ddiloco; print(ddiloco.__file__)"
    env = dict(os.environ, PYTHONPATH=str(target))
    # -S keeps the editable install's path hooks out; the dependencies come from the real site-packages
    site = subprocess.run([sys.executable, "-c", "import site; print(site.getsitepackages()[0])"],
                          capture_output=True, text=True).stdout.strip()
    env["PYTHONPATH"] = os.pathsep.join([str(target), site])
    probe = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env,
                           timeout=120)
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert probe.stdout.strip().startswith(str(target)), probe.stdout
    cli = subprocess.run([sys.executable, "-S", "-m", "ddiloco.cli", "--version"], capture_output=True, text=True,
                         cwd=tmp_path, env=env, timeout=60)
    assert cli.returncode == 0 and cli.stdout.strip() == "0.1.0", cli.stderr
