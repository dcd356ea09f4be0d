#!/usr/bin/env python3
"""On a GPU host: the accounting sampler and ledger on live NVML, with a process that keeps GPU 0 busy
(scripts/gpu-check.sh runs it; docs/gpu-check.md records the answer).

Starts a child that runs matrix products on GPU 0 (torch) for ``--seconds``, reads GPU 0 with
:class:`collectors.procsampler.ProcessSampler` once per ``--interval`` on this thread, integrates with
:class:`accelstats.accounting.Ledger` (the child's cgroup from ``/proc/<pid>/cgroup`` is the
"container"), and prints one Markdown section: the child's SM-seconds against its wall time (a busy
loop should be near 1 per second), memory byte-seconds against ``usedGpuMemory`` x time, and energy
conservation (container share + idle + unattributed against the energy counter's growth). Exit 0
when the child was accounted (SM-seconds > 0) and energy is conserved to 1e-6. Read-only: it changes
no GPU setting.

Usage: ``python3 scripts/accounting_check.py [--seconds 12] [--interval 0.5]`` (as root or the GPU's user).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pynvml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from accelstats.accounting import Ledger
from accelstats.attribution.containers import AcceleratorStats, ContainerStats
from collectors.model import Device
from collectors.nvml_call import NvmlCaller
from collectors.procsampler import ProcessRound, ProcessSampler
from scripts.process_samples_probe import BUSY


def own_cgroup(pid: int) -> str | None:
    """The v2 (``0::``) cgroup path of ``pid``, or None."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    return next((line.split("::", 1)[1] for line in lines if line.startswith("0::")), None)


def main() -> int:
    """Run the check and print its section (module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=12.0)
    parser.add_argument("--interval", type=float, default=0.5)
    args = parser.parse_args()
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    uuid = pynvml.nvmlDeviceGetUUID(handle)
    uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
    child = subprocess.Popen([sys.executable, "-c", BUSY, str(args.seconds)])
    cgroup = own_cgroup(child.pid) or f"/accounting-check-{child.pid}"
    ledger = Ledger(SimpleNamespace(cgroup_of=lambda pid: cgroup if pid == child.pid else own_cgroup(pid),
                                    started_at=lambda c: None, alive=lambda c: True))
    energies: list[float] = []

    def sink(rounds: list[ProcessRound]) -> None:
        ledger.add_rounds(rounds)
        energies.extend(r.energy_joules for r in rounds if r.energy_joules is not None)

    sampler = ProcessSampler(NvmlCaller(pynvml), args.interval, sink)
    sampler.set_devices([(Device(uuid=uuid, index=0, minor=0, name="GPU 0"), handle)])
    started = time.monotonic()
    used: list[int] = []
    while child.poll() is None:
        for r in sampler.read_round():
            used += [u for pid, u in (r.memory or ()) if pid == child.pid and u is not None]
        time.sleep(args.interval)
    for _ in range(11):  # after the child: its last samples, and an energy reading to close the window
        sampler.read_round()
        time.sleep(args.interval)
    wall = time.monotonic() - started
    learnt = sampler.answer_shapes().get(uuid)
    container = ContainerStats(cgroup=cgroup, identity=None, accelerators=[AcceleratorStats(
        make="nvidia", model="", id=uuid, minor=0, index=0, attribution="devices_cgroup", memory_total_bytes=None,
        memory_used_bytes=None, duty_cycle=None, container_memory_used_bytes=None,
        container_sm_utilization_ratio=None, container_processes=None)])
    view = ledger.settle([container], lambda u: "0")
    pynvml.nvmlShutdown()
    mine = next((a for a in view.accounts if a.labels[0] == cgroup), None)
    (_, idle, unattributed), = view.devices or (("", 0.0, 0.0),)
    shares = sum(a.energy_joules for a in view.accounts)
    delta = energies[-1] - energies[0] if len(energies) > 1 else 0.0
    print("\n## Accounting on live NVML (scripts/accounting_check.py)\n")
    print(f"- busy child {args.seconds:g} s, reads every {args.interval:g} s, {wall:.1f} s in all, "
          f"{len(energies)} energy readings")
    if mine is None:
        print("- the child was never accounted: FAIL")
        return 1
    shape, period_us = learnt if learnt is not None else (None, None)
    print(f"- nvmlDeviceGetProcessUtilization's answer shape as the sampler learnt it (collectors/smsamples.py): "
          f"{shape or 'not learnt (no idle stretch before the child)'}; driver period seen: "
          f"{f'{period_us / 1000:.1f} ms' if period_us else 'none'}")
    print(f"- child SM-seconds {mine.sm_seconds:.2f} for {args.seconds:g} s of a busy loop "
          f"({mine.sm_seconds / args.seconds:.2f} per second)")
    mean_used = sum(used) / len(used) if used else 0
    print(f"- memory byte-seconds {mine.memory_byte_seconds:.4g}; mean usedGpuMemory {mean_used:.4g} B "
          f"x {args.seconds:g} s = {mean_used * args.seconds:.4g}")
    print(f"- energy: counter grew {delta:.1f} J; child share {mine.energy_joules:.1f} J, idle {idle:.1f} J, "
          f"unattributed {unattributed:.1f} J; sum {shares + idle + unattributed:.1f} J")
    conserved = abs(shares + idle + unattributed - delta) <= 1e-6 * max(1.0, delta)
    print(f"- energy conserved: {'yes' if conserved else 'NO'}")
    return 0 if mine.sm_seconds > 0 and conserved else 1


if __name__ == "__main__":
    sys.exit(main())
