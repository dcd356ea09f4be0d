"""A throw-away PKI for TLS tests, made with the ``openssl`` command-line tool.

``make_pki(folder)`` writes a CA, a server certificate for ``localhost``/``127.0.0.1``/``::1`` signed
by it, a client certificate signed by it, and a "rogue" client certificate signed by a second CA the
server does not trust. Keys are P-256 (fast to make); certificates are valid for two days.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

_OPENSSL_CNF = """\
[req]
distinguished_name = dn
prompt = no
[dn]
CN = accelstats-test
[ca_ext]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign
subjectKeyIdentifier = hash
[server_ext]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature
extendedKeyUsage = serverAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
subjectAltName = DNS:localhost,IP:127.0.0.1,IP:::1
[client_ext]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature
extendedKeyUsage = clientAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
"""


@dataclass(frozen=True)
class Pki:
    """Paths of the PEM files ``make_pki`` wrote (``*_key`` unencrypted PKCS#8)."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_cert: Path
    rogue_key: Path


def _openssl(*args: str, cwd: Path) -> None:
    proc = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)} failed: {proc.stderr.strip()}")


def _ca(folder: Path, name: str) -> None:
    _openssl("req", "-x509", "-config", "openssl.cnf", "-extensions", "ca_ext", "-newkey", "ec",
             "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.pem",
             "-days", "2", "-subj", f"/CN=accelstats test {name}", cwd=folder)


def _leaf(folder: Path, name: str, ca: str, ext: str, serial: int) -> None:
    _openssl("req", "-new", "-config", "openssl.cnf", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
             "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=folder)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
             "-set_serial", str(serial), "-days", "2", "-extfile", "openssl.cnf", "-extensions", ext,
             "-out", f"{name}.pem", cwd=folder)


def openssl_missing() -> str | None:
    """Why the PKI cannot be made here (no ``openssl`` on PATH), or None."""
    return None if shutil.which("openssl") else "the openssl command is not installed (Debian: openssl)"


def make_pki(folder: Path) -> Pki:
    """Write the PKI into ``folder`` (created). Raises RuntimeError with openssl's message on failure."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "openssl.cnf").write_text(_OPENSSL_CNF)
    _ca(folder, "ca")
    _ca(folder, "rogue-ca")
    _leaf(folder, "server", "ca", "server_ext", 2)
    _leaf(folder, "client", "ca", "client_ext", 3)
    _leaf(folder, "rogue", "rogue-ca", "client_ext", 4)
    return Pki(ca=folder / "ca.pem", server_cert=folder / "server.pem", server_key=folder / "server.key",
               client_cert=folder / "client.pem", client_key=folder / "client.key",
               rogue_cert=folder / "rogue.pem", rogue_key=folder / "rogue.key")
