"""The HTTP server under attack and at the edges of HTTP.

Item 2, slow and idle connections must not lock out scrapes (``accelstats/web/server.py``):

| test | attack | expected |
|---|---|---|
| flood, real ``serve`` | 1100 idle or half-sent connections, RLIMIT_NOFILE 1024 | scrapes 200 in < 3 s; ``evicted`` |
| head deadline | a head trickled one byte per 0.2 s | closed after ``header_timeout``; counted |
| TLS handshake deadline | a ClientHello trickled one byte per 0.2 s | closed after ``handshake_timeout``; counted |
| keep-alive | requests on one connection, then idle | HTTP/1.1; closed after ``max_requests``, ``idle_timeout`` |
| connection limit | twice ``max_connections`` idle | the oldest closed, the scrape served, ``evicted`` |
| every slot busy | ``max_connections`` requests in progress | the newcomer closed at once, ``limit`` |
| threads | 200 idle connections | no thread per connection |
| oversized head | 40 KiB of header | 431 |

Item 9: HEAD has no body on every path; other methods 405 with ``Allow`` and no collection; gzip
follows ``Accept-Encoding`` q-values; an unknown OpenMetrics version gets the text format.

Each of these failed on the earlier server (threads per connection, HTTP/1.0, per-recv timeouts).
"""

from __future__ import annotations

import contextlib
import gzip
import http.client
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from conftest import in_ci
from support.http_attack_util import (
    client_hello,
    closed_within,
    exchange,
    metric,
    proc_fds,
    proc_threads,
    raise_nofile,
    read_until_closed,
    serve_process,
    split_responses,
    trickle,
)
from support.tls_pki import Pki

from accelstats.manager import AcceleratorManager
from accelstats.settings import Settings
from accelstats.web.server import serve
from accelstats.web.source import WebConfigSource
from collectors.replay.lib import open_replay

REFUSED = "accelstats_http_connections_refused_total"


@dataclass
class Served:
    """An in-process server over a replayed H200; ``collections`` counts ``manager.collect`` calls."""

    server: Any
    manager: AcceleratorManager
    port: int
    web: WebConfigSource | None = None
    collections: list[int] = field(default_factory=lambda: [0])


def launch(folder: Path, fixtures_dir: Path, web_text: str | None = None) -> Served:
    """:func:`serve` on 127.0.0.1 (a free port) over the H200 replay, an empty cgroup tree and /proc
    in ``folder``; with ``web_text``, that web configuration file."""
    for d in ("cgroup", "proc"):
        (folder / d).mkdir(exist_ok=True)
    manager = AcceleratorManager(Settings(cgroup_root=folder / "cgroup", proc_root=folder / "proc",
                                          collectors=("nvidia",)),
                                 open_replay(fixtures_dir / "h200" / "nvidia-smi-q.xml"))
    manager.setup()
    web = None
    if web_text is not None:
        (folder / "web.yml").write_text(web_text)
        web = WebConfigSource(folder / "web.yml")
    server, _ = serve(manager, "127.0.0.1", 0, web)
    s = Served(server, manager, server.server_address[1], web)
    original = manager.collect

    def counting() -> Any:
        s.collections[0] += 1
        return original()

    manager.collect = counting  # type: ignore[method-assign]
    return s


def stop(s: Served) -> None:
    s.server.shutdown()
    s.server.server_close()
    s.manager.destroy(timeout=0.5)
    s.manager.close()


@pytest.fixture
def start(tmp_path: Path, fixtures_dir: Path) -> Iterator[Callable[..., Served]]:
    """A server of the test's own (its limits may be changed)."""
    started: list[Served] = []

    def _start(web_text: str | None = None) -> Served:
        started.append(launch(tmp_path, fixtures_dir, web_text))
        return started[-1]

    yield _start
    for s in started:
        stop(s)


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory: pytest.TempPathFactory, fixtures_dir: Path) -> Iterator[Served]:
    """One server for the tests that change nothing but its collection count."""
    s = launch(tmp_path_factory.mktemp("shared"), fixtures_dir)
    yield s
    stop(s)


@pytest.fixture
def served(shared_server: Served) -> Served:
    """:func:`shared_server` with its collection count at 0."""
    shared_server.collections[0] = 0
    return shared_server


def get(port: int, path: str = "/metrics", headers: dict[str, str] | None = None, method: str = "GET",
        tls: ssl.SSLContext | None = None, timeout: float = 5.0) -> tuple[int, dict[str, str], bytes]:
    conn: http.client.HTTPConnection
    if tls is not None:
        conn = http.client.HTTPSConnection("localhost", port, context=tls, timeout=timeout)
    else:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, headers=headers or {})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def refused(port: int, reason: str, tls: ssl.SSLContext | None = None) -> float | None:
    status, _, body = get(port, tls=tls)
    assert status == 200
    return metric(body.decode(), REFUSED, reason=reason)


# -- item 2: connection floods ---------------------------------------------------------------------


def test_a_flood_of_idle_and_slow_connections_does_not_lock_out_scrapes(tmp_path: Path, fixtures_dir: Path) -> None:
    """A real ``python3 -m accelstats serve`` with systemd's default soft RLIMIT_NOFILE (1024, what
    the unit gave before LimitNOFILE) and 1100 hostile connections: every other one idle, the rest a
    started head that never ends. Before the event loop each took a thread and a descriptor until its 30 s
    read timeout; past 1024 descriptors accept() failed and no scrape got in."""
    hard_needed = 1100 + 200
    if raise_nofile(4096) < hard_needed:
        message = f"this process needs {hard_needed} file descriptors (RLIMIT_NOFILE hard limit too low)"
        if in_ci():
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    for d in ("cgroup", "proc", "rootfs"):
        (tmp_path / d).mkdir()
    config = tmp_path / "config.toml"
    config.write_text("")
    args = ["--config", str(config), "--nvml-replay", str(fixtures_dir / "h200" / "nvidia-smi-q.xml"),
            "--cgroup-root", str(tmp_path / "cgroup"), "--proc-root", str(tmp_path / "proc"),
            "--rootfs", str(tmp_path / "rootfs"), "--collector", "nvidia"]
    with serve_process(args, tmp_path / "serve.log", nofile=1024) as (proc, port):
        limits = Path(f"/proc/{proc.pid}/limits").read_text()
        assert any(line.startswith("Max open files") and line.split()[3] == "1024" for line in limits.splitlines())
        hostile: list[socket.socket] = []
        try:
            for i in range(1100):
                sock = socket.create_connection(("127.0.0.1", port), timeout=5)
                hostile.append(sock)
                if i % 2:
                    with contextlib.suppress(OSError):  # already evicted: the server made room
                        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Never-Ends: ")
            bodies = []
            for _ in range(5):
                began = time.monotonic()
                status, _, body = get(port, timeout=5)
                assert status == 200
                assert time.monotonic() - began < 3.0
                bodies.append(body.decode())
            threads, fds = proc_threads(proc.pid), proc_fds(proc.pid)
            print(f"exporter while 1100 hostile connections were open: {threads} threads, {fds} fds")
            assert threads < 50, threads  # the loop, a worker, NVML and collection threads: not one per connection
            assert fds < 1024
            evicted = metric(bodies[-1], REFUSED, reason="evicted")
            assert evicted is not None and evicted >= 1100 - 768  # the limit under 1024 descriptors: 768
        finally:
            for sock in hostile:
                sock.close()


def test_a_request_head_has_a_total_deadline(start: Callable[..., Served]) -> None:
    """A head sent one byte every 0.2 s: each byte used to restart a 30 s read timeout, for ever."""
    s = start()
    s.server.header_timeout = 1.0
    with socket.create_connection(("127.0.0.1", s.port)) as sock:
        took = trickle(sock, b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100, every=0.2, limit=4.0)
    assert took is not None, "the server kept a trickling head open"
    assert 0.8 < took < 2.5
    assert refused(s.port, "header_timeout") == 1.0


def test_tls_handshake_and_head_have_total_deadlines_and_keep_alive_reuses_a_handshake(
        pki: Pki, start: Callable[..., Served]) -> None:
    """A ClientHello trickled one byte every 0.2 s (CPython's ``do_handshake`` already bounded the
    whole handshake), then, after a handshake, a head trickled the same way: each byte used to restart
    a 30 s read timeout, so a client that never sent its credentials held its thread for ever."""
    s = start(f"tls_server_config:\n  cert_file: {pki.server_cert}\n  key_file: {pki.server_key}\n")
    s.server.handshake_timeout = 1.0
    s.server.header_timeout = 1.0
    with socket.create_connection(("127.0.0.1", s.port)) as sock:
        took = trickle(sock, client_hello(), every=0.2, limit=4.0)
    assert took is not None, "the server kept a trickling handshake open"
    assert 0.8 < took < 2.5
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    with ctx.wrap_socket(socket.create_connection(("127.0.0.1", s.port), timeout=5),
                         server_hostname="localhost") as tls:
        took = trickle(tls, b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100, every=0.2, limit=4.0)
    assert took is not None, "the server kept a trickling head open after the handshake"
    assert 0.8 < took < 2.5
    conn = http.client.HTTPSConnection("localhost", s.port, context=ctx, timeout=5)
    try:
        conn.request("GET", "/metrics")
        first = conn.getresponse()
        body = first.read().decode()
        sock = conn.sock
        conn.request("GET", "/healthz")
        second = conn.getresponse()
        assert second.read() == b"ok\n"
        assert conn.sock is sock  # one connection, one handshake, two requests
    finally:
        conn.close()
    assert (first.status, first.version) == (200, 11)
    assert metric(body, REFUSED, reason="tls_handshake_timeout") == 1.0
    assert metric(body, REFUSED, reason="header_timeout") == 1.0


def test_keep_alive_is_bounded_by_requests_and_idle_time(start: Callable[..., Served]) -> None:
    s = start()
    s.server.max_requests = 3
    s.server.idle_timeout = 1.0
    conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=5)
    try:
        answers = []
        for _ in range(3):
            conn.request("GET", "/healthz")
            r = conn.getresponse()
            answers.append((r.status, r.version, r.getheader("Connection"), r.read()))
            if len(answers) == 1:
                sock = conn.sock
            elif len(answers) == 2:
                assert conn.sock is sock, "the second request did not reuse the connection"
    finally:
        conn.close()
    assert answers == [(200, 11, None, b"ok\n"), (200, 11, None, b"ok\n"), (200, 11, "close", b"ok\n")]
    with socket.create_connection(("127.0.0.1", s.port), timeout=5) as raw:
        raw.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        began = time.monotonic()
        data = read_until_closed(raw, 5.0)  # the answer, then the server closes the idle connection
        idle = time.monotonic() - began
    ((status, headers, body),) = split_responses(data)
    assert (status, body, headers.get("connection")) == ("HTTP/1.1 200 OK", b"ok\n", None)
    assert 0.8 < idle < 3.0
    assert refused(s.port, "idle_timeout") == 1.0


def test_pipelined_requests_are_answered_in_order(served: Served) -> None:
    s = served
    data = exchange(s.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\nHEAD / HTTP/1.1\r\nHost: x\r\n\r\n"
                            b"GET /nowhere HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    got = split_responses(data, head_only=[False, True, False])
    assert [(status, body) for status, _, body in got] == [
        ("HTTP/1.1 200 OK", b"ok\n"), ("HTTP/1.1 200 OK", b""),
        ("HTTP/1.1 404 Not Found", b"not found: try /metrics\n")]
    assert got[2][1]["connection"] == "close"


def test_at_the_connection_limit_the_oldest_idle_connections_make_room(start: Callable[..., Served]) -> None:
    s = start()
    s.server.max_connections = 20
    idle = [socket.create_connection(("127.0.0.1", s.port), timeout=5) for _ in range(40)]
    try:
        assert get(s.port, "/healthz")[::2] == (200, b"ok\n")  # accepted after the 40: room was made
        assert closed_within(idle[0], 2.0), "the oldest connection was kept"
        assert not closed_within(idle[-1], 0.2), "the newest idle connection was closed"
        evicted = refused(s.port, "evicted")
        assert evicted is not None and evicted >= 21
    finally:
        for sock in idle:
            sock.close()


def test_when_every_connection_has_a_request_in_progress_a_newcomer_is_closed(start: Callable[..., Served]) -> None:
    s = start()
    s.server.max_connections = 3
    gate, arrived = threading.Event(), threading.Semaphore(0)
    counting = s.manager.collect

    def held() -> Any:
        arrived.release()
        gate.wait(10)
        return counting()

    s.manager.collect = held  # type: ignore[method-assign]
    # three clients (requests from one address beyond its share would wait for a worker, and be evictable)
    busy = [socket.create_connection(("127.0.0.1", s.port), timeout=5, source_address=(f"127.0.0.{2 + i}", 0))
            for i in range(3)]
    try:
        for sock in busy:
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        for _ in busy:
            assert arrived.acquire(timeout=5)  # three requests in the app, each waiting on the gate
        with socket.create_connection(("127.0.0.1", s.port), timeout=5) as newcomer:
            assert closed_within(newcomer, 2.0), "a connection past the limit was kept while every slot was busy"
        gate.set()
        for sock in busy:
            ((status, _, _),) = split_responses(read_until_closed(sock, 5.0))
            assert status == "HTTP/1.1 200 OK"
    finally:
        gate.set()
        for sock in busy:
            sock.close()
    s.manager.collect = counting  # type: ignore[method-assign]
    assert refused(s.port, "limit") == 1.0


def test_open_connections_cost_no_threads(start: Callable[..., Served]) -> None:
    s = start()
    assert get(s.port, "/healthz")[0] == 200
    before = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", s.port), timeout=5) for _ in range(200)]
    try:
        assert get(s.port, "/healthz")[0] == 200  # accepted after the 200 (one listen queue, in order)
        assert threading.active_count() <= before + 2, "a thread per connection"
    finally:
        for sock in idle:
            sock.close()


def test_an_oversized_head_gets_431(served: Served) -> None:
    s = served
    data = exchange(s.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 40000 + b"\r\n\r\n")
    assert data.startswith(b"HTTP/1.1 431 ")
    assert get(s.port, "/healthz")[0] == 200


# -- item 9: HTTP semantics ------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/", "/healthz", "/metrics", "/metrics?name[]=accelstats_gpu_up", "/nowhere"])
def test_head_answers_have_no_body(served: Served, path: str) -> None:
    s = served
    data = exchange(s.port, f"HEAD {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    head, _, rest = data.partition(b"\r\n\r\n")
    assert head.split(b"\r\n")[0].split(b" ", 1)[1] in (b"200 OK", b"404 Not Found")
    assert rest == b"", f"HEAD {path} sent a body: {rest[:80]!r}"
    assert s.collections[0] == 0  # HEAD never collects


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "FOO"])
@pytest.mark.parametrize("path", ["/metrics", "/", "/healthz"])
def test_other_methods_get_405_and_never_collect(served: Served, method: str, path: str) -> None:
    s = served
    status, headers, _ = get(s.port, path, method=method)
    assert (status, headers.get("allow")) == (405, "GET, HEAD")
    assert s.collections[0] == 0


@pytest.mark.parametrize(("accept_encoding", "gzipped"), [
    ("gzip", True), ("GZIP", True), ("gzip;q=0.5", True), ("deflate, gzip;q=1.0", True), ("x-gzip", True),
    ("gzip;q=0", False), ("gzip; q=0.000", False), ("identity, gzip;q=0", False), ("gzip;q=bogus", False),
    ("br", False), ("", False),
])
@pytest.mark.parametrize("path", ["/metrics", "/metrics?name[]=accelstats_gpu_up"])
def test_gzip_follows_accept_encoding_q_values(served: Served, accept_encoding: str, gzipped: bool,
                                               path: str) -> None:
    s = served
    status, headers, body = get(s.port, path, {"Accept-Encoding": accept_encoding})
    assert status == 200
    assert (headers.get("content-encoding") == "gzip") == gzipped
    text = gzip.decompress(body) if gzipped else body
    assert b"accelstats_gpu_up{" in text


@pytest.mark.parametrize(("accept", "content_type"), [
    ("application/openmetrics-text; version=x", "text/plain; version=0.0.4"),
    ("application/openmetrics-text; version=2.0.0", "text/plain; version=0.0.4"),
    ("text/plain; version=x", "text/plain; version=0.0.4"),
    ("application/openmetrics-text; version=1.x, text/plain", "text/plain; version=0.0.4"),
    ("application/openmetrics-text; version=x, application/openmetrics-text; version=1.0.0",
     "application/openmetrics-text; version=1.0.0"),
    ("application/openmetrics-text;version=1.0.0;q=0.5,text/plain;version=0.0.4;q=0.4",
     "application/openmetrics-text; version=1.0.0"),
])
@pytest.mark.parametrize("path", ["/metrics", "/metrics?name[]=accelstats_gpu_up"])
def test_an_unknown_openmetrics_version_gets_the_text_format(served: Served, accept: str,
                                                             content_type: str, path: str) -> None:
    s = served
    status, headers, body = get(s.port, path, {"Accept": accept})
    assert status == 200, body[:300]
    assert headers["content-type"].startswith(content_type)
    assert b"accelstats_gpu_up{" in body
    assert body.endswith(b"# EOF\n") == content_type.startswith("application/openmetrics-text")


# -- the server's counters in /metrics -------------------------------------------------------------


def test_refused_connections_and_web_config_reload_failures_are_published(start: Callable[..., Served]) -> None:
    plain = start()
    _, _, body = get(plain.port)
    reasons = {"limit", "evicted", "tls_handshake_timeout", "header_timeout", "idle_timeout", "write_timeout"}
    assert {r for r in reasons if metric(body.decode(), REFUSED, reason=r) == 0.0} == reasons
    assert b"accelstats_web_config_reload_failures_total" not in body  # no web config: no such family
    configured = start("http_server_config:\n  headers:\n    X-Frame-Options: deny\n")
    _, headers, body = get(configured.port)
    assert headers["x-frame-options"] == "deny"
    assert metric(body.decode(), "accelstats_web_config_reload_failures_total") == 0.0
    assert configured.web is not None
    path = configured.web.path
    mtime = path.stat().st_mtime_ns
    path.write_text("http_server_config:\n  headers: [\n")  # a half-written file: refused, counted
    os.utime(path, ns=(mtime + 2_000_000_000, mtime + 2_000_000_000))
    _, headers, body = get(configured.port)
    assert headers["x-frame-options"] == "deny"  # the last good configuration stays in force
    assert metric(body.decode(), "accelstats_web_config_reload_failures_total") == float(
        configured.web.reload_failures) == 1.0
