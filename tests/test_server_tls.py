"""`mirror-sd serve --ssl-certfile ...` (serve/tls.py): HTTPS with certificates made here by openssl, client
certificates where asked for, and the files checked before the bundle loads."""

from __future__ import annotations

import http.client
import json
import shutil
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mirror_sd.cli import main
from mirror_sd.runtime.pipeline import Pipeline
from mirror_sd.version import __version__

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="the test makes its certificates with openssl")


def _certificate(folder: Path, name: str, ca: tuple[Path, Path] | None = None) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key: self-signed, or signed by `ca` (its certificate and key)."""
    cert, key = folder / f"{name}.pem", folder / f"{name}-key.pem"
    if ca is None:
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
                        "-days", "2", "-subj", f"/CN={name}", "-addext", "subjectAltName=IP:127.0.0.1"],
                       check=True, capture_output=True)
    else:
        request = folder / f"{name}.csr"
        subprocess.run(["openssl", "req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", request, "-subj",
                        f"/CN={name}"], check=True, capture_output=True)
        subprocess.run(["openssl", "x509", "-req", "-in", request, "-CA", ca[0], "-CAkey", ca[1],
                        "-CAcreateserial", "-out", cert, "-days", "2"], check=True, capture_output=True)
    return cert, key


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serving(bundle: Path, port: int, *flags: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "mirror_sd.cli", "serve", str(bundle), "--port", str(port),
                             "--model-name", "tiny", "--log-level", "warning", *flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _post(port: int, context: ssl.SSLContext) -> tuple[int, dict]:
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"model": "tiny", "prompt": "the cat", "max_tokens": 6,
                                                        "temperature": 0}), {"Content-Type": "application/json"})
    r = conn.getresponse()
    status, body = r.status, json.loads(r.read())
    conn.close()
    return status, body


def _wait_up(port: int, server: subprocess.Popen, context: ssl.SSLContext) -> None:
    end = time.monotonic() + 120
    while time.monotonic() < end:
        assert server.poll() is None, server.stderr.read()
        try:
            conn = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except (OSError, ssl.SSLError):
            time.sleep(0.2)
    pytest.fail("mirror-sd serve did not come up")


def test_https_answers_as_the_library_and_plain_http_is_not_served(bundle_factory, tmp_path):
    bundle = bundle_factory("llama")
    cert, key = _certificate(tmp_path, "server")
    port = _free_port()
    server = _serving(bundle, port, "--ssl-certfile", str(cert), "--ssl-keyfile", str(key))
    try:
        trusting = ssl.create_default_context(cafile=str(cert))
        _wait_up(port, server, trusting)
        status, body = _post(port, trusting)
        pipe = Pipeline.load(bundle, huge_pages=False)
        try:
            assert status == 200 and body["choices"][0]["text"] == pipe.generate("the cat", mode="ar",
                                                                                   max_new_tokens=6).text
        finally:
            pipe.close()
        conn = http.client.HTTPSConnection("127.0.0.1", port, context=trusting, timeout=10)
        conn.request("GET", "/version")  # vLLM's route
        assert json.loads(conn.getresponse().read()) == {"version": __version__}
        with pytest.raises(ssl.SSLCertVerificationError):  # a client that does not trust the certificate
            _post(port, ssl.create_default_context())
        plain = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        with pytest.raises((http.client.HTTPException, ConnectionError)):
            plain.request("GET", "/health")
            plain.getresponse().read()
        pooled = http.client.HTTPSConnection("127.0.0.1", port, context=trusting, timeout=10)
        pooled.request("GET", "/health")
        pooled.getresponse().read()  # and kept open, idle, as a client's connection pool keeps it
    finally:
        server.terminate()
        assert server.wait(30) == 0
    # the idle connection was dropped at exit, not waited on until uvicorn's graceful timeout gave up on it
    assert "timeout graceful shutdown exceeded" not in server.stderr.read()


def test_client_certificates_from_the_given_authority_are_required_where_asked(bundle_factory, tmp_path):
    ca = _certificate(tmp_path, "ca")
    cert, key = _certificate(tmp_path, "server")
    client_cert, client_key = _certificate(tmp_path, "client", ca=ca)
    stranger_cert, stranger_key = _certificate(tmp_path, "stranger")
    port = _free_port()
    server = _serving(bundle_factory("llama"), port, "--ssl-certfile", str(cert), "--ssl-keyfile", str(key),
                      "--ssl-ca-certs", str(ca[0]), "--ssl-cert-reqs", "2")
    try:
        def client(cert_and_key: tuple[Path, Path] | None) -> ssl.SSLContext:
            context = ssl.create_default_context(cafile=str(cert))
            if cert_and_key is not None:
                context.load_cert_chain(*map(str, cert_and_key))
            return context

        _wait_up(port, server, client((client_cert, client_key)))
        assert _post(port, client((client_cert, client_key)))[0] == 200
        for refused in (None, (stranger_cert, stranger_key)):  # none, or one no given authority signed
            with pytest.raises((ssl.SSLError, ConnectionError)):
                _post(port, client(refused))
    finally:
        server.terminate()
        server.wait(30)


def test_tls_files_are_checked_before_the_bundle_loads(tmp_path, capsys, monkeypatch):
    cert, key = _certificate(tmp_path, "server")
    _, other_key = _certificate(tmp_path, "other")
    encrypted = tmp_path / "encrypted-key.pem"
    subprocess.run(["openssl", "pkey", "-in", key, "-out", encrypted, "-aes256", "-passout", "pass:secret"],
                   check=True, capture_output=True)
    loads = []
    monkeypatch.setattr(Pipeline, "load", lambda *args, **kwargs: loads.append(args))
    for flags, why in [
        (["--ssl-certfile", str(tmp_path / "missing.pem")], "--ssl-certfile"),
        (["--ssl-certfile", str(tmp_path)], "a directory, not a file"),
        (["--ssl-certfile", str(key), "--ssl-keyfile", str(key)], "--ssl-certfile"),  # swapped: no certificate
        (["--ssl-certfile", str(cert), "--ssl-keyfile", str(other_key)], "the key is not the certificate's"),
        (["--ssl-certfile", str(cert), "--ssl-keyfile", str(encrypted)], "--ssl-keyfile"),
        (["--ssl-certfile", str(cert), "--ssl-keyfile", str(encrypted)], "the private key is encrypted"),
        (["--ssl-certfile", str(cert)], "no PEM private key in it"),  # a certificate alone, no key in it
        (["--ssl-certfile", str(cert), "--ssl-keyfile", str(key), "--ssl-ca-certs", str(cert)],
         "--ssl-ca-certs asks for nothing without --ssl-cert-reqs"),
        (["--ssl-keyfile", str(key)], "--ssl-keyfile: only with --ssl-certfile"),
        (["--ssl-certfile", str(cert), "--ssl-keyfile", str(key), "--ssl-cert-reqs", "2"], "needs --ssl-ca-certs"),
        (["--ssl-certfile", str(cert), "--ssl-keyfile", str(key), "--ssl-cert-reqs", "3"], "must be 0 (none)"),
        (["--ssl-certfile", str(cert), "--ssl-keyfile", str(key), "--ray"], "not with --ray"),
    ]:
        assert main(["serve", str(tmp_path / "bundle"), "--port", str(_free_port()), *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith("mirror-sd: error: ") and why in err and err.count("\n") == 1, (flags, err)
    assert loads == []
