"""The app of ``accelstats serve``: a request in, ``(status, headers, body)`` out (served by
:mod:`accelstats.web.server`, which frames the answer).

``/metrics`` (one collection shared by concurrent scrapes, encoded once per collection and format:
:class:`SharedExposition`), ``/healthz`` and a landing page at ``/``. GET and HEAD only: any other
method gets ``405`` with ``Allow: GET, HEAD`` and never collects; HEAD gets a GET's headers and no body
(``HEAD /metrics`` does not collect, so it has no ``Content-Length``). ``Accept`` chooses the format
(:func:`negotiate`; an unknown element is passed over, never a 500), ``Accept-Encoding`` gzip with its
q-values (:func:`gzip_wanted`). The server's own counters (:class:`ServerCounters`) follow the
collection's families.
"""

from __future__ import annotations

import contextlib
import gzip
import html
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from accelstats import __version__, catalog
from accelstats.manager import AcceleratorManager, Collection
from accelstats.web.exposition import OPENMETRICS, AccelstatsCollector, FastEncoder, supported
from accelstats.web.exposition import TEXT as TEXT_FORMAT

if TYPE_CHECKING:
    from accelstats.web.source import WebConfigSource

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Request:
    """One request as the app sees it: ``method`` (``"GET"``), ``path`` (percent-decoded as Latin-1),
    ``query`` (as sent), ``headers`` (lower-case names; a repeated field's values joined by ``,``, RFC
    9110 §5.3), ``client`` (the peer's address; ``""`` when unknown)."""

    method: str
    path: str
    query: str = ""
    headers: Mapping[str, str] = field(default_factory=dict)
    client: str = ""


Answer = tuple[int, list[tuple[str, str]], bytes]  # status code, headers, body (the server frames it)
App = Callable[[Request], Answer]
Encoder = Callable[[Any], bytes]

LANDING = """<!doctype html>
<html><head><title>accelstats</title></head><body>
<h1>accelstats {version}</h1>
<p>Per-container accelerator metrics (NVIDIA GPUs, MIG, MPS, file devices).</p>
<ul><li><a href="metrics">/metrics</a> &mdash; Prometheus exposition</li>
<li><a href="healthz">/healthz</a> &mdash; liveness</li></ul>
<p>{nvidia}</p>
</body></html>
"""
NVIDIA_STATE = {  # accelstats_nvml_state, in words, for the landing page
    "ready": "NVIDIA: NVML ready, {devices} device(s).",
    "no_device": "NVIDIA: this host has no NVIDIA device ({reason}); GPU families are absent, by design.",
    "unavailable": "NVIDIA: NVML unavailable: {reason}. The exporter retries by itself; see its log.",
    "": "NVIDIA: not read yet (the first scrape of /metrics reads it).",
}
ALLOW = "GET, HEAD"
TEXT = "text/plain; charset=utf-8"

# -- content negotiation ----------------------------------------------------------------------------

_ESCAPINGS = frozenset({"allow-utf-8", "underscores", "dots", "values"})  # client_python's _get_escaping
_KNOWN_VERSIONS = {"application/openmetrics-text": ("", "1.0.0"), "text/plain": ("", "0.0.4", "1.0.0")}


def _qvalue(params: Iterable[str]) -> float:
    """The ``q`` parameter among ``params`` (``["q=0.5", …]``), 1.0 when absent, 0.0 when it is not a
    number in [0, 1] (RFC 9110 §12.4.2: an element with a broken weight is not taken as acceptable)."""
    for param in params:
        key, _, value = param.partition("=")
        if key.strip().lower() == "q":
            try:
                q = float(value.strip())
            except ValueError:
                return 0.0
            return q if 0.0 <= q <= 1.0 else 0.0
    return 1.0


def gzip_wanted(accept_encoding: str) -> bool:
    """Whether to gzip for this ``Accept-Encoding`` value: ``gzip`` (or ``x-gzip``) listed with a
    q-value above 0 (RFC 9110 §12.5.3; the highest weight when listed twice). ``gzip;q=0`` is a
    refusal, and ``*`` alone is not taken as a request for gzip (the identity answer is always
    acceptable). prometheus_client's ``gzip_accepted`` ignores q-values."""
    best: float | None = None
    for element in accept_encoding.split(","):
        coding, *params = element.split(";")
        if coding.strip().lower() in ("gzip", "x-gzip"):
            q = _qvalue(params)
            best = q if best is None else max(best, q)
    return best is not None and best > 0.0


def negotiate(accept: str) -> tuple[Encoder, str, str]:
    """``(encoder, content type, canonical Accept)`` for an ``Accept`` header value.

    Elements this exporter can serve are kept in the client's order, rewritten canonically
    (``application/openmetrics-text; version=1.0.0``, ``text/plain; version=0.0.4|1.0.0``, an
    ``escaping`` client_python knows); others (other media types, unknown versions such as
    ``version=x`` or ``2.0.0``, weight 0) are dropped, and client_python's ``choose_encoder`` picks from
    what is left, falling back to text 0.0.4. Never raises (``choose_encoder`` raises TypeError on a
    version that is not a number)."""
    kept: list[str] = []
    for element in accept.split(","):
        media, *params = element.split(";")
        media = media.strip().lower()
        versions = _KNOWN_VERSIONS.get(media)
        if versions is None or _qvalue(params) == 0.0:
            continue
        version, escaping = "", ""
        for param in params:
            key, _, value = param.partition("=")
            key, value = key.strip().lower(), value.strip().strip('"')
            if key == "version":
                version = value
            elif key == "escaping" and value in _ESCAPINGS:
                escaping = value
        if version not in versions:
            continue
        kept.append(media + (f"; version={version}" if version else "")
                    + (f"; escaping={escaping}" if escaping else ""))
    canonical = ",".join(kept)
    try:
        encoder, content_type = choose_encoder(canonical)
    except (TypeError, ValueError):  # not expected after the filter above; the text format then
        encoder, content_type = choose_encoder("")
        canonical = ""
    return encoder, content_type, canonical


# -- the app -----------------------------------------------------------------------------------------


# zlib level of gzipped bodies (benchmarks/exposition.py): for the 2.2 MB body of 8 GPUs x 1000 containers,
# levels 1 to 3 took 10 ms for 390 KB, level 6 22 ms for 356 KB, level 9 (gzip's default) 36 ms for 344 KB.
GZIP_LEVEL = 1
MAX_FILTERS = 16  # name[] filters whose bodies are kept per collection (Prometheus sends none)
# Costly bodies: a name[] filter or an escaping the fast encoder does not write (dots, values), encoded by
# prometheus_client (0.11 to 0.26 s against 0.02 to 0.05 s for 8 GPUs x 1000 containers). At most this many
# in progress per address (more: 429) and in all (more: 503): each one running takes a share of the GIL
# from the scrapes (32 addresses with filters of their own: scraper p50 x 5.4 to 6.7 at 1 in all, x 6.8 at 2,
# x 42 to 46 uncapped; tests/web/test_http_encodings.py, docs/performance.md); kept up to COSTLY_BYTES a collection.
COSTLY_PER_CLIENT, MAX_COSTLY = 1, 1
COSTLY_BYTES = 16 << 20
RETRY_AFTER = "1"  # seconds, in a 429 or 503 for a costly body (about one costly encoding)


class BusyError(Exception):
    """A costly body refused for now: ``code`` 429 when its address has :data:`COSTLY_PER_CLIENT` in
    progress, 503 when :data:`MAX_COSTLY` are in progress in all; the message says which."""

    def __init__(self, code: int, why: str) -> None:
        super().__init__(why)
        self.code = code


BodyKey = tuple[str, bool, "tuple[str, ...] | None"]  # (format or content type, gzip, names)


class SharedExposition:
    """``/metrics`` bodies shared by the scrapes that share a collection.

    :meth:`AcceleratorManager.collect` hands one collection to every scrape that arrived while it ran,
    and rendering and encoding it is the larger part of a big scrape (63 of 121 ms for 8 GPUs and 1000
    containers, docs/performance.md): the body is kept for the newest collection, per format, gzip
    (:func:`gzip_wanted`) and ``name[]`` filter (client_python's ``restricted_registry``). Formats
    whose bytes are the same share one body (the fast encoder's :func:`supported`: text 0.0.4 and 1.0.0,
    the escapings that leave names alone), so the fast bodies of a collection are at most four (text,
    OpenMetrics, each plain and gzipped) whatever ``Accept`` rotates through; a scrape that wants a body
    another thread is making waits for it (one encoding per body). *Costly* bodies (a filter, or an
    escaping only prometheus_client writes) are admitted :data:`COSTLY_PER_CLIENT` per address and
    :data:`MAX_COSTLY` in all at once (:class:`BusyError` otherwise, before any collection) and kept for at
    most :data:`MAX_FILTERS` filters and :data:`COSTLY_BYTES` per collection. ``extra`` collectors (the
    server's counters) follow the collection's families, read when the body is encoded.
    """

    def __init__(self, manager: AcceleratorManager, extra: Sequence[Collector] = (), fast: bool = True) -> None:
        self.manager = manager
        self.extra = tuple(extra)
        self.fast = FastEncoder() if fast else None  # None: prometheus_client's encoders for every body
        self._lock = threading.Lock()  # held only to look at or change what follows
        self._collection: Collection | None = None
        self._bodies: dict[BodyKey, bytes] = {}  # of self._collection
        self._making: dict[BodyKey, threading.Event] = {}  # bodies of self._collection being made, set when done
        self._costly_bytes = 0  # of the costly bodies kept
        self._costly: dict[str, int] = {}  # client address -> costly bodies in progress
        self._refusals = 0
        self.encodings = 0  # bodies encoded, gzip not counted (a counter for tests and benchmarks)

    def body(self, accept: str, accept_encoding: str, names: Iterable[str] | None = None,
             client: str = "") -> tuple[bytes, list[tuple[str, str]]]:
        """(body, headers) for one scrape from address ``client``: one collection (shared), encoded once
        per collection, format and ``names`` (a ``name[]`` filter: only those families; None: every
        family). Raises :class:`BusyError` for a costly body over its caps."""
        encoder, content_type, _ = negotiate(accept)
        compress = gzip_wanted(accept_encoding)
        wanted = tuple(sorted(set(names))) if names is not None else None
        fmt = supported(content_type)
        key = (fmt or content_type, compress, wanted)
        if wanted is None and fmt is not None:
            body = self._body(self.manager.collect(), key, encoder)
        else:
            with self._admitted(client):
                body = self._body(self.manager.collect(), key, encoder)
        headers = [("Content-Type", content_type)]
        if compress:
            headers.append(("Content-Encoding", "gzip"))
        return body, headers

    @contextlib.contextmanager
    def _admitted(self, client: str) -> Iterator[None]:
        """Count a costly body in progress for ``client``; :class:`BusyError` when over a cap (logged once)."""
        with self._lock:
            busy = None
            if self._costly.get(client, 0) >= COSTLY_PER_CLIENT:
                busy = BusyError(429, f"{COSTLY_PER_CLIENT} filtered or re-escaped /metrics per address at a time")
            elif sum(self._costly.values()) >= MAX_COSTLY:
                busy = BusyError(503, f"{MAX_COSTLY} filtered or re-escaped /metrics bodies in progress")
            if busy is not None:
                self._refusals += 1
                if self._refusals == 1:
                    log.warning("/metrics from %s refused (%d): %s; later refusals are counted in "
                                "accelstats_http_requests_total", client or "?", busy.code, busy)
                raise busy
            self._costly[client] = self._costly.get(client, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                self._costly[client] -= 1
                if not self._costly[client]:
                    del self._costly[client]

    def _body(self, collection: Collection, key: BodyKey, encoder: Encoder) -> bytes:
        """The body ``key`` of ``collection``: gzip is made from the plain body."""
        kind, compress, wanted = key
        if compress:
            plain = self._body(collection, (kind, False, wanted), encoder)
            return self._shared(collection, key, lambda: gzip.compress(plain, compresslevel=GZIP_LEVEL))
        return self._shared(collection, key, lambda: self._encode(collection, kind, encoder, wanted))

    def _shared(self, collection: Collection, key: BodyKey, make: Callable[[], bytes]) -> bytes:
        """The body ``key`` of ``collection``: kept, or waited for while another thread makes it, or
        made here (and kept, see the class). A collection older than the newest seen is made apart."""
        while True:
            with self._lock:
                if self._collection is None or collection.started > self._collection.started:
                    self._collection, self._bodies, self._making, self._costly_bytes = collection, {}, {}, 0
                older = collection is not self._collection
                body = None if older else self._bodies.get(key)
                if body is not None:
                    return body
                waiting = None if older else self._making.get(key)
                if waiting is None and not older:
                    making = self._making[key] = threading.Event()
                    break
            if waiting is None:  # older: made outside the lock, which make() takes itself (_encode counts under it)
                return make()
            waiting.wait()  # then kept, or not (over the bounds, or the maker failed): made here next turn
        try:
            body = make()
            with self._lock:
                if collection is self._collection and self._keep(key, len(body)):
                    self._bodies[key] = body
        finally:
            with self._lock:
                if self._making.get(key) is making:
                    del self._making[key]
            making.set()
        return body

    def _keep(self, key: BodyKey, size: int) -> bool:
        """Whether to keep a body of ``size`` bytes (caller holds the lock): the fast ones always; a
        costly one within :data:`MAX_FILTERS` filters and :data:`COSTLY_BYTES`."""
        kind, _, wanted = key
        if wanted is None and kind in (TEXT_FORMAT, OPENMETRICS):
            return True
        if len({k[2] for k in self._bodies} | {wanted}) > MAX_FILTERS + 1 or self._costly_bytes + size > COSTLY_BYTES:
            return False
        self._costly_bytes += size
        return True

    def _encode(self, collection: Collection, kind: str, encoder: Encoder, wanted: tuple[str, ...] | None) -> bytes:
        """``collection`` encoded: the fast encoder's ``kind`` when it writes it, else ``encoder``."""
        with self._lock:
            self.encodings += 1
        if wanted is None and kind in (TEXT_FORMAT, OPENMETRICS) and self.fast is not None:
            rest = CollectorRegistry(auto_describe=False)  # the catalog straight to bytes, the same as below
            for collector in self.extra:
                rest.register(collector)
            return self.fast.encode(collection, kind).encode("utf-8") + encoder(rest)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(AccelstatsCollector(lambda: collection))
        for collector in self.extra:
            registry.register(collector)
        return encoder(registry.restricted_registry(wanted) if wanted is not None else registry)


def make_app(manager: AcceleratorManager, extra: Sequence[Collector] = ()) -> App:
    """The app: ``/metrics`` (a body shared by scrapes that share a collection, see
    :class:`SharedExposition`; gzip and OpenMetrics by request; ``name[]`` filters the same
    way), ``/healthz``, ``/``; GET and HEAD only (405 otherwise, no collection); HEAD of ``/metrics``
    collects nothing and answers an empty body (the server sends no body for HEAD). ``extra``:
    collectors whose families follow the collection's (the server's counters)."""
    shared = SharedExposition(manager, extra)

    def landing() -> bytes:
        """The landing page, with the NVIDIA state of the newest collection (none is started for it)."""
        latest = manager.latest
        snap = latest.snapshot if latest is not None else None
        state = snap.nvml_state if snap is not None and snap.nvml_state in NVIDIA_STATE else ""
        nvidia = NVIDIA_STATE[state].format(reason=html.escape(snap.nvml_status if snap is not None else ""),
                                            devices=len(snap.devices) if snap is not None else 0)
        return LANDING.format(version=__version__, nvidia=nvidia).encode()

    def metrics(request: Request) -> Answer:
        _, content_type, canonical = negotiate(request.headers.get("accept", ""))
        compress = gzip_wanted(request.headers.get("accept-encoding", ""))
        if request.method == "HEAD":  # probes: no collection, so no Content-Length either
            return 200, [("Content-Type", content_type)] + ([("Content-Encoding", "gzip")] if compress else []), b""
        try:
            body, headers = shared.body(canonical, "gzip" if compress else "", parse_qs(request.query).get("name[]"),
                                        request.client)
        except BusyError as busy:
            return busy.code, [("Content-Type", TEXT), ("Retry-After", RETRY_AFTER)], f"busy: {busy}; retry\n".encode()
        return 200, headers, body

    def app(request: Request) -> Answer:
        if request.method not in ("GET", "HEAD"):
            return 405, [("Content-Type", TEXT), ("Allow", ALLOW)], b"method not allowed: use GET or HEAD\n"
        if request.path == "/metrics":
            return metrics(request)
        if request.path == "/healthz":
            return 200, [("Content-Type", TEXT)], b"ok\n"
        if request.path == "/":
            return 200, [("Content-Type", "text/html; charset=utf-8")], landing()
        return 404, [("Content-Type", TEXT)], b"not found: try /metrics\n"

    return app


# -- the server's counters --------------------------------------------------------------------------

REFUSED_REASONS = ("limit", "evicted", "tls_handshake_timeout", "header_timeout", "idle_timeout", "write_timeout")


class ServerCounters(Collector):
    """The server's own counters as a collector: ``accelstats_http_connections_refused_total{reason}``
    (catalog.HTTP_REFUSED; every reason of :data:`REFUSED_REASONS`, from 0),
    ``accelstats_http_requests_total{code}`` (catalog.HTTP_REQUESTS: answers written, by status code;
    200 from 0) and, when ``web`` is set,
    ``accelstats_web_config_reload_failures_total`` (catalog.WEB_CONFIG_RELOAD_FAILURES, read from
    ``web.reload_failures``, 0 where the source does not count).

    ``refused`` and ``answers`` are written by the event-loop thread only; reading them from another
    is safe."""

    def __init__(self, web: WebConfigSource | None = None) -> None:
        super().__init__()
        self.web = web
        self.refused = dict.fromkeys(REFUSED_REASONS, 0)
        self.answers: dict[str, int] = {"200": 0}

    def answered(self, code: str) -> None:
        """One more answer with status ``code`` (three digits) written."""
        self.answers[code] = self.answers.get(code, 0) + 1

    def count(self, reason: str) -> None:
        """One more connection closed unserved for ``reason`` (one of :data:`REFUSED_REASONS`)."""
        self.refused[reason] += 1

    def collect(self) -> Iterator[Metric]:
        """The families with their current values."""
        spec = catalog.HTTP_REFUSED
        refused = CounterMetricFamily(spec.name, spec.help, labels=list(spec.labels))
        for reason in REFUSED_REASONS:
            refused.add_metric([reason], float(self.refused[reason]))
        yield refused
        spec = catalog.HTTP_REQUESTS
        answers = CounterMetricFamily(spec.name, spec.help, labels=list(spec.labels))
        for code, n in sorted(dict(self.answers).items()):
            answers.add_metric([code], float(n))
        yield answers
        if self.web is not None:
            spec = catalog.WEB_CONFIG_RELOAD_FAILURES
            yield CounterMetricFamily(spec.name, spec.help, value=float(getattr(self.web, "reload_failures", 0)))
