"""The HTTP server of ``accelstats serve`` (and of the Nomad plugin's ``metrics_listen``); the WSGI app
it serves is :mod:`accelstats.web.app`.

**The server** (:class:`HTTPServer`, started by :func:`serve`) is built so that clients that connect
and then stall cannot lock out a scrape:

* *One event-loop thread owns every socket.* ``accelstats-http`` (:mod:`selectors`, epoll) accepts,
  runs TLS handshakes non-blocking, reads request heads, keeps idle keep-alive connections and writes
  answers. A pool of at most :data:`WORKERS` threads (started on demand, gone after
  :data:`WORKER_IDLE_EXIT` idle seconds) runs the WSGI app, and only for a request whose head is
  complete. An idle, slow-header or handshake-stalling client costs one file descriptor and the bytes
  it sent, never a thread: the server runs at most 1 + :data:`WORKERS` threads however many
  connections are open. The loop reads at most :data:`_READS_PER_EVENT` times from one connection per
  turn, so a client that never stops sending cannot keep it from the others or from the deadlines.
* *Work is shared by client address* (:class:`accelstats.web.workers.FairWorkers`): requests wait per
  address and are taken round-robin, at most two of one address running at once (scrapes of
  ``/metrics`` without a filter excepted: concurrent ones share a collection and its encoded body, so
  many at once cost little more than one), so a flood from one address, or a few, does not queue a
  scrape from another. A request whose client has closed its side
  by the time a worker takes it (connect, send, close: a flood's cheapest form) is not run and not
  answered, as nginx does.
* *Deadlines are totals*, fixed when a connection enters a state and never moved by a byte arriving:
  the TLS handshake within ``handshake_timeout`` (10 s) of the accept; a request head within
  ``header_timeout`` (10 s) of the accept (plain), of the handshake's end (TLS) or of the first
  byte after an idle keep-alive; keep-alive idle ``idle_timeout`` (90 s: at Prometheus' default 1 min
  scrape interval a scraper keeps its connection, and pays one TLS handshake, not one per scrape); a
  whole answer written within ``write_timeout`` (30 s). A request waiting for a worker, or running,
  has no deadline: that is the app's (the collection's own deadlines).
* *HTTP/1.1 with keep-alive* (HTTP/1.0 too, when the client asks with ``Connection: keep-alive``), at
  most ``max_requests`` (1000) requests per connection, pipelined requests answered in order. A
  request that announces a body (no GET or HEAD needs one) is answered and its connection closed, so
  no unread body can be taken for the next request. Heads are read by :mod:`accelstats.web.head`
  (bounded in bytes and lines, ``431``; a malformed one gets ``400`` and a close).
* *Bounded connections.* At most ``max_connections``: :data:`DEFAULT_MAX_CONNECTIONS` (4096), and
  never more than ``RLIMIT_NOFILE`` less :data:`FD_RESERVE` descriptors kept for NVML, the files a
  collection reads and the process itself (:func:`connection_limit`; ``systemd/accelstats.service``
  sets ``LimitNOFILE=8192``). A connection that arrives at the limit makes room: the connection that
  has been longest in its current state among those whose request is not running (still handshaking
  or sending its head, idle between requests, its request waiting for a worker, or having its answer
  written) is closed (counted as ``evicted``). Only when every connection has a request running is
  the newcomer closed at once (``limit``). Oldest-first eviction is what lets a scrape through a
  flood: a scraper needs a few milliseconds from connect to a complete request, so a client holding
  every slot would have to open ``max_connections`` new connections within those milliseconds to
  push it out, while the slots it holds are the first to go; an idle keep-alive scraper that loses
  its connection just opens another. The same eviction answers ``EMFILE`` from ``accept``.
* *Bounded memory for answers.* Answers not yet sent, all connections together, are kept under
  ``output_budget`` (:data:`OUTPUT_BUDGET`, 128 MiB, each connection's bytes counted even where the
  body is shared): past it the connection that has been writing longest is closed (``evicted``), so
  clients that ask and never read cannot make the exporter hold their answers until ``write_timeout``.
* *Counted:* every connection the server closes on its own, by reason, in
  ``accelstats_http_connections_refused_total{reason}`` (:data:`REFUSED_REASONS`): ``limit``,
  ``evicted``, ``tls_handshake_timeout``, ``header_timeout``, ``idle_timeout`` (keep-alive idle),
  ``write_timeout``; rendered from the server's own counters into ``/metrics``
  (:class:`ServerCounters`), with ``accelstats_web_config_reload_failures_total`` when a web
  configuration is in use.

Why one module of ~750 lines: :class:`HTTPServer` is one state machine over the sockets it owns
(states, deadlines, eviction order and the hand-off to workers); the pieces that stand alone are
elsewhere (the app in :mod:`accelstats.web.app`, head parsing in :mod:`accelstats.web.head`), and
cutting the machine further would spread one connection's transitions over several files.

With a web configuration file (``--web-config``, :mod:`accelstats.web.config`): TLS, basic auth and
extra headers (:mod:`accelstats.web.auth`). Plain HTTP sent to the TLS port gets Go's ``400`` answer.
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import os
import resource
import select
import selectors
import socket
import ssl
import sys
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from email.utils import formatdate
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, unquote

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector

from accelstats import __version__
from accelstats.manager import AcceleratorManager
from accelstats.web.app import ServerCounters, WSGIApp, make_app
from accelstats.web.head import (
    MAX_EMPTY_LINE_BYTES,
    MAX_HEAD_BYTES,
    BadRequestError,
    Request,
    head_end,
    parse_head,
    simple_answer,
    strip_empty_lines,
)
from accelstats.web.workers import FairWorkers

if TYPE_CHECKING:  # the web-config stack (PyYAML, bcrypt) is imported only when --web-config is given
    from accelstats.web.source import WebConfigSource

log = logging.getLogger(__name__)


# -- the server -------------------------------------------------------------------------------------

DEFAULT_MAX_CONNECTIONS = 4096
FD_RESERVE = 256  # descriptors kept out of the connection limit: NVML's device nodes, files read, stdio, epoll
# Threads running the WSGI app at most. As many as the scrapers that may come at once, so that they share
# one collection (AcceleratorManager.collect shares a collection only among callers waiting in it): 50
# concurrent scrapers of 2 MB bodies were served 31/s with 16 workers (7.8 scrapes per collection) and
# 78/s with 64 (23 per collection; 77/s with a thread per connection), benchmarks/load.py.
WORKERS = 64
WORKER_IDLE_EXIT = 5.0  # seconds an idle worker thread waits for work before it ends
HANDSHAKE_TIMEOUT = 10.0  # seconds from accept to a finished TLS handshake
HEADER_TIMEOUT = 10.0  # seconds for a whole request head
IDLE_TIMEOUT = 90.0  # seconds a keep-alive connection may wait for its next request
WRITE_TIMEOUT = 30.0  # seconds to write a whole answer
LINGER_TIMEOUT = 2.0  # seconds, after our last byte, to read what the client still sends before closing
MAX_REQUESTS = 1000  # requests per connection
_SWEEP = 0.1  # seconds between deadline checks
_ACCEPTS_PER_WAKE = 64
_READS_PER_EVENT = 4  # recv() calls for one connection per turn of the loop (16 KiB each)
OUTPUT_BUDGET = 128 << 20  # bytes of unsent answers, all connections together, before the oldest unread go
_CHUNK = 1 << 20  # bytes per send(): the kernel takes what fits in the socket buffer
_NOT_TLS = (b"HTTP/1.0 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\nConnection: close\r\n\r\n"
            b"Client sent an HTTP request to an HTTPS server.\n")  # what Go's net/http answers
_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "date", "upgrade"})


def connection_limit(default: int = DEFAULT_MAX_CONNECTIONS, reserve: int = FD_RESERVE) -> int:
    """Connections to allow under this process's ``RLIMIT_NOFILE`` soft limit: ``default``, or the
    soft limit less ``reserve`` descriptors (at least half the limit) when that is lower."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return default
    room = soft - reserve if soft - reserve >= soft // 2 else soft // 2
    return max(1, min(default, room))


# connection states: what the event loop waits for
_TLS_START = "tls_start"  # the first byte (TLS or not)
_HANDSHAKE = "handshake"
_READING = "reading"  # a request head, begun or not
_IDLE = "idle"  # keep-alive, between requests
_WORKING = "working"  # a request with a worker (queued or running): no deadline; evictable until it starts
_WRITING = "writing"
_LINGER = "linger"  # after our last byte: half-closed, reading until EOF
_TIMEOUT_REASON = {_TLS_START: "tls_handshake_timeout", _HANDSHAKE: "tls_handshake_timeout",
                   _READING: "header_timeout", _IDLE: "idle_timeout", _WRITING: "write_timeout"}


class _Conn:
    """One client connection, owned by the event loop."""

    __slots__ = ("buf", "closed", "deadline", "drained", "empty", "events", "keep_alive", "out", "peer", "requests",
                 "sock", "started", "state", "tls", "unsent")

    def __init__(self, sock: socket.socket, peer: Any, tls: bool) -> None:
        self.sock = sock
        self.peer = peer
        self.tls = tls
        self.state = ""
        self.deadline = 0.0
        self.events = 0  # selector events registered; 0 = not registered
        self.buf = bytearray()
        self.out: deque[memoryview] = deque()
        self.keep_alive = False
        self.requests = 0
        self.drained = 0  # bytes read and dropped after our last byte
        self.empty = 0  # CR and LF bytes dropped before the request being read
        self.unsent = 0  # bytes of the answer not yet sent
        self.started = False  # a worker took its request (set by the worker)
        self.closed = False  # closed by the event loop (read by workers: skip its request)

    @property
    def client(self) -> str:
        """The client's address: the key its requests are queued under."""
        return str(self.peer[0]) if isinstance(self.peer, tuple) and self.peer else "local"


class HTTPServer:
    """The event-loop HTTP(S) server (the module docstring has the design).

    ``listener``: a bound, listening socket; ``app``: the WSGI app; ``web``: the web configuration
    (TLS when ``web.tls_enabled``); ``counters``: where refused connections are counted. Limits are
    attributes read when used, so tests may lower them on a running server: ``max_connections``,
    ``handshake_timeout``, ``header_timeout``, ``idle_timeout``, ``write_timeout``, ``max_requests``.
    :meth:`serve_forever` runs the loop (in the thread :func:`serve` starts); :meth:`shutdown` stops it
    and waits; :meth:`server_close` closes the listener, every connection and the workers."""

    def __init__(self, listener: socket.socket, app: WSGIApp, web: WebConfigSource | None = None,
                 counters: ServerCounters | None = None, workers: int = WORKERS) -> None:
        self.socket = listener
        self.server_address: tuple[Any, ...] = listener.getsockname()
        self.server_port: int = self.server_address[1]
        self.app = app
        self.web = web
        self.counters = counters if counters is not None else ServerCounters(web)
        self.max_connections = connection_limit()
        self.handshake_timeout = HANDSHAKE_TIMEOUT
        self.header_timeout = HEADER_TIMEOUT
        self.idle_timeout = IDLE_TIMEOUT
        self.write_timeout = WRITE_TIMEOUT
        self.max_requests = MAX_REQUESTS
        self.workers: FairWorkers[tuple[_Conn, Request, bool]] = FairWorkers(workers, self._work,
                                                                             idle_exit=WORKER_IDLE_EXIT)
        self.output_budget = OUTPUT_BUDGET
        self._unsent = 0  # bytes of answers not yet sent, every connection together
        self._conns: set[_Conn] = set()
        self._evictable: OrderedDict[_Conn, None] = OrderedDict()  # oldest state change first
        self._done: deque[tuple[_Conn, list[bytes] | None, bool]] = deque()
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        listener.setblocking(False)
        self._selector.register(listener, selectors.EVENT_READ, self._accept)
        self._selector.register(self._wake_r, selectors.EVENT_READ, self._drain_wake)
        # Connections whose request waits for a worker, watched for the client closing its side
        # (EPOLLRDHUP alone: pipelined bytes do not wake it); the epoll is itself watched by the loop.
        self._gone: Any = None
        self._gone_fds: dict[int, _Conn] = {}
        if hasattr(select, "epoll") and hasattr(select, "EPOLLRDHUP"):
            self._gone = select.epoll()
            self._selector.register(self._gone, selectors.EVENT_READ, self._on_gone)
        self._accept_paused_until = 0.0
        self._emfile_logged = 0.0
        self._stop = False
        self._started = False
        self._closed = False
        self._stopped = threading.Event()

    # -- lifecycle

    def serve_forever(self) -> None:
        """Run the event loop until :meth:`shutdown`."""
        self._started = True
        try:
            next_sweep = time.monotonic() + _SWEEP
            while not self._stop:
                # Idle (no connection, accepting): nothing has a deadline, so sleep until a client or
                # the wake-up socket comes (a scrape every 15 s costs no wake-ups in between).
                idle = not self._conns and not self._accept_paused_until
                timeout = None if idle else max(0.0, next_sweep - time.monotonic())
                for key, _mask in self._selector.select(timeout):
                    data = key.data
                    if isinstance(data, _Conn):
                        if data in self._conns:  # not closed by an eviction earlier in this round
                            self._on_event(data)
                        continue
                    try:
                        data()  # the listener or the wake-up socket
                    except Exception:  # a bug here must not end the loop
                        log.exception("HTTP server: unexpected error")
                now = time.monotonic()
                if idle:
                    next_sweep = now + _SWEEP  # the first deadline check comes a sweep after the wake-up
                elif now >= next_sweep:
                    self._sweep(now)
                    next_sweep = now + _SWEEP
        finally:
            self._stopped.set()

    def shutdown(self) -> None:
        """Stop the event loop and wait until it has (returns at once when it never ran)."""
        self._stop = True
        self._wake()
        if self._started:
            self._stopped.wait()

    def server_close(self) -> None:
        """Close the listener, every connection, the workers' queue (running jobs finish alone)."""
        if self._closed:
            return
        if self._started and not self._stopped.is_set():
            self.shutdown()
        self._closed = True
        self.workers.stop()
        if self.web is not None:  # its checking thread: serve() was handed the source, and owns it now
            self.web.close()
        for conn in list(self._conns):
            self._close(conn)
        self._selector.close()
        if self._gone is not None:
            self._gone.close()
        for sock in (self.socket, self._wake_r, self._wake_w):
            sock.close()

    @property
    def connections(self) -> int:
        """Open client connections (for tests and benchmarks)."""
        return len(self._conns)

    # -- event loop helpers

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # full (a wake is pending anyway) or closed (the server is closing)
            self._wake_w.send(b"\0")

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        while self._done:
            conn, out, keep_alive = self._done.popleft()
            if conn not in self._conns:
                continue
            self._unwatch_gone(conn)
            if out is None:  # the client had gone before a worker took its request
                self._close(conn)
            else:
                self._start_writing(conn, out, keep_alive)

    def _on_gone(self) -> None:
        """Close the connections whose client closed its side while their request waited for a worker:
        connect, send, close is a flood's cheapest request, and each would hold a connection slot
        until a worker came to it."""
        for fd, _ in self._gone.poll(0, 256):
            conn = self._gone_fds.get(fd)
            if conn is None:
                with contextlib.suppress(OSError, ValueError):
                    self._gone.unregister(fd)
                continue
            self._unwatch_gone(conn)
            if conn in self._conns and not conn.started:
                self._close(conn)

    def _unwatch_gone(self, conn: _Conn) -> None:
        """Stop watching ``conn`` for its client closing (its request started, or it is closing)."""
        if self._gone is None:
            return
        fd = conn.sock.fileno()
        if fd >= 0 and self._gone_fds.get(fd) is conn:
            del self._gone_fds[fd]
            with contextlib.suppress(OSError, ValueError):
                self._gone.unregister(fd)

    def _want(self, conn: _Conn, events: int) -> None:
        if events == conn.events:
            return
        if conn.events and events:
            self._selector.modify(conn.sock, events, conn)
        elif events:
            self._selector.register(conn.sock, events, conn)
        else:
            self._selector.unregister(conn.sock)
        conn.events = events

    def _enter(self, conn: _Conn, state: str, timeout: float | None, events: int = selectors.EVENT_READ) -> None:
        """Put ``conn`` in ``state`` with a deadline ``timeout`` seconds from now (None: none)."""
        conn.state = state
        conn.deadline = time.monotonic() + timeout if timeout is not None else float("inf")
        self._evictable.pop(conn, None)
        self._evictable[conn] = None  # _WORKING too: evictable while its request waits for a worker
        self._want(conn, events)

    def _close(self, conn: _Conn, reason: str | None = None) -> None:
        if conn not in self._conns:
            return
        if reason is not None:
            self.counters.count(reason)
            log.debug("%s: closed (%s)", conn.peer, reason)
        self._unwatch_gone(conn)
        self._conns.discard(conn)
        self._evictable.pop(conn, None)
        conn.closed = True
        self._unsent -= conn.unsent
        conn.unsent = 0
        conn.out.clear()
        if conn.events:
            with contextlib.suppress(KeyError, ValueError):  # the selector is closed
                self._selector.unregister(conn.sock)
            conn.events = 0
        with contextlib.suppress(OSError):
            conn.sock.close()

    def _evict_one(self, keep: _Conn | None = None, state: str | None = None) -> bool:
        """Close the connection longest in its state among those whose request is not running
        (handshaking, reading a head, idle, queued for a worker, writing, lingering); ``state``: only
        among those in that state; never ``keep``. False when there is none."""
        for conn in self._evictable:
            if conn is keep or (state is not None and conn.state != state):
                continue
            if conn.state == _WORKING and conn.started:
                continue  # its request runs: the work is done or nearly; the answer follows
            self._close(conn, None if conn.state == _LINGER else "evicted")
            return True
        return False

    def _sweep(self, now: float) -> None:
        if self._accept_paused_until and now >= self._accept_paused_until:
            self._accept_paused_until = 0.0
            self._selector.register(self.socket, selectors.EVENT_READ, self._accept)
        for conn in [c for c in self._conns if c.deadline <= now]:
            self._close(conn, _TIMEOUT_REASON.get(conn.state))

    def _accept(self) -> None:
        for _ in range(_ACCEPTS_PER_WAKE):
            try:
                sock, peer = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    if self._evict_one():
                        continue
                    now = time.monotonic()
                    if now - self._emfile_logged > 60:
                        self._emfile_logged = now
                        log.warning("accept: %s with every connection busy; raise LimitNOFILE", exc.strerror)
                    self._selector.unregister(self.socket)  # back in the next sweep
                    self._accept_paused_until = now + _SWEEP
                    return
                log.debug("accept: %s", exc)  # ECONNABORTED and the like: that client is gone
                continue
            if len(self._conns) >= self.max_connections and not self._evict_one():
                self.counters.count("limit")
                sock.close()
                continue
            try:
                self._setup(sock, peer)
            except OSError as exc:  # the client reset the connection already
                log.debug("%s: %s", peer, exc)
                sock.close()

    def _setup(self, sock: socket.socket, peer: Any) -> None:
        sock.setblocking(False)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        tls = self.web is not None and self.web.tls_enabled
        conn = _Conn(sock, peer, tls)
        self._conns.add(conn)
        if tls:
            self._enter(conn, _TLS_START, self.handshake_timeout)
        else:
            self._enter(conn, _READING, self.header_timeout)

    def _on_event(self, conn: _Conn) -> None:
        try:
            state = conn.state
            if state == _TLS_START:
                self._tls_start(conn)
            elif state == _HANDSHAKE:
                self._handshake(conn)
            elif state in (_READING, _IDLE):
                self._read(conn)
            elif state == _WRITING:
                self._write(conn)
            elif state == _LINGER:
                self._linger_read(conn)
        except Exception:  # a bug with one connection must not end the loop for all
            log.exception("%s: unexpected error, connection closed", conn.peer)
            self._close(conn)

    # -- TLS

    def _tls_start(self, conn: _Conn) -> None:
        try:
            first = conn.sock.recv(1, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            log.debug("%s: connection dropped before TLS: %s", conn.peer, exc)
            self._close(conn)
            return
        if not first:
            self._close(conn)
            return
        if first != b"\x16":  # every TLS connection starts with a handshake record (0x16)
            log.debug("%s: not TLS (first byte %r)", conn.peer, first)
            if first.isalpha():  # a method name: plain HTTP, answered as Go's net/http does
                self._start_writing(conn, [_NOT_TLS], False)
            else:
                self._linger(conn)
            return
        assert self.web is not None
        from accelstats.web.config import WebConfigError

        try:
            _, ctx = self.web.current()
        except WebConfigError:  # logged by the source; fail closed
            self._close(conn)
            return
        if ctx is None:
            self._close(conn)
            return
        self._want(conn, 0)  # wrap_socket detaches the plain socket: register the TLS one instead
        conn.sock = ctx.wrap_socket(conn.sock, server_side=True, do_handshake_on_connect=False)
        conn.state = _HANDSHAKE  # same deadline: the handshake's counts from the accept
        self._handshake(conn)

    def _handshake(self, conn: _Conn) -> None:
        assert isinstance(conn.sock, ssl.SSLSocket)
        try:
            conn.sock.do_handshake()
        except ssl.SSLWantReadError:
            self._want(conn, selectors.EVENT_READ)
            return
        except ssl.SSLWantWriteError:
            self._want(conn, selectors.EVENT_WRITE)
            return
        except OSError as exc:  # ssl.SSLError included
            log.debug("%s: TLS handshake failed: %s", conn.peer, exc)
            self._close(conn)
            return
        self._enter(conn, _READING, self.header_timeout)
        self._read(conn)  # the request may have come with the handshake's last flight, decrypted already

    # -- requests

    def _read(self, conn: _Conn) -> None:
        conn.empty += strip_empty_lines(conn.buf)
        reads = 0
        while head_end(conn.buf) < 0 and len(conn.buf) <= MAX_HEAD_BYTES:
            if conn.empty > MAX_EMPTY_LINE_BYTES:
                self._start_writing(conn, [simple_answer("400 Bad Request", b"empty lines instead of a request\n")],
                                    False)
                return
            if reads == _READS_PER_EVENT and not (isinstance(conn.sock, ssl.SSLSocket) and conn.sock.pending()):
                return  # the loop's turn: other clients, and the deadlines, come first (epoll brings it back)
            reads += 1
            try:
                data = conn.sock.recv(16384)
            except (BlockingIOError, InterruptedError, ssl.SSLWantReadError):
                self._want(conn, selectors.EVENT_READ)
                return
            except ssl.SSLWantWriteError:
                self._want(conn, selectors.EVENT_WRITE)
                return
            except OSError as exc:
                log.debug("%s: %s", conn.peer, exc)
                self._close(conn)
                return
            if not data:
                self._close(conn)
                return
            if conn.state == _IDLE:  # the next request begins: its head has header_timeout from now
                self._enter(conn, _READING, self.header_timeout)
            conn.buf += data
            conn.empty += strip_empty_lines(conn.buf)
        self._dispatch(conn)

    def _dispatch(self, conn: _Conn) -> None:
        """Hand the complete head in ``conn.buf`` to a worker (or answer a bad one here)."""
        end = head_end(conn.buf)
        if end < 0 or end > MAX_HEAD_BYTES + 4:
            too_large = simple_answer("431 Request Header Fields Too Large", b"request head too large\n")
            self._start_writing(conn, [too_large], False)
            return
        head = bytes(conn.buf[:end]).rstrip(b"\r\n")
        del conn.buf[:end]
        try:
            request = parse_head(head)
        except BadRequestError as exc:
            log.debug("%s: %s: %s", conn.peer, exc.status, exc)
            self._start_writing(conn, [simple_answer(exc.status, f"{exc}\n".encode())], False)
            return
        conn.requests += 1
        conn.empty = 0
        conn.started = False
        keep_alive = request.keep_alive and conn.requests < self.max_requests and not self._stop
        self._enter(conn, _WORKING, None, 0)
        if self._gone is not None:
            with contextlib.suppress(OSError):
                fd = conn.sock.fileno()
                self._gone.register(fd, select.EPOLLRDHUP)
                self._gone_fds[fd] = conn
        self.workers.submit(conn.client, (conn, request, keep_alive), shared=_shared_answer(request))

    def _environ(self, conn: _Conn, request: Request) -> dict[str, Any]:
        env: dict[str, Any] = {
            "REQUEST_METHOD": request.method, "SCRIPT_NAME": "", "PATH_INFO": unquote(request.path, "latin-1"),
            "QUERY_STRING": request.query, "SERVER_PROTOCOL": request.version,
            "SERVER_NAME": str(self.server_address[0]), "SERVER_PORT": str(self.server_port),
            "SERVER_SOFTWARE": f"accelstats/{__version__}",
            "REMOTE_ADDR": conn.client if isinstance(conn.peer, tuple) else "",
            "wsgi.version": (1, 0), "wsgi.url_scheme": "https" if conn.tls else "http",
            "wsgi.input": io.BytesIO(), "wsgi.errors": sys.stderr,
            "wsgi.multithread": True, "wsgi.multiprocess": False, "wsgi.run_once": False,
        }
        if conn.tls:
            env["HTTPS"] = "on"
        for name, value in request.headers:
            if "_" in name:  # as wsgiref: X_Forwarded could pose as X-Forwarded
                continue
            key = name.upper().replace("-", "_")
            if key not in ("CONTENT_TYPE", "CONTENT_LENGTH"):
                key = "HTTP_" + key
            env[key] = f"{env[key]},{value}" if key in env else value
        return env

    def _work(self, job: tuple[_Conn, Request, bool]) -> Callable[[], None] | None:
        """On a worker: run the app for one request; returns the call that hands the answer to the loop,
        None when the loop closed the connection meanwhile (evicted). A client that has closed its
        side (``POLLRDHUP``: it sent FIN, e.g. connect, send, close) is not answered and its request
        not run, as nginx does ("client prematurely closed connection"): such requests cost a flood
        nothing and would delay the scrapes behind them."""
        conn, request, keep_alive = job
        conn.started = True
        if conn.closed:
            return None
        out: list[bytes] | None
        if _peer_gone(conn.sock):
            out = None
        else:
            out, keep_alive = self._respond(conn, request, keep_alive)

        def deliver() -> None:
            self._done.append((conn, out, keep_alive))
            self._wake()

        return deliver

    def _respond(self, conn: _Conn, request: Request, keep_alive: bool) -> tuple[list[bytes], bool]:
        """Run the app; ``([head, body], keep_alive)``. HEAD: the head only, with the ``Content-Length``
        the app gave, or the length of the body it returned."""
        started: list[tuple[str, list[tuple[str, str]]]] = []
        parts: list[bytes] = []

        def start_response(status: str, headers: list[tuple[str, str]],
                           exc_info: Any = None) -> Callable[[bytes], None]:
            if started and exc_info is None:
                raise AssertionError("start_response called twice without exc_info")
            started[:] = [(status, list(headers))]
            return parts.append

        try:
            result = self.app(self._environ(conn, request), start_response)
            try:
                parts.extend(result)
            finally:
                close = getattr(result, "close", None)
                if close is not None:
                    close()
            if not started:
                raise AssertionError("the app returned without start_response")
            status, headers = started[0]
            body = b"".join(parts)
            lines = [f"HTTP/1.1 {status}"]
            length = None
            for name, value in headers:
                if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
                    raise ValueError(f"header {name!r}: line break in the value")
                if name.lower() == "content-length":
                    length = value
                if name.lower() not in _HOP:
                    lines.append(f"{name}: {value}")
            if request.method != "HEAD":
                lines.append(f"Content-Length: {len(body)}")
            elif length is not None or body:
                lines.append(f"Content-Length: {length if length is not None else len(body)}")
            lines.append(f"Date: {formatdate(usegmt=True)}")
            if not keep_alive:
                lines.append("Connection: close")
            elif request.version == "HTTP/1.0":
                lines.append("Connection: keep-alive")
            head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        except Exception as exc:  # a failing app or a bad header: 500, the server goes on
            log.error("%s %s: %s: %s", request.method, request.target[:200], type(exc).__name__, exc,
                      exc_info=log.isEnabledFor(logging.DEBUG))
            return [simple_answer("500 Internal Server Error", b"internal error, see the exporter's log\n")], False
        return ([head] if request.method == "HEAD" or not body else [head, body]), keep_alive

    # -- answers

    def _start_writing(self, conn: _Conn, out: list[bytes], keep_alive: bool) -> None:
        if out and out[0][:5] == b"HTTP/" and out[0][8:9] == b" " and out[0][9:12].isdigit():
            self.counters.answered(out[0][9:12].decode())
        conn.out = deque(memoryview(b) for b in out if b)
        conn.keep_alive = keep_alive
        conn.unsent = sum(len(b) for b in conn.out)
        self._unsent += conn.unsent
        self._enter(conn, _WRITING, self.write_timeout, selectors.EVENT_WRITE)
        # Answers a client does not read stay in memory until write_timeout: past the budget the
        # oldest unread ones go (each connection's bytes counted, shared bodies as often as shared).
        while self._unsent > self.output_budget and self._evict_one(keep=conn, state=_WRITING):
            pass
        self._write(conn)

    def _write(self, conn: _Conn) -> None:
        while conn.out:
            data = conn.out[0]
            try:
                n = conn.sock.send(data[:_CHUNK])  # TLS: a retry after WANT_WRITE passes the same bytes
            except (BlockingIOError, InterruptedError, ssl.SSLWantWriteError):
                self._want(conn, selectors.EVENT_WRITE)
                return
            except ssl.SSLWantReadError:
                self._want(conn, selectors.EVENT_READ)
                return
            except OSError as exc:
                log.debug("%s: %s", conn.peer, exc)
                self._close(conn)
                return
            conn.unsent -= n
            self._unsent -= n
            if n < len(data):
                conn.out[0] = data[n:]
            else:
                conn.out.popleft()
        if not conn.keep_alive:
            self._linger(conn)
            return
        self._enter(conn, _IDLE if not conn.buf else _READING,
                    self.idle_timeout if not conn.buf else self.header_timeout)
        self._read(conn)  # a pipelined request, or bytes TLS has decrypted already

    def _linger(self, conn: _Conn) -> None:
        """Half-close, then read (and drop) what the client still sends, up to 64 KiB or
        :data:`LINGER_TIMEOUT`: closing with unread bytes would reset the connection before the client
        read our answer."""
        conn.buf = bytearray()
        try:
            conn.sock.shutdown(socket.SHUT_WR)  # on TLS this also drops the TLS layer: no close_notify
        except OSError:
            self._close(conn)
            return
        self._enter(conn, _LINGER, LINGER_TIMEOUT)
        self._linger_read(conn)

    def _linger_read(self, conn: _Conn) -> None:
        while True:
            try:
                data = conn.sock.recv(16384)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self._close(conn)
                return
            conn.drained += len(data)
            if not data or conn.drained > 65536:
                self._close(conn)
                return


def _shared_answer(request: Request) -> bool:
    """Whether concurrent requests like ``request`` share their cost: ``/metrics`` without a ``name[]``
    filter joins the collection in progress and its encoded body; ``/healthz`` and ``/`` cost
    nothing. Other requests (filtered ones, any other path) are capped per client address."""
    if request.method not in ("GET", "HEAD") or request.path not in ("/metrics", "/healthz", "/"):
        return False
    return "name[]" not in parse_qs(request.query)


def _peer_gone(sock: socket.socket) -> bool:
    """Whether the client has closed its side of ``sock`` or the connection failed (``poll`` with
    ``POLLRDHUP``, Linux; without it, a FIN shows as readable with nothing to read, which is not
    told apart from a pipelined request: False)."""
    rdhup = getattr(select, "POLLRDHUP", 0)
    if not rdhup:
        return False
    try:
        fd = sock.fileno()
        if fd < 0:
            return True
        poller = select.poll()
        poller.register(fd, rdhup | select.POLLHUP | select.POLLERR)
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return True


def _listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket: ``host ""`` is every interface, IPv6 and IPv4 on one socket
    (IPV6_V6ONLY off), IPv4 only where the host has no IPv6. Backlog: ``SOMAXCONN`` (socketserver's
    default of 5 overflowed with 50 concurrent scrapers; benchmarks/load.py), capped by the kernel at
    net.core.somaxconn. Raises OSError whose ``strerror`` is the system's alone (``create_server``
    appends the address to it)."""
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
    """Start serving on ``host:port`` in a daemon thread; ``host ""`` is every interface, IPv6 and
    IPv4 (IPv4 only where the host has no IPv6). ``web``: the ``--web-config`` file (TLS when it has
    ``tls_server_config``; basic auth and headers through :class:`accelstats.web.auth.BasicAuth`).

    Returns ``(server, thread)``; call ``server.shutdown()`` then ``server.server_close()`` to stop.
    Raises OSError when the address cannot be bound (e.g. EADDRINUSE).
    """
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
