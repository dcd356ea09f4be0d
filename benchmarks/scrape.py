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
import contextlib
import logging
import os
import platform
import secrets
import stat
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.exposition import generate_latest

from accelstats.cgroups.mode import detect_layout
from accelstats.manager import AcceleratorManager
from accelstats.settings import Settings
from accelstats.web.exposition import make_registry, render
from collectors.replay.lib import open_replay

RUNC_DEFAULTS = ["c 1:3 rwm", "c 1:5 rwm", "c 1:7 rwm", "c 1:8 rwm", "c 1:9 rwm", "c 5:0 rwm", "c 5:2 rwm",
                 "c 136:* rwm", "c 10:200 rwm", "c 195:255 rw"]


def write_scenario(path: Path, capture: Path, gpus: int) -> Path:
    """Write a replay scenario of ``gpus`` copies of ``capture`` (NVML indices and minors 0..gpus-1,
    fresh UUIDs) to ``path``; returns ``path``."""
    lines = []
    for i in range(gpus):
        lines += ["[[gpu]]", f'capture = "{capture}"', f"index = {i}", f"minor = {i}",
                  f'uuid = "GPU-{i:08x}-0000-4000-8000-{secrets.token_hex(6)}"', ""]
    path.write_text("\n".join(lines))
    return path


def build_host(root: Path, capture: Path | None, gpus: int, containers: int,
               minors: Sequence[int] | None = None) -> Settings:
    """Write a replay scenario of ``gpus`` GPUs and a v1 devices tree of ``containers`` containers,
    container n granted ``c 195:<minors[n mod len(minors)]> rw``.

    ``minors``: the GPUs' minor numbers (default 0..gpus-1, the replay's). ``capture`` None writes no
    scenario (``nvml_replay`` None: live NVML; pass the minors NVML reports, or the grants name
    devices the host does not have). Raises ValueError for an empty ``minors``."""
    minors = list(range(gpus)) if minors is None else list(minors)
    if not minors:
        raise ValueError("build_host: no GPU minor to grant")
    scenario = write_scenario(root / "scenario.toml", capture, gpus) if capture is not None else None
    devices = root / "cgroup" / "devices"
    devices.mkdir(parents=True)
    (devices / "devices.list").write_text("a *:* rwm\n")
    for n in range(containers):
        d = devices / "docker" / secrets.token_hex(32)
        d.mkdir(parents=True)
        rules = ["b *:* m", "c *:* m", *RUNC_DEFAULTS, f"c 195:{minors[n % len(minors)]} rw"]
        (d / "devices.list").write_text("\n".join(rules) + "\n")
        (d / "cgroup.procs").write_text("")
    (root / "proc").mkdir()
    return Settings(nvml_replay=scenario, cgroup_root=root / "cgroup", proc_root=root / "proc",
                    collectors=("nvidia",))


def devices_hierarchy() -> Path | None:
    """The mounted cgroup v1 ``devices`` hierarchy when this process may make cgroups in it (root), else
    None (:func:`accelstats.cgroups.mode.detect_layout` on this host)."""
    if os.geteuid() != 0:
        return None
    return detect_layout().devices_root


@contextlib.contextmanager
def cgroupfs_host(root: Path, capture: Path, gpus: int, containers: int) -> Iterator[Settings]:
    """:func:`build_host` on real cgroupfs: ``containers`` cgroups made in the host's v1 ``devices``
    hierarchy (under ``accelstats-bench-<hex>/docker``), their rules written through ``devices.deny`` /
    ``devices.allow`` as runc writes them, and that subtree bind-mounted at ``<root>/cgroup/devices``, so
    the exporter walks real kernfs (and reads with plain opens: accelstats/cgroups/plainreads.py). Removed
    again on exit. Needs root and a v1 ``devices`` hierarchy (:func:`devices_hierarchy`); raises
    RuntimeError without one."""
    hierarchy = devices_hierarchy()
    if hierarchy is None:
        raise RuntimeError("cgroupfs_host: needs root and a mounted cgroup v1 devices hierarchy")
    base = hierarchy / f"accelstats-bench-{secrets.token_hex(4)}"
    made: list[Path] = []
    mounted = root / "cgroup" / "devices"
    try:
        (base / "docker").mkdir(parents=True)
        for n in range(containers):
            d = base / "docker" / secrets.token_hex(32)
            d.mkdir()
            made.append(d)
            (d / "devices.deny").write_text("a")
            for rule in ["b *:* m", "c *:* m", *RUNC_DEFAULTS, f"c 195:{n % gpus} rw"]:
                (d / "devices.allow").write_text(rule)
        scenario = write_scenario(root / "scenario.toml", capture, gpus)
        mounted.mkdir(parents=True)
        (root / "proc").mkdir()
        subprocess.run(["mount", "--bind", str(base), str(mounted)], check=True)
        try:
            yield Settings(nvml_replay=scenario, cgroup_root=root / "cgroup", proc_root=root / "proc",
                           collectors=("nvidia",))
        finally:
            subprocess.run(["umount", str(mounted)], check=True)
    finally:
        for d in made:
            d.rmdir()
        for d in (base / "docker", base):
            if d.exists():
                d.rmdir()


def build_v2_host(root: Path, capture: Path, gpus: int = 8, containers: int = 100, gpu_processes: int = 200,
                  other_processes: int = 10_000, others_in_containers: bool = False) -> Settings:
    """A cgroup v2 host: ``containers`` docker containers (systemd driver) sharing ``gpu_processes``
    GPU processes, each holding its GPU's node open (a 195:<minor> node made with mknod in ``root``;
    a regular file when not root), and ``other_processes`` host processes that attribution must not
    touch. Every container process has ``/proc/<pid>/{cgroup,stat,fd/}`` in a fake proc root."""
    cg, proc, nodes = root / "cgroup", root / "proc", root / "dev"
    for d in (cg, proc, nodes):
        d.mkdir()
    (cg / "cgroup.controllers").write_text("cpu io memory pids\n")
    for minor in range(gpus):
        node = nodes / f"nvidia{minor}"
        try:
            os.mknod(node, stat.S_IFCHR | 0o600, os.makedev(195, minor))
        except PermissionError:
            node.write_text("")
    ids = [secrets.token_hex(32) for _ in range(containers)]
    members: dict[str, list[int]] = {cid: [] for cid in ids}
    lines = []
    pid = 100_000
    procs_of_gpu: dict[int, list[tuple[int, str]]] = {g: [] for g in range(gpus)}
    for n in range(gpu_processes):
        pid += 1
        cid, gpu = ids[n % containers], n % gpus
        members[cid].append(pid)
        procs_of_gpu[gpu].append((pid, cid))
    for i in range(gpus):
        lines += ["[[gpu]]", f'capture = "{capture}"', f"index = {i}", f"minor = {i}",
                  f'uuid = "GPU-{i:08x}-0000-4000-8000-{secrets.token_hex(6)}"']
        for p, _ in procs_of_gpu[i]:
            lines += ["[[gpu.process]]", f"pid = {p}", f"used_memory_bytes = {(p % 7 + 1) << 30}",
                      f"sm_utilization_percent = {p % 90}"]
        lines.append("")
    (root / "scenario.toml").write_text("\n".join(lines))
    for cid, pids in members.items():
        d = cg / "system.slice" / f"docker-{cid}.scope"
        d.mkdir(parents=True)
        (d / "cgroup.procs").write_text("".join(f"{p}\n" for p in pids))
    gpu_of = {p: g for g, entries in procs_of_gpu.items() for p, _ in entries}
    for cid, pids in members.items():
        for p in pids:
            _fake_process(proc, p, f"/system.slice/docker-{cid}.scope", [nodes / f"nvidia{gpu_of[p]}"])
    for n in range(other_processes):
        pid = 200_000 + n
        if others_in_containers:  # a busy container host: the other processes live in the containers
            cid = ids[n % containers]
            members[cid].append(pid)
            _fake_process(proc, pid, f"/system.slice/docker-{cid}.scope", [])
        else:
            _fake_process(proc, pid, "/system.slice/other.service", [])
    if others_in_containers:
        for cid, pids in members.items():
            (cg / "system.slice" / f"docker-{cid}.scope" / "cgroup.procs").write_text("".join(f"{p}\n" for p in pids))
    return Settings(nvml_replay=root / "scenario.toml", cgroup_root=cg, proc_root=proc, collectors=("nvidia",))


def _fake_process(proc: Path, pid: int, cgroup: str, open_nodes: list[Path]) -> None:
    d = proc / str(pid)
    (d / "fd").mkdir(parents=True)
    (d / "cgroup").write_text(f"0::{cgroup}\n")
    (d / "stat").write_text(f"{pid} (python3) S 1 " + " ".join(["0"] * 17) + f" {pid * 10} 0 0\n")
    for fd, node in enumerate(open_nodes, start=3):
        (d / "fd" / str(fd)).symlink_to(node)


def time_scrapes(settings: Settings, scrapes: int) -> dict[str, float]:
    """Full scrapes (``generate_latest`` on the exporter's registry: collection + rendering +
    encoding), then the three parts timed alone, in milliseconds; plus the exposition size."""
    assert settings.nvml_replay is not None
    manager = AcceleratorManager(settings, open_replay(settings.nvml_replay))
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
    attributor = manager._attributor
    scanner = attributor.scanner if attributor is not None else None
    fd_scans_before = scanner.scans if scanner is not None else 0
    manager.collect()
    fd_scans_last = (scanner.scans - fd_scans_before) if scanner is not None else 0
    manager.destroy()
    return {"p50": percentile(full, 50), "p99": percentile(full, 99), "collect": percentile(collect, 50),
            "render": percentile(render_ms, 50), "encode": percentile(encode, 50), "bytes": size,
            "samples": sum(len(f.samples) for f in families), "fd_scans_last": fd_scans_last,
            "containers_with_gpu": sum(1 for c in collection.containers if c.accelerators)}


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


def percentile(sorted_ms: list[float], pct: int) -> float:
    """The ``pct`` percentile of an ascending list (50: the median; else the nearest rank below)."""
    if pct == 50:
        return statistics.median(sorted_ms)
    return sorted_ms[min(len(sorted_ms) - 1, int(len(sorted_ms) * pct / 100))]


def machine() -> str:
    """One line naming the date, host, CPU model, CPU count and Python version."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: platform's answer below
        cpuinfo = ""
    names = [line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")]
    model = names[0] if names else (platform.processor() or platform.machine())
    return (f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')} {platform.node()} {model} cpus={os.cpu_count()} "
            f"python={platform.python_version()}")


def loadavg() -> str:
    """``load average: 1m 5m 15m`` (os.getloadavg): says whether other work shared the machine."""
    one, five, fifteen = os.getloadavg()
    return f"load average: {one:.2f} {five:.2f} {fifteen:.2f}"


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
    print("\ncgroup v2: 8 GPUs, 200 GPU processes in 100 containers (each holding its GPU's node open), "
          "10 000 other processes")
    print(f"{'others in':>16} {'p50 ms':>8} {'p99 ms':>8} | {'collect':>8} {'render':>7} {'encode':>7} | "
          f"{'samples':>7} {'containers':>10} {'fd scans in a steady scrape':>28}")
    for inside in (False, True):
        with tempfile.TemporaryDirectory() as tmp:
            settings = build_v2_host(Path(tmp), capture, others_in_containers=inside)
            r = time_scrapes(settings, args.scrapes)
        where = "the containers" if inside else "host services"
        print(f"{where:>16} {r['p50']:>8.2f} {r['p99']:>8.2f} | {r['collect']:>8.2f} {r['render']:>7.2f} "
              f"{r['encode']:>7.2f} | {r['samples']:>7.0f} {r['containers_with_gpu']:>10.0f} "
              f"{r['fd_scans_last']:>28.0f}")


if __name__ == "__main__":
    main()
