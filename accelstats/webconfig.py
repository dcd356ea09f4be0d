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
``web config /etc/accelstats/web.yml: tls_server_config.cert_file: …``; no error or log line ever holds
a bcrypt hash or any other value of ``basic_auth_users`` (YAML errors name the line and column, never
quote the line). The file is read only when it is a regular file of at most :data:`MAX_FILE_BYTES`, and
a document that aliases expand past :data:`MAX_NODES` nodes ("billion laughs") is an error, as Go's
yaml.v2 refuses "excessive aliasing".

:class:`WebConfigSource` re-reads the file, and the certificate, key and CA files, when one of them
changes (checked on every connection and request), as exporter-toolkit re-reads them per connection.
A reload never lowers security: a changed file that is broken (empty, half written, invalid, a key
that does not match its certificate) or that would turn basic auth or TLS off, switch to HTTPS, or
lower ``client_auth_type`` or ``min_version`` is refused; the configuration in force stays, one error
is logged per refused change and :attr:`WebConfigSource.reload_failures` counts it. Those changes
need a restart. :func:`security_warnings` (a world-writable file, a world-readable private key, a
certificate outside its validity period) are logged at start and at every reload.
"""

from __future__ import annotations

import base64
import binascii
import logging
import os
import re
import ssl
import stat
import threading
import warnings
from dataclasses import dataclass
from datetime import datetime, timezone
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
# The 22nd salt character carries 2 of the salt's 128 bits: bcrypt (pyca's and OpenBSD's) refuses a
# hash whose last salt character has any of its 4 low bits set.
_BCRYPT_SALT_LAST = frozenset(".Oeu")
# Anything that looks like a bcrypt hash or a piece of one: cut out of every error message.
_SECRET = re.compile(r"\$2[abxy]?\$[0-9]{2}\$[./A-Za-z0-9]*")
MAX_FILE_BYTES = 1 << 20  # a web config is a few hundred bytes; one with 10000 users is about 800 KiB
MAX_NODES = 100_000  # YAML nodes once aliases are expanded (the file's own nodes count too)

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
    (KEY is a dotted path such as ``tls_server_config.cert_file``; absent for file-level errors), one
    line, with anything shaped like a bcrypt hash cut out."""


def _redact(text: str) -> str:
    """``text`` on one line with every bcrypt hash (or piece of one) replaced by ``$2…(hidden)``."""
    return _SECRET.sub("$2…(hidden)", text.replace("\n", " "))


def _short(value: object, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters (a value from the file: never unbounded)."""
    text = repr(value) if isinstance(value, (str, int, float, bool)) or value is None else type(value).__name__
    return text if len(text) <= limit else text[:limit] + "…"


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
    """SafeLoader that refuses duplicate mapping keys (Go's yaml.UnmarshalStrict does), recursive
    aliases, and documents that aliases expand past :data:`MAX_NODES` nodes (checked on the composed
    node graph, before anything is constructed)."""

    def get_single_node(self) -> yaml.Node | None:
        node = super().get_single_node()
        if node is not None:
            _expanded_size(node, MAX_NODES)
        return node

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, (str, int, float, bool)) and key is not None:
                continue  # an unhashable key: SafeLoader reports it
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {_short(key)}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def _expanded_size(root: yaml.Node, limit: int) -> int:
    """Nodes in ``root`` with every alias expanded (each node once per reference); raises
    ``yaml.composer.ComposerError`` past ``limit`` or for an alias inside the node it names. Memoised
    per node, so a "billion laughs" document costs one visit per distinct node."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def size(node: yaml.Node) -> int:
        known = sizes.get(id(node))
        if known is not None:
            return known
        if id(node) in open_nodes:
            raise yaml.composer.ComposerError(None, None, "an alias refers to a node that contains it "
                                              "(recursive alias)", node.start_mark)
        open_nodes.add(id(node))
        children: list[yaml.Node] = []
        if isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        total = 1
        for child in children:
            total += size(child)
            if total > limit:
                raise yaml.composer.ComposerError(None, None, f"aliases expand the document past {limit} nodes "
                                                  "(a YAML alias bomb?)", node.start_mark)
        open_nodes.discard(id(node))
        sizes[id(node)] = total
        return total

    return size(root)


def _yaml_reason(exc: yaml.YAMLError) -> str:
    """PyYAML's error as ``problem (context) at line L, column C``: without the quoted line PyYAML's
    own message carries (which may hold a bcrypt hash)."""
    if isinstance(exc, yaml.MarkedYAMLError):
        words = [w for w in (exc.problem, exc.context and f"({exc.context})") if w]
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        return " ".join(words) + where
    return str(exc)


def _read_bounded(path: Path) -> str:
    """The text of ``path``: a regular file (a FIFO or device would block or never end) of at most
    :data:`MAX_FILE_BYTES`. Raises OSError, UnicodeDecodeError, or ValueError saying what is wrong."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("not a regular file")
        data = f.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise ValueError(f"larger than {MAX_FILE_BYTES} bytes")
    return data.decode("utf-8")


def load_web_config(path: Path) -> WebConfig:
    """Read and validate ``path``. Raises :class:`WebConfigError` naming the file and the key at fault.

    Only the YAML is checked here; :func:`build_ssl_context` reads the certificate files.
    """
    p = _Parser(path)
    try:
        text = _read_bounded(path)
    except OSError as exc:
        raise p.error("", f"cannot read: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise p.error("", f"not UTF-8 text (byte {exc.start})") from exc
    except ValueError as exc:
        raise p.error("", f"cannot read: {exc}") from exc
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # a SafeLoader
    except yaml.YAMLError as exc:
        raise p.error("", f"invalid YAML: {_yaml_reason(exc)}") from exc
    except RecursionError as exc:
        raise p.error("", "invalid YAML: nested too deeply") from exc
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
        return WebConfigError(_redact(f"web config {self.path}: {key + ': ' if key else ''}{reason}"))

    def typed(self, key: str, value: Any, kind: type) -> Any:
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            # the value itself only when it is a number, a boolean or null: a string may be a secret
            # (a mis-indented "user:$2b$..."), and a list or mapping may be an alias bomb
            shown = f" {value!r}" if value is None or isinstance(value, (int, float)) else ""
            raise self.error(key, f"expected {'a mapping' if kind is dict else kind.__name__}, "
                                  f"got {type(value).__name__}{shown}")
        return value

    def table(self, key: str, value: Any) -> dict[str, Any]:
        table: dict[str, Any] = self.typed(key or "(top level)", {} if value is None else value, dict)
        for name in table:
            full = f"{key}.{name}" if key else str(name)
            if full in _REFUSED:
                raise self.error(full, _REFUSED[full])
            if key in _KNOWN and name not in _KNOWN[key]:
                full = full if len(full) <= 80 else full[:80] + "…"
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
            raise self.error(k + "client_auth_type", f"unknown value {_short(auth)} (known: {', '.join(CLIENT_AUTH)})")
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
                raise self.error(f"{k}cipher_suites[{i}]", f"unknown cipher suite {_short(name)} "
                                 f"(known: Go's tls.CipherSuites() names, {', '.join(GO_CIPHERS)})")
        prefer = self.typed(k + "prefer_server_cipher_suites", table.get("prefer_server_cipher_suites", True), bool)
        return TLSServerConfig(cert_file=cert, key_file=key, client_auth_type=auth, client_ca_file=ca_file,
                               client_ca=ca_text, min_version=versions[0], max_version=versions[1],
                               cipher_suites=tuple(suites), prefer_server_cipher_suites=prefer)

    def version(self, key: str, value: Any, default: str) -> ssl.TLSVersion:
        name = self.typed(key, value or default, str)
        if name not in TLS_VERSIONS:
            raise self.error(key, f"unknown TLS version {_short(name)} (known: {', '.join(TLS_VERSIONS)})")
        return TLS_VERSIONS[name]

    def headers(self, value: Any) -> tuple[tuple[str, str], ...]:
        out = []
        for name, text in self.typed("http_server_config.headers", value or {}, dict).items():
            key = f"http_server_config.headers.{name}"
            if name not in HEADERS:
                raise self.error(key, f"this header cannot be configured (known: {', '.join(HEADERS)})")
            text = self.typed(key, "" if text is None else text, str)
            if text and HEADERS[name] and text not in HEADERS[name]:
                raise self.error(key, f"expected one of {', '.join(HEADERS[name])}, got {_short(text)}")
            if text:  # "Unset if blank" (web-configuration.md)
                out.append((name, text))
        return tuple(out)

    def users(self, value: Any) -> tuple[tuple[str, bytes], ...]:
        out = []
        for name, hashed in self.typed("basic_auth_users", value or {}, dict).items():
            if not isinstance(name, str):
                raise self.error("basic_auth_users", f"user name {_short(name)} is not a string (quote it)")
            key = f"basic_auth_users.{name}"
            text = self.typed(key, hashed, str)
            m = BCRYPT_HASH.fullmatch(text)
            if m is None or not 4 <= int(m.group(1)) <= 31 or text[28] not in _BCRYPT_SALT_LAST:
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


_CLIENT_AUTH_RANK = {"NoClientCert": 0, "VerifyClientCertIfGiven": 1, "RequireAndVerifyClientCert": 2}
_TLS_NAMES = {v: k for k, v in TLS_VERSIONS.items()}


def weakening(old: WebConfig, new: WebConfig) -> tuple[str, str] | None:
    """``(key, reason)`` when ``new`` may not replace ``old`` while running, else None.

    Refused: turning TLS off (``tls_server_config`` removed or empty) or on (the listening socket is
    plain: switching needs a restart either way), turning basic auth off (``basic_auth_users`` removed
    or empty), and lowering ``client_auth_type`` (RequireAndVerifyClientCert > VerifyClientCertIfGiven >
    NoClientCert) or ``min_version``. A file written in place is briefly empty or cut short, and so
    looks like each of these; a deliberate change of this kind takes a restart. Fewer users, other
    passwords, other headers or certificates are not a weakening.
    """
    if (old.tls is None) != (new.tls is None):
        return ("tls_server_config", "removed (or empty): turning TLS off needs a restart" if new.tls is None
                else "added: switching from HTTP to HTTPS needs a restart")
    if old.users and not new.users:
        return "basic_auth_users", "removed (or empty): turning basic auth off needs a restart"
    if old.tls is not None and new.tls is not None:
        before, after = old.tls.client_auth_type, new.tls.client_auth_type
        if _CLIENT_AUTH_RANK[after] < _CLIENT_AUTH_RANK[before]:
            return "tls_server_config.client_auth_type", f"lowered from {before} to {after}: needs a restart"
        if new.tls.min_version < old.tls.min_version:
            return ("tls_server_config.min_version", f"lowered from {_TLS_NAMES[old.tls.min_version]} to "
                    f"{_TLS_NAMES[new.tls.min_version]}: needs a restart")
    return None


def _der_element(der: bytes, pos: int) -> tuple[int, int, int]:
    """``(tag, content start, content end)`` of the DER element at ``pos``; ValueError when malformed."""
    if pos + 2 > len(der):
        raise ValueError("truncated DER")
    tag, length, pos = der[pos], der[pos + 1], pos + 2
    if length & 0x80:
        count = length & 0x7F
        if not 1 <= count <= 4 or pos + count > len(der):
            raise ValueError("bad DER length")
        length, pos = int.from_bytes(der[pos:pos + count], "big"), pos + count
    if pos + length > len(der):
        raise ValueError("truncated DER")
    return tag, pos, pos + length


def _der_time(der: bytes, pos: int) -> tuple[datetime, int]:
    """An X.509 ``Time`` (RFC 5280 4.1.2.5: UTCTime ``YYMMDDHHMMSSZ``, years 50-99 meaning 19xx, or
    GeneralizedTime ``YYYYMMDDHHMMSSZ``) at ``pos``, and the position after it."""
    tag, start, end = _der_element(der, pos)
    text = der[start:end].decode("ascii")
    if tag == 0x17 and len(text) == 13:
        year = int(text[:2])
        text = f"{1900 + year if year >= 50 else 2000 + year}{text[2:]}"
    elif tag != 0x18 or len(text) != 15:
        raise ValueError("not a UTCTime or GeneralizedTime")
    return datetime.strptime(text, "%Y%m%d%H%M%SZ").replace(tzinfo=timezone.utc), end


def certificate_validity(path: Path) -> tuple[datetime, datetime] | None:
    """``(notBefore, notAfter)`` in UTC of the first PEM certificate in ``path`` (the server's own
    certificate: the chain follows it), from the DER of RFC 5280's TBSCertificate; None when the file
    cannot be read or parsed (OpenSSL reports a bad certificate when it loads it)."""
    try:
        text = _read_bounded(path)
        m = re.search(r"-----BEGIN CERTIFICATE-----(.+?)-----END CERTIFICATE-----", text, re.S)
        if m is None:
            return None
        der = base64.b64decode("".join(m.group(1).split()), validate=True)
        _, cert, _ = _der_element(der, 0)  # Certificate ::= SEQUENCE
        _, pos, _ = _der_element(der, cert)  # tbsCertificate ::= SEQUENCE
        tag, _, end = _der_element(der, pos)
        if tag == 0xA0:  # [0] EXPLICIT version
            pos = end
        for _ in range(3):  # serialNumber, signature, issuer
            pos = _der_element(der, pos)[2]
        _, pos, _ = _der_element(der, pos)  # validity ::= SEQUENCE { notBefore, notAfter }
        not_before, pos = _der_time(der, pos)
        not_after, _ = _der_time(der, pos)
    except (OSError, ValueError, binascii.Error):  # UnicodeDecodeError is a ValueError
        return None
    return not_before, not_after


def _open_to_others(path: Path, bit: int) -> int | None:
    """``path``'s mode when it has ``bit`` (``S_IROTH``, ``S_IWOTH``) and every directory above the
    file it names is searchable by others (so that every user can reach it), else None."""
    try:
        real = path.resolve()
        mode = real.stat().st_mode
        if not mode & bit:
            return None
        if not all(parent.stat().st_mode & stat.S_IXOTH for parent in real.parents):
            return None
    except OSError:
        return None
    return mode


def security_warnings(config: WebConfig, now: datetime | None = None) -> list[str]:
    """One line per risk in ``config``'s files (naming the file, never its contents): the web config
    writable by every user (anyone on the host could add a user or swap the certificate), the private
    key readable by every user (a file mode that allows it, in directories that every user can
    search: a 0644 key under a 0700 directory is not reported), the server certificate expired or not
    yet valid at ``now`` (default: the current time; clients refuse it, as Go's and OpenSSL's verifiers
    do)."""
    out = []
    mode = _open_to_others(config.path, stat.S_IWOTH)
    if mode is not None:
        out.append(f"web config {config.path}: writable by every user on this host (mode "
                   f"{stat.S_IMODE(mode):04o}): anyone here can add a user or change the certificate; chmod o-w")
    if config.tls is not None:
        where = f"web config {config.path}: tls_server_config."
        mode = _open_to_others(config.tls.key_file, stat.S_IROTH)
        if mode is not None:
            out.append(f"{where}key_file: {config.tls.key_file}: readable by every user on this host (mode "
                       f"{stat.S_IMODE(mode):04o}): anyone here can read the private key; chmod o-r")
        validity = certificate_validity(config.tls.cert_file)
        now = now or datetime.now(timezone.utc)
        if validity is not None and now > validity[1]:
            out.append(f"{where}cert_file: {config.tls.cert_file}: the certificate expired on "
                       f"{validity[1]:%Y-%m-%d %H:%M:%S} UTC: clients will refuse it")
        elif validity is not None and now < validity[0]:
            out.append(f"{where}cert_file: {config.tls.cert_file}: the certificate is not valid before "
                       f"{validity[0]:%Y-%m-%d %H:%M:%S} UTC: clients will refuse it until then")
    return out


_Stat = tuple[int, int, int, int] | None


def _stat(path: Path) -> _Stat:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino)


def _signature(paths: tuple[Path, ...]) -> tuple[_Stat, ...]:
    return tuple(_stat(path) for path in paths)


class WebConfigSource:
    """The web configuration in force, reloaded when the file or a file it names changes.

    Construction loads and checks everything (raises :class:`WebConfigError`) and logs
    :func:`security_warnings`. ``tls_enabled`` is fixed then. :meth:`current` is thread-safe and cheap
    when nothing changed (one ``stat`` per watched file). A change is applied when it loads in full
    and :func:`weakening` has nothing against it (the warnings are logged again); otherwise it is
    refused: the configuration in force stays, one error naming the file, the key and the reason is
    logged, and ``reload_failures`` (refused changes since start, for
    ``accelstats_web_config_reload_failures_total``) goes up by one. The next change is tried again.
    Files are ``stat``-ed before they are read, so a change made while reading is seen next time.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self.reload_failures = 0
        self.refused: WebConfigError | None = None  # why the file on disk is not the one in force
        seen = {path: _stat(path)}
        config = load_web_config(path)
        files = self._files(config)
        seen.update({f: _stat(f) for f in files if f not in seen})
        self._state = (config, build_ssl_context(config) if config.tls else None)
        self.initial = config  # as loaded at start-up
        self.tls_enabled = config.tls is not None
        self._watched = files
        self._sig = tuple(seen[f] for f in files)
        for line in security_warnings(config):
            log.warning("%s", line)

    def _files(self, config: WebConfig) -> tuple[Path, ...]:
        return (self.path,) + (config.tls.files() if config.tls else ())

    def _reload(self, seen: dict[Path, _Stat]) -> None:
        """Try the files as they are now (``seen``: their signatures, taken before reading)."""
        old = self._state[0]
        watched = list(self._files(old))
        try:
            config = load_web_config(self.path)
            for f in self._files(config):  # watched even when refused: fixing a new key file retries
                if f not in seen:
                    seen[f] = _stat(f)
                if f not in watched:
                    watched.append(f)
            why = weakening(old, config)
            if why is not None:
                raise _Parser(self.path).error(*why)
            state = (config, build_ssl_context(config) if config.tls else None)
        except WebConfigError as exc:
            self.reload_failures += 1
            self.refused = exc
            log.error("%s; change refused, the configuration loaded before stays in force", exc)
        else:
            self._state, self.refused = state, None
            watched = list(self._files(config))
            log.info("web config %s reloaded", self.path)
            for line in security_warnings(config):
                log.warning("%s", line)
        self._watched = tuple(watched)
        self._sig = tuple(seen[f] if f in seen else _stat(f) for f in self._watched)

    def current(self) -> tuple[WebConfig, ssl.SSLContext | None]:
        """``(config, ssl_context)`` in force (context None without TLS): the last configuration that
        loaded in full without lowering security. Never raises after construction."""
        with self._lock:
            sig = _signature(self._watched)
            if sig != self._sig:
                self._reload(dict(zip(self._watched, sig, strict=True)))
            return self._state
