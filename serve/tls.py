"""HTTPS for `mirror-sd serve`, under vLLM's flags: `--ssl-certfile` (and `--ssl-keyfile` where the key is a file of its
own), `--ssl-ca-certs` with `--ssl-cert-reqs` for clients that prove who they are with certificates of their own.

    context = server_context(certfile, keyfile, ca_certs, cert_reqs)   # None without a certificate

The files are read once, before the bundle loads (a wrong path, a key that is not the certificate's, an encrypted key:
one error line), and the server serves that context (serve/app.py `serve`): nothing is read again, and so nothing
fails only after a minute's load.
"""

from __future__ import annotations

import ssl
from pathlib import Path

from mirror_sd.errors import BadInputError

CERT_REQS = {0: ssl.CERT_NONE, 1: ssl.CERT_OPTIONAL, 2: ssl.CERT_REQUIRED}  # the ssl module's numbers, as vLLM's flag


def server_context(certfile: str | None, keyfile: str | None = None, ca_certs: str | None = None,
                   cert_reqs: int | None = None) -> ssl.SSLContext | None:
    """The server's TLS context the flags ask for, made now (None: plain HTTP); BadInputError naming the flag at
    fault."""
    if certfile is None:
        stray = [flag for flag, value in (("--ssl-keyfile", keyfile), ("--ssl-ca-certs", ca_certs),
                                          ("--ssl-cert-reqs", cert_reqs)) if value is not None]
        if stray:
            raise BadInputError(f"{', '.join(stray)}: only with --ssl-certfile (the server's certificate)")
        return None
    if cert_reqs is not None and cert_reqs not in CERT_REQS:
        raise BadInputError(f"--ssl-cert-reqs must be 0 (none), 1 (optional) or 2 (required), got {cert_reqs}")
    if cert_reqs and ca_certs is None:
        raise BadInputError("--ssl-cert-reqs 1 or 2 needs --ssl-ca-certs: the authorities client certificates "
                            "are checked against")
    if ca_certs is not None and not cert_reqs:  # vLLM takes it and asks no client for a certificate
        raise BadInputError("--ssl-ca-certs asks for nothing without --ssl-cert-reqs 1 (a client certificate "
                            "checked where sent) or 2 (required)")
    return _context(certfile, keyfile, ca_certs, cert_reqs or 0)


def _context(certfile: str, keyfile: str | None, ca_certs: str | None, cert_reqs: int) -> ssl.SSLContext:
    texts = {flag: _read(flag, path) for flag, path in (("--ssl-certfile", certfile), ("--ssl-keyfile", keyfile),
                                                        ("--ssl-ca-certs", ca_certs)) if path is not None}
    key_flag = "--ssl-keyfile" if keyfile is not None else "--ssl-certfile"
    if "-----BEGIN CERTIFICATE-----" not in texts["--ssl-certfile"]:
        raise BadInputError(f"--ssl-certfile {certfile!r}: no PEM certificate in it")
    key = texts[key_flag]
    if "ENCRYPTED" in key:  # "BEGIN ENCRYPTED PRIVATE KEY", or an old-style "Proc-Type: 4,ENCRYPTED"
        raise BadInputError(f"{key_flag} {keyfile or certfile!r}: the private key is encrypted; give it decrypted "
                            "(openssl pkey -in KEY -out PLAIN)")
    if "PRIVATE KEY-----" not in key:
        raise BadInputError(f"{key_flag} {keyfile or certfile!r}: no PEM private key in it"
                            + ("" if keyfile else " (give it with --ssl-keyfile where it is a file of its own)"))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        # a password of b"": a key encrypted otherwise fails here rather than prompting on the terminal at start-up
        context.load_cert_chain(certfile, keyfile, password=b"")
    except (OSError, ssl.SSLError) as e:
        files = f"--ssl-certfile {certfile!r}" + (f" / --ssl-keyfile {keyfile!r}" if keyfile else "")
        why = ("the key is not the certificate's (the file's first certificate must be the server's own)"
               if getattr(e, "reason", None) == "KEY_VALUES_MISMATCH" else "not a certificate and its private key")
        raise BadInputError(f"{files}: {why}") from None
    if ca_certs is not None:
        try:
            context.load_verify_locations(cafile=ca_certs)
        except (OSError, ssl.SSLError):
            raise BadInputError(f"--ssl-ca-certs {ca_certs!r}: not PEM certificates") from None
    context.verify_mode = CERT_REQS[cert_reqs]
    return context


def _read(flag: str, path: str) -> str:
    if not Path(path).is_file():
        raise BadInputError(f"{flag} {path!r}: {'a directory, not a file' if Path(path).is_dir() else 'no such file'}")
    try:
        return Path(path).read_text(encoding="ascii", errors="replace")  # PEM is ASCII; DER reads as no PEM
    except OSError as e:
        raise BadInputError(f"{flag} {path!r}: cannot read it: {e.strerror or e}") from None
