"""Scrape cost: full collections + exposition over a synthetic cgroup v1 host and a replayed GPU fleet.

For each G GPUs (replayed from the H200 capture, minors 0..G-1) and N containers (docker cgroupfs
paths, each granted ``c 195:<i mod G> rw`` plus the usual runc defaults), builds the tree in a temp
directory, then times ``generate_latest`` on the exporter's registry (one collection + rendering +
encoding: what one ``/metrics`` scrape costs) and prints p50/p99 in milliseconds, followed by the
median of each part alone: ``collect`` (NVML replay + cgroup walk + devices.list reads),
``render`` (building metric families from the catalog) and ``encode`` (prometheus_client's
text encoder on those families).

Usage: ``python3 benchmarks/scrape.py [--scrapes 200] [--shared DIR]``. Figures are recorded in
docs/performance.md; there is no pass/fail here (machines are noisy; compare within one run).
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.exposition import generate_latest

from accelstats.config import Settings
from accelstats.exporter import make_registry, render
from accelstats.manager import AcceleratorManager
from collectors.nvml_replay import ReplayNVML

RUNC_DEFAULTS = ["c 1:3 rwm", "c 1:5 rwm", "c 1:7 rwm", "c 1:8 rwm", "c 1:9 rwm", "c 5:0 rwm", "c 5:2 rwm",
                 "c 136:* rwm", "c 10:200 rwm", "c 195:255 rw"]


def build_host(root: Path, capture: Path, gpus: int, containers: int) -> Settings:
    """Write a replay scenario of ``gpus`` GPUs and a v1 devices tree of ``containers`` containers."""
    lines = []
    for i in range(gpus):
        lines += ["[[gpu]]", f'capture = "{capture}"', f"index = {i}", f"minor = {i}",
                  f'uuid = "GPU-{i:08x}-0000-4000-8000-{secrets.token_hex(6)}"', ""]
    scenario = root / "scenario.toml"
    scenario.write_text("\n".join(lines))
    devices = root / "cgroup" / "devices"
    devices.mkdir(parents=True)
    (devices / "devices.list").write_text("a *:* rwm\n")
    for n in range(containers):
        d = devices / "docker" / secrets.token_hex(32)
        d.mkdir(parents=True)
        rules = ["b *:* m", "c *:* m", *RUNC_DEFAULTS, f"c 195:{n % gpus} rw"]
        (d / "devices.list").write_text("\n".join(rules) + "\n")
    (root / "proc").mkdir()
    return Settings(nvml_replay=scenario, cgroup_root=root / "cgroup", proc_root=root / "proc",
                    collectors=("nvidia",))


def time_scrapes(settings: Settings, scrapes: int) -> dict[str, float]:
    """Full scrapes (``generate_latest`` on the exporter's registry: collection + rendering +
    encoding), then the three parts timed alone, in milliseconds; plus the exposition size."""
    assert settings.nvml_replay is not None
    manager = AcceleratorManager(settings, ReplayNVML.from_path(settings.nvml_replay))
    manager.setup()
    registry = make_registry(manager)
    size = len(generate_latest(registry))  # warm-up
    full = _times(scrapes, lambda: generate_latest(registry))
    collect = _times(scrapes, manager.collect)
    collection = manager.collect()
    families = list(render(collection))
    render_ms = _times(scrapes, lambda: list(render(collection)))
    fixed = CollectorRegistry(auto_describe=False)
    fixed.register(_Fixed(families))
    encode = _times(scrapes, lambda: generate_latest(fixed))
    manager.destroy()
    return {"p50": _pct(full, 50), "p99": _pct(full, 99), "collect": _pct(collect, 50),
            "render": _pct(render_ms, 50), "encode": _pct(encode, 50), "bytes": size,
            "samples": sum(len(f.samples) for f in families)}


class _Fixed:
    """A collector that yields the same families every time (to time encoding alone)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def _times(n: int, fn: Callable[[], object]) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1000)
    out.sort()
    return out


def _pct(sorted_ms: list[float], pct: int) -> float:
    if pct == 50:
        return statistics.median(sorted_ms)
    return sorted_ms[min(len(sorted_ms) - 1, int(len(sorted_ms) * pct / 100))]


def default_shared() -> Path:
    """``$ACCELSTATS_SHARED``, ``../shared`` beside the repository, or the copies in ``tests/shared``."""
    root = Path(__file__).resolve().parents[1]
    env = os.environ.get("ACCELSTATS_SHARED")
    if env:
        return Path(env)
    return root.parent / "shared" if (root.parent / "shared" / "fixtures").is_dir() else root / "tests" / "shared"


def main() -> None:
    """Run every (G, N) case and print one line each."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scrapes", type=int, default=200)
    parser.add_argument("--shared", type=Path, default=default_shared(),
                        help="folder holding fixtures/ (default: ../shared, else tests/shared)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    capture = args.shared / "fixtures" / "h200" / "nvidia-smi-q.xml"
    print(f"# {time.strftime('%Y-%m-%d')} {platform.node()} {platform.processor() or platform.machine()} "
          f"cpus={os.cpu_count()} python={platform.python_version()} scrapes={args.scrapes}")
    print(f"{'GPUs':>4} {'containers':>10} {'p50 ms':>8} {'p99 ms':>8} | {'collect':>8} {'render':>7} "
          f"{'encode':>7} | {'samples':>7} {'bytes':>9}")
    for gpus in (1, 8):
        for containers in (10, 100, 1000):
            with tempfile.TemporaryDirectory() as tmp:
                settings = build_host(Path(tmp), capture, gpus, containers)
                r = time_scrapes(settings, args.scrapes)
            print(f"{gpus:>4} {containers:>10} {r['p50']:>8.2f} {r['p99']:>8.2f} | {r['collect']:>8.2f} "
                  f"{r['render']:>7.2f} {r['encode']:>7.2f} | {r['samples']:>7.0f} {r['bytes']:>9.0f}")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
