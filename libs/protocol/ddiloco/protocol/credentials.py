"""Who may talk to a synchronizer: TLS material and bearer tokens, for both ends of the wire.

One place builds what both sides need: the client's channel credentials and call metadata, the
server's reading of a bearer token, and the PEM files both read. Server TLS is set up by the
synchronizer from the same ``read_pem``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import grpc

BEARER = "Bearer "
TOKEN_ENV = "DDILOCO_TOKEN"
"""The environment variable a client's bearer token may come from (a Secret exposed as env)."""


def read_pem(path: str) -> bytes:
    """A PEM file's bytes, or a clear error naming the file."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ValueError(f"cannot read PEM file {path}: {exc.strerror}") from exc


def read_token(path: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """The bearer token from a file (a mounted Secret), else from $DDILOCO_TOKEN; None without either."""
    if path:
        try:
            with open(path) as f:
                token = f.read().strip()
        except OSError as exc:
            raise ValueError(f"cannot read token file {path}: {exc.strerror}") from exc
        if not token:
            raise ValueError(f"token file {path} is empty")
        return token
    return environ.get(TOKEN_ENV) or None


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    """Call metadata carrying ``token`` (None when there is no token)."""
    return (("authorization", BEARER + token),) if token else None


def token_from_metadata(metadata: Any) -> str:
    """The bearer token of a call's metadata ("" when it carries none)."""
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str) and value.startswith(BEARER):
            return value[len(BEARER):]
    return ""


@dataclass(frozen=True, kw_only=True)
class Credentials:
    """A client's credentials: TLS when ``tls_ca`` is set, mutual TLS with a certificate and key,
    and a bearer token sent with every call."""

    tls_ca: str | None = None
    """PEM CA bundle that verifies the synchronizer's certificate (enables TLS)."""
    tls_cert: str | None = None
    """PEM client certificate (mutual TLS)."""
    tls_key: str | None = None
    """PEM client private key (mutual TLS)."""
    token: str | None = None
    """Bearer token."""

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        if self.tls_cert and not self.tls_ca:
            raise ValueError("a client certificate (mutual TLS) needs tls_ca to verify the synchronizer")

    @property
    def metadata(self) -> tuple[tuple[str, str], ...] | None:
        return bearer_metadata(self.token)

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """TLS channel credentials, or None for a plaintext channel."""
        if not self.tls_ca:
            return None
        return grpc.ssl_channel_credentials(
            read_pem(self.tls_ca), read_pem(self.tls_key) if self.tls_key else None,
            read_pem(self.tls_cert) if self.tls_cert else None)
