"""``--web-config``: exporter-toolkit's web configuration file, and a real TLS + basic-auth server.

Part one is the parser's table: a valid file, and for each mistake the key the message names.
Part two starts the real server in-process (``accelstats.web.server.serve``) with certificates made by
``openssl`` (tests/support/tls_pki.py) and talks to it over real sockets; part three runs ``python3 -m
accelstats serve --web-config`` as a user would.
"""

from __future__ import annotations

import http.client
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import bcrypt
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.ports import free_port
from support.tls_pki import Pki

from accelstats.config import load_config
from accelstats.manager import AcceleratorManager
from accelstats.settings import Settings
from accelstats.web import auth as webauth
from accelstats.web.config import (
    GO_CIPHERS,
    WebConfig,
    WebConfigError,
    build_ssl_context,
    load_web_config,
)
from accelstats.web.server import serve
from accelstats.web.source import WebConfigSource
from collectors.replay.lib import open_replay

H200_UUID = "GPU-5f1c2a9e-0b7d-4c3e-9a61-2d8e4f7b9c10"
PASSWORD = "s3cret-pw"
HASH = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode()  # cost 4: fast tests


def tls_block(pki: Pki, **extra: str) -> str:
    lines = [f"  cert_file: {pki.server_cert}", f"  key_file: {pki.server_key}"]
    lines += [f"  {k}: {v}" for k, v in extra.items()]
    return "tls_server_config:\n" + "\n".join(lines) + "\n"


def load(tmp_path: Path, text: str) -> WebConfig:
    """Parse and, with TLS, build the SSL context: everything ``--web-config`` checks at start-up."""
    path = tmp_path / "web.yml"
    path.write_text(text)
    config = load_web_config(path)
    if config.tls is not None:
        build_ssl_context(config)
    return config


# --------------------------------------------------------------------------------------------
# the parser's table

TLS = "tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n"
BAD = [  # (case, file text, key path the message names, reason fragment)
    ("unknown top-level key", "tls_server_confg:\n  cert_file: x\n", "tls_server_confg", "unknown key"),
    ("unknown TLS key", TLS + "  cert_path: x\n", "tls_server_config.cert_path", "unknown key"),
    ("unknown http key", "http_server_config:\n  http3: true\n", "http_server_config.http3", "unknown key"),
    ("missing cert file", "tls_server_config:\n  cert_file: nowhere.pem\n  key_file: {key}\n",
     "tls_server_config.cert_file", "no such file"),
    ("missing key file", "tls_server_config:\n  cert_file: {cert}\n  key_file: nowhere.key\n",
     "tls_server_config.key_file", "no such file"),
    ("key of another certificate", "tls_server_config:\n  cert_file: {cert}\n  key_file: {client_key}\n",
     "tls_server_config.key_file", "private key"),
    ("a key where the certificate goes", "tls_server_config:\n  cert_file: {key}\n  key_file: {key}\n",
     "tls_server_config.cert_file", "not a PEM certificate"),
    ("cert_file without key_file", "tls_server_config:\n  cert_file: {cert}\n", "tls_server_config.key_file",
     "required"),
    ("cert_file not a string", "tls_server_config:\n  cert_file: 42\n  key_file: {key}\n",
     "tls_server_config.cert_file", "expected str"),
    ("unknown client_auth_type", TLS + "  client_auth_type: Sometimes\n", "tls_server_config.client_auth_type",
     "unknown value (known: NoClientCert"),
    ("unverified client certificates", TLS + "  client_auth_type: RequireAnyClientCert\n  client_ca_file: {ca}\n",
     "tls_server_config.client_auth_type", "not supported"),
    ("client auth without a CA", TLS + "  client_auth_type: RequireAndVerifyClientCert\n",
     "tls_server_config.client_ca_file", "required"),
    ("a CA without client auth", TLS + "  client_ca_file: {ca}\n", "tls_server_config.client_auth_type",
     "NoClientCert"),
    ("a CA file with no certificate", TLS + "  client_auth_type: VerifyClientCertIfGiven\n  client_ca_file: {key}\n",
     "tls_server_config.client_ca_file", "no PEM CA certificate"),
    ("unknown TLS version", TLS + "  min_version: TLS14\n", "tls_server_config.min_version",
     "unknown TLS version (known: TLS10"),
    ("min above max", TLS + "  min_version: TLS13\n  max_version: TLS12\n", "tls_server_config.min_version",
     "above max_version"),
    ("unknown cipher suite", TLS + "  cipher_suites: [TLS_AES_128_GCM_SHA256, TLS_RSA_WITH_RC4_128_SHA]\n",
     "tls_server_config.cipher_suites[1]", "unknown cipher suite (known: Go's"),
    ("inline certificate", "tls_server_config:\n  cert: '-----BEGIN CERTIFICATE-----'\n  key_file: {key}\n",
     "tls_server_config.cert", "use cert_file"),
    ("curve preferences", TLS + "  curve_preferences: [X25519]\n", "tls_server_config.curve_preferences",
     "not supported"),
    ("SAN allow-list", TLS + "  client_allowed_sans: [a]\n", "tls_server_config.client_allowed_sans", "not supported"),
    ("rate limit", "rate_limit:\n  interval: 1s\n  burst: 5\n", "rate_limit", "not supported"),
    ("not a bcrypt hash", "basic_auth_users:\n  alice: 5f4dcc3b5aa765d61d8327deb882cf99\n",
     "basic_auth_users.alice", "not a bcrypt hash"),
    ("a clear-text password", "basic_auth_users:\n  alice: hunter2\n", "basic_auth_users.alice", "not a bcrypt hash"),
    ("bcrypt cost below 4", "basic_auth_users:\n  alice: '$2b$03$" + "a" * 53 + "'\n", "basic_auth_users.alice",
     "cost 04-15"),
    ("users as a list", "basic_auth_users:\n  - alice\n", "basic_auth_users", "expected a mapping"),
    ("user name not a string", f"basic_auth_users:\n  42: '{HASH}'\n", "basic_auth_users", "quote it"),
    ("header that cannot be set", "http_server_config:\n  headers:\n    X-Powered-By: me\n",
     "http_server_config.headers.X-Powered-By", "cannot be configured"),
    ("header value not allowed", "http_server_config:\n  headers:\n    X-Frame-Options: allow\n",
     "http_server_config.headers.X-Frame-Options", "unknown value (known: deny, sameorigin)"),
    ("http2 not a boolean", "http_server_config:\n  http2: 'sometimes'\n", "http_server_config.http2",
     "expected bool"),
    ("TLS block not a mapping", "tls_server_config: server.pem\n", "tls_server_config", "expected a mapping"),
]


@pytest.mark.parametrize(("case", "text", "key", "reason"), BAD, ids=[c[0] for c in BAD])
def test_each_mistake_names_the_file_and_the_key(pki: Pki, tmp_path: Path, case: str, text: str, key: str,
                                                 reason: str) -> None:
    text = text.format(cert=pki.server_cert, key=pki.server_key, ca=pki.ca, client_key=pki.client_key)
    with pytest.raises(WebConfigError) as err:
        load(tmp_path, text)
    assert str(err.value).startswith(f"web config {tmp_path / 'web.yml'}: {key}: "), str(err.value)
    assert reason in str(err.value)


@pytest.mark.parametrize(("text", "reason"), [
    ("tls_server_config:\n  cert_file: a\n  cert_file: b\n", "duplicate key 'cert_file'"),
    ("tls_server_config:\n  cert_file: [unclosed\n", "invalid YAML"),
    ("- a list\n", "(top level): expected a mapping"),
])
def test_file_level_mistakes(tmp_path: Path, text: str, reason: str) -> None:
    with pytest.raises(WebConfigError, match=rf"^web config {tmp_path / 'web.yml'}: .*{reason}".replace("(", r"\(")
                       .replace(")", r"\)")):
        load(tmp_path, text)


def test_missing_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(WebConfigError, match=r"web config .*/absent\.yml: cannot read: No such file"):
        load_web_config(tmp_path / "absent.yml")


def test_valid_file_every_supported_key(pki: Pki, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "etc"
    folder.mkdir()
    for src in (pki.server_cert, pki.server_key, pki.ca):
        (folder / src.name).write_bytes(src.read_bytes())
    (folder / "web.yml").write_text(f"""\
tls_server_config:
  cert_file: server.pem        # relative: to this file's directory
  key_file: server.key
  client_auth_type: VerifyClientCertIfGiven
  client_ca_file: ca.pem
  min_version: TLS12
  max_version: TLS13
  cipher_suites: [TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256, TLS_AES_128_GCM_SHA256]
  prefer_server_cipher_suites: false
http_server_config:
  http2: true
  headers:
    X-Frame-Options: deny
    X-Content-Type-Options: nosniff
    Strict-Transport-Security: ""
basic_auth_users:
  prometheus: '{HASH}'
  "grafana agent": '{HASH}'
""")
    monkeypatch.chdir(tmp_path)  # relative paths follow the file, not the working directory
    config = load_web_config(Path("etc/web.yml"))
    assert config.tls is not None
    assert config.tls.cert_file == folder / "server.pem" and config.tls.key_file == folder / "server.key"
    assert config.tls.client_ca_file == folder / "ca.pem"
    assert (config.tls.min_version, config.tls.max_version) == (ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3)
    assert config.headers == (("X-Frame-Options", "deny"), ("X-Content-Type-Options", "nosniff"))  # "" = unset
    assert [u for u, _ in config.users] == ["prometheus", "grafana agent"]
    ctx = build_ssl_context(config)
    assert ctx.verify_mode == ssl.CERT_OPTIONAL
    assert not ctx.options & ssl.OP_CIPHER_SERVER_PREFERENCE
    tls12 = {c["name"] for c in ctx.get_ciphers() if c["protocol"] == "TLSv1.2"}
    assert tls12 == {"ECDHE-ECDSA-AES128-GCM-SHA256"}


def test_the_example_in_docs_loads(pki: Pki, repo_root: Path, tmp_path: Path) -> None:
    doc = (repo_root / "docs" / "web-config.md").read_text()
    example = doc.split("```yaml\n", 1)[1].split("```", 1)[0]
    for src in (pki.server_cert, pki.server_key):
        (tmp_path / src.name).write_bytes(src.read_bytes())
    config = load(tmp_path, example)
    assert config.tls is not None and [u for u, _ in config.users] == ["prometheus"]
    assert bcrypt.checkpw(b"example-only", config.users[0][1])


def test_tls10_is_accepted_with_a_warning_that_openssl_may_refuse_it(
        pki: Pki, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    config = load(tmp_path, tls_block(pki, min_version="TLS10"))
    assert config.tls is not None and config.tls.min_version == ssl.TLSVersion.TLSv1
    assert "min_version: set below TLS12" in caplog.text


def test_empty_file_is_plain_http_without_auth(tmp_path: Path) -> None:
    config = load(tmp_path, "# nothing yet\n")
    assert (config.tls, config.users, config.headers) == (None, (), ())


def test_go_cipher_names_map_to_openssl_names_as_openssl_pairs_them() -> None:
    """Every pair in GO_CIPHERS is the (IANA, OpenSSL) pair `openssl ciphers -stdname` prints."""
    out = subprocess.run(["openssl", "ciphers", "-stdname", "ALL:@SECLEVEL=0"], capture_output=True, text=True,
                         check=True, timeout=30).stdout
    pairs = {}
    for line in out.splitlines():
        iana, _, rest = line.partition(" - ")
        pairs[iana.strip()] = rest.split()[0]
    for go_name, openssl_name in GO_CIPHERS.items():
        assert pairs.get(go_name) == (openssl_name or go_name), go_name  # TLS 1.3 suites keep their IANA names


def test_toml_config_web_config_key_is_relative_to_the_config_file(tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_text('web_config = "web.yml"\n')
    assert load_config(tmp_path / "config.toml").web_config == tmp_path / "web.yml"
    (tmp_path / "config.toml").write_text('web_config = ""\n')
    assert load_config(tmp_path / "config.toml").web_config is None


# --------------------------------------------------------------------------------------------
# a real server in-process


@pytest.fixture(scope="module")
def manager(fixtures_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AcceleratorManager]:
    root = tmp_path_factory.mktemp("host")
    (root / "cgroup").mkdir()
    (root / "proc").mkdir()
    replay = fixtures_dir / "h200" / "nvidia-smi-q.xml"
    settings = Settings(nvml_replay=replay, collectors=("nvidia",), cgroup_root=root / "cgroup",
                        proc_root=root / "proc")
    m = AcceleratorManager(settings, open_replay(replay))
    m.setup()
    yield m
    m.destroy()


@dataclass
class Served:
    port: int
    path: Path
    server: object
    source: WebConfigSource


@pytest.fixture
def start(manager: AcceleratorManager, tmp_path: Path) -> Iterator[Callable[[str], Served]]:
    """Factory: write a web config, serve it on a free loopback port; every server stops at teardown."""
    started: list[tuple[object, threading.Thread]] = []

    def _start(text: str) -> Served:
        path = tmp_path / "web.yml"
        path.write_text(text)
        source = WebConfigSource(path)
        server, thread = serve(manager, "127.0.0.1", 0, source)
        started.append((server, thread))
        return Served(port=server.server_address[1], path=path, server=server, source=source)

    yield _start
    for server, thread in started:
        server.shutdown()  # type: ignore[attr-defined]
        server.server_close()  # type: ignore[attr-defined]
        thread.join(timeout=5)


def client_ctx(pki: Pki, cert: tuple[Path, Path] | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    if cert is not None:
        ctx.load_cert_chain(*cert)
    return ctx


def fetch(port: int, ctx: ssl.SSLContext | None, path: str = "/metrics",
          auth: tuple[str, str] | None = None) -> tuple[int, dict[str, str], str]:
    """(status, headers, body) of one GET; HTTPS when ``ctx`` is given."""
    conn = (http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=10) if ctx is not None
            else http.client.HTTPConnection("127.0.0.1", port, timeout=10))
    headers = {}
    if auth is not None:
        import base64
        headers["Authorization"] = "Basic " + base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
    try:
        conn.request("GET", path, headers=headers)
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read().decode()
    finally:
        conn.close()


def auth_config(pki: Pki, **tls: str) -> str:
    return (tls_block(pki, **tls) + "http_server_config:\n  headers:\n    X-Frame-Options: deny\n"
            + f"basic_auth_users:\n  prometheus: '{HASH}'\n")


def test_right_password_gets_the_exposition_over_tls(pki: Pki, start: Callable[[str], Served]) -> None:
    s = start(auth_config(pki))
    status, headers, body = fetch(s.port, client_ctx(pki), auth=("prometheus", PASSWORD))
    assert status == 200
    assert headers["X-Frame-Options"] == "deny"
    families = {f.name: f for f in text_string_to_metric_families(body)}
    assert [x.labels["uuid"] for x in families["accelstats_gpu_info"].samples] == [H200_UUID]


@pytest.mark.parametrize(("case", "auth"), [
    ("wrong password", ("prometheus", "guess")),
    ("unknown user", ("root", PASSWORD)),
    ("no credentials", None),
    ("empty password", ("prometheus", "")),
])
def test_without_the_right_password_401(pki: Pki, start: Callable[[str], Served], case: str,
                                        auth: tuple[str, str] | None) -> None:
    s = start(auth_config(pki))
    for path in ("/metrics", "/"):
        status, headers, body = fetch(s.port, client_ctx(pki), path, auth=auth)
        assert status == 401, path
        assert headers["WWW-Authenticate"] == 'Basic realm="accelstats"'
        assert headers["X-Frame-Options"] == "deny"
        assert "accelstats_" not in body


def test_healthz_answers_without_credentials(pki: Pki, start: Callable[[str], Served]) -> None:
    s = start(auth_config(pki))
    assert fetch(s.port, client_ctx(pki), "/healthz")[::2] == (200, "ok\n")


def test_plain_http_on_the_tls_port_gets_400_and_the_server_keeps_serving(
        pki: Pki, start: Callable[[str], Served]) -> None:
    s = start(auth_config(pki))
    status, _, body = fetch(s.port, None, auth=("prometheus", PASSWORD))
    assert (status, body) == (400, "Client sent an HTTP request to an HTTPS server.\n")
    assert fetch(s.port, client_ctx(pki), auth=("prometheus", PASSWORD))[0] == 200


def _worker_threads() -> int:
    return sum(t.name == "accelstats-http-worker" for t in threading.enumerate())


def test_stalled_and_broken_clients_neither_wedge_the_server_nor_leak_threads(
        pki: Pki, start: Callable[[str], Served]) -> None:
    s = start(auth_config(pki))
    s.server.handshake_timeout = 2.0  # type: ignore[attr-defined]
    assert fetch(s.port, client_ctx(pki), auth=("prometheus", PASSWORD))[0] == 200
    silent = [socket.create_connection(("127.0.0.1", s.port)) for _ in range(5)]  # connect, send nothing
    began = time.monotonic()
    assert fetch(s.port, client_ctx(pki), auth=("prometheus", PASSWORD))[0] == 200
    assert time.monotonic() - began < 1.5, "a stalled handshake held up the next client"
    for junk in (b"\x00\x01\x02 not TLS", b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"\x16\x03\x01\x00\x05trunc"):
        with socket.create_connection(("127.0.0.1", s.port), timeout=5) as sock:
            sock.sendall(junk)
            sock.recv(4096)  # an answer or a clean EOF: not a hang, not a reset
    untrusting = ssl.create_default_context()  # does not trust our CA: aborts the handshake itself
    with pytest.raises(ssl.SSLCertVerificationError):
        fetch(s.port, untrusting)
    assert fetch(s.port, client_ctx(pki), auth=("prometheus", PASSWORD))[0] == 200
    # The requests above came one after another, so one worker thread served them all (two at most,
    # should one be slow to count itself free); the five silent connections and the junk hold none.
    assert _worker_threads() <= 2, [t.name for t in threading.enumerate()]
    for sock in silent:
        assert sock.recv(1) == b""  # the server closed them after the handshake timeout
        sock.close()


def test_required_client_certificate(pki: Pki, start: Callable[[str], Served]) -> None:
    s = start(tls_block(pki, client_auth_type="RequireAndVerifyClientCert", client_ca_file=str(pki.ca)))
    assert fetch(s.port, client_ctx(pki, (pki.client_cert, pki.client_key)))[0] == 200
    with pytest.raises(OSError):  # TLS 1.3: the alert arrives with the first read
        fetch(s.port, client_ctx(pki))
    with pytest.raises(OSError):
        fetch(s.port, client_ctx(pki, (pki.rogue_cert, pki.rogue_key)))
    assert fetch(s.port, client_ctx(pki, (pki.client_cert, pki.client_key)), "/healthz")[0] == 200


def test_min_version_tls13_refuses_a_tls12_client(pki: Pki, start: Callable[[str], Served]) -> None:
    s = start(tls_block(pki, min_version="TLS13"))
    old = client_ctx(pki)
    old.maximum_version = ssl.TLSVersion.TLSv1_2
    with pytest.raises(ssl.SSLError):
        fetch(s.port, old)
    assert fetch(s.port, client_ctx(pki))[0] == 200


def _touch(path: Path, text: str, source: WebConfigSource) -> None:
    """Rewrite ``path`` with a modification time certainly different from the last one, and wait until
    ``source`` has looked at it (its own thread checks the files; the change is applied or refused)."""
    mtime = path.stat().st_mtime_ns + 2_000_000_000
    new = path.with_name(path.name + ".new")
    new.write_text(text)
    os.utime(new, ns=(mtime, mtime))
    new.replace(path)  # one change, whenever the source's thread looks
    assert source.sync(), "the web config was not checked within 10 s"


def test_changed_file_applies_without_restart_and_a_broken_one_keeps_the_last_good(
        pki: Pki, start: Callable[[str], Served]) -> None:
    """A valid change applies at once; a broken one is refused (counted), and the last good
    configuration keeps serving — never less security, never an outage."""
    s = start(auth_config(pki))
    new_hash = bcrypt.hashpw(b"rotated", bcrypt.gensalt(rounds=4)).decode()
    _touch(s.path, tls_block(pki) + f"basic_auth_users:\n  prometheus: '{new_hash}'\n", s.source)
    assert fetch(s.port, client_ctx(pki), auth=("prometheus", PASSWORD))[0] == 401
    assert fetch(s.port, client_ctx(pki), auth=("prometheus", "rotated"))[0] == 200
    _touch(s.path, tls_block(pki) + "basic_auth_users:\n  prometheus: hunter2\n", s.source)
    assert fetch(s.port, client_ctx(pki), auth=("prometheus", "rotated"))[0] == 200  # the last good one
    assert fetch(s.port, client_ctx(pki))[0] == 401
    assert s.source.reload_failures == 1
    _touch(s.path, tls_block(pki) + f"basic_auth_users:\n  prometheus: '{new_hash}'\n", s.source)
    assert fetch(s.port, client_ctx(pki), auth=("prometheus", "rotated"))[0] == 200


def test_plain_http_with_basic_auth_and_a_broken_file_keeps_the_last_good(start: Callable[[str], Served]) -> None:
    s = start(f"basic_auth_users:\n  prometheus: '{HASH}'\n")
    assert fetch(s.port, None, auth=("prometheus", PASSWORD))[0] == 200
    assert fetch(s.port, None, auth=("prometheus", "nope"))[0] == 401
    _touch(s.path, "basic_auth_users: [\n", s.source)
    assert fetch(s.port, None, auth=("prometheus", PASSWORD))[0] == 200
    assert fetch(s.port, None)[0] == 401
    assert s.source.reload_failures == 1


def test_successful_checks_are_cached_failures_are_not(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "web.yml"
    path.write_text(f"basic_auth_users:\n  prometheus: '{HASH}'\n")
    source = WebConfigSource(path)
    auth = webauth.BasicAuth(lambda request: (200, [], b""), source)
    calls = []
    real = bcrypt.checkpw

    def counting(password: bytes, hashed: bytes) -> bool:
        calls.append(password)
        return real(password, hashed)

    monkeypatch.setattr(bcrypt, "checkpw", counting)
    config = source.current()[0]
    assert [auth.check(config, b"prometheus", PASSWORD.encode()) for _ in range(3)] == [True] * 3
    assert len(calls) == 1
    assert [auth.check(config, b"prometheus", b"wrong") for _ in range(2)] == [False] * 2
    assert len(calls) == 3
    assert auth.check(config, b"nobody", PASSWORD.encode()) is False  # unknown users pay one check too
    assert len(calls) == 4
    assert auth.check(config, b"prometheus", b"x" * 73) is False  # over bcrypt's 72 bytes: refused


@pytest.mark.parametrize(("header", "expected"), [
    ("Basic cHJvbWV0aGV1czpwdzpoYXM6Y29sb25z", (b"prometheus", b"pw:has:colons")),
    ("basic   cHJvbWV0aGV1czpw", (b"prometheus", b"p")),
    ("Bearer cHJvbWV0aGV1czpw", None),
    ("Basic not base64!", None),
    ("Basic bm9jb2xvbg==", None),  # "nocolon"
    ("", None),
])
def test_parse_basic(header: str, expected: tuple[bytes, bytes] | None) -> None:
    assert webauth.parse_basic(header) == expected


# --------------------------------------------------------------------------------------------
# the command line

CLI = [sys.executable, "-m", "accelstats"]


def test_serve_web_config_end_to_end(pki: Pki, fixtures_dir: Path, tmp_path: Path) -> None:
    """`accelstats serve --web-config`: HTTPS with basic auth, and systemd told READY=1 once it is
    bound (sd_notify socket), STOPPING=1 on SIGTERM."""
    web = tmp_path / "web.yml"
    web.write_text(auth_config(pki))
    port = free_port()
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify"))
    notify.settimeout(30)
    proc = subprocess.Popen([*CLI, "serve", "--listen", f"127.0.0.1:{port}", "--collector", "nvidia",
                             "--nvml-replay", str(fixtures_dir / "h200" / "nvidia-smi-q.xml"),
                             "--web-config", str(web)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "NOTIFY_SOCKET": str(tmp_path / "notify")})
    try:
        ready = notify.recv(4096).decode()
        assert ready.splitlines()[0] == "READY=1"
        assert f"STATUS=serving https://127.0.0.1:{port}/metrics with basic auth" in ready.splitlines()
        assert fetch(port, client_ctx(pki), "/healthz")[0] == 200  # READY came after the bind
        assert fetch(port, client_ctx(pki), auth=("prometheus", PASSWORD))[0] == 200
        assert fetch(port, client_ctx(pki), auth=("prometheus", "guess"))[0] == 401
        proc.send_signal(signal.SIGTERM)
        assert notify.recv(4096) == b"STOPPING=1"
        _, err = proc.communicate(timeout=15)
    finally:
        notify.close()
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    assert f"serving https://127.0.0.1:{port}/metrics with basic auth" in err


def test_serve_bad_web_config_is_one_line_exit_2(pki: Pki, fixtures_dir: Path, tmp_path: Path) -> None:
    web = tmp_path / "web.yml"
    web.write_text(f"tls_server_config:\n  cert_file: missing.pem\n  key_file: {pki.server_key}\n")
    proc = subprocess.run([*CLI, "serve", "--listen", f"127.0.0.1:{free_port()}", "--web-config", str(web),
                           "--nvml-replay", str(fixtures_dir / "h200" / "nvidia-smi-q.xml")],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2
    assert proc.stderr == (f"accelstats: error: web config {web}: tls_server_config.cert_file: "
                           f"{tmp_path / 'missing.pem'}: no such file\n")


def test_a_key_of_another_certificate_is_named_as_such(tmp_path: Path, pki: Pki) -> None:
    text = f"tls_server_config:\n  cert_file: {pki.server_cert}\n  key_file: {pki.client_key}\n"
    with pytest.raises(WebConfigError, match=r"key_file: .*client\.key: a private key, but not the one of "
                                             r"cert_file .*server\.pem \(KEY_VALUES_MISMATCH\)"):
        load(tmp_path, text)
