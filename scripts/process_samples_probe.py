#!/usr/bin/env python3
"""On a GPU host: what ``nvmlDeviceGetProcessUtilization`` returns while a process keeps the GPU busy
(scripts/gpu-check.sh runs it; docs/gpu-check.md records the answer).

Per-container SM-seconds must integrate NVML's per-process samples exactly once, so accelstats has
to know what a sample is: one per process per call (the latest), or every sample newer than
``lastSeenTimeStamp``; how far apart their timestamps are; and how that compares with the device's
``nvmlDeviceGetSamples(NVML_GPU_UTILIZATION_SAMPLES)`` period. The probe starts a child that runs
matrix products on GPU 0 for ``--seconds`` (torch), then asks NVML with ``lastSeenTimeStamp`` 0 and
with the newest timestamp of a first call after a pause, and prints one Markdown section: samples
per PID, their timestamp spacing, the smUtil values, and the device's sample spacing. Exit 0 when
the child's PID was in the answer. Read-only: it changes no GPU setting.

Usage: ``python3 scripts/process_samples_probe.py [--seconds 4]`` (as root or the GPU's user).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import subprocess
import sys
import time
from typing import Any

import pynvml

BUSY = ("import sys, time, torch\n"
        "x = torch.randn(4096, 4096, device='cuda')\n"
        "end = time.time() + float(sys.argv[1])\n"
        "while time.time() < end:\n"
        "    x = (x @ x).clamp_(-1, 1)\n"
        "    torch.cuda.synchronize()\n")


def spacing_ms(stamps: list[int]) -> str:
    """Median and range of the gaps between consecutive timestamps (µs) in ms."""
    gaps = [(b - a) / 1000 for a, b in itertools.pairwise(stamps)]
    if not gaps:
        return "no timestamp" if not stamps else "one timestamp"
    return f"median {statistics.median(gaps):.1f} ms (min {min(gaps):.1f}, max {max(gaps):.1f})"


def describe(samples: list[Any], pid: int) -> list[str]:
    """Summary lines of ``nvmlProcessUtilizationSample_t`` ``samples`` (µs timestamps, smUtil in %)
    for ``pid``: count, spacing, values."""
    mine = sorted((int(s.timeStamp), int(s.smUtil)) for s in samples if int(s.pid) == pid)
    pids = sorted({int(s.pid) for s in samples})
    return [f"{len(samples)} samples for PIDs {pids}; the busy child's: {len(mine)}",
            f"its timestamps: {spacing_ms([t for t, _ in mine])}",
            f"its smUtil: {[u for _, u in mine][:40]}"]


def main() -> int:
    """Run the probe and print its section (module docstring); 0 when the busy child was sampled."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0)
    args = parser.parse_args()
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        child = subprocess.Popen([sys.executable, "-c", BUSY, str(args.seconds)])
        try:
            time.sleep(args.seconds * 0.75)
            first = pynvml.nvmlDeviceGetProcessUtilization(handle, 0)
            newest = max((int(s.timeStamp) for s in first), default=0)
            time.sleep(args.seconds * 0.2)
            try:
                second = pynvml.nvmlDeviceGetProcessUtilization(handle, newest)
            except pynvml.NVMLError as exc:
                second, second_error = [], str(exc)
            else:
                second_error = ""
            try:
                _, device = pynvml.nvmlDeviceGetSamples(handle, pynvml.NVML_GPU_UTILIZATION_SAMPLES, 0)
                device_stamps = sorted(int(s.timeStamp) for s in device)
            except pynvml.NVMLError as exc:
                device_stamps = []
                print(f"nvmlDeviceGetSamples: {exc}")
        finally:
            child.wait(timeout=args.seconds + 60)
        print("\n### nvmlDeviceGetProcessUtilization while one process keeps GPU 0 busy\n")
        print(f"- busy child PID {child.pid}, exit {child.returncode}, {args.seconds:g} s of matrix products")
        for line in describe(first, child.pid):
            print(f"- lastSeenTimeStamp 0: {line}")
        if second_error:
            print(f"- lastSeenTimeStamp = newest of that answer, {args.seconds * 0.2:g} s later: {second_error}")
        else:
            for line in describe(second, child.pid):
                print(f"- lastSeenTimeStamp = newest of that answer, {args.seconds * 0.2:g} s later: {line}")
        print(f"- device GPU_UTILIZATION_SAMPLES: {len(device_stamps)} samples, {spacing_ms(device_stamps)}")
        return 0 if any(int(s.pid) == child.pid for s in first) else 1
    finally:
        pynvml.nvmlShutdown()


if __name__ == "__main__":
    sys.exit(main())
