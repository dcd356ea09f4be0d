"""The HTTP(S) server of ``accelstats serve`` and of the Nomad plugin's ``metrics_listen``.

asyncio owns the sockets, the event loop and TLS; h11 reads request heads and frames answers; this
module is the admission policy on top (docs/design.md has the design, docs/security.md what each part
prevents, docs/performance.md what it costs): total deadlines per connection state, oldest-first
eviction at :func:`connection_limit`, one budget of unsent answers, the app on at most :data:`WORKERS`
threads shared fairly by client address (:class:`~accelstats.web.workers.FairWorkers`) and only for a
complete head, HTTP/1.1 keep-alive (HTTP/1.0: one request per connection), linger after the last
answer, Go's ``400`` for plain HTTP on the TLS port; closes counted by reason, answers by code
(:class:`~accelstats.web.app.ServerCounters`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import http
import logging
import os
import resource
import socket
import ssl
import threading
import time
from asyncio import sslproto
from collections import OrderedDict
from collections.abc import Callable
from email.utils import formatdate
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, unquote, urlsplit

import h11
from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector

from accelstats.manager import AcceleratorManager
from accelstats.web.app import TEXT, App, Request, ServerCounters, make_app
from accelstats.web.workers import FairWorkers

if TYPE_CHECKING:  # the web-config stack (PyYAML, bcrypt, cryptography): only with --web-config
    from accelstats.web.source import WebConfigSource

log = logging.getLogger(__name__)

DEFAULT_MAX_CONNECTIONS = 4096
FD_RESERVE = 256  # descriptors kept out of the connection limit: NVML's device nodes, files read, stdio, epoll
# Threads running the app at most: as many as scrapers that may come at once, so that they share a collection
# (50 concurrent scrapers of 2 MB bodies: 31/s with 16 workers, 78/s with 64; benchmarks/load.py).
WORKERS = 64
WORKER_IDLE_EXIT = 5.0  # seconds an idle worker thread waits for work before it ends
HANDSHAKE_TIMEOUT, HEADER_TIMEOUT, IDLE_TIMEOUT, WRITE_TIMEOUT = 10.0, 10.0, 90.0, 30.0  # seconds
LINGER_TIMEOUT, LINGER_BYTES = 2.0, 65536  # after our last byte: what the client still sends is read and dropped
MAX_REQUESTS = 1000  # per connection
MAX_HEAD_BYTES, MAX_HEADERS = 32768, 100  # past either: 431
MAX_EMPTY_LINE_BYTES = 64  # CR and LF bytes ignored before a request (RFC 9112 §2.2); more: 400
OUTPUT_BUDGET = 128 << 20  # bytes of unsent answers, all connections together
_CHUNK = 1 << 20  # bytes handed to a transport at once; the next when the kernel has taken them
_ACCEPTS_PER_WAKE = 64
_ACCEPT_RETRY = 0.1  # seconds before accepting again when out of descriptors with nothing to evict
_SWEEP = 0.1  # seconds between two looks at the deadlines (while there are connections)
_NOT_TLS = (b"HTTP/1.0 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\nConnection: close\r\n\r\n"
            b"Client sent an HTTP request to an HTTPS server.\n")  # what Go's net/http answers
_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "date", "upgrade"})
# asyncio's TLS protocol allocates and zeroes a read buffer of SSLProtocol.max_size bytes per connection:
# 256 KiB, 250 MiB for 1000 connections. Request heads are small; 4 KiB reads lose nothing.
_TLS_READ_BYTES = 4 << 10
_TLS_RECORD_MAX = 5 + (16 << 10) + 256  # a TLS record's header and its longest body (RFC 8446 §5.1, 5.2)
# a peek at most this often at a connection whose first TLS record is not all there: 500 half ClientHellos
# cost 0.06 cores at 50 ms (benchmarks/attack.py); a client split in segments waits at most twice its gap (+1 ms)
_PEEK_MAX = 0.5
_TCP_CLOSING = frozenset({7, 8, 9})  # TCP_CLOSE, TCP_CLOSE_WAIT, TCP_LAST_ACK (include/net/tcp_states.h)
# connection states; a request with a worker (_WORKING) has no deadline and is evictable until it starts
_TLS_START, _HANDSHAKE, _READING, _IDLE, _WORKING, _WRITING, _LINGER = (
    "tls_start", "handshake", "reading", "idle", "working", "writing", "linger")
_TIMEOUT_REASON = {_TLS_START: "tls_handshake_timeout", _HANDSHAKE: "tls_handshake_timeout",
                   _READING: "header_timeout", _IDLE: "idle_timeout", _WRITING: "write_timeout"}

Job = tuple["_Conn", h11.Request, str, str, bool]  # connection, request, path, query, keep-alive


def connection_limit(default: int = DEFAULT_MAX_CONNECTIONS, reserve: int = FD_RESERVE) -> int:
    """Connections to allow under this process's ``RLIMIT_NOFILE`` soft limit: ``default``, or the
    soft limit less ``reserve`` descriptors (at least half the limit) when that is lower."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return default if soft == resource.RLIM_INFINITY else max(1, min(default, max(soft - reserve, soft // 2)))


def split_target(target: str) -> tuple[str, str]:
    """``(path, query)`` of a request target in origin form (``/metrics?x``) or absolute form
    (``http://host:port/metrics?x``, path ``/`` when empty, RFC 9112 §3.2.2); raises ValueError for an
    absolute form ``urlsplit`` refuses (``http://[::1/metrics``, a port that is not a number)."""
    if not target.lower().startswith(("http://", "https://")):
        path, _, query = target.partition("?")
        return path, query
    parts = urlsplit(target)
    parts.port  # noqa: B018 - raises ValueError for a port that is not a number
    return parts.path or "/", parts.query


def _own_answer(http_conn: h11.Connection, code: int, text: str) -> list[bytes]:
    """This server's answer ``code`` (and ``Connection: close``) with the body ``text``, framed by h11."""
    body = text.encode()
    head = http_conn.send(h11.Response(status_code=code, reason=http.HTTPStatus(code).phrase, headers=[
        ("Content-Type", TEXT), ("Content-Length", str(len(body))), ("Date", formatdate(usegmt=True)),
        ("Connection", "close")]))
    http_conn.send(h11.Data(data=body))
    http_conn.send(h11.EndOfMessage())
    return [head or b"", body]


class _Conn(asyncio.Protocol):
    """One client connection; asyncio calls it and only the event loop changes it, but ``started``
    (set by the worker that takes its request)."""

    __slots__ = ("client", "closed", "deadline", "drained", "empty", "eof", "fed", "held", "http", "inbox",
                 "keep_alive", "not_tls", "out", "paused", "peer", "requests", "server", "sock", "started", "state",
                 "task", "tls", "transport", "unsent", "wait")

    def __init__(self, server: HTTPServer, sock: socket.socket, peer: Any, tls: bool) -> None:
        self.server, self.sock, self.peer, self.tls = server, sock, peer, tls
        self.client = str(peer[0]) if isinstance(peer, tuple) and peer else ""  # the key of its requests
        self.not_tls: bool | None = None  # on the TLS port, not TLS: True plain HTTP, False anything else
        self.transport: asyncio.Transport | None = None
        self.task: asyncio.Task[Any] | None = None  # connect_accepted_socket (with the TLS handshake)
        self.http: h11.Connection | None = None  # the request being read or answered
        self.inbox = bytearray()  # bytes not given to h11 yet (pipelined requests)
        self.out: list[memoryview] = []  # the answer's parts not handed to the transport yet
        self.state, self.deadline = "", 0.0
        self.fed = self.empty = self.unsent = self.requests = self.drained = 0
        self.keep_alive = self.eof = self.paused = self.held = self.started = self.closed = False
        self.wait = 0.0  # seconds until the first TLS record is looked at again (doubling from 1 ms, at most _PEEK_MAX)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.set_write_buffer_limits(high=1, low=0)  # paused while the kernel has not taken it all
        if self.closed:  # evicted while asyncio made the transport
            transport.abort()
        elif self.not_tls:
            self.answer([_NOT_TLS], False, 400)
        elif self.not_tls is not None:
            self.linger()
        elif self.state == _HANDSHAKE:
            self.enter(_READING, self.server.header_timeout)

    def data_received(self, data: bytes) -> None:
        if self.state == _LINGER:
            self.drained += len(data)
            if self.drained > LINGER_BYTES:
                self.close()
            return
        self.inbox += data
        if self.state == _IDLE:
            self.enter(_READING, self.server.header_timeout)
        if self.state == _READING:
            self.parse()
        elif len(self.inbox) > MAX_HEAD_BYTES and not self.held and self.transport is not None:
            self.transport.pause_reading()  # pipelined bytes past a head's worth wait in the kernel
            self.held = True

    def eof_received(self) -> bool | None:
        # A complete request is answered, then the connection closed (HTTP/1.1 allows a half-close: busybox
        # nc, health checks); until it starts, its job leaves the shared lane for its address's cap (see _work).
        self.eof = True
        if self.state in (_READING, _IDLE, _LINGER):
            self.close()
            return None
        return True if self.not_tls is not None or not self.tls else None  # plain: open until the answer is out

    def connection_lost(self, exc: Exception | None) -> None:
        self.close()

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        if self.state == _WRITING:
            self.write()

    def enter(self, state: str, timeout: float | None) -> None:
        """Put this connection in ``state`` with a deadline ``timeout`` seconds from now (None: none)."""
        if not self.closed:
            self.state = state
            self.deadline = self.server.loop.time() + timeout if timeout is not None else float("inf")
            self.server.conns.move_to_end(self)

    def close(self, reason: str | None = None) -> None:
        """Close now (a worker skips its request); ``reason``: counted as refused."""
        if self.closed:
            return
        self.closed = True
        server = self.server
        server.conns.pop(self, None)
        if reason is not None:
            server.counters.count(reason)
            log.debug("%s: closed (%s)", self.peer, reason)
        server.unsent -= self.unsent
        self.unsent, self.out = 0, []
        if self.transport is not None:
            self.transport.abort()
        elif self.task is not None:
            self.task.cancel()  # asyncio closes the transport it made; _connected closes the socket
        else:
            with contextlib.suppress(ValueError, OSError):
                server.loop.remove_reader(self.sock.fileno())
            self.sock.close()

    def connect(self, ctx: ssl.SSLContext | None) -> None:
        """Hand the socket to asyncio, with a TLS handshake when ``ctx`` is given (our deadline comes
        first; asyncio's is a backstop, as its TLS shutdown timeout is behind our linger's)."""
        tls: dict[str, Any] = {} if ctx is None else {"ssl": ctx, "ssl_handshake_timeout": HANDSHAKE_TIMEOUT + 1}
        loop = self.server.loop
        self.task = loop.create_task(loop.connect_accepted_socket(lambda: self, self.sock, **tls))
        self.task.add_done_callback(self._connected)

    def _connected(self, task: asyncio.Task[Any]) -> None:
        self.task = None
        if task.cancelled() or task.exception() is not None:
            log.debug("%s: %s", self.peer, "closed" if task.cancelled() else task.exception())
            self.close()
            self.sock.close()  # closed already where asyncio made a transport

    def parse(self) -> None:
        """Give h11 the inbox, at most :data:`MAX_HEAD_BYTES` + 1 bytes for one head, and hand a complete
        request to a worker, or answer one this server does not take."""
        if self.http is None:
            self.http = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
            self.fed = self.empty = 0
        if self.fed == 0:  # h11 refuses any empty line before a request: the first 64 bytes are dropped
            skip = min(len(self.inbox) - len(self.inbox.lstrip(b"\r\n")), MAX_EMPTY_LINE_BYTES - self.empty)
            del self.inbox[:skip]
            self.empty += skip
        take = min(len(self.inbox), MAX_HEAD_BYTES + 1 - self.fed)
        self.http.receive_data(bytes(self.inbox[:take]))
        del self.inbox[:take]
        self.fed += take
        try:
            request = self.http.next_event()
        except h11.RemoteProtocolError as exc:  # 431 past max_incomplete_event_size
            return self.refuse(exc.error_status_hint, str(exc))
        if request is h11.NEED_DATA:
            return None
        assert isinstance(request, h11.Request)
        if request.http_version not in (b"1.0", b"1.1"):
            return self.refuse(505, "HTTP version")
        if len(request.headers) > MAX_HEADERS:
            return self.refuse(431, "too many header lines")
        try:
            path, query = split_target(request.target.decode("latin-1"))
        except ValueError:
            return self.refuse(400, "bad request target")
        bodiless = not any(n == b"transfer-encoding" or (n == b"content-length" and v.strip(b"0"))
                           for n, v in request.headers)  # a body announced, even an empty chunked one: closed after
        try:
            bodiless = bodiless and isinstance(self.http.next_event(), h11.EndOfMessage)
        except h11.RemoteProtocolError:
            bodiless = False
        self.inbox[:0] = self.http.trailing_data[0] if bodiless else b""  # pipelined requests
        self.requests += 1
        server, self.started = self.server, False
        keep_alive = (bodiless and self.http.their_state is h11.DONE and self.requests < server.max_requests
                      and not server.stopping)
        self.enter(_WORKING, None)
        shared = (request.method in (b"GET", b"HEAD") and path in ("/metrics", "/healthz", "/")
                  and "name[]" not in parse_qs(query))  # requests that share one collection and body
        server.workers.submit(self.client, (self, request, path, query, keep_alive), shared=shared)
        return None

    def refuse(self, code: int, why: str) -> None:
        log.debug("%s: %d: %s", self.peer, code, why)
        assert self.http is not None
        self.answer(_own_answer(self.http, code, why + "\n"), False, code)

    def answer(self, out: list[bytes], keep_alive: bool, code: int) -> None:
        """Write ``out``; then the next request (``keep_alive``), or linger and close."""
        server = self.server
        server.counters.answered(str(code))
        self.out = [memoryview(b) for b in out if b]
        self.unsent = sum(len(b) for b in self.out)
        server.unsent += self.unsent
        self.keep_alive = keep_alive and not self.eof
        self.enter(_WRITING, server.write_timeout)
        while server.unsent > server.output_budget and server.evict(keep=self, state=_WRITING):
            pass
        self.write()

    def write(self) -> None:
        assert self.transport is not None
        while self.out and not self.paused and not self.transport.is_closing():  # closing: connection_lost follows
            data = self.out[0]
            self.transport.write(data[:_CHUNK])
            n = min(len(data), _CHUNK)
            self.unsent -= n
            self.server.unsent -= n
            self.out[0:1] = [data[n:]] if n < len(data) else []
        if self.out or self.paused or self.closed or self.transport.is_closing():
            return  # resume_writing brings it back when the kernel has taken the rest
        if self.eof:
            return self.close()
        if not self.keep_alive:
            return self.linger()
        self.http = None
        if self.held:
            self.transport.resume_reading()
            self.held = False
        if not self.inbox:
            return self.enter(_IDLE, self.server.idle_timeout)
        self.enter(_READING, self.server.header_timeout)  # a pipelined request
        return self.parse()

    def linger(self) -> None:
        """Half-close, then read and drop what the client still sends: closing with unread bytes would
        reset the connection before the client read our answer. TLS: asyncio sends close_notify and
        waits as long for the client's."""
        assert self.transport is not None
        self.inbox.clear()
        self.enter(_LINGER, LINGER_TIMEOUT)
        if self.held:
            self.transport.resume_reading()
        if self.transport.can_write_eof():
            self.transport.write_eof()
        else:
            self.transport.close()


class HTTPServer:
    """The asyncio HTTP(S) server (the module docstring has the design).

    ``listener``: a bound, listening socket; ``app``: :data:`~accelstats.web.app.App`; ``web``: the web configuration
    (TLS when ``web.tls_enabled``); ``counters``: where closes and answers are counted. Limits are read
    when used, so tests may lower them on a running server: ``max_connections``, ``handshake_timeout``,
    ``header_timeout``, ``idle_timeout``, ``write_timeout``, ``max_requests``, ``output_budget``.
    :meth:`serve_forever` runs the loop (in the thread :func:`serve` starts); :meth:`shutdown` stops it,
    closing every connection, and waits; :meth:`server_close` also closes the listener and workers."""

    def __init__(self, listener: socket.socket, app: App, web: WebConfigSource | None = None,
                 counters: ServerCounters | None = None, workers: int = WORKERS) -> None:
        self.socket, self.app, self.web = listener, app, web
        self.server_address: tuple[Any, ...] = listener.getsockname()
        self.server_port: int = self.server_address[1]
        self.counters = counters if counters is not None else ServerCounters(web)
        self.max_connections = connection_limit()
        self.handshake_timeout, self.header_timeout = HANDSHAKE_TIMEOUT, HEADER_TIMEOUT
        self.idle_timeout, self.write_timeout = IDLE_TIMEOUT, WRITE_TIMEOUT
        self.max_requests, self.output_budget = MAX_REQUESTS, OUTPUT_BUDGET
        self.workers: FairWorkers[Job] = FairWorkers(workers, self._work, idle_exit=WORKER_IDLE_EXIT,
                                                     unshared=lambda job: job[0].eof)
        self.unsent = 0  # bytes of answers not handed to a transport yet, every connection together
        self.conns: OrderedDict[_Conn, None] = OrderedDict()  # open connections, longest in their state first
        self.loop = asyncio.new_event_loop()
        self.stopping = self._started = self._closed = False
        self._sweeping: asyncio.TimerHandle | None = None
        self._tcp = listener.family in (socket.AF_INET, socket.AF_INET6)
        self._emfile_logged = 0.0
        self._peek = bytearray(_TLS_RECORD_MAX)  # what the loop peeks at before a connection goes to asyncio
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        listener.setblocking(False)

    @property
    def connections(self) -> int:
        """Open client connections (for tests and benchmarks)."""
        return len(self.conns)

    def serve_forever(self) -> None:
        """Run the event loop until :meth:`shutdown`; every connection is closed on the way out."""
        with self._lock:
            if self.stopping or self._closed:
                return
            self._started = True
        sslproto.SSLProtocol.max_size = _TLS_READ_BYTES  # type: ignore[attr-defined]  # not in typeshed
        try:
            self.loop.add_reader(self.socket.fileno(), self._accept)
            self.loop.run_forever()
        finally:
            with contextlib.suppress(ValueError, OSError):
                self.loop.remove_reader(self.socket.fileno())
            for conn in list(self.conns):
                conn.close()
            tasks = asyncio.all_tasks(self.loop)
            self.loop.run_until_complete(asyncio.wait(tasks, timeout=1.0) if tasks else asyncio.sleep(0))
            self.loop.run_until_complete(asyncio.sleep(0))  # the transports' connection_lost: sockets closed
            self.loop.close()
            self._stopped.set()

    def shutdown(self) -> None:
        """Stop the event loop and wait until it has (returns at once when it never ran)."""
        with self._lock:
            self.stopping, started = True, self._started
        if started:
            with contextlib.suppress(RuntimeError):  # closed: stopped already
                self.loop.call_soon_threadsafe(self.loop.stop)
            self._stopped.wait()

    def server_close(self) -> None:
        """:meth:`shutdown`, then close the listener, the workers' queue (running jobs finish alone) and
        the web configuration's checking thread (serve() was handed the source, and owns it)."""
        self.shutdown()
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if not self.loop.is_closed():
            self.loop.close()
        self.workers.stop()
        if self.web is not None:
            self.web.close()
        self.socket.close()

    def evict(self, keep: _Conn | None = None, state: str | None = None) -> bool:
        """Close the connection longest in its state among those whose request is not running; ``state``:
        only among those in that state; never ``keep``. False when there is none."""
        for conn in self.conns:
            if conn is keep or (state is not None and conn.state != state) or (conn.state == _WORKING and conn.started):
                continue
            conn.close(None if conn.state == _LINGER else "evicted")
            return True
        return False

    def _accept(self) -> None:
        for _ in range(_ACCEPTS_PER_WAKE):
            try:
                sock, peer = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    log.debug("accept: %s", exc)  # ECONNABORTED and the like: that client is gone
                    continue
                evicted, now = self.evict(), time.monotonic()
                if not evicted and now - self._emfile_logged > 60:
                    self._emfile_logged = now
                    log.warning("accept: %s with every connection busy; raise LimitNOFILE", exc.strerror)
                self.loop.remove_reader(self.socket.fileno())  # asyncio closes the evicted socket in a callback:
                self.loop.call_later(0 if evicted else _ACCEPT_RETRY, self._resume_accept)  # accept after it
                return
            if len(self.conns) >= self.max_connections and not self.evict():
                self.counters.count("limit")
                sock.close()
                continue
            if self._tcp:  # asyncio sets it only where the socket's proto is IPPROTO_TCP; accept() gives 0
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(self, sock, peer, self.web is not None and self.web.tls_enabled)
            self.conns[conn] = None
            if self._sweeping is None:
                self._sweeping = self.loop.call_later(_SWEEP, self._sweep)
            if conn.tls:  # in a TLS flood the first flight is there at the accept: no watch for it
                conn.enter(_TLS_START, self.handshake_timeout)
                self._first_byte(conn, watched=False)
            else:  # watched from the start: requests are read in the order they came
                conn.enter(_READING, self.header_timeout)
                self.loop.add_reader(sock.fileno(), self._first_byte, conn)

    def _sweep(self) -> None:
        """Close the connections past their deadline (counted by the state they were in)."""
        now = self.loop.time()
        for conn in [c for c in self.conns if c.deadline <= now]:
            conn.close(_TIMEOUT_REASON.get(conn.state))
        self._sweeping = self.loop.call_later(_SWEEP, self._sweep) if self.conns else None

    def _resume_accept(self) -> None:
        if not self.stopping:
            self.loop.add_reader(self.socket.fileno(), self._accept)

    def _first_byte(self, conn: _Conn, watched: bool = True) -> None:
        """Hand a connection to asyncio once its first bytes are there (an idle one costs a descriptor and
        a watch, no transport; in a flood they are there at the accept). On the TLS port a handshake
        record (0x16) starts the handshake once the whole first record has come (its length is in the
        record header, RFC 8446 §5.1: a client that sends half a ClientHello costs no TLS session), within
        the deadline counted from the accept; a letter is plain HTTP (Go's ``400``); anything else
        lingers. ``watched``: the loop watches the socket."""
        if conn.closed:
            return
        try:  # asyncio makes the socket non-blocking
            n = conn.sock.recv_into(self._peek, _TLS_RECORD_MAX if conn.tls else 1,
                                    socket.MSG_PEEK | socket.MSG_DONTWAIT)
            first = bytes(self._peek[:min(n, 5)])
        except (BlockingIOError, InterruptedError):
            if not watched:
                self.loop.add_reader(conn.sock.fileno(), self._first_byte, conn)
            return
        except OSError as exc:
            log.debug("%s: connection dropped before TLS: %s", conn.peer, exc)
            first, n = b"", 0
        if watched:
            self.loop.remove_reader(conn.sock.fileno())
        if first and not conn.tls:
            return conn.connect(None)
        record = 5 + int.from_bytes(first[3:5], "big") if n >= 5 else 5  # header and body
        if first[:1] == b"\x16" and n < min(record, _TLS_RECORD_MAX):
            # the rest of the record is on its way: look again later (a watch would fire at once, since
            # the bytes are there but not taken), sooner for a client that is merely split in segments;
            # a client that closed its side meanwhile (TCP_INFO's state, tcp(7)) will not send it
            if self._tcp and conn.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] in _TCP_CLOSING:
                return conn.close()
            conn.wait = min(2 * conn.wait or 0.001, _PEEK_MAX)
            self.loop.call_later(conn.wait, self._first_byte, conn, False)
            return
        ctx = None
        if first[:1] == b"\x16":
            assert self.web is not None
            ctx = self.web.in_force()[1]
        if ctx is not None:
            conn.state = _HANDSHAKE  # same deadline: the handshake's counts from the accept
            conn.connect(ctx)
        elif first and first[:1] != b"\x16":
            log.debug("%s: not TLS (first byte %r)", conn.peer, first[:1])
            conn.not_tls = first[:1].isalpha()
            conn.connect(None)
        else:
            conn.close()

    def _deliver(self, conn: _Conn, out: list[bytes], code: int, keep_alive: bool) -> None:
        if not conn.closed:
            conn.answer(out, keep_alive, code)

    # -- requests, on worker threads

    def _work(self, job: Job) -> Callable[[], None] | None:
        """Run the app for one request; returns the call that hands the answer to the loop, None when the
        loop closed the connection meanwhile (evicted). A request whose client closed its side before it
        started is run in its address's capped lane (``unshared``): connect, send, close is a flood's
        cheapest request, and costs at most :data:`~accelstats.web.workers.PER_CLIENT` workers an address."""
        conn, request, path, query, keep_alive = job
        conn.started = True
        if conn.closed:
            return None
        out, code, keep_alive = self._respond(conn, request, path, query, keep_alive and not conn.eof)

        def deliver() -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: the server stopped
                self.loop.call_soon_threadsafe(self._deliver, conn, out, code, keep_alive)

        return deliver

    def _respond(self, conn: _Conn, request: h11.Request, path: str, query: str,
                 keep_alive: bool) -> tuple[list[bytes], int, bool]:
        """``([head, body], status code, keep_alive)`` for one request, framed by h11, with
        ``Content-Length`` (none for an empty answer to HEAD: ``HEAD /metrics`` does not collect), ``Date``
        and ``Connection: close`` when not kept alive; HEAD: the head only. A failing app or a header
        h11 refuses: 500 and a close."""
        assert conn.http is not None
        headers: dict[str, str] = {}
        for name, value in request.headers:  # h11 gives names in lower case
            text, key = value.decode("latin-1"), name.decode("ascii")
            headers[key] = f"{headers[key]},{text}" if key in headers else text
        head_only = request.method == b"HEAD"
        try:
            code, fields, body = self.app(Request(request.method.decode("ascii"), unquote(path, "latin-1"), query,
                                                  headers, conn.client))
            framed = [(n.encode("latin-1"), v.encode("latin-1")) for n, v in fields if n.lower() not in _HOP]
            if body or not head_only:
                framed.append((b"Content-Length", str(len(body)).encode()))
            framed.append((b"Date", formatdate(usegmt=True).encode()))
            if not keep_alive:
                framed.append((b"Connection", b"close"))
            response = h11.Response(status_code=code, reason=http.HTTPStatus(code).phrase, headers=framed)
        except Exception as exc:  # a failing app or a bad header: 500, the server goes on
            log.error("%s %s: %s: %s", request.method.decode(), request.target[:200].decode("latin-1"),
                      type(exc).__name__, exc, exc_info=log.isEnabledFor(logging.DEBUG))
            return _own_answer(conn.http, 500, "internal error, see the exporter's log\n"), 500, False
        out = [conn.http.send(response) or b""]
        if body and not head_only:
            out += conn.http.send_with_data_passthrough(h11.Data(data=body)) or []  # the body itself, not a copy
        conn.http.send(h11.EndOfMessage())
        return out, response.status_code, keep_alive


def _listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket: ``host ""`` is every interface, IPv6 and IPv4 on one socket (IPv4 only
    where the host has no IPv6). Backlog ``SOMAXCONN`` (5 overflowed with 50 concurrent scrapers;
    benchmarks/load.py). Raises OSError whose ``strerror`` is the system's alone."""
    try:
        if host == "" and socket.has_ipv6 and socket.has_dualstack_ipv6():
            try:
                return socket.create_server(("::", port), family=socket.AF_INET6, backlog=socket.SOMAXCONN,
                                            dualstack_ipv6=True)
            except OSError as exc:
                if exc.errno not in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL):
                    raise
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        return socket.create_server((host or "0.0.0.0", port), family=family, backlog=socket.SOMAXCONN)
    except OSError as exc:
        if exc.errno is None:
            raise
        raise OSError(exc.errno, os.strerror(exc.errno)) from exc


def serve(manager: AcceleratorManager, host: str, port: int,
          web: WebConfigSource | None = None) -> tuple[HTTPServer, threading.Thread]:
    """Serve ``manager`` on ``host:port`` (``""``: every interface, IPv6 and IPv4) in a daemon thread;
    ``web``: the ``--web-config`` file (TLS, and basic auth and headers through
    :class:`accelstats.web.auth.BasicAuth`). Returns ``(server, thread)``; ``server.shutdown()`` then
    ``server.server_close()`` stop it. Raises OSError when the address cannot be bound."""
    counters = ServerCounters(web)
    # the process_* and python_* families every client_python exporter has, read per scrape
    own = (ProcessCollector(registry=None), PlatformCollector(registry=None),
           GCCollector(registry=CollectorRegistry()))  # GCCollector insists on registering somewhere
    app = make_app(manager, (counters, *own))
    if web is not None:
        from accelstats.web.auth import BasicAuth

        app = BasicAuth(app, web)
    server = HTTPServer(_listener(host, port), app, web, counters)
    if server.max_connections < DEFAULT_MAX_CONNECTIONS:
        log.info("at most %d HTTP connections (RLIMIT_NOFILE %d; %d needs %d)", server.max_connections,
                 resource.getrlimit(resource.RLIMIT_NOFILE)[0], DEFAULT_MAX_CONNECTIONS,
                 DEFAULT_MAX_CONNECTIONS + FD_RESERVE)
    thread = threading.Thread(target=server.serve_forever, name="accelstats-http", daemon=True)
    thread.start()
    return server, thread
