"""HTTPS for `mirror-sd serve`, under vLLM's flags: `--ssl-certfile` (and `--ssl-keyfile` where the key is a file of its
own), `--ssl-ca-certs` and `--ssl-cert-reqs` for clients that prove who they are with certificates of their own.

    tls = Tls.given(certfile, keyfile, ca_certs, cert_reqs)   # None without a certificate; checked at once
    uvicorn.Config(app, **tls.uvicorn_options())

The files are read and checked before the bundle loads (a wrong path, a key that does not match its certificate, an
encrypted key: one error line), as the socket is bound first: nothing fails only after a minute's load.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mirror_sd.errors import BadInputError

CERT_REQS = {0: ssl.CERT_NONE, 1: ssl.CERT_OPTIONAL, 2: ssl.CERT_REQUIRED}  # the ssl module's numbers, as vLLM's flag


@dataclass(frozen=True)
class Tls:
    certfile: str  # PEM: the server's certificate chain, and its key unless keyfile is given
    keyfile: str | None = None
    ca_certs: str | None = None  # PEM: the authorities whose client certificates are taken
    cert_reqs: int = 0  # 0: no client certificate asked for, 1: checked where one is sent, 2: required

    @classmethod
    def given(cls, certfile: str | None, keyfile: str | None = None, ca_certs: str | None = None,
              cert_reqs: int | None = None) -> Tls | None:
        """The TLS settings the flags ask for (None: plain HTTP), checked now: BadInputError naming the flag."""
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
        tls = cls(certfile, keyfile, ca_certs, cert_reqs or 0)
        tls.context()
        return tls

    def context(self) -> ssl.SSLContext:
        """The server's context from the files, as uvicorn builds it; BadInputError where one cannot be."""
        for flag, path in (("--ssl-certfile", self.certfile), ("--ssl-keyfile", self.keyfile),
                           ("--ssl-ca-certs", self.ca_certs)):
            if path is not None and not Path(path).is_file():
                raise BadInputError(f"{flag} {path!r}: no such file")
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            # a password of b"": an encrypted key fails here rather than prompting on the terminal at start-up
            context.load_cert_chain(self.certfile, self.keyfile, password=b"")
        except (OSError, ssl.SSLError) as e:
            files = f"--ssl-certfile {self.certfile!r}" + (f" / --ssl-keyfile {self.keyfile!r}" if self.keyfile else "")
            why = "the key is not the certificate's" if getattr(e, "reason", None) == "KEY_VALUES_MISMATCH" else \
                "not a PEM certificate chain and its private key, unencrypted"
            raise BadInputError(f"{files}: {why}") from None
        if self.ca_certs is not None:
            try:
                context.load_verify_locations(cafile=self.ca_certs)
            except (OSError, ssl.SSLError):
                raise BadInputError(f"--ssl-ca-certs {self.ca_certs!r}: not PEM certificates") from None
        context.verify_mode = CERT_REQS[self.cert_reqs]
        return context

    def uvicorn_options(self) -> dict[str, Any]:
        return {"ssl_certfile": self.certfile, "ssl_keyfile": self.keyfile, "ssl_ca_certs": self.ca_certs,
                "ssl_cert_reqs": CERT_REQS[self.cert_reqs]}
