"""Scale to the floor, in one run: a scrape beside the I/O it cannot avoid, from 1 x 10 to 8 x 5000, then
the accounting overhead, then start-up, CPU and RSS beside nvitop-exporter.

1. For each host (GPUs x containers: 1 x 10, 8 x 100, 8 x 1000, 8 x 5000; the replayed H200 capture and a
   cgroup v1 tree: with ``--tree cgroupfs`` real cgroups in the host's v1 ``devices`` hierarchy, removed
   after, benchmarks/scrape.py ``cgroupfs_host``; with ``--tree tmp`` files in a temp directory,
   ``build_host``; ``auto``, the default, takes cgroupfs where it can: root and a v1 devices hierarchy),
   interleaved scrape by scrape:

   * ``accelstats``: one ``/metrics`` body as Prometheus asks for it (``SharedExposition``, fast encoder,
     OpenMetrics, gzip), each a fresh collection — CPU ms (``time.process_time``: every thread);
   * ``floor``: what no exporter of this data can skip — read every container's ``devices.list`` and
     ``cgroup.procs`` once in Python (plain ``open``/``read``) and gzip (level 1, the level accelstats
     uses) the same OpenMetrics body — CPU ms.

   It prints both p50s, their ratio, the median of the scrape-by-scrape ratios, and microseconds per
   container above the 1 x 10 host's cost (flat = cost linear in containers); then, for 8 x 1000, the
   parts of a scrape timed alone: a collection, of it the attribution, the encoding, gzip, the floor's reads.
2. Accounting at 8 x 1000 (benchmarks/accounting.py ``overhead``: one GPU process per container, off and
   on alternated): the CPU added per scrape.
3. Beside nvitop-exporter (benchmarks/peers.py ``compare``: 1 GPU, exec → first answer, CPU per scrape,
   RSS) when ``nvitop_exporter`` is importable (``pip install nvitop-exporter``), else a line saying so.

Usage: ``python3 benchmarks/scale.py [--scrapes 40] [--skip-peers] [--tree auto|cgroupfs|tmp]`` from a
checkout with the Quick start's ``.venv`` (run it with ``.venv/bin/python``). No pass/fail: figures for
docs/performance.md, compared within one run (issue 29's goals: 8 x 1000 ≤ 2 x the floor, per-container
cost flat from 100 to 5000, accounting ≤ +10 %, start-up ≤ nvitop-exporter's).
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import importlib.util
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from accounting import overhead
from exposition import PROMETHEUS_ACCEPT, cpu_ms
from peers import compare
from scrape import build_host, cgroupfs_host, default_shared, devices_hierarchy, loadavg, machine

from accelstats.manager import AcceleratorManager
from accelstats.web.app import ServerCounters, SharedExposition
from accelstats.web.exposition import OPENMETRICS
from collectors.replay.lib import open_replay

HOSTS = ((1, 10), (8, 100), (8, 1000), (8, 5000))


def floor(containers: list[str], body: bytes) -> None:
    """The unavoidable work of one scrape: each container's ``devices.list`` and ``cgroup.procs`` read
    once, and ``body`` gzipped at level 1."""
    for directory in containers:
        for name in ("devices.list", "cgroup.procs"):
            fd = os.open(f"{directory}/{name}", os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.read(fd, 65536)
            finally:
                os.close(fd)
    gzip.compress(body, compresslevel=1)


def host(gpus: int, containers: int, scrapes: int, capture: Path, tree: str,
         parts: bool = False) -> dict[str, list[float]]:
    """CPU ms per scrape of ``accelstats`` and ``floor`` on one host, interleaved (module docstring);
    ``tree``: ``cgroupfs`` (real cgroups, :func:`scrape.cgroupfs_host`) or ``tmp`` (files in a temporary
    directory, :func:`scrape.build_host`); ``parts``: also the scrape's parts, timed alone (collection,
    attribution, encoding, gzip, the floor's reads)."""
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        if tree == "cgroupfs":
            settings = stack.enter_context(cgroupfs_host(Path(tmp), capture, gpus, containers))
        else:
            settings = build_host(Path(tmp), capture, gpus, containers)
        assert settings.nvml_replay is not None
        dirs = [str(d) for d in sorted((settings.cgroup_root / "devices" / "docker").iterdir()) if d.is_dir()]
        with AcceleratorManager(settings, open_replay(settings.nvml_replay)) as manager:
            shared = SharedExposition(manager, extra=[ServerCounters()], fast=True)
            for _ in range(3):  # warm-up: NVML's slow values, label caches
                shared.body(PROMETHEUS_ACCEPT, "gzip")
            body, _ = shared.body(PROMETHEUS_ACCEPT, "")
            times: dict[str, list[float]] = {"accelstats": [], "floor": []}
            for _ in range(scrapes):
                times["accelstats"].append(cpu_ms(lambda: shared.body(PROMETHEUS_ACCEPT, "gzip")))
                times["floor"].append(cpu_ms(lambda: floor(dirs, body)))
            if parts:  # where a scrape's time goes, part by part, interleaved as above
                assert shared.fast is not None
                encoder, attributor = shared.fast, manager._attributor
                assert attributor is not None
                for _ in range(scrapes):
                    collection = manager.collect()
                    times.setdefault("collection", []).append(cpu_ms(manager.collect))
                    times.setdefault("of it, attribution", []).append(
                        cpu_ms(lambda c=collection: attributor.attribute(c.snapshot)))
                    times.setdefault("encoding (fast encoder, OpenMetrics)", []).append(
                        cpu_ms(lambda c=collection: encoder.encode(c, OPENMETRICS)))
                    times.setdefault("gzip level 1 of the body", []).append(
                        cpu_ms(lambda: gzip.compress(body, compresslevel=1)))
                    times.setdefault("floor: the reads alone", []).append(cpu_ms(lambda: floor(dirs, b"")))
    return times


def main() -> None:
    """Run the three parts and print the figures (module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scrapes", type=int, default=40, help="scrapes per host (8 x 5000: a quarter)")
    parser.add_argument("--shared", type=Path, default=default_shared())
    parser.add_argument("--skip-peers", action="store_true", help="leave out the nvitop-exporter comparison")
    parser.add_argument("--tree", choices=("auto", "cgroupfs", "tmp"), default="auto",
                        help="where the containers' cgroups are: real cgroupfs (root, a v1 devices hierarchy), "
                             "a temporary directory, or cgroupfs when this process can (default)")
    args = parser.parse_args()
    tree = args.tree if args.tree != "auto" else ("cgroupfs" if devices_hierarchy() is not None else "tmp")
    logging.basicConfig(level=logging.ERROR)
    capture = args.shared / "fixtures" / "h200" / "nvidia-smi-q.xml"
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} {machine()} {loadavg()} scrapes={args.scrapes} "
          f"tree={tree}")
    print("\n## a scrape as Prometheus asks (OpenMetrics + gzip), CPU ms p50, beside the floor")
    print(f"{'host':>10} {'accelstats':>11} {'floor':>8} {'ratio':>6} {'pairwise':>9} {'us/container':>13}")
    base: float | None = None
    profile: dict[str, float] = {}
    for gpus, containers in HOSTS:
        n = max(5, args.scrapes // 4) if containers >= 5000 else args.scrapes
        times = host(gpus, containers, n, capture, tree, parts=containers == 1000)
        a, f = statistics.median(times["accelstats"]), statistics.median(times["floor"])
        if containers == 1000:
            profile = {k: statistics.median(v) for k, v in times.items() if k not in ("accelstats", "floor")}
        pairwise = statistics.median(x / y for x, y in zip(times["accelstats"], times["floor"], strict=True))
        base = a if base is None else base
        per = "" if containers == 10 else f"{(a - base) * 1000 / (containers - 10):13.1f}"
        print(f"{gpus:>3} x {containers:<4} {a:11.2f} {f:8.2f} {a / f:6.2f} {pairwise:9.2f} {per}")
        sys.stdout.flush()
    print("\n## 8 x 1000: where a scrape's time goes, each part timed alone, CPU ms p50")
    for key, value in profile.items():
        print(f"{key:>40} {value:8.2f}")
    print("\n## accounting at 8 x 1000 (one GPU process per container), CPU ms p50 per scrape")
    r = overhead(capture, 8, 1000, args.scrapes, 15, 10)
    print(f"off {r.off_ms:.2f}  on {r.on_ms:.2f}  added {100 * (r.on_ms / r.off_ms - 1):+.1f} % "
          f"(scrape-by-scrape: {100 * (r.pair_ratio - 1):+.1f} %)")
    sys.stdout.flush()
    print("\n## beside nvitop-exporter (1 GPU; accelstats also attributes 10 containers), medians of 3 rounds")
    if args.skip_peers:
        print("skipped (--skip-peers)")
        return
    if importlib.util.find_spec("nvitop_exporter") is None:
        print("nvitop-exporter is not installed in this environment: `pip install nvitop-exporter` to compare")
        return
    results = compare(capture, 3, 20, 0.5)
    keys = list(next(iter(results.values())))
    print(f"{'':<16}" + "".join(f"{k:>22}" for k in keys))
    for name, figures in results.items():
        print(f"{name:<16}" + "".join(f"{statistics.median(figures[k]):>22.2f}" for k in keys))
    a_, n_ = results["accelstats"], results["nvitop-exporter"]
    for key in ("first answer ms", "CPU ms per scrape", "RSS MiB"):
        print(f"accelstats / nvitop-exporter, {key}: {statistics.median(a_[key]) / statistics.median(n_[key]):.2f}")


if __name__ == "__main__":
    main()
