"""Who is calling: bearer tokens and client certificates, each naming an identity.

Two kinds of credential, usable together:

- **Bearer tokens** (``auth_tokens`` inline, ``auth_tokens_file`` for deployments): each token is
  listed under an identity. A call without a known token is refused (UNAUTHENTICATED) before it
  reaches the service; health checks stay open for probes. The file is read again whenever it
  changes (checked at each call, by its modification time and size), so a token is rotated by
  writing the new table: new calls need the new token, streams already open keep running.
- **Client certificates** (mutual TLS, ``tls_client_ca``): gRPC verifies the chain during the
  handshake; the certificate's common name is its identity. Server certificate, key and client
  CA are read again when their files change (checked at each new connection), so rotating a
  certificate, or the CA (which revokes every certificate the old CA signed), needs no restart.

An identity binds what its holder may do (``check_sync``, ``check_status``): a learner stream's
learner id must be its identity (or ``<identity>-...`` with ``identity_binding: prefix``), so a
learner can neither take over another's stream nor contribute under another id; operator
identities may read status and may not train. No token or key is ever logged.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import grpc

from ddiloco.core.config import ConfigError, read_file
from ddiloco.protocol.credentials import read_pem
from ddiloco.synchronizer.config import SynchronizerConfig, check_tokens


def _stamp(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


class TokenTable:
    """token -> identity, from the inline table and the tokens file (re-read when it changes)."""

    def __init__(self, inline: dict[str, str], path: str | None, *,
                 on_error: Callable[[str], None] = lambda _: None) -> None:
        self.inline = dict(inline)
        self.path = path
        self.on_error = on_error
        self._stamp: tuple[int, int] | None = None
        self._by_token: dict[str, str] = {}
        self._load(initial=True)

    @property
    def enabled(self) -> bool:
        return bool(self.inline) or self.path is not None

    def _load(self, initial: bool = False) -> None:
        table = dict(self.inline)
        stamp = None
        if self.path is not None:
            stamp = _stamp(self.path)
            try:
                loaded = read_file(self.path)
                if not all(isinstance(k, str) and isinstance(v, str) for k, v in loaded.items()):
                    raise ConfigError(f"{self.path}: every identity and token must be a string")
                check_tokens(loaded, self.path)
                for identity, token in loaded.items():
                    if identity in table and table[identity] != token:
                        raise ConfigError(f"{self.path}: {identity!r} has another token inline in the config")
                table.update(loaded)
                check_tokens(table, "auth_tokens + auth_tokens_file")
            except ValueError as exc:
                if initial:
                    raise
                self.on_error(f"tokens file not reloaded, the previous tokens stay in force: {exc}")
                self._stamp = stamp
                return
        self._by_token = {token: identity for identity, token in table.items()}
        self._stamp = stamp

    def identity(self, token: str) -> str | None:
        """The identity ``token`` is listed under (None: unknown)."""
        if self.path is not None and _stamp(self.path) != self._stamp:
            self._load()
        return self._by_token.get(token) if token else None


class ServerCertificates:
    """The server's TLS material, read again when a file changes (at the next handshake)."""

    def __init__(self, cfg: SynchronizerConfig, *, on_reload: Callable[[str], None] = lambda _: None,
                 on_error: Callable[[str], None] = lambda _: None) -> None:
        assert cfg.tls_cert and cfg.tls_key
        self.paths = tuple(p for p in (cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca) if p)
        self.cert, self.key, self.client_ca = cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca
        self.on_reload, self.on_error = on_reload, on_error
        self.reloads = 0
        self._stamps = self._read_stamps()
        self._initial = self._configuration()

    def _read_stamps(self) -> tuple[tuple[int, int] | None, ...]:
        return tuple(_stamp(p) for p in self.paths)

    def _configuration(self) -> Any:
        root = read_pem(self.client_ca) if self.client_ca else None
        key, cert = read_pem(self.key), read_pem(self.cert)
        if not key_matches(key, cert):  # caught between replacing the key and the certificate
            raise ValueError(f"{self.key} is not the key of {self.cert}")
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=root)

    def _fetch(self) -> Any:
        stamps = self._read_stamps()
        if stamps == self._stamps:
            return None
        try:
            config = self._configuration()
        except ValueError as exc:  # a file half-written or removed: keep serving with the old one
            self.on_error(f"TLS files not reloaded, the previous ones stay in force: {exc}")
            return None
        self._stamps = stamps
        self.reloads += 1
        self.on_reload(", ".join(self.paths))
        return config

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(self._initial, self._fetch,
                                                   require_client_authentication=self.client_ca is not None)


def key_matches(key_pem: bytes, cert_pem: bytes) -> bool:
    """True when the private key belongs to the certificate (both parse)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError as exc:
        raise ValueError(f"cannot parse TLS key or certificate: {exc}") from exc
    fmt = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return key.public_key().public_bytes(*fmt) == cert.public_key().public_bytes(*fmt)


def certificate_identity(context: Any) -> str | None:
    """The common name of the verified client certificate of a call (None without one)."""
    try:
        auth = context.auth_context()
    except Exception:  # no transport security at all
        return None
    names = auth.get("x509_common_name") or ()
    return names[0].decode() if names else None


class Gate:
    """Decides, per call, whether its credentials allow what it asks."""

    def __init__(self, cfg: SynchronizerConfig, tokens: TokenTable) -> None:
        self.tokens = tokens
        self.prefix = cfg.identity_binding == "prefix"
        self.operators = frozenset(cfg.operators)

    def identities(self, token: str, context: Any) -> list[str]:
        """Every identity the call's credentials prove (token and client certificate)."""
        found = []
        if self.tokens.enabled:
            ident = self.tokens.identity(token)
            if ident is not None:
                found.append(ident)
        cert = certificate_identity(context)
        if cert is not None:
            found.append(cert)
        return found

    def binds(self, identity: str, learner_id: str) -> bool:
        return learner_id == identity or (self.prefix and learner_id.startswith(identity + "-"))

    @staticmethod
    def _disagree(identities: list[str]) -> str | None:
        if len(set(identities)) > 1:
            return f"the call's credentials belong to different identities ({' and '.join(map(repr, identities))})"
        return None

    def check_sync(self, identities: list[str], learner_id: str) -> str | None:
        """Why these credentials may not stream as ``learner_id`` (None: they may)."""
        if (why := self._disagree(identities)) is not None:
            return why
        for ident in identities:
            if ident in self.operators:
                return f"operator credentials ({ident!r}) may not Sync"
            if not self.binds(ident, learner_id):
                return f"credentials belong to {ident!r}, not {learner_id!r}"
        return None

    def check_status(self, identities: list[str]) -> str | None:
        """Why these credentials may not read status (None: they may)."""
        if (why := self._disagree(identities)) is not None:
            return why
        if self.operators and not self.operators.intersection(identities):
            return "status is limited to operator credentials"
        return None
