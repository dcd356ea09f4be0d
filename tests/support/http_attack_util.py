"""Hostile and careful HTTP clients for tests/web/test_http_hardening.py.

* raw requests over sockets (:func:`exchange`, :func:`split_responses`): what ``http.client`` hides
  (a body after HEAD, pipelining, who closed first);
* :func:`closed_within` and :func:`trickle`: wait for the server to close a connection, as an event,
  while sending nothing or one byte at a time;
* :func:`client_hello`: the first flight of a real TLS client, to stall a handshake with;
* :func:`serve_process`: ``python3 -m accelstats serve`` as a child with a chosen ``RLIMIT_NOFILE``
  (systemd's default soft limit is 1024), and :func:`proc_threads` / :func:`proc_fds` from ``/proc``.
"""

from __future__ import annotations

import contextlib
import os
import resource
import select
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

import accelstats
from support.faultmatrix_util import wait_healthy
from support.ports import free_port

REPO = Path(accelstats.__file__).resolve().parents[1]  # the checkout this process imports: the child runs it too


def exchange(port: int, request: bytes, timeout: float = 5.0) -> bytes:
    """Send ``request`` on a new connection to 127.0.0.1:``port``, then read until the server closes
    it; raises TimeoutError when it does not within ``timeout`` seconds."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(request)
        return read_until_closed(sock, timeout)


def read_until_closed(sock: socket.socket, timeout: float) -> bytes:
    """Everything ``sock`` receives until EOF; TimeoutError after ``timeout`` seconds in all."""
    end = time.monotonic() + timeout
    data = bytearray()
    while True:
        left = end - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"connection still open after {timeout}s; received {bytes(data[:200])!r}")
        sock.settimeout(left)
        chunk = sock.recv(65536)
        if not chunk:
            return bytes(data)
        data += chunk


def split_responses(data: bytes, head_only: Sequence[bool] = ()) -> list[tuple[str, dict[str, str], bytes]]:
    """``data`` (one or more HTTP responses back to back) → ``[(status line, headers, body)]``; the body
    is ``Content-Length`` bytes, none for the responses whose ``head_only`` entry is True (answers to
    HEAD), else the rest. Header names are lower-cased."""
    out = []
    i = 0
    while data:
        head, sep, data = data.partition(b"\r\n\r\n")
        assert sep, f"no end of head in {head[:200]!r}"
        status, *lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
        if i < len(head_only) and head_only[i]:
            body = b""
        elif "content-length" in headers:
            n = int(headers["content-length"])
            body, data = data[:n], data[n:]
        else:
            body, data = data, b""
        out.append((status, headers, body))
        i += 1
    return out


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """True when the server closes ``sock`` (EOF or reset) within ``seconds``; what it sends before is
    read and dropped."""
    end = time.monotonic() + seconds
    while True:
        left = end - time.monotonic()
        if left <= 0:
            return False
        readable, _, _ = select.select([sock], [], [], left)
        if readable:
            try:
                if not sock.recv(65536):
                    return True
            except (ConnectionResetError, BrokenPipeError):
                return True


def trickle(sock: socket.socket, data: bytes, every: float, limit: float) -> float | None:
    """Send ``data`` one byte every ``every`` seconds until the server closes the connection: the
    seconds that took, or None when it was still open after ``limit`` seconds. ``sock`` (plain or
    TLS) is made non-blocking: TLS records that carry no data (session tickets) are read and ignored."""
    sock.setblocking(False)
    t0 = time.monotonic()
    sent = 0
    while time.monotonic() - t0 < limit:
        readable, _, _ = select.select([sock], [], [], every)
        if readable:
            try:
                if not sock.recv(65536):
                    return time.monotonic() - t0
                continue
            except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                pass
            except OSError:  # reset, or a TLS connection cut without close_notify
                return time.monotonic() - t0
        if sent < len(data):
            try:
                sent += sock.send(data[sent:sent + 1])
            except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                pass
            except OSError:
                return time.monotonic() - t0
    return None


def client_hello() -> bytes:
    """The ClientHello a Python TLS client sends first (TLS 1.2/1.3, SNI localhost)."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ctx.wrap_bio(incoming, outgoing, server_hostname="localhost")
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def metric(body: str, family: str, **labels: str) -> float | None:
    """The value of the sample of ``family`` (exposition name, ``_total`` included) with ``labels``."""
    for fam in text_string_to_metric_families(body):
        for sample in fam.samples:
            if sample.name == family and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return None


def raise_nofile(wanted: int) -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` to ``wanted`` (at most the hard limit); the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft if soft != resource.RLIM_INFINITY else wanted
    resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return target


def proc_threads(pid: int) -> int:
    """``Threads:`` of ``/proc/<pid>/status``."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError(f"no Threads: line for {pid}")


def proc_fds(pid: int) -> int:
    """Open file descriptors of ``pid`` (entries of ``/proc/<pid>/fd``)."""
    return len(os.listdir(f"/proc/{pid}/fd"))


_EXEC_WITH_NOFILE = (
    "import os, resource, sys\n"
    "hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]\n"
    "resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), hard))\n"
    "os.execv(sys.executable, [sys.executable, '-m', 'accelstats', *sys.argv[2:]])\n")


@contextlib.contextmanager
def serve_process(args: Sequence[str], log: Path, nofile: int, timeout: float = 60.0
                  ) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """``python3 -m accelstats serve --listen 127.0.0.1:<port> *args`` (the checkout this process
    imports ``accelstats`` from) with soft ``RLIMIT_NOFILE`` ``nofile``, output to ``log``, until ``/healthz``
    answers; yields (process, port); SIGTERM (then SIGKILL after 10 s) at the end."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    # The limit is set by a small Python that then execs the server, not by ``preexec_fn``: a fork with
    # ``preexec_fn`` runs gRPC's fork handlers, and while another test of this worker holds a live gRPC
    # channel or server (the kubelet and Nomad tests) grpcio 1.80+ aborts the child before its exec
    # ("epoll_wait error: Bad file descriptor", grpc/grpc#43055; seen here 5 in 300 forks with 1.85.3).
    # Without ``preexec_fn`` CPython spawns with vfork, which runs no fork handlers.
    cmd = [sys.executable, "-c", _EXEC_WITH_NOFILE, str(nofile),
           "serve", "--listen", f"127.0.0.1:{port}", *args]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_healthy(proc, port, log, timeout)
        yield proc, port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
