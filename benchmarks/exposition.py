"""A scrape as Prometheus asks for it: collection + encoding (+ gzip), fast encoder vs prometheus_client.

For 8 GPUs x 1000 containers and 1 GPU x 10 containers (the replayed H200 capture, a cgroup v1 tree
built in a temp directory, benchmarks/scrape.py ``build_host``), each scrape is a fresh collection
(``manager.collect()``) and one ``/metrics`` body from ``SharedExposition``, as the server makes it:

* ``text``: no ``Accept`` header (Prometheus text 0.0.4), no gzip;
* ``prometheus``: ``Accept: application/openmetrics-text;version=1.0.0,…`` and ``Accept-Encoding:
  gzip`` (what Debian's Prometheus 2.42 sends);

each with the fast encoder (the default) and with prometheus_client's encoders (``fast=False``),
interleaved. Prints CPU milliseconds per scrape (``time.process_time``: every thread of this process,
so the collection's worker threads count) as p50 / p90, the collection alone, and the gzip levels:
size and CPU per level for the 8 x 1000 OpenMetrics body. Targets (docs/performance.md): 8 x 1000
prometheus p50 <= 25 ms, text p50 <= 20 ms.

Usage: ``python3 benchmarks/exposition.py [--scrapes 60]``. No pass/fail: figures to record.
"""

from __future__ import annotations

import argparse
import gzip
import logging
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from scrape import build_host, default_shared, loadavg, machine

from accelstats.manager import AcceleratorManager
from accelstats.web.app import ServerCounters, SharedExposition
from collectors.replay.lib import open_replay

PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                     "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")
CASES = {"text": ("", ""), "prometheus": (PROMETHEUS_ACCEPT, "gzip")}


def cpu_ms(fn: Callable[[], object]) -> float:
    """CPU milliseconds ``fn()`` took, every thread of this process (``time.process_time``)."""
    t0 = time.process_time()
    fn()
    return (time.process_time() - t0) * 1000


def run(gpus: int, containers: int, scrapes: int, capture: Path) -> dict[str, list[float]]:
    """CPU ms per scrape for every (case, encoder), interleaved, plus ``collect`` alone."""
    with tempfile.TemporaryDirectory() as tmp:
        settings = build_host(Path(tmp), capture, gpus, containers)
        assert settings.nvml_replay is not None
        with AcceleratorManager(settings, open_replay(settings.nvml_replay)) as manager:
            shared = {fast: SharedExposition(manager, extra=[ServerCounters()], fast=fast) for fast in (True, False)}
            for _ in range(3):  # warm-up: NVML slow values, label cache
                for s in shared.values():
                    for accept, encoding in CASES.values():
                        s.body(accept, encoding)
            times: dict[str, list[float]] = {}
            for _ in range(scrapes):
                for case, (accept, encoding) in CASES.items():
                    for fast, s in shared.items():
                        key = f"{case} {'fast' if fast else 'prometheus_client'}"
                        times.setdefault(key, []).append(cpu_ms(lambda s=s, a=accept, e=encoding: s.body(a, e)))
                times.setdefault("collect alone", []).append(cpu_ms(manager.collect))
            if gpus == 8:
                body, _ = shared[True].body(PROMETHEUS_ACCEPT, "")
                levels: dict[int, list[float]] = {level: [] for level in (1, 2, 3, 6, 9)}
                for _ in range(30):  # interleaved, so that the machine's moods fall on every level
                    for level, ms in levels.items():
                        ms.append(cpu_ms(lambda b=level: gzip.compress(body, compresslevel=b)))
                for level, ms in levels.items():
                    size = len(gzip.compress(body, compresslevel=level))
                    times[f"gzip level {level} ({size} of {len(body)} B)"] = ms
    return times


def main() -> None:
    """Run both hosts and print the figures (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scrapes", type=int, default=60)
    parser.add_argument("--shared", type=Path, default=default_shared())
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    capture = args.shared / "fixtures" / "h200" / "nvidia-smi-q.xml"
    print(f"# {machine()} {loadavg()} scrapes={args.scrapes} (CPU ms per scrape)")
    for gpus, containers in ((8, 1000), (1, 10)):
        times = run(gpus, containers, args.scrapes, capture)
        print(f"\n{gpus} GPUs x {containers} containers")
        for key, ms in times.items():
            ms.sort()
            p90 = ms[min(len(ms) - 1, int(len(ms) * 0.9))]
            print(f"  {key:<58} p50 {statistics.median(ms):8.2f}   p90 {p90:8.2f}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
