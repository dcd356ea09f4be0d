"""The HTTP server of ``accelstats serve`` (and of the Nomad plugin's ``metrics_listen``).

``make_app`` is the WSGI app: ``/metrics`` (one collection shared by concurrent scrapes, encoded
once per collection and format, :class:`SharedExposition`), ``/healthz`` and a landing page at
``/``. ``serve`` runs it on a threading WSGI server: plain HTTP, or with a web configuration file
(``--web-config``, :mod:`accelstats.webconfig`) TLS, basic auth and extra headers
(:mod:`accelstats.webauth`).
"""

from __future__ import annotations

import errno
import gzip
import logging
import socket
import socketserver
import ssl
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import Metric
from prometheus_client.exposition import choose_encoder, gzip_accepted

from accelstats import __version__
from accelstats.exporter import make_registry, render
from accelstats.manager import AcceleratorManager, Collection
from accelstats.webauth import BasicAuth
from accelstats.webconfig import WebConfigError, WebConfigSource

log = logging.getLogger(__name__)

StartResponse = Callable[..., Any]


LANDING = """<!doctype html>
<html><head><title>accelstats</title></head><body>
<h1>accelstats {version}</h1>
<p>Per-container accelerator metrics (NVIDIA GPUs, MIG, MPS, file devices).</p>
<ul><li><a href="metrics">/metrics</a> &mdash; Prometheus exposition</li>
<li><a href="healthz">/healthz</a> &mdash; liveness</li></ul>
</body></html>
"""


class _OneCollection:
    """A collector over one finished collection (rendered, never collected again)."""

    def __init__(self, collection: Collection) -> None:
        self.collection = collection

    def collect(self) -> Iterator[Metric]:
        """The families of the one collection (:func:`render`)."""
        return render(self.collection)


class SharedExposition:
    """``/metrics`` bodies shared by the scrapes that share a collection.

    :meth:`AcceleratorManager.collect` hands one collection to every scrape that arrived while it
    ran; rendering and encoding it is the larger part of a big scrape (63 of 121 ms for 8 GPUs and
    1000 containers, docs/performance.md), so the encoded body (and its gzip) is kept for the newest
    collection, per format chosen by the ``Accept`` header (text 0.0.4/1.0.0 or OpenMetrics, client_python's
    ``choose_encoder``). Requests with a ``name[]`` filter go to client_python's own app, uncached.
    """

    def __init__(self, manager: AcceleratorManager) -> None:
        self.manager = manager
        self._lock = threading.Lock()
        self._collection: Collection | None = None
        self._bodies: dict[tuple[str, bool], bytes] = {}  # (content type, gzip) -> body
        self.encodings = 0  # bodies encoded (a counter for tests and benchmarks)

    def body(self, accept: str, accept_encoding: str) -> tuple[bytes, list[tuple[str, str]]]:
        """(body, headers) for one scrape: one collection (shared), encoded once per collection and format."""
        encoder, content_type = choose_encoder(accept)
        compress = gzip_accepted(accept_encoding)
        collection = self.manager.collect()
        with self._lock:
            if collection is not self._collection:
                self._collection, self._bodies = collection, {}
            key = (content_type, compress)
            body = self._bodies.get(key)
            if body is None:
                plain = self._bodies.get((content_type, False))
                if plain is None:
                    registry = CollectorRegistry(auto_describe=False)
                    registry.register(_OneCollection(collection))
                    plain = encoder(registry)
                    self.encodings += 1
                    self._bodies[(content_type, False)] = plain
                body = gzip.compress(plain) if compress else plain
                self._bodies[key] = body
        headers = [("Content-Type", content_type)]
        if compress:
            headers.append(("Content-Encoding", "gzip"))
        return body, headers


def make_app(manager: AcceleratorManager) -> Callable[[dict[str, Any], StartResponse], Iterable[bytes]]:
    """WSGI app: ``/metrics`` (a body shared by scrapes that share a collection, see
    :class:`SharedExposition`; gzip and OpenMetrics by request; ``name[]`` filters through
    client_python's app), ``/healthz``, ``/``."""
    filtered = make_wsgi_app(make_registry(manager))
    shared = SharedExposition(manager)
    landing = LANDING.format(version=__version__).encode()

    def metrics(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        if "name[]" in parse_qs(environ.get("QUERY_STRING", "")):
            return filtered(environ, start_response)  # type: ignore[no-any-return]
        body, headers = shared.body(environ.get("HTTP_ACCEPT", ""), environ.get("HTTP_ACCEPT_ENCODING", ""))
        start_response("200 OK", headers + [("Content-Length", str(len(body)))])
        return [body]

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/")
        if path == "/metrics" and environ.get("REQUEST_METHOD") == "HEAD":  # probes: no collection
            start_response("200 OK", [("Content-Type", "text/plain; version=0.0.4; charset=utf-8")])
            return []
        if path == "/metrics":
            return metrics(environ, start_response)
        if path == "/healthz":
            start_response("200 OK", [("Content-Type", "text/plain; charset=utf-8")])
            return [b"ok\n"]
        if path == "/":
            start_response("200 OK", [("Content-Type", "text/html; charset=utf-8")])
            return [landing]
        start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
        return [b"not found: try /metrics\n"]

    return app


HANDSHAKE_TIMEOUT = 10.0  # seconds a TLS client may take to send its hello and finish the handshake
IO_TIMEOUT = 30.0  # seconds a request may stall on a socket read or write once it started
_NOT_TLS = (b"HTTP/1.0 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\nConnection: close\r\n\r\n"
            b"Client sent an HTTP request to an HTTPS server.\n")  # what Go's net/http answers


class _ThreadingServer(socketserver.ThreadingMixIn, WSGIServer):
    """One thread per connection. With ``web`` set and TLS enabled in it, the connection's own thread
    (never the accept loop) runs the TLS handshake under ``handshake_timeout``, so a client that
    stalls or speaks plain HTTP costs one short-lived thread and blocks nobody else."""

    daemon_threads = True
    allow_reuse_address = True
    # listen() backlog: socketserver's default of 5 overflowed with 50 concurrent scrapers (SYNs dropped,
    # clients retrying after 1, 3, 7 s; benchmarks/load.py). The kernel caps it at net.core.somaxconn.
    request_queue_size = socket.SOMAXCONN
    web: WebConfigSource | None = None
    handshake_timeout = HANDSHAKE_TIMEOUT

    def finish_request(self, request: Any, client_address: Any) -> None:
        if self.web is None or not self.web.tls_enabled:
            super().finish_request(request, client_address)
            return
        conn = _tls_handshake(request, client_address, self.web, self.handshake_timeout)
        if conn is None:
            return  # process_request_thread closes the plain socket
        try:
            super().finish_request(conn, client_address)
        finally:
            self.shutdown_request(conn)


def _tls_handshake(sock: socket.socket, peer: Any, web: WebConfigSource, timeout: float) -> ssl.SSLSocket | None:
    """The TLS connection for ``sock``, or None (logged at debug level) when the client sent plain HTTP
    (answered 400, as Go's net/http does), stalled past ``timeout`` or failed the handshake."""
    sock.settimeout(timeout)
    try:
        first = sock.recv(1, socket.MSG_PEEK)
        if not first:
            return None
        if first != b"\x16":  # every TLS connection starts with a handshake record (0x16)
            if first.isalpha():  # a method name: plain HTTP
                sock.sendall(_NOT_TLS)
            log.debug("%s: not TLS (first byte %r), %s", peer, first, "answered 400" if first.isalpha() else "closed")
            _drain(sock)
            return None
        _, ctx = web.current()
        assert ctx is not None
        conn = ctx.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
    except (OSError, WebConfigError) as exc:
        log.debug("%s: connection dropped before TLS: %s", peer, exc)
        return None
    try:
        conn.do_handshake()
    except OSError as exc:  # ssl.SSLError and socket timeouts are OSErrors
        log.debug("%s: TLS handshake failed: %s", peer, exc)
        conn.close()
        return None
    return conn


def _drain(sock: socket.socket, limit: int = 65536) -> None:
    """Half-close, then read what the client still sends (up to ``limit`` bytes, until EOF or the
    socket's timeout), so that closing does not reset the connection before it read our answer."""
    sock.shutdown(socket.SHUT_WR)
    sock.settimeout(min(sock.gettimeout() or 2.0, 2.0))
    while limit > 0:
        chunk = sock.recv(min(limit, 8192))
        if not chunk:
            return
        limit -= len(chunk)


class _QuietHandler(WSGIRequestHandler):
    timeout = IO_TIMEOUT

    def get_environ(self) -> dict[str, Any]:
        environ = super().get_environ()
        if isinstance(self.connection, ssl.SSLSocket):
            environ["HTTPS"] = "on"  # wsgi.url_scheme https
        return environ

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)


class _V6Server(_ThreadingServer):
    address_family = socket.AF_INET6


class _DualStackServer(_V6Server):
    """``[::]`` with IPV6_V6ONLY off: IPv6 and IPv4 clients on one socket (``host ""``)."""

    def server_bind(self) -> None:
        self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()


def serve(manager: AcceleratorManager, host: str, port: int,
          web: WebConfigSource | None = None) -> tuple[WSGIServer, threading.Thread]:
    """Start serving on ``host:port`` in a daemon thread; ``host ""`` is every interface, IPv6 and
    IPv4 (IPv4 only where the host has no IPv6). ``web``: the ``--web-config`` file (TLS when it has
    ``tls_server_config``; basic auth and headers through :class:`accelstats.webauth.BasicAuth`).

    Returns ``(server, thread)``; call ``server.shutdown()`` to stop. Raises OSError when the address
    cannot be bound (e.g. EADDRINUSE).
    """
    app = make_app(manager)
    if web is not None:
        app = BasicAuth(app, web)
    server: _ThreadingServer
    if host == "" and socket.has_ipv6:
        try:
            server = make_server("::", port, app, server_class=_DualStackServer, handler_class=_QuietHandler)
        except OSError as exc:
            if exc.errno not in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL):
                raise
        else:
            return server, _start(server, web)
    server_class = _V6Server if ":" in host else _ThreadingServer
    server = make_server(host or "0.0.0.0", port, app, server_class=server_class, handler_class=_QuietHandler)
    return server, _start(server, web)


def _start(server: _ThreadingServer, web: WebConfigSource | None) -> threading.Thread:
    server.web = web
    thread = threading.Thread(target=server.serve_forever, name="accelstats-http", daemon=True)
    thread.start()
    return thread
