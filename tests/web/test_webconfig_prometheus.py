"""A real Prometheus scrapes ``accelstats serve --web-config`` over TLS with basic auth.

The exporter runs as a user runs it (``python3 -m accelstats serve``, H200 replay) with a web config
holding an openssl-made server certificate (tests/support/tls_pki.py) and one bcrypt user. Debian's
``prometheus`` (tests/support/prom_harness.py) scrapes it every second with three jobs:

| job | scheme | credentials | expected |
|---|---|---|---|
| ``accelstats`` | https, our CA | right password | ``up == 1`` and the accelstats series stored |
| ``wrong-password`` | https, our CA | wrong password | ``up == 0``, last error a 401 |
| ``plain-http`` | http | right password | ``up == 0``, last error a 400 (plain HTTP to the TLS port) |

Needs the ``prometheus`` binary: skipped without it, except under ``CI=true`` where that fails.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import bcrypt
import pytest
from conftest import in_ci
from support.ports import free_port
from support.prom_harness import PrometheusServer, ScrapeTarget, prometheus_unavailable
from support.tls_pki import make_pki, openssl_missing

H200_UUID = "GPU-5f1c2a9e-0b7d-4c3e-9a61-2d8e4f7b9c10"
PASSWORD = "scrape-me"
JOBS = ("accelstats", "wrong-password", "plain-http")


pytestmark = [pytest.mark.slow,  # a real Prometheus scraping over TLS
              pytest.mark.xdist_group("webconfig_prometheus")]  # one worker, one Prometheus


@pytest.fixture(scope="module")
def prometheus_needed() -> None:
    for missing in (prometheus_unavailable(), openssl_missing()):
        if missing:
            if in_ci():
                pytest.fail(f"cannot run under CI=true: {missing}", pytrace=False)
            pytest.skip(missing)


@pytest.fixture(scope="module")
def scraped(prometheus_needed: None, fixtures_dir: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrometheusServer]:
    """The exporter with TLS + basic auth, and Prometheus after each job has been scraped 3 times."""
    work = tmp_path_factory.mktemp("webconfig-prom")
    pki = make_pki(work / "pki")
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=10)).decode()  # a realistic cost
    web = work / "web.yml"
    web.write_text(f"tls_server_config:\n  cert_file: {pki.server_cert}\n  key_file: {pki.server_key}\n"
                   f"basic_auth_users:\n  prometheus: '{hashed}'\n")
    port = free_port()
    log = (work / "accelstats.log").open("w")
    exporter = subprocess.Popen([sys.executable, "-m", "accelstats", "serve", "--listen", f"127.0.0.1:{port}",
                                 "--collector", "nvidia", "--web-config", str(web),
                                 "--nvml-replay", str(fixtures_dir / "h200" / "nvidia-smi-q.xml")],
                                stdout=log, stderr=log)
    address = f"127.0.0.1:{port}"
    tls = {"ca_file": str(pki.ca)}
    targets = [
        ScrapeTarget(address, job="accelstats", scheme="https", tls_config=tls,
                     basic_auth={"username": "prometheus", "password": PASSWORD}),
        ScrapeTarget(address, job="wrong-password", scheme="https", tls_config=tls,
                     basic_auth={"username": "prometheus", "password": "not-it"}),
        ScrapeTarget(address, job="plain-http", scheme="http",
                     basic_auth={"username": "prometheus", "password": PASSWORD}),
    ]
    try:
        with PrometheusServer(targets, workdir=work / "prometheus") as prom:
            deadline = time.monotonic() + 60
            while True:
                res = prom.query("sum by (job) (count_over_time(up[1h]))")  # scrapes so far
                counts = {s["metric"]["job"]: int(s["value"][1]) for s in res.series}
                if all(counts.get(job, 0) >= 3 for job in JOBS):
                    break
                if exporter.poll() is not None or time.monotonic() > deadline:
                    log.flush()
                    tail = (work / "accelstats.log").read_text()[-2000:]
                    pytest.fail(f"scrapes so far {counts}; exporter rc={exporter.poll()}; targets "
                                f"{prom.active_targets()}; exporter log: {tail}")
                time.sleep(0.3)
            yield prom
    finally:
        exporter.send_signal(signal.SIGTERM)
        try:
            exporter.wait(timeout=15)
        except subprocess.TimeoutExpired:
            exporter.kill()
            exporter.wait(timeout=10)
        log.close()


def _value(prom: PrometheusServer, expr: str) -> list[float]:
    res = prom.query(expr)
    assert res.ok, res.error
    return [float(s["value"][1]) for s in res.series]


def _last_error(prom: PrometheusServer, job: str) -> str:
    return next(str(t.get("lastError", "")) for t in prom.active_targets() if t.get("scrapePool") == job)


def test_tls_and_right_password_up_and_series_stored(scraped: PrometheusServer) -> None:
    assert _value(scraped, 'up{job="accelstats"}') == [1.0]
    assert _value(scraped, 'min_over_time(up{job="accelstats"}[1h])') == [1.0]  # never a failed scrape
    gpus = scraped.query('accelstats_gpu_info{job="accelstats"}')
    assert [s["metric"]["uuid"] for s in gpus.series] == [H200_UUID]
    assert _value(scraped, 'accelstats_gpu_up{job="accelstats"}') == [1.0]


def test_wrong_password_is_down_with_401(scraped: PrometheusServer) -> None:
    assert _value(scraped, 'max_over_time(up{job="wrong-password"}[1h])') == [0.0]
    assert "401" in _last_error(scraped, "wrong-password")
    assert _value(scraped, 'count(accelstats_gpu_info{job="wrong-password"})') == []


def test_plain_http_to_the_tls_port_is_down_with_400(scraped: PrometheusServer) -> None:
    assert _value(scraped, 'max_over_time(up{job="plain-http"}[1h])') == [0.0]
    assert "400" in _last_error(scraped, "plain-http")
