"""Run a real Prometheus server (Debian's ``prometheus`` binary) for end-to-end tests.

Usage::

    target = ScrapeTarget("127.0.0.1:9847")
    with PrometheusServer([target], workdir=tmp_path) as prom:
        prom.wait_for_scrapes(3)
        result = prom.query("accelstats_gpu_up")
        assert result.ok, result.error
        print(result.series)          # [{"metric": {...}, "value": [<unix time>, "1"]}, ...]

What it does:

* listens on a free loopback port (``--web.listen-address=127.0.0.1:<port>``) with a fresh TSDB in
  ``<workdir>/data`` (``--storage.tsdb.path``) and a generated ``<workdir>/prometheus.yml``: one
  scrape job per :class:`ScrapeTarget` (``scheme``, ``tls_config`` and ``basic_auth`` written as
  given: Prometheus' own keys, see its configuration docs), scrape and rule-evaluation interval
  ``scrape_interval_s`` (1 s by default; the scrape timeout equals it) and the given ``rule_files``;
* waits for ``/-/ready`` (200), or raises :class:`PrometheusError` with the end of its log if it
  exits or does not get ready within ``start_timeout_s``;
* answers queries through the HTTP API (``/api/v1/query``, ``/api/v1/targets``, ``/api/v1/rules``);
* stops with SIGTERM (SIGKILL after 10 s) when the ``with`` block ends, whatever happened in it.

The config is written as JSON, which is YAML, so no YAML library is needed. Prometheus' log is in
``<workdir>/prometheus.log`` (a file, not a pipe, so a chatty server never blocks).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from support.ports import free_port

__all__ = ["PrometheusError", "PrometheusServer", "QueryResult", "ScrapeTarget",
           "prometheus_unavailable"]

_HTTP_TIMEOUT_S = 10.0
_STOP_TIMEOUT_S = 10.0


class PrometheusError(RuntimeError):
    """Prometheus could not be started, did not answer, or did not scrape in time."""


@dataclass(frozen=True)
class ScrapeTarget:
    """One scrape job: ``address`` is ``host:port``; ``job`` must be unique within a server.

    ``tls_config`` (e.g. ``{"ca_file": ..., "server_name": ...}``) and ``basic_auth`` (``{"username":
    ..., "password": ...}``) are Prometheus' ``scrape_config`` sections, passed through unchanged.
    """

    address: str
    job: str = "accelstats"
    scheme: str = "http"
    metrics_path: str = "/metrics"
    tls_config: Mapping[str, Any] | None = None
    basic_auth: Mapping[str, str] | None = None

    def scrape_config(self, interval: str) -> dict[str, Any]:
        """This target's entry of ``scrape_configs``."""
        cfg: dict[str, Any] = {
            "job_name": self.job, "scrape_interval": interval, "scrape_timeout": interval,
            "scheme": self.scheme, "metrics_path": self.metrics_path,
            "static_configs": [{"targets": [self.address]}],
        }
        if self.tls_config is not None:
            cfg["tls_config"] = dict(self.tls_config)
        if self.basic_auth is not None:
            cfg["basic_auth"] = dict(self.basic_auth)
        return cfg


@dataclass(frozen=True)
class QueryResult:
    """One answer of ``/api/v1/query``.

    ``status`` is ``"success"`` or ``"error"``. On success ``result_type`` is ``vector``, ``matrix``,
    ``scalar`` or ``string`` and ``result`` is the API's ``data.result`` unchanged (vector:
    ``[{"metric": {label: value}, "value": [unix time, "value"]}]``); on error ``error_type`` is the
    API's (``bad_data`` for a parse error, ``execution`` for an evaluation error) and ``error`` its text.
    """

    expr: str
    status: str
    result_type: str = ""
    result: Any = None
    error_type: str = ""
    error: str = ""
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when Prometheus parsed and evaluated the expression."""
        return self.status == "success"

    @property
    def series(self) -> list[dict[str, Any]]:
        """The series of a vector or matrix result (empty for errors, scalars and strings)."""
        if self.ok and self.result_type in ("vector", "matrix"):
            return list(self.result)
        return []



def prometheus_unavailable(binary: str = "prometheus") -> str | None:
    """Why Prometheus cannot be run here (not on ``PATH``), or None if it can."""
    if shutil.which(binary) is None:
        return f"{binary} not found on PATH (apt-get install prometheus)"
    return None


class PrometheusServer:
    """A Prometheus process scraping ``targets``; see the module docstring. Use it as a context manager.

    Raises ValueError for an empty target list or duplicate job names, PrometheusError when the
    server cannot be started.
    """

    def __init__(self, targets: Sequence[ScrapeTarget], *, workdir: Path, scrape_interval_s: float = 1.0,
                 rule_files: Sequence[Path] = (), binary: str = "prometheus", start_timeout_s: float = 30.0) -> None:
        jobs = [t.job for t in targets]
        if not jobs:
            raise ValueError("at least one scrape target is needed")
        if len(set(jobs)) != len(jobs):
            raise ValueError(f"scrape job names must be unique, got {jobs}")
        self.targets = list(targets)
        self.workdir = workdir
        self.interval = f"{int(scrape_interval_s * 1000)}ms"
        self.rule_files = [Path(p).resolve() for p in rule_files]
        self.binary = binary
        self.start_timeout_s = start_timeout_s
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>`` (valid once started)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        """Prometheus' log file."""
        return self.workdir / "prometheus.log"

    def config(self) -> dict[str, Any]:
        """The configuration written to ``prometheus.yml``."""
        return {
            "global": {"scrape_interval": self.interval, "evaluation_interval": self.interval},
            "rule_files": [str(p) for p in self.rule_files],
            "scrape_configs": [t.scrape_config(self.interval) for t in self.targets],
        }

    # -- lifecycle

    def start(self) -> None:
        """Write the config, start Prometheus and wait until ``/-/ready`` answers 200."""
        if self._proc is not None:
            raise PrometheusError("already started")
        if prometheus_unavailable(self.binary):
            raise PrometheusError(str(prometheus_unavailable(self.binary)))
        self.workdir.mkdir(parents=True, exist_ok=True)
        config_file = self.workdir / "prometheus.yml"
        config_file.write_text(json.dumps(self.config(), indent=2))
        self.port = free_port()
        cmd = [self.binary, f"--config.file={config_file}", f"--storage.tsdb.path={self.workdir / 'data'}",
               f"--web.listen-address=127.0.0.1:{self.port}"]
        with self.log_path.open("wb") as log:
            self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                          start_new_session=True)
        deadline = time.monotonic() + self.start_timeout_s
        last = "no answer yet"
        while True:
            if self._proc.poll() is not None:
                raise PrometheusError(f"prometheus exited with {self._proc.returncode}: {self._log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError) as err:
                last = str(err)  # not listening yet, or 503 while starting: poll again until the deadline
            if time.monotonic() > deadline:
                self.stop()
                raise PrometheusError(f"prometheus not ready after {self.start_timeout_s} s ({last}): "
                                      f"{self._log_tail()}")
            time.sleep(0.1)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s; idempotent."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=_STOP_TIMEOUT_S)

    def __enter__(self) -> PrometheusServer:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def _log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError as err:
            return f"(no log: {err})"

    # -- HTTP API

    def _get(self, path: str, params: Mapping[str, str] | None = None) -> dict[str, Any]:
        """GET an API path; returns the JSON body also for 4xx/5xx answers (the API's errors are JSON)."""
        url = self.url + path + ("?" + urllib.parse.urlencode(params) if params else "")
        try:
            with urllib.request.urlopen(url, timeout=_HTTP_TIMEOUT_S) as resp:
                body = resp.read()
        except urllib.error.HTTPError as err:
            body = err.read()
        except (urllib.error.URLError, OSError) as err:
            raise PrometheusError(f"GET {url}: {err}") from err
        try:
            data: dict[str, Any] = json.loads(body)
        except ValueError as err:
            raise PrometheusError(f"GET {url}: not JSON: {body[:200]!r}") from err
        return data

    def query(self, expr: str, at: float | None = None) -> QueryResult:
        """Evaluate ``expr`` at ``at`` (Unix seconds; default now). API errors come back in the result;
        raises PrometheusError only when Prometheus does not answer."""
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        body = self._get("/api/v1/query", params)
        data = body.get("data") or {}
        return QueryResult(expr=expr, status=str(body.get("status", "")), result_type=str(data.get("resultType", "")),
                           result=data.get("result"), error_type=str(body.get("errorType", "")),
                           error=str(body.get("error", "")), warnings=list(body.get("warnings", [])))

    def active_targets(self) -> list[dict[str, Any]]:
        """``/api/v1/targets``' active targets (keys ``scrapePool``, ``health``, ``lastError``, ...)."""
        return list(self._get("/api/v1/targets").get("data", {}).get("activeTargets", []))

    def rules(self) -> list[dict[str, Any]]:
        """Every loaded rule (``/api/v1/rules``), each with ``name``, ``query``, ``type``, ``health``,
        ``lastError`` and the ``group`` and ``file`` it is in."""
        out: list[dict[str, Any]] = []
        for group in self._get("/api/v1/rules").get("data", {}).get("groups", []):
            for rule in group.get("rules", []):
                out.append({**rule, "group": group.get("name", ""), "file": group.get("file", "")})
        return out

    def wait_for_scrapes(self, n: int, timeout_s: float = 30.0) -> dict[str, int]:
        """Wait until every target has been scraped successfully ``n`` times; returns {job: count}.

        Counts ``up == 1`` samples (``sum_over_time(up[1h])``). Raises PrometheusError on timeout,
        naming each target's health and last scrape error.
        """
        deadline = time.monotonic() + timeout_s
        jobs = {t.job for t in self.targets}
        counts: dict[str, int] = {}
        while True:
            res = self.query("sum by (job) (sum_over_time(up[1h]))")
            counts = {s["metric"].get("job", ""): int(float(s["value"][1])) for s in res.series}
            if all(counts.get(job, 0) >= n for job in jobs):
                return counts
            if time.monotonic() > deadline:
                health = [(t.get("scrapePool"), t.get("health"), t.get("lastError")) for t in self.active_targets()]
                raise PrometheusError(f"fewer than {n} successful scrapes after {timeout_s} s: {counts}; "
                                      f"targets (job, health, last error): {health}")
            time.sleep(0.2)
