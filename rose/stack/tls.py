"""A throw-away certificate authority and a server certificate for 127.0.0.1/localhost, made with
openssl, for the Kafka broker's TLS listener that tests secured client configs against."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from rose.stack.errors import StackError


def ensure_local_tls(d: Path) -> bool:
    """A throw-away CA and a server certificate for 127.0.0.1/localhost (openssl), for the
    TLS listener that tests secured client configs; False (no TLS listener) without openssl."""
    if (d / "server.pem").exists() and (d / "ca.pem").exists():
        return True
    if not shutil.which("openssl"):
        return False
    d.mkdir(parents=True, exist_ok=True)
    ext = d / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    steps = [
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "3650",
            "-subj",
            "/CN=rose-local-ca",
            "-keyout",
            str(d / "ca.key"),
            "-out",
            str(d / "ca.pem"),
        ],
        [
            "openssl",
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            "/CN=localhost",
            "-keyout",
            str(d / "server.key"),
            "-out",
            str(d / "server.csr"),
        ],
        [
            "openssl",
            "x509",
            "-req",
            "-in",
            str(d / "server.csr"),
            "-CA",
            str(d / "ca.pem"),
            "-CAkey",
            str(d / "ca.key"),
            "-CAcreateserial",
            "-days",
            "3650",
            "-extfile",
            str(ext),
            "-out",
            str(d / "server.crt"),
        ],
    ]
    for cmd in steps:
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise StackError(f"openssl failed making the local TLS certificate: {r.stderr[-500:]}")
    # Kafka's PEM keystore: the PKCS#8 private key followed by the certificate chain
    (d / "server.pem").write_text(
        (d / "server.key").read_text() + (d / "server.crt").read_text() + (d / "ca.pem").read_text()
    )
    return True
