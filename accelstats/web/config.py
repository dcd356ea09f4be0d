"""The web configuration file of Prometheus' exporter-toolkit (``accelstats serve --web-config FILE``).

exporter-toolkit's ``docs/web-configuration.md`` format (YAML read strictly, as Go's
``yaml.UnmarshalStrict``: an unknown or duplicated key is an error), so one file serves node_exporter
and accelstats alike; docs/web-config.md has an example and says what Python's ``ssl`` cannot do as
Go's ``crypto/tls`` does, which is refused with the key named rather than approximated. Every error is
a :class:`WebConfigError` naming the file and the key, and never holds a value of
``basic_auth_users`` (YAML errors name the line and column, never quote it). Files are read only when
regular and at most :data:`MAX_FILE_BYTES`; aliases expanding past :data:`MAX_NODES` nodes are an
error (Go's yaml.v2: "excessive aliasing"). Reloads: :mod:`accelstats.web.source`.
"""

from __future__ import annotations

import logging
import re
import ssl
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from accelstats.settings import ConfigError
from collectors.fsread import read_regular

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
# (tests/web/test_webconfig.py checks every pair against it). None: a TLS 1.3 suite, which neither Go
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
BCRYPT_MIN_COST = 4  # bcrypt's own minimum
# The highest cost accepted: one check of cost 15 takes 1.9-2.0 s of one CPU (AMD EPYC, 2-core VM, pyca
# bcrypt; each step of cost doubles it), paid by every first login, wrong password and unknown user
# (checked against a dummy of the highest configured cost); cost 31 would be 2^16 times that: 36 hours.
BCRYPT_MAX_COST = 15
BCRYPT_WARN_COST = 12  # above it, a warning at each load: each check takes 0.5 s (cost 13) or more
# RFC 9110 5.1 field-name = token; tchar = "!" / "#" / "$" / "%" / "&" / "'" / "*" / "+" / "-" / "." /
# "^" / "_" / "`" / "|" / "~" / DIGIT / ALPHA
HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
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


def _kind(value: object) -> str:
    """The YAML type of ``value`` as an error names it, never the value (a number or a list may hold
    a password given by mistake)."""
    return "null" if value is None else type(value).__name__


def _key_name(key: str, limit: int = 80) -> str:
    """A dotted key for an error, cut to ``limit`` characters (a key from the file: never unbounded)."""
    return key if len(key) <= limit else key[:limit] + "…"


def _unsendable(text: str) -> str | None:
    """Why ``text`` cannot be an HTTP header value, or None when it can: RFC 9110 5.5 allows visible
    ASCII, space, tab and obs-text; sent as Latin-1 (as http.server and the WSGI spec do), so a value
    may hold Latin-1's printable characters (U+00A0-U+00FF) but no CR, LF, NUL or other control
    character (CR/LF would split the header: response splitting) and nothing beyond Latin-1. The
    reason names the character's position and class, never the value."""
    for i, ch in enumerate(text, 1):
        code = ord(ch)
        if ch in "\r\n\0":
            return f"character {i} is a CR, LF or NUL"
        if code > 0xFF:
            return f"character {i} is not Latin-1"
        if (code < 0x20 and ch != "\t") or 0x7F <= code < 0xA0:
            return f"character {i} is a control character"
    return None


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


def _read_bytes(path: Path, limit: int = MAX_FILE_BYTES) -> bytes:
    """The bytes of ``path``, a regular file of at most ``limit`` bytes or a symbolic link to one
    (Kubernetes and certbot mount these files as links), by :func:`collectors.fsread.read_regular`: a
    FIFO or a device is refused without being opened, a larger file refused, not cut. Raises OSError,
    or ValueError saying what is wrong. (A hung network mount still blocks the caller: only start-up
    and :class:`~accelstats.web.source.WebConfigSource`'s own thread read.)"""
    return read_regular(path, limit, past_limit="refuse", follow_symlinks=True).data_or_raise()


def load_web_config(path: Path) -> WebConfig:
    """Read and validate ``path``. Raises :class:`WebConfigError` naming the file and the key at fault.

    Only the YAML is checked here; :func:`build_ssl_context` reads the certificate files.
    """
    p = _Parser(path)
    try:
        text = _read_bytes(path).decode("utf-8")
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
            # the type only, never the value: a number may be a password given unquoted, a string a
            # mis-indented "user:$2b$...", a list or mapping an alias bomb
            raise self.error(key, f"expected {'a mapping' if kind is dict else kind.__name__}, "
                                  f"got {_kind(value)}")
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
            raise self.error(k + "client_auth_type", f"unknown value (known: {', '.join(CLIENT_AUTH)})")
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
                raise self.error(f"{k}cipher_suites[{i}]", "unknown cipher suite "
                                 f"(known: Go's tls.CipherSuites() names, {', '.join(GO_CIPHERS)})")
        prefer = self.typed(k + "prefer_server_cipher_suites", table.get("prefer_server_cipher_suites", True), bool)
        return TLSServerConfig(cert_file=cert, key_file=key, client_auth_type=auth, client_ca_file=ca_file,
                               client_ca=ca_text, min_version=versions[0], max_version=versions[1],
                               cipher_suites=tuple(suites), prefer_server_cipher_suites=prefer)

    def version(self, key: str, value: Any, default: str) -> ssl.TLSVersion:
        name = self.typed(key, value or default, str)
        if name not in TLS_VERSIONS:
            raise self.error(key, f"unknown TLS version (known: {', '.join(TLS_VERSIONS)})")
        return TLS_VERSIONS[name]

    def headers(self, value: Any) -> tuple[tuple[str, str], ...]:
        out = []
        for name, text in self.typed("http_server_config.headers", value or {}, dict).items():
            key = _key_name(f"http_server_config.headers.{name}")
            if not isinstance(name, str) or not HEADER_NAME.fullmatch(name):
                raise self.error(key, "not a header name (an RFC 9110 token: letters, digits, !#$%&'*+-.^_`|~)")
            if name not in HEADERS:
                raise self.error(key, f"this header cannot be configured (known: {', '.join(HEADERS)})")
            text = self.typed(key, "" if text is None else text, str)
            if text and HEADERS[name] and text not in HEADERS[name]:
                raise self.error(key, f"unknown value (known: {', '.join(HEADERS[name])})")
            bad = _unsendable(text)
            if bad:
                raise self.error(key, f"cannot be sent in an HTTP header: {bad}")
            if text:  # "Unset if blank" (web-configuration.md)
                out.append((name, text))
        return tuple(out)

    def users(self, value: Any) -> tuple[tuple[str, bytes], ...]:
        out = []
        for name, hashed in self.typed("basic_auth_users", value or {}, dict).items():
            if not isinstance(name, str):
                raise self.error("basic_auth_users", f"a user name of type {_kind(name)} is not a string (quote it)")
            key = _key_name(f"basic_auth_users.{name}")
            text = self.typed(key, hashed, str)
            m = BCRYPT_HASH.fullmatch(text)
            if m is None or int(m.group(1)) < BCRYPT_MIN_COST or text[28] not in _BCRYPT_SALT_LAST:
                raise self.error(key, "not a bcrypt hash ($2b$<cost>$<53 characters>, cost "
                                 f"{BCRYPT_MIN_COST:02d}-{BCRYPT_MAX_COST}); make one with htpasswd -nBC 10 \"\" "
                                 "or python3 -c 'import bcrypt; …' (docs/web-config.md)")
            if int(m.group(1)) > BCRYPT_MAX_COST:
                raise self.error(key, f"bcrypt cost above {BCRYPT_MAX_COST}, the most accelstats accepts: one check "
                                 "of a cost-15 hash takes about 2 s of a CPU, and each higher cost doubles it, for "
                                 "every first login, wrong password and unknown user name; make the hash again "
                                 "with cost 10-12 (docs/web-config.md)")
            out.append((name, text.encode("ascii")))
        return tuple(out)


_PEM_CERTIFICATE = re.compile(rb"-----BEGIN (?:X509 |TRUSTED )?CERTIFICATE-----.+?-----END (?:X509 |TRUSTED )?"
                              rb"CERTIFICATE-----", re.S)


def _tls_file(p: _Parser, key: str, path: Path) -> bytes:
    """The bytes of the TLS file ``path`` named by ``key`` (:func:`_read_bytes`: a regular file of at
    most :data:`MAX_FILE_BYTES`); raises :class:`WebConfigError` naming the key and the path."""
    try:
        return _read_bytes(path)
    except FileNotFoundError as exc:
        raise p.error(key, f"{path}: no such file") from exc
    except PermissionError as exc:
        raise p.error(key, f"{path}: not readable") from exc
    except OSError as exc:
        raise p.error(key, f"{path}: cannot read: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise p.error(key, f"{path}: {exc}") from exc


def _certificates(data: bytes) -> str:
    """The PEM certificate blocks of ``data``, for ``cadata`` (text around them is dropped, as
    OpenSSL's PEM reader skips it); "" when there is none."""
    return "\n".join(block.decode("latin-1") for block in _PEM_CERTIFICATE.findall(data))


def _no_password() -> bytes:
    """The key's password callback: none. Without one OpenSSL would prompt on the terminal (a read that
    may never return); an encrypted key then fails to load, as the documentation says it must."""
    return b""


def build_ssl_context(config: WebConfig) -> ssl.SSLContext:
    """A server-side ``SSLContext`` for ``config.tls`` (which must be set). Reads the certificate, key
    and CA files, each only when it is a regular file of at most :data:`MAX_FILE_BYTES` (a FIFO or a
    device is an error, never a blocking read); certificates and CAs are loaded from those bytes, the
    chain and key by OpenSSL from the paths just checked (Python's ``ssl`` has no in-memory API for
    them). Raises :class:`WebConfigError` naming the key whose file is missing or does not load."""
    tls = config.tls
    assert tls is not None
    p = _Parser(config.path)
    k = "tls_server_config."
    cert_pem = _tls_file(p, k + "cert_file", tls.cert_file)
    _tls_file(p, k + "key_file", tls.key_file)
    ca_pem = _tls_file(p, k + "client_ca_file", tls.client_ca_file) if tls.client_ca_file is not None else None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    if tls.min_version < ssl.TLSVersion.TLSv1_2:
        log.warning("web config %s: tls_server_config.min_version: set below TLS12, but %s refuses TLS 1.0 and 1.1 "
                    "at its default security level (OpenSSL 3): clients still need TLS 1.2", config.path,
                    ssl.OPENSSL_VERSION)
    with warnings.catch_warnings():  # ssl's DeprecationWarning for TLSv1/TLSv1_1: the log line above says it
        warnings.simplefilter("ignore", DeprecationWarning)
        ctx.minimum_version, ctx.maximum_version = tls.min_version, tls.max_version
    certs = _certificates(cert_pem)
    try:
        if not certs:
            raise ValueError("no complete BEGIN/END CERTIFICATE block")
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=certs)  # parses them alone
    except (ssl.SSLError, ValueError) as exc:
        raise p.error(k + "cert_file", f"{tls.cert_file}: not a PEM certificate ({exc})") from exc
    try:
        ctx.load_cert_chain(tls.cert_file, tls.key_file, password=_no_password)
    except ssl.SSLError as exc:
        if getattr(exc, "reason", "") == "KEY_VALUES_MISMATCH":
            raise p.error(k + "key_file", f"{tls.key_file}: a private key, but not the one of cert_file "
                          f"{tls.cert_file} (KEY_VALUES_MISMATCH)") from exc
        raise p.error(k + "key_file", f"{tls.key_file}: not a PEM private key (unencrypted) for "
                      f"cert_file ({exc})") from exc
    except OSError as exc:  # replaced or removed since it was read
        raise p.error(k + "key_file", f"{tls.key_file}: cannot read: {exc.strerror or exc}") from exc
    if ca_pem is not None or tls.client_ca:
        where = k + ("client_ca_file" if tls.client_ca_file else "client_ca")
        try:
            cadata = _certificates(ca_pem) if ca_pem is not None else tls.client_ca
            if not cadata:
                raise ValueError("no complete BEGIN/END CERTIFICATE block")
            ctx.load_verify_locations(cadata=cadata)
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
