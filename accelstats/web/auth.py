"""Basic auth and extra response headers from the web configuration file, wrapped around the app.

As exporter-toolkit's ``web/handler.go``: the configuration in force is consulted on every request, its
headers go on every answer, and with ``basic_auth_users`` a request needs ``Authorization: Basic`` with a
listed user and the password of its bcrypt hash, else ``401``; ``/healthz`` answers without (it says
only ``ok``). Unlike it (docs/security.md): no user enumeration by timing (:meth:`BasicAuth.verify`:
every failed check costs one check at the highest configured cost); bcrypt once per scraper (successes
cached as HMAC keys, never passwords); guesses from other prefixes cannot starve a scraper
(:class:`CheckGate`: bounded slots and waiters, round-robin by client prefix and address, the heaviest
prefix shed first, ``503`` with ``Retry-After: 1`` when shed); failures logged at info, at most a line
a second, naming a user only when it is a configured one.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import bcrypt

from accelstats.web.app import TEXT, Answer, App, Request
from accelstats.web.config import WebConfig
from accelstats.web.refused import RefusedMemory
from accelstats.web.source import REQUEST_WAIT, WebConfigSource

log = logging.getLogger(__name__)

CACHE_SIZE = 256  # successful checks remembered (a few scrapers, a few users each)
REALM = "accelstats"
OPEN_PATHS = frozenset({"/healthz"})
MAX_WAIT = 5.0  # seconds a check may wait for a bcrypt slot before it is answered 503
LOG_INTERVAL = 1.0  # seconds between two log lines about failed checks
_BCRYPT_MAX = 72  # bytes; bcrypt ignores (pyca's raises on) anything longer, Go's bcrypt refuses it
_BCRYPT_ALPHABET = "./ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


BCRYPT_SLOTS = max(1, min(4, _cpus() // 2))  # concurrent bcrypt checks: a flood takes half the CPUs, 4 at most
MAX_WAITING = 4  # checks waiting for a slot (each holds an HTTP worker thread; accelstats.web.server.WORKERS is 64)
PER_SOURCE_WAITING = 2  # of which from one client address
LOAD_HALF_LIFE = 10.0  # seconds: how fast an address's past arrivals stop counting against it (CheckGate)
MAX_ADDRESSES = 4096  # addresses, and prefixes of each length, CheckGate remembers (least recently seen forgotten)
V4_LEVELS = (0, 8, 16, 24, 32)  # prefix lengths an IPv4 client is counted at: all, /8, a provider's /16, a LAN, itself
V6_LEVELS = (0, 32, 48, 64, 128)  # IPv6: all, a provider's /32, a site's /48, a LAN's /64, the address
TIE = 2.0  # CheckGate sheds among prefixes with at least 1/TIE of the heaviest one's load


def parse_basic(header: str) -> tuple[bytes, bytes] | None:
    """``(user, password)`` from an ``Authorization`` header value, None when it is not valid Basic
    (RFC 7617: ``Basic base64(user ":" password)``; the scheme is case-insensitive)."""
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        raw = base64.b64decode(token.strip(), validate=True)
    except (binascii.Error, ValueError):
        return None
    user, sep, password = raw.partition(b":")
    return (user, password) if sep else None


def dummy_hash(cost: int) -> bytes:
    """A bcrypt hash of cost ``cost`` (4-31) that no password matches in practice: a random salt
    (``bcrypt.gensalt``) and a random 31-character checksum. ``bcrypt.checkpw`` against it costs the
    same as against a real hash of that cost; making it costs nothing."""
    checksum = "".join(secrets.choice(_BCRYPT_ALPHABET) for _ in range(31))
    return bcrypt.gensalt(rounds=cost) + checksum.encode("ascii")


def prefixes(source: str) -> tuple[str, ...]:
    """The nodes a client address is counted under by :class:`CheckGate`, widest first, one per level
    of :data:`V4_LEVELS` (an IPv4 address, or an IPv4-mapped IPv6 one) or :data:`V6_LEVELS`: keys
    such as ``"4:8323072/24"`` (the address's first 24 bits as a number). Anything else (``""``, a
    Unix socket) is one node of its own under a common one at every wider level."""
    try:
        address = ipaddress.ip_address(source.partition("%")[0])  # a scope (fe80::1%eth0) is no part of it
    except ValueError:
        return ("?",) * (len(V4_LEVELS) - 1) + ("?" + source,)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    bits, levels = (32, V4_LEVELS) if address.version == 4 else (128, V6_LEVELS)
    return tuple(f"{address.version}:{int(address) >> (bits - n)}/{n}" for n in levels)


@dataclass(slots=True)
class _Waiter:
    credentials: bytes
    retry: bool
    since: float  # the gate's clock when it began to wait
    event: threading.Event = field(default_factory=threading.Event)
    granted: bool = False
    shed: bool = False


class CheckGate:
    """At most ``slots`` holders at once and ``max_waiting`` waiters (``per_source`` per client
    address); a waiter gives up after ``max_wait`` seconds.

    Arrivals (calls to :meth:`acquire`) and slots handed out are counted per address and per prefix
    (:func:`prefixes`: IPv4 /0, /8, /16, /24, /32; IPv6 /0, /32, /48, /64, /128), each level
    remembering its :data:`MAX_ADDRESSES` most recently seen nodes: fresh addresses from one prefix
    are one heavy prefix, and churning addresses cannot push the few wide prefixes out.

    **Serving**: a freed slot goes to the address whose widest prefix was served least recently
    (never served first), then the next level's, down to the address (ties: the one waiting longest),
    its newest waiter first. So a check from a prefix that has not been served lately goes before the
    waiting checks of a prefix that has, however many addresses these come from. But a check that
    has waited ``max_wait / 2`` goes first (the longest waiting first): one that is never shed is
    served before it times out even when fresh prefixes keep arriving ahead of its own.

    **Shedding** (the shed waiter's :meth:`acquire` returns False at once): a newcomer whose address
    has ``per_source`` waiting pushes out the oldest of them. In a full waiting room the victim is
    found among the waiting addresses and the newcomer, level by level from the widest: only those
    whose prefix has at least 1/:data:`TIE` of the heaviest prefix's load (:meth:`load`) stay in the
    running; among the addresses left, the one with the most waiting checks (the newcomer counting
    one more of its own), then one without a *retry* (a check with ``credentials`` a refused, shed or
    timed-out check of its address had, not served since: a scraper tries its one password again at
    its next scrape, a guesser seldom does; remembered in :class:`accelstats.web.refused.RefusedMemory`,
    which a flood of fresh addresses does not turn over within a scrape interval), then the more
    loaded, then the one that arrived last. Its oldest waiter is shed, or the newcomer refused when
    the victim is its own address with nothing waiting. The gate holds at most ``slots +
    max_waiting`` threads (HTTP workers, of which the server has more).
    """

    def __init__(self, slots: int, max_wait: float, max_waiting: int = 4, per_source: int = 2,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.slots = slots
        self.max_wait = max_wait
        self.max_waiting = max_waiting
        self.per_source = per_source
        self._clock = clock
        self._lock = threading.Lock()
        self._free = slots
        self._waiting: dict[str, list[_Waiter]] = {}  # address -> waiters, oldest first
        self._tick = 0
        self._refused = RefusedMemory()  # (address, credentials) of checks refused and not since served
        levels = range(len(V4_LEVELS))
        self._served: list[OrderedDict[str, int]] = [OrderedDict() for _ in levels]  # node -> tick of its last slot
        self._load: list[OrderedDict[str, tuple[float, float, int]]] = [OrderedDict() for _ in levels]  # node ->
        # (load, when, arrival)

    def acquire(self, source: str, credentials: bytes = b"") -> bool:
        """Take a slot (True); False when shed or after ``max_wait``. Release a slot with :meth:`release`.
        ``credentials``: an opaque token of what is checked (:class:`BasicAuth`: an HMAC of user,
        hash and password), for telling a retry; ``b""``: none."""
        with self._lock:
            self._arrive(source)
            if self._free > 0:
                self._free -= 1
                self._mark(source, credentials)
                return True
            retry = bool(credentials) and self._refused.seen(source, credentials)
            if len(self._waiting.get(source, ())) >= self.per_source:
                self._shed(source)
            elif sum(len(q) for q in self._waiting.values()) >= self.max_waiting:
                victim = self._victim(source, retry)
                if victim == source and not self._waiting.get(source):
                    self._note_refused(source, credentials)
                    return False  # the newcomer itself: its address has nothing waiting to push out
                self._shed(victim)
            waiter = _Waiter(credentials, retry, self._clock())
            self._waiting.setdefault(source, []).append(waiter)  # after the shedding, which may empty it
        waiter.event.wait(self.max_wait)
        with self._lock:
            if waiter.granted or waiter.shed:
                return waiter.granted
            queue = self._waiting[source]  # timed out: still queued (granting or shedding removes it)
            queue.remove(waiter)
            if not queue:
                del self._waiting[source]
            self._note_refused(source, credentials)
            return False

    def release(self) -> None:
        """Hand the slot to the longest waiter if it has waited ``max_wait / 2``, else to the newest
        waiter of the address served least recently, prefix by prefix from the widest; or free it."""
        with self._lock:
            if not self._waiting:
                self._free += 1
                return
            aged = self._clock() - self.max_wait / 2

            def order(address: str) -> tuple[bool, float, list[int]]:
                since = self._waiting[address][0].since
                if since <= aged:
                    return False, since, []
                return True, 0.0, [self._served[n].get(node, -1) for n, node in enumerate(prefixes(address))]

            source = min(self._waiting, key=order)  # ties: first to wait
            queue = self._waiting[source]
            waiter = queue.pop(0) if queue[0].since <= aged else queue.pop()
            if not queue:
                del self._waiting[source]
            waiter.granted = True
            self._mark(source, waiter.credentials)
            waiter.event.set()

    def waiting(self) -> int:
        """Checks waiting for a slot now."""
        with self._lock:
            return sum(len(q) for q in self._waiting.values())

    def load(self, source: str, level: int = -1) -> float:
        """The arrivals (calls to :meth:`acquire`) from ``source``'s prefix at ``level`` (an index into
        :func:`prefixes`; -1, the default: the address itself), each weighing 1 when it came and half as
        much every :data:`LOAD_HALF_LIFE` seconds since; 0 for a prefix not seen (or forgotten)."""
        with self._lock:
            return self._load_now(level % len(V4_LEVELS), prefixes(source)[level], self._clock())[0]

    def _load_now(self, level: int, node: str, now: float) -> tuple[float, int]:
        load, when, arrival = self._load[level].get(node, (0.0, now, 0))
        return load * 0.5 ** ((now - when) / LOAD_HALF_LIFE), arrival

    def _arrive(self, source: str) -> None:
        now = self._clock()
        self._tick += 1
        for level, node in enumerate(prefixes(source)):
            table = self._load[level]
            table[node] = (self._load_now(level, node, now)[0] + 1.0, now, self._tick)
            table.move_to_end(node)
            if len(table) > MAX_ADDRESSES:  # forget the node seen longest ago
                table.popitem(last=False)

    def _victim(self, newcomer: str, retry: bool) -> str:
        """The address to shed from when the waiting room is full and ``newcomer`` arrives (see the
        class's docstring)."""
        now = self._clock()
        chains = {address: prefixes(address) for address in [*self._waiting, newcomer]}
        running = list(chains)
        for level in range(len(V4_LEVELS) - 1):
            loads = {address: self._load_now(level, chains[address][level], now)[0] for address in running}
            heaviest = max(loads.values())
            running = [address for address in running if loads[address] * TIE >= heaviest]

        def rank(address: str) -> tuple[int, bool, float, int]:
            waiters = self._waiting.get(address, [])
            count = len(waiters) + (address == newcomer)
            retrying = any(w.retry for w in waiters) or (address == newcomer and retry)
            load, arrival = self._load_now(len(V4_LEVELS) - 1, chains[address][-1], now)
            return count, not retrying, load, arrival

        return max(running, key=rank)

    def _note_refused(self, source: str, credentials: bytes) -> None:
        if credentials:
            self._refused.note(source, credentials)

    def _mark(self, source: str, credentials: bytes) -> None:
        if credentials:
            self._refused.forget(source, credentials)
        self._tick += 1
        for level, node in enumerate(prefixes(source)):
            table = self._served[level]
            table[node] = self._tick
            table.move_to_end(node)
            if len(table) > MAX_ADDRESSES:  # forget the node served longest ago (it ranks as never served)
                table.popitem(last=False)

    def _shed(self, source: str) -> None:
        queue = self._waiting[source]
        victim = queue.pop(0)
        if not queue:
            del self._waiting[source]
        victim.shed = True
        self._note_refused(source, victim.credentials)
        victim.event.set()


class _FailureLog:
    """Info lines about failed checks, at most one per ``interval`` seconds; the next line says how
    many were left out."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._lock = threading.Lock()
        self._last = -float("inf")
        self._left_out = 0

    def note(self, peer: str, what: str) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last < self.interval:
                self._left_out += 1
                return
            left_out, self._left_out, self._last = self._left_out, 0, now
        more = f" ({left_out} more failed since the previous line)" if left_out else ""
        log.info("basic auth from %s failed: %s%s", peer or "an unknown address", what, more)


class BasicAuth:
    """The app wrapped: configured headers on every answer; basic auth when ``basic_auth_users`` is set.

    ``slots`` (default :data:`BCRYPT_SLOTS`) and ``max_wait`` (default :data:`MAX_WAIT`, seconds)
    configure the :class:`CheckGate` in front of bcrypt."""

    def __init__(self, app: App, source: WebConfigSource, slots: int | None = None,
                 max_wait: float = MAX_WAIT) -> None:
        self.app = app
        self.source = source
        self._key = os.urandom(32)
        self._ok: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()
        self.gate = CheckGate(slots or BCRYPT_SLOTS, max_wait, MAX_WAITING, PER_SOURCE_WAITING)
        self._dummies: dict[int, bytes] = {}  # cost -> dummy hash
        self._failures = _FailureLog(LOG_INTERVAL)

    def __call__(self, request: Request) -> Answer:
        config, _ = self.source.current(REQUEST_WAIT)
        code, headers, body = self._answer(config, request)
        present = {name.lower() for name, _ in headers}
        return code, headers + [(n, v) for n, v in config.headers if n.lower() not in present], body

    def _answer(self, config: WebConfig, request: Request) -> Answer:
        if not config.users or request.path in OPEN_PATHS:
            return self.app(request)
        creds = parse_basic(request.headers.get("authorization", ""))
        if creds is not None:
            ok = self.verify(config, *creds, peer=request.client)
            if ok:
                return self.app(request)
            if ok is None:
                return 503, [("Content-Type", TEXT), ("Retry-After", "1")], b"too many password checks, try again\n"
        return 401, [("Content-Type", TEXT), ("WWW-Authenticate", f'Basic realm="{REALM}"')], b"Unauthorized\n"

    def check(self, config: WebConfig, user: bytes, password: bytes) -> bool:
        """True when ``user`` is configured and ``password`` matches its bcrypt hash (cached when true);
        :meth:`verify` without a client address, a check that could not run counting as False."""
        return self.verify(config, user, password) is True

    def verify(self, config: WebConfig, user: bytes, password: bytes, peer: str = "") -> bool | None:
        """True when ``user`` is configured and ``password`` matches its hash; False when not; None when
        the check got no bcrypt slot (shed, or :data:`MAX_WAIT` passed; the caller answers 503).
        ``peer``: the client address, for fair queueing and the log. A success is cached; a cache hit
        costs one HMAC and never waits.

        Every failed check costs the bcrypt work of one check at the highest configured cost ``top``,
        so that its time tells nothing about the user name: an unknown user is checked against a
        dummy hash of cost ``top``; a known user whose hash has a lower cost ``c`` and whose password
        is wrong is then checked against dummy hashes of costs ``c``, ``c + 1``, …, ``top - 1``
        (bcrypt's work is 2^cost rounds, and 2^c + 2^c + 2^(c+1) + … + 2^(top-1) = 2^top), in the same
        slot. Burning the CPU rather than sleeping keeps the two equal under any load and keeps the
        padding inside the gate's bounds (exporter-toolkit's fixed cost-10 dummy tells a cost-12 user
        apart: 68 ms against 258 ms)."""
        hashed = None
        name = ""
        top = 0
        for candidate_name, candidate in config.users:  # every user, no early exit: constant time
            if hmac.compare_digest(candidate_name.encode("utf-8"), user):
                hashed, name = candidate, candidate_name
            top = max(top, int(candidate[4:6]))
        key = hmac.new(self._key, b"%d:%s%d:%s%s" % (len(user), user, len(hashed or b""), hashed or b"", password),
                       hashlib.sha256).digest()
        if hashed is not None:
            with self._lock:
                if key in self._ok:
                    self._ok.move_to_end(key)
                    return True
        what = f"wrong password for user {name!r}" if hashed is not None else "unknown user"
        if len(password) > _BCRYPT_MAX:
            self._failures.note(peer, what + f" (password over {_BCRYPT_MAX} bytes)")
            return False
        target = hashed if hashed is not None else self._dummy(top)
        if not self.gate.acquire(peer, key):
            who = f"user {name!r}" if hashed is not None else "an unknown user"
            self._failures.note(peer, f"{who} not checked: all {self.gate.slots} bcrypt slots busy and the "
                                      "waiting room full (answered 503)")
            return None
        try:
            ok = _checkpw(password, target)
            if not ok:
                for cost in range(int(target[4:6]), top):  # pad to the work of one cost-`top` check
                    _checkpw(password, self._dummy(cost))
        finally:
            self.gate.release()
        if ok and hashed is not None:
            with self._lock:
                self._ok[key] = None
                while len(self._ok) > CACHE_SIZE:
                    self._ok.popitem(last=False)
            return True
        self._failures.note(peer, what)
        return False

    def _dummy(self, cost: int) -> bytes:
        """This process's dummy hash of ``cost`` (:func:`dummy_hash`, made on first use)."""
        with self._lock:
            hashed = self._dummies.get(cost)
            if hashed is None:
                hashed = self._dummies[cost] = dummy_hash(cost)
            return hashed


def _checkpw(password: bytes, hashed: bytes) -> bool:
    """``bcrypt.checkpw``, False for a hash bcrypt refuses (the loader checks their form, so not expected)."""
    try:
        return bcrypt.checkpw(password, hashed)
    except ValueError:
        return False
