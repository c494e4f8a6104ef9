"""``ddiloco certs`` makes a CA and leaves that verify, name the right identities and serve real mutual TLS.

Every check reads the files back with ``cryptography`` (or dials a real gRPC server with them);
nothing is mocked.
"""

from __future__ import annotations

import ipaddress
import stat
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TypeVar

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from ddiloco.protocol.certs import CertFiles, expires_at, identity_of, init_ca, issue, main

E = TypeVar("E", bound=x509.ExtensionType)


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _verifies(ca: Path, leaf: Path) -> None:
    ca_cert, cert = _cert(ca), _cert(leaf)
    assert cert.issuer == ca_cert.subject
    public_key, digest = ca_cert.public_key(), cert.signature_hash_algorithm
    assert isinstance(public_key, ec.EllipticCurvePublicKey) and digest is not None
    public_key.verify(cert.signature, cert.tbs_certificate_bytes, ec.ECDSA(digest))


def _ext(cert: x509.Certificate, cls: type[E]) -> E:
    return cert.extensions.get_extension_for_class(cls).value


@pytest.fixture
def ca(tmp_path: Path) -> CertFiles:
    return init_ca(tmp_path / "ca")


def test_init_writes_a_ca_with_a_private_key(tmp_path: Path) -> None:
    files = init_ca(tmp_path / "new" / "ca", name="test-ca", days=10)
    assert files == CertFiles(tmp_path / "new" / "ca" / "ca.pem", tmp_path / "new" / "ca" / "ca.key")
    assert stat.S_IMODE(files.key.stat().st_mode) == 0o600
    assert stat.S_IMODE(files.cert.parent.stat().st_mode) == 0o700
    cert = _cert(files.cert)
    assert identity_of(files.cert.read_bytes()) == "test-ca"
    assert _ext(cert, x509.BasicConstraints) == x509.BasicConstraints(ca=True, path_length=0)
    usage = _ext(cert, x509.KeyUsage)
    assert usage.key_cert_sign and usage.crl_sign
    _verifies(files.cert, files.cert)
    assert sorted(p.name for p in files.cert.parent.iterdir()) == ["ca.key", "ca.pem"]


def test_init_refuses_to_overwrite_unless_forced(ca: CertFiles) -> None:
    before = ca.cert.read_bytes()
    with pytest.raises(ValueError, match=r"already exist.*force"):
        init_ca(ca.cert.parent)
    assert ca.cert.read_bytes() == before
    init_ca(ca.cert.parent, force=True)
    assert ca.cert.read_bytes() != before
    assert stat.S_IMODE(ca.key.stat().st_mode) == 0o600


def test_server_certificate(ca: CertFiles, tmp_path: Path) -> None:
    files = issue(ca.cert.parent, tmp_path / "out", "synchronizer", kind="server",
                  hosts=["sync.example", "10.1.2.3", "::1"])
    assert stat.S_IMODE(files.key.stat().st_mode) == 0o600
    _verifies(ca.cert, files.cert)
    cert = _cert(files.cert)
    assert identity_of(files.cert.read_bytes()) == "synchronizer"
    san = _ext(cert, x509.SubjectAlternativeName)
    assert san.get_values_for_type(x509.DNSName) == ["sync.example"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.1.2.3"), ipaddress.ip_address("::1")]
    assert list(_ext(cert, x509.ExtendedKeyUsage)) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert _ext(cert, x509.BasicConstraints) == x509.BasicConstraints(ca=False, path_length=None)
    aki = _ext(cert, x509.AuthorityKeyIdentifier)
    assert aki.key_identifier == _ext(_cert(ca.cert), x509.SubjectKeyIdentifier).digest


def test_server_default_hosts_and_client_certificate(ca: CertFiles, tmp_path: Path) -> None:
    server = _cert(issue(ca.cert.parent, tmp_path, "sync", kind="server").cert)
    san = _ext(server, x509.SubjectAlternativeName)
    assert san.get_values_for_type(x509.DNSName) == ["localhost"]
    assert {str(ip) for ip in san.get_values_for_type(x509.IPAddress)} == {"127.0.0.1", "::1"}

    files = issue(ca.cert.parent, tmp_path, "learner-3", kind="client")
    _verifies(ca.cert, files.cert)
    cert = _cert(files.cert)
    assert identity_of(files.cert.read_bytes()) == "learner-3"
    san = _ext(cert, x509.SubjectAlternativeName)
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == ["spiffe://ddiloco/learner-3"]
    assert list(_ext(cert, x509.ExtendedKeyUsage)) == [ExtendedKeyUsageOID.CLIENT_AUTH]


def test_window_override_makes_an_expired_certificate(ca: CertFiles, tmp_path: Path) -> None:
    now = datetime.now(UTC)
    files = issue(ca.cert.parent, tmp_path, "old", kind="client", not_before=now - timedelta(days=2),
                  not_after=now - timedelta(days=1))
    when = expires_at(files.cert.read_bytes())
    assert when.tzinfo is not None and when < now
    assert abs(when - (now - timedelta(days=1))) < timedelta(seconds=2)
    fresh = expires_at(issue(ca.cert.parent, tmp_path, "new", kind="client", days=30).cert.read_bytes())
    assert timedelta(days=29) < fresh - now <= timedelta(days=30)


@pytest.mark.parametrize("name", ["", "-lead", "a/b", "../x", "a b", "x" * 129, "caf\u00e9"])
def test_invalid_names_are_refused_and_nothing_is_written(ca: CertFiles, tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError, match="invalid name"):
        issue(ca.cert.parent, tmp_path / "out", name, kind="client")
    assert not (tmp_path / "out").exists()


def test_bad_requests_are_refused(ca: CertFiles, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"cannot read CA certificate .*missing.*ca\.pem"):
        issue(tmp_path / "missing", tmp_path / "out", "a", kind="client")
    with pytest.raises(ValueError, match="invalid host"):
        issue(ca.cert.parent, tmp_path / "out", "a", kind="server", hosts=["bad host"])
    with pytest.raises(ValueError, match="outlive its CA"):
        issue(ca.cert.parent, tmp_path / "out", "a", kind="client", days=40000)
    with pytest.raises(ValueError, match="CA's own files"):
        issue(ca.cert.parent, ca.cert.parent, "ca", kind="client", force=True)
    assert not (tmp_path / "out").exists()
    first = issue(ca.cert.parent, tmp_path, "a", kind="client").cert.read_bytes()
    with pytest.raises(ValueError, match="already exist"):
        issue(ca.cert.parent, tmp_path, "a", kind="client")
    assert (tmp_path / "a.pem").read_bytes() == first
    assert issue(ca.cert.parent, tmp_path, "a", kind="client", force=True).cert.read_bytes() != first


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ca_dir, out = tmp_path / "ca", tmp_path / "out"
    assert main(["init", "--dir", str(ca_dir)]) == 0
    printed = capsys.readouterr().out
    assert str(ca_dir / "ca.pem") in printed and str(ca_dir / "ca.key") in printed
    assert main(["init", "--dir", str(ca_dir)]) == 2
    assert capsys.readouterr().err.startswith("ddiloco certs: ")

    assert main(["issue", "--ca-dir", str(ca_dir), "--out", str(out), "--name", "sync", "--server",
                 "--host", "127.0.0.1"]) == 0
    printed = capsys.readouterr().out
    assert f"tls_cert={out / 'sync.pem'}" in printed and f"tls_key={out / 'sync.key'}" in printed
    assert f"tls_client_ca={ca_dir / 'ca.pem'}" in printed
    assert main(["issue", "--ca-dir", str(ca_dir), "--out", str(out), "--name", "learner-0", "--client"]) == 0
    assert f"tls_ca={ca_dir / 'ca.pem'}" in capsys.readouterr().out

    for bad in (["issue", "--ca-dir", str(ca_dir), "--out", str(out), "--name", "x"],
                ["issue", "--ca-dir", str(ca_dir), "--out", str(out), "--name", "x", "--client", "--host", "h"],
                ["issue", "--ca-dir", str(ca_dir), "--out", str(out), "--name", "bad/name", "--client"],
                ["issue", "--ca-dir", str(tmp_path / "none"), "--out", str(out), "--name", "x", "--client"]):
        assert main(bad) == 2
        assert "ddiloco certs" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["learner-0.key", "learner-0.pem", "sync.key", "sync.pem"]

    assert main(["show", str(out / "sync.pem")]) == 0
    shown = capsys.readouterr().out
    assert "sync" in shown and "IP:127.0.0.1" in shown and "EXPIRED" not in shown
    now = datetime.now(UTC)
    old = issue(ca_dir, out, "old", kind="client", not_before=now - timedelta(days=3),
                not_after=now - timedelta(days=2))
    assert main(["show", str(old.cert)]) == 0
    assert "EXPIRED" in capsys.readouterr().out
    assert main(["show", str(out / "sync.key")]) == 2
    assert main(["show", str(tmp_path / "absent.pem")]) == 2


def test_module_runs_as_a_command(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "ddiloco.protocol.certs", "init", "--dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert str(tmp_path / "ca.pem") in done.stdout


async def _check(port: int, ca: Path, client: CertFiles) -> None:
    creds = grpc.ssl_channel_credentials(ca.read_bytes(), client.key.read_bytes(), client.cert.read_bytes())
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", creds) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_issued_files_serve_mutual_tls(ca: CertFiles, tmp_path: Path) -> None:
    server_files = issue(ca.cert.parent, tmp_path / "server", "sync", kind="server", hosts=["127.0.0.1"])
    client = issue(ca.cert.parent, tmp_path / "learners", "learner-0", kind="client")
    other_ca = init_ca(tmp_path / "other-ca")
    stranger = issue(other_ca.cert.parent, tmp_path / "strangers", "learner-0", kind="client")

    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health_aio.HealthServicer(), server)
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials(
        [(server_files.key.read_bytes(), server_files.cert.read_bytes())],
        root_certificates=ca.cert.read_bytes(), require_client_auth=True))
    await server.start()
    try:
        await _check(port, ca.cert, client)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _check(port, ca.cert, stranger)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(None)
