"""Host lookups of the accounting ledger that read files (I/O at the edge)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from accelstats.fsread import read_small
from accelstats.openfds import pids_in_cgroup, process_start_time


def oldest_process_start(directory: Path, proc_root: Path, clock: Callable[[], float] = time.monotonic) -> float | None:
    """Monotonic seconds at which the oldest process of the cgroup ``directory`` (and below) started,
    from ``cgroup.procs`` and field 22 of ``<proc_root>/<pid>/stat`` (clock ticks since boot, proc(5))
    against ``<proc_root>/uptime``; None when no process or time can be read. A host that was
    suspended skews it by the time asleep (CLOCK_MONOTONIC stops, boot time does not)."""
    pids, _ = pids_in_cgroup(directory)
    ticks = [t for t in (process_start_time(proc_root, pid) for pid in pids) if t is not None]
    uptime = read_small(proc_root / "uptime")
    if not ticks or uptime is None:
        return None
    try:
        since_boot = float(uptime.split()[0])
    except (ValueError, IndexError):
        return None
    return clock() - max(0.0, since_boot - min(ticks) / os.sysconf("SC_CLK_TCK"))
