"""Credentials against a real synchronizer over real TLS: certificates from ``ddiloco certs``.

Server TLS (right CA, wrong CA, wrong host name, expired certificate, plaintext client), mutual TLS
with the learner id bound to the client certificate (exact and prefix binding), rotation of the
server certificate and of the client CA without a restart, bearer tokens from a file that is
re-read when it changes, and operator-only status.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import shutil
import time

import grpc
import pytest

from ddiloco.protocol import certs, wire
from ddiloco.protocol.client import StreamClosed, get_status
from ddiloco.protocol.credentials import Credentials, bearer_metadata
from ddiloco.synchronizer import server as server_module
from tests.scripted import ScriptedLearner, eventually, running_server, sync_config

NOW = dt.datetime.now(dt.UTC)


@pytest.fixture
def pki(tmp_path):
    """A CA, a server certificate for 127.0.0.1 and client certificates a, b, group, ops."""
    ca = tmp_path / "ca"
    certs.init_ca(ca)
    out = tmp_path / "certs"
    certs.issue(ca, out, "server", kind="server", hosts=("127.0.0.1", "localhost"))
    for name in ("a", "b", "group", "ops"):
        certs.issue(ca, out, name, kind="client")
    return tmp_path


def tls_config(tmp_path, pki, *, mutual: bool = True, **kw):
    c = pki / "certs"
    return sync_config(tmp_path / "state", tls_cert=str(c / "server.pem"), tls_key=str(c / "server.key"),
                       tls_client_ca=str(pki / "ca" / "ca.pem") if mutual else None, **kw)


def client(pki, name: str | None, *, ca=None, token: str | None = None) -> Credentials:
    c = pki / "certs"
    return Credentials(tls_ca=str(ca or pki / "ca" / "ca.pem"), token=token,
                       tls_cert=str(c / f"{name}.pem") if name else None,
                       tls_key=str(c / f"{name}.key") if name else None)


async def _connect(port: int, learner_id: str, creds: Credentials | None, token: str | None = None):
    learner = ScriptedLearner(port, learner_id, credentials=creds, token=token)
    try:
        return await learner.connect()
    finally:
        await learner.close()


async def _refused(port: int, learner_id: str, creds: Credentials | None, token: str | None = None):
    with pytest.raises(StreamClosed) as info:
        await _connect(port, learner_id, creds, token)
    return info.value.code


async def test_server_tls_verifies_the_synchronizer(tmp_path, pki):
    other = tmp_path / "other-ca"
    certs.init_ca(other)
    c = pki / "certs"
    certs.issue(pki / "ca", c, "elsewhere", kind="server", hosts=("other.example",))
    certs.issue(pki / "ca", c, "old", kind="server", hosts=("127.0.0.1",),
                not_before=NOW - dt.timedelta(days=30), not_after=NOW - dt.timedelta(days=1))
    async with running_server(tls_config(tmp_path, pki, mutual=False)) as server:
        assert (await _connect(server.port, "a", client(pki, None))).state == "genesis_requested"
        assert await _refused(server.port, "a", client(pki, None, ca=other / "ca.pem")) == grpc.StatusCode.UNAVAILABLE
        assert await _refused(server.port, "a", None) == grpc.StatusCode.UNAVAILABLE  # plaintext to a TLS port
    for name in ("elsewhere", "old"):  # a certificate for another host; an expired one
        cfg = sync_config(tmp_path / name, tls_cert=str(c / f"{name}.pem"), tls_key=str(c / f"{name}.key"))
        async with running_server(cfg) as server:
            assert await _refused(server.port, "a", client(pki, None)) == grpc.StatusCode.UNAVAILABLE


async def test_mutual_tls_binds_the_learner_id_to_the_certificate(tmp_path, pki):
    other = tmp_path / "other-ca"
    certs.init_ca(other)
    certs.issue(other, other, "a", kind="client")
    certs.issue(pki / "ca", pki / "certs", "late", kind="client",
                not_before=NOW - dt.timedelta(days=30), not_after=NOW - dt.timedelta(days=1))
    async with running_server(tls_config(tmp_path, pki)) as server:
        assert (await _connect(server.port, "a", client(pki, "a"))).state == "genesis_requested"
        assert await _refused(server.port, "b", client(pki, "a")) == grpc.StatusCode.PERMISSION_DENIED
        assert await _refused(server.port, "a", client(pki, None)) == grpc.StatusCode.UNAVAILABLE  # no cert
        foreign = Credentials(tls_ca=str(pki / "ca" / "ca.pem"), tls_cert=str(other / "a.pem"),
                              tls_key=str(other / "a.key"))
        assert await _refused(server.port, "a", foreign) == grpc.StatusCode.UNAVAILABLE
        assert await _refused(server.port, "late", client(pki, "late")) == grpc.StatusCode.UNAVAILABLE
        assert server.engine.membership.learners.keys() == {"a"}
        assert server.engine.metrics.auth_refusals.labels(reason="identity")._value.get() == 1


async def test_prefix_binding_lets_one_certificate_serve_a_deployment(tmp_path, pki):
    async with running_server(tls_config(tmp_path, pki, identity_binding="prefix")) as server:
        assert (await _connect(server.port, "group-7d9f8-x2k94", client(pki, "group"))).state
        assert (await _connect(server.port, "group", client(pki, "group"))).state
        for lid in ("groupie", "a", "x-group-1"):
            assert await _refused(server.port, lid, client(pki, "group")) == grpc.StatusCode.PERMISSION_DENIED


async def test_rotation_without_restart_revokes_the_old_ca(tmp_path, pki):
    async with running_server(tls_config(tmp_path, pki)) as server:
        assert (await _connect(server.port, "a", client(pki, "a"))).state
        # A new CA replaces the old one: new server certificate, new client CA, new learner cert.
        new = tmp_path / "new"
        certs.init_ca(new / "ca")
        certs.issue(new / "ca", new / "certs", "server", kind="server", hosts=("127.0.0.1",))
        certs.issue(new / "ca", new / "certs", "a", kind="client")
        old_stamp = os.stat(pki / "certs" / "server.pem").st_mtime_ns
        for src, dst in ((new / "certs" / "server.key", pki / "certs" / "server.key"),
                         (new / "certs" / "server.pem", pki / "certs" / "server.pem"),
                         (new / "ca" / "ca.pem", pki / "ca" / "ca.pem.new")):
            shutil.copy(src, dst)
        os.replace(pki / "ca" / "ca.pem.new", pki / "ca" / "ca.pem")
        assert os.stat(pki / "certs" / "server.pem").st_mtime_ns != old_stamp
        old_learner = Credentials(tls_ca=str(new / "ca" / "ca.pem"), tls_cert=str(pki / "certs" / "a.pem"),
                                  tls_key=str(pki / "certs" / "a.key"))
        assert await _refused(server.port, "a", old_learner) == grpc.StatusCode.UNAVAILABLE
        new_learner = Credentials(tls_ca=str(new / "ca" / "ca.pem"), tls_cert=str(new / "certs" / "a.pem"),
                                  tls_key=str(new / "certs" / "a.key"))
        assert (await _connect(server.port, "a", new_learner)).state
        assert server.certificates.reloads == 1


async def test_a_half_rotated_key_keeps_the_old_certificate_in_force(tmp_path, pki):
    async with running_server(tls_config(tmp_path, pki, mutual=False)) as server:
        certs.issue(pki / "ca", tmp_path / "next", "server", kind="server", hosts=("127.0.0.1",))
        shutil.copy(tmp_path / "next" / "server.key", pki / "certs" / "server.key")  # the cert comes later
        assert (await _connect(server.port, "a", client(pki, None))).state  # still the old pair
        assert server.certificates.reloads == 0
        shutil.copy(tmp_path / "next" / "server.pem", pki / "certs" / "server.pem")
        assert (await _connect(server.port, "a", client(pki, None))).state
        assert server.certificates.reloads == 1


async def test_tokens_file_is_reread_and_a_broken_one_keeps_the_old_tokens(tmp_path):
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text("a: token-of-learner-a-0001\n")
    async with running_server(sync_config(tmp_path / "state", auth_tokens_file=str(tokens))) as server:
        assert (await _connect(server.port, "a", None, token="token-of-learner-a-0001")).state
        tokens.write_text("a: token-of-learner-a-0002\nb: token-of-learner-b-0001\n")
        assert await _refused(server.port, "a", None, token="token-of-learner-a-0001") == \
            grpc.StatusCode.UNAUTHENTICATED
        assert (await _connect(server.port, "a", None, token="token-of-learner-a-0002")).state
        assert (await _connect(server.port, "b", None, token="token-of-learner-b-0001")).state
        tokens.write_text("a: short\n")  # refused on reload: the previous table stays
        assert (await _connect(server.port, "a", None, token="token-of-learner-a-0002")).state
        assert await _refused(server.port, "a", None, token="short") == grpc.StatusCode.UNAUTHENTICATED


def _refusals(server) -> float:
    return server.engine.metrics.auth_refusals.labels(reason="unknown_token")._value.get()


async def test_a_refused_sync_stream_ends_only_after_its_first_message(tmp_path, monkeypatch):
    """Ended at once, the stream could close under the client's first write, and grpcio's asyncio
    client then reports INTERNAL (the failed write) instead of UNAUTHENTICATED."""
    monkeypatch.setattr(server_module, "DENY_READ_S", 60.0)  # no bound within reach of a slow machine
    cfg = sync_config(tmp_path / "state", auth_tokens={"a": "token-of-learner-a-0001"})
    async with running_server(cfg) as server:
        learner = ScriptedLearner(server.port, "a")
        try:
            call = wire.SynchronizerStub(learner.channel).Sync(metadata=bearer_metadata("token-of-learner-a-0009"))
            await eventually(lambda: _refusals(server) == 1, what="the refusal")
            await asyncio.sleep(0.3)
            assert not call.done()  # the refusal waits for the Hello
            await call.write(wire.learner_message_to_pb(learner.hello()))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call.read()
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        finally:
            await learner.close()


async def test_a_refused_sync_stream_that_never_writes_is_refused_after_a_bound(tmp_path, monkeypatch):
    assert server_module.DENY_READ_S >= 2.0
    monkeypatch.setattr(server_module, "DENY_READ_S", 0.3)
    cfg = sync_config(tmp_path / "state", auth_tokens={"a": "token-of-learner-a-0001"})
    async with running_server(cfg) as server:
        learner = ScriptedLearner(server.port, "a")
        try:
            began = time.monotonic()
            call = wire.SynchronizerStub(learner.channel).Sync(metadata=bearer_metadata("token-of-learner-a-0009"))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await asyncio.wait_for(call.read(), 30)
            took = time.monotonic() - began
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert 0.3 <= took < 2.0  # the bound as set here, not the default
            assert _refusals(server) == 1
            assert server.interceptor.waiting == 0
        finally:
            await learner.close()


async def test_refused_sync_streams_wait_for_their_first_message_up_to_a_number_then_are_refused_at_once(
        tmp_path, monkeypatch):
    monkeypatch.setattr(server_module, "DENY_READ_S", 60.0)
    monkeypatch.setattr(server_module, "DENY_WAITING", 1)
    cfg = sync_config(tmp_path / "state", auth_tokens={"a": "token-of-learner-a-0001"})
    async with running_server(cfg) as server:
        learner = ScriptedLearner(server.port, "a")
        try:
            stub = wire.SynchronizerStub(learner.channel)
            bad = bearer_metadata("token-of-learner-a-0009")
            first = stub.Sync(metadata=bad)
            await eventually(lambda: server.interceptor.waiting == 1, what="the first refused stream waiting")
            second = stub.Sync(metadata=bad)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await asyncio.wait_for(second.read(), 30)  # long before the first one's 60 s
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert not first.done()
            await first.done_writing()  # the client closes its side: refused without waiting longer
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await asyncio.wait_for(first.read(), 30)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            await eventually(lambda: server.interceptor.waiting == 0, what="no refused stream waiting")
            assert _refusals(server) == 2
        finally:
            await learner.close()


@pytest.mark.parametrize("content, message", [
    ("a: short\n", "at least 16"),
    ("a: same-token-for-two-ids\nb: same-token-for-two-ids\n", "share a token"),
    ("- just\n- a list\n", "mapping"),
])
def test_bad_tokens_file_refuses_to_start(tmp_path, content, message):
    from ddiloco.synchronizer.server import SynchronizerServer

    tokens = tmp_path / "tokens.yaml"
    tokens.write_text(content)
    with pytest.raises(ValueError, match=message):
        SynchronizerServer(sync_config(tmp_path / "state", auth_tokens_file=str(tokens)))
    assert not (tmp_path / "state").exists()


async def test_status_limited_to_operators_and_token_and_certificate_must_agree(tmp_path, pki):
    tokens = {"a": "token-of-learner-a-0001", "b": "token-of-learner-b-0001", "ops": "token-of-operator-0001"}
    async with running_server(tls_config(tmp_path, pki, operators=("ops",), auth_tokens=tokens)) as server:
        target = f"127.0.0.1:{server.port}"
        assert (await get_status(target, credentials=client(pki, "ops", token=tokens["ops"]))).synchronizer_id
        for name in ("a", "ops"):  # a learner's credentials; an operator's certificate without its token
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await get_status(target, credentials=client(pki, name, token=tokens["a"]))
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await get_status(target, credentials=client(pki, "ops"))  # no token at all
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert await _refused(server.port, "ops", client(pki, "ops", token=tokens["ops"])) == \
            grpc.StatusCode.PERMISSION_DENIED  # an operator may not train
        assert await _refused(server.port, "a", client(pki, "a", token=tokens["b"])) == \
            grpc.StatusCode.PERMISSION_DENIED  # the token says b, the certificate says a
        assert (await _connect(server.port, "a", client(pki, "a", token=tokens["a"]))).state
