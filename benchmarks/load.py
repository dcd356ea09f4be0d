"""Load: concurrent scrapers against a real ``accelstats serve`` on loopback.

Builds the scrape benchmark's synthetic host (``scrape.build_host``: G GPUs replayed from the H200
capture, N docker containers on a cgroup v1 devices tree), starts ``python3 -m accelstats serve`` on
``127.0.0.1`` with ``--nvml-replay`` / ``--cgroup-root`` / ``--proc-root`` / ``--rootfs`` pointing
at it, then runs ``--clients`` scraper threads (``http.client``, one new connection per request, the
costlier case: the server keeps HTTP/1.1 connections alive, but a scraper that connects anew each
time pays the accept and the head read each time; no ``Accept-Encoding``, so bodies are plain text)
for ``--seconds``.

Printed: requests, errors (any non-200, timeout, connection error, or a body shorter than its
Content-Length or not ending in a newline), p50/p99/max latency (connect to last byte), scrapes/s,
the TCP connect time alone (p99, and how many took ≥ 0.9 s: Linux retransmits a dropped SYN after
1 s, so those met a full listen backlog), how many 200 answers reported a GPU down or a collector
failed (``accelstats_gpu_up 0``, ``accelstats_scrape_collector_success 0``: e.g. NVML past its 1.5 s
deadline while the process was busy),
the CPU the exporter process and this client process took (psutil, in cores), the exporter's RSS,
threads and fds, and the collections the scrapes were served from.

Collections are counted from outside: every response carries
``accelstats_scrape_collector_duration_seconds`` of the ``nvidia`` collector and of ``attribution``,
measured by the collection it was rendered from, so responses with the same pair of values came
from one collection. ``--check-seconds`` first validates that method in process: the same clients
against the registry, with the NVML object wrapped to count calls (one
``nvmlDeviceGetPowerUsage`` per GPU per NVML pass, one pass per collection), and prints both counts.

With ``--wrk SECONDS`` it then runs ``wrk`` (a C client, ``apt-get install wrk``) against the same
server with the same number of connections; wrk does not check bodies and cannot count collections.

Usage: ``python3 benchmarks/load.py [--seconds 60] [--clients 50] [--gpus 8] [--containers 1000]``.
Exit status 1 when any request failed. Figures go to docs/performance.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import logging
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from prometheus_client.exposition import generate_latest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # support.ports: the one free_port

from scrape import build_host, default_shared, loadavg, machine, percentile  # benchmarks/ is sys.path[0]
from support.ports import free_port

from accelstats.manager import AcceleratorManager
from accelstats.settings import Settings
from accelstats.web.exposition import make_registry
from collectors.replay.lib import open_replay

REPO = Path(__file__).resolve().parents[1]
DURATION_FAMILY = b"# TYPE accelstats_scrape_collector_duration_seconds gauge\n"
DURATION_SAMPLE = re.compile(rb'accelstats_scrape_collector_duration_seconds\{collector="([a-z_]+)"\} (\S+)\n')
UP_FAMILY = b"# TYPE accelstats_gpu_up gauge\n"
SUCCESS_FAMILY = b"# TYPE accelstats_scrape_collector_success gauge\n"
DOWN_SAMPLE = re.compile(rb"^accelstats_(?:gpu_up|scrape_collector_success)\{[^}\n]*\} 0\.0$", re.MULTILINE)


class RecordingNVML:
    """Wraps an NVML object (the ``pynvml`` module, or pynvml over a replay: :class:`ReplayedNVML`) and
    counts every NVML function called through it, by name (``counts``). While :meth:`record` is on, calls made on a
    thread named ``thread`` are also kept, in order, as ``(name, args, kwargs)`` in ``calls``.

    Everything else (constants, classes, ``NVMLError``, ``source``) is the wrapped object's own, so
    the backend cannot tell the difference. Thread-safe."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.counts: Counter[str] = Counter()
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self._thread: str | None = None
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.inner, name)
        if not name.startswith("nvml") or isinstance(value, type) or not callable(value):
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self.counts[name] += 1
                if self._thread is not None and threading.current_thread().name == self._thread:
                    self.calls.append((name, args, kwargs))
            return value(*args, **kwargs)

        return call

    def __dir__(self) -> list[str]:
        return sorted(set(dir(self.inner)))

    @contextmanager
    def record(self, thread: str) -> Iterator[list[tuple[str, tuple[Any, ...], dict[str, Any]]]]:
        """Keep the calls made on thread ``thread`` until the block ends; yields the list they go to."""
        with self._lock:
            self.calls = []
            self._thread = thread
        try:
            yield self.calls
        finally:
            with self._lock:
                self._thread = None


@dataclass
class ScrapeResult:
    """One request: ``error`` "" when it succeeded; ``seconds`` from connect to the last byte;
    ``collection`` the (nvidia, attribution) durations it was rendered from (None on error)."""

    error: str
    seconds: float
    size: int = 0
    collection: tuple[bytes, ...] | None = None
    connect: float = 0.0  # seconds of the TCP connect alone
    degraded: bool = False  # a GPU reported down or a collector failed (see :func:`degraded`)


def collection_key(body: bytes) -> tuple[bytes, ...] | None:
    """The ``accelstats_scrape_collector_duration_seconds`` values of one exposition, in order:
    the same tuple means the same collection. None when the family is missing."""
    at = body.find(DURATION_FAMILY)
    if at < 0:
        return None
    values = DURATION_SAMPLE.findall(body, at, at + 4096)
    return tuple(v for _, v in values) or None


def degraded(body: bytes) -> bool:
    """True when the exposition reports a GPU down (``accelstats_gpu_up 0``: lost, or NVML past its
    deadline) or a collector failed (``accelstats_scrape_collector_success 0``): a 200 that is
    not the whole truth. Looks only at those two families' first 16 KiB."""
    for family in (UP_FAMILY, SUCCESS_FAMILY):
        at = body.find(family)
        if at >= 0 and DOWN_SAMPLE.search(body, at, at + 16384):
            return True
    return False


def check_body(status: int, length: str | None, body: bytes) -> str:
    """Why a response is an error ("" when it is not): non-200, a Content-Length other than the
    body's size, or a body that does not end in a newline (text exposition ends every line)."""
    if status != 200:
        return f"HTTP {status}"
    if length is None or int(length) != len(body):
        return f"truncated: Content-Length {length}, {len(body)} bytes read"
    if not body.endswith(b"\n"):
        return "truncated: body does not end with a newline"
    return ""


def http_scrape(host: str, port: int, timeout: float, sources: int = 1) -> ScrapeResult:
    """``GET /metrics`` on a new connection (``Connection: close``); never raises. ``sources`` > 1:
    scraper thread ``scraper-<i>`` connects from 127.0.0.<2 + i mod sources> (one address per
    Prometheus server: the exporter shares its workers by client address)."""
    t0 = time.perf_counter()
    source = None
    if sources > 1:
        index = int(threading.current_thread().name.rpartition("-")[2] or 0)
        source = (f"127.0.0.{2 + index % sources}", 0)
    conn = http.client.HTTPConnection(host, port, timeout=timeout, source_address=source)
    connect = 0.0
    try:
        conn.connect()
        connect = time.perf_counter() - t0
        conn.request("GET", "/metrics", headers={"Connection": "close"})
        resp = conn.getresponse()
        body = resp.read()
        status, length = resp.status, resp.getheader("Content-Length")
    except (OSError, http.client.HTTPException) as exc:  # timeouts are OSError; IncompleteRead is HTTPException
        return ScrapeResult(f"{type(exc).__name__}: {exc}"[:200], time.perf_counter() - t0, connect=connect)
    finally:
        conn.close()
    seconds = time.perf_counter() - t0
    error = check_body(status, length, body)
    key = collection_key(body) if not error else None
    if not error and key is None:
        error = "no accelstats_scrape_collector_duration_seconds in the body"
    return ScrapeResult(error, seconds, len(body), key, connect, not error and degraded(body))


def run_clients(scrape: Callable[[], ScrapeResult], clients: int, seconds: float) -> tuple[list[ScrapeResult], float]:
    """``clients`` threads calling ``scrape`` back to back until ``seconds`` have passed (a request
    started before the end is waited for). Returns (every result, wall seconds)."""
    results: list[ScrapeResult] = []
    end = time.monotonic() + seconds

    def loop() -> None:
        while time.monotonic() < end:
            results.append(scrape())  # list.append is atomic under the GIL

    threads = [threading.Thread(target=loop, name=f"scraper-{i}", daemon=True) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - t0



class ServeProcess:
    """``python3 -m accelstats serve`` on ``127.0.0.1:<free port>`` for ``settings`` (replay or, with
    ``nvml_replay`` None, live NVML; its cgroup, proc and rootfs roots; only the nvidia collector) and
    an empty config file. A context manager: started and waited for (``/healthz``) on entry,
    SIGTERM (then SIGKILL after 10 s) on exit. Raises RuntimeError when it does not come up in 60 s."""

    def __init__(self, settings: Settings, workdir: Path) -> None:
        self.port = free_port()
        config = workdir / "empty.toml"
        config.write_text("")
        self.argv = [sys.executable, "-m", "accelstats", "serve", "--listen", f"127.0.0.1:{self.port}",
                     "--config", str(config), "--collector", "nvidia", "--cgroup-root", str(settings.cgroup_root),
                     "--proc-root", str(settings.proc_root), "--rootfs", str(settings.rootfs),
                     "--log-level", "warning"]
        if settings.nvml_replay is not None:
            self.argv += ["--nvml-replay", str(settings.nvml_replay)]
        self.log = workdir / "serve.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> ServeProcess:
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"accelstats serve exited with {self.proc.returncode}: "
                                   f"{self.log.read_text()[-2000:]}")
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
            try:
                conn.request("GET", "/healthz")
                if conn.getresponse().status == 200:
                    return self
            except OSError:
                pass  # not listening yet
            finally:
                conn.close()
            time.sleep(0.1)
        self.__exit__()
        raise RuntimeError(f"accelstats serve did not answer /healthz within 60 s: {self.log.read_text()[-2000:]}")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    @property
    def ps(self) -> psutil.Process:
        """The exporter process (psutil)."""
        assert self.proc is not None
        return psutil.Process(self.proc.pid)


@dataclass
class ProcessWatch:
    """Samples a process's threads and RSS every ``interval`` seconds in a daemon thread."""

    process: psutil.Process
    interval: float = 0.5
    threads: list[int] = field(default_factory=list)
    rss: list[int] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> ProcessWatch:
        threading.Thread(target=self._loop, name="watch", daemon=True).start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.threads.append(self.process.num_threads())
                self.rss.append(self.process.memory_info().rss)
            except psutil.Error:
                return  # the process ended: the samples so far stand

    def __exit__(self, *exc: object) -> None:
        self._stop.set()


def cpu_seconds(p: psutil.Process) -> float:
    """User + system CPU seconds of ``p`` so far (all its threads)."""
    t = p.cpu_times()
    return float(t.user + t.system)


def summarize(results: Sequence[ScrapeResult], wall: float) -> dict[str, Any]:
    """Counts, latency percentiles (ms) and collections of one run."""
    ok = sorted(r.seconds * 1000 for r in results if not r.error)
    errors = Counter(r.error.split(":")[0] for r in results if r.error)
    collections = {r.collection for r in results if r.collection is not None}
    return {"requests": len(results), "errors": sum(errors.values()), "error_kinds": dict(errors),
            "first_error": next((r.error for r in results if r.error), ""),
            "p50": percentile(ok, 50) if ok else float("nan"), "p99": percentile(ok, 99) if ok else float("nan"),
            "max": ok[-1] if ok else float("nan"), "rate": len(ok) / wall, "collections": len(collections),
            "bytes": max((r.size for r in results), default=0),
            "connect_p99": percentile(sorted(r.connect * 1000 for r in results), 99) if results else float("nan"),
            "slow_connects": sum(1 for r in results if r.connect >= 0.9),
            "degraded": sum(1 for r in results if r.degraded)}


def check_in_process(settings: Settings, clients: int, seconds: float) -> tuple[int, int, int]:
    """The collection count's cross-check: ``clients`` threads of ``generate_latest`` on the exporter's
    registry for ``seconds``, NVML replay wrapped to count calls. Returns (scrapes, NVML passes counted
    by calls, distinct collector-duration pairs in the bodies)."""
    assert settings.nvml_replay is not None
    nvml = RecordingNVML(open_replay(settings.nvml_replay))
    manager = AcceleratorManager(settings, nvml)
    manager.setup()
    registry = make_registry(manager)
    generate_latest(registry)  # NVML init and enumeration
    gpus = nvml.inner.nvmlDeviceGetCount()
    before = nvml.counts["nvmlDeviceGetPowerUsage"]

    def scrape() -> ScrapeResult:
        t0 = time.perf_counter()
        body = generate_latest(registry)
        return ScrapeResult("", time.perf_counter() - t0, len(body), collection_key(body))

    results, _ = run_clients(scrape, clients, seconds)
    passes = (nvml.counts["nvmlDeviceGetPowerUsage"] - before) // gpus
    manager.destroy()
    manager.close()
    return len(results), passes, len({r.collection for r in results})


def run_wrk(port: int, clients: int, seconds: float, server: psutil.Process) -> str:
    """wrk's own report for ``seconds`` with ``clients`` connections, 2 threads, 30 s timeout, and the
    exporter's CPU meanwhile; or why it was not run."""
    wrk = shutil.which("wrk")
    if wrk is None:
        return "wrk: not run (not installed; apt-get install wrk)"
    cpu0 = cpu_seconds(server)
    out = subprocess.run([wrk, "-t2", f"-c{clients}", f"-d{seconds:g}s", "--timeout", "30s", "--latency",
                          f"http://127.0.0.1:{port}/metrics"], capture_output=True, text=True, timeout=seconds + 120)
    cpu = cpu_seconds(server) - cpu0
    return (f"{out.stdout}{out.stderr}exporter CPU during wrk: {cpu:.1f} s = {cpu / seconds:.2f} cores "
            f"(wrk exit {out.returncode})")


def main() -> int:
    """Build the host, run the in-process check, the HTTP load and optionally wrk; print figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--sources", type=int, default=1,
                        help="client addresses (127.0.0.2 on): 1 = every scraper from 127.0.0.1")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--containers", type=int, default=1000)
    parser.add_argument("--timeout", type=float, default=30.0, help="per-request socket timeout, seconds")
    parser.add_argument("--check-seconds", type=float, default=3.0, help="in-process cross-check (0: skip)")
    parser.add_argument("--wrk", type=float, default=0.0, help="then run wrk for this many seconds (0: no)")
    parser.add_argument("--shared", type=Path, default=default_shared())
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    capture = args.shared / "fixtures" / "h200" / "nvidia-smi-q.xml"
    print(f"# {machine()}")
    print(f"# start {loadavg()}")
    print(f"# {args.clients} clients x {args.seconds:g} s from {args.sources} address(es), {args.gpus} replayed GPUs, "
          f"{args.containers} containers; "
          "http.client, a new connection per request (no keep-alive reuse), no gzip")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        settings = build_host(root, capture, args.gpus, args.containers)
        (root / "rootfs").mkdir()
        settings = dataclasses.replace(settings, rootfs=root / "rootfs")  # no host runtime state files
        if args.check_seconds > 0:
            scrapes, passes, keys = check_in_process(settings, args.clients, args.check_seconds)
            verdict = "agree" if passes == keys else "DISAGREE"
            print(f"in-process check ({args.check_seconds:g} s, generate_latest): {scrapes} scrapes, {passes} "
                  f"collections by NVML calls, {keys} by collector durations ({verdict})")
        with ServeProcess(settings, root) as server:
            first = http_scrape("127.0.0.1", server.port, args.timeout)
            if first.error:
                print(f"first scrape failed: {first.error}")
                return 1
            ps, me = server.ps, psutil.Process()
            cpu_s0, cpu_c0 = cpu_seconds(ps), cpu_seconds(me)
            with ProcessWatch(ps) as watch:
                results, wall = run_clients(lambda: http_scrape("127.0.0.1", server.port, args.timeout, args.sources),
                                            args.clients, args.seconds)
            cpu_s, cpu_c = cpu_seconds(ps) - cpu_s0, cpu_seconds(me) - cpu_c0
            s = summarize(results, wall)
            print(f"requests {s['requests']}, errors {s['errors']} {s['error_kinds'] or ''}"
                  f"{' first: ' + s['first_error'] if s['errors'] else ''}")
            print(f"latency ms: p50 {s['p50']:.1f}, p99 {s['p99']:.1f}, max {s['max']:.1f}; "
                  f"{s['rate']:.2f} scrapes/s over {wall:.1f} s; body {s['bytes']} bytes")
            print(f"TCP connect: p99 {s['connect_p99']:.1f} ms; {s['slow_connects']} took >= 0.9 s (a SYN "
                  "retransmitted: the listen backlog was full)")
            ratio = (s["requests"] - s["errors"]) / max(1, s["collections"])
            print(f"collections {s['collections']} for {s['requests'] - s['errors']} scrapes "
                  f"({ratio:.2f} scrapes per collection); {s['degraded']} answers reported a GPU down or a "
                  "collector failed")
            print(f"CPU: exporter {cpu_s:.1f} s = {cpu_s / wall:.2f} cores, scrapers (this process) {cpu_c:.1f} s = "
                  f"{cpu_c / wall:.2f} cores")
            print(f"exporter: threads max {max(watch.threads, default=0)}, RSS max "
                  f"{max(watch.rss, default=0) / 2**20:.0f} MiB, now {ps.memory_info().rss / 2**20:.0f} MiB, "
                  f"fds {ps.num_fds()}")
            if args.wrk > 0:
                print(run_wrk(server.port, args.clients, args.wrk, ps))
    print(f"# end {loadavg()}")
    return 1 if s["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
