"""``ddiloco certs``: a small certificate authority for a ddiloco deployment.

Mutual TLS between a synchronizer and its learners needs three kinds of file, and this makes all
of them with ECDSA P-256 keys:

* one CA (``ca.pem``, ``ca.key``). Its certificate is the trust root on both sides: the
  synchronizer's ``tls_client_ca`` and every learner's ``tls_ca``. Its key only ever issues.
* a server certificate for the synchronizer, whose subject alternative names are the hosts and
  addresses learners dial (TLS checks the name against them, not against the common name).
* one client certificate per learner. Its common name is the learner id, so the synchronizer can
  bind a connection to the learner it claims to be; it also carries ``spiffe://ddiloco/<id>``.

Rotation: issue new files over the old ones (``--force``). Each file is replaced atomically (the
key first, then the certificate), so a reader never sees a half-written file, and the
synchronizer reloads its certificate when the files change. Keys are created mode 0600 and never
exist on disk with wider permissions.

    ddiloco certs init --dir certs
    ddiloco certs issue --ca-dir certs --out certs --name synchronizer --server --host sync.example
    ddiloco certs issue --ca-dir certs --out certs --name learner-0 --client
    ddiloco certs show certs/learner-0.pem
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Literal

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_CERT = "ca.pem"
CA_KEY = "ca.key"
DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")
SPIFFE_PREFIX = "spiffe://ddiloco/"
BACKDATE = timedelta(minutes=5)
"""Leaves start this long before now, so a peer whose clock is slightly behind still accepts them."""

_USAGES = {ExtendedKeyUsageOID.SERVER_AUTH: "server (serverAuth)",
           ExtendedKeyUsageOID.CLIENT_AUTH: "client (clientAuth)"}
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_DNS_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


@dataclass(frozen=True)
class CertFiles:
    """Where a certificate and its private key were written."""

    cert: Path
    key: Path


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"invalid name {name!r}: use 1-128 of A-Z a-z 0-9 . _ - starting with a letter or digit "
                         "(a learner id)")


def _check_days(days: int) -> None:
    if isinstance(days, bool) or not isinstance(days, int) or days < 1:
        raise ValueError(f"days must be a whole number >= 1, got {days!r}")


def _is_dns_name(host: str) -> bool:
    labels = host.split(".")
    if labels[0] == "*" and len(labels) > 2:
        labels = labels[1:]
    return len(host) <= 253 and all(_DNS_LABEL.fullmatch(label) for label in labels)


def _san_for_host(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        pass
    if not _is_dns_name(host):
        raise ValueError(f"invalid host {host!r}: give a DNS name or an IP address")
    return x509.DNSName(host)


def _utc(moment: datetime, what: str) -> datetime:
    if not isinstance(moment, datetime):
        raise ValueError(f"{what} must be a datetime, got {moment!r}")
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _refuse_existing(paths: Sequence[Path], force: bool) -> None:
    existing = [str(p) for p in paths if p.exists() or p.is_symlink()]
    if existing and not force:
        raise ValueError(f"{', '.join(existing)} already exist{'s' if len(existing) == 1 else ''}; "
                         "pass force=True (--force) to replace")


def _ensure_dir(path: Path) -> None:
    """Create a directory private to its owner (it will hold private keys)."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path} is not a directory")
    if not path.exists():
        path.mkdir(mode=0o700, parents=True)
        path.chmod(0o700)


def _write_tmp(directory: Path, data: bytes, mode: int) -> Path:
    """Write ``data`` to a fresh file in ``directory`` (created 0600, then set to ``mode``)."""
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".pem")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
    except BaseException:
        os.unlink(tmp)
        raise
    return Path(tmp)


def _write_pair(cert: x509.Certificate, key: ec.EllipticCurvePrivateKey, files: CertFiles) -> CertFiles:
    """Write both files to temporaries first, then move each into place atomically (key first)."""
    key_tmp = _write_tmp(files.key.parent, _key_pem(key), 0o600)
    try:
        cert_tmp = _write_tmp(files.cert.parent, _cert_pem(cert), 0o644)
    except BaseException:
        key_tmp.unlink()
        raise
    os.replace(key_tmp, files.key)
    os.replace(cert_tmp, files.cert)
    return files


def _key_id(ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey) -> x509.AuthorityKeyIdentifier:
    try:
        ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    except x509.ExtensionNotFound:
        return x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key())
    return x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski)


def init_ca(out_dir: str | Path, *, name: str = "ddiloco-ca", days: int = 3650, force: bool = False) -> CertFiles:
    """Create a CA in ``out_dir`` (``ca.pem``, ``ca.key``); it signs only leaves (path length 0)."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError("the CA name must not be empty")
    _check_days(days)
    directory = Path(out_dir)
    files = CertFiles(cert=directory / CA_CERT, key=directory / CA_KEY)
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"{directory} is not a directory")
    _refuse_existing([files.cert, files.key], force)

    key = _new_key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.now(UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(now + timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                     crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    _ensure_dir(directory)
    return _write_pair(cert, key, files)


def _load_ca(ca_dir: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert_path, key_path = ca_dir / CA_CERT, ca_dir / CA_KEY
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    except OSError as exc:
        raise ValueError(f"cannot read CA certificate {cert_path}: {exc.strerror} "
                         "(create a CA with `ddiloco certs init`)") from exc
    except ValueError as exc:
        raise ValueError(f"{cert_path} is not a PEM certificate: {exc}") from exc
    try:
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except OSError as exc:
        raise ValueError(f"cannot read CA key {key_path}: {exc.strerror}") from exc
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{key_path} is not an unencrypted PEM private key: {exc}") from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{key_path} is not an EC private key")
    if key.public_key() != cert.public_key():
        raise ValueError(f"{key_path} does not belong to {cert_path}")
    try:
        is_ca = cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        is_ca = False
    if not is_ca:
        raise ValueError(f"{cert_path} is not a CA certificate")
    return cert, key


def issue(ca_dir: str | Path, out_dir: str | Path, name: str, *, kind: Literal["server", "client"],
          hosts: Sequence[str] = (), days: int = 365, not_before: datetime | None = None,
          not_after: datetime | None = None, force: bool = False) -> CertFiles:
    """Issue ``out_dir/<name>.pem`` and ``<name>.key``, signed by the CA in ``ca_dir``.

    A server certificate names ``hosts`` (default: this machine's loopback names) for hostname
    checks; a client certificate's CN is ``name``, the learner id the synchronizer binds it to.
    ``not_before``/``not_after`` replace the default window (now - 5 min .. now + ``days``)."""
    _check_name(name)
    if kind not in ("server", "client"):
        raise ValueError(f"kind must be 'server' or 'client', got {kind!r}")
    _check_days(days)
    if isinstance(hosts, str):
        raise ValueError("hosts must be a sequence of names, not a single string")
    if kind == "client" and hosts:
        raise ValueError("hosts are for server certificates; a client certificate is named by its learner id")
    sans: list[x509.GeneralName]
    if kind == "server":
        sans = [_san_for_host(h) for h in dict.fromkeys(hosts or DEFAULT_HOSTS)]
        usage = ExtendedKeyUsageOID.SERVER_AUTH
    else:
        sans = [x509.UniformResourceIdentifier(SPIFFE_PREFIX + name)]
        usage = ExtendedKeyUsageOID.CLIENT_AUTH
    now = datetime.now(UTC)
    start = _utc(not_before, "not_before") if not_before is not None else now - BACKDATE
    end = _utc(not_after, "not_after") if not_after is not None else now + timedelta(days=days)
    if end <= start:
        raise ValueError(f"not_after ({end.isoformat()}) must be later than not_before ({start.isoformat()})")

    ca_path = Path(ca_dir)
    ca_cert, ca_key = _load_ca(ca_path)
    if end > ca_cert.not_valid_after_utc:
        raise ValueError(f"the certificate would outlive its CA (which expires "
                         f"{ca_cert.not_valid_after_utc.isoformat()}); issue for fewer days or make a new CA")
    directory = Path(out_dir)
    files = CertFiles(cert=directory / f"{name}.pem", key=directory / f"{name}.key")
    ca_files = {(ca_path / CA_CERT).resolve(), (ca_path / CA_KEY).resolve()}
    if {files.cert.resolve(), files.key.resolve()} & ca_files:
        raise ValueError(f"{name!r} would overwrite the CA's own files in {ca_path}; choose another name")
    _refuse_existing([files.cert, files.key], force)

    key = _new_key()
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                     crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(_key_id(ca_cert, ca_key), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    _ensure_dir(directory)
    return _write_pair(cert, key, files)


def _load_cert(pem: bytes) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(pem)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"not a PEM certificate: {exc}") from exc


def identity_of(pem: bytes) -> str:
    """The subject common name of a PEM certificate: for a learner's certificate, its learner id."""
    names = _load_cert(pem).subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if not names:
        raise ValueError("the certificate has no subject common name")
    value = names[0].value
    return value.decode() if isinstance(value, bytes) else value


def expires_at(pem: bytes) -> datetime:
    """When a PEM certificate stops being valid (notAfter), in UTC."""
    return _load_cert(pem).not_valid_after_utc


def _sans(cert: x509.Certificate) -> list[str]:
    try:
        ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    kinds: dict[type, str] = {x509.DNSName: "DNS", x509.IPAddress: "IP", x509.UniformResourceIdentifier: "URI"}
    return [f"{kinds.get(type(n), type(n).__name__)}:{n.value}" for n in ext]


def describe(pem: bytes, *, now: datetime | None = None) -> str:
    """A certificate in a few lines for ``ddiloco certs show``."""
    cert = _load_cert(pem)
    now = now or datetime.now(UTC)

    def cn(name: x509.Name) -> str:
        attrs = name.get_attributes_for_oid(NameOID.COMMON_NAME)
        return str(attrs[0].value) if attrs else name.rfc4514_string()

    try:
        usages = [_USAGES.get(u, u.dotted_string)
                  for u in cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value]
    except x509.ExtensionNotFound:
        usages = []
    try:
        is_ca = cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        is_ca = False
    start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
    state = "EXPIRED" if now >= end else "NOT YET VALID" if now < start else f"valid, {(end - now).days} days left"
    return "\n".join([
        f"subject CN:  {cn(cert.subject)}",
        f"SANs:        {', '.join(_sans(cert)) or '-'}",
        f"issuer:      {cn(cert.issuer)}",
        f"kind:        {'CA' if is_ca else ', '.join(usages) or '-'}",
        f"not before:  {start.isoformat()}",
        f"not after:   {end.isoformat()}",
        f"status:      {state}",
        f"serial:      {cert.serial_number:x}",
        f"sha256:      {cert.fingerprint(hashes.SHA256()).hex(':')}",
    ])


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ddiloco certs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{init,issue,show}")
    p = sub.add_parser("init", help="create a CA (ca.pem, ca.key)")
    p.add_argument("--dir", required=True, help="directory for ca.pem and ca.key (created 0700)")
    p.add_argument("--name", default="ddiloco-ca", help="the CA's common name")
    p.add_argument("--days", type=int, default=3650, help="validity in days (default 3650)")
    p.add_argument("--force", action="store_true", help="replace an existing CA")
    p = sub.add_parser("issue", help="issue a server or client certificate signed by the CA")
    p.add_argument("--ca-dir", required=True, help="directory holding ca.pem and ca.key")
    p.add_argument("--out", required=True, help="directory for NAME.pem and NAME.key")
    p.add_argument("--name", required=True, help="common name: the learner id for a client certificate")
    kind = p.add_mutually_exclusive_group(required=True)
    kind.add_argument("--server", action="store_true", help="a synchronizer certificate")
    kind.add_argument("--client", action="store_true", help="a learner (client) certificate")
    p.add_argument("--host", action="append", default=[], metavar="H",
                   help=f"server name or IP learners dial; repeat (default: {' '.join(DEFAULT_HOSTS)})")
    p.add_argument("--days", type=int, default=365, help="validity in days (default 365)")
    p.add_argument("--force", action="store_true", help="replace existing files (rotation)")
    p = sub.add_parser("show", help="print a certificate's names and validity")
    p.add_argument("file", help="a PEM certificate")
    return parser


def _run(args: argparse.Namespace) -> None:
    if args.command == "init":
        files = init_ca(args.dir, name=args.name, days=args.days, force=args.force)
        print(f"wrote {files.cert}  (CA certificate: synchronizer tls_client_ca, learner tls_ca)")
        print(f"wrote {files.key}  (CA key: keep it private; it is needed only to issue certificates)")
        print(f"next: ddiloco certs issue --ca-dir {args.dir} --out {args.dir} --name synchronizer --server "
              "--host <name learners dial>")
    elif args.command == "issue":
        if args.client and args.host:
            raise ValueError("--host is for --server certificates")
        kind: Literal["server", "client"] = "server" if args.server else "client"
        files = issue(args.ca_dir, args.out, args.name, kind=kind, hosts=args.host, days=args.days,
                      force=args.force)
        ca = Path(args.ca_dir) / CA_CERT
        print(f"wrote {files.cert}")
        print(f"wrote {files.key}")
        if kind == "server":
            print(f"synchronizer config: tls_cert={files.cert} tls_key={files.key} tls_client_ca={ca}")
        else:
            print(f"learner config: learner_id={args.name} tls_ca={ca} tls_cert={files.cert} tls_key={files.key}")
    else:
        try:
            pem = Path(args.file).read_bytes()
        except OSError as exc:
            raise ValueError(f"cannot read {args.file}: {exc.strerror}") from exc
        print(describe(pem))


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    try:
        _run(args)
    except ValueError as exc:
        print(f"ddiloco certs: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"ddiloco certs: {exc.filename}: {exc.strerror}" if exc.filename else f"ddiloco certs: {exc}",
              file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
