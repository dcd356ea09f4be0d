"""The asyncio + h11 server (``accelstats/web/server.py``) where our policy meets the libraries.

* empty lines: h11 refuses any empty line before a request; up to 64 bytes of them are ignored (RFC 9112
  §2.2), also between pipelined requests;
* ``505`` for HTTP/x.y other than 1.0 and 1.1 (h11 takes any); ``431`` past 100 header lines;
* h11's rules, pinned: one request per HTTP/1.0 connection; an HTTP/1.1 request without ``Host`` is a ``400``;
* a request announcing a body is answered and its connection closed: what follows is never taken for a request;
* linger: a client that sends more after a ``Connection: close`` request still reads its whole answer;
* TCP_NODELAY on every accepted socket (asyncio sets it only where the socket's proto is IPPROTO_TCP;
  accept() gives 0);
* connections evicted while asyncio makes their transport or runs their TLS handshake leave no descriptor;
* ``shutdown()`` closes every connection.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import ssl
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.http_attack_util import client_hello, closed_within, exchange, read_until_closed, split_responses
from support.tls_pki import Pki

from accelstats.manager import AcceleratorManager
from accelstats.settings import Settings
from accelstats.web import serve
from accelstats.web.server import MAX_EMPTY_LINE_BYTES, MAX_HEADERS
from accelstats.web.source import WebConfigSource

HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
LAST = b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """Factory: :func:`accelstats.web.serve` on a free loopback port (no collector: these tests never
    collect), with ``web_text`` as its web configuration when given; stopped at teardown."""
    started: list[Any] = []
    manager = AcceleratorManager(Settings(cgroup_root=tmp_path, proc_root=tmp_path, collectors=()))
    manager.setup()

    def _start(web_text: str | None = None) -> Any:
        web = None
        if web_text is not None:
            (tmp_path / "web.yml").write_text(web_text)
            web = WebConfigSource(tmp_path / "web.yml")
        server, _ = serve(manager, "127.0.0.1", 0, web)
        started.append(server)
        return server

    yield _start
    for server in started:
        server.shutdown()
        server.server_close()
    manager.destroy(timeout=0.5)
    manager.close()


def port(server: Any) -> int:
    return int(server.server_address[1])


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def wait_for(condition: Callable[[], bool], seconds: float = 5.0) -> bool:
    end = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def test_empty_lines_before_a_request_are_ignored_up_to_64_bytes(start: Callable[..., Any]) -> None:
    s = start()
    got = split_responses(exchange(port(s), b"\r\n" * 5 + b"\n" + HEALTHZ + b"\r\n\r\n" + LAST))
    assert [(status, body) for status, _, body in got] == [("HTTP/1.1 200 OK", b"ok\n")] * 2
    assert MAX_EMPTY_LINE_BYTES == 64
    at_limit = exchange(port(s), b"\r\n" * 32 + LAST)
    assert at_limit.startswith(b"HTTP/1.1 200 OK\r\n"), at_limit[:80]
    past = exchange(port(s), b"\r\n" * 33 + LAST)
    assert past.startswith(b"HTTP/1.1 400 Bad Request\r\n"), past[:80]
    assert b"Connection: close" in past


@pytest.mark.parametrize("request_line", [b"GET / HTTP/2.0", b"GET / HTTP/1.2", b"GET / HTTP/0.9", b"PRI * HTTP/2.0"])
def test_http_versions_other_than_1_0_and_1_1_get_505(start: Callable[..., Any], request_line: bytes) -> None:
    data = exchange(port(start()), request_line + b"\r\nHost: x\r\n\r\n")
    assert data.startswith(b"HTTP/1.1 505 HTTP Version Not Supported\r\n"), data[:80]


def test_more_than_100_header_lines_get_431(start: Callable[..., Any]) -> None:
    s = start()
    lines = b"".join(b"X-%d: y\r\n" % i for i in range(MAX_HEADERS))  # with Host: one too many
    assert exchange(port(s), b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + lines + b"\r\n").startswith(b"HTTP/1.1 431 ")
    enough = b"".join(b"X-%d: y\r\n" % i for i in range(MAX_HEADERS - 2))
    assert exchange(port(s), b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + enough + b"\r\n"
                    ).startswith(b"HTTP/1.1 200 OK\r\n")


def test_http_1_0_gets_one_request_per_connection_and_1_1_needs_host(start: Callable[..., Any]) -> None:
    s = start()
    data = exchange(port(s), b"GET /healthz HTTP/1.0\r\nConnection: keep-alive\r\n\r\n" + HEALTHZ)
    ((status, headers, body),) = split_responses(data)  # one answer, then the server closed
    assert (status, headers.get("connection"), body) == ("HTTP/1.1 200 OK", "close", b"ok\n")
    assert exchange(port(s), b"GET /healthz HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 400 Bad Request\r\n")


@pytest.mark.parametrize("framing", [b"Content-Length: 5\r\n\r\nabcde", b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"])
def test_a_request_announcing_a_body_is_answered_and_its_connection_closed(
        start: Callable[..., Any], framing: bytes) -> None:
    """What follows the body is never taken for a request (request smuggling needs exactly that)."""
    data = exchange(port(start()), b"POST /healthz HTTP/1.1\r\nHost: x\r\n" + framing + HEALTHZ)
    ((status, headers, _),) = split_responses(data)
    assert (status, headers.get("connection")) == ("HTTP/1.1 405 Method Not Allowed", "close")


def test_an_answer_is_read_whole_by_a_client_that_keeps_sending(start: Callable[..., Any]) -> None:
    """After the last answer the server half-closes and reads what still comes (up to 64 KiB, 2 s)
    before it closes: closing with unread bytes would reset the answer away."""
    s = start()
    with socket.create_connection(("127.0.0.1", port(s)), timeout=5) as sock:
        sock.sendall(LAST + b"x" * 30000)
        ((status, _, body),) = split_responses(read_until_closed(sock, 5.0))
    assert (status, body) == ("HTTP/1.1 200 OK", b"ok\n")


def test_accepted_sockets_have_tcp_nodelay(start: Callable[..., Any]) -> None:
    """Without it an answer written in two parts (head, body) waits for the client's delayed ACK: 40 ms
    per TLS scrape, measured before the fix."""
    s = start()
    with socket.create_connection(("127.0.0.1", port(s)), timeout=5):
        assert wait_for(lambda: s.connections == 1)
        (conn,) = list(s.conns)
        assert conn.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1


@pytest.mark.parametrize("tls", [False, True])
def test_connections_evicted_during_setup_or_handshake_leave_no_descriptor(
        pki: Pki, start: Callable[..., Any], tls: bool) -> None:
    """20 connections at a limit of 5, each stalled where asyncio holds it: plain, while its transport is
    made and its head read; TLS, in the handshake (half a ClientHello), a task asyncio closes when it
    is cancelled. The oldest are evicted; once the clients are gone, so is every descriptor."""
    web = f"tls_server_config:\n  cert_file: {pki.server_cert}\n  key_file: {pki.server_key}\n" if tls else None
    s = start(web)
    s.max_connections = 5
    before = open_fds()
    hello = client_hello()
    clients = []
    for _ in range(20):
        sock = socket.create_connection(("127.0.0.1", port(s)), timeout=5)
        sock.sendall(hello[: len(hello) // 2] if tls else b"GET /healthz HTTP/1.1\r\n")
        clients.append(sock)
    try:
        assert closed_within(clients[0], 2.0), "the oldest stalled connection was kept"
        assert not closed_within(clients[-1], 0.2), "the newest stalled connection was closed"
        assert wait_for(lambda: s.counters.refused["evicted"] >= 15)
    finally:
        for sock in clients:
            sock.close()
    assert wait_for(lambda: s.connections == 0), s.connections
    assert wait_for(lambda: open_fds() <= before), f"{open_fds() - before} descriptors more than before"


def test_shutdown_closes_every_connection(pki: Pki, start: Callable[..., Any]) -> None:
    s = start(f"tls_server_config:\n  cert_file: {pki.server_cert}\n  key_file: {pki.server_key}\n")
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    idle = socket.create_connection(("127.0.0.1", port(s)), timeout=5)
    tls = ctx.wrap_socket(socket.create_connection(("127.0.0.1", port(s)), timeout=5), server_hostname="localhost")
    try:
        assert wait_for(lambda: s.connections == 2)
        s.shutdown()
        assert s.connections == 0
        assert closed_within(idle, 2.0)
        assert closed_within(tls, 2.0)
    finally:
        idle.close()
        tls.close()


def test_a_client_hello_split_in_segments_is_still_served(pki: Pki, start: Callable[..., Any]) -> None:
    """The handshake waits for the whole first TLS record (RFC 8446 §5.1: its length is in the header),
    looking again as the rest comes: a ClientHello sent in three pieces 0.3 s apart completes, and the
    request behind it is answered."""
    s = start(f"tls_server_config:\n  cert_file: {pki.server_cert}\n  key_file: {pki.server_key}\n")
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ctx.wrap_bio(incoming, outgoing, server_hostname="localhost")
    with socket.create_connection(("127.0.0.1", port(s)), timeout=5) as sock:
        with pytest.raises(ssl.SSLWantReadError):
            tls.do_handshake()
        hello = outgoing.read()
        for piece in (hello[:3], hello[3:len(hello) // 2], hello[len(hello) // 2:]):
            sock.sendall(piece)
            time.sleep(0.3)
        while True:
            try:
                tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                sock.sendall(outgoing.read())
                data = sock.recv(65536)
                assert data, "the server closed the connection in the handshake"
                incoming.write(data)
        tls.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        sock.sendall(outgoing.read())
        answer = b""
        while data := sock.recv(65536):  # until the server closes (Connection: close)
            incoming.write(data)
            with contextlib.suppress(ssl.SSLWantReadError, ssl.SSLZeroReturnError):
                while chunk := tls.read(65536):  # every record the bytes so far complete
                    answer += chunk
    assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b"\r\n\r\nok\n"), answer


def test_half_a_client_hello_then_a_close_is_closed_before_its_deadline(pki: Pki, start: Callable[..., Any]) -> None:
    """A client that sends half its first TLS record and closes its side will send no more: the server
    sees the TCP state (tcp(7) TCP_INFO) at its next look and closes, well before the 10 s handshake
    deadline, with no TLS session made for it."""
    s = start(f"tls_server_config:\n  cert_file: {pki.server_cert}\n  key_file: {pki.server_key}\n")
    hello = client_hello()
    sock = socket.create_connection(("127.0.0.1", port(s)), timeout=5)
    try:
        sock.sendall(hello[: len(hello) // 2])
        assert wait_for(lambda: s.connections == 1)
        sock.shutdown(socket.SHUT_WR)
        assert closed_within(sock, 3.0), "the half-closed connection was kept"
        assert wait_for(lambda: s.connections == 0, 3.0)
        assert s.counters.refused["tls_handshake_timeout"] == 0
    finally:
        sock.close()


# -- a client that half-closes after its request (issue 24, row 9) -----------------------------------


@pytest.mark.parametrize("path", ["/healthz", "/metrics", "/nothing"])
def test_a_request_then_a_half_close_is_answered_and_closed(start: Callable[..., Any], path: str) -> None:
    """HTTP/1.1 lets a client close its sending side after its request (``busybox nc``, health checks
    that end stdin): the request is answered, then the connection closed (``Connection: close`` when
    the half-close came before the request started).
    Before: a request whose worker had not started was dropped at the half-close, unanswered."""
    server = start()
    with socket.create_connection(("127.0.0.1", port(server)), timeout=5) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        sock.shutdown(socket.SHUT_WR)
        ((status, _, _),) = split_responses(read_until_closed(sock, 5.0))  # answered, then closed
    assert status.split()[1] == {"/nothing": "404"}.get(path, "200"), status


def test_busybox_nc_gets_its_answer(start: Callable[..., Any]) -> None:
    """``printf 'GET /healthz …' | busybox nc 127.0.0.1 PORT``: nc half-closes when its stdin ends."""
    busybox = shutil.which("busybox")
    if busybox is None:
        pytest.skip("busybox is not installed")
    server = start()
    done = subprocess.run([busybox, "nc", "127.0.0.1", str(port(server))], input=HEALTHZ, capture_output=True,
                          timeout=10, check=False)
    assert done.stdout.startswith(b"HTTP/1.1 200 OK\r\n") and done.stdout.endswith(b"\r\n\r\nok\n"), done
