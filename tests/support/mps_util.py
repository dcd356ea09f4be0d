"""The MPS test double and the GPUs the MPS tests run it with (tests/support/mps_double), and process checks."""

from __future__ import annotations

import os
import time
from pathlib import Path

from accelstats.mps.rules import MpsGpu

DOUBLE_DIR = Path(__file__).resolve().parent / "mps_double"
DOUBLE = DOUBLE_DIR / "nvidia-cuda-mps-control"
H200_BYTES = 143771 * 1024 * 1024  # nvidia-smi -q on the H200 fixture host: FB Memory Usage, Total
UUID0 = "GPU-5f1c2a9e-0b7d-4c3e-9a61-2d8e4f7b9c10"  # the H200 fixture GPU
UUID1 = "GPU-0a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9"
UUID2 = "GPU-11111111-2222-3333-4444-555555555555"
GPU0 = MpsGpu(uuid=UUID0, index=0, memory_total_bytes=H200_BYTES, compute_capability="9.0", mig_enabled=False)
GPU1 = MpsGpu(uuid=UUID1, index=1, memory_total_bytes=H200_BYTES, compute_capability="9.0", mig_enabled=False)
GPU2 = MpsGpu(uuid=UUID2, index=2, memory_total_bytes=H200_BYTES, compute_capability="9.0", mig_enabled=False)
GPUS = [GPU0, GPU1, GPU2]


def proc_state(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(errors="replace")
    except OSError:
        return None
    return stat[stat.rfind(")") + 2:].split()[0]


def gone(pid: int, wait: float = 2.0) -> bool:
    """True once ``pid`` has exited (a zombie that is not ours counts: init reaps it)."""
    deadline = time.monotonic() + wait
    while True:
        state = proc_state(pid)
        if state is None or (state == "Z" and pid not in our_zombies()):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


def our_zombies() -> list[int]:
    """PIDs of this process's children that are zombies (nobody reaped them)."""
    me = os.getpid()
    zombies = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if fields[0] == "Z" and int(fields[1]) == me:
            zombies.append(int(entry.name))
    return zombies


def serving(root: Path) -> list[int]:
    """Live processes (daemons or hung commands) whose CUDA_MPS_PIPE_DIRECTORY is under ``root``."""
    prefix = b"CUDA_MPS_PIPE_DIRECTORY=" + os.fsencode(root)
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if any(var.startswith(prefix) for var in environ.split(b"\0")) and proc_state(int(entry.name)) != "Z":
            pids.append(int(entry.name))
    return pids
