"""The Prometheus sink: a ``prometheus_client`` custom collector over the manager, and the HTTP server.

``AccelstatsCollector.collect()`` asks the manager for a collection (shared with concurrent
scrapes) and renders it into metric families declared in :mod:`accelstats.catalog`; ``describe()``
yields the same families without samples, so registering never touches NVML (client_python's
custom-collector pattern; no global Gauges set from threads). ``serve`` answers ``/metrics``,
``/healthz`` and a landing page at ``/`` from one threading WSGI server: plain HTTP, or with a web
configuration file (``--web-config``, :mod:`accelstats.webconfig`) TLS, basic auth and extra headers.
"""

from __future__ import annotations

import errno
import gzip
import logging
import platform
import socket
import socketserver
import ssl
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder, generate_latest, gzip_accepted

from accelstats import __version__, catalog
from accelstats.catalog import Family
from accelstats.containers import ContainerStats
from accelstats.manager import AcceleratorManager, Collection
from accelstats.webauth import BasicAuth
from accelstats.webconfig import WebConfigError, WebConfigSource

log = logging.getLogger(__name__)

StartResponse = Callable[..., Any]


def _family(spec: Family) -> GaugeMetricFamily | CounterMetricFamily:
    if spec.type == "counter":
        return CounterMetricFamily(spec.name, spec.help, labels=list(spec.labels))
    return GaugeMetricFamily(spec.name, spec.help, labels=list(spec.labels))


def _identity_labels(c: ContainerStats) -> list[str]:
    """cAdvisor's container labels: id (cgroup path), name, image, container, pod, namespace."""
    m = c.metadata
    return [_utf8(v) for v in (c.cgroup, m.name, m.image, m.container, m.pod, m.namespace)]


def _utf8(value: str) -> str:
    """A label value safe to encode: names read from the filesystem may carry undecodable bytes
    (``os.fsdecode`` surrogates), which would make the whole exposition fail; they become U+FFFD."""
    if value.isascii():
        return value
    return value.encode("utf-8", "surrogatepass").decode("utf-8", "replace")


def render(collection: Collection) -> Iterator[Metric]:
    """The catalog's families for one collection; families with no sample this time are left out
    (``describe()`` still declares them all)."""
    snap = collection.snapshot
    fams = {f.name: _family(f) for f in catalog.ALL}

    def add(spec: Family, labels: Iterable[str], value: float) -> None:
        fams[spec.name].add_metric(list(labels), value)

    add(catalog.BUILD_INFO, [__version__, platform.python_version(), snap.nvml_version, snap.driver_version], 1)
    for r in snap.collector_results:
        add(catalog.COLLECTOR_SUCCESS, [r.name], 1.0 if r.success else 0.0)
        add(catalog.COLLECTOR_DURATION, [r.name], r.duration_seconds)
    add(catalog.SKIPPED_LINES, [], collection.devices_list_skipped_lines_total)
    for reason, count in sorted(collection.attribution_skipped.items()):
        add(catalog.ATTRIBUTION_SKIPPED, [reason], count)
    for (call, error), count in sorted(collection.nvml_errors.items()):
        add(catalog.NVML_ERRORS, [call, error], count)

    devices = {d.uuid: d for d in snap.devices}
    for d in snap.devices:
        base = [d.uuid, str(d.index), d.name]
        add(catalog.GPU_INFO, base + [
            "" if d.minor is None else str(d.minor), d.pci_bus_id, d.kind, d.parent_uuid, d.mig_profile,
            _opt(d.gpu_instance_id), _opt(d.compute_instance_id), snap.driver_version, snap.cuda_driver_version,
            d.vbios_version, d.mig_mode, d.compute_mode, d.persistence_mode, d.compute_capability,
            d.architecture, snap.source], 1)
        sample = snap.samples.get(d.uuid)
        add(catalog.GPU_UP, base, 1.0 if sample is not None and sample.up else 0.0)
        if sample is None or not sample.up:
            continue
        for spec in catalog.GPU_SAMPLED:
            assert spec.read is not None
            for extra, value in spec.read(sample):
                add(spec, base + list(extra), value)

    for c in collection.containers:
        if not c.accelerators:
            continue
        ident = _identity_labels(c)
        i = c.identity
        info = [i.runtime, i.id, i.pod_uid, i.alloc_id, i.task] if i is not None else ["unknown", "", "", "", ""]
        add(catalog.CONTAINER_INFO, ident + [_utf8(v) for v in info], 1)
        for a in c.accelerators:
            cad = ident + [a.make, a.model, a.id]
            if a.memory_total_bytes is not None:
                add(catalog.CADVISOR_MEMORY_TOTAL, cad, a.memory_total_bytes)
            if a.memory_used_bytes is not None:
                add(catalog.CADVISOR_MEMORY_USED, cad, a.memory_used_bytes)
            if a.duty_cycle is not None:
                add(catalog.CADVISOR_DUTY_CYCLE, cad, a.duty_cycle)
            dev = devices.get(a.id)
            labels = ident + [a.id, str(dev.index if dev else a.index), a.attribution]
            if a.container_memory_used_bytes is not None:
                add(catalog.CONTAINER_MEMORY, labels, a.container_memory_used_bytes)
            if a.container_sm_utilization_ratio is not None:
                add(catalog.CONTAINER_SM, labels, a.container_sm_utilization_ratio)
            if a.container_processes is not None:
                add(catalog.CONTAINER_PROCESSES, labels, a.container_processes)
            if a.device_open is not None:
                add(catalog.CONTAINER_DEVICE_OPEN, labels, 1 if a.device_open else 0)

    for m in snap.mps:
        add(catalog.MPS_UP, [m.resource], 1.0 if m.up else 0.0)
        if not m.up:
            continue
        add(catalog.MPS_SERVERS, [m.resource], m.servers)
        add(catalog.MPS_CLIENTS, [m.resource], m.clients)
        if m.active_thread_ratio is not None:
            add(catalog.MPS_THREADS, [m.resource], m.active_thread_ratio)
        for uuid, limit in m.pinned_memory_limit_bytes:
            if limit is not None:
                add(catalog.MPS_PINNED, [m.resource, uuid], limit)
    if any(r.name == "files" for r in snap.collector_results):
        add(catalog.FILES_SKIPPED, [], snap.file_devices_skipped_total)
    for f in snap.file_devices:
        labels = [f.id, f.vendor, f.type, f.name, _utf8(f.path)]
        add(catalog.FILE_INFO, labels, 1)
        add(catalog.FILE_HEALTHY, labels, 1.0 if f.healthy else 0.0)
        add(catalog.FILE_SIZE, labels, f.size_bytes)
        add(catalog.FILE_MTIME, labels, f.modified_timestamp_seconds)
        add(catalog.FILE_MODE, labels, f.mode)
    yield from (f for f in fams.values() if f.samples)


def _opt(value: int | None) -> str:
    return "" if value is None else str(value)


class AccelstatsCollector:
    """prometheus_client custom collector: one manager collection per scrape, rendered from the catalog."""

    def __init__(self, manager: AcceleratorManager) -> None:
        self.manager = manager

    def collect(self) -> Iterator[Metric]:
        """Yield every family for a fresh (or concurrently shared) collection."""
        yield from render(self.manager.collect())

    def describe(self) -> Iterator[Metric]:
        """Yield every family of the catalog without samples (no NVML call at registration)."""
        for spec in catalog.ALL:
            yield _family(spec)


def make_registry(manager: AcceleratorManager) -> CollectorRegistry:
    """A registry of our own (never the global REGISTRY) holding only :class:`AccelstatsCollector`."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(AccelstatsCollector(manager))
    return registry


def exposition(manager: AcceleratorManager) -> bytes:
    """One collection as Prometheus text exposition format 0.0.4 (what ``accelstats dump`` prints)."""
    return generate_latest(make_registry(manager))


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
