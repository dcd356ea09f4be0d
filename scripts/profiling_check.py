#!/usr/bin/env python3
"""On a GPU host: GPM profiling metrics and NVLink through accelstats' own sampler, under real load
(scripts/gpu-check.sh runs it; docs/gpu-check.md records the answer).

Reads GPU 0 with :class:`collectors.nvidia.NvidiaBackend` (``profiling_interval`` 1 s: the same
background sampler ``accelstats serve`` runs) through three phases, each ``--seconds`` long, a child
process doing the work on GPU 0 with torch:

| phase | child | expected |
|---|---|---|
| idle | none | tensor and DRAM activity near 0 |
| matmul | bf16 8192 x 8192 products (tensor cores) | ``tensor_active{pipe="any"}`` >= idle + 0.2, above copy |
| copy | 2 GiB device-to-device copies (memory-bound) | ``dram_active`` >= idle + 0.2; tensor below 0.2 |

It prints one Markdown section: per phase the mean of each profiling family over the readings taken
in the phase's second half (GPM averages over the interval between two samples, so the first
readings of a phase still hold the previous one), the profiling state, and every NVLink link's state
and counters (recorded, not judged: an H200 PCIe card has none). Exit 0 when both rises are seen.

``--nvml-replay FILE`` runs the same code over the replay (no torch: the phases only sleep, and the
rises cannot be seen; the section says so and the exit status is 0 when readings came through), to try
the script on a machine without a GPU. Read-only: it changes no GPU setting.

Usage: ``python3 scripts/profiling_check.py [--seconds 12] [--nvml-replay FILE]``.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from collectors.model import DeviceSample, DeviceSnapshot
from collectors.nvidia import NvidiaBackend

MATMUL = ("import sys, time, torch\n"
          "a = torch.randn(8192, 8192, device='cuda', dtype=torch.bfloat16)\n"
          "b = torch.randn(8192, 8192, device='cuda', dtype=torch.bfloat16)\n"
          "end = time.time() + float(sys.argv[1])\n"
          "while time.time() < end:\n"
          "    for _ in range(20):\n"
          "        c = a @ b\n"
          "    torch.cuda.synchronize()\n")
COPY = ("import sys, time, torch\n"
        "x = torch.empty(512 << 20, device='cuda', dtype=torch.float32)\n"  # 2 GiB
        "y = torch.empty_like(x)\n"
        "end = time.time() + float(sys.argv[1])\n"
        "while time.time() < end:\n"
        "    for _ in range(10):\n"
        "        y.copy_(x)\n"
        "    torch.cuda.synchronize()\n")
PHASES = (("idle", None), ("matmul", MATMUL), ("copy", COPY))
SHOWN = (("sm_active", ""), ("sm_occupancy", ""), ("graphics_engine_active", ""), ("tensor_active", "any"),
         ("tensor_active", "hmma"), ("dram_active", ""), ("pipe_active", "fp32"), ("pipe_active", "fp16"))
RISE = 0.2  # the ratio a phase's activity must rise above idle by


def read(backend: NvidiaBackend, uuid: str) -> DeviceSample | None:
    snap = DeviceSnapshot()
    backend.update(snap)
    return snap.samples.get(uuid)


def phase(backend: NvidiaBackend, uuid: str, code: str | None, seconds: float) -> tuple[list[DeviceSample], str]:
    """Run ``code`` in a child for ``seconds`` (None: stay idle) and read the GPU every second;
    returns the readings of the phase's second half and what went wrong with the child ("" if nothing)."""
    child = subprocess.Popen([sys.executable, "-c", code, str(seconds)], stderr=subprocess.PIPE,
                             text=True) if code is not None else None
    start = time.monotonic()
    kept: list[DeviceSample] = []
    while time.monotonic() - start < seconds:
        time.sleep(1.0)
        sample = read(backend, uuid)
        if sample is not None and time.monotonic() - start >= seconds / 2:
            kept.append(sample)
    problem = ""
    if child is not None:
        try:
            _, err = child.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            child.kill()
            _, err = child.communicate()
        if child.returncode != 0:
            problem = f"child exited {child.returncode}: {(err or '').strip().splitlines()[-1:]}"
    return kept, problem


def mean(samples: list[DeviceSample], key: str, label: str) -> float | None:
    values = [v for s in samples for k, lab, v in s.profiling if k == key and lab == label]
    return statistics.fmean(values) if values else None


def fmt(value: float | None) -> str:
    return "absent" if value is None else f"{value:.3f}"


def main() -> int:
    """Run the check and print its section (module docstring)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seconds", type=float, default=12.0)
    parser.add_argument("--nvml-replay", type=Path, default=None)
    args = parser.parse_args()
    nvml: Any = None
    if args.nvml_replay is not None:
        from collectors.replay.lib import open_replay

        nvml = open_replay(args.nvml_replay)
    backend = NvidiaBackend(nvml, pcie_interval=0, profiling_interval=1.0)
    print("\n### GPM profiling and NVLink under load (scripts/profiling_check.py)\n")
    if not backend.setup():
        print(f"NVML not usable: {backend.status}")
        return 1
    try:
        gpu = next(d for d in backend.devices() if d.kind == "gpu")
        print(f"GPU 0: {gpu.name} ({gpu.uuid}), driver {backend.driver_version}, "
              f"source {backend.source}, {args.seconds:g} s per phase\n")
        means: dict[str, dict[tuple[str, str], float | None]] = {}
        states: dict[str, set[tuple[str, str]]] = {}
        last: DeviceSample | None = None
        problems = []
        for name, code in PHASES:
            samples, problem = phase(backend, gpu.uuid, code if nvml is None else None, args.seconds)
            if problem:
                problems.append(f"{name}: {problem}")
            means[name] = {key: mean(samples, *key) for key in SHOWN}
            states[name] = {s.profiling_state for s in samples}
            last = samples[-1] if samples else last
        print("| family | " + " | ".join(n for n, _ in PHASES) + " |")
        print("|---|" + "---|" * len(PHASES))
        for key, label in SHOWN:
            fam = f"accelstats_gpu_{key}_ratio" + (f'{{pipe="{label}"}}' if label else "")
            print(f"| `{fam}` | " + " | ".join(fmt(means[n][(key, label)]) for n, _ in PHASES) + " |")
        print("\nprofiling state per phase: " + "; ".join(f"{n}: {sorted(states[n])}" for n, _ in PHASES))
        links = last.nvlinks if last is not None else ()
        print(f"\nNVLink: {len(links)} link(s)" + ("" if links else " (none: NVML answers no link count)"))
        for link in links:
            print(f"- link {link.link}: up={link.up} data={dict(link.data_bytes)} errors={dict(link.errors)}")
        for p in problems:
            print(f"\nproblem: {p}")
        if nvml is not None:
            ok = any(means[n][("sm_active", "")] is not None for n, _ in PHASES)
            print(f"\nreplay: no load was run, so no rise can be seen; readings came through: {ok}")
            return 0 if ok else 1
        idle, mm, cp = means["idle"], means["matmul"], means["copy"]
        tensor = [m[("tensor_active", "any")] for m in (idle, mm, cp)]
        dram = [m[("dram_active", "")] for m in (idle, mm, cp)]
        tensor_rose = None not in tensor and tensor[1] >= tensor[0] + RISE and tensor[1] > tensor[2]  # type: ignore[operator]
        dram_rose = None not in dram and dram[2] >= dram[0] + RISE  # type: ignore[operator]
        tensor_low_in_copy = tensor[2] is not None and tensor[2] < RISE
        print(f"\ntensor activity rose in the matmul phase (>= idle + {RISE}, above copy): "
              f"{'yes' if tensor_rose else 'NO'}; DRAM activity rose in the copy phase (>= idle + {RISE}): "
              f"{'yes' if dram_rose else 'NO'}; tensor stayed below {RISE} in the copy phase: "
              f"{'yes' if tensor_low_in_copy else 'NO'}")
        return 0 if tensor_rose and dram_rose and tensor_low_in_copy and not problems else 1
    finally:
        backend.close()


if __name__ == "__main__":
    sys.exit(main())
