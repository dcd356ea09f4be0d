"""``accelstats serve`` under the option names a node_exporter user types (issue 26, row 13), and the
one-line warning for basic auth on plain HTTP (row 14), through a real exporter process.

| node_exporter option   | accelstats option |
|------------------------|-------------------|
| `--web.listen-address` | `--listen`        |
| `--web.config.file`    | `--web-config`    |
"""

from __future__ import annotations

import base64
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import bcrypt
import pytest
from support.ports import free_port

PLAIN_HTTP_AUTH = "basic_auth_users without tls_server_config: passwords travel in clear text on plain HTTP"


def _status(url: str, auth: str | None = None) -> int:
    request = urllib.request.Request(url)
    if auth is not None:
        request.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return e.code


@pytest.mark.parametrize("spelling", ["--web.listen-address={addr}", "--web.listen-address {addr}"])
def test_node_exporter_option_names_serve_as_ours(tmp_path: Path, fixtures_dir: Path, spelling: str) -> None:
    web = tmp_path / "web.yml"
    web.write_text("basic_auth_users:\n  prometheus: "
                   + bcrypt.hashpw(b"secret", bcrypt.gensalt(rounds=4)).decode() + "\n")
    addr = f"127.0.0.1:{free_port()}"
    proc = subprocess.Popen([sys.executable, "-m", "accelstats", "serve", *spelling.format(addr=addr).split(),
                             "--web.config.file", str(web),
                             "--nvml-replay", str(fixtures_dir / "h200" / "nvidia-smi-q.xml")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                if _status(f"http://{addr}/healthz") == 200:
                    break
            except OSError:
                time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()
        assert _status(f"http://{addr}/metrics") == 401  # the web config is in force
        assert _status(f"http://{addr}/metrics", "prometheus:secret") == 200
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr
    warned = [line for line in stderr.splitlines() if PLAIN_HTTP_AUTH in line]
    assert len(warned) == 1 and " WARNING " in warned[0] and str(web) in warned[0], stderr


def test_serve_help_names_both_spellings() -> None:
    shown = subprocess.run([sys.executable, "-m", "accelstats", "serve", "--help"], capture_output=True,
                           text=True, timeout=60, check=True).stdout
    assert "--listen, --web.listen-address" in shown and "--web-config, --web.config.file" in shown
