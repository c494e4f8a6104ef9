"""A real Docker engine for the container tests, and the images they run.

The engine: the one ``$DOCKER_HOST`` (or ``/var/run/docker.sock``) answers on, else this session
starts its own ``dockerd`` on a socket of its own (installing Debian's ``docker.io`` first when it
is missing and this runs as root) and stops it by its pid at the end. Its storage driver is
``overlay2`` where the temp folder's file system takes it (layers shared, not copied), else ``vfs``
(every layer and every container a full copy: the image build takes several times longer);
``DDILOCO_DOCKER_STORAGE_DRIVER`` picks one. When it stops, its data root is set aside (moved,
not yet removed) and removed when the test session ends (``tests/conftest.py``).

Images:
- ``hostroot``: an empty root file system (only mount points, the merged-/usr links and a
  passwd file) that runs this checkout's own virtual environment from read-only bind mounts of
  ``/usr``, the Python installation and the checkout. It starts in about a second even on vfs
  (where every container copies its whole image), so the many-container scenarios use it.
- ``service_images``: the real ``ddiloco-synchronizer`` and ``ddiloco-learner`` images, built
  from the repository's Dockerfile on a Debian base made here with debootstrap (no image
  registry is reachable), installing from a wheelhouse made from this checkout.

The scenarios' containers and networks are made, started and removed with testcontainers
(``fleet.py``), pointed at this engine through ``$DOCKER_HOST``; the verbs it has none of (kill,
pause, restart, network disconnect) go to the Docker SDK for Python (``docker``) objects it wraps,
and the images are built and imported with that SDK too. testcontainers' reaper (Ryuk) is off: its
image cannot be pulled here (no registry is reachable). Instead every container, network and volume
a test makes is removed by that test, and whatever still carries this session's testcontainers
label when the package ends is removed then. Ports are published on 127.0.0.1 only.
"""

from __future__ import annotations

import hashlib
import io
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from typing import TYPE_CHECKING

import pytest

from ddiloco.lab.procs import stop_processes
from tests.conftest import ENGINE_DIR, engine_leftovers

if TYPE_CHECKING:
    from docker.client import DockerClient

ROOT = pathlib.Path(__file__).resolve().parents[2]
HOSTROOT_TAG = "ddiloco-hostroot:1"
BASE_TAG = "ddiloco-base:bookworm"

def _ping(base_url: str) -> bool:
    import docker

    try:
        client = docker.DockerClient(base_url=base_url, timeout=5)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:
        return False


def _install_engine() -> None:
    if shutil.which("dockerd"):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip("no Docker engine here, and installing one (apt-get install docker.io) needs root")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    proc = subprocess.run(["apt-get", "install", "-y", "-q", "docker.io"], capture_output=True, text=True,
                          env=env, timeout=900)
    if proc.returncode != 0:  # a stale package index: refresh it once
        subprocess.run(["apt-get", "update", "-q"], capture_output=True, env=env, timeout=600)
        proc = subprocess.run(["apt-get", "install", "-y", "-q", "docker.io"], capture_output=True, text=True,
                              env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]


STORAGE_DRIVERS = ("overlay2", "vfs")


def is_mount_point(path: pathlib.Path) -> bool:
    """Whether something is mounted on ``path``, a bind mount of a folder onto itself included
    (``os.path.ismount`` misses those: same device, and an inode other than the parent's)."""
    with open("/proc/self/mounts") as mounts:
        return any(line.split()[1] == str(path) for line in mounts)


def release_mounts(path: pathlib.Path) -> None:
    """Unmount whatever is mounted on ``path`` (dockerd binds its data root onto itself, and a
    root can be neither moved nor cleanly removed while that mount is there)."""
    while is_mount_point(path):
        subprocess.run(["umount", str(path)], capture_output=True, check=True, timeout=60)


def _start_engine(root: pathlib.Path, driver: str) -> subprocess.Popen | None:
    """dockerd with ``driver`` on ``root``/docker.sock (its data, exec root, pid file and log in
    ``root`` too), once it answers; None when it exits first, as dockerd does at start-up with a
    driver the file system does not take (overlay2 on overlayfs)."""
    for sub in ("data", "exec"):  # a refused driver may have left a half-made root
        shutil.rmtree(root / sub, ignore_errors=True)
    url = f"unix://{root}/docker.sock"
    with open(root / "dockerd.log", "ab") as log:
        log.write(f"--- dockerd --storage-driver={driver}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            ["dockerd", f"--storage-driver={driver}", "--host", url, "--data-root", str(root / "data"),
             "--exec-root", str(root / "exec"), "--pidfile", str(root / "dockerd.pid")],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 90
    while not _ping(url):
        if proc.poll() is not None:
            # dockerd binds its data root onto itself at start-up and leaves that mount behind when
            # it gives up: release it, or the root can be neither reused cleanly nor removed
            release_mounts(root / "data")
            return None
        if time.monotonic() > deadline:
            stop_processes([proc], grace_s=60)
            raise AssertionError(f"dockerd did not answer within 90 s: {(root / 'dockerd.log').read_text()[-3000:]}")
        time.sleep(0.5)
    return proc


def _use_engine(url: str) -> None:
    """Point testcontainers at ``url`` (it reads ``$DOCKER_HOST`` whenever it makes a client, and
    makes one per container and network) and turn its reaper off, before any of them is made."""
    from testcontainers.core.config import testcontainers_config

    os.environ["DOCKER_HOST"] = url
    testcontainers_config.ryuk_disabled = True


@pytest.fixture(scope="package")
def docker_engine():
    """DOCKER_HOST of a running engine (started here when none runs)."""
    for url in filter(None, [os.environ.get("DOCKER_HOST"), "unix:///var/run/docker.sock"]):
        if _ping(url):
            _use_engine(url)
            yield url
            return
    _install_engine()
    ENGINE_DIR.mkdir(parents=True, exist_ok=True)
    url = f"unix://{ENGINE_DIR}/docker.sock"
    forced = os.environ.get("DDILOCO_DOCKER_STORAGE_DRIVER")
    proc = None
    for driver in [forced] if forced else STORAGE_DRIVERS:
        proc = _start_engine(ENGINE_DIR, driver)
        if proc is not None:
            break
    assert proc is not None, f"dockerd exited at start-up: {(ENGINE_DIR / 'dockerd.log').read_text()[-3000:]}"
    try:
        _use_engine(url)
        yield url
    finally:
        os.environ.pop("DOCKER_HOST", None)
        stop_processes([proc], grace_s=60)
        # The engine's layers (gigabytes: torch in two images) go with it, the images are rebuilt
        # from the checkout by the next run anyway; removed when the session ends, not here.
        set_aside(ENGINE_DIR)


def set_aside(root: pathlib.Path, leftovers: pathlib.Path | None = None) -> None:
    """Move a stopped engine's data and exec roots out of ``root`` into ``leftovers`` (default:
    this session's ``engine_leftovers()``), which the session's end removes; a root that cannot be
    moved (another file system) is removed now."""
    leftovers = leftovers or engine_leftovers()
    for sub in ("data", "exec"):
        path = root / sub
        release_mounts(path)
        if not path.exists():
            continue
        leftovers.mkdir(parents=True, exist_ok=True)
        try:
            path.rename(leftovers / f"{sub}-{os.getpid()}-{time.time_ns()}")
        except OSError:
            shutil.rmtree(path, ignore_errors=True)


def _remove_leftovers(client: DockerClient) -> None:
    """Remove what still carries this session's testcontainers label: Ryuk's job, done here."""
    from testcontainers.core.labels import LABEL_SESSION_ID, SESSION_ID

    session = {"label": f"{LABEL_SESSION_ID}={SESSION_ID}"}
    for container in client.containers.list(all=True, filters=session):
        container.remove(force=True, v=True)
    for network in client.networks.list(filters=session):
        network.remove()
    for volume in client.volumes.list(filters=session):
        volume.remove(force=True)


@pytest.fixture(scope="package")
def docker_client(docker_engine):
    import docker

    client = docker.DockerClient(base_url=docker_engine, timeout=600)
    try:
        yield client
    finally:
        try:
            _remove_leftovers(client)
        finally:
            client.close()


def _hostroot_tar() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        def add_dir(name: str, mode: int = 0o755) -> None:
            info = tarfile.TarInfo(name)
            info.type, info.mode = tarfile.DIRTYPE, mode
            tar.addfile(info)

        def add_file(name: str, text: str) -> None:
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))

        for d in ("usr", "etc", "proc", "sys", "dev", "run", "var", "home", "state", "events", "opt"):
            add_dir(d)
        add_dir("root", 0o700)
        add_dir("tmp", 0o1777)
        add_dir("var/tmp", 0o1777)
        for link, target in (("bin", "usr/bin"), ("lib", "usr/lib"), ("lib64", "usr/lib64"), ("sbin", "usr/sbin")):
            info = tarfile.TarInfo(link)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
        add_file("etc/passwd", "root:x:0:0:root:/root:/bin/sh\nddiloco:x:10001:10001::/tmp:/bin/sh\n")
        add_file("etc/group", "root:x:0:\nddiloco:x:10001:\n")
    return buf.getvalue()


@pytest.fixture(scope="package")
def hostroot_image(docker_client) -> str:
    try:
        docker_client.images.get(HOSTROOT_TAG)
    except Exception:
        repo, tag = HOSTROOT_TAG.split(":")
        docker_client.api.import_image_from_data(_hostroot_tar(), repository=repo, tag=tag)
        docker_client.images.get(HOSTROOT_TAG)
    return HOSTROOT_TAG


def hostroot_mounts() -> list[tuple[str, str, str]]:
    """Read-only bind mounts, as (host, container, mode) for testcontainers' ``with_volume_mapping``,
    that make this checkout's venv run in ``hostroot``."""
    paths = {"/usr"} | {str(p) for p in (pathlib.Path(sys.base_prefix).resolve(), ROOT)
                        if not str(p).startswith("/usr/")}
    return [(path, path, "ro") for path in sorted(paths)]


def hostroot_command(*args: str) -> list[str]:
    """The ``ddiloco`` command line of this checkout, for a ``hostroot`` container."""
    return [str(ROOT / ".venv" / "bin" / "python"), "-m", "ddiloco.core.cli", *args]


def _sources_digest() -> str:
    h = hashlib.sha256()
    for rel in ("Dockerfile", ".dockerignore"):
        h.update((ROOT / rel).read_bytes())
    for top in ("libs", "services"):
        for path in sorted((ROOT / top).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and ".egg-info" not in str(path) \
                    and "build" not in path.relative_to(ROOT).parts:
                h.update(str(path.relative_to(ROOT)).encode())
                h.update(path.read_bytes())
    return h.hexdigest()[:12]


def _build_base(client) -> None:
    try:
        client.images.get(BASE_TAG)
        return
    except Exception:
        pass
    if not shutil.which("debootstrap"):
        if os.geteuid() != 0 or not shutil.which("apt-get"):
            pytest.skip("building the base image needs debootstrap (apt-get install debootstrap, as root)")
        proc = subprocess.run(["apt-get", "install", "-y", "-q", "debootstrap"], capture_output=True, text=True,
                              env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"), timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    proc = subprocess.run(["bash", str(ROOT / "docker" / "build-base.sh"), BASE_TAG], capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="package")
def service_images(docker_client) -> dict[str, str]:
    """{"synchronizer": tag, "learner": tag} of the real images, built from this checkout."""
    digest = _sources_digest()
    tags = {t: f"ddiloco-{t}:test-{digest}" for t in ("synchronizer", "learner")}
    try:
        for tag in tags.values():
            docker_client.images.get(tag)
        return tags
    except Exception:
        pass
    _build_base(docker_client)
    with tempfile.TemporaryDirectory(prefix="ddiloco-image-") as tmp:
        ctx = pathlib.Path(tmp)
        for rel in ("Dockerfile", ".dockerignore"):
            shutil.copy2(ROOT / rel, ctx / rel)
        ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "*.pyc")
        for top in ("libs", "services"):
            shutil.copytree(ROOT / top, ctx / top, ignore=ignore)
        wheels = ctx / "docker" / "wheels"
        wheels.mkdir(parents=True)
        torch_version = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__.split('+')[0])"],
                                       capture_output=True, text=True, check=True).stdout.strip()
        proc = subprocess.run(
            # no build isolation: the packages build with this environment's setuptools (a fresh one
            # per package would be installed otherwise: 40 s of the build)
            [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-build-isolation", "-w", str(wheels),
             f"torch=={torch_version}",
             "setuptools>=69", "wheel", *(str(ctx / p) for p in (
                 "libs/core", "libs/fragments", "libs/protocol", "libs/algorithm", "libs/training",
                 "services/synchronizer", "services/learner"))],
            capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        for target, tag in tags.items():
            try:
                docker_client.images.build(path=str(ctx), target=target, tag=tag, rm=True, forcerm=True,
                                           buildargs={"BASE": BASE_TAG, "PIP_OFFLINE": "1",
                                                      "TORCH_SPEC": f"torch=={torch_version}"})
            except Exception as exc:  # BuildError carries the log
                log = "".join(str(chunk.get("stream", "")) for chunk in getattr(exc, "build_log", []) or [])
                raise AssertionError(f"docker build --target {target} failed: {exc}\n{log[-4000:]}") from exc
    return tags
