"""``ddiloco status`` reaches a plaintext, TLS or mutual-TLS synchronizer through the one client.

Real certificates (a CA, a server certificate for 127.0.0.1, a client certificate) are made with
the openssl command line; the synchronizer serves on 127.0.0.1:0 in this process and the CLI runs
as a separate process, as an operator would run it. The token comes from a file or the
environment, never from the command line.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import shutil
import sys

import pytest

from tests.scripted import running_server, sync_config

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command line")


async def _openssl(*args: str, cwd: pathlib.Path) -> None:
    proc = await asyncio.create_subprocess_exec("openssl", *args, cwd=cwd, stdout=asyncio.subprocess.DEVNULL,
                                                stderr=asyncio.subprocess.PIPE)
    _, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()[-2000:]


async def _certificates(d: pathlib.Path) -> None:
    await _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
                   "-days", "2", "-subj", "/CN=ddiloco test CA", cwd=d)
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    for name, subject, ext in (("server", "/CN=127.0.0.1", ["-extfile", "san.cnf"]), ("client", "/CN=operator", [])):
        await _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                       "-subj", subject, cwd=d)
        await _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                       "-out", f"{name}.pem", "-days", "2", *ext, cwd=d)


async def _status(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "ddiloco.core.cli", "status", *args,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                                                env={**os.environ, **(env or {})})
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_status_over_mutual_tls_with_a_token_from_a_file_or_the_environment(tmp_path):
    await _certificates(tmp_path)
    cfg = sync_config(tmp_path / "state", tls_cert=str(tmp_path / "server.pem"), tls_key=str(tmp_path / "server.key"),
                      tls_client_ca=str(tmp_path / "ca.pem"), auth_tokens={"operator": "s3cret-operator-token"})
    (tmp_path / "token").write_text("s3cret-operator-token\n")
    async with running_server(cfg) as server:
        target = f"127.0.0.1:{server.port}"
        tls = ["--tls-ca", str(tmp_path / "ca.pem"), "--tls-cert", str(tmp_path / "client.pem"),
               "--tls-key", str(tmp_path / "client.key")]
        code, out, err = await _status("--synchronizer", target, "--json", *tls, "--token-file", str(tmp_path / "token"))
        assert code == 0, err
        assert json.loads(out)["state"] == "genesis_pending"
        code, out, err = await _status("--synchronizer", target, *tls, env={"DDILOCO_TOKEN": "s3cret-operator-token"})
        assert code == 0 and "state=genesis_pending" in out, err
        code, _, err = await _status("--synchronizer", target, *tls)  # no token
        assert code == 1 and "UNAUTHENTICATED" in err
        code, _, err = await _status("--synchronizer", target, "--tls-ca", str(tmp_path / "ca.pem"),
                                     "--token-file", str(tmp_path / "token"))  # no client certificate
        assert code == 1 and "UNAVAILABLE" in err, err
        code, _, err = await _status("--synchronizer", target, "--token-file", str(tmp_path / "token"))  # plaintext
        assert code == 1 and "UNAVAILABLE" in err, err


async def test_status_refuses_bad_arguments_before_dialling(tmp_path):
    code, _, err = await _status("--synchronizer", "localhost")
    assert code == 2 and "must be HOST:PORT" in err
    code, _, err = await _status("--synchronizer", "127.0.0.1:1", "--token-file", str(tmp_path / "missing"))
    assert code == 2 and "cannot read token file" in err
    code, _, err = await _status("--synchronizer", "127.0.0.1:1", "--tls-cert", str(tmp_path / "c.pem"),
                                 "--tls-key", str(tmp_path / "c.key"))
    assert code == 2 and "needs tls_ca" in err
