"""The plugin's ``metrics_listen`` endpoint with TLS and basic auth.

``metrics_web_config`` names an exporter-toolkit web config file, the one ``accelstats serve
--web-config`` takes (docs/web-config.md). The installed ``nomad-device-accelstats`` is driven as
Nomad drives it (:class:`support.nomadclient.launcher.PluginProcess`, config encoded by go-cty's rules);
``/metrics`` is then read over real TLS (a throw-away PKI from tests/support/tls_pki.py) with and without
credentials (bcrypt hashes of cost 4, to keep the test fast).
"""

from __future__ import annotations

import base64
import http.client
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import bcrypt
import pytest
from support.nomadclient.ctymsgpack import encode_for_spec
from support.nomadclient.launcher import PluginProcess
from support.plugin_util import H200, binary, config
from support.ports import free_port
from support.tls_pki import Pki

USER, PASSWORD = "prometheus", "scrape-pw"
HASH = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode()  # cost 4: fast tests


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture
def plugin() -> Iterator[PluginProcess]:
    with PluginProcess(binary()) as p:
        yield p


def web_config(tmp_path: Path, pki: Pki) -> Path:
    path = tmp_path / "web.yml"
    path.write_text(f"tls_server_config:\n  cert_file: {pki.server_cert}\n  key_file: {pki.server_key}\n"
                    f"basic_auth_users:\n  {USER}: {HASH}\n")
    return path


def get(port: int, ctx: ssl.SSLContext | None, auth: tuple[str, str] | None) -> tuple[int, dict[str, str], str]:
    """GET /metrics on 127.0.0.1:port (HTTPS with ``ctx``, else plain HTTP): (status, headers, body)."""
    conn = (http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=10) if ctx is not None
            else http.client.HTTPConnection("127.0.0.1", port, timeout=10))
    headers = {}
    if auth is not None:
        headers["Authorization"] = "Basic " + base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
    try:
        conn.request("GET", "/metrics", headers=headers)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read().decode()
    finally:
        conn.close()


def invalid_argument(plugin: PluginProcess, cfg: dict[str, Any]) -> str:
    with pytest.raises(Exception) as err:
        plugin.set_config(encode_for_spec(plugin.config_schema().spec, cfg))
    assert err.value.code().name == "INVALID_ARGUMENT", err.value  # type: ignore[attr-defined]
    return str(err.value.details())  # type: ignore[attr-defined]


def test_metrics_listen_serves_tls_with_basic_auth(plugin: PluginProcess, pki: Pki, tmp_path: Path, port: int,
                                                   fixtures_dir: Path) -> None:
    replay = fixtures_dir / "h200" / "nvidia-smi-q.xml"
    plugin.set_config(encode_for_spec(plugin.config_schema().spec, config(
        replay, metrics_listen=f"127.0.0.1:{port}", metrics_web_config=str(web_config(tmp_path, pki)))))
    plugin.fingerprint().read(timeout=10)
    ctx = ssl.create_default_context(cafile=str(pki.ca))  # verifies the chain and the name (127.0.0.1)

    status, _, body = get(port, ctx, (USER, PASSWORD))
    assert status == 200
    assert f'accelstats_gpu_up{{gpu="0",model="NVIDIA H200",uuid="{H200}"}} 1.0' in body

    status, headers, body = get(port, ctx, None)  # no credentials: refused, and told how to authenticate
    assert status == 401 and headers["www-authenticate"].startswith("Basic") and "accelstats_" not in body
    status, _, body = get(port, ctx, (USER, "wrong"))
    assert status == 401 and "accelstats_" not in body

    try:  # no cleartext metrics on the TLS port
        status, _, body = get(port, None, (USER, PASSWORD))
    except (OSError, http.client.HTTPException):
        pass
    else:
        assert status != 200 and "accelstats_" not in body
    assert plugin.health() == "SERVING"


@pytest.mark.parametrize(("text", "reason"), [
    (None, "cannot read"),  # the file does not exist
    ("basic_auth_users:\n  alice: hunter2\n", "not a bcrypt hash"),
    ("tls_server_config:\n  cert_file: /nonexistent/cert.pem\n  key_file: /nonexistent/key.pem\n", "cert"),
    ("tls_server_config: [\n", "invalid YAML"),
])
def test_a_bad_web_config_is_invalid_argument_naming_the_field(plugin: PluginProcess, tmp_path: Path, port: int,
                                                               text: str | None, reason: str) -> None:
    path = tmp_path / "web.yml"
    if text is not None:
        path.write_text(text)
    details = invalid_argument(plugin, config(metrics_listen=f"127.0.0.1:{port}", metrics_web_config=str(path)))
    assert details.startswith("config: metrics_web_config: ") and reason in details, details
    assert str(path) in details and "\n" not in details
    assert "hunter2" not in details  # never a secret in the error
    with socket.socket() as s:  # nothing half-started on the address
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_web_config_without_metrics_listen_is_refused(plugin: PluginProcess, pki: Pki, tmp_path: Path) -> None:
    details = invalid_argument(plugin, config(metrics_web_config=str(web_config(tmp_path, pki))))
    assert details.startswith("config: metrics_web_config: ") and "metrics_listen" in details, details


def test_a_bad_web_config_keeps_the_endpoint_in_force(plugin: PluginProcess, pki: Pki, tmp_path: Path,
                                                      port: int, fixtures_dir: Path) -> None:
    """A SetConfig with a broken file is refused before the endpoint in force is touched: scrapes with
    the old configuration keep working."""
    replay = fixtures_dir / "h200" / "nvidia-smi-q.xml"
    good = config(replay, metrics_listen=f"127.0.0.1:{port}", metrics_web_config=str(web_config(tmp_path, pki)))
    plugin.set_config(encode_for_spec(plugin.config_schema().spec, good))
    plugin.fingerprint().read(timeout=10)
    broken = tmp_path / "broken.yml"
    broken.write_text("basic_auth_users:\n  alice: hunter2\n")
    assert "not a bcrypt hash" in invalid_argument(plugin, {**good, "metrics_web_config": str(broken)})
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    assert get(port, ctx, (USER, PASSWORD))[0] == 200
    assert get(port, ctx, None)[0] == 401
