"""Basic auth and extra response headers from the web configuration file, as a WSGI wrapper.

Behaviour follows exporter-toolkit's ``web/handler.go``: the configuration is consulted on every
request (:class:`~accelstats.webconfig.WebConfigSource` reloads it when it changed; while it is broken
every request gets 500), the configured headers go on every response, and with ``basic_auth_users``
set a request needs ``Authorization: Basic`` with a listed user and the password of its bcrypt hash.
A wrong or missing one gets ``401`` with ``WWW-Authenticate: Basic realm="accelstats"``.

One difference, on purpose: ``/healthz`` answers without credentials (a liveness probe should not need
a secret, and it says only ``ok``); ``/``, ``/metrics`` and everything else need them. TLS client
certificates, when required, are checked for every path, before any request is read.

bcrypt costs 50-250 ms per check (cost 10-12), so successful checks are cached: up to
:data:`CACHE_SIZE` keyed by an HMAC (per-process random key) of user, hash and password, so no
password is kept in the clear. Failed checks are not cached, and bcrypt runs one check at a time, so
a flood of wrong passwords costs one core, not all of them. User names are compared in constant time
against every configured user, and an unknown user still pays one bcrypt check (exporter-toolkit's
fixed-hash defence against user enumeration by timing).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import bcrypt

from accelstats.webconfig import WebConfig, WebConfigError, WebConfigSource

log = logging.getLogger(__name__)

StartResponse = Callable[..., Any]
WSGIApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]

CACHE_SIZE = 100
REALM = "accelstats"
OPEN_PATHS = frozenset({"/healthz"})
# bcrypt (cost 10) of a random string nobody knows: checked for unknown users so that they take as
# long as known ones.
_NO_SUCH_USER = b"$2b$10$2VPOAPIAhOYE18jx8AFHBOjdbheFay1dfPb7Q2D4NwrlTfOk16tde"
_BCRYPT_MAX = 72  # bytes; bcrypt ignores (pyca's raises on) anything longer, Go's bcrypt refuses it


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


class BasicAuth:
    """WSGI wrapper: configured headers on every response; basic auth when ``basic_auth_users`` is set."""

    def __init__(self, app: WSGIApp, source: WebConfigSource) -> None:
        self.app = app
        self.source = source
        self._key = os.urandom(32)
        self._ok: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()
        self._bcrypt = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        try:
            config, _ = self.source.current()
        except WebConfigError:  # logged by the source when it broke
            start_response("500 Internal Server Error", [("Content-Type", "text/plain; charset=utf-8")])
            return [b"web configuration is broken, see the exporter's log\n"]

        def start(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            present = {name.lower() for name, _ in headers}
            extra = [(n, v) for n, v in config.headers if n.lower() not in present]
            return start_response(status, headers + extra, exc_info)

        if not config.users or environ.get("PATH_INFO", "/") in OPEN_PATHS:
            return self.app(environ, start)
        creds = parse_basic(environ.get("HTTP_AUTHORIZATION", ""))
        if creds is not None and self.check(config, *creds):
            return self.app(environ, start)
        start("401 Unauthorized", [("Content-Type", "text/plain; charset=utf-8"),
                                   ("WWW-Authenticate", f'Basic realm="{REALM}"')])
        return [b"Unauthorized\n"]

    def check(self, config: WebConfig, user: bytes, password: bytes) -> bool:
        """True when ``user`` is configured and ``password`` matches its bcrypt hash (cached when true)."""
        hashed = None
        for name, candidate in config.users:  # every user, no early exit: constant time in the match
            if hmac.compare_digest(name.encode("utf-8"), user):
                hashed = candidate
        key = hmac.new(self._key, b"%d:%s%d:%s%s" % (len(user), user, len(hashed or b""), hashed or b"", password),
                       hashlib.sha256).digest()
        if hashed is not None:
            with self._lock:
                if key in self._ok:
                    self._ok.move_to_end(key)
                    return True
        if len(password) > _BCRYPT_MAX:
            return False
        with self._bcrypt:
            ok = bcrypt.checkpw(password, hashed or _NO_SUCH_USER)
        if ok and hashed is not None:
            with self._lock:
                self._ok[key] = None
                while len(self._ok) > CACHE_SIZE:
                    self._ok.popitem(last=False)
            return True
        return False
