"""Each deployable part installs on its own, with only its own dependencies, and runs.

The parts are built as real wheels (``pip wheel``, as ``pip install`` builds them) and unpacked
into a folder of their own; probes then run with ``python -S`` from an unrelated folder, with only
that folder and a *filtered* copy of site-packages on the path: the third-party dependencies are
there, the editable ddiloco installs of this checkout are not. So a module the image would lack,
or a command another part registers, cannot be picked up by accident.

What a synchronizer image holds must import, list only its own commands and never touch the lab's
plotting and progress-bar dependencies; the same for a learner image; everything together must
carry every module and the console script.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PARTS = {
    "ddiloco-core": "libs/core", "ddiloco-fragments": "libs/fragments", "ddiloco-protocol": "libs/protocol",
    "ddiloco-algorithm": "libs/algorithm", "ddiloco-simulator": "libs/simulator", "ddiloco-training": "libs/training",
    "ddiloco-synchronizer": "services/synchronizer", "ddiloco-learner": "services/learner", "ddiloco-lab": "lab",
}
LAB_ONLY = ("matplotlib", "tqdm")
"""Third-party packages only the lab may need: a service image must not ship them."""


def _requirements(part: str) -> list[str]:
    doc = tomllib.loads((ROOT / PARTS[part] / "pyproject.toml").read_text())
    return [r.split(";")[0].replace(" ", "") for r in doc["project"]["dependencies"]]


def _closure(part: str) -> tuple[set[str], set[str]]:
    """(ddiloco parts, third-party names) that installing ``part`` pulls in."""
    parts, third = {part}, set()
    todo = [part]
    while todo:
        for req in _requirements(todo.pop()):
            name = req.split("==")[0].split(">=")[0].split("<")[0]
            if name in PARTS and name not in parts:
                parts.add(name)
                todo.append(name)
            elif name not in PARTS:
                third.add(name)
    return parts, third


@pytest.mark.parametrize("service, others", [("ddiloco-synchronizer", ("ddiloco-learner", "ddiloco-training")),
                                             ("ddiloco-learner", ("ddiloco-synchronizer",))])
def test_a_service_depends_on_libraries_only(service: str, others: tuple[str, ...]) -> None:
    parts, third = _closure(service)
    assert not parts & {*others, "ddiloco-lab", "ddiloco-simulator"}, parts
    assert not third & set(LAB_ONLY), third
    for part in parts:
        version = tomllib.loads((ROOT / PARTS[part] / "pyproject.toml").read_text())["project"]["version"]
        assert version == "0.1.0", f"{part} has version {version}; every part carries the same version"


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    out = tmp_path_factory.mktemp("wheels")
    sources = tmp_path_factory.mktemp("sources")  # setuptools builds in the source folder: use copies
    copies = []
    for part, folder in PARTS.items():
        copies.append(sources / part)
        shutil.copytree(ROOT / folder, copies[-1],
                        ignore=shutil.ignore_patterns("build", "__pycache__", "*.egg-info"))
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                            "--wheel-dir", str(out), *map(str, copies)],
                           capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-2000:]
    found = {}
    for part in PARTS:
        matches = list(out.glob(part.replace("-", "_") + "-*.whl"))
        assert len(matches) == 1, (part, sorted(p.name for p in out.iterdir()))
        found[part] = matches[0]
    return found


@pytest.fixture(scope="module")
def third_party(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """site-packages without this checkout's ddiloco installs (links to everything else)."""
    site = pathlib.Path(subprocess.run([sys.executable, "-c", "import site; print(site.getsitepackages()[0])"],
                                       capture_output=True, text=True, check=True).stdout.strip())
    view = tmp_path_factory.mktemp("site")
    for entry in site.iterdir():
        name = entry.name.lower()
        if name.startswith(("ddiloco", "__editable__")) or name.endswith(".pth"):
            continue
        (view / entry.name).symlink_to(entry)
    return view


def _install(wheels: dict[str, pathlib.Path], parts: set[str], target: pathlib.Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                           "--target", str(target), *(str(wheels[p]) for p in sorted(parts))],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not list(target.glob("__editable__*")), "must be a real (non-editable) install"


def _probe(target: pathlib.Path, third_party: pathlib.Path, cwd: pathlib.Path, *args: str,
           blocked: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """``python -S`` with only the install and the third-party packages importable; ``blocked``
    modules raise ImportError when anything imports them."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(target), str(third_party)]))
    block = "".join(f"sys.modules[{m!r}] = None\n" for m in blocked)
    code = f"import sys\n{block}sys.argv = ['ddiloco', *sys.argv[1:]]\nfrom ddiloco.core.cli import main\nsys.exit(main())"
    return subprocess.run([sys.executable, "-S", "-c", code, *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=120)


def _import_all(target: pathlib.Path, third_party: pathlib.Path, cwd: pathlib.Path, packages: list[str],
                blocked: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(target), str(third_party)]))
    code = ("import importlib, pkgutil, sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in blocked)
            + f"for name in {packages!r}:\n"
            "    pkg = importlib.import_module(name)\n"
            "    assert pkg.__path__[0].startswith(sys.argv[1]), pkg.__path__\n"
            "    for info in pkgutil.walk_packages(pkg.__path__, name + '.'):\n"
            "        importlib.import_module(info.name)\n"
            "print('ok')\n")
    return subprocess.run([sys.executable, "-S", "-c", code, str(target)], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=300)


@pytest.mark.parametrize("service, packages, others, commands", [
    ("ddiloco-synchronizer", ["ddiloco.synchronizer"], ("ddiloco.learner", "ddiloco.training"),
     ["certs", "export", "status", "synchronizer"]),
    ("ddiloco-learner", ["ddiloco.learner", "ddiloco.training"], ("ddiloco.synchronizer",),
     ["certs", "eval", "learner", "prepare-data", "status"]),
])
def test_a_service_image_runs_without_the_lab(tmp_path, wheels, third_party, service, packages, others,
                                              commands) -> None:
    parts, _ = _closure(service)
    target = tmp_path / "site"
    _install(wheels, parts, target)
    blocked = (*LAB_ONLY, "ddiloco.lab", "ddiloco.simulator", *others)
    probe = _import_all(target, third_party, tmp_path, [*packages, "ddiloco.protocol", "ddiloco.fragments"], blocked)
    assert probe.returncode == 0 and probe.stdout.strip() == "ok", probe.stderr[-3000:]
    listing = _probe(target, third_party, tmp_path, "--help", blocked=blocked)
    assert listing.returncode == 0, listing.stderr
    installed = listing.stdout.split("installed commands:")[1].split("\n\n")[0]
    assert sorted(line.split()[0] for line in installed.strip().splitlines()) == commands, listing.stdout
    for command in commands:
        helped = _probe(target, third_party, tmp_path, command, "--help", blocked=blocked)
        assert helped.returncode == 0 and "usage: ddiloco " + command in helped.stdout, helped.stderr[-2000:]
    missing = _probe(target, third_party, tmp_path, "run", blocked=blocked)
    assert missing.returncode == 2 and "not installed" in missing.stderr, missing.stderr


def test_everything_together_carries_every_module_and_the_cli(tmp_path, wheels, third_party) -> None:
    target = tmp_path / "site"
    _install(wheels, set(PARTS), target)
    packages = ["ddiloco.core", "ddiloco.fragments", "ddiloco.protocol", "ddiloco.v1", "ddiloco.algorithm",
                "ddiloco.simulator", "ddiloco.training", "ddiloco.synchronizer", "ddiloco.learner", "ddiloco.lab"]
    probe = _import_all(target, third_party, tmp_path, packages, ())
    assert probe.returncode == 0 and probe.stdout.strip() == "ok", probe.stderr[-3000:]
    assert (target / "ddiloco" / "v1" / "synchronizer_pb2.pyi").exists(), "type stubs of the generated code ship"
    version = _probe(target, third_party, tmp_path, "--version")
    assert version.returncode == 0 and version.stdout.strip() == "0.1.0", version.stderr
    listing = _probe(target, third_party, tmp_path, "--help")
    for command in ("bench", "eval", "export", "learner", "prepare-data", "run", "simulate", "status", "synchronizer"):
        assert f"  {command} " in listing.stdout, listing.stdout
