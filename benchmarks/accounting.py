"""What GPU accounting costs: a scrape with and without it, and the background sampler's rounds.

Builds the 8 GPU x 1000 container host of ``benchmarks/scrape.py`` (cgroup v1, each container granted
one GPU) and gives every container one GPU process (replayed: SM 30 %, 1 GiB; ``/proc/<pid>/cgroup``
names the container), so every (container, GPU) pair has all five accounting counters. Then, in one
run, alternating the two exporters scrape by scrape, the CPU time of one ``/metrics`` body as the server
makes it for Prometheus (``SharedExposition`` with the fast encoder, OpenMetrics, gzip: collection +
rendering + encoding):

* ``off``: ``accounting_interval = 0`` (no sampler, no ledger, no accounting families);
* ``on``: ``accounting_interval = 1``, with ``--between`` sampler rounds (untimed, on this thread)
  before each scrape, so each settlement hands over what a 15 s scrape interval would.

and prints the medians, their ratio and the median of the scrape-by-scrape ratios (steadier on a
noisy machine), the samples added, and the median of one sampler round (every
device: process lists, process utilisation, energy every tenth round) over ``--rounds`` rounds.

Usage: ``python3 benchmarks/accounting.py [--scrapes 60] [--rounds 30]``. Figures are recorded in
docs/performance.md; no pass/fail here (compare within one run).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import platform
import secrets
import statistics
import tempfile
import time
from pathlib import Path

from exposition import PROMETHEUS_ACCEPT, cpu_ms
from scrape import build_host, default_shared

from accelstats.manager import AcceleratorManager
from accelstats.settings import Settings
from accelstats.web.app import ServerCounters, SharedExposition
from collectors.nvidia import NvidiaBackend
from collectors.replay.lib import open_replay

GIB = 1 << 30


def add_processes(settings: Settings, capture: Path, gpus: int) -> None:
    """Rewrite the scenario with one GPU process per container (PID 10000 + n on GPU n mod ``gpus``)
    and write each PID's ``/proc/<pid>/cgroup`` naming its container."""
    assert settings.nvml_replay is not None
    containers = sorted((settings.cgroup_root / "devices" / "docker").iterdir())
    per_gpu: dict[int, list[str]] = {i: [] for i in range(gpus)}
    for n, directory in enumerate(containers):
        gpu = int((directory / "devices.list").read_text().split("c 195:")[-1].split()[0])
        pid = 10_000 + n
        per_gpu[gpu].append(f"[[gpu.process]]\npid = {pid}\nused_memory_bytes = {GIB}\nsm_utilization_percent = 30\n")
        proc = settings.proc_root / str(pid)
        proc.mkdir()
        (proc / "cgroup").write_text(f"4:devices:/docker/{directory.name}\n0::/docker/{directory.name}\n")
    lines = []
    for i in range(gpus):
        lines += ["[[gpu]]", f'capture = "{capture}"', f"index = {i}", f"minor = {i}",
                  f'uuid = "GPU-{i:08x}-0000-4000-8000-{secrets.token_hex(6)}"', *per_gpu[i], ""]
    settings.nvml_replay.write_text("\n".join(lines))


def main() -> None:
    """Run the comparison and print it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scrapes", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--between", type=int, default=15,
                        help="sampler rounds before each scrape (15: a 15 s scrape interval at the 1 s default)")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--containers", type=int, default=1000)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    capture = default_shared() / "fixtures" / "h200" / "nvidia-smi-q.xml"
    print(f"# {time.strftime('%Y-%m-%d')} {platform.node()} cpus={os.cpu_count()} "
          f"python={platform.python_version()} {args.gpus} GPUs x {args.containers} containers, one GPU process each")
    with tempfile.TemporaryDirectory() as tmp:
        base = build_host(Path(tmp), capture, args.gpus, args.containers)
        add_processes(base, capture, args.gpus)
        assert base.nvml_replay is not None
        off = AcceleratorManager(dataclasses.replace(base, accounting_interval=0), open_replay(base.nvml_replay))
        on = AcceleratorManager(dataclasses.replace(base, accounting_interval=1.0), open_replay(base.nvml_replay))
        shared = {}
        for name, manager in (("off", off), ("on", on)):
            manager.setup()
            shared[name] = SharedExposition(manager, extra=[ServerCounters()], fast=True)
            for _ in range(3):  # warm-up: NVML set up, the sampler's first round done, label cache
                shared[name].body(PROMETHEUS_ACCEPT, "gzip")
        backend = next(c for c in on.collectors if isinstance(c, NvidiaBackend))
        sampler = backend.accounting
        assert sampler is not None
        sampler.stop()  # its rounds are timed below, on this thread
        assert sampler.wait_idle(10)
        round_ms = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            sampler.read_round()
            round_ms.append((time.perf_counter() - t0) * 1000)
        times: dict[str, list[float]] = {"off": [], "on": []}
        sizes = {name: len(s.body(PROMETHEUS_ACCEPT, "")[0]) for name, s in shared.items()}
        for _ in range(args.scrapes):
            for _ in range(args.between):  # what the sampler integrated since the previous scrape
                sampler.read_round()
            for name in ("off", "on"):
                times[name].append(cpu_ms(lambda s=shared[name]: s.body(PROMETHEUS_ACCEPT, "gzip")))
        collection = on.collect()
        accounts = len(collection.accounting.accounts) if collection.accounting is not None else 0
        for manager in (off, on):
            manager.destroy()
            manager.close()
    med = {name: statistics.median(v) for name, v in times.items()}
    pairs = statistics.median(on / off for off, on in zip(times["off"], times["on"], strict=True))
    print(f"/metrics CPU ms p50 (OpenMetrics, gzip, fast encoder): off {med['off']:.2f}  on {med['on']:.2f}  "
          f"added {100 * (med['on'] / med['off'] - 1):+.1f} % (median of the scrape-by-scrape ratios: "
          f"{100 * (pairs - 1):+.1f} %)")
    print(f"body bytes (uncompressed): off {sizes['off']}  on {sizes['on']}  ((container, GPU) accounts: {accounts})")
    print(f"sampler round ms (every GPU once, in the background): median {statistics.median(round_ms):.2f}  "
          f"max {max(round_ms):.2f}")


if __name__ == "__main__":
    main()
