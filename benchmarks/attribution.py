"""Attribution cost at N containers, cgroup v1 (devices.list) and cgroup v2 (device programs), in one run.

Builds N real container cgroups twice on this host's kernel (root, a hybrid host: the v1 ``devices``
hierarchy and the cgroup2 mount):

* v1: ``/sys/fs/cgroup/devices/docker/<id>``, restricted with ``devices.deny a`` and runc's default
  rules plus ``c 195:<i mod G> rw`` written to ``devices.allow``;
* v2: ``<cgroup2>/docker/<id>``, each with its own ``BPF_CGROUP_DEVICE`` program allowing the same
  rules, in runc's code shape (``tests/support/bpf_util.py``), loaded and attached as runc does (one program
  per container, ``BPF_F_ALLOW_MULTI``);

then times the ``attribution`` step of :meth:`AcceleratorManager.collect` (walk, runtime state,
devices cgroup of every container, PID lists, per-container stats; NVML is the replay of G H200s)
alternately on each hierarchy, and prints p50/p99 in ms, the v2 ÷ v1 ratio of the medians, the
first v2 collection (program instructions read and evaluated) and how many programs were read.

Usage: ``sudo python3 benchmarks/attribution.py [--containers 1000] [--gpus 8] [--collections 40]``.
Figures go to docs/performance.md; nothing here passes or fails.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from scrape import default_shared, loadavg, machine, percentile, write_scenario
from support import bpf_util  # tests/support/bpf_util.py: the program generator and loader

from accelstats.manager import AcceleratorManager
from accelstats.settings import Settings
from collectors.replay.lib import open_replay

RUNC_DEFAULTS = [("c", 1, 3, "rwm"), ("c", 1, 5, "rwm"), ("c", 1, 7, "rwm"), ("c", 1, 8, "rwm"), ("c", 1, 9, "rwm"),
                 ("c", 5, 0, "rwm"), ("c", 5, 2, "rwm"), ("c", 136, None, "rwm"), ("c", 10, 200, "rwm"),
                 ("c", 195, 255, "rw")]
V1_ROOT = Path("/sys/fs/cgroup/devices")


def rules(minor: int) -> list[tuple[str, int | None, int | None, str]]:
    return [("c", None, None, "m"), ("b", None, None, "m"), *RUNC_DEFAULTS, ("c", 195, minor, "rw")]


def spell(rule: tuple[str, int | None, int | None, str]) -> str:
    t, major, minor, access = rule
    return f"{t} {'*' if major is None else major}:{'*' if minor is None else minor} {access}"


def build(n: int, gpus: int, unified: Path) -> tuple[list[Path], list[Path]]:
    """N restricted v1 cgroups and N v2 cgroups with a device program each; returns their directories."""
    v1, v2 = [], []
    codes = {m: bpf_util.runc_style([(*r, True) for r in rules(m)]) for m in range(gpus)}
    for i in range(n):
        cid = secrets.token_hex(32)
        d1 = V1_ROOT / "docker" / cid
        d1.mkdir(parents=True)
        v1.append(d1)
        (d1 / "devices.deny").write_text("a")
        for rule in rules(i % gpus):
            (d1 / "devices.allow").write_text(spell(rule))
        d2 = unified / "docker" / cid
        d2.mkdir(parents=True)
        v2.append(d2)
        fd = bpf_util.load_program(codes[i % gpus])
        try:
            bpf_util.attach(d2, fd)
        finally:
            os.close(fd)  # the attachment keeps the program
    return v1, v2


def attribution_ms(manager: AcceleratorManager) -> float:
    collection = manager.collect()
    result = next(r for r in collection.snapshot.collector_results if r.name == "attribution")
    assert result.success, result.error
    return result.duration_seconds * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--containers", type=int, default=1000)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--collections", type=int, default=40)
    parser.add_argument("--shared", type=Path, default=default_shared())
    args = parser.parse_args()
    unified = bpf_util.unified_root()
    if os.geteuid() != 0 or unified is None or not (V1_ROOT / "devices.list").is_file():
        sys.exit("needs root on a host with the v1 devices hierarchy and a cgroup2 mount (hybrid)")
    if unified == Path("/sys/fs/cgroup"):
        sys.exit("cgroup2 is mounted at /sys/fs/cgroup: run on a hybrid host (v1 devices + /sys/fs/cgroup/unified)")
    with tempfile.TemporaryDirectory() as tmp:
        scenario = write_scenario(Path(tmp) / "scenario.toml", args.shared / "fixtures/h200/nvidia-smi-q.xml",
                                  args.gpus)
        t0 = time.perf_counter()
        v1, v2 = [], []
        try:
            v1, v2 = build(args.containers, args.gpus, unified)
            built = time.perf_counter() - t0
            common = {"nvml_replay": scenario, "collectors": ("nvidia",), "rootfs": Path(tmp),
                      "open_fd_scan": True}
            m1 = AcceleratorManager(Settings(cgroup_root=Path("/sys/fs/cgroup"), **common),  # type: ignore[arg-type]
                                    open_replay(scenario))
            m2 = AcceleratorManager(Settings(cgroup_root=unified, **common),  # type: ignore[arg-type]
                                    open_replay(scenario))
            m1.setup()
            m2.setup()
            assert m1.layout is not None and m1.layout.devices_root == V1_ROOT
            assert m2.layout is not None and m2.layout.mode.value == "v2"
            first_v1 = attribution_ms(m1)
            first_v2 = attribution_ms(m2)
            attributor = m2._attributor  # the benchmark reports its cache's reads
            assert attributor is not None and attributor.programs is not None
            reads_after_first = attributor.programs.reads
            ours = [c for c in m2.collect().containers if c.cgroup.startswith("/docker/")]
            granted = sum(1 for c in ours if c.accelerators and c.accelerators[0].attribution == "devices_cgroup")
            t1, t2 = [], []
            for _ in range(args.collections):
                t1.append(attribution_ms(m1))
                t2.append(attribution_ms(m2))
            reads = attributor.programs.reads
            m1.destroy()
            m2.destroy()
        finally:
            for d in [*v2, *v1, unified / "docker", V1_ROOT / "docker"]:
                with contextlib.suppress(OSError):
                    d.rmdir()  # the two "docker" parents only if empty (nobody else's containers there)
    t1.sort()
    t2.sort()
    p50_1, p50_2 = statistics.median(t1), statistics.median(t2)
    print(f"# {machine()}, {loadavg()}")
    print(f"# {args.containers} containers, {args.gpus} GPUs (replay), {args.collections} collections each, "
          f"built in {built:.1f} s; v2 containers attributed by their device programs: {granted}")
    print(f"{'hierarchy':10} {'first ms':>9} {'p50 ms':>8} {'p99 ms':>8}")
    print(f"{'v1':10} {first_v1:9.2f} {p50_1:8.2f} {percentile(t1, 99):8.2f}")
    print(f"{'v2':10} {first_v2:9.2f} {p50_2:8.2f} {percentile(t2, 99):8.2f}")
    print(f"v2 / v1 (p50): {p50_2 / p50_1:.2f}; device programs read through bpf(2): {reads_after_first} in the "
          f"first collection, {reads - reads_after_first} in the {args.collections + 1} after")


if __name__ == "__main__":
    main()
