"""Soak: many scrapes in one process; RSS, open fds and threads must not grow.

One process holds both sides: the exporter (``accelstats.web.server.serve`` on ``127.0.0.1``, an
ephemeral port, over the scrape benchmark's synthetic host: 1 replayed H200 x 10 containers by
default, so 100 000 scrapes take minutes) and the client (``http.client``, one new connection per
request: the server keeps connections alive, but a new one each time exercises every part of a
connection's life). HTTP rather than ``generate_latest`` alone because what could leak per scrape
is as much the server's as the collection's: the socket and its state in the event loop, the worker
threads, the app, the request objects; a
client in the same process keeps nothing between requests, so it cannot hide a leak, and a leak on
either side shows in the one RSS. ``--in-process`` times ``generate_latest`` on the registry
instead (collection, rendering and encoding only).

Every ``--every`` scrapes it samples the process's RSS (psutil), open fds and threads. Thread and
fd counts are the minimum over 0.2 s of polling: a closing socket can linger for a moment after
its response (the server reads what the client still sends before it closes), so a single sample
can catch one; a thread or fd that stays is a leak. Worker threads are started on demand and end
after 5 idle seconds, so the pool's size may differ by one or two between samples.
The first ``--warmup`` scrapes (default: a tenth, at most 1000) are excluded: the baseline is taken
after them. Verdict: RSS growth (end - baseline) < 5 MiB, and no more fds or threads at the end
than at the baseline; exit status 1 otherwise (a benchmark verdict, not a unit test).

Usage: ``python3 benchmarks/soak.py [--scrapes 100000] [--every 1000] [--in-process]``; a short run:
``--scrapes 2000``. Figures go to docs/performance.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import logging
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from prometheus_client.exposition import generate_latest
from scrape import build_host, default_shared, loadavg, machine  # benchmarks/ is sys.path[0]

from accelstats.manager import AcceleratorManager
from accelstats.settings import Settings
from accelstats.web.exposition import make_registry
from accelstats.web.server import serve
from collectors.replay.lib import open_replay

MIB = 2**20
LIMIT_BYTES = 5 * MIB


@dataclass
class Sample:
    """Process state after ``scrapes`` scrapes: RSS bytes, open fds, threads, seconds since start."""

    scrapes: int
    rss: int
    fds: int
    threads: int
    seconds: float


@dataclass
class SoakResult:
    """Samples (the first is the baseline, taken after the warm-up) and the verdict's parts."""

    samples: list[Sample] = field(default_factory=list)
    errors: int = 0
    first_error: str = ""
    scrapes: int = 0
    scrape_seconds: float = 0.0  # wall time of the counted scrapes, sampling pauses left out

    @property
    def baseline(self) -> Sample:
        """The sample after the warm-up."""
        return self.samples[0]

    @property
    def end(self) -> Sample:
        """The last sample."""
        return self.samples[-1]

    @property
    def rss_growth(self) -> int:
        """End RSS minus baseline RSS, bytes (negative when it shrank)."""
        return self.end.rss - self.baseline.rss

    @property
    def failures(self) -> list[str]:
        """Why the soak failed; empty when it passed."""
        out = []
        if self.errors:
            out.append(f"{self.errors} scrapes failed (first: {self.first_error})")
        if self.rss_growth >= LIMIT_BYTES:
            out.append(f"RSS grew {self.rss_growth / MIB:.2f} MiB (limit < 5 MiB)")
        if self.end.fds > self.baseline.fds:
            out.append(f"open fds grew from {self.baseline.fds} to {self.end.fds}")
        if self.end.threads > self.baseline.threads:
            out.append(f"threads grew from {self.baseline.threads} to {self.end.threads}")
        return out


def settled_counts(p: psutil.Process, seconds: float = 0.2) -> tuple[int, int]:
    """(open fds, threads) of ``p``: each the minimum over ``seconds`` of polling every 10 ms."""
    fds, threads = p.num_fds(), p.num_threads()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.01)
        fds, threads = min(fds, p.num_fds()), min(threads, p.num_threads())
    return fds, threads


def http_scraper(host: str, port: int) -> Callable[[], str]:
    """A scrape over a new connection to ``host:port``; answers "" or why it failed."""

    def scrape() -> str:
        conn = http.client.HTTPConnection(host, port, timeout=30)
        try:
            conn.request("GET", "/metrics")
            resp = conn.getresponse()
            body = resp.read()
        except (OSError, http.client.HTTPException) as exc:
            return f"{type(exc).__name__}: {exc}"
        finally:
            conn.close()
        if resp.status != 200 or not body.endswith(b"\n"):
            return f"HTTP {resp.status}, {len(body)} bytes"
        return ""

    return scrape


def soak(settings: Settings, scrapes: int, every: int = 1000, warmup: int | None = None, http: bool = True,
         progress: Callable[[Sample], None] | None = None) -> SoakResult:
    """Run ``warmup`` then ``scrapes`` scrapes of the exporter for ``settings`` (replay NVML) in this
    process, sampling every ``every`` (see the module docstring); ``progress`` gets each sample.
    Raises ValueError when ``settings`` has no replay or ``every`` does not divide ``scrapes``."""
    if settings.nvml_replay is None:
        raise ValueError("soak needs a replay (settings.nvml_replay)")
    if every <= 0 or scrapes % every:
        raise ValueError(f"--every {every} must divide --scrapes {scrapes}")
    warmup = min(1000, scrapes // 10) if warmup is None else warmup
    manager = AcceleratorManager(settings, open_replay(settings.nvml_replay))
    manager.setup()
    server = None
    if http:
        server, _ = serve(manager, "127.0.0.1", 0)
        scrape = http_scraper("127.0.0.1", server.server_port)
    else:
        registry = make_registry(manager)

        def scrape() -> str:
            return "" if generate_latest(registry).endswith(b"\n") else "exposition does not end with a newline"

    me = psutil.Process()
    result = SoakResult()
    t0 = time.monotonic()

    def sample(done: int) -> None:
        t1 = time.monotonic()
        fds, threads = settled_counts(me)
        s = Sample(done, me.memory_info().rss, fds, threads, t1 - t0)
        result.samples.append(s)
        result.scrape_seconds -= time.monotonic() - t1
        if progress is not None:
            progress(s)

    try:
        for _ in range(warmup):
            scrape()
        sample(0)
        result.scrape_seconds = -(time.monotonic() - t0)
        for i in range(1, scrapes + 1):
            error = scrape()
            if error:
                result.errors += 1
                result.first_error = result.first_error or error
            if i % every == 0:
                sample(i)
        result.scrapes = scrapes
        result.scrape_seconds += time.monotonic() - t0
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()
        manager.destroy()
        manager.close()
    return result


def small_host(root: Path, shared: Path, gpus: int = 1, containers: int = 10) -> Settings:
    """The scrape benchmark's host in ``root`` (replayed H200s), with an empty rootfs of its own."""
    settings = build_host(root, shared / "fixtures" / "h200" / "nvidia-smi-q.xml", gpus, containers)
    (root / "rootfs").mkdir()
    return dataclasses.replace(settings, rootfs=root / "rootfs")


def main() -> int:
    """Soak and print samples and the verdict."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scrapes", type=int, default=100_000)
    parser.add_argument("--every", type=int, default=None, help="sample every N scrapes (default: scrapes/100)")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--in-process", action="store_true", help="generate_latest instead of HTTP")
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--containers", type=int, default=10)
    parser.add_argument("--shared", type=Path, default=default_shared())
    args = parser.parse_args()
    every = args.every or max(1, args.scrapes // 100)
    logging.basicConfig(level=logging.WARNING)
    print(f"# {machine()}")
    print(f"# start {loadavg()}")
    how = "generate_latest in process" if args.in_process else "HTTP to an in-process server"
    print(f"# {args.scrapes} scrapes, {how}, {args.gpus} replayed GPU(s) x {args.containers} containers, "
          f"sampled every {every}", flush=True)
    print(f"{'scrapes':>8} {'seconds':>8} {'RSS MiB':>9} {'fds':>4} {'threads':>7}", flush=True)

    def show(s: Sample) -> None:
        print(f"{s.scrapes:>8} {s.seconds:>8.1f} {s.rss / MIB:>9.2f} {s.fds:>4} {s.threads:>7}", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        settings = small_host(Path(tmp), args.shared, args.gpus, args.containers)
        r = soak(settings, args.scrapes, every, args.warmup, http=not args.in_process, progress=show)
    rss = [s.rss for s in r.samples]
    print(f"RSS: baseline {r.baseline.rss / MIB:.2f} MiB, end {r.end.rss / MIB:.2f} MiB, max {max(rss) / MIB:.2f} MiB, "
          f"growth {r.rss_growth / MIB:+.2f} MiB")
    print(f"fds: {r.baseline.fds} -> {r.end.fds} (max {max(s.fds for s in r.samples)}); threads: {r.baseline.threads} "
          f"-> {r.end.threads} (max {max(s.threads for s in r.samples)}); errors {r.errors}; "
          f"{r.scrapes / r.scrape_seconds:.0f} scrapes/s ({r.scrape_seconds:.0f} s of scraping)")
    print(f"verdict: {'PASS' if not r.failures else 'FAIL: ' + '; '.join(r.failures)}")
    print(f"# end {loadavg()}")
    return 1 if r.failures else 0


if __name__ == "__main__":
    sys.exit(main())
