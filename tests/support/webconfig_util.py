"""Helpers for tests/web/test_webconfig_hardening.py: HTTP(S) requests from a chosen source address, the
certificate a TLS server presents, a file rewritten in place the way ``printf ... > web.yml`` does,
certificates with chosen validity dates, and a password-guessing flood run in its own process
(``python3 tests/support/webconfig_util.py flood ...``), so that its client threads do not share the server's GIL.
"""

from __future__ import annotations

import base64
import http.client
import ipaddress
import itertools
import secrets
import socket
import ssl
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path


def basic(user: str, password: str) -> str:
    """The ``Authorization`` header value for ``user``/``password`` (RFC 7617)."""
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def fetch(port: int, ctx: ssl.SSLContext | None, path: str = "/metrics", auth: tuple[str, str] | None = None,
          source: str = "127.0.0.1", timeout: float = 10.0) -> tuple[int, dict[str, str], str]:
    """(status, headers, body) of one GET to 127.0.0.1:``port`` from ``source`` (any 127/8 address on
    Linux); HTTPS when ``ctx`` is given. Raises OSError (ssl errors, timeouts) as http.client does."""
    conn = (http.client.HTTPSConnection("127.0.0.1", port, timeout=timeout, source_address=(source, 0), context=ctx)
            if ctx is not None else
            http.client.HTTPConnection("127.0.0.1", port, timeout=timeout, source_address=(source, 0)))
    headers = {"Authorization": basic(*auth)} if auth is not None else {}
    try:
        conn.request("GET", path, headers=headers)
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read().decode()
    finally:
        conn.close()


def peer_certificate(port: int, ctx: ssl.SSLContext, timeout: float = 10.0) -> bytes:
    """The DER of the certificate the TLS server on 127.0.0.1:``port`` presents (handshake only)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as raw, \
            ctx.wrap_socket(raw, server_hostname="localhost") as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return der


def rewrite_in_place(path: Path, chunks: list[str], between: Callable[[], None]) -> None:
    """Rewrite ``path`` as a shell's ``>`` does: truncate the same inode, then write ``chunks`` one by
    one, calling ``between()`` after the truncation and after each chunk (all flushed to the file)."""
    with path.open("w") as f:
        between()
        for chunk in chunks:
            f.write(chunk)
            f.flush()
            between()


_CA_CNF = """\
[ca]
default_ca = ca_default
[ca_default]
dir = .
database = index.txt
new_certs_dir = .
serial = serial
default_md = sha256
policy = policy_any
unique_subject = no
[policy_any]
commonName = supplied
[req]
distinguished_name = dn
prompt = no
[dn]
CN = localhost
"""


def dated_certificate(folder: Path, name: str, start: str, end: str) -> tuple[Path, Path]:
    """A self-signed P-256 certificate and its key, valid from ``start`` to ``end`` (openssl ca's
    ``YYYYMMDDHHMMSSZ``), written as ``folder/name.pem`` and ``folder/name.key``: ``openssl req``
    cannot set dates in the past, ``openssl ca -selfsign -startdate -enddate`` can."""
    work = folder / f"{name}.ca"
    work.mkdir(parents=True)
    (work / "ca.cnf").write_text(_CA_CNF)
    (work / "index.txt").write_text("")
    (work / "serial").write_text("01\n")

    def openssl(*args: str) -> None:
        proc = subprocess.run(["openssl", *args], cwd=work, capture_output=True, text=True, timeout=60, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"openssl {' '.join(args)} failed: {proc.stderr.strip()}")

    key, cert = folder / f"{name}.key", folder / f"{name}.pem"
    openssl("req", "-new", "-config", "ca.cnf", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
            "-keyout", str(key), "-out", "req.csr")
    openssl("ca", "-batch", "-config", "ca.cnf", "-selfsign", "-keyfile", str(key), "-in", "req.csr",
            "-out", str(cert), "-startdate", start, "-enddate", end, "-notext")
    return cert, key


SCRAPER = "127.0.0.1"  # the tests' legitimate client: never a flood's source (:func:`flood_sources`)


def flood_sources(spec: str) -> Callable[[], str]:
    """The source addresses of a flood, one per call (thread-safe), from ``spec``:

    * ``A.B.C.D``: that address every time;
    * ``NET/LEN``: a fresh address of that IPv4 network per call (a walk with a stride of 65 537 + 256
      from a random start: a new /24 each call, a new /16 each call too in a /8; fresh until the
      network's size is used up);
    * ``NET/LEN*N``: the first ``N`` addresses of the network, in turn.

    :data:`SCRAPER` is always skipped. Raises ValueError for anything else."""
    if "/" not in spec:
        address = str(ipaddress.IPv4Address(spec))
        return lambda: address
    net_text, _, count = spec.partition("*")
    net = ipaddress.IPv4Network(net_text)
    skip = {SCRAPER, str(net.network_address)}
    if count:
        every = (str(net.network_address + i) for i in range(net.num_addresses))
        pool = [a for a in every if a not in skip][:int(count)]
        if len(pool) < int(count):
            raise ValueError(f"{net} has fewer than {count} addresses")
        turn = itertools.cycle(pool)
        return lambda: next(turn)
    size, base, lock = net.num_addresses, int(net.network_address), threading.Lock()
    step = itertools.count(secrets.randbelow(size))

    def fresh() -> str:
        while True:
            with lock:
                address = str(ipaddress.IPv4Address(base + (next(step) * (65537 + 256)) % size))
            if address not in skip:
                return address
    return fresh


class Flood:
    """``clients`` threads in a child process, each sending GET /metrics with basic auth for ``user``
    and a fresh random password, from ``source`` (an address, or a rotation: :func:`flood_sources`),
    one request at a time, until :meth:`stop`; over TLS (a handshake per request) when ``cafile``, the CA
    to trust for ``localhost``, is given. ``responses`` counts the answers seen so far (by status)."""

    def __init__(self, port: int, source: str, clients: int, user: str, cafile: str = "") -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, "flood", str(port), source, str(clients), user,
                                      cafile], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.responses: dict[str, int] = {}
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self.responses[line.strip()] = self.responses.get(line.strip(), 0) + 1
                self._cond.notify_all()

    def wait_answers(self, count: int, timeout: float, status: str | None = None) -> bool:
        """Wait until the flood got ``count`` answers (with ``status``, e.g. ``"503"``; None: any); False
        on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: (sum(self.responses.values()) if status is None
                                                else self.responses.get(status, 0)) >= count, timeout)

    def stop(self) -> None:
        """Kill the child and wait for it (its connections are closed with it)."""
        self.proc.kill()
        self.proc.wait(timeout=30)
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self._reader.join(timeout=10)


def _flood_main(port: int, source: str, clients: int, user: str, cafile: str) -> None:
    stop = threading.Event()
    out = threading.Lock()
    sources = flood_sources(source)
    ctx = ssl.create_default_context(cafile=cafile) if cafile else None

    def client() -> None:
        while not stop.is_set():
            request = (f"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
                       f"Authorization: {basic(user, secrets.token_urlsafe(12))}\r\n\r\n").encode()
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=30, source_address=(sources(), 0)) as raw, \
                        (ctx.wrap_socket(raw, server_hostname="localhost") if ctx else raw) as sock:
                    sock.sendall(request)
                    data = b""
                    while chunk := sock.recv(4096):
                        data += chunk
                status = data.split(b" ", 2)[1].decode() if data.startswith(b"HTTP/") else "none"
            except OSError:
                status = "error"
            with out:
                print(status, flush=True)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    sys.stdin.read()  # until the parent closes it or dies
    stop.set()


if __name__ == "__main__" and sys.argv[1:2] == ["flood"]:
    _flood_main(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5], sys.argv[6] if sys.argv[6:] else "")
