"""The web configuration file of Prometheus' exporter-toolkit (``accelstats serve --web-config FILE``).

The format is exporter-toolkit's ``docs/web-configuration.md`` (YAML, read strictly: an unknown or
duplicated key is an error), so one file serves node_exporter and accelstats alike::

    tls_server_config:
      cert_file: server.pem            # relative paths: relative to this file's directory
      key_file: server.key
      client_auth_type: RequireAndVerifyClientCert   # NoClientCert (default), VerifyClientCertIfGiven
      client_ca_file: clients-ca.pem
      min_version: TLS12               # TLS10 .. TLS13; default TLS12 .. TLS13
      cipher_suites: [TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256]   # Go names; TLS 1.2 and below
    http_server_config:
      headers: {X-Frame-Options: deny}
    basic_auth_users:
      prometheus: $2b$10$...           # bcrypt hashes only

What Python's ``ssl`` cannot do the way Go's ``crypto/tls`` does is refused with the key named rather
than approximated: ``RequestClientCert``/``RequireAnyClientCert`` (accepting a client certificate
without verifying it), inline ``cert``/``key`` (OpenSSL loads the chain from files),
``curve_preferences``, ``client_allowed_sans`` and ``rate_limit``. ``http_server_config.http2`` is
accepted and has no effect: accelstats serves HTTP/1.1 only (ALPN ``http/1.1``), which every HTTP/2
client falls back to. Every error is a :class:`WebConfigError`:
``web config /etc/accelstats/web.yml: tls_server_config.cert_file: …``.

:class:`WebConfigSource` re-reads the file, and the certificate, key and CA files, when one of them
changes (checked on every connection and request), as exporter-toolkit re-reads them per connection;
while the new contents are broken it refuses requests (fails closed) and logs the error once.
"""

from __future__ import annotations

import logging
import os
import re
import ssl
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from accelstats.config import ConfigError

log = logging.getLogger(__name__)

# exporter-toolkit web/tls_config.go ConfigToTLSConfig; the values Python's ssl can honour.
CLIENT_AUTH = {
    "NoClientCert": ssl.CERT_NONE,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
UNVERIFIED_CLIENT_AUTH = ("RequestClientCert", "RequireAnyClientCert", "RequireClientCert")
TLS_VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1, "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2, "TLS13": ssl.TLSVersion.TLSv1_3,
}
# Go's tls.CipherSuites() names (IANA) -> OpenSSL names, as `openssl ciphers -stdname` pairs them
# (tests/test_webconfig.py checks every pair against it). None: a TLS 1.3 suite, which neither Go
# nor OpenSSL's cipher list configures: accepted and ignored, as Go does.
GO_CIPHERS: dict[str, str | None] = {
    "TLS_RSA_WITH_AES_128_CBC_SHA": "AES128-SHA",
    "TLS_RSA_WITH_AES_256_CBC_SHA": "AES256-SHA",
    "TLS_RSA_WITH_AES_128_GCM_SHA256": "AES128-GCM-SHA256",
    "TLS_RSA_WITH_AES_256_GCM_SHA384": "AES256-GCM-SHA384",
    "TLS_AES_128_GCM_SHA256": None,
    "TLS_AES_256_GCM_SHA384": None,
    "TLS_CHACHA20_POLY1305_SHA256": None,
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA": "ECDHE-ECDSA-AES128-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA": "ECDHE-ECDSA-AES256-SHA",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA": "ECDHE-RSA-AES128-SHA",
    "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA": "ECDHE-RSA-AES256-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256": "ECDHE-ECDSA-AES128-GCM-SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384": "ECDHE-ECDSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256": "ECDHE-RSA-AES128-GCM-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384": "ECDHE-RSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-RSA-CHACHA20-POLY1305",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-ECDSA-CHACHA20-POLY1305",
}
# exporter-toolkit web/handler.go extraHTTPHeaders: the only headers it lets a file set, and the
# values allowed where they are an enumeration (empty: any value).
HEADERS: dict[str, tuple[str, ...]] = {
    "Strict-Transport-Security": (), "X-Content-Type-Options": ("nosniff",),
    "X-Frame-Options": ("deny", "sameorigin"), "X-XSS-Protection": (), "Content-Security-Policy": (),
}
BCRYPT_HASH = re.compile(r"\$2[abxy]\$(\d\d)\$[./A-Za-z0-9]{53}")

_REFUSED = {
    "rate_limit": "not supported by accelstats",
    "tls_server_config.cert": "inline certificates are not supported (OpenSSL loads them from files): use cert_file",
    "tls_server_config.key": "inline keys are not supported (OpenSSL loads them from files): use key_file",
    "tls_server_config.curve_preferences": "not supported (Python's ssl sets a single ECDH curve, not a list)",
    "tls_server_config.client_allowed_sans": "not supported by accelstats",
}
_KNOWN = {
    "": ("tls_server_config", "http_server_config", "basic_auth_users", "rate_limit"),
    "tls_server_config": ("cert_file", "key_file", "client_auth_type", "client_ca_file", "client_ca",
                          "min_version", "max_version", "cipher_suites", "prefer_server_cipher_suites",
                          "cert", "key", "curve_preferences", "client_allowed_sans"),
    "http_server_config": ("http2", "headers"),
}


class WebConfigError(ConfigError):
    """A web configuration file that cannot be used; the message is ``web config FILE: KEY: reason``
    (KEY is a dotted path such as ``tls_server_config.cert_file``; absent for file-level errors)."""


@dataclass(frozen=True)
class TLSServerConfig:
    """``tls_server_config``: absolute paths (relative ones resolved against the file's directory)."""

    cert_file: Path
    key_file: Path
    client_auth_type: str = "NoClientCert"
    client_ca_file: Path | None = None
    client_ca: str = ""  # inline PEM
    min_version: ssl.TLSVersion = ssl.TLSVersion.TLSv1_2
    max_version: ssl.TLSVersion = ssl.TLSVersion.TLSv1_3
    cipher_suites: tuple[str, ...] = ()  # Go (IANA) names
    prefer_server_cipher_suites: bool = True

    def files(self) -> tuple[Path, ...]:
        """The files this configuration reads (watched for changes)."""
        return (self.cert_file, self.key_file) + ((self.client_ca_file,) if self.client_ca_file else ())


@dataclass(frozen=True)
class WebConfig:
    """One parsed web configuration file: ``tls`` None = plain HTTP; ``users`` (name, bcrypt hash)
    pairs, none = no basic auth; ``headers`` added to every response."""

    path: Path
    tls: TLSServerConfig | None = None
    headers: tuple[tuple[str, str], ...] = ()
    users: tuple[tuple[str, bytes], ...] = ()
    http2: bool = True


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate mapping keys (Go's yaml.UnmarshalStrict does)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, (str, int, float, bool)) and key is not None:
                continue  # an unhashable key: SafeLoader reports it
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def load_web_config(path: Path) -> WebConfig:
    """Read and validate ``path``. Raises :class:`WebConfigError` naming the file and the key at fault.

    Only the YAML is checked here; :func:`build_ssl_context` reads the certificate files.
    """
    p = _Parser(path)
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_StrictLoader)  # a SafeLoader
    except OSError as exc:
        raise p.error("", f"cannot read: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise p.error("", f"not UTF-8 text: {exc}") from exc
    except yaml.YAMLError as exc:
        raise p.error("", f"invalid YAML: {exc}".replace("\n", " ")) from exc
    top = p.table("", data)
    tls = p.tls(p.table("tls_server_config", top.get("tls_server_config")))
    http = p.table("http_server_config", top.get("http_server_config"))
    http2 = p.typed("http_server_config.http2", http.get("http2", True), bool)
    return WebConfig(path=path, tls=tls, headers=p.headers(http.get("headers")),
                     users=p.users(top.get("basic_auth_users")), http2=http2)


class _Parser:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.folder = path.absolute().parent

    def error(self, key: str, reason: str) -> WebConfigError:
        return WebConfigError(f"web config {self.path}: {key + ': ' if key else ''}{reason}")

    def typed(self, key: str, value: Any, kind: type) -> Any:
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            raise self.error(key, f"expected {'a mapping' if kind is dict else kind.__name__}, "
                                  f"got {type(value).__name__} {value!r}")
        return value

    def table(self, key: str, value: Any) -> dict[str, Any]:
        table: dict[str, Any] = self.typed(key or "(top level)", {} if value is None else value, dict)
        for name in table:
            full = f"{key}.{name}" if key else str(name)
            if full in _REFUSED:
                raise self.error(full, _REFUSED[full])
            if key in _KNOWN and name not in _KNOWN[key]:
                raise self.error(full, f"unknown key (known: {', '.join(_KNOWN[key])})")
        return table

    def file(self, key: str, value: Any) -> Path | None:
        text = self.typed(key, "" if value is None else value, str)
        return None if text == "" else self.folder / text  # an absolute text replaces the folder

    def tls(self, table: dict[str, Any]) -> TLSServerConfig | None:
        if not table:
            return None
        k = "tls_server_config."
        cert, key = self.file(k + "cert_file", table.get("cert_file")), self.file(k + "key_file", table.get("key_file"))
        if cert is None or key is None:
            raise self.error(k + ("cert_file" if cert is None else "key_file"),
                             "required when tls_server_config is set (both cert_file and key_file)")
        auth = self.typed(k + "client_auth_type", table.get("client_auth_type") or "NoClientCert", str)
        if auth in UNVERIFIED_CLIENT_AUTH:
            raise self.error(k + "client_auth_type", f"{auth} (a client certificate accepted without verification) "
                             "is not supported: use RequireAndVerifyClientCert or VerifyClientCertIfGiven")
        if auth not in CLIENT_AUTH:
            raise self.error(k + "client_auth_type", f"unknown value {auth!r} (known: {', '.join(CLIENT_AUTH)})")
        ca_file = self.file(k + "client_ca_file", table.get("client_ca_file"))
        ca_text = self.typed(k + "client_ca", table.get("client_ca") or "", str)
        if ca_file is not None and ca_text:
            raise self.error(k + "client_ca", "set together with client_ca_file: give only one")
        if auth == "NoClientCert" and (ca_file or ca_text):
            raise self.error(k + "client_auth_type", "client CAs are configured but client_auth_type is "
                             "NoClientCert: set RequireAndVerifyClientCert or VerifyClientCertIfGiven")
        if auth != "NoClientCert" and not (ca_file or ca_text):
            raise self.error(k + "client_ca_file", f"required with client_auth_type {auth} "
                             "(the CA that signs the client certificates)")
        versions = [self.version(k + name, table.get(name), default)
                    for name, default in (("min_version", "TLS12"), ("max_version", "TLS13"))]
        if versions[0] > versions[1]:
            raise self.error(k + "min_version", "is above max_version")
        suites = self.typed(k + "cipher_suites", table.get("cipher_suites") or [], list)
        for i, name in enumerate(suites):
            if self.typed(f"{k}cipher_suites[{i}]", name, str) not in GO_CIPHERS:
                raise self.error(f"{k}cipher_suites[{i}]", f"unknown cipher suite {name!r} "
                                 f"(known: Go's tls.CipherSuites() names, {', '.join(GO_CIPHERS)})")
        prefer = self.typed(k + "prefer_server_cipher_suites", table.get("prefer_server_cipher_suites", True), bool)
        return TLSServerConfig(cert_file=cert, key_file=key, client_auth_type=auth, client_ca_file=ca_file,
                               client_ca=ca_text, min_version=versions[0], max_version=versions[1],
                               cipher_suites=tuple(suites), prefer_server_cipher_suites=prefer)

    def version(self, key: str, value: Any, default: str) -> ssl.TLSVersion:
        name = self.typed(key, value or default, str)
        if name not in TLS_VERSIONS:
            raise self.error(key, f"unknown TLS version {name!r} (known: {', '.join(TLS_VERSIONS)})")
        return TLS_VERSIONS[name]

    def headers(self, value: Any) -> tuple[tuple[str, str], ...]:
        out = []
        for name, text in self.typed("http_server_config.headers", value or {}, dict).items():
            key = f"http_server_config.headers.{name}"
            if name not in HEADERS:
                raise self.error(key, f"this header cannot be configured (known: {', '.join(HEADERS)})")
            text = self.typed(key, "" if text is None else text, str)
            if text and HEADERS[name] and text not in HEADERS[name]:
                raise self.error(key, f"expected one of {', '.join(HEADERS[name])}, got {text!r}")
            if text:  # "Unset if blank" (web-configuration.md)
                out.append((name, text))
        return tuple(out)

    def users(self, value: Any) -> tuple[tuple[str, bytes], ...]:
        out = []
        for name, hashed in self.typed("basic_auth_users", value or {}, dict).items():
            if not isinstance(name, str):
                raise self.error("basic_auth_users", f"user name {name!r} is not a string (quote it)")
            key = f"basic_auth_users.{name}"
            text = self.typed(key, hashed, str)
            m = BCRYPT_HASH.fullmatch(text)
            if m is None or not 4 <= int(m.group(1)) <= 31:
                raise self.error(key, "not a bcrypt hash ($2b$<cost>$<53 characters>, cost 04-31); make one "
                                 "with htpasswd -nBC 10 \"\" or python3 -c 'import bcrypt; …' (docs/web-config.md)")
            out.append((name, text.encode("ascii")))
        return tuple(out)


def build_ssl_context(config: WebConfig) -> ssl.SSLContext:
    """A server-side ``SSLContext`` for ``config.tls`` (which must be set). Reads the certificate, key
    and CA files; raises :class:`WebConfigError` naming the key whose file is missing or does not load."""
    tls = config.tls
    assert tls is not None
    p = _Parser(config.path)
    k = "tls_server_config."
    for key, path in (("cert_file", tls.cert_file), ("key_file", tls.key_file), ("client_ca_file", tls.client_ca_file)):
        if path is not None and not os.access(path, os.R_OK):
            reason = "no such file" if not path.exists() else "not readable"
            raise p.error(k + key, f"{path}: {reason}")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    if tls.min_version < ssl.TLSVersion.TLSv1_2:
        log.warning("web config %s: tls_server_config.min_version: set below TLS12, but %s refuses TLS 1.0 and 1.1 "
                    "at its default security level (OpenSSL 3): clients still need TLS 1.2", config.path,
                    ssl.OPENSSL_VERSION)
    with warnings.catch_warnings():  # ssl's DeprecationWarning for TLSv1/TLSv1_1: the log line above says it
        warnings.simplefilter("ignore", DeprecationWarning)
        ctx.minimum_version, ctx.maximum_version = tls.min_version, tls.max_version
    try:
        ssl.create_default_context(cafile=str(tls.cert_file))  # parses the certificate(s) alone
    except (ssl.SSLError, ValueError) as exc:
        raise p.error(k + "cert_file", f"{tls.cert_file}: not a PEM certificate ({exc})") from exc
    try:
        ctx.load_cert_chain(tls.cert_file, tls.key_file)
    except ssl.SSLError as exc:
        raise p.error(k + "key_file", f"{tls.key_file}: not a PEM private key (unencrypted) for "
                      f"cert_file ({exc})") from exc
    if tls.client_ca_file is not None or tls.client_ca:
        where = k + ("client_ca_file" if tls.client_ca_file else "client_ca")
        try:
            if tls.client_ca_file is not None:
                ctx.load_verify_locations(cafile=str(tls.client_ca_file))
            else:
                ctx.load_verify_locations(cadata=tls.client_ca)
        except (ssl.SSLError, ValueError) as exc:
            raise p.error(where, f"no PEM CA certificate could be loaded ({exc})") from exc
    ctx.verify_mode = CLIENT_AUTH[tls.client_auth_type]
    names = [n for n in (GO_CIPHERS[s] for s in tls.cipher_suites) if n]
    if names:
        try:
            ctx.set_ciphers(":".join(names))
        except ssl.SSLError as exc:
            raise p.error(k + "cipher_suites", f"OpenSSL enables none of them here ({exc})") from exc
    if tls.prefer_server_cipher_suites:
        ctx.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
    else:
        ctx.options &= ~ssl.OP_CIPHER_SERVER_PREFERENCE
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


def _signature(paths: tuple[Path, ...]) -> tuple[tuple[int, int, int] | None, ...]:
    out: list[tuple[int, int, int] | None] = []
    for path in paths:
        try:
            st = path.stat()
        except OSError:
            out.append(None)
        else:
            out.append((st.st_mtime_ns, st.st_size, st.st_ino))
    return tuple(out)


class WebConfigSource:
    """The web configuration in force, reloaded when the file or a file it names changes.

    Construction loads and checks everything (raises :class:`WebConfigError`). ``tls_enabled`` is fixed
    then: switching between HTTP and HTTPS needs a restart, and a changed file that would switch is an
    error. :meth:`current` is thread-safe and cheap when nothing changed (one ``stat`` per watched file).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        config = load_web_config(path)
        self.initial = config  # as loaded at start-up
        self.tls_enabled = config.tls is not None
        self._watched = self._files(config)
        self._sig = _signature(self._watched)
        self._state = self._build(config)
        self._error: WebConfigError | None = None

    def _files(self, config: WebConfig) -> tuple[Path, ...]:
        return (self.path,) + (config.tls.files() if config.tls else ())

    def _build(self, config: WebConfig) -> tuple[WebConfig, ssl.SSLContext | None]:
        if (config.tls is not None) != self.tls_enabled:
            raise WebConfigError(f"web config {self.path}: tls_server_config: "
                                 f"{'added' if config.tls else 'removed'}; switching between HTTP and HTTPS "
                                 "needs a restart")
        return config, build_ssl_context(config) if config.tls else None

    def _reload(self) -> None:
        try:
            config = load_web_config(self.path)
            files = self._files(config)
            if files != self._watched:
                self._watched, self._sig = files, _signature(files)
            self._state, self._error = self._build(config), None
            log.info("web config %s reloaded", self.path)
        except WebConfigError as exc:
            self._error = exc
            log.error("%s; refusing requests until it is fixed", exc)

    def current(self) -> tuple[WebConfig, ssl.SSLContext | None]:
        """``(config, ssl_context)`` now in force (context None without TLS); raises WebConfigError while
        the changed file (or a certificate file it names) is broken."""
        with self._lock:
            sig = _signature(self._watched)
            if sig != self._sig:
                self._sig = sig
                self._reload()
            if self._error is not None:
                raise self._error
            return self._state
